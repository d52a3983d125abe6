"""`litqlora finetune`: check what a user can get wrong (paths, precision, compile, out_dir, resume), then run the
fine-tune (lit_qlora.train.run: load the (NF4) base, add LoRA, train with the Lightning Trainer, write the run's files).

Light at import: the CLI reads `finetune`'s signature for `--help` and argument errors, which must not wait for torch
and the training stack (lit_qlora.cli.commands); they load inside the functions that need them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal, Optional, Union

from lit_qlora.errors import UserError
from lit_qlora.hardware import PrecisionChoice, choose_precision, cpu_emulates, uses_cuda
from lit_qlora.train.args import DataArgs, ExportArgs, LoRAArgs, TrainArgs, data_source, flatten
from lit_qlora.train.loggers import LoggerName, require_loggers

DEFAULT_CHECKPOINT = Path("checkpoints/SmolLM2-135M-Instruct")


def finetune(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT,
    out_dir: Path = Path("out/finetune"),
    quantize: Literal["nf4", "none"] = "nf4",
    precision: PrecisionChoice = "auto",
    seed: int = 1337,
    accelerator: str = "auto",
    devices: int = 1,
    num_nodes: int = 1,
    strategy: Literal["auto", "ddp", "fsdp", "tp"] = "auto",
    tensor_parallel: int = 1,
    nf4_shards: Optional[int] = None,
    resume: Union[bool, Literal["auto"], Path] = False,
    lora: LoRAArgs = LoRAArgs(),
    train: TrainArgs = TrainArgs(),
    data: DataArgs = DataArgs(),
    ignore_modules: Optional[list[str]] = None,
    compile: Union[bool, Literal["force"]] = False,
    overwrite: bool = False,
    logger: Union[LoggerName, list[LoggerName]] = "tensorboard",
    export: ExportArgs = ExportArgs(),
) -> dict[str, Any]:
    """Fine-tune a LoRA adapter on a frozen base: NF4 (QLoRA, the default) or plain (LoRA, the baseline).

    Args:
        checkpoint_dir: Base model (Hugging Face directory). The default is the bundled SmolLM2-135M-Instruct,
            converted on first use.
        out_dir: Where adapters, merged model, logs, metrics and resumable checkpoints go.
        quantize: nf4 = every base linear stored as NF4 (QLoRA); none = base in the precision's dtype (LoRA).
        precision: auto picks by hardware: bf16-true on a GPU with bf16 (compute capability >= 8.0) or a CPU with
            native bf16 (AVX512-BF16, AMX); 16-mixed on older GPUs (T4, V100: fp16 compute, fp32 adapters and
            AdamW state, dynamic loss scaling); 32-true on other CPUs (they emulate bf16, 5-10x slower than
            fp32). An explicit bf16-true, 16-mixed, 16-true or 32-true wins.
        seed: Seeds adapter init, data order and dropout: CPU runs repeat exactly.
        accelerator: cpu, cuda, auto...
        devices: Devices per node.
        num_nodes: Nodes.
        strategy: auto (one device), ddp (every rank holds the whole NF4 base) or fsdp (FSDP2: each of the
            devices x num_nodes ranks holds 1/N of it) or tp (tensor parallelism: the blocks' weights split over
            `tensor_parallel` ranks). Lightning starts the processes; see tutorials/distributed.md.
        tensor_parallel: With --strategy tp, ranks per tensor-parallel group (it must divide devices x num_nodes,
            the number of heads, of kv groups and the MLP width); the rest is data parallelism.
        nf4_shards: NF4 layout: how many FSDP shards every NF4 weight must split into. Default: devices x
            num_nodes with fsdp, else 1. Give an FSDP run's value to a smaller run to quantize to the same bits.
        resume: auto = continue from the newest checkpoint in out_dir (fresh start if none); a checkpoint
            directory; or false.
        lora: Adapter settings.
        train: Optimization settings.
        data: Dataset settings; with nothing given, the dataset shipped with lit-qlora.
        ignore_modules: Module names (prefixes) whose linears stay in high precision with nf4, e.g. lm_head.
        compile: torch.compile each transformer block (regional compilation): faster steps after a warm-up,
            which summary.json reports apart (compile_seconds; tokens_per_sec excludes the steps that compiled).
            A resume may change it. Refused on a CPU that emulates the precision's matmuls (bf16 without
            AVX512-BF16/AMX: minutes per step for nothing); `force` compiles anyway.
        overwrite: Start a new run (no --resume) in an out_dir that holds another run's checkpoints or results,
            deleting them, its metrics.jsonl and logs first; without it, such an out_dir is refused.
        logger: Where the scalars (and the settings as hyperparameters) go besides metrics.jsonl, one or several
            (--logger '[tensorboard,csv]'): tensorboard (out_dir/logs), csv (out_dir/csv/metrics.csv), wandb
            (offline in out_dir/wandb unless you are logged in; pip install wandb) or mlflow (out_dir/mlruns unless
            MLFLOW_TRACKING_URI is set; pip install mlflow).
        export: More exports of the fine-tune beside final/'s adapter, merged model and PEFT adapter.
    """
    from lit_qlora.model.config import require_checkpoint_dir
    from lit_qlora.data.formats import require_source
    from lit_qlora.data.files import require_data_file
    from lit_qlora.train.run import fit, setup
    from lit_qlora.train.state import read_state

    # Input a user can get wrong, checked before setup() spends seconds importing the training stack.
    if Path(checkpoint_dir) != DEFAULT_CHECKPOINT:
        require_checkpoint_dir(checkpoint_dir)
    data_source(data)  # one dataset option at most
    if data.json_path is not None:
        require_data_file(data.json_path)
    for source in (data.path, data.val_path):
        if source is not None:
            require_source(source)
    loggers = require_loggers(logger)
    if export.gguf and Path(checkpoint_dir).is_dir():  # (the default checkpoint, not yet converted: after training)
        from lit_qlora.deploy.gguf_export import require_exportable
        from lit_qlora.lora.layer import resolve_targets

        require_exportable(Path(checkpoint_dir), head_adapted="lm_head" in resolve_targets(lora.targets))
    precision, precision_reason = choose_precision(precision, accelerator)
    compile = compile_choice(compile, accelerator, precision)
    train.require_fixed_length()
    train.require_valid_validation(data)
    train.require_valid_offload(uses_cuda(accelerator))
    claim_out_dir(Path(out_dir), resume, overwrite)
    resume_from = resolve_resume(resume, Path(out_dir))
    if resume_from is not None:
        state = read_state(resume_from)
        require_same_recipe(state, resume_from, recipe(checkpoint_dir, quantize, precision, seed, lora, train, data,
                                                       ignore_modules))
        finished = finished_summary(Path(out_dir), state, train.max_steps)
        if finished is not None:
            return finished
        print(f"Resuming from {resume_from}, after optimizer step {state.get('step', 0)}")
    print(f"Precision: {precision} ({precision_reason})")
    return fit(setup(checkpoint_dir=checkpoint_dir, out_dir=out_dir, quantize=quantize, precision=precision, seed=seed,
                     accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy,
                     tensor_parallel=tensor_parallel, nf4_shards=nf4_shards, resume=resume_from or False, lora=lora,
                     train=train, data=data, ignore_modules=ignore_modules, compile=compile,
                     precision_reason=precision_reason, logger=loggers, gguf=export.gguf))


COMPILE_EMULATED = (
    "--compile true with --precision {precision} on a CPU: {why}, so every matmul is emulated, and compiling that "
    "costs far more than it saves (measured on a 2-core AVX2-only CPU: the SmolLM2 QLoRA preset at 4x512 in bf16 spent "
    "7 min 50 s in step 1 and 6 min 35 s in step 2, and step 3 had not finished after 21 minutes). Use --precision "
    "auto ({auto} here: compiled, the preset warms up in well under a minute and then runs faster than eager, "
    "benchmarks/README.md \"Compile on CPU\"), or leave --compile off; --compile force compiles anyway.")


def compile_choice(compile: Union[bool, str], accelerator: str, precision: str) -> bool:
    """Whether to compile: `force` always; `true` unless the run is on a CPU that emulates its precision (a clear
    refusal with the measured why: that combination compiles for many minutes and never pays off)."""
    if compile == "force":
        return True
    if compile and not uses_cuda(accelerator):
        why = cpu_emulates(precision)
        if why is not None:
            raise UserError(COMPILE_EMULATED.format(precision=precision, why=why,
                                                    auto=choose_precision("auto", "cpu")[0]))
    return bool(compile)


def recipe(checkpoint_dir: Path, quantize: str, precision: str, seed: int, lora: LoRAArgs, train: TrainArgs,
           data: DataArgs, ignore_modules: Optional[list[str]]) -> dict[str, Any]:
    """The settings that define a run, as JSON (state.json's "run" holds them), with the sha256 of its dataset file:
    the same path with edited rows is other data."""
    from lit_qlora.model.config import Quantize
    from lit_qlora.data.formats import fingerprint

    return {"checkpoint_dir": str(checkpoint_dir), "quantize": Quantize(quantize).value, "precision": precision,
            "seed": seed, "lora": asdict(lora), "train": asdict(train),
            "data": json.loads(json.dumps(asdict(data), default=str)),
            "data_sha256": fingerprint([data_source(data), *([data.val_path] if data.val_path else [])]),
            "ignore_modules": list(ignore_modules or [])}


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
    from lit_qlora.checkpoint.hf import CheckpointError

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


def ensure_default_checkpoint(checkpoint_dir: Path) -> None:
    """The built-in default runs anywhere: convert the bundled SmolLM2 GGUF on first use."""
    from lit_qlora.deploy.gguf_import import convert_gguf

    if Path(checkpoint_dir) == DEFAULT_CHECKPOINT and not (DEFAULT_CHECKPOINT / "config.json").is_file():
        print(f"Converting the bundled SmolLM2-135M-Instruct into {DEFAULT_CHECKPOINT} (first run only)")
        convert_gguf("smollm2", DEFAULT_CHECKPOINT)


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
    from lit_qlora.checkpoint.hf import CheckpointError, remove_path

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
