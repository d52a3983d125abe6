"""Which attention kernel runs: plain causal SDPA where it is exact, flex_attention on CUDA for every other mask
(sliding windows, packed documents) and for Gemma 2's soft-capped scores, the dense paths elsewhere.

| case (full-sequence forward)                                   | CUDA                    | CPU (default)          |
|----------------------------------------------------------------|-------------------------|------------------------|
| causal, no window shorter than the row, unpacked, no soft cap  | SDPA `is_causal` (O(L)) | SDPA `is_causal`       |
| sliding window shorter than the row, packed documents          | flex_attention (O(L))   | SDPA + dense bool mask |
| Gemma 2's attention soft cap (any mask)                        | flex_attention (O(L))   | `capped_attention`     |
| gpt-oss's attention sinks (any mask)                           | SDPA over a sink key    | SDPA over a sink key   |
| KV-cache decoding (generation)                                 | dense, as on CPU        | dense; one query a row: |
|                                                                |                         | `decode_attention`     |

The mask is built once per forward by `lit_qlora.model.attention_mask.attention_mask`, from one rule (`mask_mod`): a
`BlockMask` for flex_attention where `use_flex_attention` says so, else a dense boolean mask or None (plain causal);
`attend` dispatches on what it receives. A BlockMask goes to `lit_qlora.model.flex.flex_attend`: flex_attention
compiled (O(L) only so), its compiled function kept, the recompile limit, and the per-shape fallback to the dense mask
where inductor cannot lower a shape (`flex_runs`, which the transformer asks of each BlockMask it built); that
module's doc says how.

Training on CPU in bf16 (or fp16), rows of at most `UPCAST_MAX_TOKENS` tokens attend through SDPA's CPU flash kernel
in float32 (`_Float32Attention`): in torch 2.13 that kernel's bf16 backward costs 5.6 ms for 2 rows x 100 tokens of
SmolLM2's 9 heads, against 2.2 ms for its float32 forward and backward together, and more accurate gradients (past
~230 tokens the bf16 kernel is faster again). `litqlora dpo` rows (a prompt with two short answers) spent 10% of a
step in that backward.

`LIT_QLORA_SDPA_BACKEND` (an A/B switch, issue 48 item 3): unset, PyTorch picks SDPA's kernel (on CUDA flash, else
cuDNN or memory-efficient, by shape and mask); `flash`, `cudnn`, `efficient` or `math` (a comma list: in that order of
preference) restricts the plain-causal and boolean-mask SDPA calls to those kernels, which raise where none fits
(`efficient` has no CPU kernel). With `LIT_QLORA_FLEX_ATTENTION=0` it also picks the kernel of packed rows' masks.

`LIT_QLORA_FLEX_ATTENTION`: unset, flex_attention on CUDA when Triton is installed; `0`, never (the dense paths, as
before, also on CUDA); `1`, on every device, CPU included. On CPU flex_attention runs without inductor
(AOTAutograd over its dense math): it materializes the scores (no memory saved) but is the reference semantics, so
tests force it there to check its numerics and gradients against the dense path (its backward too: see
`lit_qlora.model.flex`).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import torch
import torch.nn.functional as F

from lit_qlora.base import switches
from lit_qlora.model import flex
from lit_qlora.model.flex import grouped

FLEX_ENV = "LIT_QLORA_FLEX_ATTENTION"
SDPA_ENV = "LIT_QLORA_SDPA_BACKEND"
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}


def sdpa_backends() -> Optional[list]:
    """The SDPA kernels `LIT_QLORA_SDPA_BACKEND` allows, in its order, or None (unset: PyTorch's choice)."""
    names = switches.choice_list(SDPA_ENV)
    if not names:
        return None
    from torch.nn.attention import SDPBackend

    return [getattr(SDPBackend, SDPA_BACKENDS[n]) for n in names]


def use_flex_attention(device: torch.device) -> bool:
    """Whether full-sequence forwards on `device` attend with flex_attention where a mask or a soft cap is needed
    (module doc: `LIT_QLORA_FLEX_ATTENTION` decides, else CUDA with Triton)."""
    setting = flex_setting()
    if setting is not None:
        return setting
    return torch.device(device).type == "cuda" and _triton_installed()


def flex_setting() -> Optional[bool]:
    """`LIT_QLORA_FLEX_ATTENTION`: True (1), False (0), or None (unset: by device)."""
    return switches.flag(FLEX_ENV)


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def softcap(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2 bounds attention scores and logits this way."""
    return x if cap is None else torch.tanh(x / cap) * cap


def capped_attention(q, k, v, mask: Optional[torch.Tensor], scale: float, cap: float) -> torch.Tensor:
    """Attention with soft-capped scores, which SDPA cannot do: scores, cap, mask, fp32 softmax, values (O(L^2):
    the dense path, for CPU and decoding)."""
    if k.size(1) != q.size(1):  # grouped-query attention: each kv head serves n_head / n_kv query heads
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    scores = softcap(q @ k.transpose(-2, -1) * scale, cap)
    if mask is None:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def sink_attention(q, k, v, mask: Optional[torch.Tensor], scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with gpt-oss's sinks: each head's learned logit joins every query's softmax as one more column and
    takes its share of the probability, with no value.

    Run as SDPA over one more key, so no L x L scores are kept (gpt-oss-20b's 64 heads at 2048 tokens held 1 GiB of
    fp32 scores per layer, three times over in backward): every query gains a feature holding its head's sink / scale
    (zero-padded to a multiple of 8 wide), the real keys a zero there and the sink key a one there and zeros
    elsewhere, so the sink key's score is exactly the sink; its value is zero and every query may see it. The sinks'
    gradient comes back through that feature. (For gpt-oss's head width 64, scale is 1/8 and sink / scale is exact in
    bf16.)"""
    if k.size(1) != q.size(1):  # the sink feature differs per query head, so every query head gets its own keys
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    b, h, t, d = q.shape
    s = k.size(-2)
    width = d + 1 + (-(d + 1) % 8)
    sink = (sinks / scale).to(q.dtype).view(1, h, 1, 1).expand(b, h, t, 1)
    q = torch.cat([q, sink, q.new_zeros(b, h, t, width - d - 1)], dim=-1)
    sink_key = q.new_zeros(b, h, 1, width)
    sink_key[..., d] = 1
    k = torch.cat([sink_key, F.pad(k, (0, width - d))], dim=-2)
    v = F.pad(v, (0, width - d, 1, 0))  # the sink's value row: zeros
    if mask is None:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    mask = torch.cat([mask.new_ones(*mask.shape[:-1], 1), mask], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[..., :d]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float,
           cap: Optional[float] = None, gqa: Optional[bool] = None,
           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of (B, n_head, T, d) queries over (B, n_kv, S, d) keys and values, (B, n_head, T, d) out. `mask`:
    a flex_attention BlockMask (then flex_attention, with the soft cap as its score_mod), a boolean mask (True:
    attend) or None (plain causal); `cap`: Gemma 2's attention soft cap; `sinks`: gpt-oss's per-head sink logits
    (the transformer builds dense masks for them)."""
    if sinks is not None:
        return sink_attention(q, k, v, mask, scale, sinks)
    if mask is not None and not isinstance(mask, torch.Tensor):
        return flex.flex_attend(q, k, v, mask, scale, cap, gqa)
    if cap is not None:
        return capped_attention(q, k, v, mask, scale, cap)
    if _decode_applies(q, k, mask):
        return decode_attention(q, k, v, mask, scale)
    if _upcast_applies(q, k):
        return _Float32Attention.apply(q, k, v, mask, scale)
    backends = sdpa_backends()
    if backends is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=grouped(q, k, gqa))
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backends, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=grouped(q, k, gqa))


def _decode_applies(q: torch.Tensor, k: torch.Tensor, mask) -> bool:
    return (q.device.type == "cpu" and q.size(-2) == 1 and isinstance(mask, torch.Tensor) and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and q.size(1) % k.size(1) == 0)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per row over its KV cache (a decode step), in float32: each key-value head's query heads as one
    (group, d) matrix, two small matmuls and a softmax. SDPA's CPU kernel takes 0.8-7 ms for what this does in
    0.04-1.9 ms (16 rows of SmolLM2's 9 heads over 120 cached positions: 0.83 vs 0.16 ms; one row: 66 vs 37 us), and
    its cost grows with the rows of a continuous batch, whose per-row masks it handles slowly. `mask` (True: attend)
    broadcasts to (B, 1, 1, S)."""
    B, heads, _, d = q.shape
    groups = k.size(1)
    scores = torch.matmul(q.reshape(B, groups, heads // groups, d).float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask.reshape(mask.size(0) if mask.dim() == 4 else 1, 1, 1, -1), float("-inf"))
    out = torch.matmul(torch.softmax(scores, -1), v.float())  # (B, groups, heads / groups, d)
    return out.to(q.dtype).reshape(B, heads, 1, d)


UPCAST_MAX_TOKENS = 192
"""Training rows up to this long attend in float32 on CPU when the activations are bf16 or fp16 (module doc)."""


def _upcast_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad) and q.size(-2) == k.size(-2) <= UPCAST_MAX_TOKENS
            and not torch.compiler.is_compiling())


class _Float32Attention(torch.autograd.Function):
    """SDPA's CPU flash kernel on float32 copies of q, k and v (grouped-query layouts as they are); out and the
    gradients in the inputs' dtype. Saves q, k, v, the output it returns and the float32 log-sum-exp, as the kernel's
    own autograd does. `mask`: a boolean mask (True: attend) that broadcasts to (B, heads, T, T), as `attention_mask`
    makes them, or None (causal)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale: float):
        bias = None if mask is None else torch.zeros(mask.shape, dtype=torch.float32, device=mask.device
                                                     ).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.float(), k.float(), v.float(), 0.0, mask is None, attn_mask=bias, scale=scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, bias, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.float(), q.float(), k.float(), v.float(), out.float(), lse, 0.0, bias is None, attn_mask=bias,
            scale=ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
