"""Which attention kernel runs: plain causal SDPA where it is exact, flex_attention on CUDA for every other mask
(sliding windows, packed documents) and for Gemma 2's soft-capped scores, the dense paths elsewhere.

| case (full-sequence forward)                                   | CUDA                    | CPU (default)          |
|----------------------------------------------------------------|-------------------------|------------------------|
| causal, no window shorter than the row, unpacked, no soft cap  | SDPA `is_causal` (O(L)) | SDPA `is_causal`       |
| sliding window shorter than the row, packed documents          | flex_attention (O(L))   | SDPA + dense bool mask |
| Gemma 2's attention soft cap (any mask)                        | flex_attention (O(L))   | `capped_attention`     |
| KV-cache decoding (generation)                                 | dense, as on CPU        | dense                  |

The mask is built once per forward by `lit_qlora.model.attention_mask.attention_mask`, from one rule (`mask_mod`): a
`BlockMask` for flex_attention where `use_flex_attention` says so, else a dense boolean mask or None (plain causal);
`attend` dispatches on what it receives. flex_attention is O(L) only compiled: outside a compiled region it runs
through `torch.compile(flex_attention)`, made once, lazily; inside one (`--compile true`, regional compilation) the
block's graph traces it directly. Shapes: the first call compiles for its sequence length; a call at another length
recompiles with the length dynamic (dynamo's automatic dynamic shapes), and once the number of 128-token blocks has
changed too, with that dynamic as well: two or three compiles, after which lengths and each batch's new document
mask reuse the code (checked with dynamo on CPU, tests/test_attention.py; the compiled create_block_mask behaved
alike in a one-off dynamo check). Each grad mode (training, validation), mask kind (sliding, global) and head
layout has its own entries, hence RECOMPILE_LIMIT.

A run never breaks on a shape inductor cannot lower (seen on an H200: head_dim 16, a packed BlockMask,
`NoValidChoicesError`): before a forward first uses flex_attention for a shape, `flex_runs` tries it once, forward
and (when training) backward, on zeros of that shape; a failure is said once on stderr and that shape falls back to
the dense mask, the same attention through SDPA or `capped_attention` (O(L^2) memory). The verdict is kept per shape
for the process, so compiled blocks trace the path that works.

Training on CPU in bf16 (or fp16), rows of at most `UPCAST_MAX_TOKENS` tokens attend through SDPA's CPU flash kernel
in float32 (`_Float32Attention`): in torch 2.13 that kernel's bf16 backward costs 5.6 ms for 2 rows x 100 tokens of
SmolLM2's 9 heads, against 2.2 ms for its float32 forward and backward together, and more accurate gradients (past
~230 tokens the bf16 kernel is faster again). `litqlora dpo` rows (a prompt with two short answers) spent 10% of a
step in that backward.

`LIT_QLORA_FLEX_ATTENTION`: unset, flex_attention on CUDA when Triton is installed; `0`, never (the dense paths, as
before, also on CUDA); `1`, on every device, CPU included. On CPU flex_attention runs without inductor
(AOTAutograd over its dense math): it materializes the scores (no memory saved) but is the reference semantics, so
tests force it there to check its numerics and gradients against the dense path. (torch refuses flex_attention's
backward on CPU with a device guard, though that dense backward runs there: `flex_attend` lifts the guard off CUDA.
Not inside a `--compile true` block on CPU, where the guard stays: forcing flex there is unsupported.)
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from contextlib import contextmanager
from typing import Iterator, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

FLEX_ENV = "LIT_QLORA_FLEX_ATTENTION"


def use_flex_attention(device: torch.device) -> bool:
    """Whether full-sequence forwards on `device` attend with flex_attention where a mask or a soft cap is needed
    (module doc: `LIT_QLORA_FLEX_ATTENTION` decides, else CUDA with Triton)."""
    setting = flex_setting()
    if setting is not None:
        return setting
    return torch.device(device).type == "cuda" and _triton_installed()


def flex_setting() -> Optional[bool]:
    """`LIT_QLORA_FLEX_ATTENTION`: True (1), False (0), or None (unset: by device)."""
    setting = os.environ.get(FLEX_ENV, "").strip().lower()
    if setting in ("0", "false", "off"):
        return False
    if setting in ("1", "true", "on"):
        return True
    return None


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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float,
           cap: Optional[float] = None, gqa: Optional[bool] = None) -> torch.Tensor:
    """Attention of (B, n_head, T, d) queries over (B, n_kv, S, d) keys and values, (B, n_head, T, d) out. `mask`:
    a flex_attention BlockMask (then flex_attention, with the soft cap as its score_mod), a boolean mask (True:
    attend) or None (plain causal); `cap`: Gemma 2's attention soft cap."""
    if mask is not None and not isinstance(mask, torch.Tensor):
        return flex_attend(q, k, v, mask, scale, cap, gqa)
    if cap is not None:
        return capped_attention(q, k, v, mask, scale, cap)
    if _upcast_applies(q, k):
        return _Float32Attention.apply(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          enable_gqa=_grouped(q, k, gqa))


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


def _grouped(q: torch.Tensor, k: torch.Tensor, gqa: Optional[bool]) -> bool:
    """Whether k/v have fewer heads than q. A plain bool: compared sizes are a SymBool under dynamic shapes, which
    SDPA's enable_gqa refuses (a graph break in every compiled block); callers that know it pass `gqa`."""
    return bool(q.size(1) != k.size(1)) if gqa is None else gqa


