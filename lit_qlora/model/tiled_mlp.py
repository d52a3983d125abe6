"""The MLP over sequence tiles: in forward and backward only one tile's intermediate activations exist.

A block's MLP holds tensors of its intermediate width per token: gate, up, act(gate) * up and, in backward, their
gradients (Llama-3-8B, 14336 wide: ~28 KiB per token each in bf16). At long sequences, even with the block's
activations checkpointed, the block being recomputed holds all of them for every token at once (300k tokens: 8 GiB
per tensor). `tiled_mlp` runs the MLP (its gate/up/down projections, their LoRA adapters, NF4 or dense bases,
dropout, SiLU or Gemma's GeGLU: whatever `MLP.forward_untiled` does) over tiles of `mlp_tile_tokens` tokens:

* forward runs each tile without autograd and keeps only the MLP's input;
* backward runs each tile again with autograd and backpropagates it alone (`torch.autograd.grad`), writing the
  tile's input gradient and adding its LoRA gradients into fp32 sums, which the function returns as the adapters'
  gradients (once per step, as an untiled MLP's would arrive: accumulation and DDP hooks see one gradient).

So what scales with the sequence is the input, the output and the input's gradient (n_embd wide); the intermediate
tensors are one tile's. The price is one more forward of the MLP per tile (backward's recompute), as activation
checkpointing pays. Inside a checkpointed block the block's own recompute (which runs within backward) needs the
MLP only to save its input again: where the block reads nothing of the MLP's output for backward (`output_read`
False: a residual add, not Gemma's post-MLP norm) the tiled forward skips the tiles there and returns an
uninitialized output, which the recompute discards, so such a block runs its MLP twice per step, not three times.

Dropout: each tile's adapters draw their masks from the RNG as the MLP would on that tile alone; backward restores
the RNG state (CPU, and the input's CUDA device) that forward started from, so its recompute draws the same masks
as forward used (tiled and untiled masks differ, as two runs' masks do). Tiling is exact without dropout: the
tiled MLP's output and gradients equal the untiled one's (to matmul rounding, tests/test_tiling.py).

Tiling applies to training forwards (grad enabled, an input or parameter needing a gradient) with more tokens
than one tile; it is off under torch.compile (the recompute calls autograd inside backward, which dynamo does
not trace: compiled blocks keep the untiled MLP) and in multi-process runs (FSDP2 swaps the parameters between
forward and backward; untested there).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn

from lit_qlora.nf4.native import is_fake

MLP_TILE_ELEMS = 1 << 26
"""Intermediate values (tokens x intermediate size) per tile: 128 MiB per bf16 tensor, whatever the model (Llama-3-8B:
4681 tokens a tile, SmolLM2-135M: 43690). A sequence with at most this many runs untiled: as fast as before."""


def mlp_tile_tokens(intermediate_size: int) -> int:
    """Tokens per tile of an MLP this wide: MLP_TILE_ELEMS / intermediate_size (at least one)."""
    return max(1, MLP_TILE_ELEMS // max(1, intermediate_size))


def tiling_applies(x: torch.Tensor, tile_tokens: int) -> bool:
    """Whether an MLP call on `x` may run tiled: gradients enabled, more tokens than one tile, not compiled, not
    distributed (and, `tiled_mlp` checks, an input or parameter needing a gradient)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():  # (compiled: before any guard on x's shape)
        return False
    if x.numel() // max(1, x.shape[-1]) <= tile_tokens:
        return False
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def tiled_mlp(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, module: nn.Module,
              tile_tokens: int, output_read: bool = True) -> torch.Tensor:
    """`run(x)` (the untiled MLP) computed `tile_tokens` tokens at a time, forward and backward (module doc);
    `module`'s trainable parameters get their gradients. Falls back to `run(x)` where tiling does not apply.
    `output_read`: whether the caller saves the output for its backward (if not, a checkpoint's recompute skips
    the tiles: module doc)."""
    if not tiling_applies(x, tile_tokens):
        return run(x)
    params = [p for p in module.parameters() if p.requires_grad]
    if not (x.requires_grad or params):
        return run(x)
    return _TiledMLP.apply(x, run, tile_tokens, output_read, *params)


def _rng_state(x: torch.Tensor) -> tuple:
    if is_fake(x):  # `litqlora estimate`'s step: no RNG state to keep
        return ()
    cuda = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
    return (torch.get_rng_state(), cuda)


@contextlib.contextmanager
def _replayed_rng(x: torch.Tensor, state: tuple):
    """The RNG as it was when forward began (and as it is now again afterwards)."""
    if not state:
        yield
        return
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], x.device)
        yield


def tile_starts(n: int, tile_tokens: int) -> range:
    """Each tile's first token. (`litqlora estimate` traces only the first few: every tile allocates alike.)"""
    return range(0, n, tile_tokens)


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, run, tile_tokens: int, output_read: bool, *params):
        ctx.run, ctx.tile_tokens, ctx.rng = run, tile_tokens, _rng_state(x)
        ctx.params = params  # (parameters: alive anyway; not saved tensors, which checkpointing would drop)
        kind = x.device.type  # backward recomputes under forward's autocast (16-mixed), as checkpointing does
        ctx.autocast = (kind, torch.get_autocast_dtype(kind), torch.is_autocast_enabled(kind))
        ctx.save_for_backward(x)
        if not output_read and torch._C._current_graph_task_id() != -1:
            # within backward: a checkpointed block's recompute, which wants x saved again, not this output
            return torch.empty_like(x)  # (an MLP maps n_embd back to n_embd)
        x2 = x.reshape(-1, x.shape[-1])
        out = None
        with torch.no_grad():
            for start in tile_starts(x2.shape[0], tile_tokens):
                y = run(x2[start : start + tile_tokens])
                if out is None:
                    out = y.new_empty(x2.shape[0], y.shape[-1])
                out[start : start + tile_tokens] = y
                del y
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        params = ctx.params
        wanted = [i for i, needed in enumerate(ctx.needs_input_grad[4:]) if needed]
        needs_x = ctx.needs_input_grad[0]
        x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_x = torch.empty_like(x2) if needs_x else None
        sums = {i: torch.zeros_like(params[i], dtype=torch.float32) for i in wanted}
        kind, dtype, enabled = ctx.autocast
        with _replayed_rng(x, ctx.rng), torch.enable_grad(), torch.autocast(kind, dtype, enabled):
            for start in tile_starts(x2.shape[0], ctx.tile_tokens):
                xt = x2[start : start + ctx.tile_tokens].detach().requires_grad_(needs_x)
                y = ctx.run(xt)
                wrt = ([xt] if needs_x else []) + [params[i] for i in wanted]
                grads = torch.autograd.grad(y, wrt, g2[start : start + ctx.tile_tokens], allow_unused=True)
                del y
                if needs_x:
                    grad_x[start : start + ctx.tile_tokens] = grads[0]
                for i, g in zip(wanted, grads[1:] if needs_x else grads):
                    if g is not None:
                        sums[i] += g
                del grads
        grad_params = [sums[i].to(params[i].dtype) if i in sums else None for i in range(len(params))]
        return (None if grad_x is None else grad_x.view(x.shape), None, None, None, *grad_params)

