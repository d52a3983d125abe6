"""`litqlora finetune`: load the (NF4) base, add LoRA, train with the Lightning Trainer, write the run's files.

`setup()` builds the pieces (Trainer with its callbacks, FinetuneModule, data); `fit()` validates, trains,
validates again and writes final/, summary.json and the report.
"""

from __future__ import annotations

import json
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import torch

from lit_qlora.checkpoint import CheckpointError, atomic_write_text
from lit_qlora.compile import compile_seconds
from lit_qlora.config import DTYPE_NAMES, PRECISION_DTYPES, Quantize, require_checkpoint_dir
from lit_qlora.data.sft import dataset_sha256, require_data_file
from lit_qlora.export import export_final
from lit_qlora.gguf_import import convert_gguf
from lit_qlora.guards import oom_advice
from lit_qlora.lora import apply_lora, full_lora_state_dict, load_adapter, resolve_targets
from lit_qlora.loading import load_model
from lit_qlora.memory import peak_memory_stats, release_free_memory
from lit_qlora.nf4 import count_linears
from lit_qlora.parallel.distributed import build_strategy, keep_frozen_out_of_ddp, nf4_shards_for
from lit_qlora.parallel.tensor_parallel import TensorParallelShard
from lit_qlora.tokenizer import Tokenizer
from lit_qlora.train.args import DataArgs, LoRAArgs, TrainArgs, flatten, total_steps_for
from lit_qlora.train.report import print_report
from lit_qlora.train.state import latest_checkpoint, read_state

DEFAULT_CHECKPOINT = Path("checkpoints/SmolLM2-135M-Instruct")


def finetune(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT,
    out_dir: Path = Path("out/finetune"),
    quantize: Literal["nf4", "none"] = "nf4",
    precision: Literal["bf16-true", "16-true", "32-true"] = "bf16-true",
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
    compile: bool = False,
) -> dict[str, Any]:
    """Fine-tune a LoRA adapter on a frozen base: NF4 (QLoRA, the default) or plain (LoRA, the baseline).

    Args:
        checkpoint_dir: Base model (Hugging Face directory). The default is the bundled SmolLM2-135M-Instruct,
            converted on first use.
        out_dir: Where adapters, merged model, logs, metrics and resumable checkpoints go.
        quantize: nf4 = every base linear stored as NF4 (QLoRA); none = base in the precision's dtype (LoRA).
        precision: Compute dtype (Lightning's names): bf16-true, 16-true or 32-true.
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
        compile: torch.compile each transformer block (regional compilation): faster steps after a warm-up of
            tens of seconds, which summary.json reports apart (compile_seconds; tokens_per_sec excludes the steps
            that compiled). Pays off in runs of more than a few dozen steps; a resume may change it.
    """
    # Input a user can get wrong, checked before setup() spends seconds importing the training stack.
    if Path(checkpoint_dir) != DEFAULT_CHECKPOINT:
        require_checkpoint_dir(checkpoint_dir)
    if data.json_path is not None:
        require_data_file(data.json_path)
    resume_from = resolve_resume(resume, Path(out_dir))
    if resume_from is not None:
        state = read_state(resume_from)
        require_same_recipe(state, resume_from, recipe(checkpoint_dir, quantize, precision, seed, lora, train, data,
                                                       ignore_modules))
        finished = finished_summary(Path(out_dir), state, train.max_steps)
        if finished is not None:
            return finished
        print(f"Resuming from {resume_from}, after optimizer step {state.get('step', 0)}")
    return fit(setup(checkpoint_dir=checkpoint_dir, out_dir=out_dir, quantize=quantize, precision=precision, seed=seed,
                     accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy,
                     tensor_parallel=tensor_parallel, nf4_shards=nf4_shards, resume=resume_from or False, lora=lora,
                     train=train, data=data, ignore_modules=ignore_modules, compile=compile))


