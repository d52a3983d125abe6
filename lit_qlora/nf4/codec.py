"""Fast NF4 quantize / dequantize that produce and consume torchao ``NF4Tensor`` objects.

torchao's :class:`~torchao.quantization.NF4Tensor` stays the storage format (its FSDP2 hooks, aten ops and
state-dict handling keep working); only the hot paths are ours (CPU numbers: benchmarks/speed/nf4_kernels.py):

* :func:`quantize_nf4` builds an ``NF4Tensor`` whose inner tensors are bit-for-bit what
  ``torchao.quantization.to_nf4(w, block_size, scaler_block_size)`` builds, 55-75x faster on CPU (18-25x on
  the PyTorch fallback), with a transient of ~0.3x the bf16 input (torchao: ~2.1x) because nothing of
  the input's size is ever materialized (row chunks on the fallback).
* :func:`dequantize_nf4` returns exactly ``NF4Tensor.get_original_weight()`` (same bits), 15-20x faster on
  CPU (8-10x on the PyTorch fallback).
* ``rows=`` dequantizes a block-aligned slice of rows, which :mod:`lit_qlora.nf4.linear` uses to keep the
  dense copy of a large weight (an lm_head) small.

On CPU the work runs in the C kernels of :mod:`lit_qlora.nf4.native`; dequantization on CUDA in the Triton kernel
of :mod:`lit_qlora.nf4.triton`; elsewhere, or without a compiler or Triton, in the PyTorch ops of
:mod:`lit_qlora.nf4.reference` (the same computation).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torchao.quantization import NF4Tensor
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import SubclassTensorArgs

from lit_qlora.nf4.layout import check_layout, nf4_layout, row_blocks, rows_per_chunk
from lit_qlora.nf4.native import (dequantize_blocks, is_fake, native_error, native_lib, quantize_blocks,
                                  triton_available, use_native)
from lit_qlora.nf4.reference import (quant_chunk_elems, SUPPORTED_DTYPES, dequantize_eager, dequantize_scalers,
                                  double_quantize, level_table, quantize_eager)


def is_nf4(t: torch.Tensor) -> bool:
    """An NF4Tensor, or an FSDP2 shard of one (a DTensor whose local tensor is an NF4Tensor)."""
    if type(t).__name__ == "DTensor":
        t = t.to_local()
    return type(t).__name__ == "NF4Tensor"


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
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"NF4 quantization supports {SUPPORTED_DTYPES}, got {dtype}")
    shape = tuple(weight.shape)
    if scaler_block_size is None:
        block_size, scaler_block_size = nf4_layout(shape, block_size, 256, world_size)
    else:
        check_layout(shape, block_size, int(scaler_block_size), world_size)
    scaler_block_size = int(scaler_block_size)

    device = weight.device
    numel = weight.numel()
    n_blocks = numel // block_size
    w2d = weight.reshape(shape[0], -1) if weight.dim() == 2 else weight.reshape(-1, 1)
    rows, cols = w2d.shape
    quantized_data = torch.empty(numel // 2, dtype=torch.uint8, device=device)
    scalers = torch.empty(n_blocks, dtype=dtype, device=device)
    if native is None:
        native = device.type == "cpu" and use_native(dtype)
    elif native and (device.type != "cpu" or native_lib() is None or not use_native(dtype)):
        raise RuntimeError(f"native NF4 kernels unavailable ({device}, {dtype}): {native_error()}")
    contiguous = weight.is_contiguous()
    if native and contiguous:
        quantize_blocks(weight.reshape(-1), block_size, quantized_data, scalers)
    else:
        step = rows_per_chunk(cols, block_size, chunk_rows, quant_chunk_elems(device))
        flat = weight.reshape(-1) if contiguous else None
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            e0, e1 = r0 * cols, r1 * cols
            chunk = flat[e0:e1] if contiguous else w2d[r0:r1].reshape(-1)  # copies one chunk at most
            q_out = quantized_data[e0 // 2 : e1 // 2]
            s_out = scalers[e0 // block_size : e1 // block_size]
            if native:
                quantize_blocks(chunk, block_size, q_out, s_out)
            else:
                quantize_eager(chunk, block_size, q_out, s_out)
            del chunk

    quantized_scalers, quantization_factor, scaler_mean = double_quantize(scalers, scaler_block_size)
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
        level_table(dtype, device),
    )


class NF4Fields(NamedTuple):
    """An ``NF4Tensor``'s inner tensors and block sizes, as the custom op ``lit_qlora::nf4_dequantize`` receives them:
    what `dequantize_into` and `block_scales` read (an ``NF4Tensor`` itself serves as well)."""

    quantized_data: torch.Tensor
    quantized_scalers: torch.Tensor
    quantization_factor: torch.Tensor
    scaler_mean: torch.Tensor
    nf4: torch.Tensor  # the 16 levels, in the storage dtype
    block_size: int
    scaler_block_size: int


def block_scales(t: NF4Tensor | NF4Fields, blocks: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Per-block scales of ``t`` in its storage dtype (torchao's dequantize_scalers, same ops); only blocks ``b0:b1``
    when given (computed from their scaler groups alone: a head used a slice at a time would otherwise dequantize all
    its scales for every slice)."""
    sbs, storage = t.scaler_block_size, t.nf4.dtype
    if blocks is None:
        return dequantize_scalers(t.quantized_scalers, t.quantization_factor, t.scaler_mean, sbs, storage)
    g0, g1 = blocks[0] // sbs, -(-blocks[1] // sbs)
    part = dequantize_scalers(t.quantized_scalers[g0 * sbs : g1 * sbs], t.quantization_factor[g0:g1], t.scaler_mean,
                              sbs, storage)
    return part[blocks[0] - g0 * sbs : blocks[1] - g0 * sbs]


