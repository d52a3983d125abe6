"""Rollouts on the training model: a group of completions of one prompt, sampled together with the KV cache from
the NF4 (or bf16) base plus the current adapter; no second copy of the weights.

The prompt is read once (a one-row prefill) and its keys and values copied to every row of the group; then the
group decodes a token per row per forward until each row has emitted a stop token (kept: the policy learns to stop)
or the length cap. Sampling draws from a generator seeded by the caller, so a run's rollouts repeat exactly, after
a resume too.

`--grpo.compile_decode` (issue 49 item 3, the GPU's fast path, off until a GPU measures it): the decode step (one token
per row through every block and the head) is compiled once, `fullgraph` and static: the KV cache has one length for
every prompt (`Decoder.cache_len`, the run's max_seq_length, which no prompt plus completion exceeds), so the prompts'
lengths never recompile it; the positions are a tensor, not a constant. On CUDA it is compiled with CUDA graphs
(`reduce-overhead`: the step's ~hundreds of kernel launches replayed as one graph) and the cache is allocated once and
kept between groups and steps (a graph replays at fixed addresses): G x max_seq_length positions held through
training, which `litqlora estimate --method grpo` counts. The prefill (one row of the prompt's length) stays eager.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from lit_qlora.base import switches
from lit_qlora.model import decode_step
from lit_qlora.model.decode_step import DecodeStep
from lit_qlora.model.sampling import sample_rows
from lit_qlora.base.threads import process_governor
from lit_qlora.model.transformer import Transformer


@dataclass
class Group:
    """A prompt's completions: token ids (the stop token included where one ended it) and whether each stopped
    (else the length cap cut it)."""

    completions: list[list[int]]
    stopped: list[bool]


def _decode_step(model: Transformer, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The next token's logits of each row: one position through the blocks (the KV cache) and the head."""
    return model(token, input_pos=pos)[:, -1]


COMPILE_BACKEND = "inductor"
"""torch.compile's backend for the decode step, unless LIT_QLORA_DECODE_BACKEND names another (the tests and the GPU
kit's dry run trace with aot_eager: the same graph, no code generation)."""


class Decoder:
    """How a group decodes: eagerly (no `cache_len`), or with the step compiled once for a KV cache of `cache_len`
    positions (module doc). `backend`: torch.compile's, COMPILE_BACKEND by default."""

    def __init__(self, cache_len: Optional[int] = None, backend: Any = None) -> None:
        self.cache_len = cache_len
        self.backend = backend or switches.text("LIT_QLORA_DECODE_BACKEND") or COMPILE_BACKEND
        self._compiled = None
        self._threads = 0  # torch's thread count when the step compiled
        self._kept: dict = {}  # CUDA: the caches kept between groups, by (rows, device): the blocks' caches

    @property
    def compiled(self) -> bool:
        return self.cache_len is not None

    @property
    def traced(self) -> bool:
        """Whether the compiled step exists yet (its graph then holds the model's weights)."""
        return self._compiled is not None

    def attach_cache(self, model: Transformer, n: int, max_len: int, device: torch.device) -> None:
        if not self.compiled:
            return model.set_kv_cache(batch_size=n, max_len=max_len, device=device)
        if max_len > self.cache_len:
            raise ValueError(f"a prompt and its completion ({max_len}) exceed the compiled decode's cache "
                             f"({self.cache_len})")
        kept = self._kept.get((n, device))
        if kept is not None:
            for block, cache in zip(model.model.layers, kept):
                block.self_attn.kv_cache = cache
            model.max_cache_len = self.cache_len
            return
        model.set_kv_cache(batch_size=n, max_len=self.cache_len, device=device)
        if torch.device(device).type == "cuda":  # a CUDA graph replays at the addresses it recorded
            self._kept[(n, device)] = [block.self_attn.kv_cache for block in model.model.layers]

    def step(self, model: Transformer, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if not self.compiled:
            return _decode_step(model, token, pos)
        if self._compiled is None:
            cuda = token.device.type == "cuda"
            self._compiled = torch.compile(_decode_step, backend=self.backend, fullgraph=True, dynamic=False,
                                           **({"mode": "reduce-overhead"} if cuda and self.backend == "inductor"
                                              else {}))
            self._threads = torch.get_num_threads()
        # The graph keeps the thread count it was compiled with: dynamo guards on it, and a thread governor's change
        # between steps (a busy machine) would compile the whole step again (35-49 s on a 2-core CPU).
        threads = torch.get_num_threads()
        if threads != self._threads:
            torch.set_num_threads(self._threads)
        try:
            with _block_hooks_aside(model):
                logits = self._compiled(model, token, pos)
        finally:
            if threads != self._threads:
                torch.set_num_threads(threads)
        if token.device.type == "cpu":  # what the blocks' hooks would do: the thread governor (lit_qlora.base.threads)
            process_governor()()
        return logits


@contextmanager
def _block_hooks_aside(model: Transformer) -> Iterator[None]:
    """The blocks' forward hooks (the thread governor's, which reads /proc outside any graph) set aside for a
    compiled call: the graph is whole, and every call finds the blocks as the first did (no recompilation)."""
    saved = [(block, dict(block._forward_hooks)) for block in model.blocks]
    for block, _ in saved:
        block._forward_hooks.clear()  # the same dict, emptied: dynamo guards on its identity
    try:
        yield
    finally:
        for block, hooks in saved:
            block._forward_hooks.update(hooks)


EAGER = Decoder()


@torch.inference_mode()
def sample_group(model: Transformer, prompt: Sequence[int], n: int, max_new_tokens: int, temperature: float,
                 top_k: Optional[int], top_p: float, stop_ids: Sequence[int], generator: torch.Generator,
                 decoder: Decoder = EAGER) -> Group:
    """`n` completions of `prompt`, at most `max_new_tokens` each. The caller sets eval mode (no adapter dropout)."""
    device = model.model.embed_tokens.weight.device
    decoder.attach_cache(model, n, len(prompt) + max_new_tokens, device)
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
        dtype = model.model.embed_tokens.weight.dtype
        # an NF4 Llama-style policy decodes the group's rows through model/decode_step.c (its adapter's current
        # factors copied in: rebuilt every group)
        fast = (DecodeStep(model, dtype) if not decoder.compiled and device.type == "cpu"
                and decode_step.applies(model, dtype) else None)
        stops = torch.tensor(list(stop_ids) or [-1], device=device)
        tokens, done = [], torch.zeros(n, dtype=torch.bool, device=device)
        for step in range(max_new_tokens):
            token = sample_rows(logits, temperature, top_k, top_p, generator)
            tokens.append(token)
            done = done | torch.isin(token, stops)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            pos = torch.tensor([len(prompt) + step], device=device)
            logits = fast(token, pos) if fast is not None else decoder.step(model, token[:, None], pos)
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
