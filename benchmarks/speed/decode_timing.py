"""How the decode benchmarks time a stream of tokens: ours and llama.cpp's as generators (`timed_tokens`),
transformers' `generate` through its streamer (`timed_generate`), alike. Stdlib only at import: the GPU kit runs it in
the bitsandbytes venv, which has no lit_qlora."""

from __future__ import annotations

import time
from typing import Callable, Iterable


def timed_tokens(tokens: Iterable, n: int, sync: Callable[[], None] = lambda: None) -> dict:
    """The first `n` tokens of a token generator: the tokens, the whole call's seconds and the decode's (after the
    first token), the device synchronized at the first token and at the end."""
    start = time.perf_counter()
    out, first = [], None
    for token in tokens:
        out.append(int(token))
        if first is None:
            sync()
            first = time.perf_counter()
        if len(out) == n:
            break
    sync()
    end = time.perf_counter()
    return {"tokens": out, "seconds": end - start, "decode_seconds": end - first}


def timed_generate(model, prompt, n: int, sync: Callable[[], None] = lambda: None) -> dict:
    """Greedy `model.generate` of exactly `n` new tokens after `prompt` (a (1, T) id tensor): the tokens, the whole
    call's seconds and the decode's (after the first new token), the device synchronized at the ends."""
    import torch

    stamps: list[float] = []

    class Clock:  # transformers' streamer protocol: put() per step (the prompt first), end()
        def put(self, value):
            stamps.append(time.perf_counter())

        def end(self):
            pass

    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=Clock(),
                             pad_token_id=0)
    sync()
    end = time.perf_counter()
    return {"tokens": out[0, prompt.size(1):].tolist(), "seconds": end - start, "decode_seconds": end - stamps[1]}
