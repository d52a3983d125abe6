"""LoRA's dropout on CPU without a stored mask: ``scale * dropout(x) @ A^T @ B^T`` as one autograd function.

torch's CPU dropout draws a Bernoulli number per element (~13 ms for a 2048x576 bf16 input here, 25x the adapter's
A matmul): with seven adapters per block it made a SmolLM2 LoRA step ~19% slower at dropout 0.05 (issue 16).
Here the mask is a hash of each element's index and a per-call seed drawn from torch's CPU generator, computed 16
lanes at a time by LoRA's C kernel (lit_qlora/lora/kernels.c, bound in `lit_qlora.lora.native`; PyTorch ops where it
is unavailable: the same values). So:
- backward regenerates the mask from the seed: nothing is saved but the input (which the base projection's
  neighbours keep anyway) and the r-wide ``x A^T``; torch would keep the mask and the dropped copy of x;
- activation checkpointing's recompute draws the same seed (it restores the RNG state), and a resumed run
  repeats exactly (the RNG state is checkpointed);
- on CUDA, eagerly, the mask is drawn again in backward from the generator state saved in forward
  (`_ReplayedDropoutDown`): x is kept, not the dropped copy and the mask; compiled code keeps ``nn.Dropout``.
The dropped copy of x is itself never written where it can be avoided (`down`, `down_backward`): one C kernel
pass hashes, scales and multiplies by A for every adapter of one input, and backward's pass makes the A gradients
and adds the input gradient in place. Writing the copy, page faults on its fresh memory included, had made
dropout 0.05 cost 13.5% of a SmolLM2 4x512 step; 6% now (`benchmarks/ab/dropout_ab.py`, benchmarks/README.md).
"""

from __future__ import annotations

from typing import Optional

import torch

from lit_qlora.base import switches
from lit_qlora.lora import native
from lit_qlora.base.recompute import first_run_value
from lit_qlora.nf4.native import is_fake

GOLDEN, MIX1, MIX2, LOW32 = 0x9E3779B1, 0x7FEB352D, 0x846CA68B, 0xFFFFFFFF


def keep_threshold(p: float) -> int:
    """An element is kept when its 32-bit hash is at least this: kept with probability 1 - p (to 2^-32)."""
    return min(LOW32, round(p * 2**32))


def keep_mask_eager(n: int, seed: int, threshold: int, device=None) -> torch.Tensor:
    """The kernel's mask in PyTorch ops (int64 arithmetic, low 32 bits kept), for the path without the kernel."""
    h = (torch.arange(n, dtype=torch.int64, device=device) * GOLDEN + seed) & LOW32
    h ^= h >> 16
    h = (h * MIX1) & LOW32
    h ^= h >> 15
    h = (h * MIX2) & LOW32
    h ^= h >> 16
    return h >= threshold


def _dropped_eager(x: torch.Tensor, seed: int, threshold: int, scale: float) -> torch.Tensor:
    keep = keep_mask_eager(x.numel(), seed, threshold, x.device).view(x.shape)
    return torch.where(keep, (x.float() * scale).to(x.dtype), torch.zeros((), dtype=x.dtype))


_kernel_checked: dict[torch.dtype, bool] = {}


def _use_kernel(dtype: torch.dtype) -> bool:
    """The C kernel for this dtype, once it matched the PyTorch ops on a ragged tensor (else: one warning)."""
    if dtype not in _kernel_checked:
        ok = native.use_native(dtype)
        if ok:
            x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0), dtype=torch.float32).to(dtype)
            out = torch.empty_like(x)
            native.dropout_elements(x, out, 12345, keep_threshold(0.3), 1 / 0.7)
            ok = torch.equal(out, _dropped_eager(x, 12345, keep_threshold(0.3), 1 / 0.7))
            if not ok:
                native.log.warning("lit_qlora: the C LoRA dropout kernel disagrees with PyTorch; using PyTorch ops")
        _kernel_checked[dtype] = ok
    return _kernel_checked[dtype]


def dropped(x: torch.Tensor, seed: int, p: float, inplace: bool = False) -> torch.Tensor:
    """``x * keep / (1 - p)``, keep from the hash of (element index, seed): the same mask for every tensor of x's
    shape and the same seed (forward's input, backward's gradient). `inplace` writes into x (a contiguous tensor
    nobody else reads): one fresh allocation fewer, whose pages the heap release would have the OS fault in again."""
    x = x.contiguous()  # (x itself when it already is)
    threshold, scale = keep_threshold(p), 1.0 / (1.0 - p)
    if is_fake(x):
        return x if inplace else torch.empty_like(x)  # `litqlora estimate`: shapes only
    if x.device.type == "cpu" and _use_kernel(x.dtype):
        out = x if inplace else torch.empty_like(x)
        native.dropout_elements(x, out, seed, threshold, scale)
        return out
    return _dropped_eager(x, seed, threshold, scale)


