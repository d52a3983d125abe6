"""Supervised fine-tuning samples: read JSON / JSONL rows, validate them, tokenize them with a prompt style into
`input_ids` and `labels`, optionally pack them, and collate batches.

Labels are aligned with `input_ids` (not shifted): the trainer takes loss = CE(logits[:, :-1], labels[:, 1:]),
ignoring -100, i.e. the logits at position t predict token t+1. Labels are -100 on masked (prompt) tokens.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

from lit_qlora.data.errors import DataError, row_place, unusable_rows
from lit_qlora.data.files import FORMAT_HELP, read_rows
from lit_qlora.data.formats import read_source
from lit_qlora.data.prompts import PromptStyle, Segment

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")


# ---------------------------------------------------------------------------------------------- validation

def _row_problems(row: Any) -> list[str]:
    if not isinstance(row, dict):
        return [f"not a JSON object (a {type(row).__name__})"]
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            return ["`messages` is not a non-empty list"]
        problems = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                problems.append("a message without a string `content`")
            elif m.get("role") not in ROLES:
                problems.append(f"a message with role {m.get('role')!r} (use system, user or assistant)")
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
            problems.append("no assistant message (nothing to train on)")
        return problems
    if "text" in row or "prompt" in row or "completion" in row:
        keys = ("text",) if "text" in row else ("prompt", "completion")
        problems = []
        for k in keys:
            value = row.get(k)
            if k not in row:
                problems.append(f"missing `{k}`")
            elif value is None or (isinstance(value, str) and not value.strip()):  # a CSV's empty cell reads as None
                problems.append(f"empty `{k}`")
            elif not isinstance(value, str):
                problems.append(f"`{k}` is not a string")
        return problems
    if "instruction" not in row and "output" not in row:
        return ["neither `instruction`/`output` nor `messages`"]
    problems = []
    for key in ("instruction", "output"):
        if key not in row:
            problems.append(f"missing `{key}`")
        elif not isinstance(row[key], str):
            problems.append(f"`{key}` is not a string")
        elif not row[key].strip():
            problems.append(f"empty `{key}`")
    if row.get("input") is not None and not isinstance(row["input"], str):
        problems.append("`input` is not a string")
    return problems


def _normalize(row: dict) -> dict:
    if "text" in row:
        return {"text": row["text"]}
    if "prompt" in row:
        return {"prompt": row["prompt"], "completion": row["completion"]}
    if "messages" in row:
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]]}
    return {"instruction": row["instruction"], "input": row.get("input") or "", "output": row["output"]}


def validate_rows(rows: Sequence[Any], source: str, lines: Optional[Sequence[int]] = None) -> list[dict]:
    """Normalized rows (`{"instruction", "input", "output"}` or `{"messages"}`), or a DataError listing every
    problem with its 1-based row numbers (and JSONL line where it differs)."""
    if not rows:
        raise DataError(
            f"{source} holds no rows. Point --data.json_path to a JSON file holding a list of rows or a JSONL file "
            f"with one row per line. {FORMAT_HELP}"
        )
    bad: dict[str, list[str]] = {}
    for index, row in enumerate(rows):
        for problem in dict.fromkeys(_row_problems(row)):
            bad.setdefault(problem, []).append(row_place(index, lines))
    if bad:
        raise unusable_rows(source, "", bad, FORMAT_HELP)
    return [_normalize(row) for row in rows]


def load_json_rows(path: Path) -> list[dict]:
    rows, lines = read_rows(path)
    return validate_rows(rows, str(path), lines)


def load_hf_rows(name: str, split: str = "train") -> list[dict]:
    """Rows of a Hugging Face Hub dataset (downloaded and cached by `datasets`), read as `--data.path NAME` reads them
    (lit_qlora.data.formats: one Hub path, one offline error)."""
    rows, _ = read_source(name, None, split)
    return validate_rows(rows, f"Hugging Face dataset {name!r}")


# ---------------------------------------------------------------------------------------------- tokenization

@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [T]
    labels: torch.Tensor  # int64 [T]; IGNORE_INDEX where no loss is taken
    positions: Optional[torch.Tensor] = None
    """int64 [T] for a packed sample: each document's positions, from 0 (lit_qlora.model.attention_mask); None:
    0..T-1."""

    def __len__(self) -> int:
        return len(self.input_ids)


def tokenize_segments(segments: Iterable[Segment], tokenizer: Any) -> Sample:
    """Concatenate the segments' tokens (BOS once at the start when the tokenizer's family expects it), labels
    IGNORE_INDEX on masked segments."""
    ids: list[int] = []
    labels: list[int] = []
    for segment in segments:
        piece = tokenizer.encode(segment.text, bos=None if not ids else False)
        ids += piece
        labels += piece if segment.train else [IGNORE_INDEX] * len(piece)
    return Sample(torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long))


def tokenize_rows(rows: Sequence[dict], style: PromptStyle, tokenizer: Any, max_seq_length: int) -> list[Sample]:
    """One sample per row, truncated to `max_seq_length` tokens keeping the start; warns once (with counts) when
    rows were truncated. A row whose reply is cut away entirely still gives a sample, with every label
    IGNORE_INDEX (a batch of only such samples has no label to average over)."""
    samples, truncated, untrained = [], 0, 0
    for row in rows:
        sample = tokenize_segments(style.render(row), tokenizer)
        if len(sample) > max_seq_length:
            truncated += 1
            sample = Sample(sample.input_ids[:max_seq_length], sample.labels[:max_seq_length])
            untrained += bool((sample.labels == IGNORE_INDEX).all())
        samples.append(sample)
    if truncated:
        warnings.warn(
            f"{truncated} of {len(rows)} samples are longer than max_seq_length={max_seq_length} tokens and were "
            f"truncated (keeping the start); {untrained} of them lost their whole reply and train nothing. Raise "
            "--max_seq_length or shorten those rows.",
            UserWarning,
            stacklevel=2,
        )
    return samples


def pack(samples: Sequence[Sample], max_seq_length: int) -> list[Sample]:
    """Pack samples, in order, into sequences of at most `max_seq_length` tokens. A sample never straddles two
    sequences (next-fit: a sample that does not fit in the current sequence starts a new one), so every trained
    token sees its whole prompt. Packed samples stay isolated documents: each packed sequence carries `positions`
    that restart at 0 at every sample, by which the model attends only within a sample and gives it its own RoPE
    positions, so a sample's loss is what it would be alone. The first label of every packed sample is set to
    IGNORE_INDEX: it would be the target of the previous sample's last token (alone, nothing predicts it either)."""
    packed: list[Sample] = []
    ids: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    length = 0

    def flush() -> None:
        if ids:
            positions = torch.cat([torch.arange(len(piece)) for piece in ids])
            packed.append(Sample(torch.cat(ids), torch.cat(labels), positions))
        ids.clear(), labels.clear()

    for sample in samples:
        if length + len(sample) > max_seq_length:
            flush()
            length = 0
        sample_labels = sample.labels.clone()
        sample_labels[:1] = IGNORE_INDEX
        ids.append(sample.input_ids)
        labels.append(sample_labels)
        length += len(sample)
    flush()
    return packed


class SFTDataset(torch.utils.data.Dataset):
    def __init__(self, samples: Sequence[Sample]) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[index]


class Collate:
    """Right-pad a list of samples to the longest one: `{"input_ids": [B, T], "labels": [B, T]}` (int64), inputs
    padded with `pad_id`, labels with IGNORE_INDEX. When a sample is packed, the batch also holds its `positions`
    [B, T] (an unpacked row's 0..len-1; padding at position 0: each padding token a document of its own, which
    nothing attends to); an unpacked batch has none, and the model runs plain causal attention."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
        longest = max(len(s) for s in samples)
        input_ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
        for row, s in enumerate(samples):
            input_ids[row, : len(s)] = s.input_ids
            labels[row, : len(s)] = s.labels
        batch = {"input_ids": input_ids, "labels": labels}
        if any(s.positions is not None for s in samples):
            batch["positions"] = torch.zeros((len(samples), longest), dtype=torch.long)
            for row, s in enumerate(samples):
                batch["positions"][row, : len(s)] = torch.arange(len(s)) if s.positions is None else s.positions
        return batch
