"""Rotary position embeddings of a config: the inverse frequencies of the rotated dims under each scaling transformers
knows (default, linear, Llama 3, Phi-3's longrope, YaRN), how many dims rotate, and longrope's and YaRN's attention
factor."""

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
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, scaling, dim, base)
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


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: dict, dim: int, base: float) -> torch.Tensor:
    """YaRN: dims that turn many times within the pretraining length keep their frequency, those that turn less
    than once are divided by `factor`, a linear ramp between (bounds from beta_fast and beta_slow rotations,
    rounded outwards unless `truncate` is false), as transformers computes it."""
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each dim's own (extrapolated) frequency
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def rotary_dim(config: Config) -> int:
    return int(config.head_dim * config.partial_rotary_factor)


def rope_attention_factor(config: Config) -> float:
    """longrope scales cos and sin by sqrt(1 + ln(s) / ln(L)), s the context extension over the pretraining length
    L (unless the config gives attention_factor); 1 otherwise."""
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn":
        return _yarn_attention_factor(scaling, config)
    if kind != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_seq_length / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_attention_factor(scaling: dict, config: Config) -> float:
    """YaRN scales cos and sin by 0.1 ln(factor) + 1 (or the ratio of two such with mscale and mscale_all_dim)
    unless the config gives attention_factor."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling.get("factor") or config.max_seq_length / scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)
