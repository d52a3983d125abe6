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
(benchmarks/speed/results/nf4_kernels.md). ``LIT_QLORA_NF4_SCRATCH=0`` turns the buffer off.

On CUDA (with Triton) a weight is dequantized whole, one kernel launch (:mod:`lit_qlora.nf4.triton`), into a
per-device buffer (one per process) the size of the largest weight: no slices, no fresh allocation per call.

Under ``torch.compile`` the NF4 linear is traced, not a graph break: the dense weight comes from the custom op
``lit_qlora::nf4_dequantize`` (:mod:`lit_qlora.nf4.ops`), whole, and inductor plans its memory.
``LIT_QLORA_NF4_SAVE_DENSE=1`` (a benchmark switch) saves the dense weight for backward instead of the NF4 one: with
activation checkpointing, the recompute's dense weights are kept for the block's backward (speed against memory,
benchmarks/README "GPU").
A decode step (a few rows of x on CPU and no gradient to compute: generate, chat, serve, GRPO's rollouts) takes the
NF4 decode kernel instead (:mod:`lit_qlora.nf4.gemv`, where :func:`decode_applies`): the product straight from the
codes, no dense weight; ``LIT_QLORA_NF4_GEMV=0`` turns it off (the A/B of benchmarks/speed/nf4_decode.py). On CUDA a
decode step's product is the few-row Triton kernel (:mod:`lit_qlora.nf4.triton_rows`, where
:func:`rows_kernel_applies`), which reads the codes once and never writes a dense weight; the same switch turns it off.
``LIT_QLORA_NF4_FUSED=1`` (a benchmark switch, default off) computes the product without a dense weight where
:func:`fused_matmul_applies`: forward and backward's dX each in one Triton kernel that dequantizes the weight's tiles
in registers (:mod:`lit_qlora.nf4.triton_matmul`, custom ops under torch.compile); only the NF4 weight is saved.
"""

from __future__ import annotations

import os
import threading
import types
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchao.quantization import NF4Tensor

from lit_qlora.base import switches
from lit_qlora.nf4 import gemv
from lit_qlora.nf4.codec import dequantize_nf4, is_nf4
from lit_qlora.nf4.layout import row_slices
from lit_qlora.nf4.native import is_fake, triton_available
from lit_qlora.nf4.ops import dequantize_op
from lit_qlora.nf4.reference import SUPPORTED_DTYPES

DENSE_CHUNK_ELEMS = 1 << 23

_scratch = threading.local()
_cuda_scratch = types.SimpleNamespace()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def whole_weight(weight: NF4Tensor) -> bool:
    """Whether the weight is dequantized whole: under torch.compile (the op), and on CUDA with Triton (one launch)."""
    return torch.compiler.is_compiling() or (weight.quantized_data.device.type == "cuda" and triton_available())


def _row_slices(weight: NF4Tensor) -> list[tuple[int, int]]:
    if whole_weight(weight):
        return [(0, weight.shape[0])]
    return row_slices(weight, DENSE_CHUNK_ELEMS)


@torch.compiler.assume_constant_result  # dynamo calls it once, at trace time (not through triton_available's cache)
def _triton_ok() -> bool:
    return triton_available()


def fused_matmul_applies(x: torch.Tensor, weight: NF4Tensor) -> bool:
    """Whether NF4Linear runs the fused kernels (nf4/triton_matmul.py): ``LIT_QLORA_NF4_FUSED=1``, Triton, a
    supported compute dtype, and ``x`` and the weight on CUDA, or on CPU under Triton's interpreter (the tests)."""
    if not switches.enabled("LIT_QLORA_NF4_FUSED") or x.device != weight.quantized_data.device:
        return False
    interpreted = x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    return ((x.device.type == "cuda" or interpreted) and _compute_dtype(x) in SUPPORTED_DTYPES
            and weight.nf4.dtype in SUPPORTED_DTYPES and weight.numel() < 2**31 and _triton_ok())


