"""What `litqlora finetune` shows while it trains: one progress display of optimizer steps (always this one, whatever
is installed), and none of Lightning's status lines."""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from typing import Any, Optional, TextIO

import lightning as L
from lightning.pytorch.callbacks.progress import ProgressBar
from tqdm import tqdm

# `{postfix}` is the last step's loss and tokens/s; tqdm computes the rate, and so the time left, from the steps of
# this process only (`initial`: the steps before a resume).
BAR_FORMAT = "Training {n_fmt}/{total_fmt} steps |{bar}| {elapsed}<{remaining}{postfix}"
LINE_FORMAT = "Training {n_fmt}/{total_fmt} steps, {elapsed}<{remaining}{postfix}"
FALLBACK_COLUMNS = 80


class StepProgressBar(ProgressBar):
    """Optimizer steps done / total (counting those before a resume), the last step's loss and tokens/s, and the time
    left, on stderr. A terminal gets a tqdm bar redrawn in place; anything else (a file, CI) one line every
    `log_interval` steps and at the last, so a log is not flooded with redraws. Each validation ends with one line,
    its loss and the step it ran at; on a terminal a transient bar counts its batches meanwhile.

    Given to the Trainer so that it adds no bar of its own: Lightning picks RichProgressBar whenever `rich` is
    installed, TQDMProgressBar otherwise, and the look of a run would depend on what else is in the environment."""

    def __init__(self, log_interval: int, stream: Optional[TextIO] = None) -> None:
        super().__init__()
        self.log_interval = log_interval
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self._enabled = True
        self._train: Optional[tqdm] = None
        self._val: Optional[tqdm] = None
        self._started, self._initial = 0.0, 0

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def disable(self) -> None:  # Lightning: ranks other than 0, and tuning runs
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def print(self, *args: Any, sep: str = " ", end: str = "\n") -> None:
        """A line above the bar (LightningModule.print comes here while the bar is enabled)."""
        tqdm.write(sep.join(map(str, args)), file=self.stream, end=end)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started, self._initial = time.perf_counter(), pl_module.step
        if self._enabled and self.interactive:
            self._train = tqdm(total=pl_module.total_steps, initial=self._initial, file=self.stream,
                               bar_format=BAR_FORMAT, **self._width())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step, row = pl_module.step, pl_module.history[-1]
        loss = "skipped" if row["loss"] is None else f"{row['loss']:.4f}"
        postfix = f"loss {loss}, {row['tokens_per_sec']:,.0f} tokens/s"
        if self._train is not None:
            self._train.set_postfix_str(postfix, refresh=False)
            self._train.update(step - self._train.n)
        elif self._enabled and (step % self.log_interval == 0 or step == pl_module.total_steps):
            self.print(tqdm.format_meter(step, pl_module.total_steps, time.perf_counter() - self._started,
                                         initial=self._initial, bar_format=LINE_FORMAT, postfix=postfix))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._enabled and self.interactive:
            self._val = tqdm(total=sum(trainer.num_val_batches), desc="Validation", unit="batch", leave=False,
                             file=self.stream, **self._width())

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._val is not None:
            self._val.update(1)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._val is not None:
            self._val.close()
            self._val = None
        if self._enabled:
            self.print(f"Validation at step {pl_module.step}/{pl_module.total_steps}: loss {pl_module.val_loss:.4f}")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close()  # the error's message starts on a line of its own

    def _width(self) -> dict[str, Any]:
        """tqdm's width: the terminal's, followed as it changes; 80 columns where the terminal reports no size (a
        0x0 pty, as `script` or an IDE console can give), where tqdm would draw nothing at all."""
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):  # (not a real file descriptor: tqdm asks nothing of it either)
            return {"dynamic_ncols": True}
        return {"dynamic_ncols": True} if columns > 0 else {"ncols": FALLBACK_COLUMNS}

    def _close(self) -> None:
        for bar in (self._val, self._train):
            if bar is not None:
                bar.close()
        self._train = self._val = None


# Lightning's lines on a normal run that tell a user nothing: the devices it did not use, that fit() "stopped" because
# the data of the run's steps (one epoch, by design) ran out, and an advertisement for a cloud logger.
LIGHTNING_STATUS = ("GPU available:", "TPU available:", "LOCAL_RANK:", "`Trainer.fit` stopped:", "💡 Tip:")

# Lightning's warnings that a user of `litqlora finetune` can do nothing about: its own use of a deprecated pytree
# API; the validation_step that runs only through trainer.validate (fit gets no val loader on purpose); and advice
# to lower `log_every_n_steps` when a run has fewer steps than --train.log_interval (metrics.jsonl gets no row).
LIGHTNING_WARNINGS = (r".*LeafSpec", r"You defined a `validation_step` but have no `val_dataloader`",
                      r"The number of training batches \(\d+\) is smaller than the logging interval")


def _not_status(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(LIGHTNING_STATUS)


def quiet_lightning() -> None:
    """Drop Lightning's LIGHTNING_STATUS lines and LIGHTNING_WARNINGS (for the rest of the process)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.pytorch.accelerators.cuda"):
        logger = logging.getLogger(name)
        if _not_status not in logger.filters:
            logger.addFilter(_not_status)
    for message in LIGHTNING_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
