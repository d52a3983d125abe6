"""Next-token cross-entropy computed in chunks, so a large vocabulary's fp32 logits never exist all at once."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from lit_qlora.train.nf4_head_loss import nf4_head_ce_sum, vocab_sliced_head
from lit_qlora.train.tiled_loss import tiled_ce_sum, use_tiled_loss

IGNORE_INDEX = -100


def head_ce_sum(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor):
    """One chunk's summed cross-entropy: `head`'s fp32 logits for `hidden` against `targets` (IGNORE_INDEX left out).
    Looked up by module attribute on every chunk: `litqlora estimate` replaces it to trace only a loss's first chunks."""
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


# Logit elements per chunk: 16 MB of fp32 logits (131 tokens of a 32k vocabulary, 85 of SmolLM2's 49k). A chunk's
# logits exist about four times over (bf16, fp32, log-softmax, its gradient), so this bounds the loss's transient
# near 60 MB: with 1024-token chunks the loss was the whole run's memory peak (1.1B model at 1x512: 1674 -> 1425
# MiB with the per-block heap release; SmolLM2 4x512 QLoRA: 1372 -> 1222 MiB). More chunks mean more
# dequantizations of an NF4 lm_head, but SmolLM2 4x512 QLoRA steps took the same time (benchmarks/README.md).
LOGITS_CHUNK_ELEMS = 1 << 22
# On CUDA, 8x more: 128 MiB of fp32 logits a chunk. Each chunk or vocabulary slice costs a dozen kernel launches and
# their Python, and an eager 8B step at 2x2048 is bound by its host: at 4M logits the loss launched 5.6k of the step's
# 15.7k kernels (QLoRA: 126 head slices; LoRA: 128 token chunks; benchmarks/gpu/launch_count.py), at 32M 0.8k. The
# chunk's transients (~0.5 GiB) stay under the step's peak, a checkpointed block's recompute (`litqlora estimate`).
CUDA_LOGITS_CHUNK_ELEMS = 1 << 25


CHUNK_TOKENS_FLOOR = 128
"""The fewest tokens a loss chunk holds, whatever the vocabulary: the head's matmul over fewer rows runs slower per
token (a 1024-token loss and its gradient, fp32, AVX2 EPYC, hidden 512 x 49,152 words: 1.25 s in chunks of 85 rows,
1.08 s of 128, 1.00 s of 205). At SmolLM2's 49k words that is 6.3M logits a chunk (25 MB); at Llama 3's 128k, 16M."""


def tokens_per_chunk(chunk_elems: int, vocab_size: int) -> int:
    """Tokens a loss chunk of `chunk_elems` logits holds: at least CHUNK_TOKENS_FLOOR."""
    return max(CHUNK_TOKENS_FLOOR, chunk_elems // vocab_size)


def logits_chunk_elems(device: torch.device) -> int:
    """Logits a loss chunk (or NF4 head slice) holds on `device`: LOGITS_CHUNK_ELEMS, CUDA_LOGITS_CHUNK_ELEMS on CUDA.
    (`litqlora estimate --device cuda` patches it: its fake tensors are CPU tensors.)"""
    return CUDA_LOGITS_CHUNK_ELEMS if device.type == "cuda" else LOGITS_CHUNK_ELEMS


class _HeadLossWithEagerGradients(torch.autograd.Function):
    """The chunks' summed cross-entropy, whose gradients are computed in forward, chunk by chunk, while each
    chunk's logits exist anyway: backward only scales them. So the head runs once per chunk, where checkpointing
    each chunk ran it twice (SmolLM2's head is a fifth of its weights), and memory still holds one chunk's logits
    plus the gradient of `hidden`, which backward needs next anyway."""

    @staticmethod
    def forward(ctx, hidden, targets, head, chunk_tokens: int, *params):
        grad_hidden = torch.empty_like(hidden)
        grad_params = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, targets.numel(), chunk_tokens):
            h = hidden[start : start + chunk_tokens].detach().requires_grad_()
            with torch.enable_grad():
                loss = head_ce_sum(head, h, targets[start : start + chunk_tokens])
                grads = torch.autograd.grad(loss, (h, *params), allow_unused=True)
            grad_hidden[start : start + chunk_tokens] = grads[0]
            for acc, grad in zip(grad_params, grads[1:]):
                if grad is not None:
                    acc += grad
            total += loss.detach()
        ctx.save_for_backward(grad_hidden, *grad_params)
        ctx.param_dtypes = [p.dtype for p in params]
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, *grad_params = ctx.saved_tensors
        grad_params = [(g * grad_total).to(dtype) for g, dtype in zip(grad_params, ctx.param_dtypes)]
        return (grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, *grad_params)


