"""`make demo`'s wall time as a new user meets it, on this CPU and capped at AVX2 (issue 27 items 2 and 7).

    python benchmarks/speed/demo_time.py [--isa native avx2] [--rounds 1] [--precision auto]

Each run starts in an empty directory, so it pays what a fresh clone pays: the bundled SmolLM2's GGUF conversion,
the 20-step QLoRA fine-tune of config_hub/finetune/smollm2-135m/qlora.yaml (validation and exports included) and
`make demo`'s two answers (`litqlora generate --compare_base true`). `--isa avx2` caps torch (ATen and oneDNN) and
our C kernels at AVX2 (lit_qlora.base.hardware.AVX2_ENV), as on an AVX2-only laptop or VM. The install (~1.5 minutes,
pip) is not included. Per run: each phase's seconds, the precision auto chose, the fine-tune's tokens/s and losses,
and the answer. Results: benchmarks/speed/results/demo_time.json (with the CPU's name and its ISA flags).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.speed.compile_speed import cpu_name  # noqa: E402
from lit_qlora.base.hardware import AVX2_ENV  # noqa: E402  (light: no torch)

PRESET = ROOT / "config_hub/finetune/smollm2-135m/qlora.yaml"
QUESTION = "What is the capital of Austria?"  # the Makefile's


def cpu_flags() -> list[str]:
    try:
        flags = next(line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"))


def timed(cmd: list[str], cwd: Path, env: dict) -> tuple[float, str]:
    started = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True, text=True)
    return time.perf_counter() - started, out.stdout


def run(isa: str, precision: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in AVX2_ENV}
    if isa == "avx2":
        env.update(AVX2_ENV)
    cli = [sys.executable, "-m", "lit_qlora.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        finetune_s, printed = timed([*cli, "finetune", "--config", str(PRESET), "--precision", precision,
                                     "--resume", "auto"], cwd, env)
        answer_s, answer = timed([*cli, "generate", "--checkpoint_dir", "checkpoints/SmolLM2-135M-Instruct",
                                  "--adapter_dir", "out/finetune/smollm2-135m-qlora", "--prompt", QUESTION,
                                  "--compare_base", "true"], cwd, env)
        summary = json.loads((cwd / "out/finetune/smollm2-135m-qlora/summary.json").read_text())
    converting = "Converting the bundled" in printed
    return {"isa": isa, "precision": summary["precision"], "precision_reason": summary["precision_reason"],
            "converted_gguf": converting, "finetune_seconds": round(finetune_s, 1),
            "answers_seconds": round(answer_s, 1), "total_seconds": round(finetune_s + answer_s, 1),
            "train_wall_seconds": round(summary["wall_seconds"], 1), "tokens_per_sec": round(summary["tokens_per_sec"], 1),
            "initial_val_loss": round(summary["initial_val_loss"], 4), "val_loss": round(summary["val_loss"], 4),
            "answer": answer.strip().splitlines()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", nargs="+", default=["native", "avx2"], choices=["native", "avx2"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--precision", default="auto")
    args = parser.parse_args()
    runs = []
    for round_ in range(args.rounds):
        for isa in args.isa:
            runs.append({"round": round_, **run(isa, args.precision)})
            print(json.dumps(runs[-1]), flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(),
              "load_average": os.getloadavg()[0], "runs": runs}
    out = HERE / "results" / "demo_time.json"
    previous = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps([*previous, result], indent=2) + "\n")


if __name__ == "__main__":
    main()
