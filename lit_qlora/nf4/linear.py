"""The frozen NF4 linear: ``y = x @ dequant(W).T + b``, with gradients to ``x`` and ``b`` only; the frozen base
projection (NF4 or dense) that LoRA layers and tensor-parallel layers call; the frozen NF4 module.

The dense weight exists only for the matmul that needs it: backward re-dequantizes instead of saving it.
A weight larger than ``DENSE_CHUNK_ELEMS`` is used a slice of rows at a time, so the transient dense copy stays
at 16 MB (bf16) however large the weight: a 32000x2048 lm_head would need 131 MB, Llama-3's 128256x4096 1 GB.
(16 MB rather than 32: on CPU it is the one memory cost QLoRA has and LoRA lacks, and halving it cost no measurable
step time on SmolLM2 4x512: benchmarks/README, issue 16.)
(Backward sums the slices' partial products in fp32; when that sum would be larger than the whole dense weight,
many tokens through a wide weight, it dequantizes the weight whole instead.)
On CPU the dense slice is written into a per-thread scratch buffer reused across calls: a fresh multi-MB
allocation costs more in page faults (~2.5 GB/s on small VMs) than the dequantization itself
(benchmarks/results/nf4_kernels.md). ``LIT_QLORA_NF4_SCRATCH=0`` turns the buffer off.
"""

from __future__ import annotations

import os
import threading
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchao.quantization import NF4Tensor

from lit_qlora.nf4.codec import dequantize_nf4, is_nf4
from lit_qlora.nf4.layout import row_slices
from lit_qlora.nf4.reference import SUPPORTED_DTYPES

DENSE_CHUNK_ELEMS = 1 << 23

_scratch = threading.local()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _row_slices(weight: NF4Tensor) -> list[tuple[int, int]]:
    return row_slices(weight, DENSE_CHUNK_ELEMS)


def _scratch_matrix(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
    """A (rows, cols) matrix in this thread's CPU scratch buffer (grown when too small), valid until the next call
    on this thread; None where no scratch buffer is used (other devices, ``LIT_QLORA_NF4_SCRATCH=0``)."""
    if device.type != "cpu" or os.environ.get("LIT_QLORA_NF4_SCRATCH", "1") == "0":
        return None
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    numel = rows * cols
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buffers.pop(dtype, None)
        # Made outside inference_mode even under it (validation, generation): an inference tensor could not be
        # written by training later, and a second buffer per mode had held up to 32 MB through every training
        # step after the first validation.
        with torch.inference_mode(False):
            buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(rows, cols)


def _dense_rows(weight: NF4Tensor, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of the dequantized weight, valid only until the next call on this thread."""
    rows = None if (start, stop) == (0, weight.shape[0]) else (start, stop)
    out = _scratch_matrix(stop - start, weight.shape[1], dtype, weight.quantized_data.device)
    return dequantize_nf4(weight, dtype, out=out, rows=rows)


def dense_stack(weights: Sequence[NF4Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The NF4 weights dequantized and stacked along dim 0 (one matmul's weight for several projections of the
    same input), in the scratch buffer on CPU: valid only until the next call on this thread. The caller keeps
    the stack within ``DENSE_CHUNK_ELEMS``, the bound every dense copy of a weight here keeps."""
    total = sum(w.shape[0] for w in weights)
    cols, device = weights[0].shape[1], weights[0].quantized_data.device
    out = _scratch_matrix(total, cols, dtype, device)
    if out is None:
        out = torch.empty(total, cols, dtype=dtype, device=device)
    start = 0
    for w in weights:
        dequantize_nf4(w, dtype, out=out[start : start + w.shape[0]])
        start += w.shape[0]
    return out


class NF4Linear(torch.autograd.Function):
    """``y = x @ dequant(W).T + b`` with a frozen NF4 ``W``; backward re-dequantizes (saves only the NF4)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: NF4Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        dtype = _compute_dtype(x)
        dtype = dtype if dtype in SUPPORTED_DTYPES else x.dtype
        ctx.save_for_backward(weight)
        ctx.has_bias = bias is not None
        slices = _row_slices(weight)
        if len(slices) == 1:
            return F.linear(x, _dense_rows(weight, dtype, 0, weight.shape[0]), bias)
        x = x.to(dtype)
        y = x.new_empty(*x.shape[:-1], weight.shape[0])
        for start, stop in slices:
            y[..., start:stop] = F.linear(x, _dense_rows(weight, dtype, start, stop),
                                          None if bias is None else bias[start:stop])
        return y

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (weight,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            dtype = grad_output.dtype
            slices = _row_slices(weight)
            # Sliced, the partial products need an fp32 sum of grad_x's size: when that is larger than the whole
            # dense weight (Llama-3-8B's down_proj at 2x2048 tokens: 224 MiB against 112 MiB), dequantize whole.
            tokens = grad_output.numel() // grad_output.shape[-1]
            if len(slices) == 1 or tokens * 4 >= weight.shape[0] * dtype.itemsize:
                slices = [(0, weight.shape[0])]
            if len(slices) == 1:
                grad_x = grad_output @ _dense_rows(weight, dtype, 0, weight.shape[0])
            else:
                # The slices contract over different rows: their bf16 partial products are summed in fp32.
                grad_x = torch.zeros(*grad_output.shape[:-1], weight.shape[1], dtype=torch.float32,
                                     device=grad_output.device)
                for start, stop in slices:
                    grad_x += grad_output[..., start:stop] @ _dense_rows(weight, dtype, start, stop)
                grad_x = grad_x.to(dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_x, None, grad_bias


@torch.compiler.disable
def nf4_linear(x: torch.Tensor, weight: NF4Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, dequantize_nf4(weight).to(x.dtype), bias)``; gradients flow to ``x`` and ``bias`` only.

    Under autocast the weight is dequantized straight to the autocast dtype. Under ``torch.compile`` this is a
    graph break (the kernels write through raw pointers, which dynamo cannot trace): it runs eagerly.
    """
    return NF4Linear.apply(x, weight, bias)


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The base projection: our fast NF4 kernel for NF4 weights, F.linear otherwise."""
    if is_nf4(weight):
        return nf4_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class FrozenNF4Linear(nn.Linear):
    """A frozen linear whose weight is an NF4Tensor; forward goes through our fast NF4 kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.weight, self.bias)
