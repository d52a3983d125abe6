"""Hugging Face checkpoints in and out: streaming load onto a `meta` model, streaming safetensors export (the
safetensors files themselves: lit_qlora.checkpoint.files).

Loading never materializes the whole state dict: tensors are read one at a time (safetensors are memory-mapped)
and put in place, optionally transformed on the way (the NF4 loader quantizes each linear weight as it arrives).
"""

from __future__ import annotations

import copy
import json
import os
import pickle  # only for its exception type: nothing here is ever unpickled without weights_only
import re
import shutil
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn

from lit_qlora.checkpoint.files import (CheckpointError, TensorSpec, atomic_write_text, iter_safetensors, remove_path,
                                        write_safetensors)
from lit_qlora.memory.accounting import release_free_memory
from lit_qlora.model.config import Config, require_checkpoint_dir
from lit_qlora.model.hf_layout import (ExpertStacker, GptOssLayout, fuse_plan, hub_name, model_name,
                                        split_fused)
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


def require_checkpoint(checkpoint_dir: Path, tokenizer: bool = True) -> None:
    """A checkpoint folder a command can use, checked before anything reads it: config.json with the fields a model
    needs, its weights and (for a command that tokenizes) tokenizer.json; each missing piece a one-paragraph error
    naming the file and where a good one comes from."""
    from lit_qlora.checkpoint.tokenizer import require_tokenizer

    Config.from_checkpoint(checkpoint_dir)
    weight_files(checkpoint_dir)
    if tokenizer:
        require_tokenizer(Path(checkpoint_dir))


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
    experts = ExpertStacker(config.n_experts)  # per-expert tensors -> each projection's stack
    gpt_oss = GptOssLayout() if config.model_type == "gpt_oss" else None  # (its own expert layout, MXFP4)
    parts = (part for name, tensor in iter_tensors(checkpoint_dir) for part in split_fused(config, name, tensor))
    if gpt_oss is not None:
        parts = (part for name, tensor in parts for part in gpt_oss.add(name, tensor))
    stacked = (item for name, tensor in parts for item in experts.add(model_name(config, name), tensor))
    for name, tensor in stacked:
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
    missing = experts.missing() + [name for name in missing if name not in experts.pending]  # per expert, as stored
    missing += gpt_oss.missing() if gpt_oss is not None else []
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{checkpoint_dir} is missing tensors the model needs: {shown}.")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


# -- writing -----------------------------------------------------------------------------------------------------
def hf_layout_specs(config: Config, specs: list[TensorSpec]) -> list[TensorSpec]:
    """The specs under the checkpoint's own names: fused projections (Phi-3) written as one tensor again."""
    specs = [_renamed(spec, hub_name(config, spec.name)) for spec in specs]  # (Mixtral's expert names)
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


def _renamed(spec: TensorSpec, name: str) -> TensorSpec:
    if name == spec.name:
        return spec
    spec = copy.copy(spec)
    spec.name = name
    return spec


def copy_tokenizer_files(src_dir: Path, out_dir: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src_dir) / name).is_file():
            shutil.copyfile(Path(src_dir) / name, Path(out_dir) / (name + ".tmp"))
            os.replace(Path(out_dir) / (name + ".tmp"), Path(out_dir) / name)
            copied.append(name)
    return copied


def set_chat_template(out_dir: Path, template: str) -> None:
    """Make `template` the chat template of the tokenizer files in `out_dir` (tokenizer_config.json's, where
    transformers and llama.cpp's converter read it; a chat_template.jinja beside it would win, so it goes)."""
    config_file = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    config["chat_template"] = template
    atomic_write_text(config_file, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    remove_path(Path(out_dir) / "chat_template.jinja")


def save_hf_checkpoint(
    out_dir: Path | str,
    config: Config,
    specs: list[TensorSpec],
    tokenizer_dir: Optional[Path] = None,
    dtype: torch.dtype = torch.bfloat16,
    chat_template: Optional[str] = None,
) -> Path:
    """Write a Hugging Face directory (`config.json`, `model.safetensors`, tokenizer files) that transformers loads;
    `chat_template`: the tokenizer's template instead of `tokenizer_dir`'s (a fine-tune's prompt style)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(out_dir / "model.safetensors", hf_layout_specs(config, specs), metadata={"format": "pt"})
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), out_dir)
        if chat_template is not None:
            set_chat_template(out_dir, chat_template)
    hf = config.to_hf_config(torch_dtype=str(dtype).removeprefix("torch."))
    atomic_write_text(out_dir / "config.json", json.dumps(hf, indent=2) + "\n")
    return out_dir
