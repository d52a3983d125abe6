"""Fused base projections (q/k/v and gate/up as one matmul each) against each projection's own matmul.

    python benchmarks/ab/fused_projections.py --checkpoint_dir SmolLM2-135M --rounds 5 [--profile]

One process builds a LoRA (bf16 base) and a QLoRA (NF4 base) model with one_step.py (r=8, every linear, dropout
0.05, activation checkpointing on, 4x512 tokens) and times optimizer steps with the fusion on and off
(`fused_projections.fusion_plan` patched to say no), alternating, after one warm-up step each: other jobs on the
cores slow both alike, so the ratio of the medians is the result. --profile adds one torch.profiler step of each
and prints the ops whose self CPU time changed most. --json writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speed"))
import one_step  # noqa: E402
from lit_qlora.model import fused_projections  # noqa: E402


@contextmanager
def unfused():
    plan = fused_projections.fusion_plan
    fused_projections.fusion_plan = lambda x, modules: None
    try:
        yield
    finally:
        fused_projections.fusion_plan = plan


def timed(step, fused: bool, clock) -> float:
    with unfused() if not fused else nullcontext():
        t0 = clock()
        step()
        return clock() - t0


def op_totals(step, fused: bool) -> dict[str, tuple[float, int]]:
    """Self CPU seconds and calls by op of one step."""
    with unfused() if not fused else nullcontext():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    return {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", default="SmolLM2-135M")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quantize", nargs="+", default=["none", "nf4"])
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU seconds, less sensitive to other jobs (use with --threads 1, "
                             "where no thread spins waiting)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    results = {"threads": torch.get_num_threads(), "torch": torch.__version__, "batch": args.batch, "seq": args.seq,
               "dropout": args.dropout, "checkpoint_dir": args.checkpoint_dir, "clock": args.clock}
    for quantize in args.quantize:
        _, _, step = one_step.build_step(args.checkpoint_dir, quantize, args.batch, args.seq, True, args.dropout)
        timed(step, True, clock), timed(step, False, clock)  # warm-up: kernels compiled, buffers grown
        times = {True: [], False: []}
        for i in range(args.rounds):
            for fused in ((True, False) if i % 2 == 0 else (False, True)):
                times[fused].append(timed(step, fused, clock))
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"fused_s": times[True], "unfused_s": times[False], "median_fused_s": med[True],
               "median_unfused_s": med[False], "ratio_fused_over_unfused": med[True] / med[False]}
        print(f"{quantize}: median step fused {med[True]:.2f} s, unfused {med[False]:.2f} s, "
              f"ratio {row['ratio_fused_over_unfused']:.3f} (fused {[round(t, 2) for t in times[True]]}, "
              f"unfused {[round(t, 2) for t in times[False]]})")
        if args.profile:
            on, off = op_totals(step, True), op_totals(step, False)
            keys = sorted(set(on) | set(off), key=lambda k: -abs(on.get(k, (0, 0))[0] - off.get(k, (0, 0))[0]))
            print(f"{'op':<50}{'fused s':>9}{'calls':>7}{'unfused s':>11}{'calls':>7}")
            for key in keys[:15]:
                (a, ca), (b, cb) = on.get(key, (0.0, 0)), off.get(key, (0.0, 0))
                print(f"{key[:49]:<50}{a:>9.3f}{ca:>7}{b:>11.3f}{cb:>7}")
            total = {k: sum(v[0] for v in d.values()) for k, d in (("fused", on), ("unfused", off))}
            print(f"{'self CPU total':<50}{total['fused']:>9.3f}{'':>7}{total['unfused']:>11.3f}")
            row["profile"] = {"fused": {k: v for k, v in on.items() if v[0] > 0.01},
                              "unfused": {k: v for k, v in off.items() if v[0] > 0.01}}
        results[quantize] = row
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
