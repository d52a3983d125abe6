"""LoRA's dropout on CPU without a stored mask: ``scale * dropout(x) @ A^T @ B^T`` as one autograd function.

torch's CPU dropout draws a Bernoulli number per element (~13 ms for a 2048x576 bf16 input here, 25x the adapter's
A matmul): with seven adapters per block it made a SmolLM2 LoRA step ~19% slower at dropout 0.05 (issue 16).
Here the mask is a hash of each element's index and a per-call seed drawn from torch's CPU generator, computed 16
lanes at a time by the C kernel beside the NF4 ones (PyTorch ops where it is unavailable: the same values). So:
- backward regenerates the mask from the seed: nothing is saved but the input (which the base projection's
  neighbours keep anyway) and the r-wide ``x A^T``; torch would keep the mask and the dropped copy of x;
- activation checkpointing's recompute draws the same seed (it restores the RNG state), and a resumed run
  repeats exactly (the RNG state is checkpointed);
- other devices keep ``nn.Dropout`` (CUDA's dropout is one fused kernel).
"""

from __future__ import annotations

import torch

from lit_qlora.nf4 import native

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
    if native.is_fake(x):
        return x if inplace else torch.empty_like(x)  # `litqlora estimate`: shapes only
    if x.device.type == "cpu" and _use_kernel(x.dtype):
        out = x if inplace else torch.empty_like(x)
        native.dropout_elements(x, out, seed, threshold, scale)
        return out
    return _dropped_eager(x, seed, threshold, scale)


class _DroppedLoRA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, b, scale: float, p: float, seed: int):
        h = dropped(x, seed, p) @ a.T  # the dropped copy of x lives only for this matmul
        ctx.save_for_backward(x, a, b, h)
        ctx.scale, ctx.p, ctx.seed = scale, p, seed
        return (h @ b.T) * scale

    @staticmethod
    def backward(ctx, grad):
        x, a, b, h = ctx.saved_tensors
        g = grad * ctx.scale
        grad_h = g @ b
        rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        grad_a = rows(grad_h).T @ rows(dropped(x, ctx.seed, ctx.p)) if ctx.needs_input_grad[1] else None
        grad_b = rows(g).T @ rows(h) if ctx.needs_input_grad[2] else None
        grad_x = dropped(grad_h @ a, ctx.seed, ctx.p, inplace=True) if ctx.needs_input_grad[0] else None
        return grad_x, grad_a, grad_b, None, None, None


def draw_seed(x: torch.Tensor) -> int:
    """One adapter call's mask seed, from torch's CPU generator (which checkpointing's recompute restores)."""
    return 0 if native.is_fake(x) else int(torch.randint(0, 2**32, (), dtype=torch.int64).item())


@torch.compiler.disable  # the kernel writes through raw pointers
def dropped_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, p: float) -> torch.Tensor:
    """``scale * dropout(x, p) @ a^T @ b^T`` in training, for CPU tensors."""
    return _DroppedLoRA.apply(x, a, b, scale, p, draw_seed(x))