def next_token_pairs(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, d) hidden states and their (N,) next-token targets, ignored targets left out: masked prompt and padding
    positions need no logits at all."""
    hidden = hidden[:, :-1].reshape(-1, hidden.size(-1))
    targets = labels[:, 1:].reshape(-1)
    keep = targets != IGNORE_INDEX
    return hidden[keep], targets[keep]


def chunked_cross_entropy_sum(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: Optional[int] = None,
    params: Optional[Sequence[torch.Tensor]] = None,
) -> torch.Tensor:
    """Sum of CE(head(hidden[:, t]), labels[:, t + 1]) over non-ignored targets.

    `labels` are aligned with the inputs (not shifted); position t predicts token t + 1. With gradients, each
    chunk's gradients are computed as its logits are (`_HeadLossWithEagerGradients`): `params` are the head's
    trainable tensors (its LoRA factors; default: a module head's own), whose gradients it returns. `chunk_tokens` defaults to
    LOGITS_CHUNK_ELEMS / vocabulary size (the head's `out_features`), at least CHUNK_TOKENS_FLOOR.
    """
    if chunk_tokens is None:
        chunk_tokens = tokens_per_chunk(LOGITS_CHUNK_ELEMS, getattr(head, "out_features", 8192))
    hidden, targets = next_token_pairs(hidden, labels)
    if params is None:
        params = [p for p in head.parameters() if p.requires_grad] if isinstance(head, torch.nn.Module) else []
    if torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params)):
        return _HeadLossWithEagerGradients.apply(hidden, targets, head, chunk_tokens, *params)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.numel(), chunk_tokens):
        total = total + head_ce_sum(head, hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens])
    return total


def lm_loss_sum(model, input_ids: torch.Tensor, labels: torch.Tensor,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A fine-tune's summed next-token loss: the blocks, then the head in chunks of `logits_chunk_elems` logits
    (long sequences: tiles of tokens x vocabulary slices, `tiled_loss`).
    `positions`: a packed batch's per-token positions (each document attends only within itself).

    `model.logits`, not `lm_head`: a model that soft-caps its logits (Gemma 2) trains on the capped ones."""
    hidden = model.forward_hidden(input_ids, **({} if positions is None else {"positions": positions}))
    sliced = vocab_sliced_head(model.lm_head, model.config.final_softcap)
    if use_tiled_loss(model.lm_head, labels[:, 1:].numel(), sliced):  # long sequences (padding counted: no sync)
        return tiled_ce_sum(model.lm_head, *next_token_pairs(hidden, labels), model.config.final_softcap,
                            LOGITS_CHUNK_ELEMS)
    chunk_elems = logits_chunk_elems(hidden.device)
    if sliced:
        return nf4_head_ce_sum(model.lm_head, *next_token_pairs(hidden, labels), chunk_elems)
    chunk_tokens = tokens_per_chunk(chunk_elems, model.config.vocab_size)
    params = [p for p in model.lm_head.parameters() if p.requires_grad]
    return chunked_cross_entropy_sum(model.logits, hidden, labels, chunk_tokens, params)


def target_count(labels: torch.Tensor) -> int:
    """Number of trained (non-ignored) next-token targets in a batch."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())
