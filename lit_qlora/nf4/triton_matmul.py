"""The NF4 linear without a dense weight: the dequantize fused into the matmul that consumes it (issue 48 item 3).

Why: the unfused CUDA path (nf4/linear.py) dequantizes a whole weight into a dense buffer (one launch,
nf4/triton.py), then runs cuBLAS on it: ~2.5 bytes of traffic per weight value and a dense copy the size of the
largest weight, in forward and again in backward's dX. Here each program dequantizes the tiles of ``W`` it
multiplies in registers, from the packed codes (0.5 byte a value): no dense weight is ever written. Whether that
pays (the dequantization is repeated once per row tile of the activations) is what ``LIT_QLORA_NF4_FUSED=1``
(nf4/linear.py) and benchmarks/gpu/gpu_dequant.py measure.

How: one kernel, two directions (``TRANS``, a compile-time constant, so two compiled kernels):

    forward  out (M, N) = x (M, K) @ dequant(W).T      W tile element (n, k): flat index n * K + k
    dX       out (M, K) = g (M, N) @ dequant(W)        W tile element (n, k): the same flat index

Every W value is found by its FLAT row-major index ``f`` in the NF4 tensor, so any layout torchao or our quantizer
makes works (blocks may straddle rows; K need not be a multiple of the block size, nor even): its code is the high
nibble of byte ``f // 2`` when ``f`` is even, else the low one; its block ``f // block_size``; and it is computed as
nf4/triton.py computes it (fp32 arithmetic, each step rounded to the storage dtype ``D``, IEEE division):

    scale = D(D(qscaler[block] / factor[block // scaler_block_size]) + mean);  value = D(level[code] * scale)

so each dequantized tile equals torchao's ``get_original_weight()`` bit for bit; it is cast to the activations'
dtype and multiplied on the tensor cores with an fp32 accumulator (``ieee`` for fp32 inputs: no TF32). The output
is in the activations' dtype. Where W's rows hold whole blocks (K % block_size == 0: every real projection) and a
tile spans one block along K, the same values are built block-wise ("block tiles"): one scale per tile row, divided
once, not per value, and each code byte loaded once, its two nibbles interleaved. Tiles: a few configurations
autotuned per (M, N, K) on CUDA (those making block tiles where they can); one small one under Triton's interpreter
(``TRITON_INTERPRET=1``: the CPU tests, which run both paths).

The two matmuls are custom ops, ``lit_qlora::nf4_matmul`` and ``lit_qlora::nf4_matmul_dx``, taking the NF4Tensor's
inner tensors (as nf4/ops.py's dequantize), so ``torch.compile`` keeps them as opaque nodes: no graph break.
This module needs Triton (nf4/linear.py imports it only where the fused path applies).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from lit_qlora.nf4.triton import _ROUNDING, _rounded

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_GROUP_M = tl.constexpr(8)  # row tiles per group in the launch order: the weight tiles they share stay in L2


def _configs() -> list[triton.Config]:
    if _INTERPRETED:  # the tests: small tiles, so that shapes of a few dozen rows have several tiles and tails
        return [triton.Config({"BLOCK_M": 16, "BLOCK_P": 64, "BLOCK_R": 64}, num_warps=4)]
    # (BLOCK_M, BLOCK_P, BLOCK_R, warps, stages): the weight's extent along K is 64, one NF4 block, in all but one
    # (forward: BLOCK_R, dX: BLOCK_P; `_block_tiles`); wide BLOCK_M repeat the dequantization less
    shapes = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 64, 64, 4, 3), (256, 64, 64, 8, 3),
              (16, 64, 64, 4, 3), (16, 128, 64, 4, 3), (128, 64, 128, 8, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_P": p, "BLOCK_R": r}, num_warps=w, num_stages=s)
            for m, p, r, w, s in shapes]


def _block_tiles(args: dict) -> bool:
    """Whether W's tiles are whole NF4 blocks of one row each: its rows hold whole blocks (K % block_size == 0) and
    the tile's extent along K is one block. Then a tile row (forward: column) shares one scale, computed once."""
    k, k_tile = (args["P"], args["BLOCK_P"]) if args["TRANS"] else (args["R"], args["BLOCK_R"])
    return k % args["BLOCK_SIZE"] == 0 and k_tile == args["BLOCK_SIZE"]


def _prune(configs: list, named_args: dict, **kwargs) -> list:
    """Where block tiles are possible, only the configurations that make them (the others dequantize per value)."""
    fit = [c for c in configs if _block_tiles({**named_args, **kwargs, **c.kwargs})]
    return fit or configs


