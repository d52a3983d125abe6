"""Which keys each query attends to: causally, within a sliding window (Mistral, Gemma 2/3, Phi-3), in a packed
row only within its own document, and in a document with branches (a preference pair's two answers after one
prompt) only within its branch and the trunk before it.

A packed row carries per-token `positions` (B, T) that restart at 0 where each document starts: they are the documents'
RoPE positions and, read through `document_ids`, their boundaries (right padding sits at position 0, so each padding
token is a document of its own and nothing attends to it). `attention_mask` is the one place masks are built, from one
rule per kind written as flex_attention's `mask_mod(b, h, q_idx, kv_idx)` (`causal_mask_mod`, `document_mask_mod`): a
flex_attention `BlockMask` (`lit_qlora.model.flex.block_mask`) where `lit_qlora.model.attention` runs flex_attention
(CUDA; O(T) memory), else the dense boolean mask for SDPA and Gemma 2's capped attention (CPU, KV-cache decoding;
O(T^2)) or None where plain causal SDPA is exact.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from lit_qlora.model import flex as flex_module  # (`flex` is attention_mask's argument)


def attention_mask(q_pos: torch.Tensor, kv_len: int, window: Optional[int], decoding: bool,
                   positions: Optional[torch.Tensor] = None, flex: bool = False, capped: bool = False):
    """The boolean mask for SDPA (True: attend), or None where plain causal attention (`is_causal`) is exact.

    Without `positions`: a (T, kv_len) mask over the row's indices `q_pos` (a KV cache of `kv_len` slots while
    decoding, or a sliding window shorter than the row), else None; while decoding rows that each stand at their own
    positions, `q_pos` (B, T), a (B, 1, T, kv_len) mask. With packed `positions` (B, T): causal, same
    document and, given `window`, at most window - 1 positions back, as (B, 1, T, T).

    `flex` (a full-sequence forward where `lit_qlora.model.attention.use_flex_attention`): the same mask as a
    flex_attention BlockMask instead of a dense one, and with `capped` (Gemma 2's soft-capped scores, which SDPA cannot
    take) a causal BlockMask also where plain causal would do; None still where plain causal SDPA is exact."""
    if flex and not decoding:
        T = q_pos.numel()
        if positions is not None:
            return flex_module.block_mask(document_mask_mod(positions, window), positions.size(0), T,
                                          positions.device)
        if capped or (window is not None and T > window):
            return flex_module.block_mask(causal_mask_mod(window if window is not None and T > window else None),
                                          None, T, q_pos.device)
        return None
    if positions is not None:
        return dense_mask(document_mask_mod(positions, window), *positions.shape, positions.device)
    if not decoding and (window is None or q_pos.numel() <= window):
        return None
    kv_pos = torch.arange(kv_len, device=q_pos.device)
    if q_pos.dim() == 2:  # decoding rows each at its own positions (a continuous batch): (B, 1, T, kv_len)
        q_pos = q_pos[:, None]
    mask = kv_pos <= q_pos[..., None]
    if window is not None:
        mask &= (q_pos[..., None] - kv_pos) < window
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


def branches(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids of each token's branch and the position its branch starts at. A branch starts wherever the position
    does not increase: at every document's start (position 0), and where a row goes back to an earlier position of
    its document (a preference pair's rejected answer after its chosen one, both after one prompt)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] <= positions[:, :-1]
    ids = starts.cumsum(-1)
    start_pos = torch.zeros(positions.size(0), positions.size(1) + 1, dtype=positions.dtype, device=positions.device)
    start_pos = start_pos.scatter_reduce(1, ids, torch.where(starts, positions, 0), "amax").gather(1, ids)
    return ids, start_pos


def document_mask_mod(positions: torch.Tensor, window: Optional[int] = None) -> MaskMod:
    """flex_attention's `mask_mod(b, h, q_idx, kv_idx)` for packed rows: causal, same document, within `window`; and
    in a document with branches (`branches`), a token sees its own branch and the tokens before the position its
    branch starts at (its trunk), not another branch. Documents with one branch (packing) are plain causal."""
    docs = document_ids(positions)
    branch, branch_start = branches(positions)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (kv_idx <= q_idx) & (docs[b, q_idx] == docs[b, kv_idx])
        keep = keep & ((branch[b, q_idx] == branch[b, kv_idx]) | (positions[b, kv_idx] < branch_start[b, q_idx]))
        if window is not None:
            keep = keep & (positions[b, q_idx] - positions[b, kv_idx] < window)
        return keep

    return mask_mod


@functools.lru_cache(maxsize=None)
def causal_mask_mod(window: Optional[int] = None) -> MaskMod:
    """flex_attention's `mask_mod` for one row: causal and, given `window`, at most window - 1 positions back (one
    function object per window: compiled code guards on it)."""

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        return keep

    return mask_mod


def dense_mask(mask_mod: MaskMod, batch: int, length: int, device=None) -> torch.Tensor:
    """The (batch, 1, length, length) boolean mask `mask_mod` describes (the same for every head)."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    i = torch.arange(length, device=device)
    return mask_mod(b, torch.zeros((), dtype=torch.long, device=device), i[None, None, :, None],
                    i[None, None, None, :])


def as_dense(block_mask) -> torch.Tensor:
    """The boolean mask a BlockMask describes, (batch, 1, length, length): where flex_attention cannot run a shape
    (`lit_qlora.model.flex.flex_runs`), the same attention through the dense paths."""
    q_len, kv_len = block_mask.seq_lengths
    if q_len != kv_len:
        raise ValueError(f"a full-sequence BlockMask is square; this one is {q_len} x {kv_len}")
    return dense_mask(block_mask.mask_mod, block_mask.kv_num_blocks.size(0), q_len, block_mask.kv_num_blocks.device)
