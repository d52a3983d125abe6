"""Model configuration (one dataclass for the Llama family, read from and written to HF `config.json`), the one
precision/dtype table and the typed quantize choice."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any


from lit_qlora.base.errors import InvalidInput, MissingFile

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "qwen3_moe", "mixtral",
                         "olmoe", "gpt_oss")
GEMMA = ("gemma2", "gemma3_text")
MOE = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")
"""Mixtures of experts: some or all blocks route each token to the top k of n experts (lit_qlora.model.moe)."""

# transformers' defaults for fields a family's config.json may leave out, where they differ from Llama's: a field
# left out means what it means to transformers (a Qwen3 head is 128 wide there, not hidden_size / heads).
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 128, "max_position_embeddings": 32768},
    "gemma2": {"head_dim": 256, "max_position_embeddings": 8192, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
               "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0},
    "gemma3_text": {"head_dim": 256, "max_position_embeddings": 131072, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
                    "pad_token_id": 0},
    "phi3": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 32000,
             "pad_token_id": 32000},
    "qwen3_moe": {"max_position_embeddings": 32768, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False, "router_aux_loss_coef": 0.001},
    "mixtral": {"max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
                "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, "bos_token_id": 1, "eos_token_id": 2},
    "olmoe": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "num_experts_per_tok": 8,
              "norm_topk_prob": False, "router_aux_loss_coef": 0.01, "bos_token_id": None, "eos_token_id": 50279,
              "pad_token_id": 1},
    "gpt_oss": {"head_dim": 64, "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "num_experts_per_tok": 4, "router_aux_loss_coef": 0.001, "attention_bias": True, "swiglu_alpha": 1.702,
                "swiglu_limit": 7.0, "rope_theta": 150000.0},
}

GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}



class Quantize(str, Enum):
    """How the frozen base is stored: NF4 (QLoRA) or plain weights in the compute dtype (LoRA).

    A `str` subclass whose value is the CLI / JSON spelling, so `Quantize("nf4")` parses a flag or a file and
    the value writes back unchanged."""

    NF4 = "nf4"
    NONE = "none"

    def __str__(self) -> str:
        return self.value


def require_checkpoint_dir(checkpoint_dir: str | Path, error: type[Exception] = MissingFile) -> None:
    if not Path(checkpoint_dir).is_dir():
        raise error(
            f"Checkpoint directory {checkpoint_dir} does not exist. Download one with `litqlora download REPO_ID` "
            "or convert a GGUF file with `litqlora convert_gguf FILE --out_dir DIR`."
        )


REQUIRED_HF_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
"""What every config.json must give (the rest has a family default, HF_DEFAULTS, or transformers' own)."""


@dataclass
class Config:
    """Shape and numerics of a Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 2 and 3, Phi-3
    and Phi-4, SmolLM2, TinyLlama)."""

    name: str = "custom"
    model_type: str = "llama"
    """Hugging Face `model_type` written back on export: llama, mistral, qwen2, qwen3, gemma2, gemma3_text or phi3
    (Phi-3 and Phi-4, whose checkpoints fuse q/k/v and gate/up: split on load, fused again on export)."""
    vocab_size: int = 32000
    n_layer: int = 2
    n_embd: int = 256
    n_head: int = 4
    n_query_groups: int = 4
    """Number of key/value heads (grouped-query attention); equal to n_head for multi-head attention."""
    head_dim: int | None = None
    """Defaults to n_embd // n_head."""
    intermediate_size: int = 688
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """HF rope scaling dict: {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}, {"rope_type": "linear", factor} or Phi-3's {"rope_type": "longrope",
    short_factor, long_factor, original_max_position_embeddings}. Gemma 3 scales its full-attention layers only."""
    max_seq_length: int = 4096
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: int | None = None
    """Mistral-style local attention: a token sees itself and the sliding_window - 1 tokens before it."""
    qk_norm: bool = False
    """Qwen3, Gemma 3: each head's query and key are RMS-normalized (weights `q_norm`, `k_norm` of size head_dim)
    before RoPE."""
    layer_types: list[str] | None = None
    """Per layer, "sliding_attention" (within sliding_window) or "full_attention" (Gemma 2 alternates them, Gemma 3
    has five sliding layers to a full one); None: every layer uses sliding_window."""
    rope_local_base: float | None = None
    """Gemma 3: the RoPE base of the sliding-window layers (unscaled); None: every layer uses rope_base."""
    partial_rotary_factor: float = 1.0
    """RoPE rotates the first head_dim * partial_rotary_factor dims of each head, the rest pass as they are
    (Phi-4-mini: 0.75)."""
    # Gemma 2 and 3.
    norm_plus_one: bool = False
    """RMSNorm scales by (1 + weight), in fp32: the checkpoint's norm weights are centered on 0."""
    embed_scale: bool = False
    """Embeddings are multiplied by sqrt(n_embd)."""
    sandwich_norms: bool = False
    """Norms after attention and after the MLP too (post_attention_layernorm, then pre_/post_feedforward_layernorm)."""
    mlp_activation: str = "silu"
    """The gate's activation: silu, or gelu_tanh (GeGLU)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by query_pre_attn_scalar ** -0.5 (default: head_dim ** -0.5)."""
    attn_softcap: float | None = None
    """Attention scores become softcap * tanh(scores / softcap)."""
    final_softcap: float | None = None
    """Logits become softcap * tanh(logits / softcap)."""
    qk_norm_width: str = "head"
    """With qk_norm: "head" normalizes each head over head_dim (Qwen3, Gemma 3); "all" normalizes the whole query and
    key projections before they split into heads (OLMoE: weights of n_head * head_dim and n_kv * head_dim)."""
    clip_qkv: float | None = None
    """OLMoE: queries, keys and values are clamped to [-clip_qkv, clip_qkv] after their projections."""
    # Mixtures of experts (qwen3_moe, mixtral, olmoe).
    n_experts: int = 0
    """Experts per MoE block; 0: a dense model."""
    n_experts_per_token: int = 0
    """Experts each token is routed to (the top k of the router's softmax)."""
    moe_intermediate_size: int | None = None
    """An expert's MLP width (Qwen3-MoE's moe_intermediate_size; Mixtral and OLMoE: intermediate_size)."""
    norm_topk_prob: bool = False
    """The top k routing weights are renormalized to sum to 1 (Mixtral always; Qwen3-MoE and OLMoE per config)."""
    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss added while the router trains (config.json's router_aux_loss_coef)."""
    dense_mlp_layers: list[int] | None = None
    """Layers of an MoE model with a dense MLP of intermediate_size instead of experts (Qwen3-MoE's mlp_only_layers
    and decoder_sparse_step); None: every layer has experts."""
    # gpt-oss.
    attn_sinks: bool = False
    """Each head has a learned sink logit that joins its softmax and takes a share of the probability, no value."""
    router_topk_softmax: bool = False
    """The router picks the top k of its logits and softmaxes those k (gpt-oss), not the top k of a softmax over all."""
    expert_bias: bool = False
    """The router and every expert projection have a bias."""
    swiglu_limit: float | None = None
    """gpt-oss's clamped SwiGLU: gate clamped to <= limit, up to [-limit, limit], out = (up + 1) * gate *
    sigmoid(alpha * gate)."""
    swiglu_alpha: float = 1.702
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    """Written back to config.json when the checkpoint names one (generation pads batches with it)."""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidInput(
                f"model_type {self.model_type!r} is not supported; lit-qlora covers {', '.join(SUPPORTED_MODEL_TYPES)}."
            )
        if self.head_dim is None:
            self.head_dim = self.n_embd // self.n_head
        if self.n_experts:
            if not 0 < self.n_experts_per_token <= self.n_experts:
                raise InvalidInput(f"num_experts_per_tok ({self.n_experts_per_token}) must be between 1 and the "
                                   f"number of experts ({self.n_experts}); check config.json.")
            if self.moe_intermediate_size is None:
                self.moe_intermediate_size = self.intermediate_size
        if self.n_head % self.n_query_groups:
            raise InvalidInput(f"n_head ({self.n_head}) must be a multiple of n_query_groups ({self.n_query_groups}).")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3", "linear", "longrope", "yarn"):
                raise InvalidInput(f"rope scaling type {kind!r} is not supported (default, linear, llama3, longrope, "
                                   "yarn are).")
            if kind == "default":
                self.rope_scaling = None
            if kind == "longrope":
                wanted = int(self.head_dim * self.partial_rotary_factor) // 2
                for key in ("short_factor", "long_factor"):
                    if len(self.rope_scaling.get(key) or []) != wanted:
                        raise InvalidInput(f"rope_scaling.{key} needs {wanted} values (one per rotated dim pair of "
                                           f"head_dim {self.head_dim} x partial_rotary_factor "
                                           f"{self.partial_rotary_factor}); check config.json.")

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` routes tokens to experts (else it has a dense MLP)."""
        return self.n_experts > 0 and index not in (self.dense_mlp_layers or ())

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    # -- Hugging Face config.json ------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], name: str = "custom") -> "Config":
        """Build from a Hugging Face `config.json` dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x
        `rope_parameters` layout)."""
        model_type = hf.get("model_type", "llama")
        if model_type == "gemma3":
            raise InvalidInput("This config.json is a multimodal Gemma 3 (model_type gemma3: text and vision); "
                               "lit-qlora fine-tunes the text-only Gemma 3 checkpoints (model_type gemma3_text, e.g. "
                               "google/gemma-3-1b-it).")
        moe = _moe_fields(model_type, {**HF_DEFAULTS.get(model_type, {}), **hf}, hf)
        hf = {**HF_DEFAULTS.get(model_type, {}), **hf}
        if model_type == "gpt_oss" and not (hf.get("rope_scaling") or hf.get("rope_parameters")):
            hf["rope_scaling"] = GPT_OSS_ROPE  # transformers' default for gpt_oss
        rope = dict(hf.get("rope_parameters") or {})
        local_rope = {}
        if "full_attention" in rope:  # transformers 5's Gemma 3 layout: one RoPE per layer type
            rope, local_rope = dict(rope["full_attention"] or {}), dict(rope.get("sliding_attention") or {})
        rope_base = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        partial_rotary = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if model_type == "phi3" and scaling:  # long-context RoPE; its pretraining length is a top-level field
            key = "rope_type" if "rope_type" in scaling else "type"
            scaling = {**scaling, key: "longrope" if scaling[key] in ("su", "yarn") else scaling[key]}
            scaling.setdefault("original_max_position_embeddings",
                               hf.get("original_max_position_embeddings", hf["max_position_embeddings"]))
        window = hf.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
            window = None
        gemma = model_type in GEMMA
        layer_types = hf.get("layer_types") if gemma or model_type == "gpt_oss" else None
        if model_type == "gpt_oss" and layer_types is None:  # transformers: sliding first, then full, alternating
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(hf["num_hidden_layers"])]
        if gemma and layer_types is None:  # transformers' defaults: Gemma 2 alternates, Gemma 3 every 6th is full
            every = 2 if model_type == "gemma2" else hf.get("sliding_window_pattern", 6)
            layer_types = sliding_pattern(hf["num_hidden_layers"], every)
        if model_type in ("qwen3", "qwen3_moe") and window is not None:
            raise InvalidInput("This Qwen3 config.json sets use_sliding_window: true (sliding attention in the "
                               "layers from max_window_layers on), which lit-qlora does not model; the released Qwen3 "
                               "checkpoints leave it false.")
        if hf.get("use_bidirectional_attention"):
            raise InvalidInput("This config.json sets use_bidirectional_attention: true (an embedding model, not a "
                               "causal LM); lit-qlora fine-tunes causal language models.")
        local_base = None
        if model_type == "gemma3_text":
            local_base = float(local_rope.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
        return cls(
            name=name,
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            n_layer=hf["num_hidden_layers"],
            n_embd=hf["hidden_size"],
            n_head=hf["num_attention_heads"],
            n_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            intermediate_size=hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_base=float(rope_base),
            rope_scaling=dict(scaling) if scaling else None,
            rope_local_base=local_base,
            partial_rotary_factor=float(partial_rotary),
            max_seq_length=hf.get("max_position_embeddings", 4096),
            # Qwen2 always has q/k/v biases; Llama's `attention_bias` covers q, k, v and o.
            qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            attn_sinks=model_type == "gpt_oss",
            router_topk_softmax=model_type == "gpt_oss",
            expert_bias=model_type == "gpt_oss",
            swiglu_limit=hf.get("swiglu_limit") if model_type == "gpt_oss" else None,
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            o_bias=model_type != "qwen2" and bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=window,
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe", "olmoe"),
            qk_norm_width="all" if model_type == "olmoe" else "head",
            clip_qkv=hf.get("clip_qkv") if model_type == "olmoe" else None,
            layer_types=list(layer_types) if layer_types else None,
            norm_plus_one=gemma,
            embed_scale=gemma,
            sandwich_norms=gemma,
            mlp_activation="gelu_tanh" if gemma else "silu",
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if gemma else None,
            # transformers' Gemma 3 reads attn_logit_softcapping but never applies it (the released ones set null)
            attn_softcap=hf.get("attn_logit_softcapping") if model_type == "gemma2" else None,
            final_softcap=hf.get("final_logit_softcapping") if gemma else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            **moe,
        )

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> "Config":
        path = Path(checkpoint_dir) / "config.json"
        require_checkpoint_dir(checkpoint_dir)
        if not path.is_file():
            raise MissingFile(
                f"{path} does not exist: a checkpoint directory needs a Hugging Face config.json. "
                "Use `litqlora download` or `litqlora convert_gguf` to create one."
            )
        try:
            hf = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidInput(f"{path} is not valid JSON ({e}); re-download the checkpoint or restore the "
                               "file.") from None
        if not isinstance(hf, dict):
            raise InvalidInput(f"{path} is not a Hugging Face model config (a JSON object); re-download the checkpoint "
                               "or restore the file.")
        missing = [key for key in REQUIRED_HF_FIELDS if key not in {**HF_DEFAULTS.get(hf.get("model_type"), {}), **hf}]
        if missing:
            raise InvalidInput(f"{path} lacks {', '.join(missing)}: a model's config.json gives its shape (vocabulary, "
                               "width, layers, heads, MLP width). The file is incomplete or not a model's: re-download "
                               "the checkpoint (`litqlora download REPO_ID`) or convert it again.")
        return cls.from_hf_config(hf, name=Path(checkpoint_dir).name)

    def to_hf_config(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """The `config.json` dict `transformers` reads (4.x key names, which 5.x also accepts)."""
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "phi3": "Phi3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                "olmoe": "OlmoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
        hf: dict[str, Any] = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.n_embd,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layer,
            "num_attention_heads": self.n_head,
            "num_key_value_heads": self.n_query_groups,
            "head_dim": self.head_dim,
            "hidden_act": "gelu_pytorch_tanh" if self.mlp_activation == "gelu_tanh" else "silu",
            "max_position_embeddings": self.max_seq_length,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_base,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": torch_dtype,
            "use_cache": True,
        }
        if self.pad_token_id is not None:
            hf["pad_token_id"] = self.pad_token_id
        if self.model_type in ("llama", "qwen3", "qwen3_moe", "olmoe"):
            hf["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if self.model_type in ("mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"):
            hf["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
            hf["use_sliding_window"] = self.sliding_window is not None
        if self.model_type in GEMMA:
            hf.update(hidden_activation=hf["hidden_act"], attention_bias=self.qkv_bias, sliding_window=self.sliding_window,
                      layer_types=self.layer_types, query_pre_attn_scalar=self.query_pre_attn_scalar,
                      attn_logit_softcapping=self.attn_softcap, final_logit_softcapping=self.final_softcap)
        if self.model_type == "gemma3_text":
            hf.update(rope_local_base_freq=self.rope_local_base, use_bidirectional_attention=False)
        if self.model_type == "phi3":
            if self.head_dim == self.n_embd // self.n_head:
                del hf["head_dim"]  # Phi-3's config.json has none (transformers reads it only when it differs)
            rope = dict(self.rope_scaling or {})
            original = rope.pop("original_max_position_embeddings", self.max_seq_length)  # top-level in Phi-3's
            hf.update(rope_scaling=rope or None, original_max_position_embeddings=original,
                      sliding_window=self.sliding_window, partial_rotary_factor=self.partial_rotary_factor)
        if self.model_type in ("qwen3", "qwen3_moe"):  # inert with sliding off; as the released checkpoints have it
            hf["max_window_layers"] = self.n_layer
        if self.n_experts:
            hf.update(num_experts_per_tok=self.n_experts_per_token, router_aux_loss_coef=self.router_aux_loss_coef)
            hf["num_local_experts" if self.model_type == "mixtral" else "num_experts"] = self.n_experts
            if self.model_type != "mixtral":
                hf["norm_topk_prob"] = self.norm_topk_prob
        if self.model_type == "qwen3_moe":
            hf.update(moe_intermediate_size=self.moe_intermediate_size, decoder_sparse_step=1,
                      mlp_only_layers=list(self.dense_mlp_layers or []))
        if self.model_type == "olmoe":
            hf["clip_qkv"] = self.clip_qkv
        if self.model_type == "gpt_oss":
            del hf["norm_topk_prob"]
            hf.update(attention_bias=self.qkv_bias, sliding_window=self.sliding_window, layer_types=self.layer_types,
                      swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)
        return hf

    def replace(self, **changes: Any) -> "Config":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_DEFAULT_EXPERTS = {"qwen3_moe": 128, "mixtral": 8, "olmoe": 64, "gpt_oss": 128}  # transformers', when config.json names none


def _moe_fields(model_type: str, hf: dict[str, Any], written: dict[str, Any]) -> dict[str, Any]:
    """The Config fields of a mixture of experts, read from config.json (`written`; `hf` with the family's defaults)
    as transformers reads them. The Hub's Qwen3-MoE and OLMoE files say num_experts, Mixtral's and transformers 5's
    num_local_experts."""
    if model_type not in MOE:
        return {}
    n_experts = written.get("num_experts") or written.get("num_local_experts") or _DEFAULT_EXPERTS[model_type]
    dense = None
    if model_type == "qwen3_moe":  # transformers: experts where not in mlp_only_layers and (i + 1) % step == 0
        step = hf.get("decoder_sparse_step", 1) or 1
        only = set(hf.get("mlp_only_layers") or [])
        dense = [i for i in range(hf["num_hidden_layers"]) if i in only or (i + 1) % step] or None
    return dict(
        n_experts=int(n_experts),
        n_experts_per_token=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=hf.get("moe_intermediate_size") if model_type == "qwen3_moe" else None,
        norm_topk_prob=model_type == "mixtral" or (model_type != "gpt_oss" and bool(hf.get("norm_topk_prob", False))),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
        dense_mlp_layers=dense,
    )


def sliding_pattern(n_layer: int, every: int) -> list[str]:
    """Gemma's layer pattern: every `every`-th layer attends fully, the others within the sliding window (Gemma 2:
    every 2nd, Gemma 3: every 6th)."""
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layer)]
