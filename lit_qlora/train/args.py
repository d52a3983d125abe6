"""What `litqlora finetune --lora.* --train.* --data.*` accept, and the step counts that follow from them.

Plain dataclasses, no Lightning: the CLI reads them to build `--help` without importing the training stack."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union


@dataclass
class LoRAArgs:
    r: int = 8
    """Rank of the adapters."""
    alpha: float = 16.0
    """Scale numerator: updates are multiplied by alpha / r (alpha / sqrt(r) with rslora)."""
    dropout: float = 0.05
    """Dropout on the adapters' input."""
    targets: list[str] = field(default_factory=lambda: ["all"])
    """Projections that get adapters: q, k, v, o, gate, up, down, lm_head, or all."""
    rslora: bool = False
    """Rank-stabilized scaling alpha / sqrt(r)."""


@dataclass
class TrainArgs:
    max_steps: Optional[int] = None
    """Optimizer steps to run; default: `epochs` passes over the training split."""
    epochs: int = 1
    """Passes over the training split when max_steps is not set."""
    micro_batch_size: int = 4
    """Samples per forward/backward pass."""
    global_batch_size: int = 16
    """Samples per optimizer step; accumulates global / (micro * devices) micro-batches."""
    max_seq_length: int = 512
    """Samples are truncated to this many tokens."""
    lr: float = 2e-4
    """Peak learning rate (AdamW), reached after warmup, then cosine decay."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    weight_decay: float = 0.0
    """AdamW weight decay on the adapters."""
    max_norm: float = 1.0
    """Gradient clipping (global norm); 0 disables it."""
    save_interval: Optional[int] = None
    """Write a resumable checkpoint every N optimizer steps (and always at the end)."""
    log_interval: int = 1
    """Write metrics every N optimizer steps."""
    activation_checkpointing: Union[bool, int] = False
    """Recompute block activations in backward: true (all blocks), false, or N (the first N blocks)."""
    keep_last: int = 2
    """Resumable checkpoints to keep (older ones are deleted)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss stops the run (naming the step), or skips that batch's update."""

    def accumulation(self, world_size: int) -> int:
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of train.micro_batch_size "
                f"x devices ({self.micro_batch_size} x {world_size} = {per_step})."
            )
        return self.global_batch_size // per_step


def total_steps_for(train: TrainArgs, num_samples: int) -> int:
    if train.max_steps is not None:
        if train.max_steps < 1:
            raise ValueError(f"train.max_steps must be at least 1, got {train.max_steps}.")
        return train.max_steps
    return train.epochs * max(1, num_samples // train.global_batch_size)


@dataclass
class DataArgs:
    json_path: Optional[Path] = None
    """A local dataset: JSON (a list of rows) or JSONL (one row per line). Rows hold `instruction`, optional
    `input` and `output`, or `messages` (role system/user/assistant). Default: the demo set shipped with lit-qlora."""
    hf_dataset: Optional[str] = None
    """A Hugging Face Hub dataset name (its `train` split), instead of json_path; needs network or the local cache."""
    prompt_style: Literal["alpaca", "chatml", "llama3", "chat_template"] = "alpaca"
    """How rows become text: alpaca, chatml, llama3, or chat_template (the checkpoint's own chat template)."""
    val_split: float = 0.1
    """Fraction of rows held out for validation (at least one row when > 0; 0 disables validation)."""
    packing: bool = False
    """Pack several training samples into each max_seq_length sequence (fewer padding tokens)."""
    num_workers: int = 0
    """DataLoader worker processes (0: load in the training process)."""


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings by their option names: {"lora": {"r": 8}} -> {"lora.r": 8}, as `--lora.r 8` sets it."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
