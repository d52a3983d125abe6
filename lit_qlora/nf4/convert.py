"""Model-level NF4: quantize every base linear of a model in place, count them, and save them dequantized."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

from lit_qlora.nf4.codec import dequantize_nf4, is_nf4, quantize_nf4
from lit_qlora.nf4.linear import FrozenNF4Linear


def quantize_weight(weight: torch.Tensor, world_size: int = 1) -> torch.Tensor:
    """NF4 (double-quantized) copy of `weight`, in row chunks so the transient stays near the tensor's size."""
    return quantize_nf4(weight.detach(), world_size=world_size)


def is_ignored(name: str, ignore_modules: Iterable[str]) -> bool:
    """`name` is one of `ignore_modules` or inside one of them (module-name prefixes)."""
    return any(name == p or name.startswith(p + ".") for p in ignore_modules)


def base_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every base linear, lm_head included; LoRA's A and B are Parameters of LoRALinear, never Linear modules."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _dequantize_on_save(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    # Saving exposes NF4 weights as plain tensors in the compute dtype, moved to CPU one layer at a time, so a
    # full state dict never raises device memory and safetensors (which cannot store NF4) can write it.
    key = prefix + "weight"
    if key in state_dict and is_nf4(state_dict[key]):
        state_dict[key] = dequantize_nf4(state_dict[key]).cpu()


def quantize_linears(model: nn.Module, ignore_modules: Iterable[str] = (), world_size: int = 1) -> int:
    """NF4-quantize every base linear still in high precision (in place); returns how many were quantized.

    With tied embeddings the embedding stays in high precision and the head gets its own NF4 copy.
    """
    ignore_modules = tuple(ignore_modules)
    count = 0
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    for name, linear in base_linears(model).items():
        if is_ignored(name, ignore_modules):
            continue
        if not is_nf4(linear.weight):
            linear.weight = nn.Parameter(quantize_weight(linear.weight, world_size), requires_grad=False)
            count += 1
        if type(linear) is nn.Linear:
            linear.__class__ = FrozenNF4Linear  # same parameters, fast forward
        if not getattr(linear, "_nf4_save_hook", False):
            linear._register_state_dict_hook(_dequantize_on_save)
            linear._nf4_save_hook = True
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    if config is not None and config.tie_embeddings and head is not None and is_nf4(head.weight):
        if embedding is not None and embedding.weight is not head.weight:
            model.config = config.replace(tie_embeddings=False)  # the head is a weight of its own now
            model.head_tied_in_checkpoint = True  # a GGUF writes it tied again while unadapted (gguf_export.gguf_config)
    return count


def count_linears(model: nn.Module) -> tuple[int, int]:
    """(NF4 base linears, all base linears), lm_head included, adapters excluded."""
    linears = base_linears(model).values()
    return sum(is_nf4(m.weight) for m in linears), len(linears)
