"""Variants of the SmolLM2 preset through `litqlora finetune`, alternating, in one session (issue 16's "Done when"):
QLoRA vs LoRA with checkpointing on and off, what dropout 0.05 costs, and what the short OpenMP spin changes quiet.

    python benchmarks/speed/cli_ab.py [--rounds 2] [--steps 6] [--variants lora qlora lora_ckpt_off ...] [--avx2]

Every variant is config_hub/finetune/smollm2-135m/lora.yaml (dropout 0.05) at 4x512 packed, plus its own flags
below; each round runs every variant once, in order, so a shared machine's load falls on all alike. Per run: the
median tokens/s of the steps after the first (metrics.jsonl; a compiled run: after its warm-up), summary.json's
whole-process peak RSS. Each ratio is reported as the median of its per-round ratios with their range, so one noisy
round shows as spread instead of moving the answer. `--avx2` runs every variant under lit_qlora.base.hardware.AVX2_ENV
(the cap that makes this CPU behave like an AVX2-only one). Results: benchmarks/speed/results/cli_ab.json.
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
sys.path.insert(0, str(ROOT))
from lit_qlora.base.hardware import AVX2_ENV  # noqa: E402
SHAPE = ["--train.micro_batch_size", "4", "--train.global_batch_size", "4", "--train.max_seq_length", "512",
         "--data.packing", "true"]
VARIANTS = {
    "lora": ["--quantize", "none", "--train.activation_checkpointing", "true"],
    "qlora": ["--quantize", "nf4", "--train.activation_checkpointing", "true"],
    "lora_ckpt_off": ["--quantize", "none", "--train.activation_checkpointing", "false"],
    "qlora_ckpt_off": ["--quantize", "nf4", "--train.activation_checkpointing", "false"],
    "lora_dropout0": ["--quantize", "none", "--train.activation_checkpointing", "true", "--lora.dropout", "0"],
    "lora_compiled": ["--quantize", "none", "--train.activation_checkpointing", "true", "--compile", "true"],
    "qlora_compiled": ["--quantize", "nf4", "--train.activation_checkpointing", "true", "--compile", "true"],
    "lora_spin": ["--quantize", "none", "--train.activation_checkpointing", "true"],
    "qlora_spin": ["--quantize", "nf4", "--train.activation_checkpointing", "true"],
}
# libgomp's own default (workers spin ~3 ms after each op) instead of the short spin lit_qlora/__init__.py sets
ENVS = {"lora_spin": {"GOMP_SPINCOUNT": "300000"}, "qlora_spin": {"GOMP_SPINCOUNT": "300000"}}
RATIOS = [("qlora", "lora"), ("qlora_ckpt_off", "lora_ckpt_off"), ("lora", "lora_dropout0"),
          ("lora_compiled", "lora"), ("qlora_compiled", "qlora"), ("lora", "lora_spin"), ("qlora", "qlora_spin")]


def cpu_label(capped: bool) -> str:
    """The CPU's bf16-relevant flags (lscpu's names), and the cap the variants ran under."""
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0].split()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return " ".join(isa) + (" (under the AVX2 cap)" if capped else "")


def run(variant: str, steps: int, out_dir: Path, cap: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "lit_qlora.cli", "finetune", "--config",
           str(ROOT / "config_hub/finetune/smollm2-135m/lora.yaml"), "--out_dir", str(out_dir),
           "--train.max_steps", str(steps), "--train.save_interval", str(steps), *SHAPE, *VARIANTS[variant]]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**env, **cap, **ENVS.get(variant, {})})
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_sec"] for r in rows[1:] if not r.get("compile_seconds")]
    summary = json.loads((out_dir / "summary.json").read_text())
    return {"variant": variant, "tokens_per_sec": round(statistics.median(steady), 1),
            "peak_rss_gib": round(summary["peak_rss_bytes"] / 2**30, 3), "load": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS)[:5], choices=list(VARIANTS))
    parser.add_argument("--avx2", action="store_true", help="run every variant under the AVX2 cap")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "cli_ab.json")
    args = parser.parse_args()
    cap = AVX2_ENV if args.avx2 else {}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for variant in args.variants:
                row = {"round": round_, **run(variant, args.steps, Path(tmp) / f"{variant}-{round_}", cap)}
                runs.append(row)
                print(json.dumps(row), flush=True)
    medians = {v: statistics.median(r["tokens_per_sec"] for r in runs if r["variant"] == v) for v in args.variants}
    speed = {(r["round"], r["variant"]): r["tokens_per_sec"] for r in runs}
    ratios, spread = {}, {}
    for a, b in RATIOS:
        if a in medians and b in medians:
            per_round = [speed[i, a] / speed[i, b] for i in range(args.rounds)]
            ratios[f"{a}/{b}"] = round(statistics.median(per_round), 3)
            spread[f"{a}/{b}"] = [round(min(per_round), 3), round(max(per_round), 3)]
    record = {"command": "python benchmarks/speed/cli_ab.py " + " ".join(sys.argv[1:]), "steps": args.steps,
              "cpu": cpu_label(args.avx2), "runs": runs, "median_tokens_per_sec": medians,
              "ratios": ratios, "ratio_range": spread}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({"median_tokens_per_sec": medians, "ratios": ratios, "ratio_range": spread}, indent=2))


if __name__ == "__main__":
    main()
