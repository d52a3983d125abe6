"""Fast NF4 quantize / dequantize that produce and consume torchao ``NF4Tensor`` objects.

torchao's :class:`~torchao.quantization.NF4Tensor` stays the storage format (its FSDP2 hooks, aten ops and
state-dict handling keep working); only the hot paths are ours (CPU numbers: benchmarks/nf4_kernels.py):

* :func:`quantize_nf4` builds an ``NF4Tensor`` whose inner tensors are bit-for-bit what
  ``torchao.quantization.to_nf4(w, block_size, scaler_block_size)`` builds, 55-75x faster on CPU (18-25x on
  the PyTorch fallback), with a transient of ~0.3x the bf16 input (torchao: ~2.1x) because nothing of
  the input's size is ever materialized (row chunks on the fallback).
* :func:`dequantize_nf4` returns exactly ``NF4Tensor.get_original_weight()`` (same bits), 15-20x faster on
  CPU (8-10x on the PyTorch fallback).
* ``rows=`` dequantizes a block-aligned slice of rows, which :mod:`lit_qlora.nf4_linear` uses to keep the
  dense copy of a large weight (an lm_head) small.
* :func:`nf4_layout` picks a ``scaler_block_size`` that makes any real layer shape quantizable (torchao needs
  ``numel % (block_size * scaler_block_size) == 0``) and shardable along dim 0 by FSDP2.

On CPU the work runs in a small C kernel (gcc vector extensions: a per-block 16-entry table looked up with a
vector permute) compiled with ``gcc -O3 -march=native`` on first use, cached per CPU under
``~/.cache/lit_qlora/kernels``, split across ``torch.get_num_threads()`` threads and checked against the
PyTorch path before it is trusted. Without gcc (or with ``LIT_QLORA_NF4_BACKEND=eager``), and on other
devices, vectorized PyTorch ops do the same computation (table lookups instead of torchao's 16-way argmin).
``torch.compile`` of the lookup was measured too: CPU inductor emits scalar code for the table gather and
it is slower than the PyTorch fallback, so it is not used.

The NF4 format (torchao 0.18), as reproduced here:

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
from 15 decision thresholds (or, on the fallback, per-bit-pattern tables) derived from that reference search
itself: not the exact midpoints between levels, since the ``D``-rounded distances tie near the midpoints
and ties go to the lower level. For 16-bit dtypes they are checked against all 65536 values.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
from torchao.quantization import NF4Tensor
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import SubclassTensorArgs

__all__ = [
    "NF4_LEVELS",
    "NF4Layout",
    "nf4_layout",
    "quantize_nf4",
    "dequantize_nf4",
    "nf4_linear",
    "NF4Linear",
    "nf4_nbytes",
    "nf4_backend",
    "clone_nf4",
]

log = logging.getLogger(__name__)

#: The 16 NF4 levels (QLoRA's normal-float code book, rounded to 4 decimals as torchao stores them).
#: They are rounded to the weight's dtype before use, exactly like torchao's ``NF4Tensor.nf4`` table.
NF4_LEVELS: Tuple[float, ...] = (
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
)  # fmt: skip

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements per quantization chunk: small enough that the chunk's temporaries (~20 bytes per element) stay
# in cache, large enough that per-op overhead does not matter.
_QUANT_CHUNK_ELEMS = 1 << 18
_DEQUANT_CHUNK_BYTES = 1 << 18


# ----------------------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------------------
class NF4Layout(NamedTuple):
    """``(block_size, scaler_block_size)`` to pass to :func:`quantize_nf4` or torchao's ``to_nf4``."""

    block_size: int
    scaler_block_size: int


