"""The native CPU path: kernels.c compiled with ``gcc -O3 -march=native`` on first use, checked against the
PyTorch path before it is trusted, and run through ctypes across ``torch.get_num_threads()`` threads of torch's own
OpenMP team (the library links libgomp, which resolves to the copy torch loaded; without OpenMP it runs on one).

The shared library is cached per source, compiler, flags and CPU under ``~/.cache/lit_qlora/kernels`` (or
``$LIT_QLORA_KERNEL_CACHE``), so an edited kernels.c or another CPU gets its own build. Without a compiler,
with a failing self-test, or with ``LIT_QLORA_NF4_BACKEND=eager``, callers fall back to
:mod:`lit_qlora.nf4.reference` (one warning).

The build (`build_library`), simd.h (the vector helpers kernels.c includes), the storage formats' numbers and
`kernel_threads` serve LoRA's C kernels too (lit_qlora/lora/kernels.c, bound in :mod:`lit_qlora.lora.native`).

Beside it, which path CUDA tensors take: ``triton_available`` (the Triton kernel, :mod:`lit_qlora.nf4.triton`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from importlib import resources
from typing import Optional

import torch

from lit_qlora.base import switches
from lit_qlora.base.hardware import avx2_capped
from lit_qlora.nf4.reference import (SUPPORTED_DTYPES, cached, dequantize_eager, dequantize_scalers,
                                  double_quantize, level_table, quantize_eager, thresholds)

log = logging.getLogger(__name__)

STORAGE_FORMATS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
"""Storage formats as the C kernels number them (simd.h)."""
_native_lock = threading.Lock()
_native_state: dict = {"lib": None, "tried": False, "error": None}


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


def package_text(package: str, name: str) -> str:
    """A file shipped with `package` (package data, so non-editable installs have it too)."""
    return resources.files(package).joinpath(name).read_text(encoding="utf-8")


def kernel_source() -> str:
    """kernels.c as shipped with the package (package data, so non-editable installs have it too)."""
    return package_text(__package__, "kernels.c")


def simd_header() -> str:
    """simd.h, which NF4's and LoRA's kernels.c include: shipped beside this module, copied beside either to build."""
    return package_text(__package__, "simd.h")


def _kernel_cache_dir() -> str:
    cache_dir = switches.text("LIT_QLORA_KERNEL_CACHE") or os.path.join(
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
    return cache_dir


_I32, _I64, _PTR = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {  # each kernel's arguments after the thread count its threaded `_mt` entry point takes first
    "nf4_dequant16": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I32],
    "nf4_dequant32": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I32],
    "nf4_quantize": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I32],
}


def _compile_native() -> ctypes.CDLL:
    return build_library("nf4", {"kernels.c": kernel_source(), "simd.h": simd_header()}, _SIGNATURES)


def build_library(name: str, sources: dict[str, str], signatures: dict[str, list],
                  march: Optional[str] = None) -> ctypes.CDLL:
    """Compile `sources` (file name -> text: the first is compiled, the others are files it includes) into a shared
    library, cached under the kernel cache by texts, compiler, flags and CPU; with OpenMP where the compiler has it,
    else on one thread (one warning). Each of `signatures` names a kernel whose threaded entry point `NAME_mt` takes
    a thread count, then those ctypes arguments; `lib.has_f16` is what `{name}_has_f16()` says: float16 compiled.
    `march`: gcc's -march (default: `default_march()`), optionally followed by -m flags (``"x86-64-v4
    -mavx512bf16"``), for a build of one instruction set whatever the CPU."""
    compiler = switches.text("LIT_QLORA_CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise RuntimeError("no C compiler (gcc/cc) found")
    march = march or default_march()
    flags = ["-O3", *f"-march={march}".split(), "-std=gnu11", "-shared", "-fPIC"]
    flags += shlex.split(switches.text("LIT_QLORA_CFLAGS") or "")  # extra flags, e.g. for debugging
    try:
        return _build(name, sources, signatures, compiler, [*flags, "-fopenmp"])
    except RuntimeError as e:  # a compiler without OpenMP (clang on macOS): the same kernels on one thread
        log.warning("lit_qlora.%s: building the native kernels with -fopenmp failed (%s); they run on one thread",
                    name, str(e)[-300:])
        return _build(name, sources, signatures, compiler, flags)


def is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def default_march() -> str:
    """The kernels' -march: this CPU's, or AVX2 under the AVX2 cap (lit_qlora.base.hardware.AVX2_ENV), as a user's CPU
    runs them."""
    return "x86-64-v3" if avx2_capped() and is_x86() else "native"


def _build(name: str, sources: dict[str, str], signatures: dict[str, list], compiler: str,
           flags: list[str]) -> ctypes.CDLL:
    # The texts that are hashed are the texts compiled (written out below), so the key always names its build.
    texts = [f"{file}\n{text}" for file, text in sources.items()]
    key = hashlib.sha256("\n".join([*texts, compiler, *flags, _cpu_fingerprint()]).encode()).hexdigest()[:16]
    cache_dir = _kernel_cache_dir()
    lib_path = os.path.join(cache_dir, f"{name}_{key}.so")
    if not os.path.exists(lib_path):
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            for file, text in sources.items():
                with open(os.path.join(tmp, file), "w") as f:
                    f.write(text)
            src = os.path.join(tmp, next(iter(sources)))
            tmp_lib = os.path.join(tmp, f"{name}.so")
            res = subprocess.run(
                [compiler, *flags, src, "-o", tmp_lib], capture_output=True, text=True, timeout=120
            )
            if res.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {res.stderr.strip()[-2000:]}")
            os.replace(tmp_lib, lib_path)  # atomic: concurrent processes see a complete file or none
    lib = ctypes.CDLL(lib_path)
    for kernel, args in signatures.items():
        fn = getattr(lib, kernel + "_mt")
        fn.argtypes, fn.restype = [ctypes.c_int32, *args], None
    has_f16 = getattr(lib, f"{name}_has_f16")
    has_f16.restype = ctypes.c_int
    lib.has_f16 = bool(has_f16())
    return lib


def native_lib() -> Optional[ctypes.CDLL]:
    """The compiled, self-tested kernels, or None (the reason: :func:`native_error`). Built once per process."""
    if _native_state["tried"]:
        return _native_state["lib"]
    with _native_lock:
        if _native_state["tried"]:
            return _native_state["lib"]
        lib = None
        try:
            lib = _compile_native()
            _native_state["lib"] = lib  # provisional, for the self-test below
            _self_test()
        except Exception as e:  # no compiler, unsupported target, or a wrong result: use the torch path
            _native_state["error"] = f"{type(e).__name__}: {e}"
            log.warning("lit_qlora.nf4: native NF4 kernels unavailable (%s); using the PyTorch path", e)
            lib = None
        _native_state["lib"] = lib
        _native_state["tried"] = True
        return lib


def native_error() -> Optional[str]:
    """Why the native kernels are not used (after :func:`native_lib` failed), else None."""
    return _native_state["error"]


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN matching NaN (NaN bit patterns differ even between PyTorch's own kernels)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _self_test() -> None:
    """Compare the C kernels with the PyTorch path (tails, zero/inf blocks, every dtype) before using them."""
    gen = torch.Generator().manual_seed(0)
    lib = _native_state["lib"]
    for dtype in SUPPORTED_DTYPES:
        if dtype == torch.float16 and not lib.has_f16:
            continue
        for block_size in (72, 64):  # 72: 36-byte blocks exercise the scalar tails
            w = torch.randn(8, block_size * 4, generator=gen, dtype=torch.float32)
            w[1, :block_size] = 0.0  # an all-zero block: 0/0 -> NaN -> code 0
            w[2, 5] = 1e30  # a block dominated by one huge value
            w = w.to(dtype)
            n = w.numel()
            q_ref, s_ref = torch.empty(n // 2, dtype=torch.uint8), torch.empty(n // block_size, dtype=dtype)
            quantize_eager(w.reshape(-1), block_size, q_ref, s_ref)
            q_nat, s_nat = torch.empty_like(q_ref), torch.empty_like(s_ref)
            quantize_blocks(w.reshape(-1), block_size, q_nat, s_nat)
            if not (torch.equal(q_nat, q_ref) and _same_values(s_nat, s_ref)):
                raise RuntimeError(f"native quantize self-test mismatch for {dtype}")
            scales = dequantize_scalers(*double_quantize(s_ref, 4), 4, dtype)  # groups of 4 of the 32 blocks
            levels = level_table(dtype)
            ref = torch.empty(n, dtype=dtype)
            dequantize_eager(q_ref, scales, levels, ref)
            for out_dtype in {dtype, torch.float32}:
                got = torch.empty(n, dtype=out_dtype)
                dequantize_blocks(q_ref, scales, levels, dtype, got)
                if not _same_values(got, ref.to(out_dtype)):
                    raise RuntimeError(f"native dequantize self-test mismatch for {dtype} -> {out_dtype}")


def kernel_threads(n_units: int, work_bytes: int) -> int:
    """Threads for a kernel call: torch's count, but one per MiB of work at most (small jobs run on one)."""
    return max(1, min(torch.get_num_threads(), work_bytes >> 20, n_units))


def is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor (torch._subclasses): shapes and dtypes without data, as `litqlora estimate` runs a step."""
    return type(t).__name__ == "FakeTensor"


def quantize_blocks(src: torch.Tensor, block_size: int, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """C kernel over a contiguous run of whole blocks: absmax -> ``s_out``, packed codes -> ``q_out``."""
    if is_fake(src):
        return  # a dry run (`litqlora estimate`): no data to read; the kernel allocates nothing either
    lib = _native_state["lib"]
    thr = cached(("thr_tensor", src.dtype), lambda: torch.tensor(thresholds(src.dtype), dtype=torch.float32))
    fmt = STORAGE_FORMATS[src.dtype]
    n_blocks = s_out.numel()
    threads = kernel_threads(n_blocks, src.numel() * src.element_size())
    lib.nf4_quantize_mt(threads, src.data_ptr(), 0, n_blocks, block_size, thr.data_ptr(), q_out.data_ptr(),
                        s_out.data_ptr(), fmt)


def dequantize_blocks(qdata: torch.Tensor, scales: torch.Tensor, levels: torch.Tensor, dtype: torch.dtype,
                      out: torch.Tensor, blocks: Optional[tuple[int, int]] = None) -> None:
    """Dequantize all blocks, or only ``blocks = (b0, b1)``, of data stored in ``dtype`` into ``out`` (flat,
    ``dtype`` or float32)."""
    lib = _native_state["lib"]
    qdata = qdata.contiguous()
    scales = scales.float().contiguous()
    levels = levels.float().contiguous()
    hb = qdata.numel() // scales.numel()
    b0, b1 = blocks or (0, scales.numel())
    n_blocks = b1 - b0
    fmt = STORAGE_FORMATS[dtype]
    if is_fake(out):
        return  # a dry run: the temporaries above are counted, the kernel's writes need no data
    fn = lib.nf4_dequant16_mt if out.dtype != torch.float32 else lib.nf4_dequant32_mt
    # The kernel indexes blocks from its pointers, so a block range is a shift of the input pointers.
    fn(kernel_threads(n_blocks, out.numel() * out.element_size()), qdata.data_ptr() + b0 * hb,
       scales.data_ptr() + b0 * 4, levels.data_ptr(), 0, n_blocks, hb, out.data_ptr(), fmt)


def use_native(dtype: Optional[torch.dtype] = None) -> bool:
    """Whether CPU tensors of ``dtype`` go through the C kernels (compiling them on the first call)."""
    if switches.choice("LIT_QLORA_NF4_BACKEND") == "eager":
        return False
    lib = native_lib()
    return lib is not None and (dtype != torch.float16 or lib.has_f16)


def nf4_backend() -> str:
    """Which path CPU tensors use: ``"native"`` (the C kernels) or ``"eager"`` (PyTorch ops).

    ``LIT_QLORA_NF4_BACKEND=eager`` forces the PyTorch path. The kernels are compiled with gcc on first use
    (~1 s, cached under ``~/.cache/lit_qlora/kernels``) and checked against the PyTorch path; without a
    compiler, or if the check fails, the PyTorch path is used (with one warning).
    """
    return "native" if use_native() else "eager"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether the Triton kernel is used where it applies: Triton is installed (the kernel runs on CUDA tensors, or on
    CPU ones under ``TRITON_INTERPRET=1``) and ``LIT_QLORA_NF4_TRITON`` is not 0 (0: the PyTorch path in 16M-value
    slices, as before the kernel; for comparisons)."""
    return switches.enabled("LIT_QLORA_NF4_TRITON") and importlib.util.find_spec("triton") is not None
