"""Projections of one input (q/k/v, gate/up) as ONE base matmul, each projection keeping its own LoRA adapter.

Every projection stays its own module with its own weight, so checkpoints, adapters, exports, tensor parallelism
and FSDP see the Hugging Face layout unchanged; only the forward is fused. On CPU three small oneDNN matmuls
(SmolLM2: q 576x576, k and v 192x576) cost more than one of their stacked rows, and each adapter's term is added
into its slice of the one output (`addmm_`, alpha = its scale) instead of a scaled copy plus an add.

The group's base weights are stacked for each matmul: NF4 weights are dequantized into one dense block (the CPU
scratch buffer, as `NF4Linear` does; backward dequantizes again, only the NF4 codes are saved); dense weights are
read in place where `share_storage` made them row slices of one tensor (the loader does, for every block), else
concatenated in every call (a SmolLM2 LoRA `dpo` step on two short rows spent 7% of its time in those copies).
Each adapter keeps its own A, B, scale and dropout mask (the hash mask of `lora_dropout`, its seed drawn per adapter
in module order, as the unfused path draws them). Without dropout the adapters' A projections
are one matmul of x against the stacked A's.

Where the fusion does not apply, each module runs its own forward (`fusion_plan` says when: tensor-parallel
layers, DTensor weights, torch.compile, mixed NF4/dense or dtypes, trainable base weights, autocast, dropout off the CPU, an NF4
stack past `DENSE_CHUNK_ELEMS`). There, with ``LIT_QLORA_LORA_GROUPED=1`` (default off), a group of LoRALinears
computes its adapters' terms as one group (`lit_qlora.lora.grouped`: each base as its own module does, then one
dropout of x shared by the group's adapters, one A matmul and one block-diagonal B matmul).
"""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_qlora.lora import dropout as lora_dropout
from lit_qlora.lora import grouped as lora_grouped
from lit_qlora.lora.dropout import draw_seed
from lit_qlora.nf4 import linear as nf4_linear
from lit_qlora.nf4.linear import FrozenNF4Linear
from lit_qlora.nf4.reference import SUPPORTED_DTYPES


class Adapter(NamedTuple):
    """One projection's LoRA term in a fused call: its place in the group, scale, dropout in effect and seed."""

    index: int
    scale: float
    p: float
    seed: int = 0


class FusionPlan(NamedTuple):
    kind: str  # "nf4" or "dense": how the base weights are stacked
    adapters: tuple[Adapter, ...]


def _fusable_module(m: nn.Module) -> bool:
    # Exact types: a subclass (tensor-parallel layers) computes something else. Module hooks would be skipped.
    kind_ok = type(m) in (nn.Linear, FrozenNF4Linear) or getattr(type(m), "fusable", False)
    return kind_ok and not (m._forward_hooks or m._forward_pre_hooks)


def _base_kind(weights: Sequence[torch.Tensor], x: torch.Tensor) -> Optional[str]:
    names = {type(w).__name__ for w in weights}
    if "DTensor" in names or x.dtype not in SUPPORTED_DTYPES or any(w.requires_grad for w in weights):
        return None
    if any(w.dim() != 2 or w.shape[1] != x.shape[-1] for w in weights):
        return None
    if names == {"NF4Tensor"}:
        fits = sum(w.numel() for w in weights) <= nf4_linear.DENSE_CHUNK_ELEMS
        on_x = all(w.quantized_data.device == x.device for w in weights)
        return "nf4" if fits and on_x else None
    if "NF4Tensor" not in names and all(w.dtype == x.dtype and w.device == x.device for w in weights):
        return "dense"
    return None


