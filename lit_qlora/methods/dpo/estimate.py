"""The step `litqlora estimate --method dpo` traces: `litqlora dpo`'s (lit_qlora.methods.dpo.module), on the fake
tensors of `estimate.step.trace_step`.

A micro-batch of B pairs is one forward and backward of B rows (each its prompt once, then its chosen and rejected
answers as branches: lit_qlora.data.preference.PairCollate) through the real `answer_logps` and `pair_sums`. The
reference is the same base with the adapters off (no second copy of the weights): with `--dpo.reference
adapters_off` its no-grad forward of the same rows (`reference_logps`) runs
before the policy's in every step; with `cached` the step looks up 2 floats per pair, and the forwards that fill the
table run once, before training (traced once before the first step, when only the weights are live); ORPO has no
reference. After `--train.init_adapter`, the reference is that adapter: its pass sets the training adapter aside (a
copy of the LoRA weights, counted).

Answer tokens: the worst case, as the SFT estimate takes it: no prompt to share (a row is two answers of
max_seq_length tokens each, 2 x max_seq_length in all) and every position trained (in a real run a pair's prompt is
computed once and never reaches the head)."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from lit_qlora.methods.dpo.args import DPOArgs

# torch and the preference package's step are imported inside the functions: the CLI imports `estimate` to build
# `--help` (lit_qlora.cli.commands says why and how).

SEQUENCES_PER_PAIR = 2  # chosen and rejected, branches of one row


def reference_pass(dpo: DPOArgs) -> Optional[str]:
    """When the reference's forward runs: 'every step' (adapters_off), 'once before training' (cached), or None
    (ORPO: no reference)."""
    if not dpo.kind.uses_reference:
        return None
    return "every step" if dpo.reference == "adapters_off" else "once before training"


class PreferenceStep:
    """`litqlora dpo`'s micro-batch on fake tensors, for `trace_step`: `prepare` (under the fake mode, before the trace
    counts), `before_training` and `loss` (inside it). Afterwards `reference_pass_bytes` is the most the reference's
    last pass allocated above what was live when it started (None: no pass; the first one also makes NF4 scratch
    buffers the later ones reuse), and `reference_pass_op` where it peaked."""

    def __init__(self, dpo: DPOArgs) -> None:
        self.dpo = dpo
        self.reference_pass_bytes: Optional[int] = None
        self.reference_pass_op = ""
        self._args: tuple = ()

    def prepare(self, model: Any, pairs: int, length: int, phase: Any, trace: Any, init_adapter: bool) -> None:
        """The batch (`pairs` rows of two `length`-token answers, every position trained) and, after
        --train.init_adapter, the starting adapter (host memory in a real run: made here, uncounted)."""
        import torch

        from lit_qlora.lora.layer import lora_modules
        from lit_qlora.methods.dpo.loss import Objective

        dpo = self.dpo
        row = SEQUENCES_PER_PAIR * length
        ids = torch.zeros(pairs, row, dtype=torch.long)
        # No shared prompt, and no positions: the row is traced as one causal sequence of 2 x length tokens, the
        # same activations as two documents of `length`. (Positions would build the dense (2L)^2 mask of CPU runs:
        # B x 4L^2 bytes, 36 MB at L = 3000, which would also make the peak quadratic in L for the length search;
        # on CUDA the mask is a flex_attention BlockMask, O(L).)
        src = torch.arange(pairs * row)
        seq = (torch.arange(row) >= length).long()[None, :] * pairs + torch.arange(pairs)[:, None]
        batch = {"input_ids": ids, "positions": None, "src": src, "tgt": torch.zeros_like(src),
                 "seq": seq.reshape(-1), "index": torch.arange(pairs)}
        start = None
        if init_adapter:
            start = {f"{name}.{leaf}": torch.zeros_like(getattr(layer, leaf))
                     for name, layer in lora_modules(model).items() for leaf in ("lora_A", "lora_B")}
        objective = Objective.from_args(dpo)
        self._args = (model, batch, start, objective, pairs, phase, trace)

    def before_training(self) -> None:
        """cached: the forwards that fill the table, before the first step (one micro-batch's stands for them all)."""
        if reference_pass(self.dpo) == "once before training":
            self._reference()

    def loss(self) -> Any:
        """One micro-batch's loss, as PreferenceModule.accumulate_gradients builds it (with this micro-batch's pairs
        and chosen tokens standing for the global batch's: the scale does not change what is allocated)."""
        import torch

        from lit_qlora.methods.dpo.loss import answer_logps, pair_sums

        model, batch, _, objective, pairs, phase, _ = self._args
        reference = None
        if reference_pass(self.dpo) == "every step":
            reference = self._reference()
        elif objective.uses_reference:  # cached: the table's rows of this micro-batch
            reference = torch.zeros(SEQUENCES_PER_PAIR * pairs, dtype=torch.float32)
        phase.phase = "forward"
        with every_position_trained():
            logps, counts = answer_logps(model, batch)
            sums = pair_sums(objective, logps, counts, reference)
        return sums.pair_loss / pairs + sums.nll_sum / sums.chosen_tokens.clamp(min=1)

    def backward(self, loss: Any) -> None:
        with every_position_trained():  # the boolean selection's backward scatters through the same mask
            loss.backward()

    def _reference(self) -> Any:
        from lit_qlora.methods.dpo.reference import reference_logps

        model, batch, start, _, _, phase, trace = self._args
        phase.phase = "reference"
        with _peak_within(trace) as found, every_position_trained():
            logps = reference_logps(model, batch, start)
        self.reference_pass_bytes, self.reference_pass_op = found["bytes"], found["op"]  # the last: a steady step's
        return logps

def preference_section(step: PreferenceStep, objective: str, init_adapter: Any, pairs: int, peak_operation: str
                       ) -> dict[str, Any]:
    """estimate.json's `dpo` section: the objective, the step's sequences, and what the reference costs."""
    when = reference_pass(step.dpo)
    if when is None:
        model = "none: ORPO is reference-free"
    elif init_adapter is not None:
        model = ("the same base with the starting adapter (--train.init_adapter): +0 bytes of weights (its pass sets "
                 "the training adapter aside: a copy of the LoRA weights, in the pass's bytes)")
    else:
        model = "the same base, adapters off: +0 bytes of weights"
    return {"objective": objective, "loss": step.dpo.loss,
            "reference": step.dpo.reference if when else None, "sequences_per_micro_batch": SEQUENCES_PER_PAIR * pairs,
            "answer_tokens": "every position (the worst case, as for sft)", "reference_model": model,
            "reference_pass": when, "reference_pass_bytes": step.reference_pass_bytes,
            "reference_pass_peak_operation": step.reference_pass_op or None,
            "reference_pass_sets_the_peak": peak_operation.endswith("(reference)")}


def render_preference(result: dict[str, Any], batch: str) -> list[str]:
    """The report's lines on a dpo step (its micro-batch as `batch` names it): its sequences and its reference."""
    GiB = 2**30
    dpo = result["dpo"]
    lines = ["", f"Method dpo: {dpo['objective']}",
             f"  micro-batch {batch} of {result['max_seq_length']} tokens in one forward and backward; answer "
             f"tokens: {dpo['answer_tokens']}",
             f"  reference: {dpo['reference_model']}"]
    if dpo["reference_pass"] is None:
        return lines
    cost = f"{dpo['reference_pass_bytes'] / GiB:.3f} GiB"
    if dpo["reference_pass"] == "every step":
        where = ("it sets the step's peak" if dpo["reference_pass_sets_the_peak"]
                 else f"under the step's peak ({result.get('peak_operation') or 'elsewhere'})")
        lines.append(f"  its pass, a no-grad forward of the {dpo['sequences_per_micro_batch']} sequences in every "
                     f"step, peaks at {cost} above what is live before it: {where}")
    else:
        lines.append(f"  cached: 2 floats per pair (host memory), no forward in the step; the forwards that fill the "
                     f"table, once before training, peak at {cost} above the weights")
    return lines



@contextmanager
def _peak_within(trace: Any) -> Iterator[dict[str, Any]]:
    """The most `trace` (an AllocationTrace) holds above what is live on entry while inside ({"bytes", "op"} when it
    exits); the trace's own peak stays the higher of its peak before and the one inside."""
    before = trace.peak, trace.peak_by_category, trace.peak_op, trace.peak_other_by_origin
    trace.sweep()
    start = trace.peak = trace.current
    found: dict[str, Any] = {}
    try:
        yield found
    finally:
        found.update(bytes=trace.peak - start, op=trace.peak_op if trace.peak > start else "")
        if trace.peak <= before[0]:
            trace.peak, trace.peak_by_category, trace.peak_op, trace.peak_other_by_origin = before


@contextmanager
def every_position_trained() -> Iterator[None]:
    """Inside (innermost of the trace's dispatch modes), boolean masks are taken as all true: a mask's selection has
    a data-dependent size, which fake tensors cannot have. `answer_logps` selects the answer positions with a
    (2B, T-1) mask and `nonzero`; here every position is selected. Also, `logsumexp` allocates what its kernel does
    (x - max(x), as large as its input, beside the result), which a fake tensor's does not."""
    with _every_position_mode()():
        yield


def _all_positions(mask: Any) -> Any:
    """What `nonzero` returns for an all-true mask: (numel, dims) int64 positions (allocated as it allocates them)."""
    import torch

    return torch.empty(mask.numel(), mask.dim(), dtype=torch.long, device=mask.device)


@functools.lru_cache(maxsize=None)
def _every_position_mode() -> type:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    indexing = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}

    def is_mask(index: Any) -> bool:
        return index is not None and index.dtype == torch.bool

    class EveryPositionTrained(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is aten.nonzero.default and is_mask(args[0]):
                return _all_positions(args[0])
            if func is aten.logsumexp.default:
                # x - max(x) first, live while the result is made, as in the kernel
                shifted_and_result = torch.empty_like(args[0]), func(*args, **(kwargs or {}))
                return shifted_and_result[1]
            if func in indexing and any(is_mask(i) for i in args[1]):  # a k-dim mask: k index tensors, as aten has
                indices = [part for i in args[1] for part in (_all_positions(i).unbind(1) if is_mask(i) else (i,))]
                args = (args[0], indices, *args[2:])
            return func(*args, **(kwargs or {}))

    return EveryPositionTrained
