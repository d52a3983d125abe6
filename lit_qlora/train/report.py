"""The table `litqlora finetune` prints when a run finishes (from its summary.json values)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def print_report(summary: dict[str, Any], out_dir: Path) -> None:
    gib = 1024**3
    rows = [
        ("steps", summary["steps"]),
        *([("precision", summary["precision"])] if summary.get("precision") else []),
        ("train loss (last step)", loss(summary["train_loss"])),
        # (litqlora grpo validates by reward: its loss is minus the held-out reward, so that lower is better)
        ("val loss = -reward (before -> after)" if "eval_reward" in summary else "val loss (before -> after)",
         f"{loss(summary['initial_val_loss'])} -> {loss(summary['val_loss'])}"),
        *objective_rows(summary),
        (f"tokens/s (after {warmup(summary)})", f"{summary['tokens_per_sec']:.1f}" if summary["tokens_per_sec"] else "-"),
        *compile_rows(summary),
        ("peak RSS (whole run)", f"{summary['peak_rss_bytes'] / gib:.2f} GiB"),
        # Load, first validation and the steps: the final validation and the exports should not add to it.
        ("peak RSS (through training)", f"{summary['peak_rss_train_bytes'] / gib:.2f} GiB"),
        *[(k.replace("_bytes", "").replace("_", " "), f"{summary[k] / gib:.2f} GiB")
          for k in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_active_bytes") if k in summary],
        *([("offloaded activations (host)", f"{summary['offload_host_bytes'] / gib:.2f} GiB "
                                            f"({summary['offload_pinned_bytes'] / gib:.2f} GiB pinned)")]
          if summary.get("offload_activations") else []),
        *threads_rows(summary),
        ("NF4 linears", f"{summary['quantized_linears']} / {summary['total_linears']}"),
        ("trainable params", f"{summary['trainable_params']:,} of {summary['total_params']:,}"),
        ("wall time", wall_time(summary)),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join([f"\nRun finished: {out_dir}"] + [f"  {k:<{width}}  {v}" for k, v in rows]))


def objective_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """An objective's validation numbers before and after (`litqlora dpo`: eval_rewards/accuracies, ...)."""
    return [(f"{k[len('eval_'):]} (val, before -> after)", f"{summary[f'initial_{k}']:.4f} -> {summary[k]:.4f}")
            for k in summary if k.startswith("eval_") and summary.get(f"initial_{k}") is not None]


def warmup(summary: dict[str, Any]) -> str:
    """Which steps the throughput leaves out: step 1 (the first step pays one-time costs), or with --compile the
    warm-up steps that compiled."""
    steps = summary.get("warmup_steps", 1)
    return "step 1" if steps <= 1 and not summary.get("compile") else f"{steps} warm-up step{'s' * (steps != 1)}"


def compile_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """With --compile: the warm-up's cost, apart from the steady throughput above it."""
    if summary.get("compile_seconds") is None:
        return []
    first = summary.get("first_step_seconds")
    return [("compile time", f"{summary['compile_seconds']:.1f} s" + (f" (first step {first:.1f} s)" if first else ""))]


def threads_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """CPU: the thread count, where other busy processes made it change (lit_qlora.base.threads)."""
    if not summary.get("cpu_thread_changes"):
        return []
    return [("CPU threads", f"{summary['cpu_threads']}, down to {summary['cpu_threads_fewest']} beside other busy "
                            f"processes ({plural(summary['cpu_thread_changes'], 'change')})")]


def plural(count: int, noun: str) -> str:
    """`1 change`, `2 changes`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def wall_time(summary: dict[str, Any]) -> str:
    """The whole run's wall time; after a resume, also this process's part of it."""
    whole = f"{summary['wall_seconds']:.1f} s"
    if not summary.get("resumed_from_step") or summary.get("process_wall_seconds") is None:
        return whole
    return f"{whole} in all, {summary['process_wall_seconds']:.1f} s of it in this process (resumed at step " \
           f"{summary['resumed_from_step']})"


def loss(value: Any) -> str:
    """A loss to 4 decimals; '-' where there is none (no validation split, no step trained)."""
    return "-" if value is None else f"{value:.4f}"


def print_sample_change(out_dir: Path) -> None:
    """With --train.eval_interval: the held-out prompt's greedy reply before training and after (samples.jsonl)."""
    path = out_dir / "samples.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    rows = [row for row in rows if "reply" in row]  # the validations' (litqlora grpo logs training completions too)
    if len(rows) < 2:
        return
    first, last = rows[0], rows[-1]
    prompt = first.get("prompt_text") or first["prompt"]  # runs before prompt_text was recorded: the model's input
    print(f"\nA held-out prompt (validation): {prompt.strip()!r}\n"
          f"  before (step {first['step']}): {first['reply'].strip()!r}\n"
          f"  after (step {last['step']}): {last['reply'].strip()!r}")
