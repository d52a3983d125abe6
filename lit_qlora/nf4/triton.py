"""The CUDA dequantize kernel: a whole torchao ``NF4Tensor``, double-quantized scalers included, in one Triton launch.

Every output value is computed as torchao's ``get_original_weight()`` computes it, each step rounded to the weight's
storage dtype ``D`` (fp32 arithmetic, then the rounding PyTorch's own ``D`` ops do):

    scale = D(D(qscaler / factor[group]) + mean)       # torchao's dequantize_scalers
    value = D(level[code] * scale)                     # then cast to the requested dtype

so the result equals torchao's bit for bit (the division is IEEE round-to-nearest, as PyTorch's CUDA division; a
plain ``/`` in Triton may compile to an approximate division). One program writes ``2 * BYTES`` consecutive values
from ``BYTES`` code bytes: traffic is ~0.5 byte read and 2 written per bf16 value, against ~10.5 for the PyTorch
path's index_select/mul chain (reference.py), and one launch per weight instead of ~10 per 8M-value slice.

This module needs Triton (callers import it only where :func:`lit_qlora.nf4.native.triton_available`); on CPU tensors
it runs under ``TRITON_INTERPRET=1`` (the tests; the interpreter has no bf16 arithmetic, so they compare fp32/fp16).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

#: Code bytes per program (so 2x values); 4 warps write 16 KB of bf16 per program.
BYTES_PER_PROGRAM = 2048
_ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _rounded(v, ROUND: tl.constexpr):
    """``v`` (fp32) rounded to the storage dtype: 0 fp32 (as is), 1 bf16, 2 fp16."""
    if ROUND == 1:
        v = v.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _nf4_dequantize_kernel(codes_ptr, qscalers_ptr, factor_ptr, mean_ptr, levels_ptr, out_ptr, first_byte, n_bytes,
                           BLOCK_SIZE: tl.constexpr, SCALER_BLOCK_SIZE: tl.constexpr, ROUND: tl.constexpr,
                           BYTES: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    local = pid * BYTES + tl.arange(0, BYTES)  # byte index within this call's range
    mask = local < n_bytes
    byte_index = local + first_byte  # within the whole weight
    byte = tl.load(codes_ptr + byte_index, mask=mask, other=0).to(tl.int32)
    block = (byte_index * 2) // BLOCK_SIZE  # a block holds an even number of values: both nibbles share it
    q = tl.load(qscalers_ptr + block, mask=mask, other=0).to(tl.float32)
    factor = tl.load(factor_ptr + block // SCALER_BLOCK_SIZE, mask=mask, other=1.0).to(tl.float32)
    mean = tl.load(mean_ptr).to(tl.float32)
    scale = _rounded(_rounded(tl.math.div_rn(q, factor), ROUND) + mean, ROUND)
    high = _rounded(tl.load(levels_ptr + (byte >> 4), mask=mask, other=0.0).to(tl.float32) * scale, ROUND)
    low = _rounded(tl.load(levels_ptr + (byte & 15), mask=mask, other=0.0).to(tl.float32) * scale, ROUND)
    values = tl.interleave(high, low)  # the first value of a byte is its high nibble
    out_index = pid * (2 * BYTES) + tl.arange(0, 2 * BYTES)
    tl.store(out_ptr + out_index, values.to(out_ptr.dtype.element_ty), mask=out_index < 2 * n_bytes)


def dequantize_into(codes: torch.Tensor, qscalers: torch.Tensor, factor: torch.Tensor, mean: torch.Tensor,
                    levels: torch.Tensor, block_size: int, scaler_block_size: int, out: torch.Tensor,
                    first_value: int = 0) -> torch.Tensor:
    """Values ``first_value : first_value + out.numel()`` of the NF4 tensor whose inner tensors are given, written
    into ``out`` (contiguous, any of fp32/bf16/fp16) in one launch; ``first_value`` and ``out.numel()`` even.

    ``levels`` is the tensor's ``nf4`` table (already in its storage dtype ``D``, which sets the rounding)."""
    storage = levels.dtype
    if storage not in _ROUNDING or out.dtype not in _ROUNDING:
        raise TypeError(f"NF4 dequantize supports {tuple(_ROUNDING)}, got {storage} -> {out.dtype}")
    if first_value % 2 or out.numel() % 2 or not out.is_contiguous():
        raise ValueError("the NF4 kernel writes whole code bytes into a contiguous output")
    n_bytes = out.numel() // 2
    if n_bytes == 0:
        return out
    grid = (-(-n_bytes // BYTES_PER_PROGRAM),)
    _nf4_dequantize_kernel[grid](codes, qscalers, factor, mean, levels, out, first_value // 2, n_bytes,
                                 BLOCK_SIZE=block_size, SCALER_BLOCK_SIZE=scaler_block_size,
                                 ROUND=_ROUNDING[storage], BYTES=BYTES_PER_PROGRAM, num_warps=4)
    return out


def dequantize(t, dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A whole ``NF4Tensor`` ``t`` as a dense ``dtype`` tensor of its shape (into ``out`` when given)."""
    dtype = dtype or t.dtype
    if out is None:
        out = torch.empty(t.shape, dtype=dtype, device=t.quantized_data.device)
    return dequantize_into(t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4,
                           t.block_size, t.scaler_block_size, out)
