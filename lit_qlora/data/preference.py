"""Preference pairs for `litqlora dpo` (DPO, IPO, ORPO): rows holding a prompt, a chosen and a rejected answer, read
from any source `lit_qlora.data.formats` reads, validated, tokenized as two sequences that share the prompt's tokens,
and collated so that both answers of a pair go through one forward.

Row forms, as TRL documents them:
- explicit prompt: `prompt`, `chosen`, `rejected`. Strings (the prompt becomes one user turn, rendered with the prompt
  style like an alpaca instruction; the answers are the assistant's reply), or conversational: `prompt` a list of
  messages, `chosen` and `rejected` lists of messages ending with an assistant message (messages before it, the same
  in both, join the prompt);
- implicit prompt: `chosen` and `rejected` only. Strings (their common start, cut back to a word boundary, is the
  prompt: raw text, no template), or message lists (their common leading messages are the prompt).

Only the final reply and its stop token train (their labels); everything before is masked. Labels are aligned with
`input_ids`, as in `lit_qlora.data.sft`.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from lit_qlora.data.errors import DataError, row_place, unusable_rows
from lit_qlora.data.formats import read_source, rename_columns
from lit_qlora.data.prompts import PromptStyle, Segment, raw_segments
from lit_qlora.data.sft import IGNORE_INDEX, ROLES, Sample, tokenize_segments

PREFERENCE_FORMATS = ("explicit", "implicit")
# What `auto` looks for, in order: the first format whose columns a row has.
DETECT = (("explicit", ("prompt", "chosen", "rejected")), ("implicit", ("chosen", "rejected")))
PAIR_HELP = (
    "A preference row holds `prompt`, `chosen` and `rejected` (explicit prompt), or only `chosen` and `rejected` "
    "(implicit prompt: what both start with). Each is a non-empty string or a list of "
    '{"role": "system" | "user" | "assistant", "content": string} messages, `chosen` and `rejected` both strings or '
    "both lists, each list ending with the assistant's answer and differing from the other only there "
    "(see --data.format; --data.columns renames columns)."
)

Message = dict[str, str]
Side = Union[str, list[Message]]


# ---------------------------------------------------------------------------------------------- rows -> pairs

def pair_format(row: Any) -> Optional[str]:
    """The preference format a row's columns say (the first of DETECT it has), or None."""
    if isinstance(row, dict):
        for name, needs in DETECT:
            if all(column in row for column in needs):
                return name
    return None


def split_text(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen answer, rejected answer) of two texts: the prompt is their character-level common start, cut
    back to its last whitespace so that no word is split; the whitespace starts the answers, as TRL's extract_prompt
    leaves it (a BPE vocabulary spells a word with its leading space)."""
    prefix = os.path.commonprefix([chosen, rejected])
    cut = max((m.start() for m in re.finditer(r"\s+", prefix)), default=0)
    return chosen[:cut], chosen[cut:], rejected[cut:]


def read_side(row: dict, key: str) -> tuple[Optional[Side], list[str]]:
    """A column's value (a string, or a list of {role, content} messages), or None and what is wrong with it."""
    if key not in row:
        return None, [f"missing `{key}`"]
    value = row[key]
    if value is None or (isinstance(value, (str, list)) and not (value.strip() if isinstance(value, str) else value)):
        return None, [f"empty `{key}`"]  # a CSV's empty cell reads as None
    if isinstance(value, str):
        return value, []
    if not isinstance(value, list):
        return None, [f"`{key}` is not a string or a list of messages (a {type(value).__name__})"]
    problems = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            problems.append(f"`{key}` has a message without a string `content`")
        elif m.get("role") not in ROLES:
            problems.append(f"`{key}` has a message with role {m.get('role')!r} (use system, user or assistant)")
    if problems:
        return None, problems
    return [{"role": m["role"], "content": m["content"]} for m in value], []


