"""A decode step in C: one token of one sequence through every block of a Llama-style NF4 model (decode_step.c),
where `generate` would otherwise dispatch ~15 PyTorch operations a block around its seven NF4 products (on SmolLM2
two thirds of a token's time was that dispatch, not arithmetic). `generate` and `chat` decode through it.

It applies (`applies`) to the models most users decode, the Llama family without extras: every block's seven
projections NF4, `FrozenNF4Linear` or a `LoRALinear` over one (a fine-tune's adapter, unmerged; its term computed
beside the kernel), biases allowed (Qwen2), RMSNorm before attention and MLP, SiLU, full RoPE (no longrope), sliding
windows allowed; not q/k norms, soft caps, sinks, sandwich norms, experts, dense projections or a caller's forward
hooks. Elsewhere, or with ``LIT_QLORA_NF4_GEMV=0`` (the decode kernels off), or where the library is unavailable,
`generate` decodes through the model as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Optional

import torch
import torch.nn as nn

from lit_qlora.base import switches
from lit_qlora.base.threads import process_governor
from lit_qlora.lora.layer import LoRALinear
from lit_qlora.nf4 import gemv  # (lit_qlora.nf4 quiets torchao's import warnings before torchao loads)
from lit_qlora.nf4.linear import FrozenNF4Linear
from lit_qlora.nf4.native import STORAGE_FORMATS, build_library, package_text, simd_header
from lit_qlora.nf4.reference import cached, level_table

log = logging.getLogger(__name__)

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
MAX_HEAD_DIM = 512  # decode_step.c's per-head accumulator


class _Proj(ctypes.Structure):
    _fields_ = [("q", _P), ("qs", _P), ("factor", _P), ("mean", _P), ("levels", _P), ("bias", _P), ("n", _I64),
                ("k", _I64), ("bs", _I64), ("sbs", _I64), ("wfmt", _I32), ("lora_a", _P), ("lora_bt", _P), ("r", _I64),
                ("lora_scale", _F)]


class _Block(ctypes.Structure):
    _fields_ = [("p", _Proj * 7), ("norm1", _P), ("norm2", _P), ("kc", _P), ("vc", _P), ("cos", _P), ("sin", _P),
                ("sliding", _I64)]


class _Shape(ctypes.Structure):
    _fields_ = [("d", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("inter", _I64),
                ("max_len", _I64), ("max_r", _I64), ("window", _I64), ("eps", _F), ("scale", _F), ("xfmt", _I32),
                ("threads", _I32)]


_lock = threading.Lock()
_state: dict = {}


def _library() -> Optional[ctypes.CDLL]:
    """decode_step.c built (with gemv.c, as the default gemv build) and checked, or None (logged once)."""
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" not in _state:
            lib = None
            try:
                sources = {"decode_step.c": package_text(__package__, "decode_step.c"),
                           "gemv.c": package_text("lit_qlora.nf4", "gemv.c"), "simd.h": simd_header()}
                lib = build_library("decode_step", sources, {})
                lib.decode_step.argtypes = [ctypes.POINTER(_Shape), ctypes.POINTER(_Block), _I64, _I64, _P, _P, _P,
                                            _P, _I64]
                lib.decode_step.restype = None
                lib.decode_step_work_bytes.argtypes = [ctypes.POINTER(_Shape), _I64]
                lib.decode_step_work_bytes.restype = _I64
                _state["lib"] = lib  # the self-test below decodes through it
                _self_test()
            except Exception as e:  # no compiler, or a wrong result: decode through the model
                log.warning("lit_qlora: the C decode step is unavailable (%s); generate decodes through the model", e)
                _state["error"] = f"{type(e).__name__}: {e}"
                lib = None
            _state["lib"] = lib
    return _state["lib"]


def library_error() -> Optional[str]:
    """Why the C decode step is unavailable (after a first use found it so), else None."""
    return _state.get("error")


def projections(block: nn.Module) -> list[nn.Module]:
    """A block's seven projections in decode_step.c's order: q, k, v, o, gate, up, down (None where its MLP has
    none of that name: a mixture of experts)."""
    a, m = block.self_attn, block.mlp
    return [a.q_proj, a.k_proj, a.v_proj, a.o_proj, getattr(m, "gate_proj", None), getattr(m, "up_proj", None),
            getattr(m, "down_proj", None)]


def applies(model: nn.Module, dtype: torch.dtype, caches: Optional[list] = None) -> bool:
    """Whether `DecodeStep` decodes `model` (module doc): the family, every projection an NF4 linear without hooks,
    a float32 or bf16 model on CPU, the decode kernels on and the library built; its caches (`caches`, else the
    blocks' KVCaches) contiguous in `dtype`."""
    from lit_qlora.model.transformer import KVCache, MLP, Block  # transformer.py imports this module

    c = model.config
    if dtype not in (torch.float32, torch.bfloat16) or not switches.enabled("LIT_QLORA_NF4_GEMV"):
        return False
    if torch.is_autocast_enabled("cpu") or torch.is_grad_enabled():  # autocast computes in another dtype
        return False
    if (c.qk_norm or c.clip_qkv is not None or c.attn_softcap is not None or c.attn_sinks or c.sandwich_norms
            or c.norm_plus_one or c.mlp_activation != "silu" or c.partial_rotary_factor != 1.0
            or c.head_dim > MAX_HEAD_DIM or c.n_head % c.n_query_groups or c.query_pre_attn_scalar is not None):
        return False
    if (c.rope_scaling or {}).get("rope_type", (c.rope_scaling or {}).get("type")) == "longrope":
        return False
    for block in model.model.layers:
        if type(block) is not Block or type(block.mlp) is not MLP or block._forward_pre_hooks:
            return False
        if not all(getattr(hook, "governs_threads", False) or getattr(hook, "training_only", False)
                   for hook in block._forward_hooks.values()):
            return False  # a hook of the caller's would be skipped; the thread governor's runs after each step
        for p in projections(block):
            if type(p) not in (FrozenNF4Linear, LoRALinear) or p._forward_hooks or p._forward_pre_hooks:
                return False
            if type(p) is LoRALinear and p.training and isinstance(p.lora_dropout, nn.Dropout):
                return False  # dropout draws: training's forward
            if type(p.weight).__name__ != "NF4Tensor" or not p.weight.quantized_data.is_cpu:  # (not a DTensor shard)
                return False
            if p.bias is not None and p.bias.dtype != dtype:
                return False
            if not gemv.gemv_available(p.weight.nf4.dtype):  # the kernel takes this storage dtype (fp16: gcc >= 12)
                return False
        for norm in (block.input_layernorm, block.post_attention_layernorm):
            if norm.weight.dtype != dtype:
                return False
    if caches is None:
        if not all(type(b.self_attn.kv_cache) is KVCache for b in model.model.layers):
            return False
        caches = _kv_caches(model)
    if not all(t.dtype == dtype and t.is_contiguous() and t.is_cpu for kv in caches for t in kv):
        return False
    return _library() is not None


def _kv_caches(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b.self_attn.kv_cache.k, b.self_attn.kv_cache.v) for b in model.model.layers]


