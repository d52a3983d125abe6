"""The demo recipe's throughput beside one competing 2-thread job, against its quiet throughput (issue 16 item 6).

    python benchmarks/contention.py [--rounds 2] [--steps 8] [--env OMP_WAIT_POLICY=ACTIVE ...]

Each round runs `litqlora finetune --config config_hub/finetune/smollm2-135m/qlora.yaml` (the demo's settings,
--train.max_steps STEPS, no checkpoints) twice: alone, then beside a competitor, a separate process multiplying
1024x1024 float matrices on 2 threads for as long as the fine-tune runs (a test suite or a second fine-tune on a
laptop). Throughput: the median tokens/s of the optimizer steps after the first (metrics.jsonl). `--env` sets
variables for the fine-tune only (e.g. to compare OpenMP wait policies). Results: benchmarks/results/contention.json.
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
ROOT = HERE.parent
COMPETITOR = ("import torch\ntorch.set_num_threads(2)\na = torch.randn(1024, 1024)\n"
              "while True:\n    a = (a @ a).clamp_(-1, 1)\n")


def finetune_tokens_per_sec(out_dir: Path, steps: int, env: dict) -> float:
    cmd = [sys.executable, "-m", "lit_qlora.cli", "finetune", "--config",
           str(ROOT / "config_hub/finetune/smollm2-135m/qlora.yaml"), "--out_dir", str(out_dir),
           "--train.max_steps", str(steps), "--train.save_interval", str(steps)]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r and r.get("step", 0) > 1]
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the fine-tune")
    args = parser.parse_args()
    env = dict(kv.split("=", 1) for kv in args.env)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for loaded in (False, True):
                competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR]) if loaded else None
                try:
                    rate = finetune_tokens_per_sec(Path(tmp) / f"r{round_}{int(loaded)}", args.steps, env)
                finally:
                    if competitor is not None:
                        competitor.kill()
                        competitor.wait()
                runs.append({"round": round_, "competitor": loaded, "tokens_per_sec": round(rate, 1)})
                print(json.dumps(runs[-1]), flush=True)
    quiet = statistics.median(r["tokens_per_sec"] for r in runs if not r["competitor"])
    loaded = statistics.median(r["tokens_per_sec"] for r in runs if r["competitor"])
    result = {"env": env, "steps": args.steps, "runs": runs, "quiet_tokens_per_sec": quiet,
              "loaded_tokens_per_sec": loaded, "loaded_over_quiet": round(loaded / quiet, 3)}
    print(json.dumps(result))
    out = HERE / "results" / "contention.json"
    previous = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps([*previous, result], indent=2) + "\n")


if __name__ == "__main__":
    main()
