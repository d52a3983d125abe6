"""`SFTDataModule`: the data of `litqlora finetune` (a local file or folder, a Hub dataset, or the shipped demo set,
in any row format of lit_qlora.data.formats), split into train/validation by seed (or a validation file or split of
its own), batched in the one training order (`lit_qlora.train.sampler`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_qlora.data.errors import DataError
from lit_qlora.data.inference import use_prompt_style
from lit_qlora.data.prompts import get_prompt_style, prompt_text, resolve_prompt_style
from lit_qlora.data.formats import read_source, rename_columns, to_rows
from lit_qlora.data.files import DEMO_DATASET
from lit_qlora.data.sft import Collate, SFTDataset, pack, tokenize_rows, validate_rows
from lit_qlora.train.args import DataArgs, data_source
from lit_qlora.train.sampler import EpochSampler, MicroBatches, StepSampler


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
    loss = CE(logits[:, :-1], labels[:, 1:]) ignoring -100. With packing, training batches also hold
    `positions` (LongTensor[B, T], restarting at 0 at each packed sample: pass them to the model's forward so
    samples stay isolated). Validation is never packed and keeps its order.

    `train_dataloader()` serves a Trainer of your own: micro-batches, epoch by epoch, sharded over the Trainer's
    ranks (pass `use_distributed_sampler=False`: the order is already per rank). `litqlora finetune` reads the
    same order grouped into optimizer steps from `step_dataloader()`."""

    def __init__(self, args: DataArgs, tokenizer: Any, max_seq_length: int, micro_batch_size: int, seed: int) -> None:
        super().__init__()
        if max_seq_length < 2 or micro_batch_size < 1:
            raise DataError(f"max_seq_length must be >= 2 and micro_batch_size >= 1 (got {max_seq_length}, "
                            f"{micro_batch_size}).")
        try:
            data_source(args)
        except ValueError as e:
            raise DataError(str(e)) from None
        self.args, self.tokenizer = args, tokenizer
        self.max_seq_length, self.micro_batch_size, self.seed = max_seq_length, micro_batch_size, seed
        style, self.style_reason = resolve_prompt_style(args.prompt_style, tokenizer)
        if getattr(args, "prompt_style_source", None):  # not the user's flag: train.args.with_init_adapter set it
            self.style_reason = f"from {args.prompt_style_source}"
        self.style = get_prompt_style(style, tokenizer)
        use_prompt_style(tokenizer, style)  # the validation sample is prompted as inference will prompt it
        self.collate = Collate(pad_id_of(tokenizer))
        self.formats: dict[str, int] = {}  # the formats of the rows read, with their counts
        self.train_set: Optional[SFTDataset] = None
        self.val_set: Optional[SFTDataset] = None

    @property
    def source(self) -> str:
        return data_source(self.args) or str(DEMO_DATASET)

    def prepare_data(self) -> None:
        if not Path(self.source).exists():  # a Hub dataset: download it into the cache once (rank 0)
            read_source(self.source, self.args.subset, self.args.split)

    def read(self, source: str, split: str) -> list[dict]:
        """The rows of `source`, read by --data.format (auto: each row by its columns), renamed by --data.columns."""
        rows, lines = read_source(source, self.args.subset, split)
        rows = rename_columns(rows, self.args.columns, source)
        if not rows:
            validate_rows(rows, source, lines)  # says the file holds no rows and what a row looks like
        rows, counts = to_rows(rows, self.args.format, source, lines)
        how = "detected from their columns" if self.args.format == "auto" else "as --data.format says"
        print(f"Data: {source}: {', '.join(f'{n} {fmt}' for fmt, n in counts.items())} rows ({how})")
        self.formats = {**self.formats, **counts}
        return validate_rows(rows, source, lines)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        args = self.args
        print(f"Prompt style: {self.style.name} ({self.style_reason})")
        rows = self.read(self.source, args.split)
        if args.val_path is not None:
            train_rows, val_rows = rows, self.read(args.val_path, "train" if Path(args.val_path).exists() else args.split)
        elif isinstance(args.val_split, str):  # a split of the same dataset
            train_rows, val_rows = rows, self.read(self.source, args.val_split)
        else:
            train_rows, val_rows = split_rows(rows, args.val_split, self.seed)
        train = self.tokenize(train_rows)
        if self.args.packing:
            train = pack(train, self.max_seq_length)
        self.train_set = SFTDataset(train)
        self.val_set = SFTDataset(self.tokenize(val_rows))
        self.val_rows = val_rows

    def samples_per_epoch(self) -> int:
        """What one pass over the training split holds in --train.global_batch_size's unit (samples here)."""
        return len(self._require_setup())

    def val_prompt_text(self) -> Optional[str]:
        """The user's text of the first validation sample's prompt (None for plain text rows)."""
        return prompt_text(self.val_rows[0])

    def tokenize(self, rows: list[dict]) -> list:
        """Samples of validated rows (what `read` returns)."""
        return tokenize_rows(rows, self.style, self.tokenizer, self.max_seq_length)

    def _require_setup(self) -> SFTDataset:
        if self.train_set is None:
            raise RuntimeError("Call SFTDataModule.setup() first.")
        return self.train_set

    def train_dataloader(self) -> DataLoader:
        train_set = self._require_setup()
        trainer = getattr(self, "trainer", None)
        world_size, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = EpochSampler(len(train_set), self.micro_batch_size * world_size, self.seed, rank, world_size)
        return DataLoader(train_set, batch_size=self.micro_batch_size, sampler=sampler, collate_fn=self.collate,
                          num_workers=self.args.num_workers, persistent_workers=self.args.num_workers > 0)

    def step_dataloader(self, global_batch_size: int, start_step: int, total_steps: int, rank: int,
                        world_size: int) -> DataLoader:
        """One item per optimizer step in [start_step, total_steps): the list of this rank's micro-batches of that
        step's global batch (each with its `num_tokens`), what `FinetuneModule.training_step` takes."""
        train_set = self._require_setup()
        sampler = StepSampler(len(train_set), global_batch_size, self.seed, start_step, total_steps, rank,
                              world_size)
        collate = MicroBatches(self.collate, self.micro_batch_size)
        return DataLoader(train_set, batch_sampler=sampler, collate_fn=collate, num_workers=self.args.num_workers)

    def val_dataloader(self) -> DataLoader:
        self._require_setup()
        return DataLoader(self.val_set, batch_size=self.micro_batch_size, shuffle=False, collate_fn=self.collate,
                          num_workers=self.args.num_workers, persistent_workers=self.args.num_workers > 0)

    @property
    def train_lengths(self) -> list[int]:
        """Token count of each training sample (packed sequence when packing), before padding."""
        return [len(s) for s in self._require_setup().samples]

    @property
    def train_token_count(self) -> int:
        """Non-padding tokens in one training epoch."""
        return sum(self.train_lengths)
