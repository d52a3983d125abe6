"""The few-row NF4 matmul on CUDA: a decode step's ``x (M <= 16, K) @ dequant(W).T`` with W's codes read once
(issue 56 item 1, the Triton side of nf4/gemv.c).

Why: a decode step multiplies one row (or a batch's few) by every weight. Dequantizing W first (nf4/triton.py) writes
and reads a dense copy, ~4.5 bytes of traffic per bf16 value where the codes are 0.5; the fused tile kernel
(nf4/triton_matmul.py) pads the rows to a tensor-core tile and, with few output tiles, leaves most SMs idle. Here
each program reads a (BLOCK_N, BLOCK_K) tile of codes, makes the values in registers and multiplies them with all M
rows at once: the codes are the only large read, as in bitsandbytes' 4-bit GEMV and llama.cpp's.

How: a grid of (N tiles, SPLIT) programs; program (n, s) sums the K tiles s, s + SPLIT, ... into fp32 partial sums
of its (M, BLOCK_N) outputs, so that a projection with few output tiles still fills the GPU; the SPLIT partials are
summed in a fixed order (one ``sum`` over them), so a step's answer does not change between runs. Each value is made
as nf4/triton.py makes it (fp32 arithmetic rounded to the storage dtype ``D`` at each of torchao's steps: the values
equal ``get_original_weight()``), then rounded to the activations' dtype as the dense weight would be; the products
of two bf16 (or fp16) numbers are exact in fp32, so against dequantize + matmul only the order of the fp32 sums
differs. Rows: 1 to 4 multiply and reduce in registers (``tl.sum``); 5 to 16 through ``tl.dot`` (rows padded to 16,
fp32 inputs at ``ieee`` precision: no TF32). W's rows must hold whole blocks (``K % block_size == 0``: every real
projection), the block size a power of two of at most ``BLOCK_K``.

Needs Triton; runs on CPU tensors under ``TRITON_INTERPRET=1`` (the tests, which compare fp32 and fp16: the
interpreter has no bf16 arithmetic).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from lit_qlora.nf4.triton import _ROUNDING

#: The most rows of x this kernel takes (nf4/linear.py routes a product here only up to this many).
MAX_ROWS = 16
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# (BLOCK_N, BLOCK_K): 64 output rows of W a program, 256 values of each (128 code bytes: whole cache lines); under
# the interpreter small tiles, so that the tests' shapes have tails in both directions.
_TILE = (16, 64) if _INTERPRETED else (64, 256)


def _configs() -> list[triton.Config]:
    if _INTERPRETED:
        return [triton.Config({}, num_warps=4)]
    return [triton.Config({}, num_warps=w, num_stages=s) for w, s in ((2, 2), (4, 2), (4, 3), (8, 3))]


_BLOCK_N, _BLOCK_K = tl.constexpr(_TILE[0]), tl.constexpr(_TILE[1])


@triton.jit
def _as(v, dtype: tl.constexpr):
    """fp32 ``v`` rounded to ``dtype`` (a no-op for fp32): how PyTorch's ops in that dtype round it."""
    return v.to(dtype).to(tl.float32)