def recipe(checkpoint_dir: Path, quantize: str, precision: str, seed: int, lora: LoRAArgs, train: TrainArgs,
           data: DataArgs, ignore_modules: Optional[list[str]]) -> dict[str, Any]:
    """The settings that define a run, as JSON (state.json's "run" holds them), with the sha256 of its dataset file:
    the same path with edited rows is other data."""
    return {"checkpoint_dir": str(checkpoint_dir), "quantize": Quantize(quantize).value, "precision": precision,
            "seed": seed, "lora": asdict(lora), "train": asdict(train),
            "data": json.loads(json.dumps(asdict(data), default=str)),
            "data_sha256": dataset_sha256(data.json_path, data.hf_dataset), "ignore_modules": list(ignore_modules or [])}


# What a resume may change: how often it logs and saves, how it spends memory and what it does on a non-finite
# loss; and train.max_steps may grow past the checkpoint (to train longer). Devices, nodes, strategy and --compile
# are not part of the recipe (the NF4 layout is kept across devices; compiled steps compute what eager ones do).
# Anything else (seed, data, batch sizes, sequence length, learning rate, adapter shape) would make the resumed
# steps another run's.
MAY_CHANGE_ON_RESUME = frozenset({"train.save_interval", "train.log_interval", "train.keep_last",
                                  "train.activation_checkpointing", "train.on_nonfinite", "data.num_workers"})


def require_same_recipe(state: dict[str, Any], checkpoint: Path, now: dict[str, Any]) -> None:
    """Refuse to resume `checkpoint` with a recipe other than the one its run trained with (CheckpointError naming
    each changed setting, old -> new). Compared: every setting `recipe` records (seed, base checkpoint, quantize,
    precision, lora.*, train.*, data.*, the dataset file's contents, ignore_modules) but MAY_CHANGE_ON_RESUME, and
    train.max_steps only when it would end before the checkpoint's step. A setting the checkpoint does not record
    (an option added since) is not compared."""
    before, after = flatten(state.get("run", {})), flatten(now)
    changed = []
    for key, value in after.items():
        if key in MAY_CHANGE_ON_RESUME or key not in before:  # not recorded: an option added since that checkpoint
            continue
        if key == "train.max_steps" and value is not None and value >= state.get("step", 0):
            continue
        old = before[key]
        paths = key in ("checkpoint_dir", "data.json_path") and old is not None and value is not None
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
            "activation_checkpointing, on_nonfinite, data.num_workers, compile and the devices (devices, num_nodes, "
            f"strategy) may change on resume, and train.max_steps may grow (from step {state.get('step', 0)} on).")


def finished_summary(out_dir: Path, state: dict[str, Any], max_steps: Optional[int]) -> Optional[dict[str, Any]]:
    """summary.json of a run that is complete (its checkpoint is its last step, and final/ and summary.json are
    that step's), after saying so; None when there is still something to do: train on, or export (a run killed
    while exporting has its last checkpoint but no final/ or summary.json yet)."""
    summary_file, final = out_dir / "summary.json", out_dir / "final"
    if state.get("step") != state.get("total_steps") or not final.is_dir() or not summary_file.is_file():
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
    print(f"{out_dir} is already complete: {state['step']} of {state['total_steps']} steps trained, the adapter and "
          f"exports are in {final}/, the results in {summary_file}. Nothing was changed; to train longer, pass a larger "
          "--train.max_steps, or start a new run in another --out_dir.")
    return summary


