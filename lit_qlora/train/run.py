"""One fine-tune run: `setup()` builds the pieces (Trainer with its callbacks, FinetuneModule, data) from resolved
settings; `fit()` validates, trains, validates again and writes final/, summary.json and the report.

`litqlora finetune` (lit_qlora.train.finetune) checks what a user can get wrong, then calls these; Python callers and
tests may call them directly.
"""

from __future__ import annotations

import json
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lit_qlora.checkpoint.adapter import full_lora_state_dict, load_adapter
from lit_qlora.checkpoint.files import atomic_write_text
from lit_qlora.checkpoint.loading import load_model
from lit_qlora.checkpoint.tokenizer import Tokenizer
from lit_qlora.export.gguf_import import ensure_default_checkpoint
from lit_qlora.train.guards import oom_advice
from lit_qlora.lora.layer import apply_lora, resolve_targets, tied_head_note
from lit_qlora.memory.accounting import peak_memory_stats, release_free_memory
from lit_qlora.model.config import Config, Quantize
from lit_qlora.base.precision import ADAPTER_DTYPES, DTYPE_NAMES, MIXED_PRECISIONS, PRECISION_DTYPES
from lit_qlora.nf4 import count_linears
from lit_qlora.parallel.distributed import build_strategy, keep_frozen_out_of_ddp, nf4_shards_for
from lit_qlora.parallel.tensor_parallel import TensorParallelShard
from lit_qlora.base import switches
from lit_qlora.base.threads import govern_threads, threads_summary
from lit_qlora.train.args import ExportArgs, total_steps_for
from lit_qlora.train.compile import compile_seconds
from lit_qlora.train.disk import output_sizes, require_disk_space
from lit_qlora.train.final import export_final
from lit_qlora.train.offload import offload_for_run, offload_summary
from lit_qlora.train.report import print_report
from lit_qlora.train.resume import recipe
from lit_qlora.train.method import Method
from lit_qlora.train.spec import Decided, RunSpec, decide
from lit_qlora.train.state import read_state


