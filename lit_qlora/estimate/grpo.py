"""`litqlora estimate --method grpo`: `litqlora grpo`'s memory, in its two phases.

- Training: micro_batch_size completion rows of max_seq_length tokens (prompt + completion, the worst case) through
  one forward and backward, the log-probabilities a chunk of head logits at a time: the SFT step's trace at that
  batch (lit_qlora.estimate.step), whose chunked loss is the same size. The reference pass (--grpo.beta > 0) is a
  no-grad forward of the same rows, under the training step's peak (no activations kept for backward).
- Sampling: num_generations rows decoding with the KV cache (one prefill of the prompt, copied to every row), beside
  the weights, the adapters and the optimizer state (gradients are freed between steps): the cache of
  num_generations x max_seq_length positions, and the decode step's logits over the vocabulary with what sampling
  makes of them (fp32 logits, probabilities, their sorted copy and its int64 order for top_p).

The run's peak is the larger of the two."""

from __future__ import annotations

from typing import Any

# The categories that stay allocated while the rollouts are sampled.
PERSISTENT = ("frozen base", "embeddings and norms", "LoRA weights", "optimizer state")
# Bytes per vocabulary entry per row in a decode step: fp32 logits, probabilities and sorted probabilities, int64 order.
DECODE_BYTES_PER_LOGIT = 4 + 4 + 4 + 8


def kv_cache_bytes(config: Any, rows: int, length: int, dtype_bytes: int) -> int:
    """The KV cache `rows` sequences of `length` positions need (keys and values of every layer)."""
    return rows * length * config.n_layer * 2 * config.n_query_groups * config.head_dim * dtype_bytes


def sampling_phase(config: Any, grpo: Any, by_category: dict[str, int], max_seq_length: int,
                   dtype_bytes: int) -> dict[str, int]:
    """The sampling phase's bytes on a rank: what stays allocated, the rollouts' KV cache and a decode step's logits."""
    kv = kv_cache_bytes(config, grpo.num_generations, max_seq_length, dtype_bytes)
    logits = grpo.num_generations * config.vocab_size * DECODE_BYTES_PER_LOGIT
    persistent = sum(by_category.get(name, 0) for name in PERSISTENT)
    return {"persistent_bytes": persistent, "kv_cache_bytes": kv, "decode_logits_bytes": logits,
            "sampling_peak_bytes": persistent + kv + logits}


def render_grpo(result: dict[str, Any]) -> list[str]:
    """The report's lines on a grpo run: both phases and which sets the peak."""
    from lit_qlora.estimate.cards import GiB

    g = result["grpo"]
    return ["", f"Method grpo: {g['num_generations']} completions per prompt; the peak is the larger of two phases",
            f"  training: micro-batch {result['micro_batch_size']} completions of {result['max_seq_length']} tokens "
            f"(the table above): {g['training_peak_bytes'] / GiB:.3f} GiB"
            + ("; the reference's no-grad forward (beta > 0) stays under it" if g["reference_pass"] else ""),
            f"  sampling: {g['num_generations']} rows with the KV cache, {g['kv_cache_bytes'] / GiB:.3f} GiB of cache "
            f"and {g['decode_logits_bytes'] / GiB:.3f} GiB of decode logits beside "
            f"{g['persistent_bytes'] / GiB:.3f} GiB of weights, adapters and optimizer state: "
            f"{g['sampling_peak_bytes'] / GiB:.3f} GiB",
            f"  the peak is set by {g['sets_the_peak']}"]
