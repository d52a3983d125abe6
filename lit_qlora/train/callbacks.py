"""What `litqlora finetune` adds around `FinetuneModule`'s optimizer steps, as Lightning Callbacks: the metrics
file, resumable checkpoints, stopping on a signal, and returning freed heap to the OS on CPU."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.hooks import RemovableHandle

from lit_qlora.train.heap import HeapTrimmer
from lit_qlora.train.loggers import jsonl_rows_through
from lit_qlora.train.signals import StopRequested, StopSignals
from lit_qlora.train.state import (collect_training_state, latest_checkpoint, load_training_state, module_tensors,
                                   read_state, run_totals, save_training_state, step_dir)


class MetricsLog(Callback):
    """out_dir/metrics.jsonl, written by rank 0: every `log_interval`-th row of `FinetuneModule.history` (its
    `seconds` left out). A resumed run first drops the rows after its checkpoint: it trains those steps again.

    TensorBoard gets the same numbers from the module's `self.log`; this callback makes Lightning's logging steps
    the run's own, so both files hold the same steps after a resume too."""

    def __init__(self, out_dir: Path, start_step: int, log_interval: int) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.start_step, self.log_interval = start_step, log_interval
        self._opened = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._opened or not trainer.is_global_zero:
            return
        self._opened = True
        kept = jsonl_rows_through(self.path, self.start_step) if self.start_step else []
        self.path.write_text("".join(line + "\n" for line in kept))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning logs every `log_every_n_steps` by the steps it has run in this fit: counting from the
        # checkpoint's step (as Lightning restores it from its own checkpoints) keeps that on the run's steps.
        trainer.fit_loop.epoch_loop._batches_that_stepped = self.start_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        row = {k: v for k, v in pl_module.history[-1].items() if k != "seconds"}
        if trainer.is_global_zero and row["step"] % self.log_interval == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


