"""Training throughput and peak memory: QLoRA (NF4 base) vs LoRA (bf16 base), same model, batch and adapters.

    python benchmarks/speed/train_throughput.py --checkpoint_dir checkpoints/SmolLM2-135M-Instruct
    python benchmarks/speed/train_throughput.py --checkpoint_dir DIR --batch 4 --seq 512 --steps 3 --rounds 2

Each measurement is one child process (one configuration per process): load the base, add LoRA (r=8, all
linears), then warm-up step + timed optimizer steps (forward, chunked CE, backward, AdamW) on random token
batches. QLoRA and LoRA alternate for `--rounds` rounds and the ratio uses the medians, so both see the same
machine load. Peak RSS is the child's whole-process high-water mark. Results: benchmarks/speed/results/train_throughput.*
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def child(args: argparse.Namespace) -> None:
    import torch

    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.lora.layer import apply_lora
    from lit_qlora.train.loss import chunked_cross_entropy_sum
    from lit_qlora.memory.accounting import peak_rss_bytes
    from lit_qlora.base.threads import govern_threads

    torch.manual_seed(0)
    model = load_model(args.checkpoint_dir, args.quantize, "bf16-true")
    govern_threads(model)  # as `litqlora finetune` runs it
    apply_lora(model, r=8, alpha=16, dropout=0.0, targets="all", dtype=torch.bfloat16)
    model.checkpoint_blocks = model.config.n_layer if args.activation_checkpointing else 0
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    batch = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))

    def step() -> None:
        loss = chunked_cross_entropy_sum(model.lm_head, model.forward_hidden(batch), batch) / batch.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: first-touch allocations, kernel setup
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"seconds_per_step": statistics.median(times), "tokens_per_sec": batch.numel() / statistics.median(times),
                      "peak_rss_bytes": peak_rss_bytes()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", default="checkpoints/SmolLM2-135M-Instruct")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--quantize", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quantize:
        return child(args)

    import torch

    runs: dict[str, list[dict]] = {"nf4": [], "none": []}
    for _ in range(args.rounds):
        for quantize in ("nf4", "none"):
            cmd = [sys.executable, __file__, "--checkpoint_dir", args.checkpoint_dir, "--batch", str(args.batch),
                   "--seq", str(args.seq), "--steps", str(args.steps), "--quantize", quantize]
            if args.activation_checkpointing:
                cmd.append("--activation_checkpointing")
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[quantize].append(json.loads(out.strip().splitlines()[-1]))
            print(quantize, runs[quantize][-1], flush=True)

    def med(q: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[q])

    name = f"{Path(args.checkpoint_dir).name} {args.batch}x{args.seq} ckpt={'on' if args.activation_checkpointing else 'off'}"
    row = {
        "config": name,
        "qlora_tokens_per_sec": round(med("nf4", "tokens_per_sec"), 1),
        "lora_tokens_per_sec": round(med("none", "tokens_per_sec"), 1),
        "throughput_ratio": round(med("nf4", "tokens_per_sec") / med("none", "tokens_per_sec"), 3),
        "qlora_peak_rss_bytes": int(med("nf4", "peak_rss_bytes")),
        "lora_peak_rss_bytes": int(med("none", "peak_rss_bytes")),
        "memory_ratio": round(med("nf4", "peak_rss_bytes") / med("none", "peak_rss_bytes"), 3),
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in row.items() if k != "runs"}))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "train_throughput.json"
    record = json.loads(path.read_text()) if path.is_file() else {"rows": {}}
    record.update({"date": date.today().isoformat(), "torch": torch.__version__, "python": platform.python_version(),
                   "machine": f"{platform.machine()}, {torch.get_num_threads()} threads (CPU)",
                   "command": "python benchmarks/speed/train_throughput.py [--checkpoint_dir D] [--batch B] [--seq S] "
                              "[--activation_checkpointing]"})
    record["rows"][name] = row
    path.write_text(json.dumps(record, indent=2) + "\n")
    gib = 1024**3
    lines = [f"# Training throughput, QLoRA vs LoRA ({record['date']}, {record['machine']}, torch {record['torch']})",
             "", f"Reproduce: `{record['command']}`. Medians over alternating runs; one configuration per process.",
             "", "| config | QLoRA tok/s | LoRA tok/s | QLoRA / LoRA throughput | QLoRA peak RSS (GiB) | LoRA peak RSS (GiB) | memory ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in record["rows"].values():
        lines.append(f"| {r['config']} | {r['qlora_tokens_per_sec']} | {r['lora_tokens_per_sec']} | {r['throughput_ratio']} | "
                     f"{r['qlora_peak_rss_bytes'] / gib:.2f} | {r['lora_peak_rss_bytes'] / gib:.2f} | {r['memory_ratio']} |")
    (RESULTS / "train_throughput.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