@triton.jit
def _scales(qscalers_ptr, factor_ptr, mean, block, mask, SCALER_BLOCK_SIZE: tl.constexpr, ROUND: tl.constexpr):
    """torchao's dequantize_scalers for the blocks ``block``, rounded as nf4/triton.py rounds them."""
    q = tl.load(qscalers_ptr + block, mask=mask, other=0).to(tl.float32)
    factor = tl.load(factor_ptr + block // SCALER_BLOCK_SIZE, mask=mask, other=1.0).to(tl.float32)
    return _rounded(_rounded(tl.math.div_rn(q, factor), ROUND) + mean, ROUND)


@triton.jit
def _values(levels_ptr, code, scale, mask, ROUND: tl.constexpr):
    """D(level[code] * scale); 0 where masked (level 0 times a finite scale)."""
    return _rounded(tl.load(levels_ptr + code, mask=mask, other=0.0).to(tl.float32) * scale, ROUND)


@triton.autotune(configs=_configs(), key=["M", "P", "R", "TRANS"], prune_configs_by={"early_config_prune": _prune})
@triton.heuristics({"BLOCK_TILES": _block_tiles})
@triton.jit
def _nf4_matmul_kernel(a_ptr, codes_ptr, qscalers_ptr, factor_ptr, mean_ptr, levels_ptr, out_ptr, M, P, R,
                       BLOCK_SIZE: tl.constexpr, SCALER_BLOCK_SIZE: tl.constexpr, ROUND: tl.constexpr,
                       TRANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_TILES: tl.constexpr):
    """``out (M, P) = a (M, R) @ B``, both row-major and contiguous, ``B`` (R, P) the dequantized W's transpose
    (forward, W is (P, R)) or W itself (``TRANS``: dX, W is (R, P)); the sum over R in fp32."""
    pid = tl.program_id(0)
    tiles_m, tiles_p = tl.cdiv(M, BLOCK_M), tl.cdiv(P, BLOCK_P)
    per_group = _GROUP_M * tiles_p
    first_m = (pid // per_group) * _GROUP_M
    group_m = tl.minimum(tiles_m - first_m, _GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_p = (pid % per_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_r = tl.arange(0, BLOCK_R)
    in_p = offs_p < P
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * R + offs_r[None, :]
    mean = tl.load(mean_ptr).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rows_r = r0 + offs_r
        in_r = rows_r < R
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & in_r[None, :], other=0.0)
        if BLOCK_TILES:
            half = tl.arange(0, BLOCK_SIZE // 2)  # the code bytes of one block (a power of two: the tile's extent)
        if BLOCK_TILES and TRANS:  # W[rows_r, block pid_p]: a scale per row, the bytes' two nibbles side by side
            scale = _scales(qscalers_ptr, factor_ptr, mean, rows_r * (P // BLOCK_SIZE) + pid_p, in_r,
                            SCALER_BLOCK_SIZE, ROUND)[:, None]
            byte = tl.load(codes_ptr + (rows_r[:, None] * (P // 2) + pid_p * (BLOCK_SIZE // 2) + half[None, :]),
                           mask=in_r[:, None], other=0).to(tl.int32)
            w = tl.interleave(_values(levels_ptr, byte >> 4, scale, in_r[:, None], ROUND),
                              _values(levels_ptr, byte & 15, scale, in_r[:, None], ROUND))
        elif BLOCK_TILES:  # W[offs_p, block r0 // BLOCK_SIZE], built as (P, R) and transposed
            scale = _scales(qscalers_ptr, factor_ptr, mean, offs_p * (R // BLOCK_SIZE) + r0 // BLOCK_SIZE, in_p,
                            SCALER_BLOCK_SIZE, ROUND)[:, None]
            byte = tl.load(codes_ptr + (offs_p[:, None] * (R // 2) + r0 // 2 + half[None, :]), mask=in_p[:, None],
                           other=0).to(tl.int32)
            w = tl.trans(tl.interleave(_values(levels_ptr, byte >> 4, scale, in_p[:, None], ROUND),
                                       _values(levels_ptr, byte & 15, scale, in_p[:, None], ROUND)))
        else:  # any layout: each value found by its flat index
            if TRANS:
                flat = rows_r[:, None] * P + offs_p[None, :]
            else:
                flat = offs_p[None, :] * R + rows_r[:, None]
            w_mask = in_r[:, None] & in_p[None, :]
            byte = tl.load(codes_ptr + (flat >> 1), mask=w_mask, other=0).to(tl.int32)
            code = (byte >> (4 - 4 * (flat & 1))) & 15  # an even flat index is its byte's high nibble
            scale = _scales(qscalers_ptr, factor_ptr, mean, flat // BLOCK_SIZE, w_mask, SCALER_BLOCK_SIZE, ROUND)
            w = _values(levels_ptr, code, scale, w_mask, ROUND)
        w = w.to(a.dtype)
        if a_ptr.dtype.element_ty == tl.float32:
            acc = tl.dot(a, w, acc, input_precision="ieee")  # no TF32: torch's fp32 matmul (allow_tf32 off)
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_R
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * P + offs_p[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & in_p[None, :])


def _matmul(a: torch.Tensor, codes: torch.Tensor, qscalers: torch.Tensor, factor: torch.Tensor, mean: torch.Tensor,
            levels: torch.Tensor, layout: tuple[int, int, int, int], trans: bool) -> torch.Tensor:
    """``a`` (..., R) times the dequantized (rows, cols) weight, transposed (forward: R = cols) or not (dX:
    R = rows); ``layout`` is (block_size, scaler_block_size, rows, cols)."""
    block_size, scaler_block_size, rows, cols = layout
    if levels.dtype not in _ROUNDING or a.dtype not in _ROUNDING:
        raise TypeError(f"the fused NF4 matmul supports {tuple(_ROUNDING)}, got {levels.dtype} weights, {a.dtype} "
                        "activations")
    reduced, width = (rows, cols) if trans else (cols, rows)
    torch._check(a.shape[-1] == reduced, lambda: f"inner dimensions: {tuple(a.shape)} against ({rows}, {cols})")
    torch._check(rows * cols < 2**31, lambda: "the fused NF4 matmul indexes the weight in int32")
    a2 = a.reshape(-1, reduced).contiguous()
    out = torch.empty(a2.shape[0], width, dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out.view(*a.shape[:-1], width)
    m = a2.shape[0]

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(width, meta["BLOCK_P"]),)

    _nf4_matmul_kernel[grid](a2, codes, qscalers, factor, mean, levels, out, m, width, reduced,
                             BLOCK_SIZE=block_size, SCALER_BLOCK_SIZE=scaler_block_size,
                             ROUND=_ROUNDING[levels.dtype], TRANS=trans)
    return out.view(*a.shape[:-1], width)


@torch.library.custom_op("lit_qlora::nf4_matmul", mutates_args=())
def nf4_matmul(x: torch.Tensor, codes: torch.Tensor, qscalers: torch.Tensor, factor: torch.Tensor, mean: torch.Tensor,
               levels: torch.Tensor, block_size: int, scaler_block_size: int, rows: int, cols: int) -> torch.Tensor:
    """``x (..., cols) @ dequant(W).T`` for the (rows, cols) NF4 weight with these inner tensors: (..., rows)."""
    return _matmul(x, codes, qscalers, factor, mean, levels, (block_size, scaler_block_size, rows, cols), False)


@nf4_matmul.register_fake
def _(x, codes, qscalers, factor, mean, levels, block_size, scaler_block_size, rows, cols):
    return x.new_empty(*x.shape[:-1], rows)


@torch.library.custom_op("lit_qlora::nf4_matmul_dx", mutates_args=())
def nf4_matmul_dx(grad: torch.Tensor, codes: torch.Tensor, qscalers: torch.Tensor, factor: torch.Tensor,
                  mean: torch.Tensor, levels: torch.Tensor, block_size: int, scaler_block_size: int, rows: int,
                  cols: int) -> torch.Tensor:
    """``grad (..., rows) @ dequant(W)`` for the (rows, cols) NF4 weight with these inner tensors: (..., cols)."""
    return _matmul(grad, codes, qscalers, factor, mean, levels, (block_size, scaler_block_size, rows, cols), True)


@nf4_matmul_dx.register_fake
def _(grad, codes, qscalers, factor, mean, levels, block_size, scaler_block_size, rows, cols):
    return grad.new_empty(*grad.shape[:-1], cols)


def _inner(weight) -> tuple:
    return (weight.quantized_data, weight.quantized_scalers, weight.quantization_factor, weight.scaler_mean,
            weight.nf4, weight.block_size, weight.scaler_block_size, weight.shape[0], weight.shape[1])


def nf4_linear_fused(x: torch.Tensor, weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ dequant(weight).T + bias`` (``weight`` a 2-D NF4Tensor, ``x`` (..., K)) in ``x``'s dtype, with no dense
    weight; the bias (cast to that dtype) is added to the rounded product."""
    y = torch.ops.lit_qlora.nf4_matmul(x, *_inner(weight))
    return y if bias is None else y.add_(bias.to(y.dtype))


def nf4_grad_input_fused(grad: torch.Tensor, weight) -> torch.Tensor:
    """``grad @ dequant(weight)`` (``grad`` (..., N)): the linear's input gradient, in ``grad``'s dtype."""
    return torch.ops.lit_qlora.nf4_matmul_dx(grad, *_inner(weight))
