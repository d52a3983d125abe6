"""What every adapter layer sets up the same way (LoRALinear, LoRAExpertLinear): its rank and scale, and the dtype
its factors are made in."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from lit_qlora.base.errors import InvalidInput
from lit_qlora.nf4 import is_nf4


def set_rank(layer: nn.Module, r: int, alpha: float, rslora: bool, weight: torch.Tensor,
             dtype: Optional[torch.dtype]) -> torch.dtype:
    """Give `layer` r, alpha, rslora and scale (alpha / r, or alpha / sqrt(r) with rsLoRA: stable updates at large
    ranks); returns the factors' dtype: `dtype`, else the base's (bf16 over an NF4 base)."""
    if r <= 0:
        raise InvalidInput(f"LoRA rank r (--lora.r) must be positive, got {r}.")
    layer.r, layer.alpha, layer.rslora = r, alpha, rslora
    layer.scale = lora_scale(r, alpha, rslora)
    if dtype is None:
        dtype = weight.dtype if not is_nf4(weight) else torch.bfloat16
    return dtype


def lora_scale(r: int, alpha: float, rslora: bool = False) -> float:
    """What an adapter's product is scaled by: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / math.sqrt(r) if rslora else alpha / r