@triton.autotune(configs=_configs(), key=["N", "K", "SPLIT", "ROWS"])
@triton.jit
def _nf4_rows_kernel(x_ptr, codes_ptr, qscalers_ptr, factor_ptr, mean_ptr, levels_ptr, part_ptr, M, N, K, SPLIT,
                     BLOCK_SIZE: tl.constexpr, SCALER_BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr):
    """``part[s] (M, N) = x (M, K) @ dequant(W (N, K)).T`` over the K tiles ``s, s + SPLIT, ...`` of this program.
    The storage dtype D is the levels' (every step of a value rounded to it), the rows' dtype x's."""
    D: tl.constexpr = levels_ptr.dtype.element_ty
    X: tl.constexpr = x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * _BLOCK_N + tl.arange(0, _BLOCK_N)
    in_n = offs_n < N
    offs_m = tl.arange(0, ROWS)
    in_m = offs_m < M
    blocks = K // BLOCK_SIZE  # NF4 blocks per row of W
    per_tile: tl.constexpr = _BLOCK_K // BLOCK_SIZE
    half: tl.constexpr = BLOCK_SIZE // 2
    tile_blocks = tl.arange(0, per_tile)
    tile_bytes = tl.arange(0, _BLOCK_K // 2)
    tile_values = tl.arange(0, _BLOCK_K)
    mean = tl.load(mean_ptr).to(tl.float32)
    acc = tl.zeros((ROWS, _BLOCK_N), dtype=tl.float32)
    for t in range(pid_s, tl.cdiv(K, _BLOCK_K), SPLIT):
        block = tile_blocks + t * per_tile  # the tile's NF4 blocks along K
        mask = in_n[:, None] & (block < blocks)[None, :]
        index = offs_n[:, None] * blocks + block[None, :]
        q = tl.load(qscalers_ptr + index, mask=mask, other=0).to(tl.float32)
        factor = tl.load(factor_ptr + index // SCALER_BLOCK_SIZE, mask=mask, other=1.0).to(tl.float32)
        scale = _as(_as(tl.math.div_rn(q, factor), D) + mean, D)  # torchao's dequantize_scalers, (BLOCK_N, per_tile)
        # each code byte's scale: a block's half bytes share it
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (_BLOCK_N, per_tile, half)), (_BLOCK_N, _BLOCK_K // 2))
        w_mask = in_n[:, None] & ((2 * tile_bytes + t * _BLOCK_K) < K)[None, :]
        byte = tl.load(codes_ptr + (offs_n.to(tl.int64)[:, None] * (K // 2) + tile_bytes[None, :]
                                    + t * (_BLOCK_K // 2)), mask=w_mask, other=0).to(tl.int32)
        high = tl.load(levels_ptr + (byte >> 4), mask=w_mask, other=0.0).to(tl.float32)
        low = tl.load(levels_ptr + (byte & 15), mask=w_mask, other=0.0).to(tl.float32)
        # (BLOCK_N, BLOCK_K), a byte's high nibble first; each value D(level * scale), then as x's dtype holds it
        w = _as(tl.interleave(_as(high * scale, D), _as(low * scale, D)), X)
        cols = tile_values + t * _BLOCK_K
        x = tl.load(x_ptr + offs_m[:, None] * K + cols[None, :], mask=in_m[:, None] & (cols < K)[None, :],
                    other=0.0).to(tl.float32)  # (ROWS, BLOCK_K)
        if ROWS >= 16 and X == tl.float32:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")  # no TF32, as torch's fp32 matmul
        elif ROWS >= 16:  # both hold values of x's dtype: the tensor cores' products are exact in fp32
            acc = tl.dot(x.to(X), tl.trans(w.to(X)), acc)
        else:
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    out = part_ptr + pid_s * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc, mask=in_m[:, None] & in_n[None, :])


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a split of two, so the tests sum partials
    return torch.cuda.get_device_properties(device).multi_processor_count


def rows_apply(m: int, k: int, block_size: int) -> bool:
    """Whether the kernel takes ``m`` rows against a weight of width ``k`` in blocks of ``block_size``."""
    block_k = _TILE[1]
    return (0 < m <= MAX_ROWS and block_size > 1 and block_size & (block_size - 1) == 0 and block_size <= block_k
            and k % block_size == 0)


def _rows(x: torch.Tensor, codes: torch.Tensor, qscalers: torch.Tensor, factor: torch.Tensor, mean: torch.Tensor,
          levels: torch.Tensor, block_size: int, scaler_block_size: int, n: int, k: int) -> torch.Tensor:
    if levels.dtype not in _ROUNDING or x.dtype not in _ROUNDING:
        raise TypeError(f"the few-row NF4 matmul supports {tuple(_ROUNDING)}, got {levels.dtype} weights, {x.dtype} "
                        "activations")
    torch._check(x.shape[-1] == k, lambda: f"inner dimensions: {tuple(x.shape)} against ({n}, {k})")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    torch._check(rows_apply(m, k, block_size), lambda: f"{m} rows, K {k}, blocks of {block_size}: not this kernel's")
    block_n, block_k = _TILE
    n_tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    # enough programs for two waves of the GPU, but at least two K tiles each (a partial sum costs an fp32 write)
    split = max(1, min(triton.cdiv(k_tiles, 2), triton.cdiv(2 * _multiprocessors(x.device), n_tiles)))
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    rows = 16 if m > 4 else triton.next_power_of_2(m)
    _nf4_rows_kernel[(n_tiles, split)](x2, codes, qscalers, factor, mean, levels, part, m, n, k, split,
                                       BLOCK_SIZE=block_size, SCALER_BLOCK_SIZE=scaler_block_size, ROWS=rows)
    out = part[0] if split == 1 else part.sum(0)
    return out.to(x.dtype).view(*x.shape[:-1], n)


@torch.library.custom_op("lit_qlora::nf4_matmul_rows", mutates_args=())
def nf4_matmul_rows(x: torch.Tensor, codes: torch.Tensor, qscalers: torch.Tensor, factor: torch.Tensor,
                    mean: torch.Tensor, levels: torch.Tensor, block_size: int, scaler_block_size: int, rows: int,
                    cols: int) -> torch.Tensor:
    """``x (..., cols) @ dequant(W).T`` for a few rows of x and the (rows, cols) NF4 weight: (..., rows)."""
    return _rows(x, codes, qscalers, factor, mean, levels, block_size, scaler_block_size, rows, cols)


@nf4_matmul_rows.register_fake
def _(x, codes, qscalers, factor, mean, levels, block_size, scaler_block_size, rows, cols):
    return x.new_empty(*x.shape[:-1], rows)


def nf4_linear_rows(x: torch.Tensor, weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ dequant(weight).T + bias`` for a few rows of x (``rows_apply``), in x's dtype; the bias, cast to that
    dtype, is added to the rounded product (as nf4/gemv.py and the fused kernel add it)."""
    y = torch.ops.lit_qlora.nf4_matmul_rows(x, weight.quantized_data, weight.quantized_scalers,
                                            weight.quantization_factor, weight.scaler_mean, weight.nf4,
                                            weight.block_size, weight.scaler_block_size, weight.shape[0],
                                            weight.shape[1])
    return y if bias is None else y.add_(bias.to(y.dtype))