FUSED_MAX_RANK = 64
"""Adapters up to this rank run dropout and the down projection as one C kernel (`down`, `down_backward`); the
kernel's work grows with r where a matmul's barely does, so wider adapters keep the dropped copy and the matmul."""


_fused_checked: dict[torch.dtype, bool] = {}


def _fused_agrees(dtype: torch.dtype) -> bool:
    """Whether the fused kernels match the dropped copy and matmuls on a ragged problem (tails, two rank blocks,
    two adapters, accumulation), within the rounding of `dtype`."""
    g = torch.Generator().manual_seed(0)
    x, gx = (torch.randn(37, 83, generator=g).to(dtype) for _ in range(2))
    a = [torch.randn(r, 83, generator=g).to(dtype) for r in (10, 10)]
    gh = [torch.randn(37, 10, generator=g).to(dtype) for _ in a]
    seeds, p = [5, 2**32 - 1], 0.3
    keep = [keep_mask_eager(x.numel(), s, keep_threshold(p)).view(x.shape) for s in seeds]
    xm = [x.float() * k / (1 - p) for k in keep]
    h = down(x, a, seeds, p)
    grad_a, grad_x = down_backward(x, a, gh, seeds, p, gx.clone(), True)
    want_x = gx.float() + sum((gh[q].float() @ a[q].float()) * keep[q] / (1 - p) for q in range(2))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    pairs = [(grad_x, want_x)] + [(h[q], xm[q] @ a[q].float().T) for q in range(2)]
    pairs += [(grad_a[q], gh[q].float().T @ xm[q]) for q in range(2)]
    return all(torch.allclose(got.float(), want, rtol=tol, atol=tol * want.abs().max().item()) for got, want in pairs)


def _fits_kernel(x2: torch.Tensor, a: list[torch.Tensor]) -> bool:
    ranks = {t.shape[0] for t in a}
    return x2.device.type == "cpu" and len(ranks) == 1 and max(ranks) <= FUSED_MAX_RANK


def _fused_kernel(x2: torch.Tensor, a: list[torch.Tensor]) -> bool:
    """Whether `down` and `down_backward` use the fused kernels: CPU, one rank up to FUSED_MAX_RANK, the kernels
    there and checked once for this dtype (a mismatch: one warning, the dropped copy and matmuls instead)."""
    if not _fits_kernel(x2, a) or not _use_kernel(x2.dtype):
        return False
    if x2.dtype not in _fused_checked:
        _fused_checked[x2.dtype] = True  # the check itself runs the kernels
        _fused_checked[x2.dtype] = ok = _fused_agrees(x2.dtype)
        if not ok:
            native.log.warning("lit_qlora: the fused LoRA dropout kernels disagree with PyTorch; using PyTorch ops")
    return _fused_checked[x2.dtype]


def down(x2: torch.Tensor, a: list[torch.Tensor], seeds: list[int], p: float) -> list[torch.Tensor]:
    """Each adapter's ``dropout_q(x2) @ a[q]^T`` (tokens, r) in x2's dtype, mask q drawn from seeds[q]: on CPU one
    pass over x2 for all of them, the dropped copies never written (x2: (tokens, in)). A checkpointed block's
    recompute takes them from its first run (lit_qlora.base.recompute: tokens x r values per adapter, kept until
    backward), which both runs' seeds, part of the key, check: a third of dropout's kernel work saved."""
    key = ("lora_down", tuple(seeds), p, x2.shape[0], tuple(t.shape for t in a))
    return first_run_value(key, lambda: _down(x2, a, seeds, p))


def _down(x2: torch.Tensor, a: list[torch.Tensor], seeds: list[int], p: float) -> list[torch.Tensor]:
    if is_fake(x2):
        return [x2.new_empty(x2.shape[0], t.shape[0]) for t in a]
    if not _fused_kernel(x2, a):
        return [dropped(x2, seed, p) @ t.to(x2.dtype).T for t, seed in zip(a, seeds)]
    x2 = x2.contiguous()
    h = [torch.empty(x2.shape[0], t.shape[0], dtype=torch.float32) for t in a]
    native.lora_drop_down(x2, [t.to(x2.dtype).contiguous() for t in a], h, seeds, keep_threshold(p), 1.0 / (1.0 - p))
    return [t.to(x2.dtype) for t in h]