@dataclass
class RunConfig:
    """A run's resolved settings."""

    checkpoint_dir: Path
    out_dir: Path
    quantize: Quantize
    precision: str
    seed: int
    lora: LoRAArgs
    train: TrainArgs
    data: DataArgs
    ignore_modules: list[str]
    world_size: int
    strategy: str
    tensor_parallel: int
    nf4_shards: int  # the NF4 layout's shard count (nf4_shards_for)
    start_step: int
    total_steps: int
    resume_from: Optional[Path]
    initial_val_loss: Optional[float] = None  # a resumed run's, from its checkpoint
    compile: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return PRECISION_DTYPES[self.precision]

    @property
    def data_ranks(self) -> int:
        """Ranks that see different samples (the ranks of one tensor-parallel group see the same)."""
        return self.world_size // self.tensor_parallel

    def as_json(self) -> dict[str, Any]:
        """What every checkpoint's state.json records as "run": the recipe and how it was laid out on devices."""
        return {**recipe(self.checkpoint_dir, self.quantize, self.precision, self.seed, self.lora, self.train, self.data,
                         self.ignore_modules),
                "world_size": self.world_size, "strategy": self.strategy, "tensor_parallel": self.tensor_parallel,
                "nf4_shards": self.nf4_shards, "compile": self.compile}

    def adapter_config(self) -> dict[str, Any]:
        """final/adapter_config.json: what loading the adapter onto its base needs."""
        lora, dtype_name = self.lora, DTYPE_NAMES[self.dtype]
        return {
            "r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout, "targets": resolve_targets(lora.targets),
            "rslora": lora.rslora, "quantize": self.quantize.value, "precision": self.precision, "base_dtype": dtype_name,
            "lora_dtype": dtype_name, "base_model": str(Path(self.checkpoint_dir).resolve()),
            "ignore_modules": self.ignore_modules, "nf4_world_size": self.nf4_shards,
            **({"nf4_tensor_parallel": self.tensor_parallel} if self.quantize is Quantize.NF4 and self.tensor_parallel > 1
               else {}),
        }

    def oom(self, where: Callable[[], str]) -> AbstractContextManager:
        """Out-of-memory errors inside become advice naming `where()` and the settings that lower memory."""
        settings = (f"micro_batch_size={self.train.micro_batch_size}, max_seq_length={self.train.max_seq_length}, "
                    f"activation_checkpointing={self.train.activation_checkpointing}")
        return oom_advice(where, settings=settings, quantized=self.quantize is Quantize.NF4)


@dataclass
class Run:
    """What setup() builds and fit() runs. The Lightning types are named in comments, not annotations: importing
    them here would load Lightning with the module (see setup)."""

    config: RunConfig
    trainer: Any  # lightning.Trainer
    module: Any  # lit_qlora.train.module.FinetuneModule
    data: Any  # lit_qlora.data.module.SFTDataModule
    train_loader: Any  # torch.utils.data.DataLoader
    started: float  # perf_counter() at the start: summary.json's wall_seconds