def flex_attend(q, k, v, block_mask, scale: float, cap: Optional[float] = None,
                gqa: Optional[bool] = None) -> torch.Tensor:
    """flex_attention over `block_mask`, with `cap` as a score_mod: compiled (inductor: O(L) memory, the output and a
    float32 log-sum-exp per query) on CUDA; elsewhere through AOTAutograd without inductor (`aot_eager`: the dense
    reference math, as the compiled kernels' backward is derived). Not uncompiled: torch 2.13's eager flex_attention
    gives wrong gradients for a score_mod with captured tensors (the soft cap) under activation checkpointing (its
    forward traces the score_mod's backward with make_fx, and checkpoint's saved-tensor hooks catch those saves).
    (`litqlora estimate` puts a stand-in here that allocates what the compiled kernels do.)"""
    return _flex_attention(q, k, v, block_mask, scale, cap, gqa)


def _flex_attention(q, k, v, block_mask, scale: float, cap: Optional[float], gqa: Optional[bool]) -> torch.Tensor:
    """flex_attend's computation, which `flex_runs` tries as it is."""
    from torch.nn.attention.flex_attention import flex_attention

    score_mod = None if cap is None else _softcap_score_mod(q.new_full((), cap, dtype=torch.float32))
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=_grouped(q, k, gqa))
    if torch.compiler.is_compiling():  # inside a compiled block: traced into its graph
        return flex_attention(q, k, v, **kwargs)
    if q.device.type == "cuda":
        return _compiled_flex_attention("inductor")(q, k, v, **kwargs)
    with _cpu_backward_allowed():
        return _compiled_flex_attention("aot_eager")(q, k, v, **kwargs)


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention(backend: str):
    from torch.nn.attention.flex_attention import flex_attention

    raise_recompile_limit()
    return torch.compile(flex_attention, backend=backend)


RECOMPILE_LIMIT = 64
"""Compiled entries dynamo keeps per code object (flex_attention, create_block_mask): a model's mask kinds (sliding,
global) x static and dynamic lengths x grad modes (training, validation) already reach dynamo's default 8, past
which it would silently run flex_attention uncompiled: O(L^2) memory, and wrong soft-capped gradients under
activation checkpointing (flex_attend's doc)."""


def raise_recompile_limit() -> None:
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def _softcap_score_mod(cap: torch.Tensor):
    """flex_attention's score_mod for a soft cap. The cap is a 0-dim tensor, not a float: dynamo guards a captured
    tensor by its shape only, while a captured float that changes (another model's cap) turns symbolic, which
    flex_attention's tracing fails on in torch 2.13 ("Pending unbacked symbols")."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return score_mod


@contextmanager
def _cpu_backward_allowed() -> Iterator[None]:
    """Lift torch's guard against flex_attention's backward off CUDA (module doc): its eager backward is exact."""
    from torch.nn.attention import flex_attention as module

    guard = module._validate_device
    module._validate_device = _no_device_check  # one function object: dynamo guards on it when it traces the call
    try:
        yield
    finally:
        module._validate_device = guard


def _no_device_check(query, key, value) -> None:
    return None


class FlexShape(NamedTuple):
    """What decides whether inductor can lower flex_attention for a forward: the shapes, dtype and grad mode of its
    queries and keys, the score_mod (scale, soft cap) and the mask's kind (its mask_mod's code)."""

    device: str
    dtype: torch.dtype
    batch: int
    length: int
    n_head: int
    n_kv: int
    head_dim: int
    scale: float
    cap: Optional[float]
    grad: bool
    mask_kind: str


_flex_verdicts: dict[FlexShape, bool] = {}
"""Whether flex_attention ran for each shape tried in this process (`flex_runs`)."""


def flex_runs(block_mask, shape: FlexShape) -> bool:
    """Whether flex_attention, as `flex_attend` runs it, computes `shape`: tried once per shape, on zeros (no random
    numbers drawn: a run's dropout and data order stay as they were), forward and, with `shape.grad`, backward. A
    failure (an inductor lowering error, or any other) is said once on stderr; the caller then attends with the
    dense mask, which computes the same attention."""
    if torch.compiler.is_compiling() or is_fake(block_mask.kv_num_blocks):  # (`litqlora estimate`'s dry run)
        return True
    verdict = _flex_verdicts.get(shape)
    if verdict is None:
        try:
            _try_flex(block_mask, shape)
            verdict = True
        except torch.OutOfMemoryError:  # the real forward would run out too: not a lowering problem to hide
            raise
        except Exception as e:  # noqa: BLE001 - any failure to compile or run it: the dense path is exact
            verdict = False
            first_line = (str(e).strip().splitlines() or [""])[0][:300]
            print(f"flex_attention failed for {shape.length} tokens x {shape.batch} rows, {shape.n_head} heads of "
                  f"{shape.head_dim} ({shape.dtype}, {shape.mask_kind} mask{', training' if shape.grad else ''}): "
                  f"{type(e).__name__}: {first_line}. Attending with the dense mask for this shape instead (the same "
                  "attention, O(L^2) memory).", file=sys.stderr, flush=True)
        _flex_verdicts[shape] = verdict
    return verdict


def _try_flex(block_mask, shape: FlexShape) -> None:
    def zeros(heads: int) -> torch.Tensor:
        return torch.zeros(shape.batch, heads, shape.length, shape.head_dim, dtype=shape.dtype, device=shape.device,
                           requires_grad=shape.grad)

    q, k, v = zeros(shape.n_head), zeros(shape.n_kv), zeros(shape.n_kv)
    with torch.set_grad_enabled(shape.grad):
        out = _flex_attention(q, k, v, block_mask, shape.scale, shape.cap, shape.n_head != shape.n_kv)
        if shape.grad:
            torch.autograd.grad(out.sum(), (q, k, v))
