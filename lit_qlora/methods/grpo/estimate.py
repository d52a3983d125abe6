"""`litqlora estimate --method grpo`: `litqlora grpo`'s memory, in its two phases.

- Training: `GRPOStep`, GRPO's own micro-batch on the fake tensors of `estimate.step.trace_step`: micro_batch_size
  rows of max_seq_length tokens (prompt + completion, the worst case), each with max_completion_length completion
  tokens (every completion runs to the cap), through `completion_logps` (the head a chunk of log-probabilities at a
  time, lit_qlora.train.policy), `token_terms` and `micro_loss`, then backward, clipping and AdamW; the kept
  log-probabilities (old, reference) are a float per completion token.
- Sampling: num_generations rows decoding with the KV cache (one prefill of the prompt, copied to every row), beside
  the weights, the adapters and the optimizer state (gradients are freed between steps): the cache of
  num_generations x max_seq_length positions, and the decode step's logits over the vocabulary with what sampling
  makes of them (the head's output, fp32 logits, probabilities, their sorted copy and its int64 order for top_p).
  With --grpo.beta > 0 or num_iterations > 1, once the cache is freed, the no-grad forwards that keep the reference's
  and the sampling policy's log-probabilities (a micro-batch of rows at a time; traced by `GRPOStep`): the phase
  takes the larger.

Measured against a real run (benchmarks/grpo/estimate_accuracy.py, SmolLM2-135M QLoRA on a CPU): the peak 1.000 of
the measured in every row, the sampling phase 0.997-1.000.

The run's peak is the larger of the two."""

from __future__ import annotations

from typing import Any

# The categories that stay allocated while the rollouts are sampled.
PERSISTENT = ("frozen base", "embeddings and norms", "LoRA weights", "optimizer state")
# Bytes per vocabulary entry per row in a decode step beside the head's output (in the compute dtype): fp32 logits,
# probabilities and sorted probabilities, int64 order.
DECODE_BYTES_PER_LOGIT = 4 + 4 + 4 + 8


class GRPOStep:
    """`litqlora grpo`'s training micro-batch on fake tensors, for `trace_step` (the interface of
    lit_qlora.methods.dpo.estimate.PreferenceStep): `prepare` (under the fake mode, before the trace counts),
    `before_training`, `loss` and `backward` (inside it)."""

    def __init__(self, grpo: Any) -> None:
        self.grpo = grpo
        self.fixed_pass_bytes = 0
        self._args: tuple = ()
        self._trace: Any = None

    def prepare(self, model: Any, rows: int, length: int, phase: Any, trace: Any, init_adapter: bool) -> None:
        """The batch as `completion_batch` makes it: `rows` rows of `length` tokens, the last C of each a completion
        (C: max_completion_length, at most length - 1)."""
        import torch

        completion = max(1, min(self.grpo.max_completion_length, length - 1))
        ids = torch.zeros(rows, length, dtype=torch.long)
        src = (torch.arange(length - completion - 1, length - 1)[None, :] + length * torch.arange(rows)[:, None])
        batch = {"input_ids": ids, "src": src.reshape(-1), "tgt": torch.zeros(rows * completion, dtype=torch.long),
                 "mask": torch.ones(rows, completion, dtype=torch.bool)}
        self._args, self._trace = (model, batch, rows, completion, phase), trace

    def before_training(self) -> None:
        """With --grpo.beta > 0 or num_iterations > 1, the no-grad forwards that keep the rollouts' reference and old
        log-probabilities (`GRPOModule.fixed_logps`, after the sampling, a micro-batch at a time): one traced here;
        `fixed_pass_bytes` is what it allocates above what was live (the sampling phase's other candidate)."""
        import torch

        from lit_qlora.methods.dpo.estimate import _peak_within, every_position_trained
        from lit_qlora.methods.grpo.module import completion_logps

        if not (self.grpo.uses_reference or self.grpo.num_iterations > 1):
            return
        model, batch, _, _, phase = self._args
        phase.phase = "reference"
        trace = self._trace
        with _peak_within(trace) as found, every_position_trained(), torch.no_grad():
            completion_logps(model, batch, self.grpo.temperature)
        self.fixed_pass_bytes = found["bytes"]

    def loss(self) -> Any:
        """One micro-batch's part of the step's loss, as `train_on` builds it."""
        import torch

        from lit_qlora.methods.dpo.estimate import every_position_trained
        from lit_qlora.methods.grpo.loss import StepCounts, micro_loss, token_terms
        from lit_qlora.methods.grpo.module import completion_logps

        model, batch, rows, completion, phase = self._args
        g = self.grpo
        phase.phase = "forward"
        with every_position_trained():  # (logsumexp allocates what its kernel does)
            logps = completion_logps(model, batch, g.temperature)
            kept = torch.zeros_like(logps)  # old and reference log-probs: kept from the rollouts, a float a token
            terms = token_terms(logps, logps.detach() if g.num_iterations == 1 else kept, kept if g.uses_reference else None,
                                torch.zeros(rows), batch["mask"], g.epsilon, g.eps_high, g.beta)
            counts = StepCounts(float(rows), float(rows * completion), 1.0, g.max_completion_length)
            return micro_loss(terms, batch["mask"], g.loss_type, counts)

    def backward(self, loss: Any) -> None:
        from lit_qlora.methods.dpo.estimate import every_position_trained

        with every_position_trained():
            loss.backward()


