"""The Llama-family decoder, in one file (Llama, Mistral, Qwen2/3, Gemma 2/3 and Phi-3 differ in small, named
branches driven by Config).

Module names follow Hugging Face's (`model.layers.3.self_attn.q_proj`, `lm_head`) so checkpoints map 1:1 and
PEFT adapters need no renaming. Every projection is its own `nn.Linear`: LoRA and NF4 see each one separately
(Phi-3's fused checkpoint tensors are split on load and fused again on export: `hf_layout.py`); q/k/v and gate/up
still run as one base matmul each where they can (`fused_projections.py`).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lit_qlora.model.attention import attend, softcap, use_flex_attention
from lit_qlora.model.attention_mask import as_dense, attention_mask, document_lengths
from lit_qlora.model.flex import FlexShape, flex_runs
from lit_qlora.model.config import Config
from lit_qlora.model.fused_projections import fused_projections, share_storage
from lit_qlora.model.moe import SparseMoE
from lit_qlora.nf4 import gemv
from lit_qlora.nf4.grouped import ExpertLinear
from lit_qlora.model.offload import block_input_saved
from lit_qlora.base.recompute import reusing_first_run
from lit_qlora.model.rope import rope_attention_factor, rope_inv_freq
from lit_qlora.model.tiled_mlp import mlp_tile_tokens, tiled_mlp


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, plus_one: bool = False) -> None:
        super().__init__()
        self.plus_one = plus_one  # Gemma: scales by (1 + weight), the weight centered on 0
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad and not self.weight.requires_grad:
            return _LeanRMSNorm.apply(x, self.weight, self.eps, self.plus_one)
        return rms_norm(x, self.weight, self.eps, self.plus_one)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.plus_one else nn.init.ones_(self.weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool) -> torch.Tensor:
    return _rms_scale(_rms_normalize(x, eps)[0], weight, plus_one, x.dtype)


def _rms_normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / rms(x), 1 / rms(x)) in fp32: bf16 variance underflows."""
    x = x.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * rstd, rstd


def _rms_scale(normed: torch.Tensor, weight: torch.Tensor, plus_one: bool, dtype: torch.dtype) -> torch.Tensor:
    # Llama scales in the input dtype, Gemma in fp32: each as transformers does, so bf16 results match too.
    if plus_one:
        return (normed * (1.0 + weight.float())).to(dtype)
    return weight * normed.to(dtype)


class _LeanRMSNorm(torch.autograd.Function):
    """RMSNorm with a frozen weight that saves its input and one fp32 scale per row, where autograd would keep
    the fp32 copy of the input (Llama-3-8B at 2x2048: 64 MiB per norm, two per block). Outputs are
    `rms_norm`'s exactly; backward recomputes the fp32 input."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, plus_one: bool):
        normed, rstd = _rms_normalize(x, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.plus_one = plus_one
        return _rms_scale(normed, weight, plus_one, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        # The gradient reaching the fp32 normalized input: through the scale and (Llama) the cast to x's dtype.
        g = grad.float() * (1.0 + weight.float()) if ctx.plus_one else (grad * weight).float()
        normed = x * rstd  # fp32 (rstd is); not x.float().mul_(): in fp32 that is x itself, the saved input
        dot = (g * normed).mean(-1, keepdim=True)
        return g.sub_(normed.mul_(dot)).mul_(rstd).to(x.dtype), None, None, None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = cos.size(-1)
    if d < x.size(-1):  # partial rotary (Phi-4-mini): the dims past d pass unrotated
        return torch.cat((apply_rope(x[..., :d], cos, sin), x[..., d:]), dim=-1)
    return x * cos + rotate_half(x) * sin


def attention_scale(config: Config) -> float:
    """Queries are scaled by this before the softmax: 1/sqrt(head_dim), or Gemma's query_pre_attn_scalar."""
    return (config.query_pre_attn_scalar or config.head_dim) ** -0.5


