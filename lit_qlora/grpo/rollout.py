"""Rollouts on the training model: a group of completions of one prompt, sampled together with the KV cache from
the NF4 (or bf16) base plus the current adapter; no second copy of the weights.

The prompt is read once (a one-row prefill) and its keys and values copied to every row of the group; then the
group decodes a token per row per forward until each row has emitted a stop token (kept: the policy learns to stop)
or the length cap. Sampling draws from a generator seeded by the caller, so a run's rollouts repeat exactly, after
a resume too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from lit_qlora.model.sampling import sample_rows
from lit_qlora.model.transformer import Transformer


@dataclass
class Group:
    """A prompt's completions: token ids (the stop token included where one ended it) and whether each stopped
    (else the length cap cut it)."""

    completions: list[list[int]]
    stopped: list[bool]


@torch.inference_mode()
def sample_group(model: Transformer, prompt: Sequence[int], n: int, max_new_tokens: int, temperature: float,
                 top_k: Optional[int], top_p: float, stop_ids: Sequence[int], generator: torch.Generator) -> Group:
    """`n` completions of `prompt`, at most `max_new_tokens` each. The caller sets eval mode (no adapter dropout)."""
    device = model.model.embed_tokens.weight.device
    max_len = len(prompt) + max_new_tokens
    model.set_kv_cache(batch_size=n, max_len=max_len, device=device)
    try:
        positions = torch.arange(len(prompt), device=device)
        # the head on the last position only: a long prompt's logits would be prompt x vocab
        hidden = model.forward_hidden(torch.tensor([list(prompt)], device=device), input_pos=positions)
        logits = model.logits(hidden[:, -1])
        for block in model.model.layers:  # the prompt's keys and values, once, for every row
            cache = block.self_attn.kv_cache
            cache.k[1:, :, : len(prompt)] = cache.k[:1, :, : len(prompt)]
            cache.v[1:, :, : len(prompt)] = cache.v[:1, :, : len(prompt)]
        logits = logits.expand(n, -1)
        stops = torch.tensor(list(stop_ids) or [-1], device=device)
        tokens, done = [], torch.zeros(n, dtype=torch.bool, device=device)
        for step in range(max_new_tokens):
            token = sample_rows(logits, temperature, top_k, top_p, generator)
            tokens.append(token)
            done = done | torch.isin(token, stops)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            pos = torch.tensor([len(prompt) + step], device=device)
            logits = model(token[:, None], input_pos=pos)[:, -1]
    finally:
        model.clear_kv_cache()
    drawn = torch.stack(tokens, 1).tolist()
    stop_set = set(stop_ids)
    completions, stopped = [], []
    for row in drawn:
        end = next((i for i, t in enumerate(row) if t in stop_set), None)
        completions.append(row if end is None else row[: end + 1])
        stopped.append(end is not None)
    return Group(completions, stopped)
