"""Evaluation speed: `litqlora evaluate`'s lm-eval model (LitQLoRALM) vs lm-eval's own Hugging Face backend (HFLM)
on the same checkpoint, tasks, data, dtype and batch size.

    python benchmarks/evaluation/eval_speed.py                      # SmolLM2-135M-Instruct, truthfulqa_mc2 + mc1, fp32 + bf16
    python benchmarks/evaluation/eval_speed.py --dtypes float32 --tasks truthfulqa_mc2 --repeats 5

Both models are loaded once per dtype in this process (ours as `litqlora evaluate` loads it: ModelChoice, whose
loader stacks q/k/v and gate/up for one matmul each, and the thread governor); every timed run is a whole `lm_eval.simple_evaluate` call
(task building, dataset, requests, scoring) on the TruthfulQA-format file. Per task and dtype there is one
untimed warm-up run each (`--limit 2`), then `--repeats` rounds in which the two alternate, the order flipping
every round, so both see the same machine load; the table gives medians. "requests s" is the time inside the
model's loglikelihood calls alone. Scores are checked equal within 1e-3 in float32 (bf16 rounds differently in
the two implementations). The checkpoint default is converted from the bundled GGUF when missing.
Results: benchmarks/evaluation/results/eval_speed.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "evaluation" / "results"
DTYPES = ("float32", "bfloat16")
SCORE_TOL = 1e-3


def repo_relative(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def peft_export(adapter_dir: Path) -> Path:
    """The PEFT folder a fine-tune writes (final/peft/), given its out_dir or its final/."""
    for path in (adapter_dir / "final" / "peft", adapter_dir / "peft"):
        if (path / "adapter_config.json").is_file():
            return path
    raise SystemExit(f"{adapter_dir}: no PEFT export (final/peft/adapter_config.json); fine-tune with --export.peft true")


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def timed_requests(lm, seconds: list[float]):
    """Adds the time spent in `lm`'s loglikelihood calls to seconds[0] (lm-eval calls them by attribute)."""
    inner = lm.loglikelihood

    def loglikelihood(requests, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(requests, *args, **kwargs)
        finally:
            seconds[0] += time.perf_counter() - t0

    lm.loglikelihood = loglikelihood
    return lm


def run_once(lm, seconds: list[float], task: str, include: Path, batch_size: int, limit) -> dict:
    from lm_eval import simple_evaluate

    from lit_qlora.eval.evaluate import task_manager

    seconds[0] = 0.0
    load_before = load1()
    t0 = time.perf_counter()
    out = simple_evaluate(model=lm, tasks=[task], task_manager=task_manager([task], include), batch_size=batch_size,
                          limit=limit, verbosity="ERROR")
    wall = time.perf_counter() - t0
    result = out["results"][task]
    return {"seconds": round(wall, 3), "request_seconds": round(seconds[0], 3), "acc": result["acc,none"],
            "acc_stderr": result["acc_stderr,none"], "load1_before": load_before, "load1_after": load1()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", default="checkpoints/SmolLM2-135M-Instruct")
    parser.add_argument("--data_file", default=None, help="TruthfulQA-format file (default: the bundled sample)")
    parser.add_argument("--tasks", default="truthfulqa_mc2,truthfulqa_mc1")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="float32 and/or bfloat16, comma-separated")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None, help="first N questions only (a quick check)")
    parser.add_argument("--results_dir", default=str(RESULTS))
    parser.add_argument("--adapter_dir", default=None,
                        help="a fine-tune's out_dir: ours evaluates its adapter unmerged, HFLM its PEFT export (peft=)")
    parser.add_argument("--quantize", choices=("nf4", "none"), default=None,
                        help="ours: the base as `litqlora evaluate --quantize` loads it (HFLM: the plain base)")
    args = parser.parse_args()

    import torch
    from lm_eval.models.huggingface import HFLM

    from lit_qlora.base.threads import govern_threads
    from lit_qlora.deploy.choice import ModelChoice
    from lit_qlora.eval import SAMPLE_DATA_FILE
    from lit_qlora.eval.lm import LitQLoRALM
    from lit_qlora.eval.truthfulqa import check_truthfulqa_file, prepare_local_tasks
    from lit_qlora.export.gguf_import import ensure_default_checkpoint
    from lit_qlora.checkpoint.tokenizer import Tokenizer

    checkpoint_dir = Path(args.checkpoint_dir)
    ensure_default_checkpoint(checkpoint_dir)
    data_file = Path(args.data_file) if args.data_file else SAMPLE_DATA_FILE
    rows = check_truthfulqa_file(data_file)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if unknown := [d for d in dtypes if d not in DTYPES]:
        parser.error(f"--dtypes: unknown {unknown}; choose from {DTYPES}")

    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    load_start = [round(x, 2) for x in os.getloadavg()]
    include = prepare_local_tasks(data_file, Path(tempfile.mkdtemp(prefix="eval-speed-tasks-")))
    table = []
    for dtype in dtypes:
        t0 = time.perf_counter()
        ours_seconds, hf_seconds = [0.0], [0.0]
        # the model as `litqlora evaluate` loads it (eval/evaluate.py: ModelChoice.load, the thread governor)
        model = ModelChoice(checkpoint_dir=checkpoint_dir, adapter_dir=args.adapter_dir, quantize=args.quantize,
                            precision={"float32": "32-true", "bfloat16": "bf16-true"}[dtype], device="cpu").load()
        govern_threads(model)
        ours = timed_requests(LitQLoRALM(model, Tokenizer(checkpoint_dir), batch_size=args.batch_size), ours_seconds)
        ours_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        peft = {"peft": str(peft_export(Path(args.adapter_dir)))} if args.adapter_dir else {}
        hf = timed_requests(HFLM(pretrained=str(checkpoint_dir), dtype=dtype, device="cpu",
                                 batch_size=args.batch_size, **peft), hf_seconds)
        hf_load = time.perf_counter() - t0
        models = {"ours": (ours, ours_seconds), "hflm": (hf, hf_seconds)}
        for task in tasks:
            for lm, seconds in models.values():  # warm-up: dataset build and first-call costs, untimed
                run_once(lm, seconds, task, include, args.batch_size, 2)
            runs: dict[str, list[dict]] = {"ours": [], "hflm": []}
            for r in range(args.repeats):
                for name in (("ours", "hflm") if r % 2 == 0 else ("hflm", "ours")):
                    runs[name].append(run_once(*models[name], task, include, args.batch_size, args.limit))
                    print(dtype, task, name, runs[name][-1], flush=True)

            def med(name: str, key: str, runs: dict[str, list[dict]] = runs) -> float:
                return statistics.median(run[key] for run in runs[name])

            accs = {name: {run["acc"] for run in runs[name]} for name in runs}
            acc_diff = abs(runs["ours"][0]["acc"] - runs["hflm"][0]["acc"])
            row = {
                "task": task, "dtype": dtype, "batch_size": args.batch_size, "limit": args.limit,
                "ours_seconds": round(med("ours", "seconds"), 2), "hflm_seconds": round(med("hflm", "seconds"), 2),
                "speedup": round(med("hflm", "seconds") / med("ours", "seconds"), 2),
                "ours_request_seconds": round(med("ours", "request_seconds"), 2),
                "hflm_request_seconds": round(med("hflm", "request_seconds"), 2),
                "request_speedup": round(med("hflm", "request_seconds") / med("ours", "request_seconds"), 2),
                "ours_acc": runs["ours"][0]["acc"], "hflm_acc": runs["hflm"][0]["acc"],
                "ours_acc_stderr": runs["ours"][0]["acc_stderr"], "hflm_acc_stderr": runs["hflm"][0]["acc_stderr"],
                "acc_abs_diff": acc_diff,
                "scores_agree": acc_diff <= SCORE_TOL if dtype == "float32" and args.quantize != "nf4" else None,
                "repeat_scores_identical": all(len(a) == 1 for a in accs.values()),
                "ours_load_seconds": round(ours_load, 2), "hflm_load_seconds": round(hf_load, 2),
                "median_load1": round(statistics.median(run["load1_before"] for rs in runs.values() for run in rs), 2),
                "runs": runs,
            }
            print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
            table.append(row)
        del ours, hf, models

    import lm_eval
    import transformers

    record = {
        "date": started,
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("model name")), platform.machine()),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "lm_eval": lm_eval.__version__,
        },
        "loadavg_start": load_start, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "checkpoint_dir": str(checkpoint_dir), "data_file": repo_relative(data_file), "rows": rows,
        "adapter_dir": args.adapter_dir, "quantize": args.quantize,
        "repeats": args.repeats,
        "command": "python " + " ".join([repo_relative(Path(sys.argv[0])), *sys.argv[1:]]),
        "results": table,
    }
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval_speed.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "eval_speed.md").write_text(markdown(record))
    bad = [f"{r['task']} {r['dtype']}" for r in table if r["scores_agree"] is False]
    if bad:
        sys.exit(f"scores differ by more than {SCORE_TOL} in float32: {', '.join(bad)}")


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = [
        "# Evaluation speed: LitQLoRALM vs lm-eval's HFLM (transformers)",
        "",
        f"{m['cpu']} ({m['cpus']} CPUs, torch threads {m['torch_threads']}), torch {m['torch']}, transformers "
        f"{m['transformers']}, lm_eval {m['lm_eval']}, Python {m['python']}.",
        f"Measured {record['date']} to {record['finished']}; load average before/after {record['loadavg_start']} / "
        f"{record['loadavg_end']} (the machine is shared with other jobs; the table gives the median 1-minute load "
        "seen at the start of each timed run, which counts the benchmark's own torch threads: a load near the "
        "thread count means an otherwise idle machine).",
        "",
        f"Reproduce: `{record['command']}`. Model `{record['checkpoint_dir']}`, data: "
        f"`{Path(record['data_file']).name}` ({record['rows']} questions), CPU. Each figure is the median of "
        f"{record['repeats']} whole `lm_eval.simple_evaluate` calls per side, the two sides alternating; "
        "\"requests\" is the time inside the model's loglikelihood calls alone; speedup = HFLM time / our time.",
        "",
        "| task | dtype | batch | ours s | HFLM s | speedup | ours requests s | HFLM requests s | requests speedup "
        "| ours acc | HFLM acc | abs diff | median load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in record["results"]:
        lines.append(
            f"| {r['task']} | {r['dtype']} | {r['batch_size']} | {r['ours_seconds']} | {r['hflm_seconds']} | "
            f"**{r['speedup']}x** | {r['ours_request_seconds']} | {r['hflm_request_seconds']} | "
            f"{r['request_speedup']}x | {r['ours_acc']:.6f} | {r['hflm_acc']:.6f} | {r['acc_abs_diff']:.1e} | "
            f"{r['median_load1']} |")
    slowest = min(record["results"], key=lambda r: r["speedup"])
    fp32 = [r["scores_agree"] for r in record["results"] if r["dtype"] == "float32"]
    lines += [
        "",
        f"Goal: at least 3x faster with equal scores. Slowest row: {slowest['speedup']}x ({slowest['task']}, "
        f"{slowest['dtype']}); float32 scores agree within {SCORE_TOL}: {all(fp32) if fp32 else 'not measured'}.",
        "",
        "Model load (once per dtype, not in the times above): "
        + "; ".join(sorted({f"{r['dtype']}: ours {r['ours_load_seconds']} s, HFLM {r['hflm_load_seconds']} s"
                            for r in record["results"]})) + ".",
        "",
        "Why the gap: HFLM runs every (context, choice) sequence whole and computes the full-vocabulary "
        "log-softmax at every position; LitQLoRALM runs the few-shot preamble the questions share once into the "
        "KV cache, then each question as one row (its own context, then every choice as a branch that sees the "
        "context and itself only: no padding among choices), several questions a forward, and sends only the "
        "positions that predict continuation tokens through the output head.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
