"""Where the training memory goes: one profiled optimizer step, QLoRA vs LoRA, one per process.

    python benchmarks/memory/memory_breakdown.py                         # 1.1B shape, 1x512, checkpointing on
    python benchmarks/memory/memory_breakdown.py --checkpoint_dir checkpoints/SmolLM2-135M-Instruct --batch 4

Each child loads the base (NF4 or bf16), adds LoRA (r=8, every linear) and runs the `litqlora finetune` step
(FinetuneModule.micro_loss_sum: blocks with activation checkpointing, chunked CE; backward; clipping; fused
AdamW), one warm-up step and then one step under torch.profiler(profile_memory=True). The profiler's memory
timeline sorts every allocation into parameters, optimizer state, gradients, activations (kept for backward),
temporaries and autograd details; at the step's peak of allocated bytes we record each category. Resident
parts that exist before the step are also counted directly from the tensors: base weights (NF4 or bf16),
embeddings, LoRA adapters, their gradients and AdamW state, the NF4 dequantize scratch. `rss_*` are the OS view
(VmRSS / VmHWM): libraries before loading and after loading; the whole-run peak here includes the profiler's own
memory, so peak RSS comes from train_memory.py, not from this script.
Results: benchmarks/memory/results/memory_breakdown.{json,md}; tutorials/memory.md plots them.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DEFAULT_CKPT = HERE.parent / "_work" / "tinyllama-1.1b-random"
CATEGORIES = ["parameter", "optimizer_state", "input", "temporary", "activation", "gradient", "autograd_detail",
              "unknown"]


def resident(model, optimizer) -> dict[str, int]:
    from lit_qlora.memory.accounting import tensor_bytes
    from lit_qlora.nf4.linear import _scratch

    parts = {"base_linear_weights": 0, "embeddings_and_norms": 0, "lora_adapters": 0, "lora_gradients": 0}
    for name, p in model.named_parameters():
        if p.requires_grad:
            parts["lora_adapters"] += tensor_bytes(p)
            parts["lora_gradients"] += tensor_bytes(p.grad) if p.grad is not None else 0
        elif p.dim() == 2 and "wte" not in name and "embed" not in name:
            parts["base_linear_weights"] += tensor_bytes(p)
        else:
            parts["embeddings_and_norms"] += tensor_bytes(p)
    parts["optimizer_state"] = sum(tensor_bytes(v) for s in optimizer.state.values() for v in s.values()
                                   if hasattr(v, "numel") and v.dim() > 0)
    buffers = getattr(_scratch, "buffers", {}) or {}
    parts["nf4_dequant_scratch"] = sum(b.numel() * b.element_size() for b in buffers.values())
    return parts


def child(args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    from lit_qlora.memory.accounting import peak_rss_bytes, rss_bytes
    sys.path.insert(0, str(HERE.parent / "speed"))
    from one_step import build_step

    rss_libraries = rss_bytes()
    model, optimizer, step = build_step(args.checkpoint_dir, args.child, args.batch, args.seq, args.checkpointing)
    rss_loaded = rss_bytes()

    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        parts = step(lambda: resident(model, optimizer))  # gradients still present
    times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    totals = [sum(s) for s in sizes]
    at = max(range(len(totals)), key=totals.__getitem__)
    # Column 0 holds allocations made before profiling began; columns 1.. follow the profiler's categories.
    at_peak = dict(zip(["before_profiling"] + CATEGORIES, sizes[at]))
    step_ms = [(t - times[0]) / 1e3 for t in times]
    keep = range(0, len(times), max(1, len(times) // 400))
    print(json.dumps({
        "config": args.child, "resident": parts, "profiled_peak_bytes": totals[at], "profiled_at_peak": at_peak,
        "profiled_peak_ms": step_ms[at], "timeline": {"ms": [round(step_ms[i], 1) for i in keep],
                                                      "bytes": [sizes[i] for i in keep]},
        "rss_libraries_bytes": rss_libraries, "rss_loaded_bytes": rss_loaded, "rss_peak_bytes": peak_rss_bytes(),
        "vocab_size": model.config.vocab_size, "tokens": args.batch * args.seq,
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", default=str(DEFAULT_CKPT))
    parser.add_argument("--configs", nargs="+", default=["nf4", "none"], choices=["nf4", "none"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--no_checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    import torch

    common = ["--checkpoint_dir", args.checkpoint_dir, "--batch", str(args.batch), "--seq", str(args.seq)]
    common += [] if args.checkpointing else ["--no_checkpointing"]
    name = f"{Path(args.checkpoint_dir).name} {args.batch}x{args.seq} ckpt={'on' if args.checkpointing else 'off'}"
    runs = {}
    for config in args.configs:
        out = subprocess.run([sys.executable, __file__, *common, "--child", config], check=True, capture_output=True,
                             text=True).stdout
        runs[config] = json.loads(out.strip().splitlines()[-1])
    path = RESULTS / "memory_breakdown.json"
    record = json.loads(path.read_text()) if path.is_file() else {"rows": {}}
    record.update({"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads (CPU)",
                   "torch": torch.__version__, "python": platform.python_version()})
    command = f"python benchmarks/memory/memory_breakdown.py --checkpoint_dir {args.checkpoint_dir} --configs " \
              f"{' '.join(args.configs)} --batch {args.batch} --seq {args.seq}" + \
              ("" if args.checkpointing else " --no_checkpointing")
    record["rows"][name] = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command,
                            "runs": runs}
    path.write_text(json.dumps(record, indent=2) + "\n")
    write_markdown(record)


def write_markdown(record: dict) -> None:
    mib = 1024**2
    lines = [f"# Where the training memory goes ({record['machine']}, torch {record['torch']})", "",
             "MiB. Resident parts counted from the tensors after the profiled step's update; `step peak` parts are "
             "torch.profiler's categories at the step's peak of allocated bytes (allocations made before the "
             "profiled step show as `before`); RSS is the OS view of the whole process.", ""]
    for name, row in record["rows"].items():
        configs = list(row["runs"])
        lines += [f"## {name}", "", f"Reproduce: `{row['command']}` ({row['started']})", "",
                  "| part | " + " | ".join({"nf4": "QLoRA", "none": "LoRA"}[c] for c in configs) + " |",
                  "|---|" + "---:|" * len(configs)]
        runs = [row["runs"][c] for c in configs]
        keys = [("resident", k) for k in runs[0]["resident"]]
        keys += [("profiled_at_peak", k) for k in ["before_profiling"] + CATEGORIES]
        for group, key in keys:
            label = key if group == "resident" else f"step peak: {key}"
            lines.append(f"| {label} | " + " | ".join(f"{r[group].get(key, 0) / mib:.1f}" for r in runs) + " |")
        for key in ("profiled_peak_bytes", "rss_libraries_bytes", "rss_loaded_bytes"):
            lines.append(f"| **{key.removesuffix('_bytes')}** | " + " | ".join(f"{r[key] / mib:.1f}" for r in runs) + " |")
        lines.append("")
    (RESULTS / "memory_breakdown.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
