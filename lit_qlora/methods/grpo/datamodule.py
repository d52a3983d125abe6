"""`GRPODataModule`: prompts (with the columns the reward functions read) as samples, in `SFTDataModule`'s sources,
splits and training order. A step's item is the list of this rank's prompts; the module samples their completions.

A row is `{"prompt": str | [messages], **columns}` as TRL's GRPO datasets hold them: a string prompt is raw text
(TRL's standard rows), a list of messages goes through the prompt style and ends where the reply starts."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader

from lit_qlora.data.errors import DataError
from lit_qlora.data.formats import read_source, rename_columns
from lit_qlora.data.prompts import prompt_text
from lit_qlora.data.sft import IGNORE_INDEX
from lit_qlora.train.datamodule import SFTDataModule
from lit_qlora.train.sampler import StepSampler

ROW_HELP = ("A GRPO row holds a `prompt` (a string, or a list of {role, content} chat messages) and the columns your "
            "reward functions read, e.g. {\"prompt\": [{\"role\": \"user\", \"content\": \"2 + 3?\"}], \"answer\": \"5\"}; "
            "rename columns with --data.columns, e.g. {question: prompt}.")


@dataclass
class PromptSample:
    """A prompt as the model reads it, and the row it came from (its columns go to the reward functions)."""

    input_ids: torch.Tensor  # int64 [P]
    row: dict[str, Any]
    number: int  # where the row is in its source: its line in a JSONL file, else its 1-based place (for messages)

    @property
    def labels(self) -> torch.Tensor:  # code written for SFT samples (the validation sample's prompt) works
        return torch.full_like(self.input_ids, IGNORE_INDEX)

    def __len__(self) -> int:
        return len(self.input_ids)


def prompt_problem(row: Any) -> Optional[str]:
    """What makes a row unusable as a GRPO prompt, or None."""
    if not isinstance(row, dict):
        return "not an object"
    prompt = row.get("prompt")
    if prompt is None:
        return "no `prompt` column"
    if isinstance(prompt, str):
        return None if prompt.strip() else "empty `prompt`"
    if not isinstance(prompt, list) or not prompt:
        return "`prompt` is neither a string nor a list of messages"
    if any(not isinstance(m, dict) or not isinstance(m.get("content"), str) or
           m.get("role") not in ("system", "user", "assistant") for m in prompt):
        return "`prompt` has a message that is not {role: system|user|assistant, content: str}"
    if prompt[-1]["role"] == "assistant":
        return "`prompt` ends with an assistant message (the completion is what is sampled)"
    return None


def collate_prompts(samples: list[PromptSample]) -> dict[str, Any]:
    """A validation batch: its prompts stay a list (each is sampled on its own)."""
    return {"prompts": list(samples)}


def step_item(samples: list[PromptSample]) -> list[dict[str, Any]]:
    """A step's item, as `FinetuneModule.training_step` takes it: one "micro-batch" of this rank's prompts (the
    module splits the completions it samples into micro-batches, and sets num_tokens once it knows them)."""
    return [{"prompts": list(samples), "num_tokens": 0}]


class GRPODataModule(SFTDataModule):
    """`num_generations` completions per prompt: a global batch of completions is global / num_generations prompts.
    `max_completion_length`: prompts that leave less than it within max_seq_length are left out (warned)."""

    def __init__(self, args: Any, tokenizer: Any, max_seq_length: int, micro_batch_size: int, seed: int, *,
                 num_generations: int, max_completion_length: int, num_iterations: int = 1) -> None:
        super().__init__(args, tokenizer, max_seq_length, micro_batch_size, seed)
        self.num_generations, self.max_completion_length = num_generations, max_completion_length
        self.num_iterations = num_iterations
        self.collate = collate_prompts
        self.places: dict[int, int] = {}  # id(row) -> its line (JSONL) or 1-based place in its source

    def read(self, source: str, split: str) -> list[dict]:
        rows, lines = read_source(source, self.args.subset, split)
        rows = rename_columns(rows, self.args.columns, source)
        bad: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            problem = prompt_problem(row)
            if problem:
                bad.setdefault(problem, []).append(lines[i] if lines else i + 1)
        if not rows:
            raise DataError(f"{source} holds no rows. {ROW_HELP}")
        if bad:
            where = "line" if lines else "row"
            details = "; ".join(f"{where}{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers[:5]))}"
                                f"{' ...' if len(numbers) > 5 else ''}: {problem}" for problem, numbers in bad.items())
            raise DataError(f"{source} has rows that cannot be GRPO prompts: {details}. {ROW_HELP}")
        kinds = sum(isinstance(r["prompt"], list) for r in rows)
        counts = {"conversational": kinds, "standard": len(rows) - kinds}
        print(f"Data: {source}: {', '.join(f'{n} {k}' for k, n in counts.items() if n)} prompt rows")
        self.formats = {**self.formats, **{k: v for k, v in counts.items() if v}}
        # The split shuffles the rows: each keeps its place in the file, for the reward functions' messages.
        self.places.update({id(row): lines[i] if lines else i + 1 for i, row in enumerate(rows)})
        return rows

    def tokenize(self, rows: list[dict]) -> list[PromptSample]:
        room = self.max_seq_length - self.max_completion_length
        samples = []
        for row in rows:
            prompt = row["prompt"]
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else self.tokenizer.encode_chat(prompt)
            if len(ids) <= room:
                samples.append(PromptSample(torch.tensor(ids, dtype=torch.long), row, self.places[id(row)]))
        if len(samples) < len(rows):
            warnings.warn(f"{len(rows) - len(samples)} of {len(rows)} prompts are longer than max_seq_length - "
                          f"max_completion_length = {room} tokens and were left out. Raise --train.max_seq_length or "
                          "lower --grpo.max_completion_length.", UserWarning, stacklevel=2)
        if rows and not samples:
            raise DataError(f"Every one of the {len(rows)} prompts is longer than max_seq_length - "
                            f"max_completion_length = {room} tokens. Raise --train.max_seq_length or lower "
                            "--grpo.max_completion_length.")
        return samples

    def val_prompt_text(self) -> Optional[str]:
        return prompt_text({"prompt": self.val_set[0].row["prompt"]})

    def samples_per_epoch(self) -> int:
        """Completions in one pass over the training prompts (what --train.global_batch_size counts), each batch of
        rollouts counted once per step it trains (num_iterations)."""
        return len(self._require_setup()) * self.num_generations * self.num_iterations

    def step_dataloader(self, global_batch_size: int, start_step: int, total_steps: int, rank: int,
                        world_size: int) -> DataLoader:
        """One item per optimizer step: `step_item` of this rank's prompts of the step. The steps of one batch of
        rollouts (num_iterations) get the same prompts: the order's batch step // num_iterations."""
        train_set = self._require_setup()
        order = StepSampler(len(train_set), global_batch_size // self.num_generations, self.seed, 0, 0, rank,
                            world_size)
        sampler = [next(order.batches(range(step // self.num_iterations, step // self.num_iterations + 1)))
                   for step in range(start_step, total_steps)]
        return DataLoader(train_set, batch_sampler=sampler, collate_fn=step_item, num_workers=self.args.num_workers)
