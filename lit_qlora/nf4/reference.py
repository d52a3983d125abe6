"""The NF4 format as torchao 0.18 defines it, and the PyTorch path that computes it (any device, no compiler).

The format, as reproduced here:

* the tensor is flattened row-major and cut into ``n_blocks = numel / block_size`` blocks;
  ``s_b = max |w|`` over block ``b`` (in the weight's dtype ``D``);
* every element is replaced by the index of the nearest of 16 NF4 levels (``NF4_LEVELS`` rounded to ``D``)
  to ``w / s_b`` (the division rounded to ``D``; "nearest" compares the ``D``-rounded distances
  ``|v - level|`` and takes the lowest index on ties; NaN maps to code 0); two codes per byte, first element
  in the high nibble: ``quantized_data`` (uint8, numel/2);
* double quantization of the block scales: ``m = mean(s)`` over the *whole* tensor (``scaler_mean``, 0-dim,
  ``D``); ``s - m`` is cut into groups of ``scaler_block_size`` scales; per group
  ``quantization_factor = 256 / (2 * max|s - m|)`` (``D``, one per group) and
  ``quantized_scalers = clamp(round((s - m) * factor), -128, 127)`` (int8, one per block);
* dequantize: ``level[code] * ((quantized_scalers / factor) + m)``, every step rounded to ``D``.

Because of the global mean, chunked quantization first computes all block absmax values, then the double
quantization on that small tensor with the same torch ops torchao uses, so every bit matches. The codes come
from 15 decision thresholds (or here, per-bit-pattern tables) derived from that reference search itself: not
the exact midpoints between levels, since the ``D``-rounded distances tie near the midpoints and ties go to
the lower level. For 16-bit dtypes they are checked against all 65536 values. The lookups are vectorized
PyTorch ops (table lookups instead of torchao's 16-way argmin). ``torch.compile`` of the lookup was measured
too: CPU inductor emits scalar code for the table gather and it is slower than this path, so it is not used.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

#: The 16 NF4 levels (QLoRA's normal-float code book, rounded to 4 decimals as torchao stores them).
#: They are rounded to the weight's dtype before use, exactly like torchao's ``NF4Tensor.nf4`` table.
NF4_LEVELS: tuple[float, ...] = (
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
)  # fmt: skip

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements per quantization chunk: small enough that the chunk's temporaries (~20 bytes per element) stay
# in cache, large enough that per-op overhead does not matter.
QUANT_CHUNK_ELEMS = 1 << 18
_DEQUANT_CHUNK_BYTES = 1 << 18
# On a GPU the same ops are bound by kernel launches, not cache: 256 KB chunks made an 8B QLoRA step launch ~100k
# kernels (17.7 s on an H100 against LoRA's 0.66 s). Chunks of 16M values keep the int64/int32 temporaries
# bounded (64-128 MB) and a weight to a few launches.
GPU_CHUNK_ELEMS = 1 << 24


def quant_chunk_elems(device: torch.device) -> int:
    return QUANT_CHUNK_ELEMS if device.type == "cpu" else GPU_CHUNK_ELEMS


def _dequant_chunk_bytes(device: torch.device) -> int:
    return _DEQUANT_CHUNK_BYTES if device.type == "cpu" else GPU_CHUNK_ELEMS // 2

T = TypeVar("T")
_TABLE_CACHE: dict = {}
_TABLE_LOCK = threading.RLock()


def cached(key, build: Callable[[], T]) -> T:
    """``build()`` once per ``key`` for the process (thread-safe): the tables cost seconds to derive."""
    value = _TABLE_CACHE.get(key)
    if value is None:
        with _TABLE_LOCK:
            value = _TABLE_CACHE.get(key)
            if value is None:
                value = _TABLE_CACHE[key] = build()
    return value


def level_table(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(NF4_LEVELS, dtype=dtype, device=device)


def _nearest_code(values: torch.Tensor) -> torch.Tensor:
    """Reference nearest-level search in ``values.dtype`` (lowest index on ties, NaN -> 0). Slow; tables only."""
    levels = level_table(values.dtype, values.device)
    return (values.unsqueeze(-1) - levels).abs().min(dim=-1).indices


def _f32_from_ordinal(o: int) -> float:
    # total order on float32 bit patterns: negative ordinals are negative floats
    bits = o if o >= 0 else ((-o) | 0x80000000)
    return torch.tensor([bits - (1 << 32) if bits >= (1 << 31) else bits], dtype=torch.int32).view(torch.float32).item()


def _f32_ordinal(x: float) -> int:
    b = torch.tensor([x], dtype=torch.float32).view(torch.int32).item()
    return b if b >= 0 else -(b & 0x7FFFFFFF)


def thresholds(dtype: torch.dtype) -> tuple[float, ...]:
    """The 15 decision thresholds: ``code(v) = #{i : v >= thr[i]}`` for every ``dtype`` value v in [-1, 1].

    ``thr[i-1]`` is the smallest ``dtype`` value whose reference code is >= i. The reference (distances
    rounded to ``dtype``, lowest index on ties) is monotone on [-1, 1]; for 16-bit dtypes this is checked
    against all 65536 bit patterns; NaN compares false everywhere and gets code 0 like the reference.
    """

    def build() -> tuple[float, ...]:
        if dtype == torch.float32:

            def code(x: float) -> int:
                return int(_nearest_code(torch.tensor([x], dtype=torch.float32)).item())

            lo0, hi0 = _f32_ordinal(-1.0), _f32_ordinal(1.0)
            thr = []
            for i in range(1, 16):
                lo, hi = lo0, hi0  # code(lo) < i <= code(hi)
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if code(_f32_from_ordinal(mid)) >= i:
                        hi = mid
                    else:
                        lo = mid
                thr.append(_f32_from_ordinal(hi))
            return tuple(thr)
        lut = _code_lut16(dtype)
        values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype).float()
        inside = values.abs() <= 1  # excludes NaN and inf
        thr = tuple(values[inside & (lut >= i)].min().item() for i in range(1, 16))
        formula = (values.unsqueeze(1) >= torch.tensor(thr, dtype=torch.float32)).sum(1)
        check = inside | values.isnan()
        if not torch.equal(formula[check], lut[check].long()):  # pragma: no cover - NF4 levels are fixed
            raise AssertionError(f"NF4 codes are not monotone in {dtype}")
        return thr

    return cached(("thr", dtype), build)


def _code_lut16(dtype: torch.dtype) -> torch.Tensor:
    """uint8 code of each of the 65536 bit patterns of a 16-bit dtype (index = the pattern, unsigned)."""

    def build() -> torch.Tensor:
        patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
        return _nearest_code(patterns).to(torch.uint8)

    return cached(("lut16", dtype), build)


def _f32_bucket_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """float32 codes by table: the top 16 bits pick a bucket holding at most one threshold (for [-1, 1])."""

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        thr = torch.tensor((float("-inf"),) + thresholds(torch.float32) + (float("inf"),), dtype=torch.float32)
        top = torch.arange(65536, dtype=torch.int64)  # unsigned top-16-bit pattern
        signed = torch.where(top >= 32768, top - 65536, top) << 16
        first = signed.to(torch.int32).view(torch.float32)  # low 16 bits all 0
        last = (signed | 0xFFFF).to(torch.int32).view(torch.float32)  # low 16 bits all 1
        finite = torch.isfinite(first) & torch.isfinite(last)
        # w / absmax lies in [-1, 1] (or is NaN): clamp, so that buckets beyond +-1 get the end codes
        lo_v = torch.minimum(first, last).clamp(-1.0, 1.0)
        hi_v = torch.maximum(first, last).clamp(-1.0, 1.0)
        c_lo = (lo_v.unsqueeze(1) >= thr[1:16]).sum(1)
        c_hi = (hi_v.unsqueeze(1) >= thr[1:16]).sum(1)
        if bool(((c_hi - c_lo)[finite] > 1).any()):  # pragma: no cover - impossible for NF4's spacing
            raise AssertionError("two NF4 thresholds fall in one float32 bucket")
        base = torch.where(finite, c_lo, torch.zeros_like(c_lo)).to(torch.uint8)  # NaN -> 0
        bucket_thr = torch.where(finite & (c_hi > c_lo), thr[(c_lo + 1).clamp(max=16)], thr[16])
        return base, bucket_thr

    return cached(("f32buckets",), build)


def _code_tables(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Tables for :func:`_codes_of` on ``device``."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"NF4 quantization supports {SUPPORTED_DTYPES}, got {dtype}")

    def build() -> tuple[torch.Tensor, ...]:
        tables = _f32_bucket_tables() if dtype == torch.float32 else (_code_lut16(dtype),)
        return tuple(t.to(device) for t in tables)

    return cached(("tables", dtype, str(device)), build)


def _codes_of(q: torch.Tensor, tables: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """NF4 code (uint8) of every element of ``q`` (already divided by its block absmax).

    16-bit: ``lut[bits]`` (the bits read as int16; ``torch.take`` wraps negative indices to the unsigned
    pattern). float32: ``base[top16] + (q >= threshold[top16])``.
    """
    if q.dtype == torch.float32:
        base, thr = tables
        top = (q.view(torch.int32) >> 16).long()
        return torch.take(base, top) + (q >= torch.take(thr, top))
    return torch.take(tables[0], q.view(torch.int16).long())


def quantize_eager(chunk: torch.Tensor, block_size: int, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """One chunk of whole blocks: absmax -> ``s_out``, packed codes -> ``q_out``."""
    dtype = chunk.dtype
    blocks = chunk.view(-1, block_size)
    # absmax per block: exact in any precision, float32 is the fast path on CPU
    if dtype == torch.float32:
        absmax = blocks.abs().amax(dim=1)
    else:
        absmax = blocks.float().abs_().amax(dim=1).to(dtype)
    s_out.copy_(absmax)
    # same op and broadcast as the reference: (blocks / scales) rounded to dtype (0/0 -> NaN -> code 0)
    scaled = blocks / absmax.unsqueeze(-1)
    codes = _codes_of(scaled, _code_tables(dtype, chunk.device)).view(-1, 2)
    torch.bitwise_or(codes[:, 0] << 4, codes[:, 1], out=q_out)


def double_quantize(scalers: torch.Tensor, scaler_block_size: int) -> tuple[torch.Tensor, ...]:
    """int8-quantize the block absmax values per group around their global mean (torchao's exact ops):
    ``(quantized_scalers, quantization_factor, scaler_mean)``."""
    scaler_mean = scalers.mean()
    centered = scalers - scaler_mean
    groups = centered.view(-1, scaler_block_size)
    group_absmax = groups.abs().amax(dim=1, keepdim=True)
    factor = 256 / (2 * group_absmax)  # same expression as torchao (Tensor.__rtruediv__: reciprocal * 256)
    quantized = (groups * factor).round().clamp(-128, 127).to(torch.int8).flatten()
    return quantized, factor.view(-1).contiguous(), scaler_mean


def dequantize_scalers(quantized_scalers: torch.Tensor, quantization_factor: torch.Tensor,
                       scaler_mean: torch.Tensor, scaler_block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-block scales in ``dtype``, computed with the same ops as torchao's dequantize_scalers."""
    groups = quantized_scalers.view(-1, scaler_block_size)
    return (groups / quantization_factor.unsqueeze(-1)).flatten().to(dtype) + scaler_mean


def _pair_table(levels: torch.Tensor) -> torch.Tensor:
    """(256,) table: byte -> the two levels it encodes (high nibble first), packed as one int32/int64."""
    hi = levels.repeat_interleave(16)
    lo = levels.repeat(16)
    pairs = torch.stack([hi, lo], dim=1).contiguous()
    return pairs.view(torch.int32 if levels.element_size() == 2 else torch.int64).view(256)


def dequantize_eager(qdata: torch.Tensor, scales: torch.Tensor, levels: torch.Tensor, out: torch.Tensor) -> None:
    """Vectorized PyTorch dequantize into ``out`` (contiguous, flat, ``levels.dtype``)."""
    table = _pair_table(levels)
    n_bytes = qdata.numel()
    block_bytes = n_bytes // scales.numel()
    step = max(block_bytes, (_dequant_chunk_bytes(qdata.device) // block_bytes) * block_bytes)
    packed_out = out.view(table.dtype)
    for a in range(0, n_bytes, step):
        b = min(n_bytes, a + step)
        torch.index_select(table, 0, qdata[a:b].int(), out=packed_out[a:b])
        vals = out[2 * a : 2 * b].view(-1, 2 * block_bytes)
        vals.mul_(scales[a // block_bytes : b // block_bytes].unsqueeze(-1))