def _pair(row: Any, fmt: str) -> tuple[Optional[dict], list[str]]:
    """A row as a normalized pair, or None and its problems."""
    if not isinstance(row, dict):
        return None, [f"not a JSON object (a {type(row).__name__})"]
    sides: dict[str, Any] = {}
    problems: list[str] = []
    for key in ("prompt", "chosen", "rejected") if fmt == "explicit" else ("chosen", "rejected"):
        sides[key], found = read_side(row, key)
        problems += found
    if problems:
        return None, problems
    chosen, rejected = sides["chosen"], sides["rejected"]
    if isinstance(chosen, str) != isinstance(rejected, str):
        return None, ["`chosen` and `rejected` are not of one kind (both strings or both lists of messages)"]
    if isinstance(chosen, str) and fmt == "implicit":
        prompt, chosen, rejected = split_text(chosen, rejected)
        if (not chosen.strip() or not rejected.strip()) and chosen.strip() != rejected.strip():
            return None, ["`chosen` and `rejected` have no differing part (one is the other's start: no answer of its "
                          "own after the prompt they share)"]
        return {"prompt_text": prompt, "chosen": chosen, "rejected": rejected}, []
    prompt = sides.get("prompt", [])
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if isinstance(chosen, str):
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}, []
    for key, messages in (("chosen", chosen), ("rejected", rejected)):
        if messages[-1]["role"] != "assistant":
            problems.append(f"`{key}` does not end with an assistant message")
        elif not messages[-1]["content"].strip():
            problems.append(f"`{key}` ends with an empty answer")
    if not problems and chosen[:-1] != rejected[:-1]:
        problems.append("`chosen` and `rejected` differ before their last message (only the final assistant answer "
                        "may differ; what comes before it is the prompt)")
    if problems:
        return None, problems
    return {"prompt": prompt + chosen[:-1], "chosen": chosen[-1]["content"], "rejected": rejected[-1]["content"]}, []


def to_pairs(rows: list, fmt: str, source: str, lines: Optional[list[int]] = None
             ) -> tuple[list[dict], dict[str, int]]:
    """Normalized pairs of `rows` and how many rows of each format there were. `fmt`: "auto" (each row by its
    columns: prompt+chosen+rejected is explicit, chosen+rejected implicit), "explicit" or "implicit".

    A pair is `{"prompt": [messages], "chosen": str, "rejected": str}` (rendered with the prompt style; an explicit
    string prompt is one user message) or `{"prompt_text": str, "chosen": str, "rejected": str}` (implicit string
    rows: raw text, no template). A DataError lists every bad row (1-based, with its JSONL line where that differs);
    pairs whose answers are the same (but for surrounding whitespace) are left out with one warning."""
    if fmt not in ("auto", *PREFERENCE_FORMATS):
        raise DataError(f"Unknown preference format {fmt!r} (--data.format): choose auto, "
                        f"{', '.join(PREFERENCE_FORMATS)}.")
    if not rows:
        raise DataError(f"{source} holds no rows. {PAIR_HELP}")
    formats = [pair_format(row) if fmt == "auto" else fmt for row in rows]
    if not any(formats):
        columns = dict.fromkeys(key for row in rows if isinstance(row, dict) for key in row)
        raise DataError(
            f"Cannot tell the preference format of {source} from its columns ({', '.join(columns) or 'none'}): "
            "lit-qlora reads rows of `prompt`, `chosen` and `rejected` (explicit prompt) or `chosen` and `rejected` "
            "(implicit prompt). Rename columns with --data.columns (e.g. {question: prompt, good: chosen, bad: "
            "rejected}) or name the format with --data.format.")
    pairs, bad = [], {}
    for index, (row, row_fmt) in enumerate(zip(rows, formats)):
        pair, problems = _pair(row, row_fmt or "implicit")  # a row auto cannot place: told what it lacks
        for problem in dict.fromkeys(problems):
            bad.setdefault(problem, []).append(row_place(index, lines))
        pairs.append(pair)
    if bad:
        raise unusable_rows(source, "preference ", bad, PAIR_HELP)
    counts: dict[str, int] = {}
    for row_fmt in formats:
        counts[row_fmt] = counts.get(row_fmt, 0) + 1
    kept = [pair for pair in pairs if pair["chosen"].strip() != pair["rejected"].strip()]
    if not kept:
        raise DataError(f"Every pair in {source} has identical chosen and rejected answers: they carry no preference "
                        "to learn. Make `rejected` the worse answer to each prompt.")
    if len(kept) < len(pairs):
        warnings.warn(f"{source}: {len(pairs) - len(kept)} of {len(pairs)} pairs have identical chosen and rejected "
                      "answers and were left out: they carry no preference.", UserWarning, stacklevel=2)
    return kept, counts


