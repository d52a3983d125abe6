"""flex_attention as `lit_qlora.model.attention` runs it, where that module chose it (a BlockMask: CUDA, or every
device under `LIT_QLORA_FLEX_ATTENTION=1`): compiled, the compiled function kept, the recompile limit raised, and a
per-shape fallback to the dense mask where inductor cannot lower a shape.

flex_attention is O(L) only compiled: outside a compiled region it runs through `torch.compile(flex_attention)`,
made once per backend, lazily; inside one (`--compile true`, regional compilation) the block's graph traces it
directly. Shapes: the first call compiles for its sequence length; a call at another length recompiles with the
length dynamic (dynamo's automatic dynamic shapes), and once the number of 128-token blocks has changed too, with
that dynamic as well: two or three compiles, after which lengths and each batch's new document mask reuse the code
(checked with dynamo on CPU, tests/test_attention.py; the compiled create_block_mask of
`lit_qlora.model.attention_mask` behaved alike in a one-off dynamo check). Each grad mode (training, validation), mask
kind (sliding, global) and head layout has its own entries, hence RECOMPILE_LIMIT (`raise_recompile_limit`, which
the compiled create_block_mask calls too).

A run never breaks on a shape inductor cannot lower (seen on an H200: head_dim 16, a packed BlockMask,
`NoValidChoicesError`): before a forward first uses flex_attention for a shape, `flex_runs` tries it once, forward
and (when training) backward, on zeros of that shape; a failure is said once on stderr and that shape falls back to
the dense mask, the same attention through SDPA or `capped_attention` (O(L^2) memory). The verdict is kept per shape
for the process, so compiled blocks trace the path that works.

On CPU flex_attention runs without inductor (AOTAutograd over its dense math, `aot_eager`). torch refuses its
backward on CPU with a device guard, though that dense backward runs there: `flex_attend` lifts the guard off CUDA.
Not inside a `--compile true` block on CPU, where the guard stays: forcing flex there is unsupported.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple, Optional

import torch
from torch._subclasses.fake_tensor import is_fake


def grouped(q: torch.Tensor, k: torch.Tensor, gqa: Optional[bool]) -> bool:
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
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=grouped(q, k, gqa))
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


def block_mask(mask_mod: Callable, batch: Optional[int], length: int, device):
    """flex_attention's BlockMask for `mask_mod` over (length, length), per row of `batch` (None: the same for every
    row), the same for every head. On CUDA through `torch.compile(create_block_mask)` (made once), which never
    materializes the (length, length) mask: the block tables are O((length / 128)^2) int32; elsewhere eagerly (the
    dense mask, transient: tests only)."""
    from torch.nn.attention.flex_attention import create_block_mask

    build = _compiled_create_block_mask() if torch.device(device).type == "cuda" else create_block_mask
    return build(mask_mod, batch, None, length, length, device)


@functools.lru_cache(maxsize=None)
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    raise_recompile_limit()
    return torch.compile(create_block_mask)
