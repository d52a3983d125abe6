"""Where one training step's time goes: torch.profiler CPU time by op, plus the heap-release calls.

    python benchmarks/speed/step_profile.py --checkpoint_dir checkpoints/SmolLM2-135M-Instruct --quantize nf4

Runs one warm-up step of one_step.py's `litqlora finetune` step (activation checkpointing unless
--no_checkpointing) and profiles the next. Prints the wall time, the number and total time of the
malloc_trim calls (not torch ops, so invisible to the profiler) and the top ops by self CPU time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lit_qlora  # noqa: F401  (before torch: sets the OpenMP wait policy `litqlora` runs with, read as libgomp loads)
from torch.profiler import ProfilerActivity, profile

import torch

import lit_qlora.train.heap as heap
import one_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--quantize", choices=["nf4", "none"], default="nf4")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                        help="fp32 where the CPU has no bf16 arithmetic (AVX2: bf16 matmuls run ~300x slower)")
    parser.add_argument("--no_checkpointing", dest="checkpointing", action="store_false")
    args = parser.parse_args()

    trims = [0, 0.0]
    release = heap.release_free_memory

    def timed_release(*a) -> None:
        t = time.perf_counter()
        release(*a)
        trims[0] += 1
        trims[1] += time.perf_counter() - t

    heap.release_free_memory = timed_release  # what HeapTrimmer calls when it trims
    _, _, step = one_step.build_step(args.checkpoint_dir, args.quantize, args.batch, args.seq, args.checkpointing,
                                     dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    step()
    trims[:] = [0, 0.0]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    print(f"{Path(args.checkpoint_dir).name} {args.batch}x{args.seq} ckpt={'on' if args.checkpointing else 'off'} "
          f"{args.quantize} {args.dtype}: wall {wall:.2f} s, "
          f"{trims[0]} heap releases taking {trims[1]:.3f} s ({100 * trims[1] / wall:.1f}%)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=45))


if __name__ == "__main__":
    main()
