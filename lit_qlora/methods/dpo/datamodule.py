"""`PreferenceDataModule`: `SFTDataModule`'s sources, splits and training order, with preference pairs as samples
(lit_qlora.data.preference): a micro-batch of B pairs is one [2B, T] batch, chosen rows first."""

from __future__ import annotations

from typing import Any, Optional

from lit_qlora.data.preference import PairCollate, read_pairs, tokenize_pairs
from lit_qlora.data.prompts import prompt_text
from lit_qlora.train.datamodule import SFTDataModule, pad_id_of


class PreferenceDataModule(SFTDataModule):
    def __init__(self, args: Any, tokenizer: Any, max_seq_length: int, micro_batch_size: int, seed: int) -> None:
        super().__init__(args, tokenizer, max_seq_length, micro_batch_size, seed)
        self.collate = PairCollate(pad_id_of(tokenizer))

    def read(self, source: str, split: str) -> list[dict]:
        pairs = read_pairs(source, self.args.subset, split, self.args.columns, self.args.format)
        self.formats = {**self.formats, "pairs": self.formats.get("pairs", 0) + len(pairs)}
        return pairs

    def tokenize(self, rows: list[dict]) -> list:
        return tokenize_pairs(rows, self.style, self.tokenizer, self.max_seq_length)

    def val_prompt_text(self) -> Optional[str]:
        """The first kept validation pair's prompt as the user wrote it (pairs whose prompt fills max_seq_length are
        left out, so it need not be the first row's)."""
        return prompt_text(self.val_rows[self.val_set[0].row])