def down_backward(x2: torch.Tensor, a: list[torch.Tensor], grad_h: list[torch.Tensor], seeds: list[int], p: float,
                  grad_x: Optional[torch.Tensor], needs_x: bool) -> tuple[list[torch.Tensor], Optional[torch.Tensor]]:
    """`down`'s backward: (each ``grad_h[q]^T @ dropout_q(x2)``, in a[q]'s dtype; the input gradient ``sum_q
    dropout_q(grad_h[q] @ a[q])``, added into `grad_x` (contiguous, like x2) when given, else new when `needs_x`)."""
    fake = is_fake(x2)  # `litqlora estimate`: the kernel's allocations, without its self-check or its work
    if not (_fits_kernel(x2, a) if fake else _fused_kernel(x2, a)):
        grad_a = [(g.T @ dropped(x2, seed, p)).to(t.dtype) for t, g, seed in zip(a, grad_h, seeds)]
        if needs_x:
            for t, g, seed in zip(a, grad_h, seeds):
                part = dropped(g @ t.to(g.dtype), seed, p, inplace=True)
                grad_x = part if grad_x is None else grad_x.add_(part)
        return grad_a, grad_x
    x2 = x2.contiguous()
    sums = [torch.zeros(t.shape, dtype=torch.float32) for t in a]
    out = grad_x if grad_x is not None or not needs_x else torch.empty_like(x2)
    if not fake:
        native.lora_drop_down_backward(x2, [t.to(x2.dtype).contiguous() for t in a],
                                       [g.float().contiguous() for g in grad_h],
                                       sums, out, grad_x is not None, seeds, keep_threshold(p), 1.0 / (1.0 - p))
    return [s.to(t.dtype) for s, t in zip(sums, a)], out


