"""Shapes of the common checkpoints, from their published config.json files: `preset("Llama-3.1-8B")` is what
`Config.from_checkpoint` reads from that model's directory (benchmarks, the estimate and tests build from them)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lit_qlora.base.errors import InvalidInput
from lit_qlora.model.config import Config, sliding_pattern


def preset(name: str, **overrides: Any) -> Config:
    """The preset `name`, with `overrides` replaced."""
    if name not in PRESETS:
        raise InvalidInput(f"Unknown model preset {name!r}. Known presets: {', '.join(sorted(PRESETS))}.")
    return replace(PRESETS[name], **overrides)


def _llama3_scaling(factor: float, original: int) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }


# Phi-4-mini-instruct's long-context RoPE (config.json): short factors within its 4096 pretraining tokens.
_PHI4_MINI_ROPE = {
    "long_factor": [1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
                    2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
                    5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158,
                    11.70738129, 13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105,
                    25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71,
                    32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77],
    "short_factor": [1.0] * 48,
    "type": "longrope",
    "original_max_position_embeddings": 4096,
}

PRESETS: dict[str, Config] = {
    c.name: c
    for c in [
        Config("SmolLM2-135M", "llama", 49152, 30, 576, 9, 3, 64, 1536, 1e-5, 100000.0, None, 8192,
               tie_embeddings=True, bos_token_id=1, eos_token_id=2),
        Config("SmolLM2-360M", "llama", 49152, 32, 960, 15, 5, 64, 2560, 1e-5, 100000.0, None, 8192,
               tie_embeddings=True, bos_token_id=1, eos_token_id=2),
        Config("SmolLM2-1.7B", "llama", 49152, 24, 2048, 32, 32, 64, 8192, 1e-5, 130000.0, None, 8192,
               tie_embeddings=True, bos_token_id=1, eos_token_id=2),
        Config("TinyLlama-1.1B", "llama", 32000, 22, 2048, 32, 4, 64, 5632, 1e-5, 10000.0, None, 2048),
        Config("Llama-2-7b", "llama", 32000, 32, 4096, 32, 32, 128, 11008, 1e-5, 10000.0, None, 4096),
        Config("Llama-2-13b", "llama", 32000, 40, 5120, 40, 40, 128, 13824, 1e-5, 10000.0, None, 4096),
        Config("Llama-3-8B", "llama", 128256, 32, 4096, 32, 8, 128, 14336, 1e-5, 500000.0, None, 8192,
               bos_token_id=128000, eos_token_id=128001),
        Config("Llama-3.1-8B", "llama", 128256, 32, 4096, 32, 8, 128, 14336, 1e-5, 500000.0,
               _llama3_scaling(8.0, 8192), 131072, bos_token_id=128000, eos_token_id=128001),
        Config("Llama-3.2-1B", "llama", 128256, 16, 2048, 32, 8, 64, 8192, 1e-5, 500000.0,
               _llama3_scaling(32.0, 8192), 131072, tie_embeddings=True, bos_token_id=128000, eos_token_id=128001),
        Config("Llama-3.2-3B", "llama", 128256, 28, 3072, 24, 8, 128, 8192, 1e-5, 500000.0,
               _llama3_scaling(32.0, 8192), 131072, tie_embeddings=True, bos_token_id=128000, eos_token_id=128001),
        Config("Mistral-7B-v0.1", "mistral", 32000, 32, 4096, 32, 8, 128, 14336, 1e-5, 10000.0, None, 32768,
               sliding_window=4096),
        Config("Qwen2.5-0.5B", "qwen2", 151936, 24, 896, 14, 2, 64, 4864, 1e-6, 1000000.0, None, 32768,
               qkv_bias=True, tie_embeddings=True, bos_token_id=151643, eos_token_id=151643),
        Config("Qwen2.5-1.5B", "qwen2", 151936, 28, 1536, 12, 2, 128, 8960, 1e-6, 1000000.0, None, 32768,
               qkv_bias=True, tie_embeddings=True, bos_token_id=151643, eos_token_id=151643),
        Config("Qwen3-0.6B", "qwen3", 151936, 28, 1024, 16, 8, 128, 3072, 1e-6, 1000000.0, None, 40960,
               tie_embeddings=True, qk_norm=True, bos_token_id=151643, eos_token_id=151645),
        Config("Qwen3-8B", "qwen3", 151936, 36, 4096, 32, 8, 128, 12288, 1e-6, 1000000.0, None, 40960,
               qk_norm=True, bos_token_id=151643, eos_token_id=151645),
        Config("Gemma-2-2B", "gemma2", 256000, 26, 2304, 8, 4, 256, 9216, 1e-6, 10000.0, None, 8192,
               tie_embeddings=True, sliding_window=4096, layer_types=sliding_pattern(26, 2), norm_plus_one=True,
               embed_scale=True, sandwich_norms=True, mlp_activation="gelu_tanh", query_pre_attn_scalar=256,
               attn_softcap=50.0, final_softcap=30.0, bos_token_id=2, eos_token_id=1, pad_token_id=0),
        Config("Gemma-2-9B", "gemma2", 256000, 42, 3584, 16, 8, 256, 14336, 1e-6, 10000.0, None, 8192,
               tie_embeddings=True, sliding_window=4096, layer_types=sliding_pattern(42, 2), norm_plus_one=True,
               embed_scale=True, sandwich_norms=True, mlp_activation="gelu_tanh", query_pre_attn_scalar=256,
               attn_softcap=50.0, final_softcap=30.0, bos_token_id=2, eos_token_id=1, pad_token_id=0),
        Config("Gemma-3-1B", "gemma3_text", 262144, 26, 1152, 4, 1, 256, 6912, 1e-6, 1000000.0, None, 32768,
               tie_embeddings=True, sliding_window=512, layer_types=sliding_pattern(26, 6), rope_local_base=10000.0,
               qk_norm=True, norm_plus_one=True, embed_scale=True, sandwich_norms=True, mlp_activation="gelu_tanh",
               query_pre_attn_scalar=256, bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0),
        Config("Phi-3-mini-4k", "phi3", 32064, 32, 3072, 32, 32, 96, 8192, 1e-5, 10000.0, None, 4096,
               sliding_window=2047, bos_token_id=1, eos_token_id=32000, pad_token_id=32000),
        Config("Phi-4-mini", "phi3", 200064, 32, 3072, 24, 8, 128, 8192, 1e-5, 10000.0, _PHI4_MINI_ROPE, 131072,
               tie_embeddings=True, sliding_window=262144, partial_rotary_factor=0.75, bos_token_id=199999,
               eos_token_id=200020, pad_token_id=199999),
        # Mixtures of experts (config.json's num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob).
        Config("Qwen3-30B-A3B", "qwen3_moe", 151936, 48, 2048, 32, 4, 128, 6144, 1e-6, 1000000.0, None, 40960,
               qk_norm=True, bos_token_id=151643, eos_token_id=151645, n_experts=128, n_experts_per_token=8,
               moe_intermediate_size=768, norm_topk_prob=True, router_aux_loss_coef=0.001),
        Config("Mixtral-8x7B", "mixtral", 32000, 32, 4096, 32, 8, 128, 14336, 1e-5, 1000000.0, None, 32768,
               n_experts=8, n_experts_per_token=2, norm_topk_prob=True, router_aux_loss_coef=0.02),
        Config("OLMoE-1B-7B", "olmoe", 50304, 16, 2048, 16, 16, 128, 1024, 1e-5, 10000.0, None, 4096,
               qk_norm=True, qk_norm_width="all", bos_token_id=None, eos_token_id=50279, pad_token_id=1,
               n_experts=64, n_experts_per_token=8, router_aux_loss_coef=0.01),
        Config("gpt-oss-20b", "gpt_oss", 201088, 24, 2880, 64, 8, 64, 2880, 1e-5, 150000.0,
               {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}, 131072, qkv_bias=True, o_bias=True, sliding_window=128,
               layer_types=["sliding_attention", "full_attention"] * 12, bos_token_id=199998, eos_token_id=200002,
               pad_token_id=199999, n_experts=32, n_experts_per_token=4, router_aux_loss_coef=0.9,
               attn_sinks=True, router_topk_softmax=True, expert_bias=True, swiglu_limit=7.0),
        Config("Qwen2.5-7B", "qwen2", 152064, 28, 3584, 28, 4, 128, 18944, 1e-6, 1000000.0, None, 32768,
               qkv_bias=True, bos_token_id=151643, eos_token_id=151643),
    ]
}
