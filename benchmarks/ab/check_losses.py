"""Behaviour check for refactors: the demo recipe's first optimizer steps must give bit-for-bit the losses recorded
before (benchmarks/ab/results/house_baseline_losses.json).

    python benchmarks/ab/check_losses.py            # runs the 3-step demo recipe in a temporary directory, compares
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

RECORDED = Path(__file__).with_name("results") / "house_baseline_losses.json"


def main() -> int:
    recorded = json.loads(RECORDED.read_text())
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(["litqlora", "finetune", "--config", "config_hub/finetune/smollm2-135m/qlora.yaml",
                        "--train.max_steps", "3", "--out_dir", out], check=True)
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "loss", "lr", "grad_norm", "tokens")
    got = [{k: r[k] for k in keys} for r in rows]
    for want, have in zip(recorded["rows"], got):
        print(f"step {want['step']}: recorded loss {want['loss']!r}, now {have['loss']!r}")
    same = got == recorded["rows"]
    print("identical" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