def fusion_plan(x: torch.Tensor, modules: Sequence[nn.Module]) -> Optional[FusionPlan]:
    """How `modules` (linears of the same input) run as one matmul, or None where each must run its own forward."""
    if len(modules) < 2 or torch.is_autocast_enabled(x.device.type) or torch.compiler.is_compiling():
        return None  # compiled: each projection is traced (inductor fuses what it can), no graph break
    if not all(_fusable_module(m) for m in modules):
        return None
    kind = _base_kind([m.weight for m in modules], x)
    if kind == "nf4" and not modules[0].training and nf4_linear.decode_applies(x, modules[0].weight):
        return None  # inference on a few rows: each projection's own NF4 decode kernel, no dequantized stack
    biases = [m.bias for m in modules]
    if kind is None or (None in biases and any(b is not None for b in biases)):
        return None
    if any(b is not None and (b.requires_grad or b.dtype != x.dtype) for b in biases):
        return None
    adapters = []
    for i, m in enumerate(modules):
        if not hasattr(m, "lora_A") or m.scale == 0:  # scale 0 (adapters_disabled): the base alone, exactly
            continue
        p = m.lora_dropout.p if m.training and isinstance(m.lora_dropout, nn.Dropout) else 0.0
        if p > 0 and not lora_dropout.hash_dropout_applies(x):  # the fused path has no other dropout
            return None
        adapters.append(Adapter(i, m.scale, p))
    return FusionPlan(kind, tuple(adapters))


