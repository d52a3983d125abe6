"""The report of `litqlora compare`: report.json (numbers), report.md (table and verdict), report.png (plots).

Everything is read back from the stages' own files (summary.json, metrics.jsonl, results.json), so a report
can be rebuilt from an OUT_DIR at any time.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

from lit_qlora.checkpoint.files import atomic_write_text

TASK = "truthfulqa_mc2"
GIB = 1024**3


def training_peak(summary: dict[str, Any]) -> tuple[int, str]:
    """(bytes, what was measured): accelerator memory when there was one, else the process's peak RSS."""
    if "peak_allocated_bytes" in summary:
        return summary["peak_allocated_bytes"], "peak GPU memory allocated"
    return summary["peak_rss_bytes"], "peak RSS of the fine-tune process"


def loss_curve(metrics_path: Path) -> list[list[float]]:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return [[row["step"], row["loss"]] for row in rows]


def run_entry(out_dir: Path, name: str, checkpoint: Path) -> dict[str, Any]:
    results = json.loads((out_dir / "eval" / name / "results.json").read_text())
    metrics = results["results"][TASK]
    info = results["lit_qlora"]
    entry: dict[str, Any] = {
        "checkpoint_dir": str(Path(checkpoint).resolve()),
        "quantize": None, "peak_memory_bytes": None, "peak_memory_kind": None, "wall_seconds": None,
        "tokens_per_sec": None, "train_loss": None, "val_loss": None, "loss_curve": [],
        TASK: metrics["acc,none"], f"{TASK}_stderr": metrics.get("acc_stderr,none"),
        "eval_samples": results.get("n-samples", {}).get(TASK, {}).get("effective"),
        "eval_seconds": info["eval_seconds"], "eval_peak_memory_bytes": info["peak_memory_bytes"],
    }
    if name == "base":
        # The base's validation loss: the LoRA run measured it on the same split before its first step.
        lora_summary = json.loads((out_dir / "lora" / "summary.json").read_text())
        entry.update(val_loss=lora_summary["initial_val_loss"], quantize="none")
        return entry
    summary = json.loads((out_dir / name / "summary.json").read_text())
    peak, kind = training_peak(summary)
    stage = out_dir / "logs" / f"finetune-{name}.json"
    if stage.is_file():
        entry["load_average_1min"] = json.loads(stage.read_text())["load_average_1min"]
    entry.update(
        quantize="nf4" if name == "qlora" else "none", peak_memory_bytes=peak, peak_memory_kind=kind,
        wall_seconds=summary["wall_seconds"], tokens_per_sec=summary["tokens_per_sec"],
        train_loss=summary["train_loss"], val_loss=summary["val_loss"],
        initial_val_loss=summary["initial_val_loss"], steps=summary["steps"],
        quantized_linears=summary["quantized_linears"], total_linears=summary["total_linears"],
        loss_curve=loss_curve(out_dir / name / "metrics.jsonl"),
    )
    return entry


def verdict(lora: dict[str, Any], qlora: dict[str, Any]) -> dict[str, Any]:
    """Is QLoRA's truthfulqa_mc2 within one standard error (of the LoRA baseline's estimate) of LoRA's?"""
    delta = qlora[TASK] - lora[TASK]
    stderr = lora[f"{TASK}_stderr"]
    within = stderr is not None and math.isfinite(stderr) and abs(delta) <= stderr
    return {"qlora_minus_lora": delta, "lora_stderr": stderr, "within_one_stderr": within}


def verdict_line(v: dict[str, Any]) -> str:
    if v["lora_stderr"] is None:
        return f"Verdict: no standard error for LoRA's {TASK} (too few questions); QLoRA - LoRA = {v['qlora_minus_lora']:+.4f}."
    relation = "within" if v["within_one_stderr"] else "NOT within"
    return (f"Verdict: QLoRA is {relation} one stderr of LoRA on {TASK} "
            f"(QLoRA - LoRA = {v['qlora_minus_lora']:+.4f}, LoRA stderr {v['lora_stderr']:.4f}).")


def fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def markdown(report: dict[str, Any]) -> str:
    runs, settings = report["runs"], report["settings"]
    lines = [
        "# LoRA vs QLoRA",
        "",
        f"Base `{settings['checkpoint_dir']}`, {runs['lora'].get('steps', '?')} steps of the same recipe and seed "
        f"([recipe.yaml](recipe.yaml)); {TASK} on `{Path(settings['data_file']).name}` "
        f"({runs['base']['eval_samples']} questions, {settings['eval_precision']}).",
        "",
        "| run | base weights | peak memory | wall time | tokens/s | train loss | val loss | truthfulqa_mc2 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, label in (("base", "base (no fine-tune)"), ("lora", "LoRA"), ("qlora", "QLoRA")):
        run = runs[name]
        weights = {"none": "bf16", "nf4": "NF4"}[run["quantize"]] if name != "base" else "bf16"
        memory = fmt(None if run["peak_memory_bytes"] is None else run["peak_memory_bytes"] / GIB, ".2f", " GiB")
        score = f"{run[TASK]:.4f} ± {fmt(run[f'{TASK}_stderr'], '.4f')}"
        lines.append(f"| {label} | {weights} | {memory} | {fmt(run['wall_seconds'], '.1f', ' s')} | "
                     f"{fmt(run['tokens_per_sec'], '.1f')} | {fmt(run['train_loss'], '.4f')} | "
                     f"{fmt(run['val_loss'], '.4f')} | {score} |")
    kind = runs["qlora"]["peak_memory_kind"]
    loads = {name: runs[name].get("load_average_1min") for name in ("lora", "qlora")}
    busy = ""
    if all(loads.values()):
        cpus = report["settings"].get("cpu_count") or 1
        busy = (f" Load average (1 min, start/end) during the LoRA fine-tune {loads['lora'][0]:.1f}/"
                f"{loads['lora'][1]:.1f}, QLoRA {loads['qlora'][0]:.1f}/{loads['qlora'][1]:.1f} on {cpus} CPUs"
                + ("; other jobs were running, so wall time and tokens/s are not comparable."
                   if max(max(v) for v in loads.values()) > cpus + 0.5 else "."))
    lines += [
        "",
        verdict_line(report["verdict"]),
        "",
        f"Peak memory: {kind}. Wall time: the whole fine-tune process (load, validation, training, export). "
        "Train loss: the last optimizer step's. Val loss: on the held-out split, after training (the base's: "
        "before the LoRA run's first step). Stderr: lm-eval's standard error of the mean over questions." + busy,
        "",
        "![loss curves and peak memory](report.png)",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib  # imported here: only compare's last step plots, and matplotlib is slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for name, label, color in (("lora", "LoRA (bf16 base)", "tab:blue"), ("qlora", "QLoRA (NF4 base)", "tab:orange")):
        steps, losses = zip(*runs[name]["loss_curve"]) if runs[name]["loss_curve"] else ((), ())
        curves.plot(steps, losses, label=label, color=color)
        curves.axhline(runs[name]["val_loss"], color=color, linestyle="--", linewidth=1,
                       label=f"{label.split()[0]} val loss (end)")
    curves.set(xlabel="optimizer step", ylabel="train loss", title="Training loss")
    curves.legend()
    names = ["lora", "qlora"]
    values = [runs[n]["peak_memory_bytes"] / GIB for n in names]
    drawn = bars.bar(["LoRA", "QLoRA"], values, color=["tab:blue", "tab:orange"])
    bars.bar_label(drawn, fmt="%.2f GiB")
    kind = runs["qlora"]["peak_memory_kind"]
    bars.set(ylabel="GiB", title=kind[0].upper() + kind[1:])
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)


def write_report(out_dir: Path, evaluated: dict[str, Path]) -> dict[str, Any]:
    """Build report.json / report.md / report.png in `out_dir` from the stages' outputs."""
    out_dir = Path(out_dir)
    settings = json.loads((out_dir / "compare.json").read_text())
    runs = {name: run_entry(out_dir, name, path) for name, path in evaluated.items()}
    report = {
        "runs": runs,
        "verdict": verdict(runs["lora"], runs["qlora"]),
        "settings": {"checkpoint_dir": str(Path(evaluated["base"]).resolve()), "data_file": settings["eval"]["data_file"],
                     "limit": settings["eval"]["limit"], "eval_precision": settings["eval"]["precision"],
                     "recipe": "recipe.yaml", "cpu_count": os.cpu_count()},
    }
    atomic_write_text(out_dir / "report.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(out_dir / "report.md", markdown(report))
    plot(report, out_dir / "report.png")
    return report