def read_pairs(source: str, subset: Optional[str], split: str, columns: Optional[dict[str, str]], fmt: str
               ) -> list[dict]:
    """The normalized pairs of a file, folder or Hub dataset: read by --data.format (auto: each row by its columns),
    renamed by --data.columns."""
    rows, lines = read_source(source, subset, split)
    rows = rename_columns(rows, columns, source)
    pairs, counts = to_pairs(rows, fmt, source, lines)
    how = "detected from their columns" if fmt == "auto" else "as --data.format says"
    print(f"Data: {source}: {', '.join(f'{n} {name}' for name, n in counts.items())} rows ({how})")
    return pairs


# ---------------------------------------------------------------------------------------------- tokenization

@dataclass
class PairSample:
    chosen: Sample  # labels IGNORE_INDEX on the prompt: only the final answer and its stop token train
    rejected: Sample
    index: int  # the pair's position in its split (cached reference log-probs are looked up by it)
    row: Optional[int] = None  # its row in the split's pairs (they count the pairs left out too)

    @property
    def input_ids(self) -> torch.Tensor:  # code written for SFT samples (the validation sample's prompt) works
        return self.chosen.input_ids

    @property
    def labels(self) -> torch.Tensor:
        return self.chosen.labels

    def __len__(self) -> int:  # the tokens the pair costs
        return len(self.chosen) + len(self.rejected)


def render_pair(pair: dict, style: PromptStyle, tokenizer: Any) -> tuple[list[Segment], list[Segment]]:
    """The segments of prompt + chosen and of prompt + rejected. A messages pair is rendered by the prompt style, and
    every trained segment but the last is masked (earlier assistant turns of the prompt are context); a raw-text pair
    is its prompt (masked) and the answer with the tokenizer's EOS (trained), as prompt/completion rows are."""
    return render_answer(pair, pair["chosen"], style, tokenizer), render_answer(pair, pair["rejected"], style, tokenizer)


def render_answer(row: dict, answer: str, style: PromptStyle, tokenizer: Any) -> list[Segment]:
    """The segments of a row's prompt (`prompt` messages or raw `prompt_text`) and `answer`, only the answer (with
    its stop) trained: what `render_pair` renders for each side, and `litqlora kto` for its one completion."""
    if "prompt_text" in row:
        return raw_segments({"prompt": row["prompt_text"], "completion": answer}, tokenizer)
    segments = style.render({"messages": [*row["prompt"], {"role": "assistant", "content": answer}]})
    last = max(i for i, s in enumerate(segments) if s.train)
    return [Segment(s.text, s.train and i == last) for i, s in enumerate(segments)]


