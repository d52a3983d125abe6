"""Unpaired feedback for `litqlora kto`: rows of a prompt, one completion and a boolean label (desirable or not), as
TRL's KTOTrainer reads them, so thumbs-up/down logs train directly. Read from any source `lit_qlora.data.formats`
reads, validated, tokenized, and collated with the mismatched pairs of KTO's KL estimate.

Row forms, as TRL documents them:
- `prompt`, `completion`, `label`: strings (the prompt becomes one user turn in the prompt style, the completion the
  assistant's reply), or conversational: `prompt` a list of messages, `completion` a list ending with the assistant's
  message; `label` true (desirable) or false (undesirable); a CSV's "true"/"false" and 1/0 read as such.
- preference pairs (`chosen` and `rejected`, with or without `prompt`): each pair becomes two rows, its chosen answer
  desirable and its rejected one undesirable, as TRL's `maybe_unpair_preference_dataset` does.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from lit_qlora.data.errors import DataError, row_place, unusable_rows
from lit_qlora.data.formats import read_source, rename_columns
from lit_qlora.data.preference import read_side, render_answer, to_pairs
from lit_qlora.data.prompts import PromptStyle
from lit_qlora.data.sft import IGNORE_INDEX, Sample, tokenize_segments

ROW_HELP = ("An unpaired row holds `prompt`, `completion` and a boolean `label` (true: desirable, false: undesirable); "
            "`prompt` a non-empty string or a list of {\"role\", \"content\"} messages, `completion` a string or a list "
            "ending with the assistant's message. Preference pairs (`chosen`, `rejected`) are read as two rows each "
            "(--data.columns renames columns).")
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


def label_of(value: Any) -> Optional[bool]:
    """A row's `label` as a bool (true/false, 1/0, and those spellings as strings), or None."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
        return value.strip().lower() in TRUE
    return None


def unpaired_row(row: Any) -> tuple[Optional[dict], list[str]]:
    """A `prompt`/`completion`/`label` row normalized (as a pair with one side: `{"prompt": [messages], "completion":
    str, "label": bool}`), or None and its problems."""
    if not isinstance(row, dict):
        return None, [f"not a JSON object (a {type(row).__name__})"]
    prompt, problems = read_side(row, "prompt")
    completion, found = read_side(row, "completion")
    problems += found
    label = label_of(row.get("label"))
    if label is None:
        problems.append("`label` is missing or not true/false" if "label" in row else "missing `label`")
    if isinstance(completion, list):
        if completion[-1]["role"] != "assistant" or not completion[-1]["content"].strip():
            problems.append("`completion` does not end with a non-empty assistant message")
        else:
            prompt = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt or []) + completion[:-1]
            completion = completion[-1]["content"]
    if problems:
        return None, problems
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return {"prompt": prompt, "completion": completion, "label": label}, []


def to_unpaired(rows: list, source: str, lines: Optional[list[int]] = None) -> list[dict]:
    """The normalized rows of `rows`: `prompt`/`completion`/`label` rows as they are, preference pairs as two rows.
    A DataError lists every bad row (1-based, with its line where that differs)."""
    if not rows:
        raise DataError(f"{source} holds no rows. {ROW_HELP}")
    if all(isinstance(r, dict) and "chosen" in r and "rejected" in r for r in rows):
        pairs, _ = to_pairs(rows, "auto", source, lines)
        out = []
        for pair in pairs:
            for side, label in (("chosen", True), ("rejected", False)):
                out.append({**{k: v for k, v in pair.items() if k not in ("chosen", "rejected")},
                            "completion": pair[side], "label": label})
        return out
    out, bad = [], {}
    for index, row in enumerate(rows):
        normalized, problems = unpaired_row(row)
        for problem in dict.fromkeys(problems):
            bad.setdefault(problem, []).append(row_place(index, lines))
        out.append(normalized)
    if bad:
        raise unusable_rows(source, "unpaired ", bad, ROW_HELP)
    return out


def read_unpaired(source: str, subset: Optional[str], split: str, columns: Optional[dict[str, str]]) -> list[dict]:
    """The normalized rows of a file, folder or Hub dataset, renamed by --data.columns."""
    rows, lines = read_source(source, subset, split)
    out = to_unpaired(rename_columns(rows, columns, source), source, lines)
    good = sum(r["label"] for r in out)
    print(f"Data: {source}: {len(out)} rows, {good} desirable and {len(out) - good} undesirable")
    if good == 0 or good == len(out):
        warnings.warn(f"{source}: every row is {'desirable' if good else 'undesirable'}: KTO learns from both kinds "
                      "(TRL advises between 1:1 and 4:3 desirable to undesirable; --kto.desirable_weight and "
                      "undesirable_weight balance an uneven mix).", UserWarning, stacklevel=2)
    return out


# ---------------------------------------------------------------------------------------------- tokenization

