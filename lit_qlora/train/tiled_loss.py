"""Cross-entropy over tiles of tokens x slices of the vocabulary, for long sequences: nothing scales as tokens x
vocabulary, and the NF4 head is dequantized once per loss.

The two short-sequence losses each scale badly with the tokens N. `chunked_cross_entropy_sum` runs the whole head on
LOGITS_CHUNK_ELEMS / V tokens at a time (32 for Llama-3's 128256 words), so it reads the head (and dequantizes an
NF4 one) N / 32 times. `nf4_head_ce_sum` walks the vocabulary in slices of LOGITS_CHUNK_ELEMS / N rows (12 at 300k
tokens), re-reading all N hidden states per slice, and keeps an fp32 N x n_embd gradient. Here:

* the head's dense weight is made once per call (an NF4 head dequantized into a fresh V x n_embd tensor in the
  hidden states' dtype, freed when the loss returns; a dense head is used as it is);
* the tokens go in tiles of LOSS_TILE_TOKENS; for each tile, a first pass over vocabulary slices of
  LOGITS_CHUNK_ELEMS / LOSS_TILE_TOKENS rows keeps a running log-sum-exp and the target's logit, a second turns
  each slice's logits into their gradient (softmax minus one-hot, through Gemma 2's soft-cap) and accumulates the
  tile's hidden-state gradient in fp32 (LOSS_TILE_TOKENS x n_embd), written into the N x n_embd gradient in the
  hidden states' dtype once the tile is done;
* a LoRA head's term ``scale * dropout(h) A^T B^T`` is computed per tile: its r-wide projection with autograd,
  the gradient pushed through it (dropout, A) at the end of the tile; B's gradient accumulates in fp32.

As in `_HeadLossWithEagerGradients` the gradients are computed in forward, where the logits exist; backward only
scales them. The values equal the token-chunked loss's (fp32 to ~1e-6; bf16 to its rounding: the slices' partial
products are summed in fp32).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from lit_qlora.lora.dropout import dropped_down
from lit_qlora.nf4 import dequantize_nf4, is_nf4
from lit_qlora.train.nf4_head_loss import fold_slice, subtract_targets

LOSS_TILE_TOKENS = 4096
"""Tokens per tile; with LOGITS_CHUNK_ELEMS logits a slice (1024 vocabulary rows). A tile's fp32 temporaries are
its logits slice (a few copies), the hidden-state gradient (LOSS_TILE_TOKENS x n_embd: 64 MiB at n_embd 4096) and
per-token statistics."""


def tiled_head(head: nn.Module) -> bool:
    """Whether `tiled_ce_sum` can run `head`: a plain linear (dense or NF4, frozen weight and bias), bare or with our
    LoRA adapter; not tensor-parallel or sharded heads."""
    from lit_qlora.lora.layer import LoRALinear
    from lit_qlora.nf4.linear import FrozenNF4Linear

    if type(head) not in (nn.Linear, FrozenNF4Linear, LoRALinear):
        return False
    tensors = [head.weight, head.bias] + ([head.lora_A, head.lora_B] if isinstance(head, LoRALinear) else [])
    if any(type(t).__name__ == "DTensor" for t in tensors if t is not None):
        return False
    return not head.weight.requires_grad and (head.bias is None or not head.bias.requires_grad)


def use_tiled_loss(head: nn.Module, tokens: int, vocab_sliced: bool) -> bool:
    """Whether `lm_loss_sum` takes the tiled loss for `tokens` next-token positions (padding and masked prompts
    counted: no device sync to decide): more than one tile, a head it can
    run, and, for an NF4 head that would take the vocabulary-sliced loss (`vocab_sliced`), at least V / 2 tokens:
    from there the dense head (V x n_embd in bf16) costs no more than the sliced loss's fp32 N x n_embd gradient."""
    if tokens <= LOSS_TILE_TOKENS or not tiled_head(head):
        return False
    return not vocab_sliced or 2 * tokens >= head.out_features


