"""Will a run's files fit on its disk? Checked before training, so that a run does not train for hours and then die
writing its exports: a merged 8B model alone is 16 GB (an H200 run hit `No space left on device` there).

What a run writes into out_dir, asked of the exporters' own size functions on the base's shapes on the meta device
(no weights read):
- final/: the adapter, merged/ (the base with the adapter merged, bf16; `--export.merged false` skips it), peft/
  (the adapter again, in PEFT's format; `--export.peft false`) and, with `--export.gguf TYPE`, the GGUF file;
- checkpoints/: up to `--train.keep_last` resumable checkpoints and the one being written, each the adapter and
  AdamW's two moments; best/ (with `--train.eval_interval`), the best adapter.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lit_qlora.base.errors import UserError

MARGIN = 1.02
"""Headroom over the sizes computed: tokenizer files, JSON, TensorBoard logs, GGUF metadata, filesystem blocks."""


class DiskSpaceError(UserError):
    """Not enough free disk space for what the run will write."""


@dataclass
class OutputSizes:
    """Bytes each part of a run's output takes on disk."""

    merged: int
    gguf: int
    peft: int
    adapters: int  # final/'s adapter, best/ and the resumable checkpoints

    @property
    def total(self) -> int:
        return int((self.merged + self.gguf + self.peft + self.adapters) * MARGIN)

    def parts(self) -> str:
        named = (("the merged bf16 model in final/merged", self.merged), ("the GGUF file", self.gguf),
                 ("the PEFT adapter", self.peft), ("the adapter and resumable checkpoints", self.adapters))
        return ", ".join(f"{name} {size_text(size)}" for name, size in named if size)


def size_text(nbytes: float) -> str:
    """Decimal units, as `df -H` and disk vendors count: 16.1 GB, 340 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def output_sizes(checkpoint_dir: Path, lora, train, export, lora_bytes: int) -> OutputSizes:
    """What a run with these settings writes (module doc), asked of the exporters themselves on the base's shapes (a
    meta-device model: no weights read). `lora`, `train`, `export`: the run's LoRAArgs, TrainArgs and ExportArgs;
    `lora_bytes`: bytes per adapter value (its dtype's size)."""
    import torch

    from lit_qlora.export.hf import merged_bytes, peft_bytes
    from lit_qlora.export.gguf import gguf_data_bytes
    from lit_qlora.lora.layer import apply_lora, lora_modules
    from lit_qlora.model.config import Config
    from lit_qlora.model.transformer import Transformer

    dtype = {2: torch.bfloat16, 4: torch.float32}[lora_bytes]  # (fp16 adapters take bf16's bytes)
    with torch.device("meta"):
        model = apply_lora(Transformer(Config.from_checkpoint(checkpoint_dir)), lora.r, lora.alpha,
                           targets=lora.targets, rslora=lora.rslora, dtype=dtype)
    adapter = sum(m.lora_A.numel() + m.lora_B.numel() for m in lora_modules(model).values()) * lora_bytes
    checkpoints = (train.keep_last or 0) + 1  # the ones kept and the next, written before the oldest goes
    copies = 1 + checkpoints * 3 + (train.eval_interval is not None)  # final/, (adapter + 2 AdamW moments) each, best/
    return OutputSizes(merged=merged_bytes(model, torch.bfloat16) if export.merged else 0,
                       gguf=gguf_data_bytes(model, export.gguf) if export.gguf else 0,
                       peft=peft_bytes(model, lora.alpha, lora.rslora) if export.peft else 0,
                       adapters=adapter * copies)


def free_bytes(path: Path) -> tuple[Path, int]:
    """(the nearest existing folder of `path`, the bytes free on its filesystem)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path, shutil.disk_usage(path).free


def require_disk_space(out_dir: Path, sizes: OutputSizes, free: Optional[int] = None) -> None:
    """Refuse (DiskSpaceError, naming the sizes and the switches) a run whose outputs do not fit the free space."""
    where, available = free_bytes(out_dir)
    available = available if free is None else free
    if sizes.total <= available:
        return
    skip = (" The merged model is the largest part: --export.merged false skips it (the adapter and PEFT adapter are "
            "still written, and `litqlora merge` builds the merged model later, anywhere with the space)."
            if sizes.merged else "")
    raise DiskSpaceError(
        f"Not enough free disk space for this run's outputs in {out_dir}: it will write about "
        f"{size_text(sizes.total)} ({sizes.parts()}), and {where} has {size_text(available)} free. Free some space "
        f"or choose an --out_dir on a larger disk.{skip} Nothing was trained or written.")
