"""Next-token cross-entropy computed in chunks, so a large vocabulary's fp32 logits never exist all at once."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _head_ce_sum(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor):
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


# Logit elements per chunk: 16 MB of fp32 logits (131 tokens of a 32k vocabulary, 85 of SmolLM2's 49k). A chunk's
# logits exist about four times over (bf16, fp32, log-softmax, its gradient), so this bounds the loss's transient
# near 60 MB: with 1024-token chunks the loss was the whole run's memory peak (1.1B model at 1x512: 1674 -> 1425
# MiB with the per-block heap release; SmolLM2 4x512 QLoRA: 1372 -> 1222 MiB). More chunks mean more
# dequantizations of an NF4 lm_head, but SmolLM2 4x512 QLoRA steps took the same time (benchmarks/README.md).
LOGITS_CHUNK_ELEMS = 1 << 22


def chunked_cross_entropy_sum(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: Optional[int] = None,
) -> torch.Tensor:
    """Sum of CE(head(hidden[:, t]), labels[:, t + 1]) over non-ignored targets.

    `labels` are aligned with the inputs (not shifted); position t predicts token t + 1. Each chunk's logits are
    recomputed in backward (checkpointed) rather than stored, so memory holds one chunk of fp32 logits.
    `chunk_tokens` defaults to LOGITS_CHUNK_ELEMS / vocabulary size (the head's `out_features`).
    """
    if chunk_tokens is None:
        chunk_tokens = max(1, LOGITS_CHUNK_ELEMS // getattr(head, "out_features", 8192))
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


def lm_loss_sum(model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A fine-tune's summed next-token loss: the blocks, then the head in chunks of LOGITS_CHUNK_ELEMS logits.

    `model.logits`, not `lm_head`: a model that soft-caps its logits (Gemma 2) trains on the capped ones."""
    hidden = model.forward_hidden(input_ids)
    chunk_tokens = max(1, LOGITS_CHUNK_ELEMS // model.config.vocab_size)
    return chunked_cross_entropy_sum(model.logits, hidden, labels, chunk_tokens)


def target_count(labels: torch.Tensor) -> int:
    """Number of trained (non-ignored) next-token targets in a batch."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())
