"""The GPU suite (issue 16 item 8): `litqlora finetune` on CUDA, QLoRA vs LoRA (compile on and off where the flag
exists), with torch's CUDA memory statistics from summary.json.

    python benchmarks/gpu/gpu_suite.py --models smollm2 llama-3.1-8b --quantize nf4 none [--compile false true]
        [--offload false auto] --tokenizer_dir DIR --out results.json

Each configuration is one `litqlora finetune` process (the users' command: load, first validation, steps, final
validation, every export). Checkpoints are random bf16 Hugging Face directories of the model's shape, written
once under --work (weights do not change speed or memory); the tokenizer comes from --tokenizer_dir (SmolLM2's:
its ids fit every vocabulary here). The dataset is synthetic rows long enough that packing fills each sequence.
Recorded: every step's seconds (metrics.jsonl: tokens / tokens_per_sec, each step ends with a host sync), the
median tokens/s of the steps after timing.WARMUP_STEPS with its spread (quartiles, extremes: issue 48 item 1; an 8B
row times 20 steps), the first step's tokens/s (warm-up, compile included), summary.json's peaks (allocated,
reserved, active; during training and for the whole run), wall time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

import timing

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODELS = {  # name -> (preset, micro-batch, sequence length, steps): 8B, 4 warm-up + 20 timed (~0.6 s each on an H200)
    "smollm2": ("SmolLM2-135M", 4, 512, 24),
    "llama-3.1-8b": ("Llama-3.1-8B", 2, 2048, 24),
}


def write_random_checkpoint(preset, out_dir: Path, tokenizer_dir: Path) -> Path:
    """A random bf16 Hugging Face checkpoint of `preset`'s shape (a preset name or a lit_qlora Config)."""
    import torch

    from lit_qlora.checkpoint.hf import save_hf_checkpoint

    from lit_qlora.checkpoint.files import TensorSpec
    from lit_qlora.model.presets import preset as named_preset
    from lit_qlora.model.transformer import Transformer

    if (out_dir / "model.safetensors").is_file():
        return out_dir
    config = named_preset(preset) if isinstance(preset, str) else preset
    with torch.device("meta"):
        model = Transformer(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(0)

    def produce(shape):
        return lambda: (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    specs = [TensorSpec(n, t.shape, torch.bfloat16, produce(t.shape)) for n, t in model.state_dict().items()]
    return save_hf_checkpoint(out_dir, config, specs, tokenizer_dir=tokenizer_dir, dtype=torch.bfloat16)


def write_dataset(path: Path, rows: int = 400, words: int = 900) -> Path:
    rng = random.Random(0)
    vocab = [w for w in "the of and to in is that for it as with was on be by this are from at or an which one".split()]
    vocab += ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(500)]
    data = [{"instruction": f"Continue text {i}.", "output": " ".join(rng.choice(vocab) for _ in range(words))}
            for i in range(rows)]
    path.write_text(json.dumps(data))
    return path


def run(ckpt: Path, data: Path, out_dir: Path, quantize: str, micro: int, seq: int, steps: int, compile_: str | None,
        checkpointing: bool, offload: str | None = None, extra: Sequence[str] = (),
        launcher: Sequence[str] | None = None, env: Optional[Mapping[str, str]] = None,
        accelerator: str = "cuda", warmup: int = timing.WARMUP_STEPS, verb: str = "finetune") -> dict:
    """One `litqlora finetune` process (or `litqlora grpo`: `verb`, on its bundled prompts; `micro` completions a
    step); `extra` options go last (they win), `launcher` replaces `python -m lit_qlora.cli` (benchmarks/gpu/check.py's
    memory-capped one), `env` is added to this process's environment (an A/B variant's settings)."""
    data_args = ["--data.json_path", str(data), "--data.packing", "true"] if verb == "finetune" else []
    cmd = [*(launcher or [sys.executable, "-m", "lit_qlora.cli"]), verb, "--checkpoint_dir", str(ckpt),
           "--out_dir", str(out_dir),
           "--accelerator", accelerator, "--quantize", quantize, *data_args,
           "--data.val_split", "0.02", "--lora.dropout", "0.05", "--train.max_steps", str(steps),
           "--train.micro_batch_size", str(micro), "--train.global_batch_size", str(micro),
           "--train.max_seq_length", str(seq), "--train.activation_checkpointing", str(checkpointing).lower(),
           "--train.warmup_steps", "1", "--overwrite", "true"]  # a rerun of the suite measures afresh
    if compile_ is not None:
        cmd += ["--compile", compile_]
    if offload is not None:  # default auto: on from 1 GiB of checkpointed block inputs (an 8B at 2x2048: 1 GiB)
        cmd += ["--train.offload_activations", offload]
    cmd += list(extra)
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - started
    row = {"quantize": quantize, "compile": compile_, "offload": offload, "micro_batch": micro, "seq": seq, "steps": steps,
           "checkpointing": checkpointing, "wall_seconds": round(wall, 1), "rc": proc.returncode}
    if proc.returncode:
        row["error"] = (proc.stdout + proc.stderr)[-3000:]
        return row
    summary = json.loads((out_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    seconds = [m["tokens"] / m["tokens_per_sec"] for m in metrics]
    rates = timing.timed([m["tokens_per_sec"] for m in metrics], warmup)
    row.update({
        "first_step_tokens_per_sec": round(metrics[0]["tokens_per_sec"], 1),
        "steady_tokens_per_sec": round(statistics.median(rates), 1) if rates else None,
        "timed_steps": len(rates), "step_seconds": [round(x, 4) for x in seconds],
        "tokens_per_sec_spread": {k: round(v, 4 if k == "rel_iqr" else 1) for k, v in timing.spread(rates).items()
                                  if v is not None} if rates else None,
        "losses": [round(m["loss"], 4) for m in metrics],
        **{k: v for k, v in summary.items()
           if k.startswith(("peak_", "offload_")) or k in ("compile_seconds", "val_loss")},
    })
    return row


def spread_text(row: dict) -> str:
    s = row.get("tokens_per_sec_spread")
    return f"[{s['min']}, {s['max']}]" if s else "-"


def gib(n) -> str:
    return f"{n / 2**30:.2f}" if isinstance(n, (int, float)) else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--quantize", nargs="+", default=["nf4", "none"])
    parser.add_argument("--compile", nargs="+", default=[None])
    parser.add_argument("--offload", nargs="+", default=[None], help="--train.offload_activations values (default auto)")
    parser.add_argument("--no_checkpointing", action="store_true")
    parser.add_argument("--finetune_args", default="", help="more finetune options, last: '--export.merged false'")
    parser.add_argument("--tokenizer_dir", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_suite"))
    parser.add_argument("--out", type=Path, default=Path("gpu_suite.json"))
    args = parser.parse_args()
    import torch

    args.work.mkdir(parents=True, exist_ok=True)
    data = write_dataset(args.work / "data.json")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    results = {"device": device, "torch": torch.__version__, "runs": []}
    for name in args.models:
        preset, micro, seq, steps = MODELS[name]
        t0 = time.perf_counter()
        ckpt = write_random_checkpoint(preset, args.work / name, args.tokenizer_dir)
        print(f"{name}: checkpoint ready in {time.perf_counter() - t0:.0f} s", flush=True)
        for compile_, offload, quantize in itertools.product(args.compile, args.offload, args.quantize):
            row = run(ckpt, data, args.work / f"out-{name}-{quantize}-{compile_}-{offload}", quantize, micro, seq,
                      steps, compile_, not args.no_checkpointing, offload, shlex.split(args.finetune_args))
            row["model"] = name
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\n{device}, torch {torch.__version__}")
    print("| model | BxS | quantize | compile | offload | tok/s steady (median) | [min, max] | first step tok/s | "
          "peak allocated (train) GiB | peak reserved GiB | whole-run peak allocated GiB | wall s |")
    print("|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results["runs"]:
        print(f"| {r['model']} | {r['micro_batch']}x{r['seq']} | {r['quantize']} | {r['compile']} | {r.get('offload')} | "
              f"{r.get('steady_tokens_per_sec', 'error')} | {spread_text(r)} | {r.get('first_step_tokens_per_sec', '-')} | "
              f"{gib(r.get('peak_allocated_train_bytes'))} | {gib(r.get('peak_reserved_bytes'))} | "
              f"{gib(r.get('peak_allocated_bytes'))} | {r['wall_seconds']} |")
    for r in results["runs"]:
        if r.get("step_seconds"):
            print(f"{r['model']} {r['quantize']} compile {r['compile']}: step seconds {r['step_seconds']}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
