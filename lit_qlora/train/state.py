"""Resumable training checkpoints: adapters, optimizer and RNG as safetensors, everything else as JSON.

Nothing here is ever unpickled. The NF4 base is not saved: a resume re-quantizes it from the original checkpoint,
which is deterministic. Each checkpoint is a directory written under a temporary name and renamed when complete,
so a kill at any moment leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from lit_qlora.checkpoint.files import (CheckpointError, TensorSpec, atomic_write_text, iter_safetensors, replace_dir,
                                        write_safetensors)
from lit_qlora.base.errors import MissingFile
from lit_qlora.checkpoint.files import require_finite
from lit_qlora.checkpoint.adapter import full_lora_state_dict, load_adapter
from lit_qlora.parallel.distributed import full, shard_like

STEP_DIR = re.compile(r"^step-(\d{6,})$")
STATE_FILE = "state.json"
# What an objective keeps between steps beyond the adapter and optimizer (GRPO: the rollouts its next steps train on).
MODULE_FILE = "module.safetensors"


def step_dir(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step-{step:06d}"


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """Finished checkpoints (state.json present), oldest first."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out_dir: Path) -> Optional[Path]:
    done = complete_checkpoints(out_dir)
    return done[-1] if done else None


def _specs(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(k, v.shape, v.dtype, lambda v=v: v) for k, v in tensors.items()]


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    state = optimizer.state_dict()
    tensors = {}
    for index, values in state["state"].items():
        for key, value in values.items():
            tensors[f"{index}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state["param_groups"]]
    return tensors, groups


def rng_tensors() -> dict[str, torch.Tensor]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    return tensors


def collect_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Adapter and optimizer state as whole CPU tensors. Under FSDP2 this gathers the shards: every rank calls it."""
    opt_tensors, groups = _optimizer_tensors(optimizer)
    return {"adapter": full_lora_state_dict(model), "param_groups": groups,
            "optimizer": {k: full(v).cpu() for k, v in opt_tensors.items()}}


def save_training_state(out_dir: Path, step: int, model: Optional[torch.nn.Module],
                        optimizer: Optional[torch.optim.Optimizer], state: dict[str, Any], keep_last: int,
                        collected: Optional[dict[str, Any]] = None) -> Path:
    """Write checkpoint `step` atomically, then delete all but the newest `keep_last` complete ones.

    `collected`: the output of `collect_training_state` (distributed runs gather on every rank, write on rank 0);
    by default it is collected from `model` and `optimizer` here. Non-finite adapter weights raise
    FloatingPointError before anything is written."""
    collected = collected or collect_training_state(model, optimizer)
    require_finite(collected["adapter"], f"checkpoint step-{step:06d}")
    final = step_dir(out_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_safetensors(tmp / "adapter.safetensors", _specs(collected["adapter"]))
    write_safetensors(tmp / "optimizer.safetensors", _specs(collected["optimizer"]))
    write_safetensors(tmp / "rng.safetensors", _specs(rng_tensors()))
    if collected.get("module"):
        write_safetensors(tmp / MODULE_FILE, _specs(collected["module"]))
    atomic_write_text(tmp / STATE_FILE, json.dumps({**state, "step": step, "param_groups": collected["param_groups"]},
                                                   indent=2))
    replace_dir(tmp, final)  # a re-run that reached the same step replaces it as a whole
    for old in complete_checkpoints(out_dir)[: -max(1, keep_last)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(path: Path) -> dict[str, Any]:
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise MissingFile(f"{file} does not exist: --resume needs a checkpoint directory written by "
                          "`litqlora finetune` (out_dir/checkpoints/step-NNNNNN), or `auto`.")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}); resume from an older checkpoint.") from None


def module_tensors(path: Path) -> dict[str, torch.Tensor]:
    """What the objective kept in checkpoint `path` (MODULE_FILE; empty where it kept nothing)."""
    file = Path(path) / MODULE_FILE
    return dict(iter_safetensors(file)) if file.is_file() else {}


def load_training_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore adapters, optimizer and RNG from checkpoint `path`; returns its JSON state."""
    state = read_state(path)
    load_adapter(model, path)  # a checkpoint holds adapter.safetensors, like a fine-tune's final/
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    params = [p for group in optimizer.param_groups for p in group["params"]]  # state_dict's index order
    for key, tensor in iter_safetensors(Path(path) / "optimizer.safetensors"):
        index, _, name = key.partition(".")
        opt_state.setdefault(int(index), {})[name] = shard_like(tensor, params[int(index)])  # FSDP2: this shard
    optimizer.load_state_dict({"state": opt_state, "param_groups": state["param_groups"]})
    for name, tensor in iter_safetensors(Path(path) / "rng.safetensors"):
        if name == "torch":
            torch.set_rng_state(tensor)
        elif torch.cuda.is_available() and int(name.split(".")[1]) < torch.cuda.device_count():
            torch.cuda.set_rng_state(tensor, int(name.split(".")[1]))
    return state


def run_totals(history: list[dict[str, Any]], wall_seconds: float, before: Optional[dict[str, Any]] = None
               ) -> dict[str, Any]:
    """The whole run's time and throughput up to now, as each checkpoint's state.json records them ("totals") and
    summary.json reports them: the totals of the checkpoint this process resumed from (`before`; empty for a new
    run) plus this process's steps (`history`: FinetuneModule's rows) and `wall_seconds`.

    A process's first step, and any step that compiled, is warm-up: steady throughput leaves them out (all of a
    process's steps after its first when every one compiled). The steps an interrupted process ran after its last
    checkpoint are not counted: the resumed run trains them again."""
    before = before or {}
    steady = [r for r in history[1:] if not r.get("compile_seconds")] or history[1:]
    first = before.get("first_step_seconds")
    return {
        "wall_seconds": before.get("wall_seconds", 0.0) + wall_seconds,
        "steady_tokens": before.get("steady_tokens", 0) + sum(r["tokens"] for r in steady),
        "steady_seconds": before.get("steady_seconds", 0.0) + sum(r["seconds"] for r in steady),
        "warmup_steps": before.get("warmup_steps", 0) + len(history) - len(steady),
        "first_step_seconds": first if first is not None else history[0]["seconds"] if history else None,
    }
