"""Model-level NF4: quantize every base linear of a model in place, count them, and save them dequantized."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

from lit_qlora.nf4.codec import dequantize_nf4, is_nf4, quantize_nf4
from lit_qlora.nf4.grouped import ExpertLinear
from lit_qlora.nf4.linear import FrozenNF4Linear


def quantize_weight(weight: torch.Tensor, world_size: int = 1) -> torch.Tensor:
    """NF4 (double-quantized) copy of `weight`, in row chunks so the transient stays near the tensor's size. A stack
    of experts' weights (n_experts, out, in) becomes one (n_experts * out, in) NF4 tensor (ExpertLinear's form)."""
    weight = weight.detach()
    if weight.dim() == 3:
        weight = weight.reshape(-1, weight.size(-1))
    return quantize_nf4(weight, world_size=world_size)


def is_ignored(name: str, ignore_modules: Iterable[str]) -> bool:
    """`name` is one of `ignore_modules` or inside one of them (module-name prefixes)."""
    return any(name == p or name.startswith(p + ".") for p in ignore_modules)


def base_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every base linear with a weight of its own, lm_head included unless it is tied to the embedding (then its
    weight is the embedding's, which is looked up and stays in high precision: the head reads it as it is, no NF4
    copy). LoRA's A and B are Parameters of LoRALinear, never Linear modules.
    A mixture of experts' router (a Linear marked `keeps_precision`) is not one: it stays in high precision, as its
    top-k choice is sensitive to small changes."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and id(m.weight) not in embeddings
            and not getattr(m, "keeps_precision", False)}


def expert_linears(model: nn.Module) -> dict[str, ExpertLinear]:
    """Every stacked expert projection (lit_qlora.nf4.grouped.ExpertLinear) of a mixture of experts."""
    return {n: m for n, m in model.named_modules() if isinstance(m, ExpertLinear)}


def _dequantize_on_save(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    # Saving exposes NF4 weights as plain tensors in the compute dtype, moved to CPU one layer at a time, so a
    # full state dict never raises device memory and safetensors (which cannot store NF4) can write it.
    key = prefix + "weight"
    if key in state_dict and is_nf4(state_dict[key]):
        dense = dequantize_nf4(state_dict[key]).cpu()
        if isinstance(module, ExpertLinear):
            dense = dense.view(module.n_experts, module.out_features, module.in_features)
        state_dict[key] = dense


def quantize_linears(model: nn.Module, ignore_modules: Iterable[str] = (), world_size: int = 1) -> int:
    """NF4-quantize every base linear still in high precision (in place); returns how many were quantized.

    A head tied to the embedding stays tied: it reads the embedding's high-precision weight (base_linears).
    """
    ignore_modules = tuple(ignore_modules)
    count = 0
    for name, linear in base_linears(model).items():
        if is_ignored(name, ignore_modules):
            continue
        if not is_nf4(linear.weight):
            linear.weight = nn.Parameter(quantize_weight(linear.weight, world_size), requires_grad=False)
            count += 1
        if type(linear) is nn.Linear:
            linear.__class__ = FrozenNF4Linear  # same parameters, fast forward
        _hook_save(linear)
    for name, experts in expert_linears(model).items():
        if is_ignored(name, ignore_modules):
            continue
        if not is_nf4(experts.weight):
            experts.weight = nn.Parameter(quantize_weight(experts.weight, world_size), requires_grad=False)
            count += experts.n_experts
        _hook_save(experts)
    return count


def _hook_save(module: nn.Module) -> None:
    if not getattr(module, "_nf4_save_hook", False):
        module._register_state_dict_hook(_dequantize_on_save)
        module._nf4_save_hook = True


def count_linears(model: nn.Module) -> tuple[int, int]:
    """(NF4 base linears, all base linears), lm_head included, adapters excluded; each expert's projection counts as
    one linear."""
    linears = base_linears(model).values()
    experts = expert_linears(model).values()
    return (sum(is_nf4(m.weight) for m in linears) + sum(m.n_experts for m in experts if is_nf4(m.weight)),
            len(linears) + sum(m.n_experts for m in experts))
