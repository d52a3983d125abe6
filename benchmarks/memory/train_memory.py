"""Whole-run peak RSS (and tokens/s) of real training steps: QLoRA vs LoRA (vs full fine-tuning), one per process.

    python benchmarks/memory/train_memory.py                                  # 1.1B shape, 1x512, checkpointing on
    python benchmarks/memory/train_memory.py --configs nf4 none full --steps 3 --rounds 1
    python benchmarks/memory/train_memory.py --checkpoint_dir /path/SmolLM2-135M-Instruct --batch 4 --no_checkpointing

Each child process loads the base (NF4 for `nf4`, bf16 for `none` and `full`), adds LoRA (r=8, alpha=16, every
linear incl. lm_head; `full` trains every parameter instead) and runs `--steps` optimizer steps through the same
path as `litqlora finetune`: Lightning Trainer, NF4Precision, FinetuneModule (chunked CE, clipping, fused AdamW).
Batches are fixed random tokens (seed 0), every token a target. Peak RSS is the child's VmHWM at exit: the whole
run, load included. tokens/s excludes the first (warm-up) step. Configurations alternate over `--rounds`, so
ratios come from the same session. The random TinyLlama-1.1B-shaped checkpoint is written by load_memory.py.
Results: benchmarks/memory/results/train_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DEFAULT_CKPT = HERE.parent / "_work" / "tinyllama-1.1b-random"


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def child(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.lora.layer import apply_lora
    from lit_qlora.memory.accounting import peak_rss_bytes
    from lit_qlora.base.threads import govern_threads
    from lit_qlora.train.precision import NF4Precision
    from lit_qlora.train.args import TrainArgs
    from lit_qlora.train.callbacks import HeapRelease
    from lit_qlora.train.module import FinetuneModule

    before = peak_rss_bytes()
    if args.batches:  # peers.py's token file: the same batches for every side; its shape sets steps x batch x seq
        from safetensors.torch import load_file

        batches = load_file(args.batches)["input_ids"]
        args.steps, args.batch, args.seq = batches.shape
    L.seed_everything(0, verbose=False)
    model = load_model(args.checkpoint_dir, "nf4" if args.child == "nf4" else "none", "bf16-true").train()
    govern_threads(model)  # as `litqlora finetune` runs it
    if args.child == "full":
        model.requires_grad_(True)
    else:
        apply_lora(model, r=8, alpha=16, dropout=0.0, targets="all", dtype=torch.bfloat16)
    model.checkpoint_blocks = model.config.n_layer if args.checkpointing else 0
    train = TrainArgs(max_steps=args.steps, micro_batch_size=args.batch, global_batch_size=args.batch,
                      max_seq_length=args.seq, warmup_steps=1, activation_checkpointing=args.checkpointing,
                      lr=args.lr or TrainArgs.lr)
    module = FinetuneModule(model, train, total_steps=args.steps)
    if not args.batches:
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=gen)
                   for _ in range(args.steps)]
    steps = [[{"input_ids": ids, "labels": ids.clone(), "num_tokens": ids.numel()}] for ids in batches]
    loader = DataLoader(steps, batch_size=None, collate_fn=lambda x: x)
    plugin = NF4Precision("bf16-true") if args.child == "nf4" else None
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=None if plugin else "bf16-true",
                        plugins=[plugin] if plugin else None, callbacks=[HeapRelease()], max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False)
    load_before = loadavg()
    trainer.fit(module, train_dataloaders=loader)
    timed = module.history[1:]
    print(json.dumps({
        "config": args.child, "peak_rss_bytes": peak_rss_bytes(), "rss_before_load_bytes": before,
        "tokens_per_sec": sum(r["tokens"] for r in timed) / sum(r["seconds"] for r in timed) if timed else None,
        "step_seconds": [round(r["seconds"], 2) for r in module.history],
        "losses": [round(r["loss"], 4) for r in module.history],
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "loadavg_before": load_before, "loadavg_after": loadavg(),
    }))


def write_markdown(record: dict) -> None:
    gib = 1024**3
    lines = [f"# Training peak memory, whole run (CPU RSS), {record['machine']}, torch {record['torch']}", "",
             "Peak RSS = the child's VmHWM after its last step (load, Trainer setup and all steps included). tokens/s "
             "excludes the first step; the machine is shared, so it is only comparable within one session (same "
             "`started`). `vs LoRA` = ratio to the `none` row of the same session.", "",
             "| checkpoint | BxS | act. ckpt | config | peak RSS GiB | vs LoRA | tokens/s | vs LoRA | loadavg (1 min, "
             "before/after) | started | reproduce |", "|---|---|---|---|---:|---:|---:|---:|---|---|---|"]
    for r in record["rows"].values():
        loads = ", ".join(f"{x['loadavg_before'][0]}/{x['loadavg_after'][0]}" for x in r["runs"])
        lines.append(f"| {r['checkpoint']} | {r['batch']}x{r['seq']} | {'on' if r['checkpointing'] else 'off'} | "
                     f"{ {'nf4': 'QLoRA', 'none': 'LoRA', 'full': 'full FT'}[r['config']]} | "
                     f"{r['peak_rss_bytes'] / gib:.2f} | {r.get('peak_rss_vs_lora', '-')} | "
                     f"{r['tokens_per_sec']:.1f} | {r.get('tokens_per_sec_vs_lora', '-')} | {loads} | {r['started']} | "
                     f"`{r['command']}` |")
    (RESULTS / "train_memory.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", default=str(DEFAULT_CKPT))
    parser.add_argument("--configs", nargs="+", default=["nf4", "none"], choices=["nf4", "none", "full"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no_checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, help="with --child: peak learning rate (default: TrainArgs')")
    parser.add_argument("--batches", help="with --child: read the token batches (steps x batch x seq) from this "
                        "safetensors file (peers.py writes it) instead of drawing them")
    parser.add_argument("--render", action="store_true", help="only rewrite results/train_memory.md from the JSON")
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.render:
        if not (RESULTS / "train_memory.json").is_file():
            parser.error(f"--render needs {RESULTS / 'train_memory.json'}; run a measurement first")
        return write_markdown(json.loads((RESULTS / "train_memory.json").read_text()))

    import torch

    if Path(args.checkpoint_dir) == DEFAULT_CKPT and not (DEFAULT_CKPT / "model.safetensors").is_file():
        sys.path.insert(0, str(HERE))
        from load_memory import write_tinyllama

        write_tinyllama(DEFAULT_CKPT)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    for _ in range(args.rounds):
        for config in args.configs:
            cmd = [sys.executable, __file__, "--checkpoint_dir", args.checkpoint_dir, "--batch", str(args.batch),
                   "--seq", str(args.seq), "--steps", str(args.steps), "--child", config]
            if not args.checkpointing:
                cmd.append("--no_checkpointing")
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[config].append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(runs[config][-1]), flush=True)

    name = (f"{Path(args.checkpoint_dir).name} {args.batch}x{args.seq} "
            f"ckpt={'on' if args.checkpointing else 'off'}")
    med = {c: {k: statistics.median(r[k] for r in rs) for k in ("peak_rss_bytes", "tokens_per_sec")}
           for c, rs in runs.items()}
    path = RESULTS / "train_memory.json"
    record = json.loads(path.read_text()) if path.is_file() else {"rows": {}}
    record.update({"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {torch.get_num_threads()} "
                              "torch threads (CPU)", "torch": torch.__version__, "python": platform.python_version()})
    for config, m in med.items():
        row = {"checkpoint": Path(args.checkpoint_dir).name, "batch": args.batch, "seq": args.seq,
               "checkpointing": args.checkpointing, "config": config, "started": started, **m, "runs": runs[config],
               "command": f"python benchmarks/memory/train_memory.py --checkpoint_dir {args.checkpoint_dir} --configs "
                          f"{' '.join(args.configs)} --batch {args.batch} --seq {args.seq} --steps {args.steps} "
                          f"--rounds {args.rounds}" + ("" if args.checkpointing else " --no_checkpointing")}
        if "none" in med and config != "none":
            row["peak_rss_vs_lora"] = round(m["peak_rss_bytes"] / med["none"]["peak_rss_bytes"], 3)
            row["tokens_per_sec_vs_lora"] = round(m["tokens_per_sec"] / med["none"]["tokens_per_sec"], 3)
        record["rows"][f"{name} {config}"] = row
    path.write_text(json.dumps(record, indent=2) + "\n")
    write_markdown(record)


if __name__ == "__main__":
    main()
