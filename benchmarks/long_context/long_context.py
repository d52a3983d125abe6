"""The longest trainable context per card size, predicted by `litqlora estimate` on fake CUDA, against Unsloth's
published table (issue 29).

    python benchmarks/long_context/long_context.py                 # every card size below (about a minute each on 2 cores)
    python benchmarks/long_context/long_context.py --sizes 24

The recipe is Unsloth's: Llama-3.1-8B, 4-bit QLoRA, r 32 (alpha 32, dropout 0) on q, k, v, o, gate, up and down,
micro-batch 1, activation checkpointing; our defaults do the rest (offloaded checkpoints on, tiled MLP and loss past
a tile). Each size runs `litqlora estimate --train.max_seq_length auto --device_memory SIZE` in its own process,
so its wall time is what a user waits. Results: benchmarks/long_context/results/long_context.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
# Unsloth's table ("Llama 3.1 (8B) max. context length", 4-bit QLoRA, r 32, all linear layers, batch 1) and
# Hugging Face + Flash Attention 2 beside it, by card memory in GB.
UNSLOTH = {8: 2972, 12: 21848, 16: 40724, 24: 78475, 40: 153977, 48: 191728, 80: 342733}
HF_FA2 = {8: None, 12: 932, 16: 2551, 24: 5789, 40: 12264, 48: 15502, 80: 28454}
RECIPE = ["--checkpoint_dir", "Llama-3.1-8B", "--quantize", "nf4", "--lora.r", "32", "--lora.alpha", "32",
          "--lora.dropout", "0", "--lora.targets", "[q, k, v, o, gate, up, down]", "--train.micro_batch_size", "1",
          "--train.global_batch_size", "1", "--train.activation_checkpointing", "true",
          "--train.max_seq_length", "auto"]


def longest(size_gb: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "lit_qlora.cli", "estimate", *RECIPE, "--device_memory",
                               f"{size_gb}GiB", "--out_dir", out], capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode:
            raise SystemExit(f"estimate at {size_gb} GB failed:\n{done.stderr[-3000:]}")
        result = json.loads((Path(out) / "estimate.json").read_text())
    return {"device_memory_gb": size_gb, "max_seq_length": result["max_seq_length"],
            "unsloth": UNSLOTH[size_gb], "hf_fa2": HF_FA2[size_gb],
            "ratio_to_unsloth": round(result["max_seq_length"] / UNSLOTH[size_gb], 2),
            "peak_gib": round(result["peak_bytes"] / 2**30, 2),
            "host_gib": round(result["offload_host_bytes"] / 2**30, 2),
            "pinned_gib": round(result["offload_pinned_bytes"] / 2**30, 2),
            "traces": len(result["traced_peaks"]), "seconds": round(seconds, 1)}


def table(rows: list[dict]) -> str:
    lines = ["| card | lit-qlora (predicted) | Unsloth | x Unsloth | HF + FA2 | peak | host (pinned) | traces, time |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hf = f"{r['hf_fa2']:,}" if r["hf_fa2"] else "OOM"
        lines.append(f"| {r['device_memory_gb']} GB | {r['max_seq_length']:,} | {r['unsloth']:,} | "
                     f"{r['ratio_to_unsloth']:.2f} | {hf} | {r['peak_gib']:.2f} GiB | {r['host_gib']:.1f} "
                     f"({r['pinned_gib']:.0f}) GiB | {r['traces']}, {r['seconds']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=list(UNSLOTH), choices=list(UNSLOTH))
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        rows.append(longest(size))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    isa = sorted({flag for flag in ("avx2", "avx512_bf16", "amx_bf16") if flag in cpu})
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu_isa": isa,
              "command": " ".join(["litqlora estimate", *RECIPE, "--device_memory", "SIZE"]), "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "long_context.json").write_text(json.dumps(record, indent=2) + "\n")
    (RESULTS / "long_context.md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
