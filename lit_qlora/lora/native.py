"""LoRA's C kernels (kernels.c beside this module: the hash-mask dropout, and dropout fused with the down projection,
forward and backward) and their ctypes bindings, for :mod:`lit_qlora.lora.dropout`.

Built on first use as NF4's kernels are (`lit_qlora.nf4.native.build_library`: ``gcc -O3 -march=native``, torch's
OpenMP team, cached per source, compiler, flags and CPU), with NF4's simd.h beside kernels.c. dropout.py checks them
against its PyTorch ops, per dtype, before it uses them. Without a compiler, or with ``LIT_QLORA_NF4_BACKEND=eager``
(which selected the PyTorch path for these kernels too when they were built with NF4's), the PyTorch ops run.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Optional, Sequence

import torch

from lit_qlora.base import switches
from lit_qlora.nf4.native import STORAGE_FORMATS, build_library, kernel_threads, package_text, simd_header

log = logging.getLogger(__name__)

_I32, _I64, _PTR, _U32, _F32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_float
_SIGNATURES = {  # each kernel's arguments after the thread count its threaded `_mt` entry point takes first
    "lora_dropout": [_PTR, _PTR, _I64, _I64, _U32, _U32, _F32, _I32],
    "lora_drop_down": [_PTR, _I64, _I64, _I64, _I32, _PTR, _I64, _PTR, _PTR, _U32, _F32, _I32],
    "lora_drop_down_bwd": [_PTR, _I64, _I64, _I64, _I64, _I32, _PTR, _I64, _PTR, _PTR, _PTR, _I32, _PTR, _U32, _F32,
                           _I32],
}
_native_lock = threading.Lock()
_native_state: dict = {"lib": None, "tried": False, "error": None}


def kernel_source() -> str:
    """kernels.c as shipped with the package (package data)."""
    return package_text(__package__, "kernels.c")


def native_lib() -> Optional[ctypes.CDLL]:
    """The compiled kernels, or None (the reason: :func:`native_error`). Built once per process."""
    if _native_state["tried"]:
        return _native_state["lib"]
    with _native_lock:
        if not _native_state["tried"]:
            try:
                _native_state["lib"] = build_library("lora", {"kernels.c": kernel_source(), "simd.h": simd_header()},
                                                     _SIGNATURES)
            except Exception as e:  # no compiler, or an unsupported target: the PyTorch ops
                _native_state["error"] = f"{type(e).__name__}: {e}"
                log.warning("lit_qlora.lora: native LoRA dropout kernels unavailable (%s); using PyTorch ops", e)
            _native_state["tried"] = True
        return _native_state["lib"]


def native_error() -> Optional[str]:
    """Why the kernels are not used (after :func:`native_lib` failed), else None."""
    return _native_state["error"]


def use_native(dtype: Optional[torch.dtype] = None) -> bool:
    """Whether the kernels can run on CPU tensors of ``dtype`` (compiling them on the first call)."""
    if switches.choice("LIT_QLORA_NF4_BACKEND") == "eager":
        return False
    lib = native_lib()
    return lib is not None and (dtype != torch.float16 or lib.has_f16)


def dropout_elements(src: torch.Tensor, out: torch.Tensor, seed: int, threshold: int, scale: float) -> None:
    """C kernel: ``out = src * scale`` where the hash of (element index, seed) >= threshold, else 0 (both
    contiguous, same dtype; see lit_qlora/lora/dropout.py)."""
    lib = _native_state["lib"]
    fmt, n = STORAGE_FORMATS[src.dtype], src.numel()
    threads = kernel_threads(-(-n // (1 << 14)), n * src.element_size())  # the C side splits in chunks of 2**14
    lib.lora_dropout_mt(threads, src.data_ptr(), out.data_ptr(), 0, n, seed, threshold, scale, fmt)


def _pointers(tensors) -> ctypes.Array:
    return (ctypes.c_int64 * len(tensors))(*[t.data_ptr() for t in tensors])


def lora_drop_down(x: torch.Tensor, a: Sequence[torch.Tensor], h: Sequence[torch.Tensor], seeds: Sequence[int],
                   threshold: int, scale: float) -> None:
    """C kernel: ``h[q] = (x * keep_q * scale) @ a[q].T`` for each adapter q without writing the dropped x (x
    contiguous (rows, cols); a[q] (r, cols) of x's dtype, h[q] float32 (rows, r), all contiguous; see lora_dropout)."""
    lib = _native_state["lib"]
    rows, cols = x.shape
    r, fmt = a[0].shape[0], STORAGE_FORMATS[x.dtype]
    threads = kernel_threads(-(-rows // 32), x.numel() * x.element_size() * len(a))  # the C side splits in 32 rows
    lib.lora_drop_down_mt(threads, x.data_ptr(), cols, 0, rows, len(a), _pointers(a), r, _pointers(h),
                          (ctypes.c_int64 * len(seeds))(*seeds), threshold, scale, fmt)


def lora_drop_down_backward(x: torch.Tensor, a: Sequence[torch.Tensor], grad_h: Sequence[torch.Tensor],
                            grad_a: Sequence[torch.Tensor], grad_x: Optional[torch.Tensor], accumulate: bool,
                            seeds: Sequence[int], threshold: int, scale: float) -> None:
    """C kernel: ``grad_a[q] += grad_h[q].T @ (x * keep_q * scale)`` and ``grad_x (+)= sum_q keep_q * scale *
    (grad_h[q] @ a[q])`` (a[q] (r, cols) of x's dtype, float32 grad_h[q] (rows, r) and grad_a (r, cols); grad_x like x,
    or None)."""
    lib = _native_state["lib"]
    rows, cols = x.shape
    r, fmt = a[0].shape[0], STORAGE_FORMATS[x.dtype]
    gx = None if grad_x is None else grad_x.data_ptr()
    threads = kernel_threads(-(-cols // 16), x.numel() * x.element_size() * len(a))  # the C side splits in 16 columns
    lib.lora_drop_down_bwd_mt(threads, x.data_ptr(), rows, cols, 0, cols, len(a), _pointers(a), r, _pointers(grad_h),
                              _pointers(grad_a), gx, int(accumulate), (ctypes.c_int64 * len(seeds))(*seeds),
                              threshold, scale, fmt)
