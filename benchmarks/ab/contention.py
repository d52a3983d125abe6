"""The demo recipe's throughput beside one competing 2-thread job, against its quiet throughput (issue 16 item 6).

    python benchmarks/ab/contention.py [--rounds 2] [--steps 8] [--variants shipped GOMP_SPINCOUNT=300000 ...]

Each round runs `litqlora finetune --config config_hub/finetune/smollm2-135m/qlora.yaml` (the demo's settings,
--train.max_steps STEPS, no checkpoints) once per variant alone, then once per variant beside a competitor: a
separate process multiplying 1024x1024 float matrices on 2 threads for as long as the fine-tune runs (a test suite
or a second fine-tune on a laptop). A variant is `shipped` (the environment as it is) or KEY=VALUE[,KEY=VALUE]
set for the fine-tune only, e.g. `GOMP_SPINCOUNT=300000` for libgomp's own spin default (a user's setting of it
overrides the short spin lit_qlora/__init__.py sets). Throughput: the median tokens/s of the optimizer steps
after the first (metrics.jsonl). Results: benchmarks/ab/results/contention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
COMPETITOR = ("import torch\ntorch.set_num_threads(2)\na = torch.randn(1024, 1024)\n"
              "while True:\n    a = (a @ a).clamp_(-1, 1)\n")
# Variables this benchmark may vary; cleared for the fine-tune unless the variant sets them.
OPENMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


def variant_env(variant: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS}
    if variant != "shipped":
        env.update(kv.split("=", 1) for kv in variant.split(","))
    return env


def finetune_tokens_per_sec(out_dir: Path, steps: int, env: dict) -> float:
    cmd = [sys.executable, "-m", "lit_qlora.cli", "finetune", "--config",
           str(ROOT / "config_hub/finetune/smollm2-135m/qlora.yaml"), "--out_dir", str(out_dir),
           "--train.max_steps", str(steps), "--train.save_interval", str(steps)]
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r and r.get("step", 0) > 1]
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--variants", nargs="+", default=["shipped"], help="shipped, or KEY=VALUE[,KEY=VALUE]")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for loaded in (False, True):
                for i, variant in enumerate(args.variants):
                    competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR]) if loaded else None
                    try:
                        rate = finetune_tokens_per_sec(Path(tmp) / f"r{round_}{int(loaded)}v{i}", args.steps,
                                                       variant_env(variant))
                    finally:
                        if competitor is not None:
                            competitor.kill()
                            competitor.wait()
                    runs.append({"round": round_, "variant": variant, "competitor": loaded,
                                 "tokens_per_sec": round(rate, 1)})
                    print(json.dumps(runs[-1]), flush=True)
    results = []
    for variant in args.variants:
        mine = [r for r in runs if r["variant"] == variant]
        quiet = statistics.median(r["tokens_per_sec"] for r in mine if not r["competitor"])
        loaded = statistics.median(r["tokens_per_sec"] for r in mine if r["competitor"])
        results.append({"variant": variant, "steps": args.steps, "runs": mine, "quiet_tokens_per_sec": quiet,
                        "loaded_tokens_per_sec": loaded, "loaded_over_quiet": round(loaded / quiet, 3)})
        print(json.dumps(results[-1]))
    out = HERE / "results" / "contention.json"
    previous = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps([*previous, *results], indent=2) + "\n")


if __name__ == "__main__":
    main()
