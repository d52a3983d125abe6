"""`litqlora estimate --method grpo` against a real `litqlora grpo` run's measured peak of allocated bytes (issue 49
item 7), on the CPU.

    python benchmarks/grpo/estimate_accuracy.py [--rows demo beta checkpointed]

Each row is one child process: `litqlora grpo` (the CLI's own function, in-process) on SmolLM2-135M's shape with
random weights (written once under benchmarks/_work/, SmolLM2's tokenizer from checkpoints/: random weights never
draw the stop token, so every completion runs to --grpo.max_completion_length, the estimate's worst case), 4 steps.
Its prompts all tokenize to the same length P ("Compute 12 + 34." with two-digit numbers), so every training row is
P + max_completion_length tokens. Measured with lit_qlora.memory.trace.profiled_peak (the storages alive before
plus the highest running sum of torch.profiler's allocation events; the measurement the SFT estimate is checked
against, benchmarks/memory/estimate_accuracy.py):
- the second batch of rollouts' sampling (GRPOModule.make_rollouts: the KV cache, the decode steps, the rewards,
  and with beta or num_iterations > 1 the kept log-probabilities' no-grad forwards) against the estimate's sampling
  phase;
- the last step (its sampling where it samples, then every micro-batch's forward and backward, clipping, AdamW), and
  the larger of the two measured peaks against the estimate's peak (the larger of its two phases),
with `litqlora estimate --method grpo --device cpu` run at --train.max_seq_length P + max_completion_length (the rows'
real length) and the run's precision. Results: benchmarks/grpo/results/estimate_accuracy.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from demo import cpu_flags  # (this folder is on sys.path: the script's own)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORK = ROOT / "benchmarks" / "_work" / "grpo-estimate"
STEPS = 4
ROWS = {  # name -> options after the demo preset's (config_hub/grpo/smollm2-135m/qlora.yaml)
    "demo": [],
    "beta": ["--grpo.beta", "0.04", "--grpo.num_iterations", "2"],
    "checkpointed": ["--train.activation_checkpointing", "true", "--grpo.max_completion_length", "48"],
}


def prepare() -> tuple[Path, Path]:
    """The random checkpoint and the prompts (two-digit sums: SmolLM2's tokenizer splits digits, so every prompt is
    as long as the others; the run checks that every row had one length)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    import gpu_suite

    ckpt = gpu_suite.write_random_checkpoint("SmolLM2-135M", WORK / "smollm2-random",
                                             ROOT / "checkpoints" / "SmolLM2-135M-Instruct")
    rng = random.Random(0)
    rows = [{"prompt": [{"role": "user", "content": f"Compute {a} + {b}."}], "answer": str(a + b)}
            for a, b in ((rng.randint(10, 99), rng.randint(10, 99)) for _ in range(64))]
    data = WORK / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ckpt, data


