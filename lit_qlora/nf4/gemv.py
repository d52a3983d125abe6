"""The NF4 decode kernel: ``y = x @ dequant(W).T + b`` for a few rows of ``x`` on CPU (gemv.c), with the codes looked
up in registers and no dense weight. A decode step (generate, chat, serve, GRPO's rollouts) multiplies one row per
sequence by every weight; dequantizing each weight whole for that (the training path, nf4/linear.py) writes and reads
back 8 bytes per weight where the product needs half a byte.

The values are dequantize's own (the same scales and rounded table, bit for bit), the sums float32: against
dequantize + matmul only the order of the additions differs. x and y are float32 or bfloat16 (y in x's dtype); the
weight is stored in any NF4 dtype.

Which build runs: ``isa=None`` the one kernels.c gets (``native.default_march``: this CPU, or AVX2 under the AVX2 cap),
or a named one, ``"avx512_bf16"`` (bf16 x multiplied by vdpbf16ps: a CPU with AVX512-BF16 decodes bf16 this way),
``"avx512"``, ``"avx2"`` or ``"scalar"`` (portable C), for tests and benchmarks. Each is compiled on
first use by ``native.build_library``, checked against dequantize + matmul before it is trusted, and threaded over the
weight's rows on torch's OpenMP team. Unavailable (no compiler, a failed check, ``LIT_QLORA_NF4_BACKEND=eager``), the
NF4 linear keeps its dense path; :mod:`lit_qlora.nf4.linear` decides when the kernel applies.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Optional

import torch
from torchao.quantization import NF4Tensor

from lit_qlora.base import switches
from lit_qlora.nf4.codec import dequantize_nf4, quantize_nf4
from lit_qlora.nf4.native import (STORAGE_FORMATS, build_library, is_x86, package_text, simd_header,
                                  use_native)
from lit_qlora.nf4.reference import cached, level_table

log = logging.getLogger(__name__)

MAX_ROWS = 16
"""The most rows of x (tokens of a step) the NF4 linear sends here: the kernel's tiles of 4 rows each read the codes
again, and from about this many rows on a matmul of the dense weight wins back its dequantize."""

ISAS = ("scalar", "avx2", "avx512", "avx512_bf16")  # by the number gemv.c's nf4_gemv_isa() returns
_MARCH = {"avx512_bf16": "x86-64-v4 -mavx512bf16", "avx512": "x86-64-v4", "avx2": "x86-64-v3",
          "scalar": "x86-64"}
_I32, _I64, _PTR = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {  # after the thread count: q, qs, factor, mean, levels, n, k, bs, sbs, wfmt, x, m, xfmt, bias, y, scratch, cap
    "nf4_gemv": [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I32, _PTR, _I64, _I32, _PTR, _PTR, _PTR, _I64],
    "dense_gemv": [_PTR, _I64, _I64, _PTR, _I64, _PTR],  # w, n, k, x, m, y: all bf16
}
X_FORMATS = {torch.bfloat16: 0, torch.float32: 2}
"""x's dtypes, numbered as simd.h numbers the storage formats."""
_TABLE_BLOCKS = 128  # blocks whose tables a thread computes at once (8 KiB: they stay in L1 for the product)
_WORK_PER_THREAD = 1 << 17  # multiply-adds (~30 us on one core) that pay for waking another thread

_lock = threading.Lock()
_scratch = threading.local()
_libs: dict = {}
_errors: dict = {}


