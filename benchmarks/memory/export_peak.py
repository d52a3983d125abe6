"""Peak RSS of a whole `litqlora finetune` run by phase (issue 16): does anything after training raise the peak?

    python benchmarks/memory/export_peak.py                      # 1.1B shape, 1x512, checkpointing on, 1 step, QLoRA + LoRA
    python benchmarks/memory/export_peak.py --steps 2 --configs nf4

Each configuration runs `litqlora finetune` in a child process on the random TinyLlama-1.1B-shaped checkpoint of
train_memory.py (given a byte-level tokenizer of 258 tokens, so any text fits its 32000-token vocabulary) and 40
rows of ~600-byte samples: every sequence is a full 512 tokens. The parent samples the child's VmRSS every 0.05 s
and names the phase from what the run has written so far (the first validation until metrics.jsonl has a row,
then training, then the export's files as they appear under .final.tmp/). Reported: summary.json's
`peak_rss_bytes` (the whole run) and `peak_rss_train_bytes` (through the last training step), and the highest
sample of each phase. Results: benchmarks/memory/results/export_peak.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WORK = HERE.parent / "_work"
DEFAULT_CKPT = WORK / "tinyllama-1.1b-random"
MIB = 1 << 20


def byte_tokenizer(checkpoint_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json: byte-level BPE with no merges (<s>, </s> and the 256 bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if (checkpoint_dir / "tokenizer.json").is_file():
        return
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(checkpoint_dir / "tokenizer.json"))
    (checkpoint_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": False}) + "\n")


def dataset(path: Path) -> Path:
    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches".split()
    rows = [{"instruction": f"Repeat sample {i}.", "output": " ".join(words[(i + j) % len(words)] for j in range(120))}
            for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def phase(out_dir: Path) -> str:
    staging = out_dir / ".final.tmp"
    if (out_dir / "summary.json").is_file():
        return "summary"
    if (out_dir / "final").is_dir():
        return "after export"
    if (staging / "peft").is_dir():
        return "export: peft/"
    if (staging / "merged").is_dir():
        return "export: merged/"
    if staging.is_dir():
        return "export: adapter"
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        return "train/final validation"
    return "load/first validation"


def vm_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_one(args: argparse.Namespace, config: str) -> dict:
    out_dir = WORK / f"export_peak_{config}"
    subprocess.run(["rm", "-rf", str(out_dir)], check=True)
    cmd = [sys.executable, "-c", "from lit_qlora.cli import main; main()", "finetune",
           "--checkpoint_dir", str(args.checkpoint_dir), "--out_dir", str(out_dir), "--quantize", config,
           "--accelerator", "cpu", "--train.max_steps", str(args.steps), "--train.micro_batch_size", "1",
           "--train.global_batch_size", "1", "--train.max_seq_length", str(args.seq), "--train.warmup_steps", "1",
           "--train.activation_checkpointing", "true", "--data.json_path", str(dataset(WORK / "export_peak.jsonl")),
           "--data.val_split", "0.05"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples: list[tuple[float, int, str]] = []

    def sample() -> None:
        while proc.poll() is None:
            rss = vm_rss(proc.pid)
            if rss is not None:
                samples.append((time.perf_counter() - started, rss, phase(out_dir)))
            time.sleep(args.interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = proc.stdout.read()
    proc.wait()
    sampler.join()
    if proc.returncode:
        sys.exit(f"{config} failed:\n{output}")
    summary = json.loads((out_dir / "summary.json").read_text())
    phases: dict[str, dict] = {}
    for t, rss, name in samples:
        p = phases.setdefault(name, {"max_rss_mib": 0, "from_s": round(t, 1)})
        p["max_rss_mib"] = max(p["max_rss_mib"], round(rss / MIB))
        p["to_s"] = round(t, 1)
    return {"config": config, "peak_rss_bytes": summary["peak_rss_bytes"],
            "peak_rss_train_bytes": summary.get("peak_rss_train_bytes"), "phases": phases,
            "merged_bytes": (out_dir / "final" / "merged" / "model.safetensors").stat().st_size,
            "wall_seconds": round(summary["wall_seconds"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", type=Path, default=DEFAULT_CKPT)
    parser.add_argument("--configs", nargs="+", default=["nf4", "none"], choices=["nf4", "none"])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between RSS samples")
    parser.add_argument("--label", default="", help="a name for this measurement in the results (e.g. before/after)")
    args = parser.parse_args()
    WORK.mkdir(exist_ok=True)
    if args.checkpoint_dir == DEFAULT_CKPT and not (DEFAULT_CKPT / "model.safetensors").is_file():
        sys.path.insert(0, str(HERE))
        from load_memory import write_tinyllama

        write_tinyllama(DEFAULT_CKPT)
    byte_tokenizer(args.checkpoint_dir)
    rows = {}
    for config in args.configs:
        rows[config] = run_one(args, config)
        print(json.dumps(rows[config]), flush=True)
    if "nf4" in rows and "none" in rows:
        for key in ("peak_rss_bytes", "peak_rss_train_bytes"):
            if rows["nf4"][key] and rows["none"][key]:
                print(f"QLoRA/LoRA {key}: {rows['nf4'][key] / rows['none'][key]:.3f}")
    record_path = RESULTS / "export_peak.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    command = (f"python benchmarks/memory/export_peak.py --configs {' '.join(args.configs)} --steps {args.steps} "
               f"--seq {args.seq}")
    record[args.label or datetime.now(timezone.utc).isoformat(timespec="seconds")] = {
        "command": command, "steps": args.steps, "seq": args.seq, "rows": rows}
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    write_markdown(record)


def write_markdown(record: dict) -> None:
    lines = ["# Peak RSS of a whole `litqlora finetune` run by phase (issue 16)", "",
             "1.1B shape, batch 1, activation checkpointing on. `whole run` = summary.json's peak_rss_bytes; "
             "`training` = its peak_rss_train_bytes (VmHWM when the last step ended: load, first validation and the "
             "steps; not recorded before this change); phases: the highest 0.05 s RSS sample. `before` ran at commit "
             "adad29b, `after` with the streaming export.",
             "", "| label | config | steps, BxS | whole run MiB | training MiB | phase maxima (MiB) |",
             "|---|---|---|---:|---:|---|"]
    for label, rec in record.items():
        for r in rec["rows"].values():
            train = f"{r['peak_rss_train_bytes'] / MIB:.0f}" if r["peak_rss_train_bytes"] else "-"
            ph = "; ".join(f"{k} {v['max_rss_mib']}" for k, v in r["phases"].items())
            lines.append(f"| {label} | {r['config']} | {rec['steps']}, 1x{rec['seq']} | "
                         f"{r['peak_rss_bytes'] / MIB:.0f} | {train} | {ph} |")
    (RESULTS / "export_peak.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