class _DroppedDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, p: float, seed: int):
        ctx.save_for_backward(x, a)
        ctx.p, ctx.seed = p, seed
        return down(x.reshape(-1, x.shape[-1]), [a], [seed], p)[0].view(*x.shape[:-1], a.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, a = ctx.saved_tensors
        (grad_a,), grad_x = down_backward(x.reshape(-1, x.shape[-1]), [a], [grad.reshape(-1, grad.shape[-1])],
                                          [ctx.seed], ctx.p, None, ctx.needs_input_grad[0])
        return None if grad_x is None else grad_x.view(x.shape), grad_a, None, None


def dropped_down(x: torch.Tensor, a: torch.Tensor, dropout: torch.nn.Module) -> torch.Tensor:
    """``dropout(x) @ a^T``, the r-wide half of a LoRA term, as the layer's `dropout` module would drop x: in
    training on CPU with the hash mask in one kernel pass (`down`), else with the module itself."""
    if dropout.training and isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
        if hash_dropout_applies(x):
            return _DroppedDown.apply(x, a, dropout.p, draw_seed(x))
        if replayed_dropout_applies(x):
            return replayed_dropout_down(x, a, dropout.p)
    return dropout(x) @ a.T


class _ReplayedDropoutDown(torch.autograd.Function):
    """``dropout(x) @ a^T`` that saves x and the generator's state, not the dropped copy and its mask: backward draws
    the same mask again (the same kernel from the same Philox/Mersenne state gives the same values). nn.Dropout then
    matmul keeps both (3 bytes per bf16 element, per adapter); x is often kept anyway, once for q, k and v, which
    read the same input. On an 8B QLoRA step (2x2048) that is 248 MiB less at the peak, the recompute of a block."""

    @staticmethod
    def forward(ctx, x, a, p: float):
        keep = _recorded_keep_mask(x, p, ctx)
        ctx.save_for_backward(x, a)
        return _dropped(x, keep, p) @ a.T

    @staticmethod
    def backward(ctx, grad):
        x, a = ctx.saved_tensors
        keep = _replayed_keep_mask(x, ctx)
        # One x-sized temporary at a time beside the 1-byte mask: the dropped copy, then the input gradient.
        dropped = _dropped(x, keep, ctx.p)
        grad_a = grad.reshape(-1, grad.shape[-1]).T @ dropped.reshape(-1, x.shape[-1])
        del dropped
        grad_x = _dropped(grad @ a, keep, ctx.p, inplace=True) if ctx.needs_input_grad[0] else None
        return grad_x, grad_a, None


class _ReplayedLoRA(torch.autograd.Function):
    """A whole LoRA term added to the base's output, ``out + scale * dropout(x) @ a^T @ b^T``, with the mask replayed
    as in `_ReplayedDropoutDown`: one autograd node and 5 kernels forward, 8 backward, where the same term as
    separate ops took 7 and 13 (benchmarks/gpu/launch_count.py). An eager GPU step is bound by its host, which pays for
    every kernel and node: an 8B step has 224 adapters, each run forward twice (checkpointing) and backward once.
    Saved: x (as before), the factors and the r-wide ``h = scale * dropout(x) a^T``."""

    @staticmethod
    def forward(ctx, x, out, a, b, scale: float, p: float):
        ctx.scale = scale
        x2 = x.reshape(-1, x.shape[-1])
        h = (x2 * _recorded_keep_mask(x2, p, ctx)) @ a.T
        h.mul_(scale / (1.0 - p))  # r wide: the dropout's and the adapter's scale in one small kernel
        ctx.save_for_backward(x, a, b, h)
        return torch.addmm(out.reshape(-1, out.shape[-1]), h, b.T).view(out.shape)

    @staticmethod
    def backward(ctx, grad):
        x, a, b, h = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_b = g.T @ h
        grad_h = (g @ b).mul_(ctx.scale / (1.0 - ctx.p))  # the gradient of (x * keep) a^T
        x2 = x.reshape(-1, x.shape[-1])
        keep = _replayed_keep_mask(x2, ctx)
        # One x-sized temporary at a time beside the 1-byte mask, as in _ReplayedDropoutDown.
        grad_a = grad_h.T @ (x2 * keep)
        grad_x = (grad_h @ a).mul_(keep).view(x.shape) if ctx.needs_input_grad[0] else None
        return grad_x, grad, grad_a, grad_b, None, None


def replayed_lora(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                  p: float) -> torch.Tensor:
    """``out + scale * dropout(x, p) @ a^T @ b^T`` in training, keeping no mask (`_ReplayedLoRA`)."""
    return _ReplayedLoRA.apply(x, out, a, b, scale, p)


def _recorded_keep_mask(x: torch.Tensor, p: float, ctx) -> torch.Tensor:
    """A keep mask for `x` drawn from the default generator, whose state (and `p`) `ctx` records for
    `_replayed_keep_mask`. On fake tensors (a dry run; fake CUDA has no generator) there is no state to keep."""
    gen = None if is_fake(x) else _default_generator(x.device)
    ctx.state, ctx.p = None if gen is None else gen.get_state(), p
    return _keep_mask(x, p, gen)


def _replayed_keep_mask(x: torch.Tensor, ctx) -> torch.Tensor:
    """The keep mask forward drew for `x` (its shape), drawn again from the generator state it saved."""
    gen = None
    if ctx.state is not None:
        gen = torch.Generator(device=x.device)
        gen.set_state(ctx.state)
    return _keep_mask(x, ctx.p, gen)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def _keep_mask(x: torch.Tensor, p: float, gen: Optional[torch.Generator]) -> torch.Tensor:
    """1 where an element of x is kept (probability 1 - p), else 0: uint8, drawn from `gen`."""
    return torch.empty_like(x, dtype=torch.uint8).bernoulli_(1.0 - p, generator=gen)


def _dropped(t: torch.Tensor, keep: torch.Tensor, p: float, inplace: bool = False) -> torch.Tensor:
    """``t * keep / (1 - p)`` in t's dtype, as nn.Dropout scales (into t when `inplace`)."""
    return (t.mul_(keep) if inplace else t * keep).mul_(1.0 / (1.0 - p))


def replayed_dropout_applies(x: torch.Tensor) -> bool:
    """Whether LoRA dropout on `x` saves the RNG state instead of its mask: CUDA tensors, eagerly (compiled code
    keeps nn.Dropout, which inductor fuses into the block's kernels). `litqlora estimate --device cuda` patches it."""
    if x.device.type != "cuda" or torch.compiler.is_compiling():
        return False
    return switches.enabled("LIT_QLORA_DROPOUT_REPLAY")  # 0: nn.Dropout (for A/B measurements)


def replayed_dropout_down(x: torch.Tensor, a: torch.Tensor, p: float) -> torch.Tensor:
    """``dropout(x, p) @ a^T`` in training, keeping no mask (`_ReplayedDropoutDown`)."""
    return _ReplayedDropoutDown.apply(x, a, p)


def hash_dropout_applies(x: torch.Tensor) -> bool:
    """Whether LoRA dropout on `x` runs as the hash mask (CPU tensors; elsewhere `nn.Dropout`). Every LoRA path
    asks this, by module attribute: `litqlora estimate --device cuda` patches it to say no, as on a GPU."""
    return x.device.type == "cpu"


def draw_seed(x: torch.Tensor) -> int:
    """One adapter call's mask seed, from torch's CPU generator (which checkpointing's recompute restores)."""
    return 0 if is_fake(x) else int(torch.randint(0, 2**32, (), dtype=torch.int64).item())


@torch.compiler.disable  # the kernel writes through raw pointers
def dropped_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, p: float) -> torch.Tensor:
    """``scale * dropout(x, p) @ a^T @ b^T`` in training, for CPU tensors: what autograd saves is x, A, B and the
    r-wide product (the mm's output is scaled in place; nothing of its size is kept)."""
    return (_DroppedDown.apply(x, a, p, draw_seed(x)) @ b.T).mul_(scale)
