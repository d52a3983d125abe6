"""The DPO (or KTO) demo preset, run as a user runs it, with what it reached recorded (issue 40 item 5, issue 55).

    python benchmarks/preference/dpo_demo.py [--method dpo|kto] [--isa native avx2] [--precision auto]

Runs `litqlora dpo --config config_hub/dpo/smollm2-135m/qlora.yaml` (QLoRA on the bundled SmolLM2-135M-Instruct,
the shipped demo pairs, their held-out 10%; with --method kto, `litqlora kto` on its preset and the demo's unpaired
rows, and the held-out rows' rewards) in an empty directory, once per ISA setting (`avx2` caps torch and our C
kernels at AVX2, lit_qlora.base.hardware.AVX2_ENV). Records, from the run's summary.json and samples.jsonl: the held-out
pairs' reward accuracy (TRL's rewards/accuracies) and the share where the policy finds the chosen answer likelier
(logps/accuracies), before the first step and after the last; the validation loss (log 2 before: the policy starts as
the reference); the held-out question's greedy answer before and after; tokens/s, peak RSS and wall time.
Results: benchmarks/preference/results/{dpo,kto}_demo.json and .md, with the CPU's name and ISA flags.
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
from benchmarks.speed.demo_time import cpu_flags  # noqa: E402
from lit_qlora.base.hardware import AVX2_ENV  # noqa: E402  (light: no torch)

# Per method: its preset, the preset's out_dir, the held-out numbers recorded (the first three in the table), and
# what is held out.
METHODS = {
    "dpo": ("config_hub/dpo/smollm2-135m/qlora.yaml", "out/dpo/smollm2-135m-qlora",
            ("rewards/accuracies", "logps/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected"),
            "the 43 validation pairs"),
    "kto": ("config_hub/kto/smollm2-135m/qlora.yaml", "out/kto/smollm2-135m-qlora",
            ("rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"),
            "the 43 validation rows: 23 desirable, 20 undesirable"),
}
METHOD = "dpo"  # set by --method
PRESET, OUT, KEYS, HELD_OUT = ROOT / METHODS[METHOD][0], *METHODS[METHOD][1:]


def run(isa: str, precision: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in AVX2_ENV}
    if isa == "avx2":
        env.update(AVX2_ENV)
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "lit_qlora.cli", METHOD, "--config", str(PRESET), "--precision",
                        precision], cwd=cwd, env=env, check=True, capture_output=True, text=True)
        wall = time.perf_counter() - started
        summary = json.loads((cwd / OUT / "summary.json").read_text())
        samples = [json.loads(line) for line in (cwd / OUT / "samples.jsonl").read_text().splitlines() if line]
    return {
        "isa": isa, "precision": summary["precision"], "wall_seconds": round(wall, 1), "steps": summary["steps"],
        "val_loss": [summary["initial_val_loss"], summary["val_loss"]],
        **{f"held_out {k}": [summary[f"initial_eval_{k}"], summary[f"eval_{k}"]] for k in KEYS},
        "tokens_per_sec": summary["tokens_per_sec"], "peak_rss_gib": summary["peak_rss_bytes"] / 1024**3,
        "question": samples[0]["prompt"], "answer_before": samples[0]["reply"], "answer_after": samples[-1]["reply"],
    }


def markdown(record: dict) -> str:
    flag = "" if METHOD == "dpo" else f" --method {METHOD}"
    lines = [f"# {METHOD.upper()} demo preset ({PRESET.relative_to(ROOT)})\n",
             f"CPU: {record['cpu']} ({', '.join(record['flags'])}); torch {record['torch']}.\n",
             f"`python benchmarks/preference/dpo_demo.py{flag}` (each run from an empty directory, through `litqlora "
             f"{METHOD}`; held out: {HELD_OUT}).\n",
             "| ISA | precision | val loss | " + " | ".join(f"held-out {k}" for k in KEYS[:3])
             + " | tokens/s | peak RSS | wall |", "|" + "---|" * 9]
    for r in record["runs"]:
        pair = lambda v: f"{v[0]:.3f} -> {v[1]:.3f}"  # noqa: E731
        lines.append(f"| {r['isa']} | {r['precision']} | {pair(r['val_loss'])} | "
                     + " | ".join(pair(r[f"held_out {k}"]) for k in KEYS[:3])
                     + f" | {r['tokens_per_sec']:.1f} | {r['peak_rss_gib']:.2f} GiB | {r['wall_seconds']:.0f} s |")
    for r in record["runs"]:
        lines += ["", f"Held-out question ({r['isa']}): {r['question'].strip().splitlines()[-2]!r}",
                  f"- before: {r['answer_before'].strip()!r}", f"- after: {r['answer_after'].strip()!r}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", nargs="+", default=["native"], choices=["native", "avx2"])
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--method", default="dpo", choices=sorted(METHODS))
    args = parser.parse_args()
    global METHOD, PRESET, OUT, KEYS, HELD_OUT
    METHOD = args.method
    PRESET, OUT, KEYS, HELD_OUT = ROOT / METHODS[METHOD][0], *METHODS[METHOD][1:]
    import torch

    results = HERE / "results"
    results.mkdir(exist_ok=True)
    previous = results / f"{METHOD}_demo.json"
    kept = json.loads(previous.read_text())["runs"] if previous.is_file() else []  # other ISA settings' runs stay
    runs = [run(isa, args.precision) for isa in args.isa]
    record = {"cpu": cpu_name(), "flags": cpu_flags(), "torch": torch.__version__,
              "runs": [r for r in kept if r["isa"] not in args.isa] + runs}
    (results / f"{METHOD}_demo.json").write_text(json.dumps(record, indent=2) + "\n")
    (results / f"{METHOD}_demo.md").write_text(markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main()
