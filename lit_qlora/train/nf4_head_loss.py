"""Cross-entropy over an NF4 head, vocabulary slice by slice: each slice of the head is dequantized twice per loss,
whatever the number of tokens.

`chunked_cross_entropy_sum` walks the tokens in chunks and runs the whole head on each chunk, so a sliced NF4 head
is dequantized once per chunk: Llama-3's 128256-word head meets 32 tokens per chunk, and an 8B QLoRA step at 2x2048
dequantized 134G values for its head against 21G for all its blocks (4.9 s a step on an H100, LoRA 0.66 s). Here
the vocabulary is the outer loop: a first pass keeps a running log-sum-exp and the target's logit for every token,
a second pass turns each slice's logits into their gradient (softmax minus one-hot) and accumulates the gradients
of the hidden states and of the head's LoRA factors. The logits of one slice (LOGITS_CHUNK_ELEMS values, as many as
one chunk of the token-chunked loss) are all that exists of them at a time.

As in `_HeadLossWithEagerGradients`, the gradients are computed in forward (the logits exist there); backward scales
them. The LoRA term is `scale * dropout(h) A^T B^T`; its r-wide projection P is computed once, with autograd, and
its gradient is pushed through (dropout and A) at the end.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from lit_qlora.lora.dropout import dropped_down
from lit_qlora.nf4 import is_nf4, row_slices
from lit_qlora.nf4 import linear as nf4_linear
from lit_qlora.nf4.linear import DENSE_CHUNK_ELEMS, dense_rows


def vocab_sliced_head(head: nn.Module, softcap: Optional[float]) -> bool:
    """Whether `nf4_head_ce_sum` applies: a plain (not sharded, not tensor-parallel) NF4 head without a soft-cap,
    bare or with our LoRA adapter."""
    from lit_qlora.lora.layer import LoRALinear

    weight = getattr(head, "weight", None)
    if softcap is not None or weight is None or not is_nf4(weight) or getattr(head, "bias", None) is not None:
        return False
    if isinstance(head, LoRALinear):
        return type(head) is LoRALinear and type(head.lora_A).__name__ != "DTensor"
    return isinstance(head, nn.Linear)


def _slice_logits(hidden, weight, rows, dtype, p, b):
    w = dense_rows(weight, dtype, *rows)  # (valid until the next dequantization on this thread)
    z = hidden @ w.T
    if p is not None:
        z.addmm_(p, b[rows[0] : rows[1]].T)
    return z.float(), w


class _VocabSlicedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, targets, head, slice_elems: int, grads: bool, *params):
        dtype, n = hidden.dtype, targets.numel()
        lora = len(params) == 2
        with torch.enable_grad():
            h = hidden.detach().requires_grad_(grads and hidden.requires_grad)
            p_graph = dropped_down(h, params[0].to(dtype), head.lora_dropout) * head.scale if lora else None
        p = p_graph.detach() if lora else None
        b = params[1].detach().to(dtype) if lora else None
        slices = row_slices(head.weight, slice_elems)
        top = hidden.new_full((n,), float("-inf"), dtype=torch.float32)
        sumexp = hidden.new_zeros(n, dtype=torch.float32)
        target_logit = hidden.new_zeros(n, dtype=torch.float32)
        for rows in slices:
            z, _ = _slice_logits(hidden, head.weight, rows, dtype, p, b)
            top, sumexp, target_logit = fold_slice(top, sumexp, target_logit, z, targets, rows)
        lse = top + sumexp.log()
        total = (lse - target_logit).sum()
        ctx.param_dtypes = [q.dtype for q in params]
        if not grads:
            ctx.save_for_backward()
            return total
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_p = hidden.new_zeros((n, p.shape[1]), dtype=torch.float32) if lora else None
        grad_b = torch.empty(b.shape, dtype=torch.float32, device=b.device) if lora else None
        for rows in slices:
            z, w = _slice_logits(hidden, head.weight, rows, dtype, p, b)
            g = z.sub_(lse[:, None]).exp_()  # softmax of the slice
            subtract_targets(g, targets, rows)
            g = g.to(dtype)
            grad_hidden += g @ w
            if lora:
                grad_p += g @ b[rows[0] : rows[1]]
                grad_b[rows[0] : rows[1]] = (g.T @ p).float()
        grads_ab = ()
        if lora:
            wrt = [t for t in (h, params[0]) if t.requires_grad]
            pushed = torch.autograd.grad(p_graph, wrt, grad_outputs=grad_p.to(dtype)) if wrt else ()
            if h.requires_grad:
                grad_hidden += pushed[0]
            grad_a = pushed[-1].float() if params[0].requires_grad else torch.zeros_like(params[0], dtype=torch.float32)
            grads_ab = (grad_a, grad_b)
        ctx.save_for_backward(grad_hidden.to(dtype), *grads_ab)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, *grad_params = ctx.saved_tensors
        grad_params = [(g * grad_total).to(dt) for g, dt in zip(grad_params, ctx.param_dtypes)]
        return (grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, *grad_params)


def targets_in(targets: torch.Tensor, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Which targets fall in the slice's vocabulary rows, and their column in it (0 for the others: masked)."""
    inside = (targets >= rows[0]) & (targets < rows[1])
    return inside, torch.where(inside, targets - rows[0], torch.zeros_like(targets))


def fold_slice(top: torch.Tensor, sumexp: torch.Tensor, target_logit: torch.Tensor, z: torch.Tensor,
               targets: torch.Tensor, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One vocabulary slice's fp32 logits `z` (tokens, rows) folded into each token's running maximum, sum of
    exp(logit - maximum) and target logit (this loss and the tiled one): after the last slice, log-sum-exp is
    top + log(sumexp)."""
    new_top = torch.maximum(top, z.amax(1))
    sumexp = sumexp * (top - new_top).exp() + (z - new_top[:, None]).exp_().sum(1)
    inside, local = targets_in(targets, rows)
    return new_top, sumexp, torch.where(inside, z.gather(1, local[:, None]).squeeze(1), target_logit)


def subtract_targets(g: torch.Tensor, targets: torch.Tensor, rows: tuple[int, int]) -> None:
    """A slice's softmax `g` becomes its cross-entropy gradient: minus the one-hot targets in it (in place)."""
    inside, local = targets_in(targets, rows)
    g.scatter_add_(1, local[:, None], -inside.float()[:, None])


def nf4_head_ce_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, logits_elems: int) -> torch.Tensor:
    """Sum of CE(head(hidden), targets) over rows of (N, d) `hidden`, for a head `vocab_sliced_head` accepts; each
    slice of the head covers at most `logits_elems` logits (and DENSE_CHUNK_ELEMS dense weight values)."""
    from lit_qlora.lora.layer import LoRALinear

    rows = max(1, logits_elems // max(1, targets.numel()))
    # On a GPU (weights dequantized whole, into one buffer per device) a slice's dense rows are bounded as its logits
    # are: an 8B head in 16 slices at 2x2048, not 63 of DENSE_CHUNK_ELEMS (the CPU's bound, for its scratch buffer).
    dense_cap = max(DENSE_CHUNK_ELEMS, logits_elems) if nf4_linear.whole_weight(head.weight) else DENSE_CHUNK_ELEMS
    slice_elems = min(dense_cap, rows * hidden.shape[-1])
    params = (head.lora_A, head.lora_B) if isinstance(head, LoRALinear) and head.scale != 0 else ()
    grads = torch.is_grad_enabled() and (hidden.requires_grad or any(q.requires_grad for q in params))
    return _VocabSlicedLoss.apply(hidden, targets, head, slice_elems, grads, *params)
