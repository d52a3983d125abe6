"""The GRPO demo on real weights (issue 49): the presets as a user runs them, SFT then GRPO on the bundled
SmolLM2-135M-Instruct, and what GRPO changed on the held-out prompts.

    python benchmarks/grpo/demo.py [--out_dir out/bench/grpo]

Runs `litqlora finetune --config config_hub/grpo/smollm2-135m/sft.yaml`, then `litqlora grpo --config
config_hub/grpo/smollm2-135m/qlora.yaml` from its adapter, and records in benchmarks/grpo/results/demo.json: each
held-out reward before and after (greedy completions of the validation prompts, from summary.json), one held-out
prompt's completion before and after (samples.jsonl), the reward of the training steps as they went, each command's
wall time, the GRPO steps' tokens/s (generation included) and peak RSS, and the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def cpu_flags() -> str:
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0].split()
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def timed(cmd: list[str]) -> float:
    started = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return round(time.time() - started, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", type=Path, default=Path("out/bench/grpo"))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "demo.json")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "lit_qlora.cli"]
    sft, run = args.out_dir / "sft", args.out_dir / "grpo"
    sft_seconds = timed([*cli, "finetune", "--config", "config_hub/grpo/smollm2-135m/sft.yaml", "--out_dir", str(sft),
                         "--overwrite", "true"])
    grpo_seconds = timed([*cli, "grpo", "--config", "config_hub/grpo/smollm2-135m/qlora.yaml", "--out_dir", str(run),
                          "--train.init_adapter", str(sft), "--overwrite", "true"])
    summary = json.loads((ROOT / run / "summary.json").read_text())
    samples = [json.loads(line) for line in (ROOT / run / "samples.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (ROOT / run / "metrics.jsonl").read_text().splitlines()]
    held_out = {k[len("eval_"):]: [round(summary[f"initial_{k}"], 4), round(summary[k], 4)]
                for k in summary if k.startswith("eval_") and k.endswith(("reward", "/mean"))}
    record = {
        "command": "python benchmarks/grpo/demo.py " + " ".join(sys.argv[1:]), "cpu": cpu_flags(),
        "cores": os.cpu_count(), "held_out_before_after": held_out,
        "held_out_prompt": samples[0].get("prompt_text", samples[0]["prompt"]),
        "completion_before_after": [samples[0]["reply"], samples[-1]["reply"]],
        "train_reward_by_step": [round(r["reward"], 4) for r in rows if "loss" in r],
        "sft_wall_seconds": sft_seconds, "grpo_wall_seconds": grpo_seconds,
        "grpo_tokens_per_sec": round(summary["tokens_per_sec"], 1),
        "grpo_peak_rss_gib": round(summary["peak_rss_bytes"] / 2**30, 3),
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
