"""`litqlora finetune --compile force` against eager on SmolLM2: warm-up, steady tokens/s, and whether compiling on a
CPU pays for itself (issue 27 item 3: `--compile true` is refused on CPU on these figures).

    python benchmarks/speed/compile_speed.py [--rounds 1] [--steps 6] [--kinds qlora] [--isa native avx2] [--cold]
                                       [--timeout 900] [--shape preset|preset-512|4x512]

Each round runs, for each preset (config_hub/finetune/smollm2-135m/{lora,qlora}.yaml: dropout 0.05, precision auto)
and each ISA setting (native, or capped at AVX2 by lit_qlora.base.hardware.AVX2_ENV), eager then compiled, alternating so
that a shared machine's load falls on both alike. `--shape preset` keeps the preset's batches (4 x up to 256
tokens, unpacked: each micro-batch's length differs), `preset-512` the same up to 512 tokens, `4x512` packs 4x512 with
activation checkpointing. `--cold` gives
every compiled run an empty inductor cache (TORCHINDUCTOR_CACHE_DIR), as a first run on a user's machine has. A run
still compiling after `--timeout` seconds is stopped and recorded as such. Per run: the median tokens/s of the steps
after the warm-up (metrics.jsonl: steps after the first that compiled nothing), summary.json's compile_seconds and
first_step_seconds, each step's seconds, and the whole process's wall time. Results:
benchmarks/speed/results/compile_speed.json (with the CPU's name and ISA).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
from lit_qlora.base.hardware import AVX2_ENV  # noqa: E402  (light: no torch)

SHAPES = {
    "preset": [],
    "preset-512": ["--train.max_seq_length", "512"],  # the preset's batches (unpacked) up to 512 tokens
    "4x512": ["--train.micro_batch_size", "4", "--train.global_batch_size", "4", "--train.max_seq_length", "512",
              "--data.packing", "true", "--train.activation_checkpointing", "true"],
}


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def run(kind: str, compile: bool, steps: int, out_dir: Path, isa: str, cold: bool, timeout: float,
        shape: str) -> dict:
    cmd = [sys.executable, "-m", "lit_qlora.cli", "finetune", "--config",
           str(ROOT / f"config_hub/finetune/smollm2-135m/{kind}.yaml"), "--out_dir", str(out_dir),
           "--train.max_steps", str(steps), "--train.save_interval", str(steps), *SHAPES[shape],
           "--compile", "force" if compile else "false"]
    env = {k: v for k, v in os.environ.items() if k not in AVX2_ENV}
    if isa == "avx2":
        env.update(AVX2_ENV)
    if compile:
        env["TORCH_LOGS"] = "recompiles"  # each recompilation and the guard that failed, on stderr
    with tempfile.TemporaryDirectory() as cache:
        if cold:
            env["TORCHINDUCTOR_CACHE_DIR"] = cache
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env=env, timeout=timeout)
            if proc.returncode:
                raise RuntimeError(proc.stderr[-3000:])
            finished, stderr = True, proc.stderr
        except subprocess.TimeoutExpired as e:
            finished, stderr = False, (e.stderr or b"").decode(errors="replace")
        wall = time.perf_counter() - started
    metrics = out_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    result = {"kind": kind, "isa": isa, "compile": compile, "cold": cold, "finished": finished,
              "wall_seconds": round(wall, 1), "steps_done": len(rows),
              "step_seconds": [round(r["tokens"] / r["tokens_per_sec"], 1) for r in rows],
              "step_compile_seconds": [r.get("compile_seconds") for r in rows],
              "losses": [None if r["loss"] is None else round(r["loss"], 4) for r in rows]}
    if compile:
        result["recompiles"] = recompile_causes(stderr)
    steady = [r["tokens_per_sec"] for r in rows[1:] if not r.get("compile_seconds")]
    result["steady_tokens_per_sec"] = round(statistics.median(steady), 1) if steady else None
    if finished:
        summary = json.loads((out_dir / "summary.json").read_text())
        result.update(precision=summary.get("precision"), compile_seconds=summary["compile_seconds"],
                      first_step_seconds=round(summary["first_step_seconds"], 1))
    return result


def recompile_causes(stderr: str) -> dict[str, int]:
    """TORCH_LOGS=recompiles' reports, counted by the first guard that failed: a new tensor size (a new sequence
    length or batch size: dynamo then makes that dimension dynamic), another NF4 weight's metadata (a LoRA or NF4
    frame first met with another projection's weight shape), the fused-projection arity (q/k/v vs gate/up), other."""
    causes: dict[str, int] = {}
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if "Recompiling function" not in line:
            continue
        guard = next((x for x in lines[i + 1 : i + 4] if " - " in x and "/" in x.split(" - ", 1)[1][:8]), "")
        kind = ("new size" if "size mismatch" in guard or "<=" in guard or "==" in guard and "size()" in guard
                else "NF4 weight metadata" if "check_metadata" in guard
                else "fused-projection arity" if "len(modules)" in guard else "other")
        causes[kind] = causes.get(kind, 0) + 1
    return causes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kinds", nargs="+", default=["qlora"])
    parser.add_argument("--isa", nargs="+", default=["native"], choices=["native", "avx2"])
    parser.add_argument("--cold", action="store_true", help="an empty inductor cache for every run")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a run is stopped")
    parser.add_argument("--shape", default="preset", choices=sorted(SHAPES))
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for isa in args.isa:
                for kind in args.kinds:
                    for compile in (False, True):
                        out_dir = Path(tmp) / f"{kind}-{isa}-{compile}-{round_}"
                        runs.append({"round": round_, **run(kind, compile, args.steps, out_dir, isa, args.cold,
                                                            args.timeout, args.shape)})
                        print(json.dumps(runs[-1]), flush=True)
    ratios = {}
    for isa in args.isa:
        for kind in args.kinds:
            rate = {c: [r["steady_tokens_per_sec"] for r in runs if (r["kind"], r["isa"], r["compile"]) == (kind, isa, c)
                        and r["steady_tokens_per_sec"]] for c in (False, True)}
            if rate[False] and rate[True]:
                ratios[f"{kind}/{isa}"] = round(statistics.median(rate[True]) / statistics.median(rate[False]), 3)
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cores": os.cpu_count(), "steps": args.steps,
              "shape": args.shape, "cold": args.cold, "runs": runs, "compiled_over_eager": ratios}
    print(json.dumps({"compiled_over_eager": ratios}))
    out = HERE / "results" / "compile_speed.json"
    previous = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps([*previous, result], indent=2) + "\n")


if __name__ == "__main__":
    main()
