"""Next-token cross-entropy computed in chunks, so a large vocabulary's fp32 logits never exist all at once."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _head_ce_sum(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor):
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy_sum(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """Sum of CE(head(hidden[:, t]), labels[:, t + 1]) over non-ignored targets.

    `labels` are aligned with the inputs (not shifted); position t predicts token t + 1. Each chunk's logits are
    recomputed in backward (checkpointed) rather than stored, so memory holds one chunk of fp32 logits.
    """
    hidden = hidden[:, :-1].reshape(-1, hidden.size(-1))
    targets = labels[:, 1:].reshape(-1)
    keep = targets != IGNORE_INDEX  # masked prompt and padding positions need no logits at all
    hidden, targets = hidden[keep], targets[keep]
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            total = total + checkpoint(_head_ce_sum, head, h, t, use_reentrant=False)
        else:
            total = total + _head_ce_sum(head, h, t)
    return total


def target_count(labels: torch.Tensor) -> int:
    """Number of trained (non-ignored) next-token targets in a batch."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())
