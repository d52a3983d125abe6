"""Which keys each query attends to: causally, within a sliding window (Mistral, Gemma 2/3, Phi-3), and in a packed
row only within its own document.

A packed row carries per-token `positions` (B, T) that restart at 0 where each document starts: they are the
documents' RoPE positions and, read through `document_ids`, their boundaries (right padding sits at position 0, so
each padding token is a document of its own and nothing attends to it). `attention_mask` is the one place masks are
built. Today a packed batch gets a dense boolean (B, 1, T, T) mask for SDPA (and Gemma 2's capped attention), O(T^2)
memory; `document_mask_mod` is written as flex_attention's `mask_mod(b, h, q_idx, kv_idx)`, so O(T) attention on CUDA
(a BlockMask from the same function) can replace `dense_mask` without another definition of the rule.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def attention_mask(q_pos: torch.Tensor, kv_len: int, window: Optional[int], decoding: bool,
                   positions: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The boolean mask for SDPA (True: attend), or None where plain causal attention (`is_causal`) is exact.

    Without `positions`: a (T, kv_len) mask over the row's indices `q_pos` (a KV cache of `kv_len` slots while
    decoding, or a sliding window shorter than the row), else None. With packed `positions` (B, T): causal, same
    document and, given `window`, at most window - 1 positions back, as (B, 1, T, T)."""
    if positions is not None:
        return dense_mask(document_mask_mod(positions, window), *positions.shape, positions.device)
    if not decoding and (window is None or q_pos.numel() <= window):
        return None
    kv_pos = torch.arange(kv_len, device=q_pos.device)
    mask = kv_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= (q_pos[:, None] - kv_pos[None, :]) < window
    return mask


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(B, T) ids, counting from 1, of the document each token belongs to: a document starts at every position 0."""
    return (positions == 0).cumsum(-1)


def document_lengths(positions: torch.Tensor) -> torch.Tensor:
    """(B, T): the length of each token's document (Phi-3's longrope picks its factors by it, as for a row alone)."""
    docs = document_ids(positions)
    longest = torch.zeros(docs.size(0), docs.size(1) + 1, dtype=positions.dtype, device=positions.device)
    return longest.scatter_reduce(1, docs, positions + 1, "amax").gather(1, docs)


MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def document_mask_mod(positions: torch.Tensor, window: Optional[int] = None) -> MaskMod:
    """flex_attention's `mask_mod(b, h, q_idx, kv_idx)` for packed rows: causal, same document, within `window`."""
    docs = document_ids(positions)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (kv_idx <= q_idx) & (docs[b, q_idx] == docs[b, kv_idx])
        if window is not None:
            keep = keep & (positions[b, q_idx] - positions[b, kv_idx] < window)
        return keep

    return mask_mod


def dense_mask(mask_mod: MaskMod, batch: int, length: int, device=None) -> torch.Tensor:
    """The (batch, 1, length, length) boolean mask `mask_mod` describes (the same for every head)."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    i = torch.arange(length, device=device)
    return mask_mod(b, torch.zeros((), dtype=torch.long, device=device), i[None, None, :, None],
                    i[None, None, None, :])
