"""Hugging Face checkpoints in and out: streaming load onto a `meta` model, streaming safetensors export.

Loading never materializes the whole state dict: tensors are read one at a time (safetensors are memory-mapped)
and put in place, optionally transformed on the way (the NF4 loader quantizes each linear weight as it arrives).
"""

from __future__ import annotations

import json
import os
import pickle  # only for its exception type: nothing here is ever unpickled without weights_only
import re
import shutil
import struct
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.nn as nn

from lit_qlora.model.config import Config, require_checkpoint_dir
from lit_qlora.errors import UserError
from lit_qlora.model.hf_layout import fuse_plan, split_fused
from lit_qlora.memory.accounting import release_free_memory
from lit_qlora.model.transformer import Transformer

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
)

# Keys some checkpoints carry that are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(UserError, ValueError):
    """A checkpoint directory or file that cannot be used, with what to do about it."""


def weight_files(checkpoint_dir: Path) -> list[Path]:
    """The weight files of a HF directory: sharded or single safetensors first, then pytorch_model.bin."""
    checkpoint_dir = Path(checkpoint_dir)
    require_checkpoint_dir(checkpoint_dir, CheckpointError)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = checkpoint_dir / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid shard index (needs a 'weight_map'): {e}") from None
            files = [checkpoint_dir / name for name in dict.fromkeys(weight_map.values())]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} lists shards that are not in {checkpoint_dir}: {', '.join(missing)}.")
            return files
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (checkpoint_dir / name).is_file():
            return [checkpoint_dir / name]
    raise CheckpointError(
        f"{checkpoint_dir} has no weights: expected model.safetensors, model.safetensors.index.json with its "
        "shards, or pytorch_model.bin. Point --checkpoint_dir at a Hugging Face model directory."
    )


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


def iter_tensors(checkpoint_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time from every weight file of the checkpoint."""
    for path in weight_files(checkpoint_dir):
        if path.suffix == ".safetensors":
            yield from iter_safetensors(path)
        else:
            state = load_pickled_weights(path)
            for key in list(state):
                yield key, state.pop(key)


def load_pickled_weights(path: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin read with weights_only=True: tensors and containers only, never arbitrary objects."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) files cannot be memory-mapped
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = (f"it holds a pickled object ({found[1]}), not only tensors" if found
                else f"it cannot be read as tensors ({type(e).__name__}; truncated or corrupt?)")
        raise CheckpointError(
            f"{path} was refused: {what}. lit-qlora reads .bin files with torch.load(weights_only=True) and never "
            "unpickles anything else; get the model's .safetensors files instead."
        ) from None


def set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace the parameter or buffer `name` of `model` with `tensor` (no copy, works on meta models)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=tensor.is_floating_point())
    elif leaf in module._buffers:
        module._buffers[leaf] = tensor
    else:
        raise KeyError(name)


Transform = Callable[[str, torch.Tensor], torch.Tensor]


def load_checkpoint(
    checkpoint_dir: Path | str,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    transform: Optional[Transform] = None,
    config: Optional[Config] = None,
) -> Transformer:
    """Build the model on `meta` and stream the checkpoint into it, one tensor at a time.

    `transform(name, tensor)` sees each floating tensor after the dtype cast and before placement (quantization
    hooks in here). Peak memory is the final model plus one tensor.
    """
    checkpoint_dir = Path(checkpoint_dir)
    config = config or Config.from_checkpoint(checkpoint_dir)
    with torch.device("meta"):
        model = Transformer(config)
    expected = dict(model.state_dict(keep_vars=True))
    tied = config.tie_embeddings
    loaded: set[str] = set()
    for name, tensor in (part for item in iter_tensors(checkpoint_dir) for part in split_fused(config, *item)):
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        if name not in expected:
            raise CheckpointError(
                f"{checkpoint_dir}: tensor {name!r} has no place in a {config.model_type} model with this "
                "config.json. Check that the weights and config.json belong to the same model."
            )
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{checkpoint_dir}: tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies "
                f"{tuple(expected[name].shape)}. The weights and config.json do not match."
            )
        transformed = tensor.is_floating_point() and transform is not None
        big = tensor.nbytes >= 8 << 20
        if tensor.is_floating_point():
            tensor = tensor.to(device=device, dtype=dtype)
            if transform is not None:
                tensor = transform(name, tensor)
        else:
            tensor = tensor.to(device)
        set_tensor(model, name, tensor)
        loaded.add(name)
        if transformed and big:
            del tensor
            release_free_memory()
    missing = sorted(set(expected) - loaded - ({"lm_head.weight"} if tied else set()))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{checkpoint_dir} is missing tensors the model needs: {shown}.")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


# -- writing -----------------------------------------------------------------------------------------------------
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


def hf_layout_specs(config: Config, specs: list[TensorSpec]) -> list[TensorSpec]:
    """The specs under the checkpoint's own names: fused projections (Phi-3) written as one tensor again."""
    plan = fuse_plan(config, [spec.name for spec in specs])
    if not plan:
        return specs
    by_name = {spec.name: spec for spec in specs}
    out = []
    for spec in specs:
        fused, members = plan.get(spec.name, (spec.name, []))
        if not members:
            if fused:
                out.append(spec)
            continue
        parts = [by_name[member] for member in members]
        shape = (sum(part.shape[0] for part in parts), *spec.shape[1:])
        # Concatenated along dim 0: the parts' row blocks, streamed one after another.
        out.append(TensorSpec(fused, shape, spec.dtype,
                              chunks=lambda parts=parts: (x for p in parts for x in p.pieces())))
    return out


def copy_tokenizer_files(src_dir: Path, out_dir: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src_dir) / name).is_file():
            shutil.copyfile(Path(src_dir) / name, Path(out_dir) / (name + ".tmp"))
            os.replace(Path(out_dir) / (name + ".tmp"), Path(out_dir) / name)
            copied.append(name)
    return copied


def save_hf_checkpoint(
    out_dir: Path | str,
    config: Config,
    specs: list[TensorSpec],
    tokenizer_dir: Optional[Path] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a Hugging Face directory (`config.json`, `model.safetensors`, tokenizer files) that transformers loads."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(out_dir / "model.safetensors", hf_layout_specs(config, specs), metadata={"format": "pt"})
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), out_dir)
    hf = config.to_hf_config(torch_dtype=str(dtype).removeprefix("torch."))
    atomic_write_text(out_dir / "config.json", json.dumps(hf, indent=2) + "\n")
    return out_dir
