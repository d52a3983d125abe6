"""Sampling with the KV cache: the tokens a model generates after a prompt, greedy or sampled."""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence

import torch

from lit_qlora.base.errors import InvalidInput
from lit_qlora.model import decode_step
from lit_qlora.model.decode_step import DecodeStep
from lit_qlora.model.transformer import Transformer


def sample_rows(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: float,
                generator: torch.Generator) -> torch.Tensor:
    """One token per row of (rows, vocab) logits: greedy at temperature 0; else a draw among the top_k most likely
    tokens (None or 0: all) and, below top_p 1, the smallest set of most likely tokens whose probabilities sum to at
    least top_p (nucleus sampling; the most likely always stays)."""
    if temperature <= 0:
        return logits.float().argmax(-1)  # the same token; bf16's argmax is 3-5x slower on the CPU than the copy
    logits = logits.float() / temperature
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the mass before a token already reaches top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample(logits: torch.Tensor, temperature: float, top_k: Optional[int], generator: torch.Generator,
           top_p: Optional[float] = None) -> int:
    """One token of (vocab,) logits, as `sample_rows` draws a row's (the same draw from the same generator)."""
    return int(sample_rows(logits[None], temperature, top_k, 1.0 if top_p is None else top_p, generator)[0])


def last_logits(model: Transformer, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """The (vocab,) logits of the last position of row 0: the head over that position alone, where the prefill's
    every position through it was the largest matmul of a short reply (SmolLM2's 49152x576 head). Through the
    model's own call where hooks wrap it (FSDP2 unshards its root parameters in a forward pre-hook)."""
    if model._forward_hooks or model._forward_pre_hooks or idx.size(1) == 1:
        return model(idx, input_pos=input_pos)[0, -1]
    return model.logits(model.forward_hidden(idx, input_pos)[:, -1:])[0, -1]


@torch.inference_mode()
def generate(
    model: Transformer,
    prompt: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    stop_ids: Sequence[int] = (),
    seed: int = 1234,
    top_p: Optional[float] = None,
) -> Iterator[int]:
    """Yield new token ids one by one; stops after `max_new_tokens` or at a stop id (which is not yielded)."""
    device = next(model.parameters()).device
    max_len = min(len(prompt) + max_new_tokens, model.config.max_seq_length)
    if len(prompt) >= max_len:
        raise InvalidInput(f"The prompt has {len(prompt)} tokens; the model's context is "
                           f"{model.config.max_seq_length}.")
    generator = torch.Generator(device=device).manual_seed(seed)
    model.set_kv_cache(batch_size=1, max_len=max_len, device=device)
    try:
        dtype = model.model.embed_tokens.weight.dtype
        step = DecodeStep(model, dtype) if device.type == "cpu" and decode_step.applies(model, dtype) else None
        idx = torch.tensor([list(prompt)], device=device)
        input_pos = torch.arange(len(prompt), device=device)
        for _ in range(max_len - len(prompt)):
            if step is not None and idx.size(1) == 1:  # after the prefill: every block in one C call
                logits = step(int(idx[0, 0]), int(input_pos[0]))
            else:
                logits = last_logits(model, idx, input_pos)
            token = sample(logits, temperature, top_k, generator, top_p)
            if token in stop_ids:
                return
            yield token
            idx = torch.tensor([[token]], device=device)
            input_pos = input_pos[-1:] + 1
    finally:
        model.clear_kv_cache()


class Pieces:
    """A reply's text as its tokens come, piece by piece (a multi-byte character that spans tokens waits for its last
    one): `push` each token, then `flush` once for what is left. What a streamed reply shows."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece, self.shown = text[len(self.shown):], text
        return piece


def decoded_pieces(tokenizer, tokens: Iterable[int]) -> Iterator[str]:
    """The text of `tokens` as they come (`Pieces`), each non-empty piece once."""
    pieces = Pieces(tokenizer)
    for token in tokens:
        piece = pieces.push(token)
        if piece:
            yield piece
    piece = pieces.flush()
    if piece:
        yield piece
