"""The one training data order: which samples every optimizer step sees, on every rank, resumable at any step.

Epoch e visits the training set in `epoch_order(n, seed, e)`, cut into global batches (each epoch drops its last
partial one); rank r of `world_size` takes every world_size-th sample of each global batch, from r. Being a pure
function of (seed, step), the order needs no state to resume: a run restarted at step k sees exactly what an
uninterrupted one would have seen from k on.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Sampler

from lit_qlora.base.errors import InvalidInput


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """All sample indices of one epoch, in training order."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)
    return torch.randperm(num_samples, generator=generator).tolist()


class StepSampler(Sampler[list[int]]):
    """One item per optimizer step: this rank's sample indices of global batch `step`, for the steps
    [start_step, total_steps)."""

    def __init__(self, num_samples: int, global_batch: int, seed: int, start_step: int, total_steps: int,
                 rank: int = 0, world_size: int = 1) -> None:
        self.steps_per_epoch = num_samples // global_batch
        if self.steps_per_epoch == 0:
            raise InvalidInput(f"The training split has {num_samples} samples, fewer than one global batch "
                               f"({global_batch}). Lower --train.global_batch_size or add data.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.start_step, self.total_steps, self.rank, self.world_size = start_step, total_steps, rank, world_size

    def __len__(self) -> int:
        return self.total_steps - self.start_step

    def __iter__(self) -> Iterator[list[int]]:
        return self.batches(range(self.start_step, self.total_steps))

    def batches(self, steps: range) -> Iterator[list[int]]:
        """This rank's samples of each step in `steps`."""
        order, order_epoch = None, -1
        for step in steps:
            epoch, index = divmod(step, self.steps_per_epoch)
            if epoch != order_epoch:
                order, order_epoch = epoch_order(self.num_samples, self.seed, epoch), epoch
            batch = order[index * self.global_batch : (index + 1) * self.global_batch]
            yield batch[self.rank :: self.world_size]


class EpochSampler(Sampler[int]):
    """For a Trainer of your own: this rank's samples of the epoch Lightning announces (`set_epoch`), the
    StepSampler steps of that epoch one after another. Batched by global_batch / world_size, they are exactly
    StepSampler's per-rank batches."""

    def __init__(self, num_samples: int, global_batch: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.steps = StepSampler(num_samples, global_batch, seed, 0, 0, rank, world_size)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps.steps_per_epoch * len(range(self.steps.rank, self.steps.global_batch, self.steps.world_size))

    def __iter__(self) -> Iterator[int]:
        first = self.epoch * self.steps.steps_per_epoch
        for batch in self.steps.batches(range(first, first + self.steps.steps_per_epoch)):
            yield from batch


class MicroBatches:
    """Collate one step's samples into its micro-batches (each a padded dict, plus its non-padding token count)."""

    def __init__(self, collate: Callable[[list], dict[str, Any]], micro_batch_size: int) -> None:
        self.collate, self.micro_batch_size = collate, micro_batch_size

    def __call__(self, samples: list) -> list[dict[str, Any]]:
        out = []
        for i in range(0, len(samples), self.micro_batch_size):
            part = samples[i : i + self.micro_batch_size]
            batch = self.collate(part)
            batch["num_tokens"] = sum(len(s) for s in part)
            out.append(batch)
        return out