def decode_applies(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """Whether NF4Linear's forward is the decode kernel (nf4/gemv.py): a 2-D NF4 weight and x on CPU, at most
    ``gemv.MAX_ROWS`` rows of x, a float32 or bf16 compute dtype, nothing to differentiate (grad mode off, or neither
    x nor the bias requires grad), not under torch.compile (ctypes kernels cannot be traced) nor on fake tensors,
    ``LIT_QLORA_NF4_GEMV`` not 0, and the kernel built and checked."""
    return _decode_dtype(x, weight, bias) is not None


def _decode_dtype(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.dtype]:
    """The compute dtype where `decode_applies`, else None. Runs for every linear of every decode step, so it asks
    the NF4 weight nothing through torch functions (its shape: `gemv.weight_shape`)."""
    if torch.compiler.is_compiling() or not x.is_cpu or is_fake(x):  # first: no guards while tracing
        return None
    if type(weight) is not NF4Tensor or not weight.quantized_data.is_cpu:
        return None
    k = x.shape[-1] if x.dim() else -1
    if gemv.weight_shape(weight)[1:] != (k,) or not 0 < x.numel() <= gemv.MAX_ROWS * k:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    dtype = _compute_dtype(x)
    if dtype not in gemv.X_FORMATS or not switches.enabled("LIT_QLORA_NF4_GEMV"):
        return None
    return dtype if gemv.gemv_available(weight.nf4.dtype) and not fused_matmul_applies(x, weight) else None


def rows_kernel_applies(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """Whether NF4Linear's forward is the few-row Triton kernel (nf4/triton_rows.py): x and a 2-D NF4 weight on CUDA
    with Triton (or on CPU under Triton's interpreter with ``LIT_QLORA_NF4_FUSED=1``: the tests), at most
    ``triton_rows.MAX_ROWS`` rows of x, W's rows of whole blocks, a supported compute dtype, nothing to differentiate,
    not under torch.compile, ``LIT_QLORA_NF4_GEMV`` not 0."""
    if torch.compiler.is_compiling() or is_fake(x) or type(weight) is not NF4Tensor or x.dim() == 0:
        return False
    if x.is_cuda:
        if (x.device != weight.quantized_data.device or _compute_dtype(x) not in SUPPORTED_DTYPES
                or weight.nf4.dtype not in SUPPORTED_DTYPES or not _triton_ok()):
            return False
    elif not fused_matmul_applies(x, weight):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or not switches.enabled("LIT_QLORA_NF4_GEMV"):
        return False
    from lit_qlora.nf4.triton_rows import rows_apply

    return rows_apply(x.numel() // x.shape[-1], weight.shape[1], weight.block_size)


def _save_dense() -> bool:
    return switches.enabled("LIT_QLORA_NF4_SAVE_DENSE")


def _scratch_matrix(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
    """A (rows, cols) matrix in this thread's scratch buffer for ``device`` (CPU, or CUDA with Triton; grown when too
    small), valid until the next call on this thread; None where no scratch buffer is used (other devices,
    ``LIT_QLORA_NF4_SCRATCH=0``, the dense weight saved for backward)."""
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not triton_available()):
        return None
    if not switches.enabled("LIT_QLORA_NF4_SCRATCH") or (device.type == "cuda" and _save_dense()):
        return None
    # One CUDA buffer per process, not per thread: CUDA's backward runs on autograd's device thread, and a buffer
    # per thread doubled it (measured: +224 MiB, not 112, at 8B). The stream orders its uses.
    holder = _scratch if device.type == "cpu" else _cuda_scratch
    buffers = getattr(holder, "buffers", None)
    if buffers is None:
        buffers = holder.buffers = {}
    numel = rows * cols
    key = (device, dtype)
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buffers.pop(key, None)
        # Made outside inference_mode even under it (validation, generation): an inference tensor could not be
        # written by training later, and a second buffer per mode had held up to 32 MB through every training
        # step after the first validation.
        with torch.inference_mode(False):
            buf = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(rows, cols)


def dense_rows(weight: NF4Tensor, dtype: torch.dtype, start: int, stop: int, recompute: int = 0) -> torch.Tensor:
    """Rows ``start:stop`` of the dequantized weight, valid only until the next call on this thread (a fresh tensor
    under torch.compile, where it comes from the custom op: ``recompute`` names the call site, see nf4/ops.py)."""
    if torch.compiler.is_compiling():
        return dequantize_op(weight, dtype, recompute)
    rows = None if (start, stop) == (0, weight.shape[0]) else (start, stop)
    out = _scratch_matrix(stop - start, weight.shape[1], dtype, weight.quantized_data.device)
    return dequantize_nf4(weight, dtype, out=out, rows=rows)


def dense_stack(weights: Sequence[NF4Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The NF4 weights dequantized and stacked along dim 0 (one matmul's weight for several projections of the
    same input), in the scratch buffer on CPU: valid only until the next call on this thread. The caller keeps
    the stack within ``DENSE_CHUNK_ELEMS``, the bound every dense copy of a weight here keeps."""
    if torch.compiler.is_compiling():
        return torch.cat([dequantize_op(w, dtype) for w in weights])
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
        ctx.has_bias = bias is not None
        ctx.dense = False
        ctx.fused = fused_matmul_applies(x, weight)
        if ctx.fused:
            from lit_qlora.nf4.triton_matmul import nf4_linear_fused

            ctx.save_for_backward(weight)
            return nf4_linear_fused(x.to(dtype), weight, bias)
        slices = _row_slices(weight)
        if len(slices) == 1:
            dense = dense_rows(weight, dtype, 0, weight.shape[0])
            ctx.dense = _save_dense() and not torch.compiler.is_compiling()
            ctx.save_for_backward(dense if ctx.dense else weight)
            return F.linear(x, dense, bias)
        ctx.save_for_backward(weight)
        x = x.to(dtype)
        y = x.new_empty(*x.shape[:-1], weight.shape[0])
        for start, stop in slices:
            y[..., start:stop] = F.linear(x, dense_rows(weight, dtype, start, stop),
                                          None if bias is None else bias[start:stop])
        return y

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (weight,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0] and ctx.fused:
            from lit_qlora.nf4.triton_matmul import nf4_grad_input_fused

            grad_x = nf4_grad_input_fused(grad_output, weight)
        elif ctx.needs_input_grad[0] and ctx.dense:
            grad_x = grad_output @ weight.to(grad_output.dtype)
        elif ctx.needs_input_grad[0]:
            dtype = grad_output.dtype
            slices = _row_slices(weight)
            # Sliced, the partial products need an fp32 sum of grad_x's size: when that is larger than the whole
            # dense weight (Llama-3-8B's down_proj at 2x2048 tokens: 224 MiB against 112 MiB), dequantize whole.
            tokens = grad_output.numel() // grad_output.shape[-1]
            if len(slices) == 1 or tokens * 4 >= weight.shape[0] * dtype.itemsize:
                slices = [(0, weight.shape[0])]
            if len(slices) == 1:
                grad_x = grad_output @ dense_rows(weight, dtype, 0, weight.shape[0], recompute=1)
            else:
                # The slices contract over different rows: their bf16 partial products are summed in fp32.
                grad_x = torch.zeros(*grad_output.shape[:-1], weight.shape[1], dtype=torch.float32,
                                     device=grad_output.device)
                for start, stop in slices:
                    grad_x += grad_output[..., start:stop] @ dense_rows(weight, dtype, start, stop)
                grad_x = grad_x.to(dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_x, None, grad_bias


def nf4_linear(x: torch.Tensor, weight: NF4Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, dequantize_nf4(weight).to(x.dtype), bias)``; gradients flow to ``x`` and ``bias`` only.

    Under autocast the weight is dequantized straight to the autocast dtype. Under ``torch.compile`` it is traced
    (the dense weight from the custom op ``lit_qlora::nf4_dequantize``), no graph break. A decode step
    (:func:`decode_applies`) runs the decode kernel, which never dequantizes the weight (on CUDA the few-row Triton
    kernel, :func:`rows_kernel_applies`).
    """
    dtype = _decode_dtype(x, weight, bias)
    if dtype is not None:
        return gemv.nf4_matmul_rows(x if x.dtype == dtype else x.to(dtype), weight, bias)
    if not x.is_cpu or switches.enabled("LIT_QLORA_NF4_FUSED"):  # the CPU's training steps: no further checks
        if rows_kernel_applies(x, weight, bias):
            from lit_qlora.nf4.triton_rows import nf4_linear_rows

            return nf4_linear_rows(x.to(_compute_dtype(x)), weight, bias)
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