class KVCache(nn.Module):
    def __init__(self, batch_size: int, n_kv: int, max_len: int, head_dim: int, device=None, dtype=None) -> None:
        super().__init__()
        shape = (batch_size, n_kv, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.k[: k.size(0)].index_copy_(2, input_pos, k.to(self.k.dtype))
        self.v[: v.size(0)].index_copy_(2, input_pos, v.to(self.v.dtype))
        return self.k[: k.size(0)], self.v[: v.size(0)]


class CacheView(nn.Module):
    """A block's keys and values inside a larger cache that a caller manages (`lit_qlora.model.batch_decode`): each
    forward reads and writes the views `select` chose, one row of it (a request's prefill, `input_pos` (T,)) or its
    first rows, each at its own positions (a continuous batch's decode step, `input_pos` (rows, T)). A module only so
    it can sit where the block's KVCache does; its tensors are not state."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__()
        self.whole_k, self.whole_v = k, v
        self.k, self.v = k, v

    def select(self, rows: slice, length: int) -> None:
        self.k, self.v = self.whole_k[rows, :, :length], self.whole_v[rows, :, :length]

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if input_pos.dim() == 1:
            self.k.index_copy_(2, input_pos, k.to(self.k.dtype))
            self.v.index_copy_(2, input_pos, v.to(self.v.dtype))
        else:
            rows = torch.arange(input_pos.size(0), device=input_pos.device)[:, None]
            self.k[rows, :, input_pos] = k.transpose(1, 2).to(self.k.dtype)  # (rows, T, n_kv, d) at each row's T
            self.v[rows, :, input_pos] = v.transpose(1, 2).to(self.v.dtype)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        hd, nh, nkv = config.head_dim, config.n_head, config.n_query_groups
        self.q_proj = nn.Linear(config.n_embd, nh * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.n_embd, nkv * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.n_embd, nkv * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(nh * hd, config.n_embd, bias=config.o_bias)
        if config.qk_norm:
            whole = config.qk_norm_width == "all"  # OLMoE: over the whole projection, before the heads split
            self.q_norm = RMSNorm(nh * hd if whole else hd, config.norm_eps, config.norm_plus_one)
            self.k_norm = RMSNorm(nkv * hd if whole else hd, config.norm_eps, config.norm_plus_one)
        if config.attn_sinks:
            self.sinks = nn.Parameter(torch.zeros(nh))
        self.scale = attention_scale(config)
        self.kv_cache: Optional[KVCache | CacheView] = None

    def forward(self, x, cos, sin, mask: Optional[torch.Tensor], input_pos: Optional[torch.Tensor]) -> torch.Tensor:
        B, T, _ = x.shape
        c, hd = self.config, self.config.head_dim
        q, k, v = fused_projections(x, (self.q_proj, self.k_proj, self.v_proj))
        if c.qk_norm and c.qk_norm_width == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q, k, v = (t.view(B, T, -1, hd) for t in (q, k, v))
        if c.qk_norm and c.qk_norm_width == "head":  # Qwen3, Gemma 3: per head, over head_dim, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_cache is not None:
            if input_pos is None:
                raise ValueError("input_pos is required when the KV cache is in use.")
            k, v = self.kv_cache.update(input_pos, k, v)
            k, v = k.to(q.dtype), v.to(q.dtype)
        y = attend(q, k, v, mask, self.scale, self.config.attn_softcap,  # SDPA, flex_attention or capped (dense)
                   self.config.n_head != self.config.n_query_groups, getattr(self, "sinks", None))
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.mlp_bias)

        self.act = partial(F.gelu, approximate="tanh") if config.mlp_activation == "gelu_tanh" else F.silu
        self.tile_tokens = mlp_tile_tokens(config.intermediate_size)
        """Training sequences longer than this run the MLP tile by tile (lit_qlora.model.tiled_mlp)."""
        self.output_read = config.sandwich_norms
        """Whether the block saves this MLP's output for backward (Gemma's post-MLP norm; a residual add does not)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_mlp(self.forward_untiled, x, self, self.tile_tokens, self.output_read)

    def forward_untiled(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused_projections(x, (self.gate_proj, self.up_proj))
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return self.down_proj(_LeanGatedActivation.apply(gate, up, self.act))
        return self.down_proj(self.act(gate) * up)


class _LeanGatedActivation(torch.autograd.Function):
    """act(gate) * up that saves only gate and up: autograd would also keep act(gate), one more tensor of the MLP's
    width per block (Llama-3-8B at 2x2048: 112 MiB). Backward recomputes it and uses the same kernels as autograd,
    so the gradients are bitwise the same."""

    @staticmethod
    def forward(ctx, gate, up, act):
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return act(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:  # first: its temporary is gone before act(gate) is recomputed
            if ctx.act is F.silu:
                grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
            else:
                grad_gate = torch.ops.aten.gelu_backward(grad * up, gate, approximate="tanh")
        if ctx.needs_input_grad[1]:
            grad_up = ctx.act(gate).mul_(grad)
        return grad_gate, grad_up, None


class Block(nn.Module):
    def __init__(self, config: Config, sliding: bool = False, moe: bool = False) -> None:
        super().__init__()
        self.sliding = sliding
        """Attends within config.sliding_window (Gemma 2 alternates sliding and full layers)."""
        norm = partial(RMSNorm, config.n_embd, config.norm_eps, config.norm_plus_one)
        self.input_layernorm = norm()
        self.self_attn = Attention(config)
        # Llama's post_attention_layernorm is the MLP's input norm; with sandwich norms (Gemma 2) it normalizes the
        # attention output, and the MLP has its own norms before and after.
        self.post_attention_layernorm = norm()
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = SparseMoE(config) if moe else MLP(config)
        self.sandwich = config.sandwich_norms

    def forward(self, x, cos, sin, mask=None, input_pos=None) -> torch.Tensor:
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask, input_pos))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, input_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Decoder-only LM. `forward(idx)` -> logits; `forward(idx, input_pos=...)` after `set_kv_cache` decodes;
    `forward(idx, positions=...)` runs packed rows, each document on its own."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        kinds = config.layer_types or ["sliding_attention"] * config.n_layer
        self.model.layers = nn.ModuleList(Block(config, kind == "sliding_attention", config.is_moe_layer(i))
                                          for i, kind in enumerate(kinds))
        self.model.norm = RMSNorm(config.n_embd, config.norm_eps, config.norm_plus_one)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_cache_len = 0
        self.checkpoint_blocks = 0
        """The first N blocks recompute their activations in backward instead of storing them."""
        self.activation_offload = None
        """An ActivationOffload (lit_qlora.model.offload): the checkpointed blocks' inputs wait in host memory."""

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, sliding: bool = False):
        """cos and sin at `positions` for a block of this kind (Gemma 3's sliding blocks have their own base): (T, d)
        for a row's positions, (B, 1, T, d) for packed per-token positions (B, T)."""
        inv_freq = rope_inv_freq(self.config, positions.device, sliding)
        scaling = self.config.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "longrope":
            # Phi-3 switches to its long factors once the sequence passes the pretraining length, as transformers
            # does (decided per call: a KV cache filled before the switch keeps its short-factor keys; a packed
            # document by its own length, as if alone).
            length = positions.max() + 1 if positions.dim() == 1 else document_lengths(positions)[..., None]
            long = length > scaling["original_max_position_embeddings"]
            inv_freq = torch.where(long, rope_inv_freq(self.config, positions.device, long=True), inv_freq)
        freqs = positions.float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        if positions.dim() == 2:  # per row: broadcast over the heads
            emb = emb[:, None]
        factor = rope_attention_factor(self.config)
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)

    def forward_hidden(self, idx: torch.Tensor, input_pos: Optional[torch.Tensor] = None,
                       positions: Optional[torch.Tensor] = None,
                       masks: Optional[dict[bool, torch.Tensor]] = None) -> torch.Tensor:
        """Final-norm hidden states (B, T, n_embd): what the head (or a chunked loss) consumes. `positions` (B, T):
        packed rows' per-token positions, restarting at 0 at each document, which then attends only within itself
        (lit_qlora.model.attention_mask). `masks` (decoding into the KV cache's slots `input_pos` (T,), with
        `positions`): each block kind's dense attention mask ({sliding: (B, 1, T, cache length) bool}, keyed as
        `block.sliding`), used instead of the causal one, and `positions` then the tokens' RoPE positions: branches
        that share the cache's context, scored in one row (eval/lm.py)."""
        T = idx.size(1)
        if input_pos is None and self.max_cache_len:
            raise ValueError("input_pos is required after set_kv_cache().")
        if positions is not None and input_pos is not None and masks is None:
            raise ValueError("Packed positions are for full-sequence forwards, not KV-cache decoding (input_pos).")
        if masks is not None and (input_pos is None or positions is None):
            raise ValueError("Explicit masks are for decoding into the KV cache (input_pos), with RoPE positions.")
        row_pos = input_pos if input_pos is not None else torch.arange(T, device=idx.device)
        x = self.model.embed_tokens(idx)
        if self.config.embed_scale:  # Gemma: sqrt(n_embd), rounded to the activations' dtype as transformers does
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        kv_len = self.max_cache_len if self.max_cache_len else T
        kinds = {block.sliding for block in self.model.layers}
        # BlockMasks for flex_attention (CUDA) where a mask or soft cap is needed; gpt-oss's sinks take dense masks
        flex = use_flex_attention(idx.device) and not self.config.attn_sinks
        if masks is None:
            masks = {sliding: attention_mask(row_pos, kv_len, self.config.sliding_window if sliding else None,
                                             self.max_cache_len > 0, positions, flex,
                                             self.config.attn_softcap is not None)
                     for sliding in kinds}
            if flex:
                masks = {sliding: self.flex_or_dense(mask, idx.size(0), x.dtype) for sliding, mask in masks.items()}
        ropes = {sliding: self.rope(row_pos if positions is None else positions, x.dtype, sliding) for sliding in kinds}
        for i, block in enumerate(self.model.layers):
            mask, (cos, sin) = masks[block.sliding], ropes[block.sliding]
            if i < self.checkpoint_blocks and torch.is_grad_enabled():
                with block_input_saved(self.activation_offload, x):
                    x = checkpoint(reusing_first_run(block), x, cos, sin, mask, input_pos, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask, input_pos)
        return self.model.norm(x)

    def share_projection_storage(self, trainable: bool = False) -> None:
        """Each block's q/k/v and gate/up base weights as row slices of one tensor, which their fused matmul reads
        in place (fused_projections.share_storage: dense weights; trainable ones too with `trainable`, before any
        optimizer holds them). A move to another device copies each weight on its own: call it again there."""
        for block in self.model.layers:
            attn, mlp = block.self_attn, block.mlp
            share_storage((attn.q_proj, attn.k_proj, attn.v_proj), trainable)
            if isinstance(mlp, MLP):
                share_storage((mlp.gate_proj, mlp.up_proj), trainable)

    def flex_or_dense(self, mask, rows: int, dtype: torch.dtype):
        """A BlockMask where flex_attention runs this forward's shape, else its dense mask (flex.flex_runs)."""
        if mask is None or isinstance(mask, torch.Tensor):
            return mask
        c = self.config
        q_len = mask.seq_lengths[0]
        if torch.is_autocast_enabled(mask.kv_num_blocks.device.type):  # 16-mixed: q, k and v come out of autocast
            dtype = torch.get_autocast_dtype(mask.kv_num_blocks.device.type)
        kind = mask.mask_mod.__qualname__.split(".")[0]  # document_mask_mod, causal_mask_mod
        shape = FlexShape(mask.kv_num_blocks.device.type, dtype, rows, q_len, c.n_head, c.n_query_groups, c.head_dim,
                          attention_scale(c), c.attn_softcap, torch.is_grad_enabled(), kind)
        return mask if flex_runs(mask, shape) else as_dense(mask)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head over final hidden states (soft-capped for Gemma 2): what forward returns and the loss reads. A
        bf16 decode step's plain head (a tied embedding stays bf16 under NF4) takes the dense decode kernel."""
        head = self.lm_head
        if type(head) is nn.Linear and head.bias is None and not head._forward_pre_hooks and not head._forward_hooks \
                and gemv.dense_applies(hidden, head.weight):
            return softcap(gemv.dense_matmul_rows(hidden, head.weight), self.config.final_softcap)
        return softcap(head(hidden), self.config.final_softcap)

    def forward(self, idx: torch.Tensor, input_pos: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.logits(self.forward_hidden(idx, input_pos, positions))

    def set_kv_cache(self, batch_size: int, max_len: Optional[int] = None, device=None, dtype=None) -> None:
        max_len = max_len or self.config.max_seq_length
        ref = self.model.embed_tokens.weight
        device = device or ref.device
        dtype = dtype or (ref.dtype if ref.dtype.is_floating_point else torch.bfloat16)
        c = self.config
        for block in self.model.layers:
            block.self_attn.kv_cache = KVCache(batch_size, c.n_query_groups, max_len, c.head_dim, device, dtype)
        self.max_cache_len = max_len

    def clear_kv_cache(self) -> None:
        for block in self.model.layers:
            block.self_attn.kv_cache = None
        self.max_cache_len = 0

    def init_weights(self, std: float = 0.02) -> None:
        """Random initialization for tests and benchmarks (real runs load a checkpoint)."""
        for module in self.modules():
            if isinstance(module, ExpertLinear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
