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
    return sum(storage.nbytes() for storage in _storages(t))


def _storages(t: torch.Tensor) -> list:
    """The storages a tensor keeps alive: its own, or its inner tensors' (a tensor subclass); none on meta."""
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [storage for n in names for storage in _storages(getattr(t, n))]
    return [] if t.is_meta else [t.untyped_storage()]


def module_bytes(module: nn.Module) -> int:
    """Resident bytes of all parameters and buffers, each storage counted once: tied weights share one, and so do
    the row slices of one tensor (dense q/k/v and gate/up, loaded as views of their fused weight)."""
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        for storage in _storages(t):
            if storage.data_ptr() in seen and storage.nbytes():
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _proc_status_bytes(field: str) -> Optional[int]:
    """A size field of /proc/self/status (Linux), in bytes; None where it is not available."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, from the OS.

    On Linux this is VmHWM: getrusage's ru_maxrss survives exec, so a child started from a big parent would
    report the parent's peak.
    """
    peak = _proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def peak_memory_stats(device: torch.device) -> dict[str, int]:
    """The run's memory high-water marks so far: peak RSS, and on a GPU torch's allocated/reserved/active peaks."""
    stats = {"peak_rss_bytes": peak_rss_bytes()}
    if device.type == "cuda":
        stats["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        stats["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        stats["peak_active_bytes"] = torch.cuda.memory_stats(device).get("active_bytes.all.peak", 0)
    return stats


def rss_bytes() -> Optional[int]:
    """This process's resident set size now (VmRSS); None outside Linux."""
    return _proc_status_bytes("VmRSS")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@lru_cache(maxsize=1)
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim"):
        return None
    if hasattr(libc, "mallinfo2"):  # glibc >= 2.33
        libc.mallinfo2.restype = _MallInfo2
    return libc


def heap_in_use_bytes() -> Optional[int]:
    """Bytes malloc has handed out and not got back (glibc's mallinfo2: in-use heap chunks plus mmapped ones);
    None where that is not known (not glibc, or glibc before 2.33).

    Not mallinfo2's free bytes (fordblks): those count the heap's holes whether their pages are resident or were
    already handed back, so after one trim they stay high and say nothing about what another trim would return."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Streaming a checkpoint frees one large high-precision tensor after another while small NF4 results stay:
    glibc keeps the holes between them (its dynamic mmap threshold moves large blocks onto the heap), so RSS
    drifts up by hundreds of MB from run to run. Trimming after each large tensor keeps the peak at the model
    plus one tensor.
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