def tokenize_pairs(pairs: Sequence[dict], style: PromptStyle, tokenizer: Any, max_seq_length: int
                   ) -> list[PairSample]:
    """One PairSample per pair. A sequence longer than `max_seq_length` is truncated keeping the start; a pair whose
    prompt alone fills it (chosen or rejected keeps no trained token) is left out. One counted warning for each."""
    samples: list[PairSample] = []
    truncated = dropped = 0
    for row, pair in enumerate(pairs):
        sides, cut = [], 0
        for segments in render_pair(pair, style, tokenizer):
            sample = tokenize_segments(segments, tokenizer)
            if len(sample) > max_seq_length:
                cut += 1
                sample = Sample(sample.input_ids[:max_seq_length], sample.labels[:max_seq_length])
            sides.append(sample)
        if any(bool((s.labels == IGNORE_INDEX).all()) for s in sides):
            dropped += 1
            continue
        truncated += cut
        samples.append(PairSample(sides[0], sides[1], index=len(samples), row=row))
    if pairs and not samples:
        raise DataError(f"Every one of the {len(pairs)} pairs has a prompt of max_seq_length={max_seq_length} tokens "
                        "or more, leaving no answer token to compare. Raise --train.max_seq_length or shorten the "
                        "prompts.")
    if truncated:
        warnings.warn(f"{truncated} of {2 * len(samples)} sequences (a prompt with its chosen or rejected answer) are "
                      f"longer than max_seq_length={max_seq_length} tokens and were truncated (keeping the start). "
                      "Raise --train.max_seq_length or shorten those rows.", UserWarning, stacklevel=2)
    if dropped:
        warnings.warn(f"{dropped} of {len(pairs)} pairs were left out: their prompt fills max_seq_length="
                      f"{max_seq_length} tokens, leaving no token of the chosen or rejected answer. Raise "
                      "--train.max_seq_length or shorten those prompts.", UserWarning, stacklevel=2)
    return samples


def shared_prompt_length(pair: PairSample) -> int:
    """How many leading tokens the pair's two sequences share before either trains: its prompt, computed once."""
    first = [int((s.labels != IGNORE_INDEX).nonzero()[0]) for s in (pair.chosen, pair.rejected)]
    a, b = pair.chosen.input_ids, pair.rejected.input_ids
    n = min(first)
    differs = (a[:n] != b[:n]).nonzero()
    return int(differs[0]) if len(differs) else n


class PairCollate:
    """A batch of B pairs as B rows, each its prompt once, then the chosen answer, then the rejected one: the answers
    are branches of the prompt (prefix sharing). The rejected tokens carry the positions they have after the prompt
    alone, so the attention rule of packed rows (lit_qlora.model.attention_mask: a position that does not increase
    starts a branch, which sees its document's tokens before that position and itself) lets them see the prompt and
    not the chosen answer: each answer is computed exactly as in a sequence of its own, and the prompt once.

    `{"input_ids": [B, T], "positions": [B, T], "index": [B], "src": [N], "tgt": [N], "seq": [N]}` (int64), right
    padded (inputs with `pad_id`, positions 0: each padding token a document of its own). The N trained tokens:
    `tgt` is the token, `src` the flat index (row * T + column) of the hidden state that predicts it, `seq` the
    answer it belongs to: pair i's chosen answer is i, its rejected answer B + i."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, samples: Sequence[PairSample]) -> dict[str, torch.Tensor]:
        rows, src, tgt, seq = [], [], [], []
        for i, pair in enumerate(samples):
            chosen, rejected = pair.chosen, pair.rejected
            shared, n = shared_prompt_length(pair), len(chosen)
            ids = torch.cat([chosen.input_ids, rejected.input_ids[shared:]])
            positions = torch.cat([torch.arange(n), torch.arange(shared, len(rejected))])
            rows.append((ids, positions))
            # where token j of each sequence sits in the row: the chosen one in place, the rejected one after it
            where = (torch.arange(n), torch.cat([torch.arange(shared), n + torch.arange(len(rejected) - shared)]))
            for side, sample in enumerate((chosen, rejected)):
                trained = (sample.labels[1:] != IGNORE_INDEX).nonzero().squeeze(1) + 1
                src.append(where[side][trained - 1])  # a column of row i: made flat below, once T is known
                tgt.append(sample.labels[trained])
                seq.append(torch.full((len(trained),), side * len(samples) + i))
        longest = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), longest), self.pad_id, dtype=torch.long)
        positions = torch.zeros((len(rows), longest), dtype=torch.long)
        for r, (ids, pos) in enumerate(rows):
            input_ids[r, : len(ids)], positions[r, : len(pos)] = ids, pos
        seq_t = torch.cat(seq)
        src_t = (seq_t % len(samples)) * longest + torch.cat(src)
        return {"input_ids": input_ids, "positions": positions, "src": src_t, "tgt": torch.cat(tgt), "seq": seq_t,
                "index": torch.tensor([s.index for s in samples], dtype=torch.long)}