class ResumableCheckpoints(Callback):
    """out_dir/checkpoints/step-NNNNNN every `save_interval` optimizer steps and at the last one (adapters,
    optimizer, RNG: `lit_qlora.train.state`); a resumed run's state is restored as training starts."""

    def __init__(self, out_dir: Path, save_interval: Optional[int], keep_last: int, total_steps: int,
                 run: dict[str, Any], resume_from: Optional[Path] = None, started: Optional[float] = None) -> None:
        self.out_dir, self.save_interval, self.keep_last = Path(out_dir), save_interval, keep_last
        self.total_steps, self.run, self.resume_from = total_steps, run, resume_from
        self.last_saved: Optional[int] = None
        # For the whole run's time and throughput in each checkpoint (run_totals): this process's start
        # (perf_counter) and what the checkpoint it resumes from had counted.
        self.started = time.perf_counter() if started is None else started
        self.totals_before = read_state(resume_from).get("totals", {}) if resume_from is not None else {}

    def totals(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole run's time and throughput until now (`history`: this process's steps), resumed runs included."""
        return run_totals(history, time.perf_counter() - self.started, self.totals_before)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.resume_from is not None:
            state = load_training_state(self.resume_from, pl_module.model, trainer.optimizers[0])
            pl_module.restore_checkpoint_tensors(module_tensors(self.resume_from))
            if hasattr(trainer.precision_plugin, "load_state_dict") and state.get("loss_scale"):
                trainer.precision_plugin.load_state_dict(state["loss_scale"])  # 16-mixed: the same scale goes on

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = pl_module.step
        due = (self.save_interval and step % self.save_interval == 0) or step == self.total_steps
        if due and self.last_saved != step:  # (StopOnSignal, called first, may have saved this step)
            self.save(trainer, pl_module, step)

    def save(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        collected = collect_training_state(pl_module.model, trainer.optimizers[0])  # FSDP: every rank gathers
        collected["module"] = pl_module.checkpoint_tensors()
        if trainer.is_global_zero:
            state = {"total_steps": self.total_steps, "run": self.run, "initial_val_loss": pl_module.initial_val_loss,
                     "totals": self.totals(pl_module.history)}
            if pl_module.initial_val_metrics:  # an objective's validation numbers before the first step
                state["initial_val_metrics"] = pl_module.initial_val_metrics
            if pl_module.validation_record is not None:  # --train.eval_interval: best step, early stop
                state["validation"] = pl_module.validation_record.as_json()
            loss_scale = getattr(trainer.precision_plugin, "loss_scale", lambda: None)()
            if loss_scale is not None:  # 16-mixed: the scaler's scale and growth tracker, for an exact resume
                state["loss_scale"] = trainer.precision_plugin.state_dict()
            save_training_state(self.out_dir, step, None, None, state, self.keep_last, collected)
        trainer.strategy.barrier()
        self.last_saved = step


class StopOnSignal(Callback):
    """SIGTERM / SIGINT (`lit_qlora.train.signals`): at the end of the current optimizer step every rank saves a
    checkpoint at that same step and stops; in a validation, the run stops after the current batch. Either way the
    run raises TrainingStopped once the trainer call has returned. `signals` is entered around the whole run
    (finetune.fit); within it, each trainer call gets our handlers back over the SIGTERM handler Lightning sets."""

    def __init__(self, checkpoints: ResumableCheckpoints) -> None:
        self.checkpoints = checkpoints
        self.signals = StopSignals(lambda: resume_advice(checkpoints.out_dir, checkpoints.total_steps))
        self.stopped_at: Optional[int] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.signals.install()  # over Lightning's SIGTERM handler, which would stop without saving

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.signals.install()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Every rank learns of a signal any rank got, so all of them save and stop at the same step.
        received = torch.tensor(float(self.signals.received is not None), device=pl_module.device)
        if trainer.strategy.reduce(received, reduce_op="sum") > 0:
            self.signals.reached_safe_point()
            step = pl_module.step
            if self.checkpoints.last_saved != step:
                self.checkpoints.save(trainer, pl_module, step)
            self.stopped_at = step
            trainer.should_stop = True

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        # Validation changes no state: the newest checkpoint on disk is the run's. No agreement between ranks here
        # (a collective would cost every batch): a rank the signal missed would wait in its next collective until
        # that times out, but Ctrl+C and schedulers signal every process of a job.
        received = self.signals.received
        if received is not None:
            self.signals.reached_safe_point()
            raise StopRequested(f"stopped by {received.name} during validation; "
                                f"{resume_advice(self.checkpoints.out_dir, self.checkpoints.total_steps)}", received)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.stopped_at is not None:
            received = self.signals.received
            name = received.name if received else "a signal on another rank"
            raise StopRequested(
                f"stopped by {name} after optimizer step {self.stopped_at} of {self.checkpoints.total_steps}; the "
                f"checkpoint {step_dir(self.checkpoints.out_dir, self.stopped_at)} holds the run's state. Run the same "
                "command with --resume auto to continue.", received or signal.SIGTERM)


def resume_advice(out_dir: Path, total_steps: int) -> str:
    """What a run stopped now leaves to resume from, read from disk: the newest complete checkpoint and how to go on
    from it, or that there is none yet."""
    newest = latest_checkpoint(out_dir)
    if newest is None:
        return ("no checkpoint exists yet, so nothing of this run is kept: run the same command again to start "
                "it over.")
    step = read_state(newest).get("step")
    return (f"the newest checkpoint, {newest} (optimizer step {step} of {total_steps}), holds the run's state. Run "
            "the same command with --resume auto to continue from it.")


class HeapRelease(Callback):
    """CPU training: hand the heap that freed activations leave behind back to the OS after each block's forward,
    before each backward and after each optimizer step, whenever enough resident free heap has built up
    (`lit_qlora.train.heap.HeapTrimmer`); nothing on GPUs.

    glibc keeps freed blocks below its (dynamic, up to 32 MB) mmap threshold in the heap: on a 1.1B model at 1x512
    (checkpointing on) a QLoRA step left ~0.5 GB of freed activations resident, and the next backward stacked its
    own peak on top. Trimming at every one of those points kept the peak but cost ~1.4 M page faults per SmolLM2
    4x512 step; the budget keeps the working set resident (benchmarks/ab/results/heap_release.md)."""

    def __init__(self, trimmer: Optional[HeapTrimmer] = None) -> None:
        self.trimmer = trimmer or HeapTrimmer()
        self._hooks: list[RemovableHandle] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cpu" and not self._hooks:
            self._hooks = release_heap_around_blocks(pl_module.model, self.trimmer)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if pl_module.device.type == "cpu":
            self.trimmer()  # a validation's temporaries: the first one, before any training step, set a run's peak

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if pl_module.device.type == "cpu":
            self.trimmer()  # the forward's freed temporaries, before backward's peak

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if pl_module.device.type == "cpu":
            self.trimmer()


def release_heap_around_blocks(model: torch.nn.Module, trimmer: Callable[[], Any]) -> list[RemovableHandle]:
    """Offer `trimmer` a release after each block's forward and before its backward (training only).

    glibc serves the blocks' multi-MB temporaries from the heap (its mmap threshold rises to 32 MB) and cannot
    reuse the holes that the longer-lived checkpointed block inputs leave between them, so RSS climbed by ~200 MB
    over a forward and ~300 MB over a backward of a 1.1B model at 1x512 (benchmarks/README.md). The hook runs
    outside any compiled graph (torch.compiler.disable): a compiled block calls its forward hooks, and dynamo
    cannot trace the ctypes calls behind a release."""

    @torch.compiler.disable
    def after_forward(block: torch.nn.Module, args: Any, output: Any) -> None:
        if not (block.training and torch.is_grad_enabled()):
            return
        trimmer()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(before_backward)

    @torch.compiler.disable
    def before_backward(grad: torch.Tensor) -> None:
        trimmer()

    after_forward.training_only = True  # a no-op without gradients: lit_qlora.model.decode_step may skip it
    return [block.register_forward_hook(after_forward) for block in model.blocks]
