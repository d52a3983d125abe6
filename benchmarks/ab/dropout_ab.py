"""What LoRA dropout 0.05 costs a training step, measured in one process where the machine's noise is smallest.

    python benchmarks/ab/dropout_ab.py --checkpoint_dir checkpoints/SmolLM2-135M-Instruct [--quantize none] [--rounds 10]

Builds one_step.py's `litqlora finetune` step twice (r 8 on every linear, 4x512, activation checkpointing unless
--no_checkpointing), with dropout 0.05 and 0, and times the two alternately, one step each per round, after a
warm-up step of each. Reports each round's ratio and their median. `benchmarks/speed/cli_ab.py` measures the same
through the CLI, whose separate processes add +-5% run to run here. Results: benchmarks/ab/results/dropout_ab.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speed"))
import one_step  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--quantize", choices=["nf4", "none"], default="none")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--no_checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "dropout_ab.json")
    args = parser.parse_args()

    steps = {}
    for dropout in (0.05, 0.0):
        steps[dropout] = one_step.build_step(args.checkpoint_dir, args.quantize, args.batch, args.seq,
                                             args.checkpointing, dropout)[2]
        steps[dropout]()  # warm-up: optimizer state, kernels compiled and checked
    seconds: dict[float, list[float]] = {0.05: [], 0.0: []}
    for _ in range(args.rounds):
        for dropout, step in steps.items():
            start = time.perf_counter()
            step()
            seconds[dropout].append(time.perf_counter() - start)
    ratios = [a / b for a, b in zip(seconds[0.05], seconds[0.0])]
    record = {
        "command": f"python benchmarks/ab/dropout_ab.py --checkpoint_dir {args.checkpoint_dir} --quantize {args.quantize}"
                   f" --rounds {args.rounds}" + ("" if args.checkpointing else " --no_checkpointing"),
        "shape": f"{args.batch}x{args.seq}", "checkpointing": args.checkpointing,
        "step_seconds": {"dropout_0.05": [round(s, 3) for s in seconds[0.05]],
                         "dropout_0": [round(s, 3) for s in seconds[0.0]]},
        "ratios": [round(r, 4) for r in ratios],
        "median_cost_percent": round(100 * (statistics.median(ratios) - 1), 2),
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
