"""`litqlora estimate --device cpu` against a real step's measured peak of allocated tensor bytes (issue 17).

    python benchmarks/estimate_accuracy.py                     # every row below
    python benchmarks/estimate_accuracy.py --rows SmolLM2-135M:nf4:4:on:0.05

Each row runs in its own process: the prediction (`lit_qlora.estimate.trace_step`, fake tensors) for a preset's
shape, then the real thing: the same shape with random weights built as the loader builds it, LoRA r=8 alpha=16 on
every linear (dropout as the row says), and the `litqlora finetune` step of benchmarks/one_step.py (fused AdamW, clipping), one warm-up step
and one step under torch.profiler(profile_memory=True). Measured peak: the bytes of every storage alive before the
step (counted from the model, optimizer and NF4 buffers: the C kernels read NF4 codes by pointer, so no profiler
sees them as op inputs) plus the highest running sum of the step's allocation and free events. Results: benchmarks/results/estimate_accuracy.{json,md}.
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
ROWS = [f"{model}:{q}:{batch}:{ckpt}:{dropout}" for model, batch, dropouts in (("SmolLM2-135M", 4, ("0", "0.05")),
                                                                            ("TinyLlama-1.1B", 1, ("0",)))
        for dropout in dropouts for q in ("nf4", "none") for ckpt in ("on", "off")]


def child(row: str) -> None:
    import time

    import torch
    from lit_qlora.config import PRESETS, Quantize
    from lit_qlora.estimate import resident_tensors, trace_step
    from lit_qlora.memory_trace import profiled_peak
    from lit_qlora.train.args import LoRAArgs, TrainArgs
    from one_step import build_step

    model_name, quantize, batch, ckpt, dropout = row.split(":")
    batch, seq, checkpointing, dropout = int(batch), 512, ckpt == "on", float(dropout)
    started = time.perf_counter()
    trace = trace_step(PRESETS[model_name], Quantize(quantize), "bf16-true", LoRAArgs(r=8, alpha=16, dropout=dropout),
                       TrainArgs(micro_batch_size=batch, global_batch_size=batch, max_seq_length=seq,
                                 activation_checkpointing=checkpointing, max_norm=1.0), device="cpu")
    seconds = time.perf_counter() - started

    model, optimizer, step = build_step(model_name, quantize, batch, seq, checkpointing, dropout)
    step()
    measured = profiled_peak(step, resident_tensors(model, optimizer))
    print(json.dumps({"row": row, "predicted_bytes": trace.peak, "measured_bytes": measured,
                      "ratio": trace.peak / measured, "predicted_by_category": trace.peak_by_category,
                      "estimate_seconds": round(seconds, 1), "threads": torch.get_num_threads()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=ROWS, help="MODEL:QUANTIZE:BATCH:CHECKPOINTING:DROPOUT (seq 512)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    path = RESULTS / "estimate_accuracy.json"
    record = json.loads(path.read_text()) if path.is_file() else {"rows": {}}
    for row in args.rows:
        out = subprocess.run([sys.executable, __file__, "--child", row], check=True, capture_output=True, text=True,
                             cwd=HERE).stdout
        result = json.loads(out.strip().splitlines()[-1])
        result["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        record["rows"][row] = result
        print(f"{row}: predicted {result['predicted_bytes'] / 2**20:.1f} MiB, measured "
              f"{result['measured_bytes'] / 2**20:.1f} MiB, ratio {result['ratio']:.3f}", flush=True)
    record.update(machine=f"{platform.machine()} CPU", python=platform.python_version())
    path.write_text(json.dumps(record, indent=2) + "\n")
    write_markdown(record)


def write_markdown(record: dict) -> None:
    lines = ["# `litqlora estimate --device cpu` vs a real step (allocated tensor bytes)", "",
             "Seq 512, LoRA r=8 alpha=16 on every linear, fused AdamW, clipping 1.0. Measured, over a step after "
             "a warm-up step: everything resident before it plus the highest running sum of torch.profiler's "
             "allocation and free events during it (`memory_trace.profiled_peak`). Reproduce: "
             "`python benchmarks/estimate_accuracy.py --rows ROW`.", "",
             "| row (model:quantize:batch:checkpointing:dropout) | predicted MiB | measured MiB | predicted / measured |",
             "|---|---:|---:|---:|"]
    for row, r in record["rows"].items():
        lines.append(f"| {row} | {r['predicted_bytes'] / 2**20:.1f} | {r['measured_bytes'] / 2**20:.1f} | "
                     f"{r['ratio']:.3f} |")
    (RESULTS / "estimate_accuracy.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
