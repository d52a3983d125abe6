"""`litqlora estimate` for the MoE goals of issue 54 item 7, QLoRA r 16, micro-batch 1, activation checkpointing, bf16
(a GPU's auto): Qwen3-30B-A3B at 2048 tokens with adapters on attention and on attention + every expert, its longest
context on a 24 GiB card (an RTX 3090; adapters on attention), the largest r of adapters on attention + every expert
that fits one at 2048 tokens, and gpt-oss-20b at 2048 tokens with adapters on attention. Results in
benchmarks/memory/results/moe_*.json and tutorials/memory.md#mixtures-of-experts. Needs no weights: the published
config.json files are enough (written here).

    python benchmarks/memory/moe_estimate.py [--rows attention longest largest_r gpt-oss]   # ~2-4 min a trace

"Fits" is `estimate --device_memory rtx3090`'s rule: the peak x 1.10 (the caching allocator's fragmentation) plus 0.5
GiB (CUDA's context) within the card's 24,576 MiB, so a peak of at most 21.4 GiB. The largest r: the peak grows by the
same bytes per unit of r (adapters, their gradients and AdamW's two moments, all linear in r), so it is traced at r 16
and r 32, the largest r that fits read off that line, and that r traced to check it fits (and r + 1 that it does not).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from lit_qlora.estimate.cards import CARDS
from lit_qlora.estimate.search import CUDA_RESERVE, FRAGMENTATION, fits

RESULTS = Path(__file__).parent / "results"
# Qwen/Qwen3-30B-A3B's config.json, as published.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
# openai/gpt-oss-20b's config.json, as published (its experts are MXFP4 on the Hub; the estimate needs no weights).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0,
                     "beta_slow": 1.0,
                     "factor": 32.0,
                     "original_max_position_embeddings": 4096,
                     "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088}
GIB = 2**30
CARD = CARDS["rtx3090"] * 2**20  # 24 GiB, as nvidia-smi reports an RTX 3090


def estimate(work: Path, model: str, config: dict, name: str, targets: str, r: int = 16, *extra: str) -> dict:
    checkpoint = work / model
    checkpoint.mkdir(exist_ok=True)
    (checkpoint / "config.json").write_text(json.dumps(config))
    out = work / f"{model}-{name}"
    cmd = ["litqlora", "estimate", "--checkpoint_dir", str(checkpoint), "--train.micro_batch_size", "1",
           "--lora.r", str(r), "--lora.targets", targets, "--train.activation_checkpointing", "true",
           "--out_dir", str(out), *(extra or ("--train.max_seq_length", "2048"))]
    subprocess.run(cmd, check=True)
    result = json.loads((out / "estimate.json").read_text())
    result["command"] = " ".join(["litqlora", *cmd[1:]]).replace(str(work), "CONFIGS")
    (RESULTS / f"moe_{model}_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{model} {name}: peak {result['peak_bytes'] / GIB:.2f} GiB", file=sys.stderr, flush=True)
    return result


def largest_r(work: Path) -> None:
    """The largest r of adapters on attention + every expert whose 2048-token step fits 24 GiB (module doc)."""
    low = estimate(work, "qwen3-30b-a3b", QWEN3_30B_A3B, "all", "[all]", 16)["peak_bytes"]
    high = estimate(work, "qwen3-30b-a3b", QWEN3_30B_A3B, "all-r32", "[all]", 32)["peak_bytes"]
    per_r = (high - low) / 16
    usable = (CARD - CUDA_RESERVE) / FRAGMENTATION  # what `estimate --device_memory rtx3090` lets a peak reach
    r = max(1, 16 + int((usable - low) // per_r))
    peaks = {16: low, 32: high}
    for rank in (r, r + 1):
        peaks[rank] = peaks.get(rank) or estimate(work, "qwen3-30b-a3b", QWEN3_30B_A3B, f"all-r{rank}", "[all]",
                                                  rank)["peak_bytes"]
    checked = fits(peaks[r], CARD, "cuda") and not fits(peaks[r + 1], CARD, "cuda")
    summary = {"card": "rtx3090 (24,576 MiB)", "usable_peak_bytes": round(usable),
               "largest_r": r if checked else None, "bytes_per_unit_of_r": round(per_r),
               "peaks": {str(k): v for k, v in sorted(peaks.items())}}
    (RESULTS / "moe_qwen3-30b-a3b_largest_r.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"largest r on 24 GiB: {summary}", file=sys.stderr)


ROWS = {
    "attention": lambda w: estimate(w, "qwen3-30b-a3b", QWEN3_30B_A3B, "attention", "[q,k,v,o]"),
    "longest": lambda w: estimate(w, "qwen3-30b-a3b", QWEN3_30B_A3B, "attention-longest-24gib", "[q,k,v,o]", 16,
                                  "--train.max_seq_length", "auto", "--device_memory", "rtx3090"),
    "largest_r": largest_r,  # its r 16 trace is the "all" row
    "gpt-oss": lambda w: estimate(w, "gpt-oss-20b", GPT_OSS_20B, "attention", "[q,k,v,o]"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    for row in args.rows:
        ROWS[row](work)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