def _divisors(n: int) -> list[int]:
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def _check_layout(shape: Sequence[int], block_size: int, scaler_block_size: int, world_size: int) -> None:
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (1, 2):
        raise ValueError(f"NF4 quantizes 1-D or 2-D tensors, got shape {shape}")
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size must be a positive even number, got {block_size}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    numel = math.prod(shape)
    if numel == 0 or numel % block_size:
        raise ValueError(
            f"cannot quantize shape {shape} to NF4: numel {numel} is not a multiple of block_size {block_size}; "
            "NF4 needs whole blocks (pad the tensor, e.g. in_features, to a multiple of the block size)"
        )
    n_blocks = numel // block_size
    if scaler_block_size <= 0 or n_blocks % scaler_block_size:
        raise ValueError(
            f"scaler_block_size {scaler_block_size} does not divide the {n_blocks} blocks of shape {shape} "
            f"(block_size {block_size}); use nf4_layout() to pick one"
        )
    if world_size > 1:
        if shape[0] % world_size:
            raise ValueError(
                f"shape {shape} cannot be sharded along dim 0 across {world_size} ranks: {shape[0]} rows are "
                "not divisible by the world size (FSDP2 would pad the last shard, which NF4Tensor cannot hold)"
            )
        if n_blocks % world_size:
            raise ValueError(
                f"shape {shape} cannot be sharded along dim 0 across {world_size} ranks: a shard of "
                f"{shape[0] // world_size} rows holds a fraction of a {block_size}-element block"
            )
        if (n_blocks // scaler_block_size) % world_size:
            raise ValueError(
                f"shape {shape}: {n_blocks // scaler_block_size} scaler blocks cannot be split evenly across "
                f"{world_size} ranks (scaler_block_size {scaler_block_size}); use nf4_layout(world_size=...)"
            )


def nf4_layout(
    shape: Sequence[int],
    block_size: int = 64,
    scaler_block_size: int = 256,
    world_size: int = 1,
    *,
    min_scaler_block_size: int = 8,
) -> NF4Layout:
    """Choose the NF4 layout for a weight of ``shape`` so that it quantizes without padding and shards.

    ``to_nf4`` needs ``numel % (block_size * scaler_block_size) == 0``. ``block_size`` (elements per absmax
    scale, 64 in QLoRA) is kept; the ``scaler_block_size`` (number of blocks whose scales share one
    double-quantization factor) is chosen among the divisors ``d`` of ``n_blocks / world_size`` as the one
    closest to the requested value on a log scale (the requested value itself when it divides; on a tie the
    smaller one, i.e. finer double quantization). Divisors below ``min_scaler_block_size`` are only used
    when nothing else exists: below 8 the per-group factors push storage above ~0.52 bytes/parameter.
    A divisor always exists (``n_blocks / world_size`` itself: one group per shard), e.g. for a prime block
    count, so every shape whose numel is a multiple of ``block_size`` gets a layout.

    FSDP2 rule (torchao 0.18's ``NF4Tensor``): FSDP2 shards a parameter with ``torch.chunk(dim=0)``
    (``aten.split``), ``new_zeros`` for the padded shard, ``narrow``/``copy_`` and ``view(-1)``; NF4Tensor
    implements these by splitting ``quantized_data``, ``quantized_scalers`` and ``quantization_factor``
    into ``world_size`` equal flat pieces (``scaler_mean`` and ``nf4`` are replicated, and ``n_blocks`` and
    ``scaler_block_size`` are kept). The pieces line up with whole rows and whole scaler groups only if

    * ``shape[0] % world_size == 0`` (an uneven dim-0 split makes FSDP2 pad, which NF4Tensor cannot do), and
    * ``(n_blocks / scaler_block_size) % world_size == 0`` (every shard holds whole scaler groups).

    The all-gather (``fsdp_pre/post_all_gather``) concatenates the same three tensors, so a layout valid
    for ``world_size`` N is valid for every divisor of N. Quantize the *full* tensor and then shard
    (``scaler_mean`` is the mean over the whole tensor).

    Raises ``ValueError`` (never silently skips) when ``numel`` is not a multiple of ``block_size``, or
    ``shape[0]`` is not a multiple of ``world_size``, or a dim-0 shard would hold a fraction of a block.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (1, 2):
        raise ValueError(f"NF4 quantizes 1-D or 2-D tensors, got shape {shape}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    _check_layout(shape, block_size, 1, world_size)  # whole blocks, whole blocks per dim-0 shard
    n_blocks = math.prod(shape) // block_size
    per_rank = n_blocks // world_size
    target = max(1, int(scaler_block_size))
    divisors = _divisors(per_rank)
    candidates = [d for d in divisors if d >= min_scaler_block_size] or divisors
    best = min(candidates, key=lambda d: (abs(math.log(d / target)), d))
    _check_layout(shape, block_size, best, world_size)
    return NF4Layout(block_size, best)


# ----------------------------------------------------------------------------------------------------------
# Quantize
# ----------------------------------------------------------------------------------------------------------
def _level_table(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(NF4_LEVELS, dtype=dtype, device=device)


def _nearest_code(values: torch.Tensor) -> torch.Tensor:
    """Reference nearest-level search in ``values.dtype`` (lowest index on ties, NaN -> 0). Slow; tables only."""
    levels = _level_table(values.dtype, values.device)
    return (values.unsqueeze(-1) - levels).abs().min(dim=-1).indices


_TABLE_CACHE: dict = {}
_TABLE_LOCK = threading.RLock()


def _cached(key, build):
    value = _TABLE_CACHE.get(key)
    if value is None:
        with _TABLE_LOCK:
            value = _TABLE_CACHE.get(key)
            if value is None:
                value = _TABLE_CACHE[key] = build()
    return value


def _f32_from_ordinal(o: int) -> float:
    # total order on float32 bit patterns: negative ordinals are negative floats
    bits = o if o >= 0 else ((-o) | 0x80000000)
    return torch.tensor([bits - (1 << 32) if bits >= (1 << 31) else bits], dtype=torch.int32).view(torch.float32).item()


def _f32_ordinal(x: float) -> int:
    b = torch.tensor([x], dtype=torch.float32).view(torch.int32).item()
    return b if b >= 0 else -(b & 0x7FFFFFFF)


def _thresholds(dtype: torch.dtype) -> Tuple[float, ...]:
    """The 15 decision thresholds: ``code(v) = #{i : v >= thr[i]}`` for every ``dtype`` value v in [-1, 1].

    ``thr[i-1]`` is the smallest ``dtype`` value whose reference code is >= i. The reference (distances
    rounded to ``dtype``, lowest index on ties) is monotone on [-1, 1]; for 16-bit dtypes this is checked
    against all 65536 bit patterns; NaN compares false everywhere and gets code 0 like the reference.
    """

    def build() -> Tuple[float, ...]:
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
        formula = (values.unsqueeze(1) >= torch.tensor(thr)).sum(1)
        check = inside | values.isnan()
        if not torch.equal(formula[check], lut[check].long()):  # pragma: no cover - NF4 levels are fixed
            raise AssertionError(f"NF4 codes are not monotone in {dtype}")
        return thr

    return _cached(("thr", dtype), build)


def _code_lut16(dtype: torch.dtype) -> torch.Tensor:
    """uint8 code of each of the 65536 bit patterns of a 16-bit dtype (index = the pattern, unsigned)."""

    def build() -> torch.Tensor:
        patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
        return _nearest_code(patterns).to(torch.uint8)

    return _cached(("lut16", dtype), build)


def _f32_bucket_tables() -> Tuple[torch.Tensor, torch.Tensor]:
    """float32 codes by table: the top 16 bits pick a bucket holding at most one threshold (for [-1, 1])."""

    def build() -> Tuple[torch.Tensor, torch.Tensor]:
        thr = torch.tensor((float("-inf"),) + _thresholds(torch.float32) + (float("inf"),))
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

    return _cached(("f32buckets",), build)


def _code_tables(dtype: torch.dtype, device: torch.device) -> Tuple[torch.Tensor, ...]:
    """Tables for :func:`_codes_of` on ``device``."""
    if dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"NF4 quantization supports {_SUPPORTED_DTYPES}, got {dtype}")

    def build() -> Tuple[torch.Tensor, ...]:
        tables = _f32_bucket_tables() if dtype == torch.float32 else (_code_lut16(dtype),)
        return tuple(t.to(device) for t in tables)

    return _cached(("tables", dtype, str(device)), build)


def _codes_of(q: torch.Tensor, tables: Tuple[torch.Tensor, ...]) -> torch.Tensor:
    """NF4 code (uint8) of every element of ``q`` (already divided by its block absmax).

    16-bit: ``lut[bits]`` (the bits read as int16; ``torch.take`` wraps negative indices to the unsigned
    pattern). float32: ``base[top16] + (q >= threshold[top16])``.
    """
    if q.dtype == torch.float32:
        base, thr = tables
        top = (q.view(torch.int32) >> 16).long()
        return torch.take(base, top) + (q >= torch.take(thr, top))
    return torch.take(tables[0], q.view(torch.int16).long())


def _chunk_rows(cols: int, block_size: int, chunk_rows: Optional[int]) -> int:
    unit = block_size // math.gcd(cols, block_size)  # rows per chunk must hold whole blocks
    if chunk_rows is None:
        chunk_rows = _QUANT_CHUNK_ELEMS // max(cols, 1)
    return max(unit, (int(chunk_rows) // unit) * unit)


@torch.compiler.disable  # raw-pointer kernels: dynamo must not trace (it would lose the writes)
@torch.no_grad()
def quantize_nf4(
    weight: torch.Tensor,
    block_size: int = 64,
    scaler_block_size: Optional[int] = None,
    world_size: int = 1,
    chunk_rows: Optional[int] = None,
    *,
    native: Optional[bool] = None,
) -> NF4Tensor:
    """Quantize ``weight`` (1-D or 2-D, bf16/fp16/fp32) to a torchao ``NF4Tensor``.

    The result's ``quantized_data``, ``quantized_scalers``, ``quantization_factor``, ``scaler_mean``,
    ``nf4``, ``block_size``, ``scaler_block_size``, ``n_blocks``, shape and dtype are identical to
    ``torchao.quantization.to_nf4(weight, block_size, scaler_block_size)``.

    ``scaler_block_size=None`` picks the layout with :func:`nf4_layout` (256 where it divides, else the
    nearest divisor; ``world_size`` makes the layout shardable along dim 0 by FSDP2). An explicit
    ``scaler_block_size`` that does not fit raises ``ValueError``.

    Memory: besides the result (0.52 bytes/param) and its block scales (2 bytes per 64 params), the C kernel
    allocates nothing; the PyTorch path works ``chunk_rows`` rows at a time (default ~256K elements), so only
    one chunk's temporaries are alive. A non-contiguous ``weight`` is copied one chunk at a time. The
    wrapper metadata has contiguous strides and storage offset 0 (torchao copies the input's strides and
    offset) and the input's ``requires_grad`` (as torchao).

    ``native`` forces (True) or avoids (False) the C kernel; default: used on CPU when it compiled.
    """
    if not isinstance(weight, torch.Tensor) or isinstance(weight, NF4Tensor):
        raise TypeError(f"quantize_nf4 expects a dense torch.Tensor, got {type(weight).__name__}")
    dtype = weight.dtype
    if dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"NF4 quantization supports {_SUPPORTED_DTYPES}, got {dtype}")
    shape = tuple(weight.shape)
    if scaler_block_size is None:
        block_size, scaler_block_size = nf4_layout(shape, block_size, 256, world_size)
    else:
        _check_layout(shape, block_size, int(scaler_block_size), world_size)
    scaler_block_size = int(scaler_block_size)

    device = weight.device
    numel = weight.numel()
    n_blocks = numel // block_size
    w2d = weight.reshape(shape[0], -1) if weight.dim() == 2 else weight.reshape(-1, 1)
    rows, cols = w2d.shape
    quantized_data = torch.empty(numel // 2, dtype=torch.uint8, device=device)
    scalers = torch.empty(n_blocks, dtype=dtype, device=device)
    if native is None:
        native = device.type == "cpu" and _use_native(dtype)
    elif native and (device.type != "cpu" or _native_lib() is None or not _use_native(dtype)):
        raise RuntimeError(f"native NF4 kernels unavailable ({device}, {dtype}): {_native_state['error']}")
    contiguous = weight.is_contiguous()
    if native and contiguous:
        _quantize_native(weight.reshape(-1), block_size, quantized_data, scalers)
    else:
        step = _chunk_rows(cols, block_size, chunk_rows)
        flat = weight.reshape(-1) if contiguous else None
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            e0, e1 = r0 * cols, r1 * cols
            chunk = flat[e0:e1] if contiguous else w2d[r0:r1].reshape(-1)  # copies one chunk at most
            q_out = quantized_data[e0 // 2 : e1 // 2]
            s_out = scalers[e0 // block_size : e1 // block_size]
            if native:
                _quantize_native(chunk, block_size, q_out, s_out)
            else:
                _quantize_eager(chunk, block_size, q_out, s_out)
            del chunk

    quantized_scalers, quantization_factor, scaler_mean = _double_quantize(scalers, scaler_block_size)
    meta = SubclassTensorArgs(
        torch.Size(shape),
        (cols, 1) if weight.dim() == 2 else (1,),
        0,
        dtype,
        device,
        weight.requires_grad,
    )
    return NF4Tensor(
        meta,
        block_size,
        n_blocks,
        scaler_block_size,
        quantized_scalers,
        quantization_factor,
        scaler_mean,
        quantized_data,
        _level_table(dtype, device),
    )


def _quantize_eager(chunk: torch.Tensor, block_size: int, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """PyTorch path for one chunk of whole blocks: absmax -> ``s_out``, packed codes -> ``q_out``."""
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


def _quantize_native(src: torch.Tensor, block_size: int, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """C kernel over a contiguous run of whole blocks (threads split the blocks)."""
    lib = _native_state["lib"]
    thr = _cached(("thr_tensor", src.dtype), lambda: torch.tensor(_thresholds(src.dtype), dtype=torch.float32))
    fmt = _FMT[src.dtype]
    n_blocks = s_out.numel()
    ptrs = (src.data_ptr(), thr.data_ptr(), q_out.data_ptr(), s_out.data_ptr())

    def call(b0: int, b1: int) -> None:
        lib.nf4_quantize(ptrs[0], b0, b1, block_size, ptrs[1], ptrs[2], ptrs[3], fmt)

    _run_blocks(call, n_blocks, src.numel() * src.element_size())


def _double_quantize(scalers: torch.Tensor, scaler_block_size: int) -> Tuple[torch.Tensor, ...]:
    """int8-quantize the block absmax values per group around their global mean (torchao's exact ops)."""
    scaler_mean = scalers.mean()
    centered = scalers - scaler_mean
    groups = centered.view(-1, scaler_block_size)
    group_absmax = groups.abs().amax(dim=1, keepdim=True)
    factor = 256 / (2 * group_absmax)  # same expression as torchao (Tensor.__rtruediv__: reciprocal * 256)
    quantized = (groups * factor).round().clamp(-128, 127).to(torch.int8).flatten()
    return quantized, factor.view(-1).contiguous(), scaler_mean


# ----------------------------------------------------------------------------------------------------------
# Dequantize
# ----------------------------------------------------------------------------------------------------------
def _block_scales(t: NF4Tensor) -> torch.Tensor:
    """Per-block scales in the tensor's dtype, computed with the same ops as torchao's dequantize_scalers."""
    groups = t.quantized_scalers.view(-1, t.scaler_block_size)
    return (groups / t.quantization_factor.unsqueeze(-1)).flatten().to(t.dtype) + t.scaler_mean


def _pair_table(levels: torch.Tensor) -> torch.Tensor:
    """(256,) table: byte -> the two levels it encodes (high nibble first), packed as one int32/int64."""
    hi = levels.repeat_interleave(16)
    lo = levels.repeat(16)
    pairs = torch.stack([hi, lo], dim=1).contiguous()
    return pairs.view(torch.int32 if levels.element_size() == 2 else torch.int64).view(256)


def _dequant_eager(qdata: torch.Tensor, scales: torch.Tensor, levels: torch.Tensor, out: torch.Tensor) -> None:
    """Vectorized PyTorch dequantize into ``out`` (contiguous, flat, ``levels.dtype``)."""
    table = _pair_table(levels)
    n_bytes = qdata.numel()
    block_bytes = n_bytes // scales.numel()
    step = max(block_bytes, (_DEQUANT_CHUNK_BYTES // block_bytes) * block_bytes)
    packed_out = out.view(table.dtype)
    for a in range(0, n_bytes, step):
        b = min(n_bytes, a + step)
        torch.index_select(table, 0, qdata[a:b].int(), out=packed_out[a:b])
        vals = out[2 * a : 2 * b].view(-1, 2 * block_bytes)
        vals.mul_(scales[a // block_bytes : b // block_bytes].unsqueeze(-1))


# The C kernels (gcc vector extensions, 16 float lanes; gcc picks the instructions for -march=native).
# quantize: one pass per block: absmax, divide, round to the storage dtype, count the thresholds passed,
# pack two codes per byte. dequantize: a 16-entry table of rounded ``level * scale`` per block, looked up
# with a vector permute (vpermw / vpermd on AVX-512).
_C_SOURCE = r"""
#include <stdint.h>
#include <string.h>

typedef float    v16f  __attribute__((vector_size(64)));
typedef uint32_t v16u  __attribute__((vector_size(64)));
typedef int32_t  v16i  __attribute__((vector_size(64)));
typedef uint16_t v32w  __attribute__((vector_size(64)));
typedef uint64_t v8q   __attribute__((vector_size(64)));
typedef uint8_t  v16b  __attribute__((vector_size(16)));
typedef uint8_t  v8b   __attribute__((vector_size(8)));
typedef uint16_t v16w  __attribute__((vector_size(32)));
#if defined(__FLT16_MAX__)
#define HAS_F16 1
typedef _Float16 v16hf __attribute__((vector_size(32)));
#else  /* no _Float16 (gcc < 12 on x86): float16 stays on the PyTorch path, see nf4_has_f16 */
#define HAS_F16 0
#endif

int nf4_has_f16(void) { return HAS_F16; }

/* Storage formats: 0 bfloat16, 1 float16, 2 float32. All arithmetic is float32, rounded to the storage
   format exactly where PyTorch rounds (bf16: nearest-even with NaN -> 0x7FC0 like c10::BFloat16). */

static inline v16u bf16_bits(v16f x) {
    v16u u; memcpy(&u, &x, 64);
    v16u r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    v16i nan = (v16i)((u & 0x7FFFFFFFu) > 0x7F800000u);
    return (v16u)(((v16i)r & ~nan) | (nan & 0x7FC0));
}
static inline v16u f16_bits(v16f x) {
#if HAS_F16
    v16hf h = __builtin_convertvector(x, v16hf);
    v16w w; memcpy(&w, &h, 32);
    return __builtin_convertvector(w, v16u);
#else
    v16u u; memcpy(&u, &x, 64); return u;
#endif
}
static inline v16f round_to(v16f x, int fmt) {
    if (fmt == 0) { v16u b = bf16_bits(x) << 16; v16f r; memcpy(&r, &b, 64); return r; }
#if HAS_F16
    if (fmt == 1) { v16hf h = __builtin_convertvector(x, v16hf); return __builtin_convertvector(h, v16f); }
#endif
    return x;
}
static inline uint16_t bf16_bits1(float x) {
    uint32_t u; memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float round1(float x, int fmt) {
    if (fmt == 0) { uint32_t u = (uint32_t)bf16_bits1(x) << 16; float r; memcpy(&r, &u, 4); return r; }
#if HAS_F16
    if (fmt == 1) return (float)(_Float16)x;
#endif
    return x;
}
static inline v16f load16(const void* src, int64_t i, int fmt) {
    v16f r;
    if (fmt == 0) {
        v16w w; memcpy(&w, (const uint16_t*)src + i, 32);
        v16u u = __builtin_convertvector(w, v16u) << 16; memcpy(&r, &u, 64);
#if HAS_F16
    } else if (fmt == 1) {
        v16hf h; memcpy(&h, (const _Float16*)src + i, 32); r = __builtin_convertvector(h, v16f);
#endif
    } else {
        memcpy(&r, (const float*)src + i, 64);
    }
    return r;
}
static inline float load1(const void* src, int64_t i, int fmt) {
    if (fmt == 0) { uint32_t u = (uint32_t)((const uint16_t*)src)[i] << 16; float r; memcpy(&r, &u, 4); return r; }
#if HAS_F16
    if (fmt == 1) return (float)((const _Float16*)src)[i];
#endif
    return ((const float*)src)[i];
}

/* ---- quantize: blocks [b0, b1) of bs elements; absmax per block -> amax_out (storage format),
   code = #{i : round_to(x / absmax) >= thr[i]} (15 thresholds, NaN -> 0), two codes per byte, high first */
void nf4_quantize(const void* w, int64_t b0, int64_t b1, int64_t bs, const float* thr, uint8_t* qout,
                  void* amax_out, int32_t fmt) {
    v16f T[15];
    for (int i = 0; i < 15; ++i) { v16f t = {0}; T[i] = t + thr[i]; }
    const v16i even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    for (int64_t b = b0; b < b1; ++b) {
        const int64_t base = b * bs;
        float m = 0.0f;
        int nan = 0;
        int64_t j = 0;
        if (bs >= 16) {
            v16f vm = {0};
            v16i vn = {0};
            for (; j + 16 <= bs; j += 16) {
                v16f x = load16(w, base + j, fmt);
                v16u ab; memcpy(&ab, &x, 64); ab &= 0x7FFFFFFFu;
                v16f ax; memcpy(&ax, &ab, 64);
                v16i gt = (v16i)(ax > vm);
                vm = (v16f)(((v16i)ax & gt) | ((v16i)vm & ~gt));
                vn |= (v16i)(x != x);
            }
            for (int k = 0; k < 16; ++k) { if (vm[k] > m) m = vm[k]; nan |= vn[k]; }
        }
        for (; j < bs; ++j) {
            float x = load1(w, base + j, fmt), ax = x < 0 ? -x : x;
            if (x != x) nan = 1; else if (ax > m) m = ax;
        }
        if (nan) m = __builtin_nanf("");
        if (fmt == 0) ((uint16_t*)amax_out)[b] = bf16_bits1(m);
#if HAS_F16
        else if (fmt == 1) ((_Float16*)amax_out)[b] = (_Float16)m;
#endif
        else ((float*)amax_out)[b] = m;

        uint8_t* qb = qout + base / 2;
        j = 0;
        for (; j + 32 <= bs; j += 32) {
            v16f q0 = round_to(load16(w, base + j, fmt) / m, fmt);
            v16f q1 = round_to(load16(w, base + j + 16, fmt) / m, fmt);
            v16i c0 = {0}, c1 = {0};
            for (int i = 0; i < 15; ++i) { c0 -= (v16i)(q0 >= T[i]); c1 -= (v16i)(q1 >= T[i]); }
            v16i hi = __builtin_shuffle(c0, c1, even), lo = __builtin_shuffle(c0, c1, odd);
            v16b packed = __builtin_convertvector((hi << 4) | lo, v16b);
            memcpy(qb + j / 2, &packed, 16);
        }
        for (; j < bs; j += 2) {
            float qa = round1(load1(w, base + j, fmt) / m, fmt), qc = round1(load1(w, base + j + 1, fmt) / m, fmt);
            int ca = 0, cc = 0;
            for (int i = 0; i < 15; ++i) { ca += qa >= thr[i]; cc += qc >= thr[i]; }
            qb[j / 2] = (uint8_t)((ca << 4) | cc);
        }
    }
}

/* ---- dequantize, 16-bit output in the storage format fmt (0 bf16, 1 fp16): blocks [b0, b1), hb bytes
   (2 * hb values) per block; a 16-entry table of rounded level * scale per block, looked up by permute */
void nf4_dequant16(const uint8_t* q, const float* scale, const float* levels, int64_t b0, int64_t b1,
                   int64_t hb, uint16_t* out, int32_t fmt) {
    v16f lv; memcpy(&lv, levels, 64);
    const v32w even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                       0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    for (int64_t b = b0; b < b1; ++b) {
        v16f p = lv * scale[b];
        v16u bits = fmt == 0 ? bf16_bits(p) : f16_bits(p);
        v32w table = __builtin_shuffle((v32w)bits, even);
        const uint8_t* qb = q + b * hb;
        uint16_t* ob = out + 2 * b * hb;
        int64_t j = 0;
        for (; j + 16 <= hb; j += 16) {
            v16b c; memcpy(&c, qb + j, 16);
            v16u d = __builtin_convertvector(c, v16u);
            v16u idx = (d >> 4) | ((d & 15u) << 16);
            v32w o = __builtin_shuffle(table, (v32w)idx);
            memcpy(ob + 2 * j, &o, 64);
        }
        for (; j < hb; ++j) {
            ob[2 * j] = table[qb[j] >> 4];
            ob[2 * j + 1] = table[qb[j] & 15];
        }
    }
}

/* ---- dequantize to float32; the products are first rounded to the storage format fmt (0, 1, 2) */
void nf4_dequant32(const uint8_t* q, const float* scale, const float* levels, int64_t b0, int64_t b1,
                   int64_t hb, float* out, int32_t fmt) {
    v16f lv; memcpy(&lv, levels, 64);
    for (int64_t b = b0; b < b1; ++b) {
        v16f p = round_to(lv * scale[b], fmt);
        v16u table; memcpy(&table, &p, 64);
        const uint8_t* qb = q + b * hb;
        float* ob = out + 2 * b * hb;
        int64_t j = 0;
        for (; j + 8 <= hb; j += 8) {
            v8b c; memcpy(&c, qb + j, 8);
            v8q d = __builtin_convertvector(c, v8q);
            v8q idx = (d >> 4) | ((d & 15u) << 32);
            v16u o = __builtin_shuffle(table, (v16u)idx);
            memcpy(ob + 2 * j, &o, 64);
        }
        for (; j < hb; ++j) {
            ob[2 * j] = p[qb[j] >> 4];
            ob[2 * j + 1] = p[qb[j] & 15];
        }
    }
}
"""

_FMT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_native_lock = threading.Lock()
_native_state: dict = {"lib": None, "tried": False, "error": None}
_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def _forget_pool_after_fork() -> None:
    # a forked child inherits the executor object but none of its threads: start a fresh one when needed
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _cpu_fingerprint() -> str:
    # -march=native code must never be reused on another CPU (a shared home directory on a cluster)
    parts = [platform.machine(), sys.platform, torch.__version__]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name", "Features", "CPU part")):
                    parts.append(line.strip())
                    if len(parts) > 8:
                        break
    except OSError:
        parts.append(str(torch.backends.cpu.get_cpu_capability()))
    return "|".join(parts)


def _compile_native() -> ctypes.CDLL:
    compiler = os.environ.get("LIT_QLORA_CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise RuntimeError("no C compiler (gcc/cc) found")
    flags = ["-O3", "-march=native", "-std=gnu11", "-shared", "-fPIC"]
    flags += shlex.split(os.environ.get("LIT_QLORA_CFLAGS", ""))  # extra flags, e.g. for debugging
    key = hashlib.sha256("\n".join([_C_SOURCE, compiler, *flags, _cpu_fingerprint()]).encode()).hexdigest()[:16]
    cache_dir = os.environ.get("LIT_QLORA_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "lit_qlora", "kernels"
    )
    try:
        os.makedirs(cache_dir, exist_ok=True)
        if not os.access(cache_dir, os.W_OK):
            raise PermissionError(cache_dir)
    except OSError:  # read-only home: a per-user temp directory
        user = os.getuid() if hasattr(os, "getuid") else 0
        cache_dir = os.path.join(tempfile.gettempdir(), f"lit_qlora_kernels_{user}")
        os.makedirs(cache_dir, exist_ok=True)
    lib_path = os.path.join(cache_dir, f"nf4_{key}.so")
    if not os.path.exists(lib_path):
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            src = os.path.join(tmp, "nf4.c")
            with open(src, "w") as f:
                f.write(_C_SOURCE)
            tmp_lib = os.path.join(tmp, "nf4.so")
            res = subprocess.run(
                [compiler, *flags, src, "-o", tmp_lib], capture_output=True, text=True, timeout=120
            )
            if res.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {res.stderr.strip()[-2000:]}")
            os.replace(tmp_lib, lib_path)  # atomic: concurrent processes see a complete file or none
    lib = ctypes.CDLL(lib_path)
    argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32]  # fmt: skip
    for name in ("nf4_dequant16", "nf4_dequant32"):
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = None
    lib.nf4_quantize.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]  # fmt: skip
    lib.nf4_quantize.restype = None
    lib.nf4_has_f16.restype = ctypes.c_int
    lib.has_f16 = bool(lib.nf4_has_f16())
    return lib


def _native_lib() -> Optional[ctypes.CDLL]:
    if _native_state["tried"]:
        return _native_state["lib"]
    with _native_lock:
        if _native_state["tried"]:
            return _native_state["lib"]
        lib = None
        try:
            lib = _compile_native()
            _native_state["lib"] = lib  # provisional, for the self-test below
            _self_test_native()
        except Exception as e:  # no compiler, unsupported target, or a wrong result: use the torch path
            _native_state["error"] = f"{type(e).__name__}: {e}"
            log.warning("lit_qlora.nf4: native NF4 kernels unavailable (%s); using the PyTorch path", e)
            lib = None
        _native_state["lib"] = lib
        _native_state["tried"] = True
        return lib


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN matching NaN (NaN bit patterns differ even between PyTorch's own kernels)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _self_test_native() -> None:
    """Compare the C kernels with the PyTorch path (tails, zero/inf blocks, every dtype) before using them."""
    gen = torch.Generator().manual_seed(0)
    lib = _native_state["lib"]
    for dtype in _SUPPORTED_DTYPES:
        if dtype == torch.float16 and not lib.has_f16:
            continue
        for block_size in (72, 64):  # 72: 36-byte blocks exercise the scalar tails
            w = torch.randn(8, block_size * 4, generator=gen)
            w[1, :block_size] = 0.0  # an all-zero block: 0/0 -> NaN -> code 0
            w[2, 5] = 1e30  # a block dominated by one huge value
            w = w.to(dtype)
            n = w.numel()
            q_ref, s_ref = torch.empty(n // 2, dtype=torch.uint8), torch.empty(n // block_size, dtype=dtype)
            _quantize_eager(w.reshape(-1), block_size, q_ref, s_ref)
            q_nat, s_nat = torch.empty_like(q_ref), torch.empty_like(s_ref)
            _quantize_native(w.reshape(-1), block_size, q_nat, s_nat)
            if not (torch.equal(q_nat, q_ref) and _same_values(s_nat, s_ref)):
                raise RuntimeError(f"native quantize self-test mismatch for {dtype}")
            t = quantize_nf4(w, block_size=block_size, scaler_block_size=4, native=False)
            ref = torch.empty(n, dtype=dtype)
            _dequant_eager(t.quantized_data, _block_scales(t), t.nf4, ref)
            for out_dtype in {dtype, torch.float32}:
                got = torch.empty(n, dtype=out_dtype)
                _dequant_native(t, got)
                if not _same_values(got, ref.to(out_dtype)):
                    raise RuntimeError(f"native dequantize self-test mismatch for {dtype} -> {out_dtype}")


def _run_blocks(call, n_blocks: int, work_bytes: int) -> None:
    """Run ``call(b0, b1)`` over [0, n_blocks), split across torch.get_num_threads() Python threads (the
    ctypes call releases the GIL); small jobs run inline."""
    threads = max(1, min(torch.get_num_threads(), work_bytes >> 20, n_blocks))
    if threads == 1:
        call(0, n_blocks)
        return
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="nf4")
    per = -(-n_blocks // threads)
    futures = [_pool.submit(call, b0, min(n_blocks, b0 + per)) for b0 in range(per, n_blocks, per)]
    call(0, min(n_blocks, per))
    for f in futures:
        f.result()


def _dequant_native(t: NF4Tensor, out: torch.Tensor, blocks: Optional[Tuple[int, int]] = None) -> None:
    """Dequantize all blocks of ``t``, or only ``blocks = (b0, b1)``, into ``out``."""
    lib = _native_state["lib"]
    qdata = t.quantized_data.contiguous()
    scales = _block_scales(t).float().contiguous()
    levels = t.nf4.float().contiguous()
    hb = qdata.numel() // scales.numel()
    b0, b1 = blocks or (0, scales.numel())
    n_blocks = b1 - b0
    fmt = _FMT[t.dtype]
    fn = lib.nf4_dequant16 if out.dtype != torch.float32 else lib.nf4_dequant32
    # The kernel indexes blocks from its pointers, so a block range is a shift of the input pointers.
    ptrs = (qdata.data_ptr() + b0 * hb, scales.data_ptr() + b0 * 4, levels.data_ptr(), out.data_ptr())

    def call(b0: int, b1: int) -> None:
        fn(ptrs[0], ptrs[1], ptrs[2], b0, b1, hb, ptrs[3], fmt)

    _run_blocks(call, n_blocks, out.numel() * out.element_size())


def nf4_backend() -> str:
    """Which path CPU tensors use: ``"native"`` (the C kernels) or ``"eager"`` (PyTorch ops).

    ``LIT_QLORA_NF4_BACKEND=eager`` forces the PyTorch path. The kernels are compiled with gcc on first use
    (~1 s, cached under ``~/.cache/lit_qlora/kernels``) and checked against the PyTorch path; without a
    compiler, or if the check fails, the PyTorch path is used (with one warning).
    """
    return "native" if _use_native() else "eager"


def _use_native(dtype: Optional[torch.dtype] = None) -> bool:
    if os.environ.get("LIT_QLORA_NF4_BACKEND", "auto").lower() == "eager":
        return False
    lib = _native_lib()
    return lib is not None and (dtype != torch.float16 or lib.has_f16)


@torch.compiler.disable  # raw-pointer kernels: dynamo must not trace (it would lose the writes)
@torch.no_grad()
def dequantize_nf4(
    t: NF4Tensor,
    dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
    rows: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """Dequantize an ``NF4Tensor``: the same values as ``t.get_original_weight().to(dtype)``, much faster.

    ``dtype`` defaults to ``t.dtype``. ``rows = (start, stop)`` dequantizes only those rows of a 2-D tensor
    (both ends on quantization-block boundaries, see :func:`block_aligned_rows`), so a large weight can be
    used a slice at a time. ``out`` (contiguous, the result's shape, ``dtype``) is written in place and
    returned. Works on FSDP shards (it uses the inner tensors, not the stale ``n_blocks``). The wrapper's
    strides are ignored, as in torchao's ``get_original_weight`` (the data is row-major).
    """
    if not isinstance(t, NF4Tensor):
        raise TypeError(f"dequantize_nf4 expects an NF4Tensor, got {type(t).__name__}")
    dtype = dtype or t.dtype
    if dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"dequantize_nf4 supports {_SUPPORTED_DTYPES}, got {dtype}")
    shape, blocks = (t.shape, None) if rows is None else _row_blocks(t, *rows)
    device = t.quantized_data.device
    if out is not None:
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {dtype} tensor of shape {tuple(shape)}")
        if out.device != device:
            raise ValueError(f"out is on {out.device}, the NF4 tensor on {device}")
    result = out if out is not None else torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu" and (dtype == t.dtype or dtype == torch.float32) and _use_native(t.dtype):
        _dequant_native(t, result.view(-1), blocks)
        return result
    qdata, scales = t.quantized_data, _block_scales(t)
    if blocks is not None:
        hb = qdata.numel() // scales.numel()
        qdata, scales = qdata[blocks[0] * hb : blocks[1] * hb], scales[blocks[0] : blocks[1]]
    if dtype == t.dtype:
        _dequant_eager(qdata, scales, t.nf4, result.view(-1))
    else:
        tmp = torch.empty(result.numel(), dtype=t.dtype, device=device)
        _dequant_eager(qdata, scales, t.nf4, tmp)
        result.view(-1).copy_(tmp)
    return result


def block_aligned_rows(t: NF4Tensor, max_elems: int) -> int:
    """The most rows of the 2-D ``t``, at most ``max_elems`` elements (but at least one block), whose slices
    start and end on quantization-block boundaries."""
    cols = t.shape[-1]
    step = t.block_size // math.gcd(cols, t.block_size)  # rows per whole number of blocks
    return max(step, (max_elems // cols) // step * step)


def _row_blocks(t: NF4Tensor, start: int, stop: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """The shape of rows ``start:stop`` of the 2-D ``t`` and the quantization blocks ``(b0, b1)`` they span."""
    if t.dim() != 2 or not 0 <= start < stop <= t.shape[0]:
        raise ValueError(f"rows=({start}, {stop}) is not a row range of a 2-D tensor of shape {tuple(t.shape)}")
    cols, bs = t.shape[1], t.block_size
    e0, e1 = start * cols, stop * cols
    if e0 % bs or (e1 % bs and stop != t.shape[0]):
        raise ValueError(f"rows=({start}, {stop}) do not start and end on {bs}-element quantization blocks")
    return (stop - start, cols), (e0 // bs, -(-e1 // bs))


def clone_nf4(t: NF4Tensor) -> NF4Tensor:
    """An exact copy of an ``NF4Tensor`` (its inner tensors cloned).

    torchao's ``aten.clone`` (also behind ``copy.deepcopy``) re-quantizes ``get_original_weight()`` with the
    *default* layout (64, 256): it fails for layouts :func:`nf4_layout` picked for odd shapes (e.g.
    192x576) and is not guaranteed to reproduce the codes. Use this instead.
    """
    names, ctx = t.__tensor_flatten__()
    inner = {n: getattr(t, n).clone() for n in names}
    return NF4Tensor.__tensor_unflatten__(inner, ctx, t.shape, t.stride())


def nf4_nbytes(t: NF4Tensor) -> int:
    """Resident bytes of an ``NF4Tensor`` (its inner tensors)."""
    names, _ = t.__tensor_flatten__()
    return sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)