def _dense_weight(head: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    weight = head.weight
    if is_nf4(weight):
        return dequantize_nf4(weight, dtype)  # once per loss, fresh: dropped when the loss returns
    return weight.detach().to(dtype)


def _logits(h, w, bias, p, b, cap: Optional[float]):
    """A (tokens, rows) slice's fp32 logits, soft-capped, and the capped logits' derivative factor (or None)."""
    z = h @ w.T
    if bias is not None:
        z += bias
    if p is not None:
        z.addmm_(p, b.T)
    z = z.float()
    if cap is None:
        return z
    return torch.tanh(z.div_(cap)).mul_(cap)


def tile_starts(n: int, tile_tokens: int) -> range:
    """Each tile's first token. (`litqlora estimate` traces only the first few: every tile allocates alike.)"""
    return range(0, n, tile_tokens)


class _TiledLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, targets, head, cap: Optional[float], tile_tokens: int, slice_rows: int, grads: bool,
                *params):
        dtype, n, (vocab, dim) = hidden.dtype, targets.numel(), head.weight.shape
        lora = len(params) == 2
        weight = _dense_weight(head, dtype)
        bias = None if head.bias is None else head.bias.detach().to(dtype)
        b = params[1].detach().to(dtype) if lora else None
        need_h = grads and hidden.requires_grad
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_a = torch.zeros_like(params[0], dtype=torch.float32) if lora and grads else None
        grad_b = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if lora and grads else None
        total = hidden.new_zeros((), dtype=torch.float32)
        slices = [(v, min(vocab, v + slice_rows)) for v in range(0, vocab, slice_rows)]
        for t0 in tile_starts(n, tile_tokens):
            t1 = min(n, t0 + tile_tokens)
            tgt = targets[t0:t1]
            p_graph = p = None
            if lora:
                with torch.enable_grad():
                    h_graph = hidden[t0:t1].detach().requires_grad_(need_h)
                    p_graph = dropped_down(h_graph, params[0].to(dtype), head.lora_dropout) * head.scale
                p = p_graph.detach()
            h = hidden[t0:t1].detach()
            top = h.new_full((t1 - t0,), float("-inf"), dtype=torch.float32)
            sumexp = h.new_zeros(t1 - t0, dtype=torch.float32)
            target_logit = h.new_zeros(t1 - t0, dtype=torch.float32)
            for v0, v1 in slices:
                z = _logits(h, weight[v0:v1], None if bias is None else bias[v0:v1], p,
                            None if b is None else b[v0:v1], cap)
                top, sumexp, target_logit = fold_slice(top, sumexp, target_logit, z, tgt, (v0, v1))
                del z
            lse = top + sumexp.log()
            total += (lse - target_logit).sum()
            if not grads:
                continue
            gh = torch.zeros(t1 - t0, dim, dtype=torch.float32, device=h.device) if need_h else None
            grad_p = torch.zeros(t1 - t0, b.shape[1], dtype=torch.float32, device=h.device) if lora else None
            for v0, v1 in slices:
                w = weight[v0:v1]
                z = _logits(h, w, None if bias is None else bias[v0:v1], p, None if b is None else b[v0:v1], cap)
                g = (z - lse[:, None]).exp_()  # softmax of the slice
                subtract_targets(g, tgt, (v0, v1))
                if cap is not None:  # through cap * tanh(z / cap): times 1 - (capped / cap)^2
                    g.mul_(1 - z.div_(cap).square_())
                del z
                g = g.to(dtype)
                if need_h:
                    _add_product(gh, g, w)
                if lora:
                    _add_product(grad_p, g, b[v0:v1])
                    _add_product(grad_b[v0:v1], g.T, p)
                del g
            if lora:
                wrt = [t for t in (h_graph, params[0]) if t.requires_grad]
                pushed = torch.autograd.grad(p_graph, wrt, grad_outputs=grad_p.to(dtype)) if wrt else ()
                if need_h:
                    gh += pushed[0]
                if params[0].requires_grad:
                    grad_a += pushed[-1]
                del pushed, p_graph, h_graph
            if need_h:
                grad_hidden[t0:t1] = gh
            del gh, grad_p
        del weight
        ctx.param_dtypes = [q.dtype for q in params]
        saved = () if not grads else (grad_hidden if need_h else hidden.new_zeros(0),
                                      *((grad_a, grad_b) if lora else ()))
        ctx.has_grad_hidden = need_h
        ctx.save_for_backward(*saved)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, *grad_params = ctx.saved_tensors
        grad_params = [(g * grad_total).to(dt) for g, dt in zip(grad_params, ctx.param_dtypes)]
        grad_hidden = grad_hidden * grad_total.to(grad_hidden.dtype) if ctx.has_grad_hidden else None
        return (grad_hidden, None, None, None, None, None, None, *grad_params)


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc fp32: in place where the dtypes match, else each slice's product (in a's dtype) summed
    in fp32."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc += a @ b


def tiled_ce_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, softcap: Optional[float],
                 logits_elems: int, tile_tokens: Optional[int] = None) -> torch.Tensor:
    """Sum of CE(softcap(head(hidden)), targets) over the rows of (N, d) `hidden` (no ignored targets: see
    `next_token_pairs`), for a head `tiled_head` accepts: tiles of `tile_tokens` (default LOSS_TILE_TOKENS) tokens
    and slices of `logits_elems / tile_tokens` vocabulary rows. With gradients enabled they are computed here,
    for `hidden` and the head's LoRA factors."""
    from lit_qlora.lora.layer import LoRALinear

    tile_tokens = max(1, min(tile_tokens or LOSS_TILE_TOKENS, targets.numel()))
    slice_rows = max(1, logits_elems // tile_tokens)
    params = (head.lora_A, head.lora_B) if isinstance(head, LoRALinear) and head.scale != 0 else ()
    grads = torch.is_grad_enabled() and (hidden.requires_grad or any(q.requires_grad for q in params))
    return _TiledLoss.apply(hidden, targets, head, softcap, tile_tokens, slice_rows, grads, *params)
