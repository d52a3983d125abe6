"""`litqlora estimate` for Qwen3-30B-A3B QLoRA (r 16, 2048 tokens, micro-batch 1, activation checkpointing) with
adapters on attention and on attention + every expert; results in benchmarks/memory/results/moe_qwen3-30b-a3b_*.json
and tutorials/memory.md#mixtures-of-experts. Needs no weights: the published config.json is enough (written here).

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
ROWS = {"attention": "[q,k,v,o]", "all": "[all]"}


def main() -> None:
    work = Path(tempfile.mkdtemp())
    checkpoint = work / "Qwen3-30B-A3B"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    for name, targets in ROWS.items():
        out = work / name
        subprocess.run(["litqlora", "estimate", "--checkpoint_dir", str(checkpoint), "--train.max_seq_length", "2048",
                        "--train.micro_batch_size", "1", "--lora.r", "16", "--lora.targets", targets,
                        "--train.activation_checkpointing", "true", "--out_dir", str(out)], check=True)
        shutil.copyfile(out / "estimate.json", RESULTS / f"moe_qwen3-30b-a3b_{name}.json")
        result = json.loads((out / "estimate.json").read_text())
        print(f"{name}: peak {result['peak_bytes'] / 2**30:.2f} GiB", file=sys.stderr)


if __name__ == "__main__":
    main()