@dataclass
class RunConfig:
    """A run's settings as it runs: the spec, what decide() made of its choices, and what follows from the data, the
    base and the checkpoint it resumes."""

    spec: RunSpec
    decided: Decided
    world_size: int
    nf4_shards: int  # the NF4 layout's shard count (nf4_shards_for)
    start_step: int
    total_steps: int
    initial_val_loss: Optional[float] = None  # a resumed run's, from its checkpoint
    tied_head: bool = False  # the base's head is its embedding: `all` leaves it out (lit_qlora.lora.resolve_targets)
    prompt_style: Optional[str] = None  # the style rows were rendered in (--data.prompt_style, auto resolved)
    method: Method = field(default_factory=lambda: Method(RunSpec()))  # what trains: SFT, or another method
    initial_val_metrics: dict[str, float] = field(default_factory=dict)  # a resumed run's, from its checkpoint
    experts: bool = False  # the base is a mixture of experts: `all` names them

    # The spec's settings and the decisions, by the names the run's parts read them.
    checkpoint_dir = property(lambda self: Path(self.spec.checkpoint_dir))
    out_dir = property(lambda self: Path(self.spec.out_dir))
    quantize = property(lambda self: Quantize(self.spec.quantize))
    seed = property(lambda self: self.spec.seed)
    lora = property(lambda self: self.spec.lora)
    train = property(lambda self: self.spec.train)
    data = property(lambda self: self.spec.data)
    ignore_modules = property(lambda self: list(self.spec.ignore_modules or []))
    strategy = property(lambda self: self.spec.strategy)
    tensor_parallel = property(lambda self: self.spec.tensor_parallel)
    precision = property(lambda self: self.decided.precision)
    precision_reason = property(lambda self: self.decided.precision_reason)
    compile = property(lambda self: self.decided.compile)
    resume_from = property(lambda self: self.decided.resume_from)

    @property
    def dtype(self) -> torch.dtype:
        """The frozen base's and the compute's dtype."""
        return PRECISION_DTYPES[self.precision]

    @property
    def lora_dtype(self) -> torch.dtype:
        """The adapters' (and AdamW state's) dtype: fp32 under 16-mixed, else the compute dtype."""
        return ADAPTER_DTYPES[self.precision]

    @property
    def data_ranks(self) -> int:
        """Ranks that see different samples (the ranks of one tensor-parallel group see the same)."""
        return self.world_size // self.tensor_parallel

    def as_json(self) -> dict[str, Any]:
        """What every checkpoint's state.json records as "run": the recipe and how it was laid out on devices."""
        return {**recipe(self.spec, self.precision), **self.method.recorded(),
                "world_size": self.world_size, "strategy": self.strategy, "tensor_parallel": self.tensor_parallel,
                "nf4_shards": self.nf4_shards, "compile": self.compile}

    def adapter_config(self) -> dict[str, Any]:
        """final/adapter_config.json: what loading the adapter onto its base needs."""
        lora, dtype_name = self.lora, DTYPE_NAMES[self.dtype]
        lora_dtype_name = DTYPE_NAMES[self.lora_dtype]
        return {
            "r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout,
            "targets": resolve_targets(lora.targets, self.tied_head, self.experts),
            "rslora": lora.rslora, "quantize": self.quantize.value, "precision": self.precision, "base_dtype": dtype_name,
            "lora_dtype": lora_dtype_name, "base_model": str(Path(self.checkpoint_dir).resolve()),
            "ignore_modules": self.ignore_modules, "nf4_world_size": self.nf4_shards,
            "prompt_style": self.prompt_style,  # inference and exports format prompts as training did
            **({"method": self.method.name} if self.method.name != "sft" else {}),
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
    data: Any  # lit_qlora.train.datamodule.SFTDataModule
    train_loader: Any  # torch.utils.data.DataLoader
    started: float  # perf_counter() at the start: this process's part of summary.json's wall_seconds

    @property
    def export(self) -> ExportArgs:
        """What final/ holds besides the adapter."""
        return self.config.spec.export


def setup(spec: RunSpec, decided: Optional[Decided] = None, method: Optional[Method] = None) -> Run:
    """Check the settings, load the data and the base (NF4 unless quantize=none), add LoRA, build the Trainer.
    `decided`: what `lit_qlora.train.spec.decide` made of the spec's choices (decided here when not given); `method`,
    what trains (lit_qlora.train.method: SFT when None)."""
    # Lightning (and what builds on it) loads here, without transformers, matplotlib and scipy, which torchmetrics
    # would import only because they are installed (lit_qlora.train.lean_imports).
    from lit_qlora.train.lean_imports import lean_imports

    with lean_imports():
        import lightning as L

        from lit_qlora.train.precision import NF4Precision
        from lit_qlora.train.callbacks import HeapRelease, MetricsLog, ResumableCheckpoints, StopOnSignal
        from lit_qlora.train.progress import StepProgressBar, quiet_lightning
        from lit_qlora.train.loggers import build_loggers, log_settings
        from lit_qlora.train.validation import PeriodicValidation, ValidationRecord, drop_samples_after, sample_prompt

    started = time.perf_counter()
    decided = decided or decide(spec)
    precision, lora, train, data = decided.precision, spec.lora, spec.train, spec.data
    checkpoint_dir, out_dir, tensor_parallel = spec.checkpoint_dir, Path(spec.out_dir), spec.tensor_parallel
    world_size = spec.devices * spec.num_nodes
    strategy_arg = build_strategy(spec.strategy, world_size, tensor_parallel)  # checks the sizes before any loading
    train.accumulation(world_size // tensor_parallel)  # checks that the global batch divides
    L.seed_everything(spec.seed, verbose=False)
    ensure_default_checkpoint(checkpoint_dir)
    # Before anything heavy: a run that cannot write its exports should not train first.
    require_disk_space(out_dir, output_sizes(checkpoint_dir, lora, train, spec.export,
                                             ADAPTER_DTYPES[precision].itemsize))
    method = method or Method(spec)
    dm = method.data_module(data, Tokenizer(checkpoint_dir), train.max_seq_length, train.micro_batch_size, spec.seed)
    dm.setup("fit")
    total_steps = total_steps_for(train, dm.samples_per_epoch())
    resume_from = decided.resume_from
    resume_state = read_state(resume_from) if resume_from else {}
    nf4_shards = spec.nf4_shards
    if resume_from and nf4_shards is None and spec.strategy != "tp":  # keep the NF4 bits on another number of devices
        saved = resume_state.get("run", {}).get("nf4_shards")
        nf4_shards = saved if saved and (spec.strategy != "fsdp" or saved % world_size == 0) else None
    base = Config.from_checkpoint(checkpoint_dir)
    config = RunConfig(spec, decided, world_size, nf4_shards_for(spec.strategy, world_size, nf4_shards),
                       resume_state.get("step", 0), total_steps, resume_state.get("initial_val_loss"),
                       base.tie_embeddings, dm.style.name, method, resume_state.get("initial_val_metrics") or {},
                       base.n_experts > 0)

    checkpoints = ResumableCheckpoints(out_dir, train.save_interval, train.keep_last, total_steps, config.as_json(),
                                       resume_from, started)
    # StopOnSignal first: at a step's end after a signal, it saves (a periodic save of that step is then skipped)
    # before its grace runs out.
    # The progress bar before the validation: a step's line comes before the validation that follows it.
    callbacks = [HeapRelease(), MetricsLog(out_dir, config.start_step, train.log_interval),
                 StepProgressBar(train.log_interval), StopOnSignal(checkpoints), checkpoints]
    if train.eval_interval is not None:  # before StopOnSignal and checkpoints: a step's checkpoint records its outcome
        # The sample reply decodes with the KV cache, which tensor-parallel attention (local heads) does not have.
        sample = None if tensor_parallel > 1 else sample_prompt(train.eval_prompt, dm)
        callbacks.insert(3, PeriodicValidation(out_dir, dm.val_dataloader(), train.eval_interval,
                                               train.early_stopping_patience, total_steps, config.adapter_config(),
                                               ValidationRecord.from_state(resume_state), checkpoints, sample))
    # Our plugin quantizes (QLoRA) and, under 16-mixed, keeps the base fp16 and scales the loss (QLoRA and LoRA).
    nf4 = config.quantize is Quantize.NF4
    plugin = NF4Precision(precision, config.ignore_modules, config.nf4_shards, quantize=nf4) \
        if nf4 or precision in MIXED_PRECISIONS else None
    quiet_lightning()
    loggers = build_loggers(decided.loggers, out_dir, config.start_step)
    trainer = L.Trainer(
        accelerator=spec.accelerator, devices=spec.devices, num_nodes=spec.num_nodes, strategy=strategy_arg,
        precision=None if plugin else precision, plugins=[plugin] if plugin else None, callbacks=callbacks,
        logger=loggers, log_every_n_steps=train.log_interval, max_epochs=1, enable_checkpointing=False,
        num_sanity_val_steps=0, use_distributed_sampler=False, enable_model_summary=False,
    )
    if trainer.is_global_zero:  # known from here on; rank_zero_only learns the rank only when the strategy starts
        log_settings(loggers, config.as_json())
        drop_samples_after(out_dir, config.start_step)
    # The Trainer knows this process's rank before any process group exists: tensor parallelism loads its shard.
    with config.oom(lambda: "while loading the base model"):
        shard = TensorParallelShard(trainer.global_rank % tensor_parallel, tensor_parallel) if tensor_parallel > 1 else None
        model = load_model(config.checkpoint_dir, config.quantize, precision, shard=shard,
                           ignore_modules=config.ignore_modules, nf4_world_size=config.nf4_shards).train()
    govern_threads(model)  # the run shares the CPU with other processes (lit_qlora.base.threads)
    apply_lora(model, lora.r, lora.alpha, lora.dropout, lora.targets, lora.rslora, dtype=config.lora_dtype)
    if train.init_adapter is not None:  # a finished run's adapter to go on from (a resume then restores its own)
        load_adapter(model, train.init_adapter)
    note = tied_head_note(lora.targets, config.tied_head, config.experts)
    if note and trainer.is_global_zero:
        print(note)
    model.checkpoint_blocks = train.checkpointed_blocks(model.config.n_layer)
    model.activation_offload, offload_reason = offload_for_run(
        train.offload_activations, trainer.strategy.root_device, model.checkpoint_blocks, model.config.n_embd,
        train.micro_batch_size * method.rows_per_sample, train.max_seq_length, config.dtype)
    # said where it is a choice: on a GPU (a CPU run has nothing to offload to, and says nothing of it)
    if trainer.is_global_zero and trainer.strategy.root_device.type == "cuda":
        print(f"Offloaded activation checkpoints: {'on' if model.activation_offload else 'off'} ({offload_reason})")
    module = method.module(model, dm, config)
    periodic = periodic_validation(callbacks)
    module.validation_record = periodic.record if periodic else None
    keep_frozen_out_of_ddp(module)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The ranks of one tensor-parallel group (consecutive global ranks) take the same samples.
    loader = dm.step_dataloader(train.global_batch_size, config.start_step, total_steps,
                                trainer.global_rank // tensor_parallel, config.data_ranks)
    return Run(config, trainer, module, dm, loader, started)


def fit(run: Run) -> dict[str, Any]:
    """Validate, train, validate again; rank 0 writes final/ and summary.json and prints the report. SIGINT and
    SIGTERM stop it within seconds (TrainingStopped), and the caller's signal handlers are back when it returns."""
    from lit_qlora.train.callbacks import StopOnSignal

    stop = next(c for c in run.trainer.callbacks if isinstance(c, StopOnSignal))
    with stop.signals:
        return train_and_export(run)


def train_and_export(run: Run) -> dict[str, Any]:
    from lit_qlora.train.loggers import close_loggers
    from lit_qlora.train.validation import write_val_row

    config, trainer, module = run.config, run.trainer, run.module
    periodic = periodic_validation(trainer.callbacks)
    val_loader = run.data.val_dataloader()
    if config.start_step == 0:
        with config.oom(lambda: "in the first validation"):
            trainer.validate(module, dataloaders=val_loader, verbose=False)
        module.initial_val_loss, module.initial_val_metrics = module.val_loss, dict(module.val_metrics)
        if periodic:
            write_val_row(config.out_dir, 0, module.val_loss, trainer.is_global_zero, module.val_metrics)
            periodic.log_sample(trainer, module, 0)
    else:
        module.initial_val_loss, module.initial_val_metrics = config.initial_val_loss, config.initial_val_metrics
    stopped_early = periodic.record.stopped_early if periodic else None  # a resume of a run that stopped early
    if config.start_step < config.total_steps and stopped_early is None:
        with config.oom(lambda: f"at optimizer step {module.step + 1}"):
            trainer.fit(module, train_dataloaders=run.train_loader)
    else:  # the last step's checkpoint is written but final/ or summary.json is not: validate and export again
        load_adapter(module.model, config.resume_from)
    # The peaks through training (load, first validation, steps), beside the whole run's: what comes after (final
    # validation, export) should not raise them, and summary.json shows whether it did.
    # (Lightning moves the module back to the CPU when a fit or validation ends: the strategy knows the device.)
    device = trainer.strategy.root_device
    train_peaks = {k.replace("_bytes", "_train_bytes"): v for k, v in peak_memory_stats(device).items()}
    if periodic and periodic.record.stopped_early is not None:
        # Stopped early: the run's result is the best adapter, validated when it was saved.
        load_adapter(module.model, config.out_dir / "best")
        module.val_loss = periodic.record.best_val_loss
    else:
        with config.oom(lambda: "in the final validation"):
            trainer.validate(module, dataloaders=val_loader, verbose=False)
        if periodic:
            periodic.record_validation(trainer, module, config.total_steps, module.val_loss)
            periodic.log_sample(trainer, module, config.total_steps)
    close_loggers(trainer.loggers)

    # Training's freed activations stay in glibc's heap; export's transient would stack on top of them and set the
    # run's peak (a QLoRA run peaked above LoRA's this way). Returned to the OS, export fits under training's peak.
    release_free_memory()
    adapter = full_lora_state_dict(module.model)  # FSDP: every rank gathers, rank 0 writes
    if not trainer.is_global_zero:
        return {}
    adapter_config = {**config.adapter_config(), **(best_fields(periodic.record) if periodic else {})}
    with config.oom(lambda: "while exporting final/"):
        export_final(module.model, config.out_dir / "final", config.checkpoint_dir, adapter_config, adapter,
                     gguf=run.export.gguf, merged=run.export.merged, peft=run.export.peft)
    summary = {**run_summary(run), **(best_fields(periodic.record) if periodic else {}), **train_peaks}
    if run.export.gguf:
        summary["gguf"] = str(config.out_dir / "final" / f"model-{run.export.gguf}.gguf")
    if summary.get("stopped_at_step") is not None:  # the steps trained (and checkpointed) before the stop
        summary["steps"] = summary["stopped_at_step"]
    atomic_write_text(config.out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    print_report(summary, config.out_dir)
    return summary


def periodic_validation(callbacks: list[Any]) -> Any:
    """The run's PeriodicValidation callback (--train.eval_interval), or None."""
    from lit_qlora.train.validation import PeriodicValidation

    return next((c for c in callbacks if isinstance(c, PeriodicValidation)), None)


def best_fields(record: Any) -> dict[str, Any]:
    """What final/adapter_config.json and summary.json say of the validations during training: the best step and
    its loss (out_dir/best/ holds that adapter), and the step early stopping ended training at (final/ is then the
    best adapter), or null."""
    return {"best_step": record.best_step, "best_val_loss": record.best_val_loss,
            "stopped_early": record.stopped_early is not None, "stopped_at_step": record.stopped_early}


def run_summary(run: Run) -> dict[str, Any]:
    """summary.json: the run's losses, steady throughput (after each process's warm-up: its first step, and with
    --compile any step that compiled), compile time, memory peaks and sizes. Steps, throughput and wall time are
    the whole run's, a resumed one's included (the checkpoint resumed from counted the part before: run_totals);
    process_wall_seconds is this process's alone."""
    from lit_qlora.train.callbacks import ResumableCheckpoints

    module, history = run.module, run.module.history
    totals = next(c for c in run.trainer.callbacks if isinstance(c, ResumableCheckpoints)).totals(history)
    quantized, total = count_linears(module.model)
    return {
        "steps": run.config.total_steps,
        "train_loss": history[-1]["loss"] if history else last_logged_loss(run.config.out_dir),
        "val_loss": module.val_loss,
        "initial_val_loss": module.initial_val_loss,
        # An objective's numbers (lit_qlora.methods.dpo): the last step's, the last validation's and the first's.
        **({k: history[-1][k] for k in module.extra_metrics if k in history[-1]} if history else {}),
        **module.val_metrics, **{f"initial_{k}": v for k, v in module.initial_val_metrics.items()},
        "tokens_per_sec": totals["steady_tokens"] / totals["steady_seconds"] if totals["steady_seconds"] else None,
        "warmup_steps": totals["warmup_steps"],
        "first_step_seconds": totals["first_step_seconds"],
        "precision": run.config.precision,
        "precision_reason": run.config.precision_reason,
        "compile": run.config.compile,
        # Validation's and training's compilation, this process's (a resumed run compiles again).
        "compile_seconds": compile_seconds() if run.config.compile else None,
        "wall_seconds": totals["wall_seconds"],  # the whole run: every process that trained it, resumes included
        "process_wall_seconds": time.perf_counter() - run.started,  # this process alone (its load, steps, exports)
        **peak_memory_stats(run.trainer.strategy.root_device),
        **offload_summary(getattr(module.model, "activation_offload", None)),  # host memory beside the device's
        **threads_summary(),  # CPU: how many threads the steps ran on, beside other processes
        "switches": switches.in_effect(),  # the LIT_QLORA_* settings this run measured under
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
    rows = [row for row in rows if "loss" in row]  # not the validations' rows (--train.eval_interval)
    return rows[-1]["loss"] if rows else None
