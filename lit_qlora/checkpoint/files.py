"""Files as lit-qlora writes and reads them: safetensors streamed in (memory-mapped, one tensor at a time) and out (a
tensor at a time, from specs that produce it only when written), and files and directories replaced atomically, so a
killed process leaves the old version or the new one, never half of one."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Optional

import torch

from lit_qlora.base.errors import NonFinite, UserError
from lit_qlora.memory.accounting import release_free_memory


class CheckpointError(UserError, ValueError):
    """A checkpoint directory or file that cannot be used, with what to do about it."""


_DTYPES_BY_NAME = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """(data start offset, header dict) of a safetensors file, validated against the file size."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"tensor data ends at byte {8 + n + end}, the file has {size} (truncated?)")
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}). Re-download or re-export it.") from None
    return 8 + n, header


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Read tensors one at a time into fresh memory with plain file reads.

    Not memory-mapped on purpose: mapped pages of the whole file would count in RSS next to the converted or
    quantized copies, doubling the peak.
    """
    start, header = read_safetensors_header(path)
    with open(path, "rb") as f:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _DTYPES_BY_NAME:
                raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}.")
            tensor = torch.empty(info["shape"], dtype=_DTYPES_BY_NAME[info["dtype"]])
            begin, end = info["data_offsets"]
            if end - begin != tensor.nbytes:
                raise CheckpointError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {info['shape']}.")
            f.seek(start + begin)
            if tensor.nbytes:
                f.readinto(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            yield name, tensor
            del tensor  # while suspended the frame kept it alive: the next read would double the peak


_SAFETENSORS_DTYPES = {dtype: name for name, dtype in _DTYPES_BY_NAME.items()}


class TensorSpec:
    """A tensor to be written: its name, shape and dtype up front, its data produced only when written.

    `produce()` makes the whole tensor; `chunks()`, given instead, yields consecutive row blocks whose concatenation
    along dim 0 is the tensor, so a writer can stream a large merged or dequantized weight without it ever existing
    whole (`pieces()` yields whichever the spec has)."""

    def __init__(self, name: str, shape: Iterable[int], dtype: torch.dtype,
                 produce: Optional[Callable[[], torch.Tensor]] = None,
                 chunks: Optional[Callable[[], Iterable[torch.Tensor]]] = None):
        if (produce is None) == (chunks is None):
            raise ValueError(f"{name}: give a TensorSpec either produce or chunks")
        self.name, self.shape, self.dtype = name, tuple(shape), dtype
        self._produce, self._chunks = produce, chunks

    def produce(self) -> torch.Tensor:
        if self._produce is not None:
            return self._produce()
        return torch.cat(list(self._chunks()))

    def pieces(self) -> Iterator[torch.Tensor]:
        if self._chunks is None:
            yield self._produce()
        else:
            yield from self._chunks()

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (the directory entry itself is flushed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(staging: Path, target: Path) -> None:
    """Put the complete directory `staging` in place of `target` (a directory, a file, or nothing) by renames alone.

    Deleting the old `target` in place would go file by file, and a kill halfway would leave a mix that looks like
    a result. Here the old one is renamed aside (`.NAME.old`) first, so at every moment `target` is the old one,
    absent, or the new one. The aside copy a kill may leave is removed by the next call."""
    staging, target = Path(staging), Path(target)
    aside = target.with_name(f".{target.name}.old")
    remove_path(aside)
    if target.exists() or target.is_symlink():
        os.replace(target, aside)
    os.replace(staging, target)
    fsync_dir(target.parent)
    remove_path(aside)


def remove_path(path: Path) -> None:
    """Delete a directory tree or a file; nothing if it does not exist."""
    if Path(path).is_dir() and not Path(path).is_symlink():
        shutil.rmtree(path)
    else:
        Path(path).unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_safetensors(path: Path, specs: list[TensorSpec], metadata: Optional[dict[str, str]] = None) -> None:
    """Write a safetensors file tensor by tensor, so only one tensor's data (one row block of a chunked spec) is
    ever produced at a time, and freed heap goes back to the OS after each large tensor. Nothing is read back.

    The header (names, shapes, offsets) is known from the specs; data follows in the same order. Written to a
    temporary name, fsynced, then renamed: a kill leaves either the old file or the new one.
    """
    header: dict = {}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": _SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            rows = 0
            for tensor in spec.pieces():
                shape = tuple(tensor.shape)
                if shape[1:] != spec.shape[1:] or len(shape) != len(spec.shape) or tensor.dtype != spec.dtype:
                    raise RuntimeError(f"{spec.name}: produced {shape} {tensor.dtype}, declared {spec.shape} "
                                       f"{spec.dtype}")
                rows += shape[0] if shape else 1
                data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))
                del tensor, data  # before the next block is made
            if rows != (spec.shape[0] if spec.shape else 1):
                raise RuntimeError(f"{spec.name}: produced {rows} rows, declared {spec.shape}")
            if spec.nbytes >= 8 << 20:
                release_free_memory()
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def nonfinite_names(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    return [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def require_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise NonFinite (a FloatingPointError) instead of writing NaN/inf weights."""
    bad = nonfinite_names(tensors)
    if bad:
        raise NonFinite(
            f"{len(bad)} adapter tensor(s) are not finite (e.g. {bad[0]}), so {what} was not written; the newest "
            "checkpoint on disk is still good. Lower --train.lr or use --precision bf16-true, 16-mixed or 32-true, "
            "then resume with --resume auto."
        )