def setup(checkpoint_dir: Path, out_dir: Path, quantize: str, precision: str, seed: int, accelerator: str,
          devices: int, num_nodes: int, strategy: str, tensor_parallel: int, nf4_shards: Optional[int],
          resume: Union[bool, str, Path], lora: LoRAArgs, train: TrainArgs, data: DataArgs,
          ignore_modules: Optional[list[str]], compile: bool = False) -> Run:
    """Check the settings, load the data and the base (NF4 unless quantize=none), add LoRA, build the Trainer."""
    # Lightning (and what builds on it) loads here, not when the module is imported: the CLI reads `finetune`'s
    # signature for `--help` and argument errors, which must not wait seconds for the training stack. It loads
    # without transformers, matplotlib and scipy, which torchmetrics would import only because they are installed.
    from lit_qlora.train.lean_imports import lean_imports

    with lean_imports():
        import lightning as L

        from lit_qlora.data.module import SFTDataModule
        from lit_qlora.precision import NF4Precision
        from lit_qlora.train.callbacks import HeapRelease, MetricsLog, ResumableCheckpoints, StopOnSignal
        from lit_qlora.train.module import FinetuneModule
        from lit_qlora.train.progress import StepProgressBar, quiet_lightning
        from lit_qlora.train.tensorboard import RunTensorBoardLogger

    started = time.perf_counter()
    out_dir = Path(out_dir)
    world_size = devices * num_nodes
    strategy_arg = build_strategy(strategy, world_size, tensor_parallel)  # checks the sizes before any loading
    train.accumulation(world_size // tensor_parallel)  # checks that the global batch divides
    L.seed_everything(seed, verbose=False)
    ensure_default_checkpoint(checkpoint_dir)
    dm = SFTDataModule(data, Tokenizer(checkpoint_dir), train.max_seq_length, train.micro_batch_size, seed)
    dm.setup("fit")
    total_steps = total_steps_for(train, len(dm.train_set))
    resume_from = resolve_resume(resume, out_dir)
    resume_state = read_state(resume_from) if resume_from else {}
    if resume_from and nf4_shards is None and strategy != "tp":  # keep the NF4 bits on another number of devices
        saved = resume_state.get("run", {}).get("nf4_shards")
        nf4_shards = saved if saved and (strategy != "fsdp" or saved % world_size == 0) else None
    config = RunConfig(Path(checkpoint_dir), out_dir, Quantize(quantize), precision, seed, lora, train, data,
                       list(ignore_modules or []), world_size, strategy, tensor_parallel,
                       nf4_shards_for(strategy, world_size, nf4_shards), resume_state.get("step", 0), total_steps,
                       resume_from, resume_state.get("initial_val_loss"), compile)

    checkpoints = ResumableCheckpoints(out_dir, train.save_interval, train.keep_last, total_steps, config.as_json(),
                                       resume_from)
    callbacks = [HeapRelease(), MetricsLog(out_dir, config.start_step, train.log_interval), checkpoints,
                 StopOnSignal(checkpoints), StepProgressBar(train.log_interval)]
    plugin = NF4Precision(precision, config.ignore_modules, config.nf4_shards) if config.quantize is Quantize.NF4 else None
    quiet_lightning()
    logger = RunTensorBoardLogger(out_dir, config.start_step)
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy_arg,
        precision=None if plugin else precision, plugins=[plugin] if plugin else None, callbacks=callbacks,
        logger=logger, log_every_n_steps=train.log_interval, max_epochs=1, enable_checkpointing=False,
        num_sanity_val_steps=0, use_distributed_sampler=False, enable_model_summary=False,
    )
    if trainer.is_global_zero:  # known from here on; rank_zero_only learns the rank only when the strategy starts
        logger.log_settings(config.as_json())
    # The Trainer knows this process's rank before any process group exists: tensor parallelism loads its shard.
    with config.oom(lambda: "while loading the base model"):
        shard = TensorParallelShard(trainer.global_rank % tensor_parallel, tensor_parallel) if tensor_parallel > 1 else None
        model = load_model(config.checkpoint_dir, config.quantize, precision, shard=shard,
                           ignore_modules=config.ignore_modules, nf4_world_size=config.nf4_shards).train()
    apply_lora(model, lora.r, lora.alpha, lora.dropout, lora.targets, lora.rslora, dtype=config.dtype)
    n_ckpt = train.activation_checkpointing
    model.checkpoint_blocks = model.config.n_layer if n_ckpt is True else int(n_ckpt or 0)
    module = FinetuneModule(model, train, total_steps, config.start_step, compile=compile)
    keep_frozen_out_of_ddp(module)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The ranks of one tensor-parallel group (consecutive global ranks) take the same samples.
    loader = dm.step_dataloader(train.global_batch_size, config.start_step, total_steps,
                                trainer.global_rank // tensor_parallel, config.data_ranks)
    return Run(config, trainer, module, dm, loader, started)


def fit(run: Run) -> dict[str, Any]:
    """Validate, train, validate again; rank 0 writes final/ and summary.json and prints the report."""
    config, trainer, module = run.config, run.trainer, run.module
    val_loader = run.data.val_dataloader()
    if config.start_step == 0:
        with config.oom(lambda: "in the first validation"):
            trainer.validate(module, dataloaders=val_loader, verbose=False)
        module.initial_val_loss = module.val_loss
    else:
        module.initial_val_loss = config.initial_val_loss
    if config.start_step < config.total_steps:
        with config.oom(lambda: f"at optimizer step {module.step + 1}"):
            trainer.fit(module, train_dataloaders=run.train_loader)
    else:  # the last step's checkpoint is written but final/ or summary.json is not: validate and export again
        load_adapter(module.model, config.resume_from)
    # The peaks through training (load, first validation, steps), beside the whole run's: what comes after (final
    # validation, export) should not raise them, and summary.json shows whether it did.
    # (Lightning moves the module back to the CPU when a fit or validation ends: the strategy knows the device.)
    device = trainer.strategy.root_device
    train_peaks = {k.replace("_bytes", "_train_bytes"): v for k, v in peak_memory_stats(device).items()}
    with config.oom(lambda: "in the final validation"):
        trainer.validate(module, dataloaders=val_loader, verbose=False)
    trainer.logger.close()

    # Training's freed activations stay in glibc's heap; export's transient would stack on top of them and set the
    # run's peak (a QLoRA run peaked above LoRA's this way). Returned to the OS, export fits under training's peak.
    release_free_memory()
    adapter = full_lora_state_dict(module.model)  # FSDP: every rank gathers, rank 0 writes
    if not trainer.is_global_zero:
        return {}
    with config.oom(lambda: "while exporting final/"):
        export_final(module.model, config.out_dir / "final", config.checkpoint_dir, config.adapter_config(), adapter)
    summary = {**run_summary(run), **train_peaks}
    atomic_write_text(config.out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    print_report(summary, config.out_dir)
    return summary


def run_summary(run: Run) -> dict[str, Any]:
    """summary.json: the run's losses, steady throughput (after this process's warm-up: its first step, and with
    --compile any step that compiled), compile time, memory peaks and sizes."""
    module, history = run.module, run.module.history
    steady = [r for r in history[1:] if not r.get("compile_seconds")] or history[1:]
    train_seconds = sum(r["seconds"] for r in steady)
    quantized, total = count_linears(module.model)
    return {
        "steps": run.config.total_steps,
        "train_loss": history[-1]["loss"] if history else last_logged_loss(run.config.out_dir),
        "val_loss": module.val_loss,
        "initial_val_loss": module.initial_val_loss,
        "tokens_per_sec": sum(r["tokens"] for r in steady) / train_seconds if train_seconds else None,
        "warmup_steps": len(history) - len(steady),
        "first_step_seconds": history[0]["seconds"] if history else None,
        "compile": run.config.compile,
        # Validation's and training's compilation, this process's (a resumed run compiles again).
        "compile_seconds": compile_seconds() if run.config.compile else None,
        "wall_seconds": time.perf_counter() - run.started,
        **peak_memory_stats(run.trainer.strategy.root_device),
        "quantized_linears": quantized,
        "total_linears": total,
        "trainable_params": sum(p.numel() for p in module.model.parameters() if p.requires_grad),
        "total_params": sum(p.numel() for p in module.model.parameters()),
        "accumulation": run.config.train.accumulation(run.config.data_ranks),
        "resumed_from_step": run.config.start_step,
    }


def last_logged_loss(out_dir: Path) -> Optional[float]:
    """The last training loss in metrics.jsonl: a process that trained no step itself reports its run's."""
    path = Path(out_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return rows[-1]["loss"] if rows else None


def ensure_default_checkpoint(checkpoint_dir: Path) -> None:
    """The built-in default runs anywhere: convert the bundled SmolLM2 GGUF on first use."""
    if Path(checkpoint_dir) == DEFAULT_CHECKPOINT and not (DEFAULT_CHECKPOINT / "config.json").is_file():
        print(f"Converting the bundled SmolLM2-135M-Instruct into {DEFAULT_CHECKPOINT} (first run only)")
        convert_gguf("smollm2", DEFAULT_CHECKPOINT)


def resolve_resume(resume: Union[bool, str, Path], out_dir: Path) -> Optional[Path]:
    if resume is False or str(resume).lower() == "false":
        return None
    if str(resume) == "auto":
        found = latest_checkpoint(out_dir)
        if found is None:  # (finetune() says where it resumes from, once it knows the run is not already complete)
            print(f"--resume auto: no checkpoint in {out_dir}, starting fresh")
        return found
    read_state(Path(resume))  # a clear error now rather than after the model has loaded
    return Path(resume)
