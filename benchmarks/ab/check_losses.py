"""Behaviour check for refactors: the demo recipe's first optimizer steps must give bit-for-bit the losses recorded
before (benchmarks/ab/results/house_baseline_losses.json).

    python benchmarks/ab/check_losses.py            # runs the 3-step demo recipe in a temporary directory, compares
    python benchmarks/ab/check_losses.py --record   # records this CPU's rows (run it on the commit before a change)

bf16 matmuls round differently with AMX, AVX512-BF16 and emulated bf16 (`--precision auto` picks fp32 on AVX2), so
the record is kept per CPU kind (`cpu_kind`): a refactor is checked against the rows of the kind it runs on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

RECORDED = Path(__file__).with_name("results") / "house_baseline_losses.json"
COMMAND = ["litqlora", "finetune", "--config", "config_hub/finetune/smollm2-135m/qlora.yaml", "--train.max_steps", "3"]
KEYS = ("step", "loss", "lr", "grad_norm", "tokens")


def cpu_kind() -> str:
    """The CPU's bf16 ISA as the demo's matmuls see it: amx, avx512_bf16, or avx512 / avx2 (bf16 emulated)."""
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return next((kind for kind, flag in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"),
                                         ("avx2", "avx2")) if flag in flags), "other")


def demo_rows() -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([*COMMAND, "--out_dir", out], check=True)
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in KEYS} for r in rows if "loss" in r]


def main() -> int:
    recorded = json.loads(RECORDED.read_text())
    kind = cpu_kind()
    if "--record" in sys.argv:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        recorded["by_cpu"][kind] = {"recorded_at_commit": commit, "rows": demo_rows()}
        RECORDED.write_text(json.dumps(recorded, indent=2) + "\n")
        print(f"recorded the {kind} rows at {commit}")
        return 0
    if kind not in recorded["by_cpu"]:
        print(f"no rows recorded for a {kind} CPU (recorded: {', '.join(recorded['by_cpu'])}): run this with "
              "--record on the commit before the change, then without it after")
        return 2
    want_rows = recorded["by_cpu"][kind]["rows"]
    got = demo_rows()
    for want, have in zip(want_rows, got):
        print(f"step {want['step']}: recorded loss {want['loss']!r}, now {have['loss']!r}")
    same = got == want_rows
    print(f"{'identical' if same else 'DIFFERENT'} ({kind} CPU, recorded at {recorded['by_cpu'][kind]['recorded_at_commit']})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
