"""What a GGUF file says differently per model family, shared by `export_gguf` and `convert_gguf`: llama.cpp's
architecture name, tensor names, q/k row order, norm weights, and what llama.cpp cannot run.

Facts about llama.cpp these follow (its converter, convert_hf_to_gguf.py, writes the same):

* Mistral is llama.cpp's `llama` architecture; Gemma 3 text models are `gemma3`.
* Only `llama` permutes q/k rows into adjacent rope pairs; qwen2/qwen3/gemma2/gemma3/phi3 run NEOX rope on Hugging
  Face's halves.
* Gemma's RMSNorm scales by (1 + w): its GGUF norm weights are stored as w + 1 (llama.cpp multiplies by w).
* Gemma's sandwich norms have their own names (`post_attention_norm`, `ffn_norm` before the MLP, `post_ffw_norm`).
* Phi-3's q/k/v are one `attn_qkv` and its gate and up one `ffn_up` (gate rows first), as in its checkpoints.
* A mixture of experts stores each projection's experts as one (n_experts, out, in) tensor (`ffn_gate_exps`,
  `ffn_up_exps`, `ffn_down_exps`) and the router as `ffn_gate_inp` (kept f32 by llama.cpp's converter); Mixtral is
  `llama` with experts, Qwen3-MoE `qwen3moe` (its expert width `expert_feed_forward_length`), OLMoE `olmoe` (q/k
  norms over the whole projection, `clamp_kqv`). llama.cpp renormalizes the top-k weights of qwen3moe and llama and
  never of olmoe, whatever norm_topk_prob says.
* llama.cpp hard-codes Gemma's sliding layers (every other layer from the first for Gemma 2, five in six for Gemma
  3) and its query scale (head_dim ** -0.5, n_embd / n_head for the 27B models); it has no sliding window for
  `llama` or `phi3` (Phi-3's is switched off in llama.cpp) and no final soft-cap for Gemma 3.
"""

from __future__ import annotations

import re

from lit_qlora.base.errors import UserError

ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                 "gemma3_text": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe", "mixtral": "llama",
                 "olmoe": "olmoe"}
"""Hugging Face model_type -> llama.cpp architecture."""
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text",
               "phi3": "phi3"}
"""llama.cpp architecture -> the model_type convert_gguf writes."""
GEMMA_ARCHS = ("gemma2", "gemma3")
GEMMA_SLIDING_EVERY = {"gemma2": 2, "gemma3": 6}  # llama.cpp: layer i slides unless (i + 1) % every == 0
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales these queries by (n_embd / n_head) ** -0.5

TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_SHARED = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
_PLAIN_NORMS = {"post_attention_layernorm": "ffn_norm"}
_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_PHI3_FUSED = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
# A mixture of experts: the router, and each projection of every expert as one (n_experts, out, in) tensor.
_EXPERTS = {"mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
            "mlp.experts.down_proj": "ffn_down_exps"}
RENORMALIZES_TOP_K = {"qwen3moe": True, "llama": True, "olmoe": False}
"""Whether llama.cpp renormalizes an architecture's top-k routing weights (it does not read norm_topk_prob)."""


class GGUFExportError(UserError, ValueError):
    """A checkpoint export_gguf cannot write for llama.cpp; the message says why and what to use instead."""


def block_names(arch: str) -> dict[str, str]:
    """Hugging Face module (within a block) -> GGUF tensor name (within `blk.N`)."""
    names = {**_SHARED, **(_GEMMA_NORMS if arch in GEMMA_ARCHS else _PLAIN_NORMS)}
    if arch == "phi3":
        del names["mlp.gate_proj"], names["mlp.up_proj"]
        names.update(_PHI3_FUSED)
    if arch in RENORMALIZES_TOP_K:
        names.update(_EXPERTS)
    return names


