"""The LoRA terms of one input's projections (q/k/v, gate/up) as one group: one dropout of x, one A matmul, one B
matmul, behind the setting ``LIT_QLORA_LORA_GROUPED=1`` (issue 48 item 3; an A/B benchmark switches it).

Where `fused_projections`' one base matmul does not apply (`fusion_plan` is None: the GPU, torch.compile, an NF4
stack past DENSE_CHUNK_ELEMS, ...), each LoRALinear runs its own forward: dropout(x), x A^T, B^T, scale, add, once
per projection. With the setting on, a group of LoRALinears of one input computes instead:

- each base projection as its own module does (`frozen_linear(x, W_i, b_i)`: NF4 or dense, unchanged);
- ONE dropout of x, shared by the group's adapters;
- ONE matmul ``h = dropout(x) @ cat(A_i)^T``, (tokens, sum r_i);
- ONE matmul of h against the block-diagonal (sum out_i, sum r_i) matrix whose blocks are ``scale_i * B_i``
  (`torch.block_diag`, built per call: small, and differentiable, so B's gradients are its diagonal blocks); it
  multiplies k times the B products' FLOPs (the zero blocks), cheap at LoRA ranks, for one kernel instead of k;
- each projection's column slice of that product added to its base output.

All of it is differentiable torch ops (no autograd.Function of its own): autograd gives the gradients eagerly,
and torch.compile traces it with no graph break (dynamo guards on the setting, so flipping it recompiles).

Semantics: with dropout, the group's adapters see the SAME dropout mask of x (PEFT, and this repo's separate path,
draw one mask per module). Without dropout (p = 0, or eval) the result is the separate modules' up to matmul rounding
(scale is folded into B before the matmul instead of applied after it). The dropout itself is the one the separate
path would use for a single module, drawn once (`dropout.dropped_down`): the hash mask on CPU, the replayed mask on
CUDA eagerly (x and the generator state saved, neither the mask nor the dropped copy: the memory the separate
path's `replayed_lora` keeps, so an A/B measures the grouping, not a dropout that keeps more); compiled,
``F.dropout`` (as nn.Dropout, which inductor fuses).

It applies when every module is a LoRALinear whose type allows it (`fusable`: not a tensor-parallel subclass)
without hooks, no weight or factor is a DTensor, all scales are nonzero (not `adapters_disabled`), the A's and B's
share one dtype and the input width, and the dropout in effect is the same p for all; else None (each module runs
its own forward). Unset or 0: off, nothing changes; any value but 0 or 1 is refused.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_qlora.base import switches
from lit_qlora.lora import dropout as lora_dropout
from lit_qlora.lora.layer import LoRALinear
from lit_qlora.nf4 import frozen_linear

ENV = "LIT_QLORA_LORA_GROUPED"


def grouped_enabled() -> bool:
    """Whether the setting asks for grouped LoRA terms (read at every call: a benchmark may flip it in-process)."""
    return switches.enabled(ENV)


def _groupable_module(m: nn.Module) -> bool:
    # A subclass may compute something else (tensor-parallel layers say so with fusable = False); hooks would be
    # skipped, as the group never calls the module.
    if not (isinstance(m, LoRALinear) and getattr(type(m), "fusable", False)):
        return False
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
        return False
    if type(m.lora_dropout) not in (nn.Dropout, nn.Identity):
        return False
    tensors = (m.weight, m.bias, m.lora_A, m.lora_B)
    return m.scale != 0 and not any(t is not None and "DTensor" in (type(t).__name__, type(t.data).__name__)
                                    for t in tensors)


def group_dropout(x: torch.Tensor, modules: Sequence[nn.Module]) -> Optional[float]:
    """The dropout probability the group's adapters share (0.0 in eval or without dropout), or None where the
    modules cannot run as one group."""
    if len(modules) < 2 or not all(_groupable_module(m) for m in modules):
        return None
    if len({t.dtype for m in modules for t in (m.lora_A, m.lora_B)}) != 1:
        return None
    if any(m.lora_A.shape[1] != x.shape[-1] for m in modules):
        return None
    ps = {m.lora_dropout.p if m.training and isinstance(m.lora_dropout, nn.Dropout) else 0.0 for m in modules}
    return ps.pop() if len(ps) == 1 else None


def grouped_projections(x: torch.Tensor, modules: Sequence[nn.Module]) -> Optional[tuple[torch.Tensor, ...]]:
    """``tuple(m(x) for m in modules)`` with the adapters' terms as one group (the module doc), or None where the
    group does not apply."""
    p = group_dropout(x, modules)
    if p is None:
        return None
    return _run_grouped(x, modules, p)


def _run_grouped(x: torch.Tensor, modules: Sequence[nn.Module], p: float) -> tuple[torch.Tensor, ...]:
    bases = [frozen_linear(x, m.weight, m.bias) for m in modules]
    a = torch.cat([m.lora_A for m in modules]).to(x.dtype)  # (sum r, in)
    h = _dropped_down(x, a, p, modules[0].lora_dropout)  # (..., sum r)
    scales = [m.scale for m in modules]
    if len(set(scales)) == 1:  # the usual case (one alpha and r): one multiply of the whole block-diagonal
        blocks = torch.block_diag(*[m.lora_B for m in modules]).to(x.dtype) * scales[0]
    else:
        blocks = torch.block_diag(*[m.lora_B.to(x.dtype) * s for m, s in zip(modules, scales)])
    delta = F.linear(h, blocks)  # (..., sum out)
    parts = delta.split([m.lora_B.shape[0] for m in modules], dim=-1)
    return tuple(base + part for base, part in zip(bases, parts))


def _dropped_down(x: torch.Tensor, a: torch.Tensor, p: float, dropout: nn.Module) -> torch.Tensor:
    """``dropout(x, p) @ a^T`` with one mask for all of a's rows."""
    if p == 0:
        return F.linear(x, a)
    if torch.compiler.is_compiling():  # traced: the hash kernel and the replay's host-side state would break it
        return F.linear(F.dropout(x, p, training=True), a)
    return lora_dropout.dropped_down(x, a, dropout)  # CPU: hash mask; CUDA: replayed; else the module
