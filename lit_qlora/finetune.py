"""`litqlora finetune`: load (NF4) base + LoRA, train with the Lightning Trainer, write the run's artifacts."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning as L
import torch

from lit_qlora.checkpoint import atomic_write_text
from lit_qlora.config import DTYPE_NAMES, PRECISION_DTYPES, Quantize
from lit_qlora.data.module import DataArgs, SFTDataModule
from lit_qlora.parallel.distributed import build_strategy, is_sharded, keep_frozen_out_of_ddp, nf4_shards_for
from lit_qlora.guards import oom_advice
from lit_qlora.lora import apply_lora, full_lora_state_dict, load_adapter, save_adapter
from lit_qlora.memory import peak_rss_bytes, release_free_memory
from lit_qlora.loading import load_model
from lit_qlora.nf4 import count_linears
from lit_qlora.parallel.tensor_parallel import TensorParallelShard
from lit_qlora.precision import NF4Precision
from lit_qlora.train.signals import StopSignals, TrainingStopped
from lit_qlora.train.state import (collect_training_state, latest_checkpoint, load_training_state, read_state,
                                   save_training_state, step_dir)
from lit_qlora.train.module import FinetuneModule, LoRAArgs, TrainArgs, total_steps_for, train_loader

DEFAULT_CHECKPOINT = Path("checkpoints/SmolLM2-135M-Instruct")


def ensure_default_checkpoint(checkpoint_dir: Path) -> None:
    """The built-in default runs anywhere: convert the bundled SmolLM2 GGUF on first use."""
    if Path(checkpoint_dir) == DEFAULT_CHECKPOINT and not (DEFAULT_CHECKPOINT / "config.json").is_file():
        from lit_qlora.gguf_import import convert_gguf

        print(f"Converting the bundled SmolLM2-135M-Instruct into {DEFAULT_CHECKPOINT} (first run only)")
        convert_gguf("smollm2", DEFAULT_CHECKPOINT)


def resolve_resume(resume: Union[bool, str, Path], out_dir: Path) -> Optional[Path]:
    if resume is False or str(resume).lower() == "false":
        return None
    if str(resume) == "auto":
        found = latest_checkpoint(out_dir)
        print(f"Resuming from {found}" if found else f"--resume auto: no checkpoint in {out_dir}, starting fresh")
        return found
    read_state(Path(resume))  # a clear error now rather than after the model has loaded
    return Path(resume)


def memory_stats(device: torch.device) -> dict[str, int]:
    stats = {"peak_rss_bytes": peak_rss_bytes()}
    if device.type == "cuda":
        stats["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        stats["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        stats["peak_active_bytes"] = torch.cuda.memory_stats(device).get("active_bytes.all.peak", 0)
    return stats


class RunLog:
    """metrics.jsonl + TensorBoard, written on rank 0; on resume, rows after the checkpoint are dropped."""

    def __init__(self, out_dir: Path, start_step: int, log_interval: int, logger) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.log_interval, self.logger = log_interval, logger
        kept = []
        if start_step and self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= start_step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, row: dict[str, Any]) -> None:
        if row["step"] % self.log_interval:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        self.logger.log_metrics(numbers, step=row["step"])


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
    debug: bool = False,
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
        debug: Show full tracebacks on errors.
    """
    started = time.perf_counter()
    quantize = Quantize(quantize)
    out_dir = Path(out_dir)
    ignore_modules = list(ignore_modules or [])
    dtype = PRECISION_DTYPES[precision]
    world_size = devices * num_nodes
    strategy_arg = build_strategy(strategy, world_size, tensor_parallel)  # checks the sizes before any loading
    data_ranks = world_size // tensor_parallel  # ranks that see different samples
    accumulation = train.accumulation(data_ranks)
    L.seed_everything(seed, verbose=False)
    ensure_default_checkpoint(checkpoint_dir)
    from lit_qlora.tokenizer import Tokenizer

    tokenizer = Tokenizer(checkpoint_dir)
    dm = SFTDataModule(data, tokenizer, train.max_seq_length, train.micro_batch_size, seed)
    dm.setup("fit")
    total_steps = total_steps_for(train, len(dm.train_set))
    resume_path = resolve_resume(resume, out_dir)
    resume_state = read_state(resume_path) if resume_path else {}
    start_step = resume_state["step"] if resume_path else 0
    if resume_path and nf4_shards is None and strategy != "tp":  # keep the NF4 bits on another number of devices
        saved = resume_state.get("run", {}).get("nf4_shards")
        nf4_shards = saved if saved and (strategy != "fsdp" or saved % world_size == 0) else None
    layout_shards = nf4_shards_for(strategy, world_size, nf4_shards)

    settings = (f"micro_batch_size={train.micro_batch_size}, max_seq_length={train.max_seq_length}, "
                f"activation_checkpointing={train.activation_checkpointing}")
    oom = partial(oom_advice, settings=settings, quantized=quantize is Quantize.NF4)
    plugin = NF4Precision(precision, ignore_modules, layout_shards) if quantize is Quantize.NF4 else None
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(save_dir=str(out_dir), name="", version="logs", default_hp_metric=False)
    trainer = L.Trainer(
        accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy_arg,
        precision=None if plugin else precision, plugins=[plugin] if plugin else None,
        max_epochs=1, logger=logger, enable_checkpointing=False, num_sanity_val_steps=0,
        use_distributed_sampler=False, enable_model_summary=False, log_every_n_steps=1,
    )
    # The Trainer knows this process's rank before any process group exists: tensor parallelism loads its shard.
    with oom(lambda: "while loading the base model"):
        tp_rank = trainer.global_rank % tensor_parallel
        shard = TensorParallelShard(tp_rank, tensor_parallel) if tensor_parallel > 1 else None
        model = load_model(checkpoint_dir, quantize, precision, shard=shard, ignore_modules=ignore_modules,
                           nf4_world_size=layout_shards).train()
    apply_lora(model, lora.r, lora.alpha, lora.dropout, lora.targets, lora.rslora, dtype=dtype)
    n_ckpt = train.activation_checkpointing
    model.checkpoint_blocks = model.config.n_layer if n_ckpt is True else int(n_ckpt or 0)
    module = FinetuneModule(model, train, total_steps, start_step)
    keep_frozen_out_of_ddp(module)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_log = RunLog(out_dir, start_step, train.log_interval, logger) if trainer.is_global_zero else None
    run_config = {"checkpoint_dir": str(checkpoint_dir), "quantize": quantize.value, "precision": precision,
                  "seed": seed, "lora": asdict(lora), "train": asdict(train), "data": json.loads(json.dumps(
                      asdict(data), default=str)), "ignore_modules": ignore_modules, "world_size": world_size,
                  "strategy": strategy, "tensor_parallel": tensor_parallel, "nf4_shards": layout_shards}

    stop = StopSignals()  # remembers the handlers before fit; installed once Lightning has set its own

    def on_train_start() -> None:
        if resume_path:
            load_training_state(resume_path, module.model, module.optimizers().optimizer)
        stop.install()

    def on_step(row: dict[str, Any]) -> None:
        row = {"step": row["step"], "loss": row["loss"], "lr": row["lr"], "grad_norm": row["grad_norm"],
               "tokens_per_sec": row["tokens"] / max(row["seconds"], 1e-9),
               "peak_memory_bytes": max(memory_stats(module.device).values()), "tokens": row["tokens"],
               **({"skipped": row["skipped"]} if "skipped" in row else {})}
        if run_log is not None:
            run_log.write(row)
        saved = (train.save_interval and row["step"] % train.save_interval == 0) or row["step"] == total_steps
        if saved:
            save_checkpoint(row["step"])
        # Every rank learns of a signal any rank got, so all of them save and stop at the same step.
        stopping = trainer.strategy.reduce(torch.tensor(float(stop.received is not None), device=module.device),
                                           reduce_op="sum")
        if stopping > 0:
            if not saved:
                save_checkpoint(row["step"])
            name = stop.received.name if stop.received else "a signal on another rank"
            raise TrainingStopped(
                f"stopped by {name} after optimizer step {row['step']} of {total_steps}; the checkpoint "
                f"{step_dir(out_dir, row['step'])} holds the run's state. Run the same command with --resume auto "
                "to continue.", stop.received or 15)

    def save_checkpoint(step: int) -> None:
        collected = collect_training_state(module.model, module.optimizers().optimizer)  # FSDP: every rank gathers
        if trainer.is_global_zero:
            save_training_state(out_dir, step, None, None, {"total_steps": total_steps, "run": run_config},
                                train.keep_last, collected)
        trainer.strategy.barrier()

    module.on_train_start_hook = on_train_start
    module.on_step = on_step
    # The ranks of one tensor-parallel group (consecutive global ranks) take the same samples.
    loader = train_loader(dm, train, seed, start_step, total_steps, trainer.global_rank // tensor_parallel, data_ranks)
    val_loader = dm.val_dataloader()

    initial_val_loss = None
    if start_step == 0:
        with oom(lambda: "in the first validation"):
            trainer.validate(module, dataloaders=val_loader, verbose=False)
        initial_val_loss = module.val_loss
    if start_step < total_steps:
        with oom(lambda: f"at optimizer step {module.step + 1}"), stop:
            trainer.fit(module, train_dataloaders=loader)
    else:  # the run had already finished: re-validate and re-export its last adapter
        load_adapter(module.model, resume_path)
    with oom(lambda: "in the final validation"):
        trainer.validate(module, dataloaders=val_loader, verbose=False)
    val_loss = module.val_loss
    train_seconds = sum(r["seconds"] for r in module.history[1:])

    summary: dict[str, Any] = {}
    # Training's freed activations stay in glibc's heap; export's transient would stack on top of them and set the
    # run's peak (a QLoRA run peaked above LoRA's this way). Returned to the OS, export fits under training's peak.
    release_free_memory()
    adapter = full_lora_state_dict(module.model)  # FSDP: every rank gathers, rank 0 writes
    if trainer.is_global_zero:
        with oom(lambda: "while exporting final/"):
            export_final(module.model, out_dir / "final", checkpoint_dir, quantize, dtype, lora, ignore_modules,
                         layout_shards, precision, adapter, tensor_parallel)
        quantized, total = count_linears(module.model)
        trainable = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
        summary = {
            "steps": total_steps,
            "train_loss": module.history[-1]["loss"] if module.history else None,
            "val_loss": val_loss,
            "initial_val_loss": initial_val_loss,
            "tokens_per_sec": sum(r["tokens"] for r in module.history[1:]) / train_seconds if train_seconds else None,
            "wall_seconds": time.perf_counter() - started,
            **memory_stats(module.device),
            "quantized_linears": quantized,
            "total_linears": total,
            "trainable_params": trainable,
            "total_params": sum(p.numel() for p in module.model.parameters()),
            "accumulation": accumulation,
            "resumed_from_step": start_step,
        }
        atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        print_report(summary, out_dir)
    return summary


def export_final(model, final_dir: Path, checkpoint_dir: Path, quantize: Quantize, dtype: torch.dtype, lora: LoRAArgs,
                 ignore_modules: list[str], world_size: int, precision: str,
                 adapter: Optional[dict[str, torch.Tensor]] = None, tensor_parallel: int = 1) -> None:
    """final/adapter.safetensors (+ config), final/merged (HF), final/peft: streamed from the trained model.

    An FSDP-sharded or tensor-parallel model has no whole base here: the merged model and PEFT adapter are then
    built from the base checkpoint and the written adapter, as `litqlora merge` does (the same NF4 layout, recorded
    as nf4_world_size / nf4_tensor_parallel, gives the same bits)."""
    from lit_qlora.checkpoint import save_hf_checkpoint
    from lit_qlora.export import export_config, hf_tensor_specs, write_peft_adapter
    from lit_qlora.lora import resolve_targets

    adapter_config = {
        "r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout, "targets": resolve_targets(lora.targets),
        "rslora": lora.rslora, "quantize": quantize.value, "precision": precision, "base_dtype": DTYPE_NAMES[dtype],
        "lora_dtype": DTYPE_NAMES[dtype], "base_model": str(Path(checkpoint_dir).resolve()),
        "ignore_modules": ignore_modules, "nf4_world_size": world_size,
        **({"nf4_tensor_parallel": tensor_parallel} if quantize is Quantize.NF4 and tensor_parallel > 1 else {}),
    }
    save_adapter(model, final_dir, adapter_config, adapter)
    if is_sharded(model):
        model = load_model(checkpoint_dir, adapter_dir=final_dir)
    model = model.eval()
    save_hf_checkpoint(final_dir / "merged", export_config(model, True), hf_tensor_specs(model, torch.bfloat16),
                       tokenizer_dir=Path(checkpoint_dir), dtype=torch.bfloat16)
    write_peft_adapter(model, adapter_config, final_dir / "peft", str(Path(checkpoint_dir).resolve()))


def print_report(summary: dict[str, Any], out_dir: Path) -> None:
    gib = 1024**3
    rows = [
        ("steps", summary["steps"]),
        ("train loss (last step)", f"{summary['train_loss']:.4f}" if summary["train_loss"] is not None else "-"),
        ("val loss (before -> after)", f"{summary['initial_val_loss'] or float('nan'):.4f} -> {summary['val_loss']:.4f}"),
        ("tokens/s (after step 1)", f"{summary['tokens_per_sec']:.1f}" if summary["tokens_per_sec"] else "-"),
        ("peak RSS (whole run)", f"{summary['peak_rss_bytes'] / gib:.2f} GiB"),
        *[(k.replace("_bytes", "").replace("_", " "), f"{summary[k] / gib:.2f} GiB")
          for k in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_active_bytes") if k in summary],
        ("NF4 linears", f"{summary['quantized_linears']} / {summary['total_linears']}"),
        ("trainable params", f"{summary['trainable_params']:,} of {summary['total_params']:,}"),
        ("wall time", f"{summary['wall_seconds']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join([f"\nRun finished: {out_dir}"] + [f"  {k:<{width}}  {v}" for k, v in rows]))
