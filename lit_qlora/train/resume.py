"""A run and its out_dir: the recipe that defines a run (state.json records it), resuming only the same recipe, a
finished run left as it is, and a new run starting only in an out_dir free of another run's checkpoints and results
(or, with --overwrite, after deleting them)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Union

from lit_qlora.train.args import data_source, flatten


def recipe(spec: Any, precision: str) -> dict[str, Any]:
    """The settings that define a run (a lit_qlora.train.spec.RunSpec, in its decided `precision`), as JSON
    (state.json's "run" holds them), with the sha256 of its dataset file: the same path with edited rows is other
    data."""
    from lit_qlora.model.config import Quantize
    from lit_qlora.data.formats import fingerprint

    data = spec.data
    return {"checkpoint_dir": str(spec.checkpoint_dir), "quantize": Quantize(spec.quantize).value,
            "precision": precision, "seed": spec.seed, "lora": asdict(spec.lora),
            "train": json.loads(json.dumps(asdict(spec.train), default=str)),
            "data": json.loads(json.dumps(asdict(data), default=str)),
            "data_sha256": fingerprint([data_source(data), *([data.val_path] if data.val_path else [])]),
            "ignore_modules": list(spec.ignore_modules or [])}


# What a resume may change: how often it logs and saves, how it spends memory and what it does on a non-finite
# loss; and train.max_steps may grow past the checkpoint (to train longer). Devices, nodes, strategy and --compile
# are not part of the recipe (the NF4 layout is kept across devices; compiled steps compute what eager ones do).
# Anything else (seed, data, batch sizes, sequence length, learning rate, adapter shape) would make the resumed
# steps another run's.
MAY_CHANGE_ON_RESUME = frozenset({"train.save_interval", "train.log_interval", "train.keep_last",
                                  "train.activation_checkpointing", "train.offload_activations", "train.on_nonfinite",
                                  "data.num_workers"})


def require_same_recipe(state: dict[str, Any], checkpoint: Path, now: dict[str, Any]) -> None:
    """Refuse to resume `checkpoint` with a recipe other than the one its run trained with (CheckpointError naming
    each changed setting, old -> new). Compared: every setting `recipe` records (seed, base checkpoint, quantize,
    precision, lora.*, train.*, data.*, the dataset file's contents, ignore_modules) but MAY_CHANGE_ON_RESUME, and
    train.max_steps only when it would end before the checkpoint's step. A setting the checkpoint does not record
    (an option added since) is not compared."""
    from lit_qlora.checkpoint.files import CheckpointError

    before, after = flatten(state.get("run", {})), flatten(now)
    changed = []
    for key, value in after.items():
        if key in MAY_CHANGE_ON_RESUME or key not in before:  # not recorded: an option added since that checkpoint
            continue
        if key == "train.max_steps" and value is not None and value >= state.get("step", 0):
            continue
        old = before[key]
        paths = key in ("checkpoint_dir", "data.json_path", "data.path", "data.val_path") and old is not None \
            and value is not None
        same = Path(old).resolve() == Path(value).resolve() if paths else old == value  # ./a and a are one file
        if same:
            continue
        if key == "data_sha256" and old and value:  # a digest says nothing to a reader: say what it stands for
            changed.append(f"the dataset file's contents (sha256 {old[:12]}... -> {value[:12]}...)")
        else:
            changed.append(f"{key} {json.dumps(old)} -> {json.dumps(value)}")
    if changed:
        raise CheckpointError(
            f"--resume: {Path(checkpoint) / 'state.json'} belongs to a run with other settings ({'; '.join(changed)}): "
            "resuming would silently continue a different run. Resume with the settings and data the run started "
            "with, or start a new run in another --out_dir. Only train.save_interval, log_interval, keep_last, "
            "activation_checkpointing, offload_activations, on_nonfinite, data.num_workers, compile and the devices "
            f"(devices, num_nodes, strategy) may change on resume, and train.max_steps may grow (from step "
            f"{state.get('step', 0)} on).")


def finished_summary(out_dir: Path, state: dict[str, Any], max_steps: Optional[int]) -> Optional[dict[str, Any]]:
    """summary.json of a run that is complete (its checkpoint is its last step, and final/ and summary.json are
    that step's), after saying so; None when there is still something to do: train on, or export (a run killed
    while exporting has its last checkpoint but no final/ or summary.json yet)."""
    summary_file, final = out_dir / "summary.json", out_dir / "final"
    # A run stopped early (--train.early_stopping_patience) ended at that step: its last.
    last_step = state.get("validation", {}).get("stopped_early") or state.get("total_steps")
    if state.get("step") != last_step or not final.is_dir() or not summary_file.is_file():
        return None
    if max_steps is not None and max_steps != state["total_steps"]:  # asked to train longer
        return None
    try:
        summary = json.loads(summary_file.read_text())
    except ValueError:  # not ours as written (atomically): export again, which rewrites it
        return None
    # summary.json is written after final/: when it counts the checkpoint's steps, final/ is that step's too. A run
    # trained longer (a larger --train.max_steps) and killed while exporting still has the shorter run's pair.
    if not isinstance(summary, dict) or summary.get("steps") != state["step"]:
        return None
    stopped = f" (stopped early at step {last_step})" if last_step != state["total_steps"] else ""
    print(f"{out_dir} is already complete{stopped}: {state['step']} of {state['total_steps']} steps trained, the "
          f"adapter and exports are in {final}/, the results in {summary_file}. Nothing was changed; to train longer, "
          "pass a larger --train.max_steps, or start a new run in another --out_dir.")
    return summary


def resolve_resume(resume: Union[bool, str, Path], out_dir: Path) -> Optional[Path]:
    from lit_qlora.train.state import latest_checkpoint, read_state

    if resume is False or str(resume).lower() == "false":
        return None
    if str(resume) == "auto":
        found = latest_checkpoint(out_dir)
        if found is None:  # (finetune() says where it resumes from, once it knows the run is not already complete)
            print(f"--resume auto: no checkpoint in {out_dir}, starting fresh")
        return found
    read_state(Path(resume))  # a clear error now rather than after the model has loaded
    return Path(resume)


# What a run leaves in its out_dir that a new run there would be mixed up with: `--resume auto` would continue from the
# old run's newest checkpoint, and final/ and summary.json would pass for the new run's results.
RUN_RESULTS = ("summary.json", "final", "checkpoints")


def claim_out_dir(out_dir: Path, resume: Union[bool, str, Path], overwrite: bool) -> None:
    """A new run (no --resume) starts only in an out_dir free of another run's checkpoints and results; with
    `overwrite`, after deleting them and that run's metrics.jsonl and TensorBoard logs/."""
    from lit_qlora.checkpoint.files import CheckpointError, remove_path

    if resume is not False and str(resume).lower() != "false":
        return
    found = [name + "/" * (out_dir / name).is_dir() for name in RUN_RESULTS if (out_dir / name).exists()]
    if not found:
        return
    if not overwrite:
        raise CheckpointError(
            f"{out_dir} holds another fine-tune's {', '.join(found)}; a new run does not start over them. Continue "
            "that run with --resume auto (the same command otherwise), choose another --out_dir, or pass --overwrite "
            "true to delete that run's checkpoints and results and start over.")
    if not first_process():  # the others start once the first has begun writing its own logs/ (Lightning's launcher)
        return
    for name in (*RUN_RESULTS, "metrics.jsonl", "logs", "csv", "wandb", "mlruns", "samples.jsonl"):
        path = out_dir / name
        if path.exists():
            # Renamed aside before deleting: a kill halfway leaves no partial checkpoint that --resume auto would take.
            aside = out_dir / f".{name}.overwritten"
            remove_path(aside)
            path.rename(aside)
            remove_path(aside)


def first_process() -> bool:
    """Whether this is the first process of a (possibly distributed) run, from the launchers' environment: the
    rank is not known before the Trainer exists."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))
