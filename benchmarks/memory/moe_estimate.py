"""`litqlora estimate` for Qwen3-30B-A3B QLoRA (r 16, 2048 tokens, micro-batch 1, activation checkpointing) with
adapters on attention and on attention + every expert, and gpt-oss-20b's with adapters on attention; results in
benchmarks/memory/results/moe_*.json and tutorials/memory.md#mixtures-of-experts. Needs no weights: the published
config.json files are enough (written here).

    python benchmarks/memory/moe_estimate.py   # ~2-4 minutes a row on a 2-core CPU
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

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
ROWS = {("qwen3-30b-a3b", "attention"): (QWEN3_30B_A3B, "[q,k,v,o]"),
        ("qwen3-30b-a3b", "all"): (QWEN3_30B_A3B, "[all]"),
        ("gpt-oss-20b", "attention"): (GPT_OSS_20B, "[q,k,v,o]")}


def main() -> None:
    work = Path(tempfile.mkdtemp())
    for (model, name), (config, targets) in ROWS.items():
        checkpoint = work / model
        checkpoint.mkdir(exist_ok=True)
        (checkpoint / "config.json").write_text(json.dumps(config))
        out = work / f"{model}-{name}"
        subprocess.run(["litqlora", "estimate", "--checkpoint_dir", str(checkpoint), "--train.max_seq_length", "2048",
                        "--train.micro_batch_size", "1", "--lora.r", "16", "--lora.targets", targets,
                        "--train.activation_checkpointing", "true", "--out_dir", str(out)], check=True)
        shutil.copyfile(out / "estimate.json", RESULTS / f"moe_{model}_{name}.json")
        result = json.loads((out / "estimate.json").read_text())
        print(f"{model} {name}: peak {result['peak_bytes'] / 2**30:.2f} GiB", file=sys.stderr)


if __name__ == "__main__":
    main()