@dataclass
class UnpairedSample:
    prompt: torch.Tensor  # int64 [P]: the prompt's tokens (never trained)
    completion: torch.Tensor  # int64 [C]: the completion and its stop token
    trained: torch.Tensor  # bool [C]: which completion tokens are scored
    label: bool
    index: int  # its position in its split
    row: Optional[int] = None  # its row in the split's rows

    @property
    def input_ids(self) -> torch.Tensor:  # code written for SFT samples (the validation sample's prompt) works
        return torch.cat([self.prompt, self.completion])

    @property
    def labels(self) -> torch.Tensor:
        labels = torch.full((len(self.prompt) + len(self.completion),), IGNORE_INDEX, dtype=torch.long)
        labels[len(self.prompt):][self.trained] = self.completion[self.trained]
        return labels

    def __len__(self) -> int:  # the tokens it costs, its KL row's aside
        return len(self.prompt) + len(self.completion)


def tokenize_unpaired(rows: Sequence[dict], style: PromptStyle, tokenizer: Any, max_seq_length: int
                      ) -> list[UnpairedSample]:
    """One sample per row: the rendered prompt (masked) and completion (trained), truncated to `max_seq_length`
    keeping the start; a row whose prompt alone fills it is left out (one counted warning each)."""
    samples, truncated, dropped = [], 0, 0
    for row_number, row in enumerate(rows):
        sample = tokenize_segments(render_answer(row, row["completion"], style, tokenizer), tokenizer)
        if len(sample) > max_seq_length:
            truncated += 1
            sample = Sample(sample.input_ids[:max_seq_length], sample.labels[:max_seq_length])
        scored = (sample.labels != IGNORE_INDEX).nonzero()
        if len(scored) == 0 or int(scored[0]) == 0:
            dropped += 1
            continue
        start = int(scored[0])
        samples.append(UnpairedSample(sample.input_ids[:start], sample.input_ids[start:],
                                      sample.labels[start:] != IGNORE_INDEX, bool(row["label"]), len(samples),
                                      row_number))
    if rows and not samples:
        raise DataError(f"Every one of the {len(rows)} rows has a prompt of max_seq_length={max_seq_length} tokens or "
                        "more, leaving no completion token to score. Raise --train.max_seq_length or shorten the "
                        "prompts.")
    if truncated:
        warnings.warn(f"{truncated} of {len(rows)} rows are longer than max_seq_length={max_seq_length} tokens and "
                      "were truncated (keeping the start).", UserWarning, stacklevel=2)
    if dropped:
        warnings.warn(f"{dropped} of {len(rows)} rows were left out: their prompt fills max_seq_length="
                      f"{max_seq_length} tokens.", UserWarning, stacklevel=2)
    return samples


def kl_partner(i: int, n: int) -> int:
    """The row whose completion row i's KL sequence takes (TRL's: the previous one in the batch, the last for the
    first), so that no prompt is paired with its own completion when n > 1."""
    return (i - 1) % n


class UnpairedCollate:
    """A batch of B samples as two right-padded batches of B rows each: `rows` (each prompt with its completion,
    scored) and `kl` (each prompt with another row's completion: `kl_partner`, the mismatched pairs of KTO's KL
    estimate). Each: `{"input_ids": [B, T], "src": [N], "tgt": [N], "seq": [N], "index": [B]}` as PairCollate
    lays trained tokens out (`seq` the row); `rows` adds `label` [B] (bool)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def batch(self, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], index: torch.Tensor
              ) -> dict[str, torch.Tensor]:
        longest = max(len(p) + len(c) for p, c, _ in parts)
        input_ids = torch.full((len(parts), longest), self.pad_id, dtype=torch.long)
        src, tgt, seq = [], [], []
        for r, (prompt, completion, trained) in enumerate(parts):
            ids = torch.cat([prompt, completion])
            input_ids[r, : len(ids)] = ids
            where = len(prompt) + trained.nonzero().squeeze(1)  # the scored tokens' columns
            src.append(r * longest + where - 1)  # the hidden state before each predicts it
            tgt.append(ids[where])
            seq.append(torch.full((len(where),), r))
        return {"input_ids": input_ids, "positions": None, "src": torch.cat(src), "tgt": torch.cat(tgt),
                "seq": torch.cat(seq), "index": index}

    def __call__(self, samples: Sequence[UnpairedSample]) -> dict[str, Any]:
        index = torch.tensor([s.index for s in samples], dtype=torch.long)
        n = len(samples)
        rows = self.batch([(s.prompt, s.completion, s.trained) for s in samples], index)
        kl = self.batch([(s.prompt, samples[kl_partner(i, n)].completion, samples[kl_partner(i, n)].trained)
                         for i, s in enumerate(samples)], index)
        rows["label"] = torch.tensor([s.label for s in samples], dtype=torch.bool)
        return {**rows, "kl": kl}
