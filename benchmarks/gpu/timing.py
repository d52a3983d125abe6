"""Figures that decide (issue 48 item 1): a run's step times after warm-up as a median with its spread, and an A/B
comparison as the median of per-round ratios with their range. Standard library only: the kit, the peers' children
and the tests import it.

Why per-round ratios: two identical 8B QLoRA runs on an H200 gave 6,536 and 5,098 tokens/s (22% apart); a ratio of
two runs taken minutes apart measures the machine's drift as much as the change. Interleaving the variants (A B A B
...) and taking each round's ratio cancels what drifts slower than a round; the range of those ratios says whether
the difference is larger than the noise.
"""

from __future__ import annotations

import statistics
from typing import Mapping, Sequence

WARMUP_STEPS = 4
"""Steps left out of the timing: the first compiles (or warms cuBLAS and the allocator), the next few still settle."""


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, linear between the two nearest ranks."""
    data = sorted(values)
    if not data:
        raise ValueError("no values")
    pos = q * (len(data) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def timed(values: Sequence[float], warmup: int = WARMUP_STEPS) -> list[float]:
    """The steps after `warmup` (a short smoke run that has no more steps than that: all but the first)."""
    if len(values) > warmup:
        return list(values[warmup:])
    return list(values[1:]) or list(values)


def spread(values: Sequence[float]) -> dict:
    """Median, quartiles, extremes and the interquartile range relative to the median of `values`."""
    med = statistics.median(values)
    p25, p75 = quantile(values, 0.25), quantile(values, 0.75)
    return {"n": len(values), "median": med, "min": min(values), "p25": p25, "p75": p75, "max": max(values),
            "rel_iqr": (p75 - p25) / med if med else None}


def ab_ratios(rounds: Sequence[Mapping[str, float]], baseline: str) -> dict[str, dict]:
    """For each variant but `baseline`: its figure over the baseline's in each round where both ran, then the
    median of those ratios and their range. `rounds`: one {variant: figure} per round (e.g. median tokens/s)."""
    variants = [v for v in dict.fromkeys(k for r in rounds for k in r) if v != baseline]
    out = {}
    for v in variants:
        ratios = [r[v] / r[baseline] for r in rounds if r.get(v) and r.get(baseline)]
        if ratios:
            out[v] = {"ratios": ratios, "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                      "rounds": len(ratios)}
    return out
