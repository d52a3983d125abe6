"""`litqlora finetune --compile true` against eager on SmolLM2 (issue 16 item 1): steady tokens/s and compile time.

    python benchmarks/compile_speed.py [--rounds 2] [--steps 6] [--kinds lora qlora]

Each round runs, for each preset (config_hub/finetune/smollm2-135m/{lora,qlora}.yaml: dropout 0.05), eager then
compiled, alternating so that a shared machine's load falls on both alike: 4x512 packed, activation checkpointing
on, `--train.max_steps STEPS`, one checkpoint at the end. Per run: the median tokens/s of the steps after the
warm-up (metrics.jsonl: steps after the first that compiled nothing), summary.json's compile_seconds and
first_step_seconds, and the whole process's wall time. Results: benchmarks/results/compile_speed.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHAPE = ["--train.micro_batch_size", "4", "--train.global_batch_size", "4", "--train.max_seq_length", "512",
         "--data.packing", "true", "--train.activation_checkpointing", "true"]


def run(kind: str, compile: bool, steps: int, out_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "lit_qlora.cli", "finetune", "--config",
           str(ROOT / f"config_hub/finetune/smollm2-135m/{kind}.yaml"), "--out_dir", str(out_dir),
           "--train.max_steps", str(steps), "--train.save_interval", str(steps), *SHAPE,
           "--compile", str(compile).lower()]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_sec"] for r in rows[1:] if not r.get("compile_seconds")]
    summary = json.loads((out_dir / "summary.json").read_text())
    return {"kind": kind, "compile": compile, "steady_tokens_per_sec": round(statistics.median(steady), 1),
            "steady_steps": len(steady), "compile_seconds": summary["compile_seconds"],
            "first_step_seconds": round(summary["first_step_seconds"], 1), "wall_seconds": round(wall, 1),
            "losses": [round(r["loss"], 4) for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kinds", nargs="+", default=["lora", "qlora"])
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for kind in args.kinds:
                for compile in (False, True):
                    out_dir = Path(tmp) / f"{kind}-{compile}-{round_}"
                    runs.append({"round": round_, **run(kind, compile, args.steps, out_dir)})
                    print(json.dumps(runs[-1]), flush=True)
    ratios = {}
    for kind in args.kinds:
        rate = {c: statistics.median(r["steady_tokens_per_sec"] for r in runs
                                     if r["kind"] == kind and r["compile"] == c) for c in (False, True)}
        ratios[kind] = round(rate[True] / rate[False], 3)
    result = {"steps": args.steps, "runs": runs, "compiled_over_eager": ratios}
    print(json.dumps({"compiled_over_eager": ratios}))
    out = HERE / "results" / "compile_speed.json"
    previous = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps([*previous, result], indent=2) + "\n")


if __name__ == "__main__":
    main()