@torch.compiler.disable  # raw-pointer kernels: dynamo must not trace (it would lose the writes)
@torch.no_grad()
def dequantize_nf4(
    t: NF4Tensor,
    dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
    rows: Optional[tuple[int, int]] = None,
) -> torch.Tensor:
    """Dequantize an ``NF4Tensor``: the same values as ``t.get_original_weight().to(dtype)``, much faster.

    ``dtype`` defaults to ``t.dtype``. ``rows = (start, stop)`` dequantizes only those rows of a 2-D tensor
    (both ends on quantization-block boundaries, see :func:`~lit_qlora.nf4.layout.block_aligned_rows`), so a
    large weight can be used a slice at a time. ``out`` (contiguous, the result's shape, ``dtype``) is written
    in place and returned. Works on FSDP shards (it uses the inner tensors, not the stale ``n_blocks``). The
    wrapper's strides are ignored, as in torchao's ``get_original_weight`` (the data is row-major).
    """
    if not isinstance(t, NF4Tensor):
        raise TypeError(f"dequantize_nf4 expects an NF4Tensor, got {type(t).__name__}")
    dtype = dtype or t.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dequantize_nf4 supports {SUPPORTED_DTYPES}, got {dtype}")
    shape, blocks = (t.shape, None) if rows is None else row_blocks(t, *rows)
    device = t.quantized_data.device
    if out is not None:
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {dtype} tensor of shape {tuple(shape)}")
        if out.device != device:
            raise ValueError(f"out is on {out.device}, the NF4 tensor on {device}")
    result = out if out is not None else torch.empty(shape, dtype=dtype, device=device)
    dequantize_into(t, result.view(-1), blocks)
    return result


def dequantize_into(t: NF4Tensor | NF4Fields, flat: torch.Tensor, blocks: Optional[tuple[int, int]] = None) -> None:
    """Blocks ``b0:b1`` of ``t`` (all without ``blocks``) into the contiguous 1-D ``flat``, in its dtype: the C
    kernel on CPU, the Triton kernel on CUDA, the PyTorch path elsewhere (the same values). No checks: callers
    (`dequantize_nf4`, the custom op) made them."""
    storage, device = t.nf4.dtype, t.quantized_data.device
    if device.type == "cpu" and flat.dtype in (storage, torch.float32) and use_native(storage):
        dequantize_blocks(t.quantized_data, block_scales(t), t.nf4, storage, flat, blocks)
        return
    if device.type == "cuda" and triton_available():  # one launch: lit_qlora/nf4/triton.py
        if is_fake(flat):
            return  # a dry run on fake CUDA: no data; the kernel allocates nothing
        from lit_qlora.nf4 import triton as kernel

        kernel.dequantize_into(t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4,
                               t.block_size, t.scaler_block_size, flat,
                               0 if blocks is None else blocks[0] * t.block_size)
        return
    qdata, scales = t.quantized_data, block_scales(t, blocks)
    if blocks is not None:
        hb = t.block_size // 2  # bytes per block: two codes a byte
        qdata = qdata[blocks[0] * hb : blocks[1] * hb]
    if flat.dtype == storage:
        dequantize_eager(qdata, scales, t.nf4, flat)
    else:
        tmp = torch.empty(flat.numel(), dtype=storage, device=device)
        dequantize_eager(qdata, scales, t.nf4, tmp)
        flat.copy_(tmp)


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
