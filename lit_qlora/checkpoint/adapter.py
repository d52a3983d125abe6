"""A fine-tune's adapter on disk: `adapter.safetensors` and `adapter_config.json` written and read back into a model's
LoRA layers (every rank keeping its FSDP2 shard), and the whole adapter gathered from the ranks that hold it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from lit_qlora.checkpoint.files import (CheckpointError, TensorSpec, atomic_write_text, iter_safetensors,
                                        write_safetensors)
from lit_qlora.base.errors import MissingFile
from lit_qlora.checkpoint.files import require_finite
from lit_qlora.lora.layer import lora_modules, lora_state_dict
from lit_qlora.parallel.distributed import full, is_sharded, reshard, shard_like

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def full_lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole adapter tensors, gathered from every rank under FSDP2 (a collective then: call it on every rank)."""
    if not is_sharded(model):
        return lora_state_dict(model)
    reshard(model)
    return {k: full(v).cpu() for k, v in lora_state_dict(model).items()}


def save_adapter(model: nn.Module, out_dir: Path, config: dict,
                 tensors: Optional[dict[str, torch.Tensor]] = None) -> Path:
    """Write `adapter.safetensors` and `adapter_config.json` (r, alpha, targets, base model, quantization...).

    `tensors`: the adapter, when already gathered (`full_lora_state_dict`); default: read from `model`."""
    tensors = lora_state_dict(model) if tensors is None else tensors
    require_finite(tensors, f"the adapter in {out_dir}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = [TensorSpec(k, v.shape, v.dtype, lambda v=v: v) for k, v in tensors.items()]
    write_safetensors(out_dir / ADAPTER_WEIGHTS, specs, metadata={"format": "pt"})
    atomic_write_text(out_dir / ADAPTER_CONFIG, json.dumps(config, indent=2) + "\n")
    return out_dir


def find_adapter_dir(adapter_dir: Path) -> Path:
    """The directory holding the adapter: `adapter_dir` itself (a fine-tune's final/ or a training checkpoint),
    or, given a fine-tune's out_dir, its final/."""
    adapter_dir = Path(adapter_dir)
    final = adapter_dir / "final"
    if not (adapter_dir / ADAPTER_CONFIG).is_file() and (final / ADAPTER_CONFIG).is_file():
        return final
    return adapter_dir


def read_adapter_config(adapter_dir: Path, flag: str = "--adapter_dir") -> dict:
    """adapter_config.json of a fine-tune's out_dir or final/ (or a training checkpoint); `flag` names the option
    that gave the directory, for the error."""
    adapter_dir = find_adapter_dir(adapter_dir)
    path = adapter_dir / ADAPTER_CONFIG
    what = (f"{flag} must be a fine-tune's out_dir or its final/ directory (which holds {ADAPTER_WEIGHTS} "
            f"and {ADAPTER_CONFIG})")
    if not adapter_dir.is_dir():
        raise MissingFile(f"Adapter directory {adapter_dir} does not exist: {what}.")
    if not path.is_file():
        has_checkpoints = (adapter_dir / "checkpoints").is_dir()
        hint = (" This out_dir has training checkpoints but no final/: the run has not finished; continue it with "
                "the same `litqlora finetune` command with --resume auto."
                if has_checkpoints else "")
        raise MissingFile(f"{path} does not exist: {what}.{hint}")
    try:
        config = json.loads(path.read_text())
        missing = [k for k in ("r", "alpha", "targets") if k not in config]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}). Re-run the fine-tune or restore the file.") from None
    if missing:
        raise CheckpointError(f"{path} lacks the key(s) {missing}; it was not written by `litqlora finetune`.")
    return config


def _trained_on(adapter_dir: Path) -> str:
    """': BASE' from the adapter's config, when it says."""
    try:
        base = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text()).get("base_model")
    except (OSError, ValueError):
        base = None
    return f": {base}" if base else ""


def load_adapter(model: nn.Module, adapter_dir: Path) -> None:
    """Copy the adapter's tensors into the LoRA layers of `model`; a mismatch is a clear error, not a warning."""
    adapter_dir = find_adapter_dir(adapter_dir)
    path = adapter_dir / ADAPTER_WEIGHTS
    if not path.is_file():
        raise MissingFile(f"{path} does not exist: --adapter_dir must hold {ADAPTER_WEIGHTS}.")
    own = {k: v for k, v in lora_state_dict(model).items()}
    params = {n: m for n, m in lora_modules(model).items()}
    fix = f"Pass the --checkpoint_dir the adapter was trained on{_trained_on(adapter_dir)}."
    seen = set()
    for name, tensor in iter_safetensors(path):
        if name not in own:
            raise CheckpointError(f"{path}: adapter tensor {name!r} has no LoRA layer in this model: the adapter "
                                  f"was trained with other targets than {ADAPTER_CONFIG} lists, or on another base "
                                  f"model. {fix}")
        if tensor.shape != own[name].shape:
            rank_axis = (0 if name.endswith("lora_A") else 1) + (tensor.dim() == 3)  # experts' are stacked
            if tensor.shape[rank_axis] != own[name].shape[rank_axis]:
                why = (f"the file has rank {tensor.shape[rank_axis]}, the model was set up with r="
                       f"{own[name].shape[rank_axis]} ({ADAPTER_CONFIG}'s r, or --lora.r when resuming). Use the "
                       f"rank the adapter was trained with; an edited {ADAPTER_CONFIG} must be restored.")
            else:
                why = "the adapter was trained on a base model of another size. " + fix
            raise CheckpointError(f"{path}: {name!r} has shape {tuple(tensor.shape)} but the model expects "
                                  f"{tuple(own[name].shape)}: {why}")
        module_name, _, leaf = name.rpartition(".")
        param = getattr(params[module_name], leaf)
        with torch.no_grad():
            param.copy_(shard_like(tensor, param))  # every rank reads the file and keeps its FSDP2 shard
        seen.add(name)
    if set(own) - seen:
        missing = sorted(set(own) - seen)
        raise CheckpointError(f"{path} lacks {len(missing)} LoRA tensor(s) the model has, e.g. {missing[0]!r}: "
                              f"it was trained with fewer targets than {ADAPTER_CONFIG} lists.")


def read_adapter_factors(adapter_dir: Path, flag: str = "--adapter_dir") -> tuple[dict, dict, float]:
    """A fine-tune's adapter as (its config, {module name: (A, B)}, its scale), for a bank of adapters on one base
    (lit_qlora.lora.bank); `flag` names the option that gave the directory, for the errors."""
    from lit_qlora.lora.rank import lora_scale

    config = read_adapter_config(adapter_dir, flag)
    path = find_adapter_dir(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise MissingFile(f"{path} does not exist: {flag} must hold {ADAPTER_WEIGHTS}.")
    tensors = dict(iter_safetensors(path))
    factors = {}
    for name, a in tensors.items():
        if not name.endswith(".lora_A"):
            continue
        module = name.removesuffix(".lora_A")
        b = tensors.get(module + ".lora_B")
        if a.dim() != 2 or b is None:
            raise CheckpointError(f"{path}: {module} has {'no lora_B' if b is None else 'per-expert factors'}; "
                                  f"{flag} serves adapters on linears only (adapters on a mixture's experts: serve "
                                  "that fine-tune alone, with --adapter_dir).")
        factors[module] = (a, b)
    return config, factors, lora_scale(config["r"], config["alpha"], config.get("rslora", False))
