"""The GPU kernels one training step launches, counted on a machine without a GPU: the step's real code runs on fake
tensors of the real shapes with the code paths a GPU takes (`lit_qlora.estimate.cuda_code_paths`), and every op that
launches a kernel on CUDA is counted (views and allocations launch none; an NF4 dequantize is one Triton launch).

Why: on the H200 the eager 8B QLoRA step was bound by the host (benchmarks/gpu/results/gpu_issue28: 0.79 s of CPU time,
0.53 s of CUDA time per step), and host time grows with the kernels launched. The counts are exact for the shapes
given and calibrate against that profile: 921 NF4 dequantizes (the H200 profile: 921 `_nf4_dequantize_kernel`) and
~3.1k matmuls per 8B step at 2x2048.

    python benchmarks/gpu/launch_count.py [--preset Llama-3.1-8B] [--batch 2] [--seq 2048] [--out results/launch_count.json]

The step is gpu_profile.py's (the presets' LoRA: r 8 on every linear and the head, dropout 0.05, every block
checkpointed; bf16): loss, backward, `clip_grad_norm_` (foreach, as on CUDA), fused AdamW; a first step, not counted,
creates the optimizer's state. Rows: QLoRA and LoRA, by phase (blocks forward, loss, backward, optimizer) and the
ops launched most.
"""

from __future__ import annotations

import argparse
import collections
import json
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from lit_qlora.estimate import step as estimate
from lit_qlora.model.presets import PRESETS
from lit_qlora.checkpoint.loading import default_dtype, random_base
from lit_qlora.lora.layer import apply_lora
from lit_qlora.memory.trace import masks_as_all_true
from lit_qlora.nf4 import linear
from lit_qlora.train import loss as loss_module
from lit_qlora.train import nf4_head_loss

# Ops that launch no kernel: views, metadata, allocations (the caching allocator serves them).
NO_KERNEL = frozenset("""view _unsafe_view t transpose expand slice split split_with_sizes as_strided detach alias
    unsqueeze squeeze permute select reshape empty empty_like new_empty empty_strided new_empty_strided _reshape_alias
    unbind lift_fresh chunk narrow diagonal unflatten flatten view_as sym_size sym_stride sym_numel is_same_size
    resolve_conj resolve_neg set_ _local_scalar_dense device size stride dim numel is_contiguous storage_offset
    _to_copy_noop""".split())
PHASES = ("blocks forward", "loss", "backward", "optimizer")


class KernelCount(TorchDispatchMode):
    """Ops launched, by (phase, op name); `quiet` > 0 inside a call counted as one kernel (the NF4 dequantize)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.phase = "setup"
        self.quiet = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.quiet and name not in NO_KERNEL:
            self.counts[(self.phase, name)] += 1
        return func(*masks_as_all_true(func, args), **(kwargs or {}))  # as the estimate: a mask keeps every row

    def one_launch(self, fn):
        def counted(*args, **kwargs):
            self.counts[(self.phase, "nf4_dequantize (Triton)")] += 1
            self.quiet += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.quiet -= 1

        return counted

    def in_phase(self, fn, phase: str):
        def phased(*args, **kwargs):
            outer, self.phase = self.phase, phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = outer

        return phased


@contextmanager
def counted_paths(count: KernelCount):
    with ExitStack() as stack:
        for module, name in ((linear, "dense_rows"), (linear, "dense_stack"), (nf4_head_loss, "dense_rows")):
            stack.enter_context(mock.patch.object(module, name, count.one_launch(getattr(module, name))))
        for name in ("nf4_head_ce_sum", "chunked_cross_entropy_sum", "tiled_ce_sum"):
            stack.enter_context(mock.patch.object(loss_module, name,
                                                  count.in_phase(getattr(loss_module, name), "loss")))
        yield


def count_step(preset: str, quantize: str, batch: int, seq: int) -> collections.Counter:
    config = PRESETS[preset]
    count = KernelCount()
    with ExitStack() as stack:
        stack.enter_context(estimate._nf4_caches_set_aside())
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        model = random_base(config, quantize, torch.bfloat16)
        apply_lora(model, r=8, alpha=16, dropout=0.05, targets="all", dtype=torch.bfloat16)
        model.checkpoint_blocks = config.n_layer
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=True)
        stack.enter_context(default_dtype(torch.bfloat16))
        stack.enter_context(estimate.cuda_code_paths())
        stack.enter_context(counted_paths(count))
        ids = torch.zeros(batch, seq, dtype=torch.long)
        with count:
            for _ in range(2):  # the second step is the one counted
                count.counts.clear()
                count.phase = "blocks forward"
                step_loss = loss_module.lm_loss_sum(model, ids, ids) / ids.numel()
                count.phase = "backward"
                step_loss.backward()
                count.phase = "optimizer"
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return count.counts


def summarize(counts: collections.Counter, top: int = 12) -> dict:
    by_phase = {phase: sum(v for (p, _), v in counts.items() if p == phase) for phase in PHASES}
    by_op = collections.Counter()
    for (_, name), v in counts.items():
        by_op[name] += v
    return {"kernels": sum(counts.values()), "by_phase": by_phase, "top_ops": dict(by_op.most_common(top))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="Llama-3.1-8B", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for quantize in ("nf4", "none"):
        row = {"preset": args.preset, "quantize": quantize, "batch": args.batch, "seq": args.seq,
               **summarize(count_step(args.preset, quantize, args.batch, args.seq))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
