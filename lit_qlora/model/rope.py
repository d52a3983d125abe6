"""Rotary position embeddings of a config: the inverse frequencies of the rotated dims under each scaling transformers
knows (default, linear, Llama 3, Phi-3's longrope), how many dims rotate, and longrope's attention factor."""

from __future__ import annotations

import math

import torch

from lit_qlora.model.config import Config


def rope_inv_freq(config: Config, device=None, sliding: bool = False, long: bool = False):
    """RoPE inverse frequencies of the rotated dims, scaled as transformers does (Llama 3, linear, Phi-3's longrope:
    its `long` factors past the pretraining length, else the short ones). Gemma 3's sliding layers use their own
    unscaled base."""
    dim = rotary_dim(config)
    local = sliding and config.rope_local_base is not None
    base = config.rope_local_base if local else config.rope_base
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    scaling = None if local else config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float32, device=device)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_dim(config: Config) -> int:
    return int(config.head_dim * config.partial_rotary_factor)


def rope_attention_factor(config: Config) -> float:
    """longrope scales cos and sin by sqrt(1 + ln(s) / ln(L)), s the context extension over the pretraining length
    L (unless the config gives attention_factor); 1 otherwise."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_seq_length / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