def gguf_name(hf_name: str, arch: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`."""
    base, _, suffix = hf_name.rpartition(".")
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{suffix}"
    parts = base.split(".", 3)
    names = block_names(arch)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in names:
        return f"blk.{parts[2]}.{names[parts[3]]}.{suffix}"
    raise GGUFExportError(f"no GGUF name for the weight {hf_name} of a {arch} model")


def hf_name(name: str, arch: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for names the family has not."""
    base, _, suffix = name.rpartition(".")
    top = {v: k for k, v in TOP_NAMES.items()}
    if base in top:
        return f"{top[base]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    names = {v: k for k, v in block_names(arch).items()}
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{suffix}"
    return None


def permutes_rope_rows(arch: str) -> bool:
    return arch == "llama"


def norm_offset(arch: str) -> float:
    """Added to norm weights on export (subtracted on import): Gemma's (1 + w) as llama.cpp's plain w."""
    return 1.0 if arch in GEMMA_ARCHS else 0.0


def is_norm(hf_tensor_name: str) -> bool:
    return hf_tensor_name.endswith("norm.weight")


def gemma_layer_types(arch: str, n_layer: int) -> list[str]:
    """The sliding and full layers llama.cpp gives a Gemma model of `n_layer` layers."""
    from lit_qlora.model.config import sliding_pattern

    return sliding_pattern(n_layer, GEMMA_SLIDING_EVERY[arch])


def gemma_query_scalar(arch: str, n_layer: int, n_embd: int, n_head: int, head_dim: int) -> float:
    """The query_pre_attn_scalar llama.cpp uses for a Gemma model of this shape."""
    return n_embd / n_head if n_layer == GEMMA_27B_LAYERS[arch] else head_dim


def refusals(config) -> list[str]:
    """Why llama.cpp would not run `config` as lit-qlora does (empty: exportable)."""
    arch = ARCHITECTURES.get(config.model_type)
    if config.model_type == "gpt_oss":
        return ["lit-qlora does not write gpt-oss to GGUF yet (llama.cpp's gpt-oss keeps its experts in MXFP4 and "
                "its attention sinks as tensors of their own): convert the merged model with llama.cpp's "
                "convert_hf_to_gguf.py"]
    if arch is None:
        return [f"llama.cpp has no architecture for model_type {config.model_type!r}"]
    found = []
    if config.n_experts and config.norm_topk_prob != RENORMALIZES_TOP_K[arch]:
        found.append(f"norm_topk_prob {str(config.norm_topk_prob).lower()} on a {config.model_type} model (llama.cpp's "
                     f"{arch} {'always' if RENORMALIZES_TOP_K[arch] else 'never'} renormalizes the top-k weights)")
    if arch == "olmoe" and config.n_query_groups != config.n_head:
        found.append(f"grouped-query attention ({config.n_query_groups} key/value heads for {config.n_head}) in an "
                     "OLMoE model (llama.cpp's olmoe sizes its key norm for as many key heads as query heads)")
    if config.dense_mlp_layers:
        found.append(f"dense MLP layers {config.dense_mlp_layers} among the experts (llama.cpp's {arch} has experts "
                     "in every layer)")
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    allowed = {"llama": ("llama3", "linear"), "phi3": ("longrope", "linear")}.get(arch, ("linear",))
    if kind not in (None, "default", *allowed):
        found.append(f"{kind} rope scaling on a {arch} model")
    if config.partial_rotary_factor != 1.0 and arch != "phi3":
        found.append("partial rotary embeddings outside Phi-3")
    if arch in GEMMA_ARCHS or arch == "phi3":
        if config.qkv_bias or config.o_bias or config.mlp_bias:
            found.append(f"linear biases in a {arch} model")
    if arch in GEMMA_ARCHS:
        want = gemma_query_scalar(arch, config.n_layer, config.n_embd, config.n_head, config.head_dim)
        if (config.query_pre_attn_scalar or config.head_dim) != want:
            found.append(f"query_pre_attn_scalar {config.query_pre_attn_scalar} (llama.cpp scales {arch} queries "
                         f"by {want:g} ** -0.5 at this shape)")
        layer_types = config.layer_types or ["sliding_attention"] * config.n_layer
        if config.sliding_window is not None and layer_types != gemma_layer_types(arch, config.n_layer):
            found.append(f"sliding layers {layer_types} (llama.cpp's {arch} slides every layer but each "
                         f"{GEMMA_SLIDING_EVERY[arch]}th)")
        if config.sliding_window is None:
            found.append(f"a {arch} model without a sliding window")
    if arch == "gemma2" and not config.tie_embeddings:
        found.append("an output head apart from the embedding on Gemma 2 (llama.cpp's gemma2 reads the embedding as "
                     "its head; a LoRA on lm_head unties them: train without it, e.g. "
                     "--lora.targets '[q, k, v, o, gate, up, down]')")
    if arch == "gemma3" and config.final_softcap is not None:
        found.append("a final logit soft-cap on Gemma 3 (llama.cpp's gemma3 has none)")
    if arch == "gemma3" and config.rope_local_base not in (None, 10000.0):
        found.append(f"a sliding-layer rope base of {config.rope_local_base:g} (llama.cpp's gemma3 uses 10000)")
    return found


def context_length(config) -> tuple[int, str | None]:
    """The context length to write, and why it is shorter than the model's when it is: llama.cpp runs `llama` and
    `phi3` with full attention, which equals the sliding window's only within the window."""
    arch = ARCHITECTURES[config.model_type]
    window = config.sliding_window
    if arch in ("llama", "qwen2", "qwen3", "phi3") and window is not None and window < config.max_seq_length:
        return window, (f"llama.cpp's {arch} has no sliding window, so the file's context length is the "
                        f"{window}-token window (within it full attention is exact), not {config.max_seq_length}")
    return config.max_seq_length, None
