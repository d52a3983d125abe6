"""A training sampler whose order is a pure function of (seed, epoch), and which can start mid-epoch: resuming
at micro-batch k gives exactly the batches an uninterrupted run would have seen from k on."""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import Sampler


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """All sample indices of one epoch, in training order."""
    if not shuffle:
        return list(range(num_samples))
    generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)
    return torch.randperm(num_samples, generator=generator).tolist()


class ResumableSampler(Sampler[int]):
    """Indices of this rank, epoch by epoch. With `num_replicas` > 1, each epoch's order is padded (by repeating
    its start) to a multiple of `num_replicas` and rank r takes every num_replicas-th index from r, as
    DistributedSampler does (then tell Lightning `use_distributed_sampler=False`).

    `set_position(epoch, batches_done)` makes the next iteration start at micro-batch `batches_done` of `epoch`;
    the offset applies to that one iteration only. `set_epoch(epoch)` (Lightning calls it at every epoch start)
    keeps a pending offset for the same epoch and drops it for another. `len()` is always a full epoch's count, so
    a trainer that reads it once computes the same number of batches per epoch on a resumed run."""

    def __init__(self, num_samples: int, batch_size: int, seed: int, shuffle: bool = True, num_replicas: int = 1,
                 rank: int = 0) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0
        self.start_batch = 0

    @property
    def samples_per_rank(self) -> int:
        return math.ceil(self.num_samples / self.num_replicas)

    @property
    def num_batches(self) -> int:
        """Micro-batches of one full epoch on this rank (the last may be partial)."""
        return math.ceil(self.samples_per_rank / self.batch_size)

    def order(self, epoch: int) -> list[int]:
        """This rank's indices of a whole epoch."""
        order = epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
        total = self.samples_per_rank * self.num_replicas
        order += (order * math.ceil(total / max(len(order), 1)))[: total - len(order)]
        return order[self.rank :: self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start_batch = 0
        self.epoch = epoch

    def set_position(self, epoch: int, batches_done: int) -> None:
        if not 0 <= batches_done <= self.num_batches:
            raise ValueError(f"batches_done={batches_done} is not in [0, {self.num_batches}] (batches per epoch)")
        if batches_done == self.num_batches:  # the epoch is complete: resume at the start of the next one
            epoch, batches_done = epoch + 1, 0
        self.epoch, self.start_batch = epoch, batches_done

    def __iter__(self) -> Iterator[int]:
        start, self.start_batch = self.start_batch * self.batch_size, 0
        return iter(self.order(self.epoch)[start:])

    def __len__(self) -> int:
        return self.samples_per_rank
