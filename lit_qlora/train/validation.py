"""Validation during training (`--train.eval_interval`), the best adapter so far (out_dir/best/) and early stopping
(`--train.early_stopping_patience`).

A validation every N optimizer steps runs inside `trainer.fit`, at the end of a step and before that step's
checkpoint: the checkpoint then records what the validation decided (the best step, the validations since it, an
early stop), and a run resumed from it goes on exactly as the uninterrupted one would have."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lit_qlora.checkpoint.files import atomic_write_text, remove_path, replace_dir
from lit_qlora.checkpoint.adapter import full_lora_state_dict, save_adapter
from lit_qlora.parallel.distributed import reshard
from lit_qlora.train.loggers import jsonl_rows_through, log_scalars
from lit_qlora.train.policy import evaluating

BEST_DIR, BEST_FILE, SAMPLES_FILE = "best", "best.json", "samples.jsonl"
SAMPLE_TOKENS = 48  # a reply's length at most: a glance at what the adapter does, seconds on a CPU


@dataclass
class ValidationRecord:
    """What the validations of a run decided so far; a checkpoint's state.json keeps it as "validation".

    The validation before the first step does not count: it measures the base model (the adapters start at zero),
    which no fine-tune should be judged against."""

    best_step: Optional[int] = None
    best_val_loss: Optional[float] = None
    since_best: int = 0  # validations after the best one that did not improve on it
    stopped_early: Optional[int] = None  # the step early stopping ended training at

    def update(self, step: int, val_loss: float) -> bool:
        """Count a validation after training started; True when it is the best so far (strictly lower)."""
        if self.best_val_loss is None or val_loss < self.best_val_loss:
            self.best_step, self.best_val_loss, self.since_best = step, val_loss, 0
            return True
        self.since_best += 1
        return False

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ValidationRecord:
        return cls(**state.get("validation", {}))

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def validation_loss(trainer: L.Trainer, module: L.LightningModule, loader: Any,
                    after_batch: Callable[[Any, int], None]) -> float:
    """The module's validation loss over `loader`, computed as trainer.validate does (eval mode, no gradients, the
    precision plugin's step context, `validation_step`), from inside a fit. `after_batch(batch, i)` runs after each
    batch (signals, heap release).

    Nothing a training step depends on changes: each module's train/eval mode comes back as it was, and the random
    number generators are restored (an iterator over a DataLoader draws its base seed from torch's generator, which
    dropout then draws from), so a run with validations trains the same steps as one without."""
    devices = [module.device] if module.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad(), evaluating(module):
        try:
            module.on_validation_epoch_start()
            for i, batch in enumerate(loader):
                batch = trainer.strategy.batch_to_device(batch)
                trainer.strategy.validation_step(batch, i)  # DDP: through its wrapper, as Lightning's loop does
                after_batch(batch, i)
            loss = module.reduced_val_loss()
        finally:
            reshard(module.model)  # FSDP2: the root keeps its parameters gathered after a forward
    return loss


class PeriodicValidation(Callback):
    """Every `interval` optimizer steps (the last step excepted: the run's final validation follows it), validate;
    record the loss in metrics.jsonl ({"step": S, "val_loss": L}), TensorBoard (val/loss) and the progress line;
    keep the best adapter in out_dir/best/; with `patience`, stop after that many validations without improvement.

    Runs before StopOnSignal and ResumableCheckpoints: the step's checkpoint records this validation's outcome, and
    a signal during the validation stops the run as in any validation (the newest checkpoint on disk holds the
    run's state). An early stop saves a checkpoint at its step, so a resume knows the run ended there."""

    def __init__(self, out_dir: Path, val_loader: Any, interval: int, patience: Optional[int], total_steps: int,
                 adapter_config: dict[str, Any], record: ValidationRecord, checkpoints: Any,
                 sample_prompt: Optional[SamplePrompt] = None) -> None:
        self.out_dir, self.val_loader, self.interval, self.patience = Path(out_dir), val_loader, interval, patience
        self.total_steps, self.adapter_config, self.record = total_steps, adapter_config, record
        self.checkpoints = checkpoints  # ResumableCheckpoints
        self.sample_prompt = sample_prompt  # a reply to it is logged at each validation

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = pl_module.step
        if step % self.interval or step >= self.total_steps:
            return
        others = [c for c in trainer.callbacks if c is not self]

        def after_batch(val_batch: Any, i: int) -> None:
            # The callbacks that act on validation batches (heap release, stop on a signal) see these too.
            for callback in others:
                callback.on_validation_batch_end(trainer, pl_module, None, val_batch, i)

        pl_module.val_loss = validation_loss(trainer, pl_module, self.val_loader, after_batch)
        for callback in others:
            callback.on_validation_end(trainer, pl_module)  # the progress line "Validation at step S/T: loss L"
        if trainer.is_global_zero:
            log_scalars(trainer.loggers, pl_module.validation_scalars(), step)
        self.record_validation(trainer, pl_module, step, pl_module.val_loss)
        self.log_sample(trainer, pl_module, step)
        if self.patience is not None and self.record.since_best >= self.patience:
            self.record.stopped_early = step
            trainer.should_stop = True
            if self.checkpoints.last_saved != step:
                self.checkpoints.save(trainer, pl_module, step)

    def record_validation(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int, val_loss: float) -> None:
        """A validation after training started: its metrics.jsonl row, and best/ when it is the best so far."""
        write_val_row(self.out_dir, step, val_loss, trainer.is_global_zero, pl_module.val_metrics)
        if self.record.update(step, val_loss):
            adapter = full_lora_state_dict(pl_module.model)  # FSDP: every rank gathers, rank 0 writes
            if trainer.is_global_zero:
                save_best(self.out_dir, pl_module.model, self.adapter_config, adapter, step, val_loss)
            trainer.strategy.barrier()


    def log_sample(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        """The reply to the sample prompt (greedy, SAMPLE_TOKENS at most) with the adapter as trained so far: printed,
        appended to out_dir/samples.jsonl and logged as text to TensorBoard. Every rank generates (FSDP and tensor
        parallelism need all of them for a forward; greedy decoding gives each the same reply), rank 0 logs; the
        random number generators and train/eval modes are restored, as after a validation."""
        if self.sample_prompt is None:
            return
        from lit_qlora.model.sampling import generate

        ids, tokenizer = self.sample_prompt.ids, self.sample_prompt.tokenizer
        model = pl_module.model
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.compiler.set_stance("force_eager"), evaluating(model):
            try:
                reply = tokenizer.decode(list(generate(model, ids, SAMPLE_TOKENS, stop_ids=tokenizer.eos_ids)))
            finally:
                reshard(model)
        if not trainer.is_global_zero:
            return
        pl_module.print(f"Sample at step {step}: {reply.strip()!r}")
        append_sample(self.out_dir, step, tokenizer.decode(ids), reply, self.sample_prompt.text)
        for logger in trainer.loggers:
            if hasattr(logger.experiment, "add_text"):  # TensorBoard
                logger.experiment.add_text("val/sample", reply, global_step=step)


def append_sample(out_dir: Path, step: int, prompt: str, reply: str, text: Optional[str] = None) -> None:
    """samples.jsonl's row: `prompt` as the model read it (the template around it included), `prompt_text` as the
    user wrote it (where there is such a text). A step already there (a resumed run validating it again) is
    written once."""
    path = Path(out_dir) / SAMPLES_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    if any(r["step"] == step and "reply" in r for r in rows):  # (litqlora grpo's training rows have none)
        return
    with open(path, "a") as f:
        row = {"step": step, "prompt": prompt, **({"prompt_text": text} if text is not None else {}), "reply": reply}
        f.write(json.dumps(row) + "\n")


def drop_samples_after(out_dir: Path, step: int) -> None:
    """A resumed run trains the steps after its checkpoint again: their samples go."""
    path = Path(out_dir) / SAMPLES_FILE
    if step and path.is_file():
        atomic_write_text(path, "".join(line + "\n" for line in jsonl_rows_through(path, step)))


class SamplePrompt(NamedTuple):
    ids: list[int]  # what the model reads
    tokenizer: Any
    text: Optional[str]  # what the user wrote (reports show it); None for plain text, whose prompt is its first tokens


def sample_prompt(prompt: Optional[str], dm: Any) -> SamplePrompt:
    """--train.eval_prompt through the chat template (as `litqlora generate` formats a prompt), else the first
    validation row up to its reply: the tokens before its first trained one (plain text trains on every token:
    its first 32 tokens, half of it at most)."""
    from lit_qlora.data.sft import IGNORE_INDEX

    if prompt is not None:
        return SamplePrompt(dm.tokenizer.encode_prompt(prompt), dm.tokenizer, prompt)
    sample = dm.val_set[0]
    trained = (sample.labels != IGNORE_INDEX).nonzero()
    start = int(trained[0]) if len(trained) else len(sample.input_ids)
    ids = sample.input_ids[: start or max(1, min(32, len(sample.input_ids) // 2))].tolist()
    return SamplePrompt(ids, dm.tokenizer, dm.val_prompt_text())


def write_val_row(out_dir: Path, step: int, val_loss: float, global_zero: bool,
                  extra: Optional[dict[str, float]] = None) -> None:
    """metrics.jsonl's row for a validation: {"step": S, "val_loss": L, **extra} (a training row has "loss" instead;
    `extra`: an objective's validation metrics, e.g. eval_rewards/accuracies). A run
    killed after its final validation's row but before final/ validates again when resumed: the step's row is then
    already the file's last, and is not written twice."""
    if not global_zero:
        return
    path = Path(out_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    last = json.loads(lines[-1]) if lines and lines[-1].strip() else {}
    if last.get("step") == step and "val_loss" in last:
        return
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "val_loss": val_loss, **(extra or {})}) + "\n")


def save_best(out_dir: Path, model: torch.nn.Module, adapter_config: dict[str, Any],
              adapter: dict[str, torch.Tensor], step: int, val_loss: float) -> Path:
    """out_dir/best/: the adapter (adapter.safetensors, adapter_config.json, loadable like final/'s) and best.json
    ({"step", "val_loss"}), built beside it and swapped in whole (a kill leaves the previous best/ or the new one)."""
    best = Path(out_dir) / BEST_DIR
    staging = best.with_name(f".{BEST_DIR}.tmp")
    remove_path(staging)
    save_adapter(model, staging, adapter_config, adapter)
    atomic_write_text(staging / BEST_FILE, json.dumps({"step": step, "val_loss": val_loss}, indent=2) + "\n")
    replace_dir(staging, best)
    return best
