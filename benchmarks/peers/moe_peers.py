"""A mixture of experts, ours vs transformers + peft on the CPU (issue 54 item 8): tokens/s and whole-run peak RSS.

    python benchmarks/peers/moe_peers.py --tokenizer_dir checkpoints/SmolLM2-135M-Instruct [--rounds 2]

The model: OLMoE-1B-7B's shape scaled down (8 layers of 64 experts, 8 per token, hidden 512, expert width 256, 8
heads; SmolLM2's 49,152-token vocabulary so `litqlora finetune` can tokenize its shipped dataset), random weights
written by transformers in the Hub's layout under benchmarks/_work/. Every side: LoRA r 8, alpha 16, dropout 0 (the
MoE presets'; peft's expert wrapper refuses any other) on q, k, v, o and every expert's gate, up and down (peft:
`target_parameters` on gate_up_proj at rank 16, which is our separate gate and up adapters' parameter count, and
down_proj at 8), activation checkpointing, AdamW, the compute dtype `--precision auto` picks on this CPU (fp32 on
AVX2, bf16 where the CPU computes it). Ours is `litqlora finetune` (LoRA: --quantize none; QLoRA: nf4) exactly as
benchmarks/peers/peers.py runs it; peft trains transformers 5's own MoE forward on the same number of tokens. Ratios
are measured in the same run, the sides alternating over rounds. Results: benchmarks/peers/results/moe_peers.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peers  # noqa: E402  (its children: `litqlora finetune`, and a training loop for a peer model)

SHAPE = dict(hidden_size=512, intermediate_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
             num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
             vocab_size=49152, tie_word_embeddings=True)


def write_checkpoint(tokenizer_dir: Path) -> Path:
    import torch
    import transformers

    from lit_qlora.checkpoint.hf import copy_tokenizer_files

    out = peers.WORK / "olmoe-scaled-8x64"
    if not (out / "model.safetensors").is_file():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("olmoe", **SHAPE))
        model.save_pretrained(out, safe_serialization=True)
        copy_tokenizer_files(tokenizer_dir, out)
    return out


def peft_moe_model(args, seq: int):
    """transformers' OLMoE + peft: adapters on attention and, through target_parameters, every expert."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.checkpoint_dir, dtype=getattr(torch, peers.TORCH_DTYPE[args.dtype]))
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                        rank_pattern={"gate_up_proj": 16}, alpha_pattern={"gate_up_proj": 32})
    model = get_peft_model(model, config)
    return model, lambda ids: model(input_ids=ids, labels=ids).loss, "LoRA on attention and every expert (peft)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer_dir", type=Path, default=Path("checkpoints/SmolLM2-135M-Instruct"))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", choices=list(peers.PRECISION), default=None,
                        help="default: what --precision auto picks on this CPU")
    parser.add_argument("--results_dir", type=Path, default=HERE / "results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint_dir", help=argparse.SUPPRESS)
    parser.add_argument("--batches", help=argparse.SUPPRESS)
    parser.add_argument("--quantize", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.checkpointing, args.dropout, args.compile, args.prepare = True, 0.0, None, False
    if args.child == "peft":
        peers.peft_model = peft_moe_model  # the peer's training loop, our model builder
        return peers.peer_child(args)
    if args.child == "ours":
        return peers.ours_child(args)
    if args.dtype is None:
        from lit_qlora.base.precision import choose_precision

        args.dtype = "bf16" if choose_precision("auto", "cpu")[0].startswith("bf16") else "fp32"
    args.checkpoint_dir = str(write_checkpoint(args.tokenizer_dir))
    common = [sys.executable, __file__, "--checkpoint_dir", args.checkpoint_dir, "--dtype", args.dtype, "--batch",
              str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    sides = {"ours LoRA": common + ["--child", "ours"], "ours QLoRA": common + ["--child", "ours", "--quantize"],
             "peft LoRA": common + ["--child", "peft", "--batches", str(peers.write_batches(args))]}
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side, cmd in sides.items():
            runs[side].append(peers.run(cmd))
            print(side, json.dumps(runs[side][-1]), flush=True)
    record(args, started, runs)


def record(args, started: str, runs: dict[str, list[dict]]) -> None:
    med = {s: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_sec", "peak_rss_bytes")}
           for s, rs in runs.items()}
    isa = subprocess.run(["bash", "-c", "lscpu | grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16' | sort -u"],
                         capture_output=True, text=True).stdout.split()
    ratios = {"ours LoRA / peft LoRA tokens/s": med["ours LoRA"]["tokens_per_sec"] / med["peft LoRA"]["tokens_per_sec"],
              "ours LoRA / peft LoRA peak RSS": med["ours LoRA"]["peak_rss_bytes"] / med["peft LoRA"]["peak_rss_bytes"],
              "ours QLoRA / peft LoRA tokens/s": med["ours QLoRA"]["tokens_per_sec"] / med["peft LoRA"]["tokens_per_sec"],
              "ours QLoRA / peft LoRA peak RSS": med["ours QLoRA"]["peak_rss_bytes"] / med["peft LoRA"]["peak_rss_bytes"],
              "ours QLoRA / ours LoRA tokens/s": med["ours QLoRA"]["tokens_per_sec"] / med["ours LoRA"]["tokens_per_sec"]}
    result = {"started": started, "cpu_isa": isa, "dtype": args.dtype, "batch": args.batch, "seq": args.seq,
              "steps": args.steps, "rounds": args.rounds, "shape": SHAPE, "medians": med,
              "ratios": {k: round(v, 3) for k, v in ratios.items()}, "runs": runs,
              "versions": {"ours": peers.versions("ours"), "peft": peers.versions("peft")},
              "command": f"python benchmarks/peers/moe_peers.py --batch {args.batch} --seq {args.seq} --steps "
                         f"{args.steps} --rounds {args.rounds} --dtype {args.dtype}"}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "moe_peers.json").write_text(json.dumps(result, indent=2) + "\n")
    gib = 1024**3
    lines = ["# A mixture of experts (OLMoE's shape scaled: 8 layers x 64 experts, top 8): ours vs transformers + peft",
             "", f"CPU ISA: {', '.join(isa)}; {args.dtype}; {args.batch}x{args.seq} tokens a step, {args.steps} steps, "
             f"{args.rounds} rounds alternating; started {started}. Goal: ours >= 2x peft's tokens/s at <= 0.5x its "
             "peak RSS; our QLoRA >= 0.9x our LoRA.", "", "| side | tokens/s (median) | peak RSS GiB (median) |",
             "|---|---:|---:|"]
    lines += [f"| {s} | {m['tokens_per_sec']:.1f} | {m['peak_rss_bytes'] / gib:.2f} |" for s, m in med.items()]
    lines += ["", "| ratio | value |", "|---|---:|"] + [f"| {k} | {v:.3f} |" for k, v in ratios.items()]
    lines += ["", f"Reproduce: `{result['command']}`", ""]
    (args.results_dir / "moe_peers.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
