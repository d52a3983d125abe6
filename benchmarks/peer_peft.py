"""Our LoRA vs transformers+peft LoRA on identical token batches: tokens/s and whole-run peak RSS, one per process.

    python benchmarks/peer_peft.py --checkpoint_dir /path/SmolLM2-135M-Instruct --batch 4 --seq 512 --rounds 2

Both sides: the same Hugging Face checkpoint in bf16, LoRA r=8, alpha=16, dropout 0 on every linear (q, k, v, o,
gate, up, down, lm_head), fused AdamW (lr 1e-4), gradient clipping at 1.0, activation checkpointing per block
unless --no_checkpointing, the same fixed random token batches (seed 0, every token a target). Ours is
benchmarks/train_memory.py's child (Lightning Trainer + FinetuneModule); peft's is a plain PyTorch loop over
`AutoModelForCausalLM` + `get_peft_model` (non-reentrant gradient checkpointing). tokens/s excludes the first
step. The two sides alternate over --rounds. Results: benchmarks/results/peer_peft.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def peft_child(args: argparse.Namespace) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(HERE.parent))
    from lit_qlora.memory import peak_rss_bytes

    before = peak_rss_bytes()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint_dir, dtype=torch.bfloat16)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=True)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=gen) for _ in range(args.steps)]
    load_before = loadavg()
    seconds, losses = [], []
    for ids in batches:
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
        losses.append(round(loss.item(), 4))
    tokens = args.batch * args.seq
    print(json.dumps({
        "config": "peft", "peak_rss_bytes": peak_rss_bytes(), "rss_before_load_bytes": before,
        "tokens_per_sec": tokens * (len(seconds) - 1) / sum(seconds[1:]), "step_seconds": [round(s, 2) for s in seconds],
        "losses": losses, "trainable_params": sum(p.numel() for p in params),
        "loadavg_before": load_before, "loadavg_after": loadavg(),
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no_checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return peft_child(args)

    import peft
    import torch
    import transformers

    common = ["--checkpoint_dir", args.checkpoint_dir, "--batch", str(args.batch), "--seq", str(args.seq),
              "--steps", str(args.steps)] + ([] if args.checkpointing else ["--no_checkpointing"])
    commands = {"ours": [sys.executable, str(HERE / "train_memory.py"), *common, "--child", "none"],
                "peft": [sys.executable, __file__, *common, "--child"]}
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    runs: dict[str, list[dict]] = {k: [] for k in commands}
    for _ in range(args.rounds):
        for side, cmd in commands.items():
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[side].append(json.loads(out.strip().splitlines()[-1]))
            print(side, json.dumps(runs[side][-1]), flush=True)
    med = {s: {k: statistics.median(r[k] for r in rs) for k in ("peak_rss_bytes", "tokens_per_sec")}
           for s, rs in runs.items()}
    name = f"{Path(args.checkpoint_dir).name} {args.batch}x{args.seq} ckpt={'on' if args.checkpointing else 'off'}"
    row = {"name": name, "started": started, "medians": med, "runs": runs,
           "throughput_ours_over_peft": round(med["ours"]["tokens_per_sec"] / med["peft"]["tokens_per_sec"], 3),
           "peak_rss_ours_over_peft": round(med["ours"]["peak_rss_bytes"] / med["peft"]["peak_rss_bytes"], 3),
           "command": f"python benchmarks/peer_peft.py --checkpoint_dir {args.checkpoint_dir} --batch {args.batch} "
                      f"--seq {args.seq} --steps {args.steps} --rounds {args.rounds}"
                      + ("" if args.checkpointing else " --no_checkpointing")}
    path = RESULTS / "peer_peft.json"
    record = json.loads(path.read_text()) if path.is_file() else {"rows": {}}
    record.update({"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads (CPU)",
                   "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                   "python": platform.python_version()})
    record["rows"][name] = row
    path.write_text(json.dumps(record, indent=2) + "\n")
    gib = 1024**3
    lines = [f"# Our LoRA vs transformers {record['transformers']} + peft {record['peft']} LoRA "
             f"({record['machine']}, torch {record['torch']})", "",
             "Identical token batches, rank, targets, micro-batch, sequence length and checkpointing; medians of "
             "alternating runs; peak RSS = whole run. Goal: ours >= 1.5x peft's tokens/s at <= 0.8x its peak RSS.", "",
             "| config | ours tok/s | peft tok/s | ours / peft tok/s | ours peak GiB | peft peak GiB | ours / peft memory "
             "| loadavg 1 min (each run, before) | started | reproduce |", "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in record["rows"].values():
        m = r["medians"]
        loads = " ".join(f"{s}:{x['loadavg_before'][0]}" for s in r["runs"] for x in r["runs"][s])
        lines.append(f"| {r['name']} | {m['ours']['tokens_per_sec']:.1f} | {m['peft']['tokens_per_sec']:.1f} | "
                     f"{r['throughput_ours_over_peft']} | {m['ours']['peak_rss_bytes'] / gib:.2f} | "
                     f"{m['peft']['peak_rss_bytes'] / gib:.2f} | {r['peak_rss_ours_over_peft']} | {loads} | "
                     f"{r['started']} | `{r['command']}` |")
    (RESULTS / "peer_peft.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
