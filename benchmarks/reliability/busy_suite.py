"""`make test` on a fresh clone beside a busy loop (issue 47's "Done when"): users run the suite on machines doing
other work, and every test that observes the machine (thread counts, timings, a pty) must still hold.

    python benchmarks/reliability/busy_suite.py [--busy 2] [--clone /tmp/busy-suite]

Clones this repository's HEAD into a fresh folder (a fresh venv through the Makefile, as a new user gets), starts
`--busy` processes that spin on a CPU each, runs `make test` there in a fresh venv (as .ci/run does), stops the spinners, and records the pytest summary
line, the wall time, the CPU and the load average in benchmarks/reliability/results/busy_suite.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def cpu_flags() -> str:
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0].split()
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, default=2, help="spinning processes beside the suite")
    parser.add_argument("--clone", type=Path, default=Path("/tmp/busy-suite"))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "busy_suite.json")
    args = parser.parse_args()
    shutil.rmtree(args.clone, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(args.clone)], check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.clone, capture_output=True, text=True,
                            check=True).stdout.strip()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    started, loads = time.time(), []
    try:
        # as CI does it (.ci/run): a fresh venv in the clone, then the README's `make test`
        proc = subprocess.Popen(["bash", "-c", "python3 -m venv .venv && . .venv/bin/activate && make test"],
                                cwd=args.clone, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"})
        lines = []
        for line in proc.stdout:
            lines.append(line)
            loads.append(os.getloadavg()[0])
        proc.wait()
    finally:
        for spinner in spinners:
            spinner.kill()
    summary = next((line.strip() for line in reversed(lines) if re.search(r"\d+ (passed|failed)", line)), "")
    failed = [line.strip() for line in lines if line.startswith("FAILED")]
    record = {"command": "python benchmarks/reliability/busy_suite.py " + " ".join(sys.argv[1:]), "commit": commit,
              "busy_processes": args.busy, "cpu": cpu_flags(), "cores": os.cpu_count(), "exit": proc.returncode,
              "pytest": summary, "failed": failed, "wall_minutes": round((time.time() - started) / 60, 1),
              "load_average_max": round(max(loads, default=0), 2)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
