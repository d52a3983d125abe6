"""out_dir/logs: a fine-tune's TensorBoard log (`tensorboard --logdir OUT_DIR/logs`): the scalars of metrics.jsonl
and the validation loss against the run's optimizer step, and the run's settings (hparams.yaml, the HPARAMS tab)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.tensorboard.summary import hparams

from lit_qlora.train.args import flatten

# metrics.jsonl's keys (and the validation loss) -> the tags they have in TensorBoard, grouped into its sections.
TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_sec": "train/tokens_per_sec",
        "tokens": "train/tokens", "peak_memory_bytes": "memory/peak_bytes", "val_loss": "val/loss"}


class RunTensorBoardLogger(TensorBoardLogger):
    """One event file per process: Lightning finalizes its logger at the end of every trainer.validate() and fit(),
    and the writer it closes reopens as a new file at the next scalar (a fine-tune's validate, fit, validate left
    three). Here finalizing only flushes; `close()` ends the run's file.

    A resumed run logs again the steps after its checkpoint: `purge_step` has TensorBoard hide what the interrupted
    run had logged from there on, so each step shows once, as in metrics.jsonl."""

    def __init__(self, out_dir: Path, start_step: int) -> None:
        super().__init__(save_dir=str(out_dir), name="", version="logs", default_hp_metric=False,
                         **({"purge_step": start_step + 1} if start_step else {}))

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if status == "success":
            self.save()
        else:
            super().finalize(status)

    @rank_zero_only
    def close(self) -> None:
        super().finalize("success")

    @rank_zero_only
    def log_settings(self, settings: dict[str, Any]) -> None:
        """The run's settings, keyed by their option names (`seed`, `lora.r`, `train.lr`), to hparams.yaml (rewritten
        by every run, resumes included) and to TensorBoard's HPARAMS tab beside the run's last train and val loss."""
        flat = flatten(settings)
        self.hparams = flat
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        save_hparams_to_yaml(Path(self.log_dir) / self.NAME_HPARAMS_FILE, flat)
        # TensorBoard takes numbers and strings (torch's writer turns booleans into 0/1): the rest goes as JSON text.
        shown = {k: v if isinstance(v, (int, float, str)) and not isinstance(v, bool) else json.dumps(v)
                 for k, v in flat.items()}
        writer = self.experiment._get_file_writer()  # as Lightning's log_hyperparams does: the same event file
        for summary in hparams(shown, dict.fromkeys((TAGS["loss"], TAGS["val_loss"]), 0.0)):
            writer.add_summary(summary)
        self.experiment.flush()

