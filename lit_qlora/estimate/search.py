"""What fits a card: the largest micro-batch and the longest sequence whose traced peak fits its memory, found by
secant searches over a few traces (`predict`: lit_qlora.estimate.command's traced peak at a size)."""

from __future__ import annotations

from typing import Any, Callable

CUDA_RESERVE = 1 << 29  # beside the peak on a real card: CUDA context and cuBLAS workspaces (~0.5 GiB)
FRAGMENTATION = 1.10  # reserved over allocated, as PyTorch's caching allocator typically runs


def fits(peak: int, budget: int, device: str) -> bool:
    if device == "cuda":
        return peak * FRAGMENTATION + CUDA_RESERVE <= budget
    return peak <= budget


def largest_batches(predict, budget: int, device: str, limit: int = 256, traces: int = 5) -> dict[str, Any]:
    """The largest micro-batch size that fits `budget`, with activation checkpointing on and off. Memory grows
    about linearly with the batch: the line through the two latest traces guesses the answer (a secant search),
    at most `traces` traces per setting (an 8B trace takes about a minute). The answer is
    always a size whose trace fits."""
    usable = (budget - CUDA_RESERVE) / FRAGMENTATION if device == "cuda" else budget
    found = {}
    for key, checkpointing in (("on", True), ("off", False)):
        peaks: dict[int, int] = {}
        best, over, size = 0, limit + 1, 1  # largest size known to fit, smallest known not to, next to trace
        while len(peaks) < traces and best < size < over:
            peaks[size] = predict(size, checkpointing)[0]
            if fits(peaks[size], budget, device):
                best = size
            else:
                over = size
            if best == 0:
                break  # not even one sequence fits
            if size == 1:
                size = 2
                continue
            last, before = list(peaks)[-1], list(peaks)[-2]  # the line through the two latest traces
            per_sample = max(1.0, (peaks[last] - peaks[before]) / (last - before))
            size = min(over - 1, max(best + 1, last + int((usable - peaks[last]) // per_sample)))
        found[key] = best
    needed = found["off"] == 0 and found["on"] > 0
    return {"max_micro_batch_size_by_checkpointing": found, "activation_checkpointing_needed": needed,
            "micro_batch_search_limit": limit}  # a size equal to it may not be the largest that fits


AUTO_LENGTH_TRACES = (8192, 32768)  # the first line is fitted through these (the fixed part is settled by 8k)
LENGTH_STEP = 256


def longest_context(predict: Callable[[int], int], budget: int, device: str, traces: int = 6,
                    limit: int = 1 << 24) -> dict[str, Any]:
    """The longest sequence (a multiple of LENGTH_STEP tokens) whose traced peak fits `budget`, by a secant search.

    With offloaded activation checkpoints and the tiled MLP and loss, the peak grows linearly with the length (O(L)
    attention, no L x intermediate or L x vocabulary buffer) but for two kinks where tiling starts (the MLP past
    one tile, the loss past V / 2 tokens), after which it grows more slowly. So the line through two traces is
    followed to the budget, the guess is traced, and the line through the two latest traces gives the next guess,
    until a traced length fits with less than one more step of room (the line being exact past the last kink,
    this takes one or two traces beyond the first two), at most `traces` in all. The answer is always a length
    whose trace fits (0: not even LENGTH_STEP tokens)."""
    usable = (budget - CUDA_RESERVE) / FRAGMENTATION if device == "cuda" else budget
    peaks = {length: predict(length) for length in AUTO_LENGTH_TRACES}
    best = max((n for n, p in peaks.items() if fits(p, budget, device)), default=0)
    over = min((n for n, p in peaks.items() if not fits(p, budget, device)), default=limit + LENGTH_STEP)
    while len(peaks) < traces and over - best > LENGTH_STEP:
        (x0, p0), (x1, p1) = list(peaks.items())[-2:]
        slope = max(1.0, (p1 - p0) / (x1 - x0))
        guess = int(x1 + (usable - p1) / slope) // LENGTH_STEP * LENGTH_STEP
        guess = min(over - LENGTH_STEP, max(best + LENGTH_STEP, guess))
        if guess in peaks:
            break
        peaks[guess] = predict(guess)
        if not fits(peaks[guess], budget, device):
            over = guess
            continue
        best = guess
        slope = max(1.0, (peaks[guess] - p1) / (guess - x1))
        if peaks[guess] + slope * LENGTH_STEP > usable:
            break  # one step more would not fit by the line through the two latest traces
    low, high = AUTO_LENGTH_TRACES
    return {"max_seq_length": best, "traced_peaks": {str(n): p for n, p in sorted(peaks.items())},
            "bytes_per_token": round((peaks[high] - peaks[low]) / (high - low))}
