"""`SFTDataModule`: the data of `litqlora finetune` (local JSON/JSONL, a Hub dataset, or the shipped demo set),
split into train/validation by seed, batched in a resumable order."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_qlora.data.errors import DataError
from lit_qlora.data.prompts import get_prompt_style
from lit_qlora.data.sampler import ResumableSampler
from lit_qlora.data.sft import (
    DEMO_DATASET, Collate, SFTDataset, load_hf_rows, load_json_rows, pack, tokenize_rows,
)


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


def split_rows(rows: list, val_split: float, seed: int) -> tuple[list, list]:
    """Deterministic shuffle by `seed`, then the first round(n * val_split) rows (at least 1) are validation."""
    if not 0 <= val_split < 1:
        raise DataError(f"--data.val_split must be in [0, 1); got {val_split}.")
    n_val = max(1, round(len(rows) * val_split)) if val_split > 0 else 0
    if n_val >= len(rows):
        raise DataError(
            f"The dataset has {len(rows)} row(s): too few to hold out {n_val} for validation and still train. Add "
            "rows or set --data.val_split 0."
        )
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [rows[i] for i in order[n_val:]], [rows[i] for i in order[:n_val]]


def pad_id_of(tokenizer: Any) -> int:
    for value in (getattr(tokenizer, "pad_id", None), tokenizer.eos_id):
        if value is not None:
            return int(value)
    return 0


class SFTDataModule(L.LightningDataModule):
    """Batches are `{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}`, right-padded to the batch's
    longest sample (inputs with the pad/EOS id, labels with -100). Labels are aligned with inputs:
    loss = CE(logits[:, :-1], labels[:, 1:]) ignoring -100. Validation is never packed and keeps its order."""

    def __init__(self, args: DataArgs, tokenizer: Any, max_seq_length: int, micro_batch_size: int, seed: int) -> None:
        super().__init__()
        if max_seq_length < 2 or micro_batch_size < 1:
            raise DataError(f"max_seq_length must be >= 2 and micro_batch_size >= 1 (got {max_seq_length}, "
                            f"{micro_batch_size}).")
        if args.json_path is not None and args.hf_dataset is not None:
            raise DataError("Pass either --data.json_path or --data.hf_dataset, not both.")
        self.args, self.tokenizer = args, tokenizer
        self.max_seq_length, self.micro_batch_size, self.seed = max_seq_length, micro_batch_size, seed
        self.style = get_prompt_style(args.prompt_style, tokenizer)
        self.collate = Collate(pad_id_of(tokenizer))
        self.train_set: Optional[SFTDataset] = None
        self.val_set: Optional[SFTDataset] = None
        self.position = (0, 0)  # (epoch, micro-batches done in it) for the next train_dataloader()
        self.num_replicas, self.rank = 1, 0
        self._sampler: Optional[ResumableSampler] = None
        self._expected: dict[str, Any] = {}

    @property
    def source(self) -> str:
        return self.args.hf_dataset or str(self.args.json_path or DEMO_DATASET)

    def prepare_data(self) -> None:
        if self.args.hf_dataset:  # download into the datasets cache once (rank 0), setup() reads it
            load_hf_rows(self.args.hf_dataset)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        if self.args.hf_dataset:
            rows = load_hf_rows(self.args.hf_dataset)
        else:
            rows = load_json_rows(self.args.json_path or DEMO_DATASET)
        train_rows, val_rows = split_rows(rows, self.args.val_split, self.seed)
        train = tokenize_rows(train_rows, self.style, self.tokenizer, self.max_seq_length)
        if self.args.packing:
            train = pack(train, self.max_seq_length)
        self.train_set = SFTDataset(train)
        self.val_set = SFTDataset(tokenize_rows(val_rows, self.style, self.tokenizer, self.max_seq_length))
        self._check_resume(self._expected)

    # ------------------------------------------------------------------------------------------ loaders

    def set_distributed(self, num_replicas: int, rank: int) -> None:
        """Shard training batches over `num_replicas` processes (when no Lightning Trainer is attached to say so)."""
        self.num_replicas, self.rank = num_replicas, rank

    def _world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (self.num_replicas, self.rank)

    def _require_setup(self) -> SFTDataset:
        if self.train_set is None:
            raise RuntimeError("Call SFTDataModule.setup() first.")
        return self.train_set

    def train_dataloader(self) -> DataLoader:
        train_set = self._require_setup()
        num_replicas, rank = self._world()
        self._sampler = ResumableSampler(len(train_set), self.micro_batch_size, self.seed, shuffle=True,
                                         num_replicas=num_replicas, rank=rank)
        self._sampler.set_position(*self.position)
        return self._loader(train_set, self._sampler)

    def val_dataloader(self) -> DataLoader:
        self._require_setup()
        return self._loader(self.val_set, None)

    def _loader(self, dataset: SFTDataset, sampler: Optional[ResumableSampler]) -> DataLoader:
        return DataLoader(dataset, batch_size=self.micro_batch_size, sampler=sampler, shuffle=False,
                          collate_fn=self.collate, num_workers=self.args.num_workers,
                          persistent_workers=self.args.num_workers > 0)

    # ------------------------------------------------------------------------------------------ sizes

    @property
    def num_train_batches(self) -> int:
        """Micro-batches in one full training epoch (per process)."""
        num_replicas, _ = self._world()
        return math.ceil(math.ceil(len(self._require_setup()) / num_replicas) / self.micro_batch_size)

    @property
    def train_lengths(self) -> list[int]:
        """Token count of each training sample (packed sequence when packing), before padding."""
        return [len(s) for s in self._require_setup().samples]

    @property
    def train_token_count(self) -> int:
        """Non-padding tokens in one training epoch."""
        return sum(self.train_lengths)

    # ------------------------------------------------------------------------------------------ resuming

    def position_of(self, micro_batches_seen: int) -> tuple[int, int]:
        """(epoch, batches_done) after `micro_batches_seen` micro-batches since the start of training."""
        return divmod(micro_batches_seen, self.num_train_batches)

    def set_position(self, epoch: int, batches_done: int) -> None:
        """Make the next train_dataloader() start at micro-batch `batches_done` of `epoch` (its order is fixed by
        the seed and the epoch), as an uninterrupted run would continue."""
        if epoch < 0 or batches_done < 0:
            raise ValueError(f"epoch and batches_done must be >= 0 (got {epoch}, {batches_done})")
        self.position = (epoch, batches_done)
        if self._sampler is not None:
            self._sampler.set_position(epoch, batches_done)

    def _fingerprint(self) -> dict[str, Any]:
        return {"seed": self.seed, "micro_batch_size": self.micro_batch_size,
                "num_train_samples": len(self.train_set) if self.train_set is not None else None}

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able position: {"epoch", "batches_done", "seed", "micro_batch_size", "num_train_samples"}."""
        epoch, batches_done = self.position
        return {"epoch": epoch, "batches_done": batches_done, **self._fingerprint()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a position from state_dict(); refuses a different seed, micro-batch size or training set."""
        self._expected = {k: state_dict[k] for k in ("seed", "micro_batch_size", "num_train_samples")
                          if state_dict.get(k) is not None}
        self._check_resume(self._expected)
        self.set_position(int(state_dict["epoch"]), int(state_dict["batches_done"]))

    def _check_resume(self, expected: dict[str, Any]) -> None:
        current = self._fingerprint()
        diff = {k: (v, current[k]) for k, v in expected.items() if current[k] is not None and current[k] != v}
        if diff:
            what = ", ".join(f"{k} was {old}, is {new}" for k, (old, new) in diff.items())
            raise DataError(
                f"Cannot resume the data order exactly: {what}. Resume with the same data, seed, micro_batch_size, "
                "max_seq_length, val_split and packing as the checkpoint, or start a new run."
            )