def child(name: str) -> None:
    import torch

    from lit_qlora.cli import main as cli
    from lit_qlora.estimate.step import resident_tensors
    from lit_qlora.methods.grpo.module import GRPOModule
    from lit_qlora.memory.trace import profiled_peak

    ckpt, data = prepare()
    measured: dict = {}
    real_rollouts, real_step = GRPOModule.make_rollouts, GRPOModule.training_step

    def alive(module) -> list:
        r = module.rollouts
        kept = [] if r is None else [*r.sequences, r.stopped, r.per_function, r.rewards, r.advantages,
                                     *(r.old_logps or []), *(r.ref_logps or [])]
        return resident_tensors(module.model, module.trainer.optimizers[0]) + kept

    calls = []

    def make_rollouts(self, prompts, step):
        calls.append(step)
        if len(calls) != 2:  # the second batch of rollouts: optimizer state exists from here on
            return real_rollouts(self, prompts, step)
        out = {}
        measured["sampling_bytes"] = profiled_peak(lambda: out.update(r=real_rollouts(self, prompts, step)),
                                                   alive(self))
        measured["completion_lengths"] = sorted(set(out["r"].completion_lengths))
        measured["row_lengths"] = sorted({len(s) for s in out["r"].sequences})
        return out["r"]

    def training_step(self, micro_batches, batch_idx):
        if self.step != STEPS - 1:  # the last step (with num_iterations 2: one that samples nothing)
            return real_step(self, micro_batches, batch_idx)
        out = {}
        measured["step_bytes"] = profiled_peak(lambda: out.update(loss=real_step(self, micro_batches, batch_idx)),
                                               alive(self))
        return out["loss"]

    GRPOModule.make_rollouts, GRPOModule.training_step = make_rollouts, training_step
    run_dir, options = WORK / f"run-{name}", ROWS[name]
    common = ["--config", str(ROOT / "config_hub/grpo/smollm2-135m/qlora.yaml"), "--checkpoint_dir", str(ckpt),
              "--train.init_adapter", "null", "--data.path", str(data), "--data.val_split", "0.05",
              "--train.max_steps", str(STEPS), "--train.save_interval", "100", "--train.eval_interval", "100", *options]
    cli(["grpo", *common, "--out_dir", str(run_dir), "--overwrite", "true", "--export.merged", "false",
         "--export.peft", "false"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(measured["row_lengths"]) == 1 and len(measured["completion_lengths"]) == 1, measured
    length = measured["row_lengths"][0]
    prompt_len = length - measured["completion_lengths"][0]
    est_dir = WORK / f"estimate-{name}"
    cli(["estimate", *common, "--method", "grpo", "--device", "cpu", "--precision", summary["precision"],
         "--train.max_seq_length", str(length), "--out_dir", str(est_dir)])
    est = json.loads((est_dir / "estimate.json").read_text())
    g = est["grpo"]
    print("ROW " + json.dumps({
        "row": name, "options": options, "precision": summary["precision"], "prompt_tokens": prompt_len,
        "completion_lengths": measured["completion_lengths"], "row_lengths": measured["row_lengths"],
        "predicted_sampling_bytes": g["sampling_peak_bytes"], "measured_sampling_bytes": measured["sampling_bytes"],
        "sampling_ratio": round(g["sampling_peak_bytes"] / measured["sampling_bytes"], 4),
        "predicted_training_bytes": g["training_peak_bytes"], "predicted_peak_bytes": est["peak_bytes"],
        "measured_step_bytes": measured["step_bytes"],
        "ratio": round(est["peak_bytes"] / max(measured["step_bytes"], measured["sampling_bytes"]), 4),
        "sets_the_peak": g["sets_the_peak"], "threads": torch.get_num_threads(), "cpu": cpu_flags()}), flush=True)


def write_markdown(record: dict, path: Path) -> None:
    mib = 2**20
    lines = ["# `litqlora estimate --method grpo` against a measured `litqlora grpo` step", "",
             f"`{record['command']}`; CPU: {record['cpu']}, {record['cores']} cores. Every row: SmolLM2-135M's shape, "
             "random weights (every completion runs to the cap), QLoRA, the demo preset's settings plus the row's "
             "options; measured with torch.profiler's allocation events (lit_qlora.memory.trace.profiled_peak).", "",
             "| row | options | precision | row tokens (prompt + completion) | sampling predicted / measured MiB | "
             "ratio | peak predicted / measured MiB (last step) | ratio (to the larger measured) | peak set by |", "|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['row']} | `{' '.join(r['options']) or '(the preset)'}` | {r['precision']} | "
                     f"{r['prompt_tokens']} + {r['completion_lengths']} | {r['predicted_sampling_bytes'] / mib:.1f} / "
                     f"{r['measured_sampling_bytes'] / mib:.1f} | {r['sampling_ratio']:.3f} | "
                     f"{r['predicted_peak_bytes'] / mib:.1f} / {r['measured_step_bytes'] / mib:.1f} | {r['ratio']:.3f} | "
                     f"{r['sets_the_peak']} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "estimate_accuracy.json")
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    WORK.mkdir(parents=True, exist_ok=True)
    record = {"command": "python benchmarks/grpo/estimate_accuracy.py " + " ".join(sys.argv[1:]), "cpu": cpu_flags(),
              "cores": os.cpu_count(), "rows": []}
    for name in args.rows:
        done = subprocess.run([sys.executable, __file__, "--child", name], cwd=ROOT, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("ROW ")), None)
        if done.returncode or line is None:
            sys.exit(f"row {name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
        record["rows"].append(json.loads(line[4:]))
        print(line, flush=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    write_markdown(record, args.out.with_suffix(".md"))
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
