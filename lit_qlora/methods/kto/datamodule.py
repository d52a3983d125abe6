"""`UnpairedDataModule`: `SFTDataModule`'s sources, splits and training order, with unpaired rows as samples
(lit_qlora.data.unpaired): a micro-batch of B rows is a batch of their sequences and one of their KL partners'."""

from __future__ import annotations

from typing import Any, Optional

from lit_qlora.data.prompts import prompt_text
from lit_qlora.data.unpaired import UnpairedCollate, read_unpaired, tokenize_unpaired
from lit_qlora.train.datamodule import SFTDataModule, pad_id_of


class UnpairedDataModule(SFTDataModule):
    def __init__(self, args: Any, tokenizer: Any, max_seq_length: int, micro_batch_size: int, seed: int) -> None:
        super().__init__(args, tokenizer, max_seq_length, micro_batch_size, seed)
        self.collate = UnpairedCollate(pad_id_of(tokenizer))

    def read(self, source: str, split: str) -> list[dict]:
        rows = read_unpaired(source, self.args.subset, split, self.args.columns)
        self.formats = {**self.formats, "unpaired": self.formats.get("unpaired", 0) + len(rows)}
        return rows

    def tokenize(self, rows: list[dict]) -> list:
        return tokenize_unpaired(rows, self.style, self.tokenizer, self.max_seq_length)

    def val_prompt_text(self) -> Optional[str]:
        """The first kept validation row's prompt as the user wrote it."""
        return prompt_text(self.val_rows[self.val_set[0].row])