def kv_cache_bytes(config: Any, rows: int, length: int, dtype_bytes: int) -> int:
    """The KV cache `rows` sequences of `length` positions need (keys and values of every layer)."""
    return rows * length * config.n_layer * 2 * config.n_query_groups * config.head_dim * dtype_bytes


def kept_cache_bytes(config: Any, grpo: Any, max_seq_length: int, dtype_bytes: int, device: str) -> int:
    """--grpo.compile_decode on CUDA keeps the groups' KV cache (and validation's one row's) between groups for its
    CUDA graphs, through training too; 0 otherwise."""
    if not (grpo.compile_decode and device == "cuda"):
        return 0
    return kv_cache_bytes(config, grpo.num_generations + 1, max_seq_length, dtype_bytes)


def sampling_phase(config: Any, grpo: Any, by_category: dict[str, int], max_seq_length: int,
                   dtype_bytes: int, fixed_pass_bytes: int = 0, kept_bytes: int = 0) -> dict[str, int]:
    """The sampling phase's bytes on a rank: what stays allocated, and the larger of the rollouts' decoding (their KV
    cache and a decode step's logits) and the no-grad pass that keeps their log-probabilities (`fixed_pass_bytes`,
    GRPOStep's; 0 without beta or num_iterations > 1), which runs after the cache is freed. A kept cache
    (`kept_bytes`, `kept_cache_bytes`) stands for the group's and stays through that pass."""
    kv = kv_cache_bytes(config, grpo.num_generations, max_seq_length, dtype_bytes)
    logits = grpo.num_generations * config.vocab_size * (DECODE_BYTES_PER_LOGIT + dtype_bytes)  # + the head's own
    persistent = sum(by_category.get(name, 0) for name in PERSISTENT)
    peak = persistent + (kept_bytes + max(logits, fixed_pass_bytes) if kept_bytes else
                         max(kv + logits, fixed_pass_bytes))
    return {"persistent_bytes": persistent, "kv_cache_bytes": kv, "decode_logits_bytes": logits,
            "fixed_logps_pass_bytes": fixed_pass_bytes, "kept_kv_cache_bytes": kept_bytes,
            "sampling_peak_bytes": peak}


def render_grpo(result: dict[str, Any]) -> list[str]:
    """The report's lines on a grpo run: both phases and which sets the peak."""
    GiB = 2**30
    g = result["grpo"]
    return ["", f"Method grpo: {g['num_generations']} completions per prompt; the peak is the larger of two phases",
            f"  training: micro-batch {result['micro_batch_size']} completions of {result['max_seq_length']} tokens "
            f"(the table above): {g['training_peak_bytes'] / GiB:.3f} GiB"
            + (f", with --grpo.compile_decode's KV cache kept for its CUDA graphs "
               f"({g['kept_kv_cache_bytes'] / GiB:.3f} GiB)" if g.get("kept_kv_cache_bytes") else "")
            + ("; the reference's no-grad forward (beta > 0) stays under it" if g["reference_pass"] else ""),
            f"  sampling: {g['num_generations']} rows with the KV cache, {g['kv_cache_bytes'] / GiB:.3f} GiB of cache "
            f"and {g['decode_logits_bytes'] / GiB:.3f} GiB of decode logits beside "
            f"{g['persistent_bytes'] / GiB:.3f} GiB of weights, adapters and optimizer state"
            + (f" (or the kept log-probabilities' no-grad pass, {g['fixed_logps_pass_bytes'] / GiB:.3f} GiB, if larger)"
               if g.get("fixed_logps_pass_bytes") else "") + f": {g['sampling_peak_bytes'] / GiB:.3f} GiB",
            f"  the peak is set by {g['sets_the_peak']}"]