class DecodeStep:
    """The blocks of `model` as decode_step.c reads them, for one generation: built after `set_kv_cache` (the caches'
    addresses, one row per sequence), used while they stay (a LoRA adapter's factors are copied: build it again after
    they change). `__call__(tokens, positions)` -> the logits of each cache row's token at its position.

    `caches`: each block's (k, v), (rows, n_kv, length, head_dim), where they are not the blocks' KVCaches (a
    continuous batch's whole cache, `lit_qlora.model.batch_decode`); a step may then run its first rows only."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, caches: Optional[list] = None) -> None:
        c = model.config
        self.model, self.dtype, self.lib = model, dtype, _library()
        caches = caches if caches is not None else _kv_caches(model)
        self.rows, _, self.max_len, _ = caches[0][0].shape
        self.keep: list = []  # tensors whose addresses the structs hold
        positions = torch.arange(self.max_len)
        kinds = {block.sliding for block in model.model.layers}
        self.ropes = {s: tuple(t.contiguous() for t in model.rope(positions, dtype, s)) for s in kinds}
        self.keep.append(self.ropes)
        xfmt = gemv.X_FORMATS[dtype]
        self.esize = 2 if dtype == torch.bfloat16 else 4
        ranks = [p.r for block in model.model.layers for p in projections(block) if type(p) is LoRALinear]
        self.shape = _Shape(c.n_embd, c.n_head, c.n_query_groups, c.head_dim, c.intermediate_size, self.max_len,
                            max(ranks, default=0), c.sliding_window or 0, c.norm_eps, c.head_dim**-0.5, xfmt, 1)
        self.blocks = (_Block * len(model.model.layers))()
        for i, block in enumerate(model.model.layers):
            b = self.blocks[i]
            for j, p in enumerate(projections(block)):
                b.p[j] = self._proj(p)
            b.norm1 = block.input_layernorm.weight.data_ptr()
            b.norm2 = block.post_attention_layernorm.weight.data_ptr()
            b.kc, b.vc = caches[i][0].data_ptr(), caches[i][1].data_ptr()
            cos, sin = self.ropes[block.sliding]
            b.cos, b.sin, b.sliding = cos.data_ptr(), sin.data_ptr(), int(block.sliding)
        self.governed = any(getattr(hook, "governs_threads", False) for block in model.model.layers
                            for hook in block._forward_hooks.values())
        k_max = max(c.n_embd, c.intermediate_size, c.n_head * c.head_dim)
        self.cap = max(128, k_max // 32 + 3)
        threads = max(torch.get_num_threads(), os.cpu_count() or 1)
        # the kernel's (x reordered, each thread's tables), then a LoRA term's (x, x @ A^T, its product with B^T)
        self.scratch = torch.empty(max(self.rows * k_max + threads * self.cap * 16, 2 * k_max + self.shape.max_r),
                                   dtype=torch.float32)
        self.work = torch.empty(self.lib.decode_step_work_bytes(ctypes.byref(self.shape), self.rows),
                                dtype=torch.uint8)
        self.x = torch.empty(self.rows, c.n_embd, dtype=dtype)

    def _proj(self, p: nn.Module) -> _Proj:
        w = p.weight
        levels = cached(("gemv_levels", w.nf4.dtype), lambda: level_table(w.nf4.dtype).float())
        bias = None if p.bias is None else p.bias.contiguous()
        self.keep += [levels, bias]
        n, k = gemv.weight_shape(w)
        proj = _Proj(w.quantized_data.data_ptr(), w.quantized_scalers.data_ptr(), w.quantization_factor.data_ptr(),
                     w.scaler_mean.data_ptr(), levels.data_ptr(), None if bias is None else bias.data_ptr(), n, k,
                     w.block_size, w.scaler_block_size, STORAGE_FORMATS[w.nf4.dtype])
        if type(p) is LoRALinear and p.scale != 0:  # scale 0: adapters_disabled, the base alone
            # as LoRALinear's forward casts them to x's dtype, then exact in float32
            a = p.lora_A.detach().to(self.dtype).float().contiguous()
            bt = p.lora_B.detach().to(self.dtype).float().t().contiguous()
            self.keep += [a, bt]
            proj.lora_a, proj.lora_bt, proj.r, proj.lora_scale = a.data_ptr(), bt.data_ptr(), p.r, p.scale
        return proj

    def hidden(self, tokens, positions) -> torch.Tensor:
        """The final-norm hidden states (rows, 1, n_embd) of the first cache rows' tokens (`tokens`: one per row, a
        tensor or a list) at their positions (`positions`: one per row, or one for all), their keys and values
        cached."""
        tokens = torch.as_tensor(tokens).reshape(-1)
        rows = tokens.numel()
        pos = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).expand(rows).contiguous()
        if not 0 < rows <= self.rows:
            raise ValueError(f"{rows} tokens for a KV cache of {self.rows} rows")
        if not bool(((pos >= 0) & (pos < self.max_len)).all()):
            raise ValueError(f"positions {pos.tolist()} outside the KV cache of {self.max_len}")
        m = self.model
        x = self.x[:rows]
        torch.index_select(m.model.embed_tokens.weight, 0, tokens, out=x)
        if m.config.embed_scale:
            x.mul_(torch.tensor(m.config.n_embd**0.5, dtype=self.dtype))
        self.shape.threads = torch.get_num_threads()
        self.lib.decode_step(ctypes.byref(self.shape), self.blocks, len(self.blocks), rows, pos.data_ptr(),
                             x.data_ptr(), self.work.data_ptr(), self.scratch.data_ptr(), self.cap)
        if self.governed:
            process_governor()()  # what each block's forward hook (base.threads.govern_threads) would have run
        return m.model.norm(x.view(rows, 1, -1))

    def __call__(self, tokens, positions) -> torch.Tensor:
        """The (rows, vocab) logits (`hidden`'s arguments); (vocab,) for one row given as an int."""
        logits = self.model.logits(self.hidden(tokens, positions))[:, -1]
        return logits[0] if isinstance(tokens, int) else logits


def _self_test() -> None:
    """A decode step of a small random NF4 model against the model's own forward, float32 and bf16."""
    from lit_qlora.model.config import Config
    from lit_qlora.model.transformer import Transformer
    from lit_qlora.nf4 import quantize_linears

    config = Config(vocab_size=96, n_layer=2, n_embd=128, n_head=4, n_query_groups=2, intermediate_size=192,
                    max_seq_length=32, qkv_bias=True)
    rng = torch.random.get_rng_state()
    # Out of inference mode (generate's first call lands here): quantizing makes parameters, not inference tensors.
    with torch.inference_mode(False), torch.no_grad():
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
            try:
                torch.manual_seed(0)
                model = Transformer(config)
                model.init_weights(std=0.1)
                for block in model.model.layers:
                    nn.init.normal_(block.self_attn.q_proj.bias, std=0.1)
            finally:
                torch.random.set_rng_state(rng)
            model = model.to(dtype).eval()
            quantize_linears(model)
            prompt = torch.tensor([[3, 50, 7, 91, 12]])
            model.set_kv_cache(1, 16)
            try:
                model(prompt, input_pos=torch.arange(5))
                got = DecodeStep(model, dtype)(40, 5)
                model.set_kv_cache(1, 16)
                expected = model(torch.cat([prompt, torch.tensor([[40]])], 1), input_pos=torch.arange(6))[0, -1]
            finally:
                model.clear_kv_cache()
            if not torch.allclose(got.float(), expected.float(), rtol=tol, atol=tol * expected.abs().max().item()):
                raise RuntimeError(f"decode step self-test mismatch in {dtype}: "
                                   f"{(got.float() - expected.float()).abs().max().item():.3g}")
