"""Memory accounting: resident bytes of a module (NF4 tensors counted by their packed storage) and peak RSS."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from functools import lru_cache
from typing import Optional

import torch
import torch.nn as nn


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor keeps resident; tensor subclasses (torchao NF4Tensor) by their inner tensors."""
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    if t.is_meta:
        return 0
    return t.untyped_storage().nbytes()


def module_bytes(module: nn.Module) -> int:
    """Resident bytes of all parameters and buffers, each storage counted once (tied weights share one)."""
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += tensor_bytes(t)
    return total


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, from the OS.

    On Linux this is VmHWM: getrusage's ru_maxrss survives exec, so a child started from a big parent would
    report the parent's peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


@lru_cache(maxsize=1)
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_free_bytes() -> Optional[int]:
    """Bytes glibc holds in free heap chunks over all arenas (mallinfo2's fordblks); None where unknown."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().fordblks


def release_free_memory(min_free_bytes: int = 0) -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Streaming a checkpoint frees one large high-precision tensor after another while small NF4 results stay:
    glibc keeps the holes between them (its dynamic mmap threshold moves large blocks onto the heap), so RSS
    drifts up by hundreds of MB from run to run. Trimming after each large tensor keeps the peak at the model
    plus one tensor. With ``min_free_bytes``, trim only when glibc holds at least that much free heap: a trim
    costs ~10 ms even when there is little to return.
    """
    libc = _libc()
    if libc is None:
        return
    if min_free_bytes > 0:
        free = heap_free_bytes()
        if free is not None and free < min_free_bytes:
            return
    libc.malloc_trim(0)