def fused_projections(x: torch.Tensor, modules: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
    """`tuple(m(x) for m in modules)`, as one base matmul plus each module's own adapter where that applies (the
    outputs are then column slices of one tensor). Where it does not and LIT_QLORA_LORA_GROUPED=1, the LoRA
    terms as one group where that applies (`lit_qlora.lora.grouped`)."""
    plan = fusion_plan(x, modules)
    if plan is None:
        grouped = lora_grouped.grouped_projections(x, modules) if lora_grouped.grouped_enabled() else None
        return grouped if grouped is not None else tuple(m(x) for m in modules)
    return _run_fused(x, modules, plan)


@torch.compiler.disable  # the NF4 and dropout kernels write through raw pointers; the seeds are host values
def _run_fused(x: torch.Tensor, modules: Sequence[nn.Module], plan: FusionPlan) -> tuple[torch.Tensor, ...]:
    adapters = tuple(a._replace(seed=draw_seed(x)) if a.p > 0 else a for a in plan.adapters)  # in module order
    rows = tuple(m.weight.shape[0] for m in modules)
    bias = None if modules[0].bias is None else _stacked([m.bias for m in modules])
    lora = [modules[a.index].lora_A for a in adapters] + [modules[a.index].lora_B for a in adapters]
    y = _FusedProjections.apply(x, bias, plan.kind, rows, adapters, *[m.weight for m in modules], *lora)
    return y.split(rows, dim=-1)


def _stacked_weight(kind: str, weights: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The group's base weights as one (sum of rows, in) matrix (NF4: in the scratch buffer, valid until the next
    dequantization on this thread)."""
    if kind == "nf4":
        return nf4_linear.dense_stack(weights, dtype)  # looked up at call time: the estimate wraps it
    return _stacked(weights)


def _stacked(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(tensors)`, without a copy where they are consecutive slices of one storage."""
    view = stacked_view(tensors)
    return view if view is not None else torch.cat([t.detach() for t in tensors])


def stacked_view(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensors stacked along dim 0 as one view, where they are contiguous, consecutive slices of one storage
    (what `share_storage` makes); else None."""
    first = tensors[0]
    storage = first.untyped_storage()._cdata
    offset = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.untyped_storage()._cdata != storage or t.storage_offset() != offset
                or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride())


def share_storage(modules: Sequence[nn.Module], trainable: bool = False) -> bool:
    """Make the dense weights (and biases) of `modules`, linears of one input, consecutive row slices of one tensor,
    so `fused_projections` reads them as one matrix in place. The same memory: the group's tensors move into one
    allocation (one group's size of it transient). Each becomes a new Parameter: with `trainable` (a model just
    loaded, whose base LoRA freezes later) trainable ones too, else (an optimizer may hold them) only frozen ones.
    Nothing for NF4, sharded or mixed weights; returns whether the group's weights now share one storage."""
    for attr in ("weight", "bias"):
        tensors = [getattr(m, attr, None) for m in modules]
        if any(t is None for t in tensors):
            if attr == "weight" or any(t is not None for t in tensors):
                return False
            continue
        names = {type(t.data).__name__ for t in tensors}
        if ("NF4Tensor" in names or "DTensor" in names or len({(t.dtype, t.device, t.shape[1:]) for t in tensors}) > 1
                or (not trainable and any(t.requires_grad for t in tensors))):
            return False
        if stacked_view(tensors) is not None:
            continue
        stacked = torch.cat([t.detach() for t in tensors])
        for m, t, part in zip(modules, tensors, stacked.split([t.shape[0] for t in tensors])):
            setattr(m, attr, nn.Parameter(part, requires_grad=t.requires_grad))
    return True


def _shared_down(adapters: Sequence[Adapter]) -> bool:
    """Whether the adapters' A projections run as one matmul (no dropout: they all read the same x)."""
    return len(adapters) > 1 and all(a.p == 0 for a in adapters)


def _by_p(adapters: Sequence[Adapter]) -> dict[float, list[int]]:
    """Positions of the adapters, by dropout probability: each group is one pass of the dropout kernel."""
    groups: dict[float, list[int]] = {}
    for i, ad in enumerate(adapters):
        groups.setdefault(ad.p, []).append(i)
    return groups


def _down(x2: torch.Tensor, a: Sequence[torch.Tensor], adapters: Sequence[Adapter]) -> list[torch.Tensor]:
    """Each adapter's (tokens, r) `dropout(x) A^T`."""
    if _shared_down(adapters):
        return list((x2 @ torch.cat(a).T).split([t.shape[0] for t in a], dim=1))
    h: list = [None] * len(adapters)
    for p, idx in _by_p(adapters).items():
        for i, h_i in zip(idx, lora_dropout.down(x2, [a[i] for i in idx], [adapters[i].seed for i in idx], p)):
            h[i] = h_i
    return h


class _FusedProjections(torch.autograd.Function):
    """y = x W_cat^T + b_cat, then each adapter's slice of y += scale * dropout(x) A^T B^T; W frozen."""

    @staticmethod
    def forward(ctx, x, bias, kind: str, rows: tuple[int, ...], adapters: tuple[Adapter, ...], *tensors):
        n, k = len(rows), len(adapters)
        weights, a, b = tensors[:n], tensors[n : n + k], tensors[n + k :]
        dtype = x.dtype
        y = F.linear(x, _stacked_weight(kind, weights, dtype), bias)
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        h = _down(x2, [t.to(dtype) for t in a], adapters)
        starts = [0, *accumulate(rows)]
        for ad, h_i, b_i in zip(adapters, h, b):
            y2[:, starts[ad.index] : starts[ad.index + 1]].addmm_(h_i, b_i.to(dtype).T, alpha=ad.scale)
        ctx.save_for_backward(x, *weights, *a, *b, *h)
        ctx.kind, ctx.rows, ctx.adapters = kind, rows, adapters
        return y

    @staticmethod
    def backward(ctx, grad):
        n, adapters = len(ctx.rows), ctx.adapters
        k = len(adapters)
        x, *rest = ctx.saved_tensors
        weights, a, b, h = rest[:n], rest[n : n + k], rest[n + k : n + 2 * k], rest[n + 2 * k :]
        dtype, starts = grad.dtype, [0, *accumulate(ctx.rows)]
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        needs_x = ctx.needs_input_grad[0]
        grad_x = g2 @ _stacked_weight(ctx.kind, weights, dtype) if needs_x else None
        a_c, grad_a, grad_b, grad_h = [t.to(dtype) for t in a], [], [], []
        for ad, b_i, h_i in zip(adapters, b, h):
            g_i = g2[:, starts[ad.index] : starts[ad.index + 1]]
            grad_h.append((g_i @ b_i.to(dtype)).mul_(ad.scale))
            grad_b.append((g_i.T @ h_i).mul_(ad.scale).to(b_i.dtype))
        if _shared_down(adapters):
            gh = torch.cat(grad_h, dim=1)
            grad_a = list((gh.T @ x2).split([t.shape[0] for t in a]))
            if needs_x:
                grad_x.addmm_(gh, torch.cat(a_c))
        else:  # the dropout kernel adds each group's input gradient into grad_x
            grad_a = [None] * k
            for p, idx in _by_p(adapters).items():
                parts, grad_x = lora_dropout.down_backward(x2, [a[i] for i in idx], [grad_h[i] for i in idx],
                                                           [adapters[i].seed for i in idx], p, grad_x, needs_x)
                for i, g in zip(idx, parts):
                    grad_a[i] = g
        grad_a = [g.to(t.dtype) for g, t in zip(grad_a, a)]
        grad_x = None if grad_x is None else grad_x.view(x.shape)
        return (grad_x, None, None, None, None, *[None] * n, *grad_a, *grad_b)