def cpu_has_avx512() -> bool:
    """Whether this CPU runs the AVX-512 build (x86-64-v4: F, BW, DQ, VL)."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return all(caps.get(f"avx512_{s}") for s in ("f", "bw", "dq", "vl"))


def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU runs the AVX512-BF16 build (AVX-512 and its bf16 dot product, vdpbf16ps)."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return cpu_has_avx512() and bool(caps.get("avx512_bf16"))


def gemv_lib(isa: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """The built, self-tested kernel (``isa``: None for the default build, or one of ``ISAS``), or None (the reason:
    :func:`gemv_error`). Built once per process and build."""
    if isa is not None and isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS} or None, got {isa!r}")
    if isa in _libs:
        return _libs[isa]
    with _lock:
        if isa not in _libs:
            lib = None
            try:
                lib = _build(isa)
                _self_test(lib)
            except Exception as e:  # no compiler, an ISA this CPU or compiler lacks, or a wrong result
                _errors[isa] = f"{type(e).__name__}: {e}"
                log.warning("lit_qlora.nf4: NF4 decode kernel (%s) unavailable (%s); the NF4 linear dequantizes",
                            isa or "default", e)
                lib = None
            _libs[isa] = lib
        return _libs[isa]


def gemv_error(isa: Optional[str] = None) -> Optional[str]:
    """Why the build of ``isa`` is not used (after :func:`gemv_lib` returned None), else None."""
    return _errors.get(isa)


def _build(isa: Optional[str]) -> ctypes.CDLL:
    if isa == "avx512" and not cpu_has_avx512():
        raise RuntimeError("this CPU has no AVX-512 (F, BW, DQ, VL)")
    if isa == "avx512_bf16" and not cpu_has_avx512_bf16():
        raise RuntimeError("this CPU has no AVX512-BF16")
    march = None
    if isa is not None and is_x86():
        march = _MARCH[isa]
    elif isa not in (None, "scalar"):
        raise RuntimeError(f"the {isa} build is for x86 CPUs")
    lib = build_library("nf4_gemv", {"gemv.c": package_text(__package__, "gemv.c"), "simd.h": simd_header()},
                        _SIGNATURES, march)
    lib.nf4_gemv_isa.restype = lib.dense_gemv_available.restype = ctypes.c_int
    lib.isa = ISAS[lib.nf4_gemv_isa()]
    lib.has_dense = bool(lib.dense_gemv_available())
    if isa is not None and lib.isa != isa:
        raise RuntimeError(f"asked for the {isa} build, compiled {lib.isa}")
    return lib


def gemv_available(storage: torch.dtype) -> bool:
    """Whether the default build runs weights stored in ``storage`` (compiling it on the first call)."""
    if not use_native(storage):
        return False
    lib = gemv_lib()
    return lib is not None and (storage != torch.float16 or lib.has_f16)


def weight_shape(weight: NF4Tensor) -> tuple[int, ...]:
    """``tuple(weight.shape)``, kept on the object (a tensor's shape never changes): NF4Tensor answers ``.shape``
    through its ``__torch_function__``, several microseconds that every linear of every decode step would pay."""
    shape = weight.__dict__.get("_lit_qlora_shape")
    if shape is None:
        shape = weight.__dict__["_lit_qlora_shape"] = tuple(weight.shape)
    return shape


def _threads(n: int, k: int, m: int) -> int:
    # torch's count at call time (the thread governor moves it), one per _WORK_PER_THREAD, one per 16 weight rows
    return max(1, min(torch.get_num_threads(), n * k * m // _WORK_PER_THREAD, n // 16))


def nf4_matmul_rows(x: torch.Tensor, weight: NF4Tensor, bias: Optional[torch.Tensor] = None, *,
                    isa: Optional[str] = None, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """``x @ dequantize_nf4(weight, x.dtype).T + bias`` in x's dtype (float32 or bfloat16, on CPU, any number of
    leading dims; the kernel is meant for a few rows), the weight a 2-D CPU ``NF4Tensor``. ``isa`` picks a build
    (see :data:`ISAS`); raises ``RuntimeError`` where it is unavailable."""
    lib = lib or gemv_lib(isa)
    if lib is None:
        raise RuntimeError(f"NF4 decode kernel unavailable: {gemv_error(isa)}")
    storage = weight.nf4.dtype
    n, k = weight_shape(weight)
    x = x.contiguous()  # (m, k) row-major, whatever its leading dims
    m = x.numel() // k
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    threads = _threads(n, k, m)
    # x reordered for the kernel's loads, then each thread's tables: 8 KiB of them (16 floats a block) at least
    cap = max(_TABLE_BLOCKS, k // weight.block_size + 3)
    scratch = _scratch_floats(m * k + threads * cap * 16)
    # The 16 levels as float: every NF4Tensor holds NF4_LEVELS rounded to its dtype (reference.level_table).
    levels = cached(("gemv_levels", storage), lambda: level_table(storage).float())
    b = None if bias is None else bias.to(x.dtype).contiguous()
    lib.nf4_gemv_mt(threads, weight.quantized_data.data_ptr(), weight.quantized_scalers.data_ptr(),
                    weight.quantization_factor.data_ptr(), weight.scaler_mean.data_ptr(), levels.data_ptr(), n, k,
                    weight.block_size, weight.scaler_block_size, STORAGE_FORMATS[storage], x.data_ptr(), m,
                    X_FORMATS[x.dtype], None if b is None else b.data_ptr(), y.data_ptr(), scratch.data_ptr(), cap)
    return y


def dense_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` is a bf16 decode product the dense kernel takes: both bf16 on CPU, a 2-D contiguous
    weight of x's width, a few rows of x, nothing to differentiate, and a build with it (AVX512-BF16)."""
    if not (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu" and weight.device.type == "cpu"):
        return False
    if weight.dim() != 2 or weight.size(1) != x.size(-1) or not weight.is_contiguous():
        return False
    if not 0 < x.numel() <= MAX_ROWS * x.size(-1) or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return False
    if torch.compiler.is_compiling() or not switches.enabled("LIT_QLORA_NF4_GEMV"):
        return False
    lib = gemv_lib() if use_native(torch.bfloat16) else None
    return lib is not None and lib.has_dense


def dense_matmul_rows(x: torch.Tensor, weight: torch.Tensor, *, isa: Optional[str] = None,
                      lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """``x @ weight.T`` for bf16 ``x`` (a few rows, any leading dims) and a bf16 (n, k) weight, read once at the
    memory's pace (where :func:`dense_applies`; raises ``RuntimeError`` on a build without the kernel)."""
    lib = lib or gemv_lib(isa)
    if lib is None or not lib.has_dense:
        raise RuntimeError(f"the dense bf16 decode kernel needs an AVX512-BF16 build ({gemv_error(isa) or 'this one has none'})")
    n, k = weight.shape
    x = x.contiguous()
    m = x.numel() // k
    y = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    lib.dense_gemv_mt(_threads(n, k, m), weight.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr())
    return y


def _scratch_floats(numel: int) -> torch.Tensor:
    """This thread's scratch of at least `numel` floats, kept between calls (grown when too small): a decode step
    calls the kernel for every linear, and a fresh allocation each time cost as much as a small product's work."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch.buf = torch.empty(max(numel, 1 << 14), dtype=torch.float32)
    return buf


def reference_product(x: torch.Tensor, weight: NF4Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What the kernel computes, in float64 from the dequantized weight (bf16 x: the weight rounded to bf16, as the
    dense path's matmul reads it): the tests' and the self-test's yardstick."""
    dense = dequantize_nf4(weight, x.dtype).double()
    y = x.double() @ dense.T
    return y if bias is None else y + bias.to(x.dtype).double()


def close_enough(got: torch.Tensor, x: torch.Tensor, weight: NF4Tensor, bias: Optional[torch.Tensor] = None,
                 rtol: float = 1e-5) -> bool:
    """Whether ``got`` is the product within float32 summation error (``rtol`` of the sum of the products' magnitudes)
    and, for bf16, one rounding of the result."""
    ref = reference_product(x, weight, bias)
    scale = x.double().abs() @ dequantize_nf4(weight, x.dtype).double().abs().T
    bound = rtol * scale + (2.0**-8 * ref.abs() if got.dtype == torch.bfloat16 else 0) + 1e-30
    return bool(((got.double() - ref).abs() <= bound).all())


def _self_test(lib: ctypes.CDLL) -> None:
    """The kernel against dequantize + matmul before it is used: layouts of whole-block rows (the fast paths) and of
    blocks spanning rows (portable C), every storage dtype, float32 and bf16 x, one row and a ragged tile."""
    gen = torch.Generator().manual_seed(0)
    storages = [torch.bfloat16, torch.float32] + ([torch.float16] if lib.has_f16 else [])
    for storage in storages:
        for (n, k), block_size in (((40, 128), 64), ((10, 96), 64), ((64, 33), 64), ((34, 64), 32)):
            w = quantize_nf4(torch.randn(n, k, generator=gen).to(storage), block_size)
            bias = torch.randn(n, generator=gen)
            for dtype in X_FORMATS:
                for m in (1, 5):
                    x = torch.randn(m, k, generator=gen).to(dtype)
                    got = nf4_matmul_rows(x, w, bias.to(dtype), lib=lib)
                    if not close_enough(got, x, w, bias.to(dtype)):
                        raise RuntimeError(f"NF4 decode kernel self-test mismatch: {storage} weight {n}x{k} "
                                           f"(block {block_size}), {dtype} x of {m} rows")
    if lib.has_dense:
        for (n, k), m in (((40, 96), 1), ((33, 200), 5)):  # tails past 64 and 32 columns; a ragged tile
            w, x = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(m, k, generator=gen).bfloat16()
            got, ref = dense_matmul_rows(x, w, lib=lib).double(), x.double() @ w.double().T
            if not bool(((got - ref).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().T) + 2**-8 * ref.abs()).all()):
                raise RuntimeError(f"dense bf16 decode kernel self-test mismatch: weight {n}x{k}, {m} rows")
