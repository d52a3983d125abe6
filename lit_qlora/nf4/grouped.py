"""Grouped matmuls for mixtures of experts: tokens sorted by expert, one matmul call per projection for all experts.

A block's experts are stored stacked, the way the grouped matmul reads them: one (n_experts, out, in) weight per
projection, or its NF4 form, one (n_experts * out, in) ``NF4Tensor`` (each expert's rows are whole quantization
blocks, so an expert is a contiguous run of codes and block scales). `ExpertLinear` is that frozen projection;
LoRA's per-expert adapters sit on it in :mod:`lit_qlora.lora.experts`.

`grouped_mm` wraps ``torch._grouped_mm`` (CUDA's grouped GEMM; on the CPU one call that loops in C++), whose
operands must have 16-byte aligned strides: where a width is not (a tiny model, a LoRA rank of 4 in bf16), the
operands are zero-padded to one that is, which changes no value.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchao.quantization import NF4Tensor

from lit_qlora.base.recompute import first_run_value
from lit_qlora.nf4.codec import block_scales, dequantize_nf4, is_nf4
from lit_qlora.nf4.native import dequantize_blocks, is_fake, use_native
from lit_qlora.nf4.reference import dequantize_eager


def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    size = t.size(dim)
    extra = -size % multiple
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return F.pad(t, pad)


PADDED_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes whose CPU matmuls go through oneDNN, which builds a kernel for every new shape: ``torch._grouped_mm`` on the
CPU is one matmul per expert, each expert's row count changes every step, and those builds took 60-80% of a bf16 MoE
step (a projection took 15 ms where the same call again took 6.5). For them each expert's rows are padded (`_padded`)
to a multiple of PAD_ROWS, so the shapes repeat from step to step; where the experts' counts are close, to the same
count, and the product is one batched matmul. fp32 runs MKL's GEMM, which builds nothing: it is left as it is."""

PAD_ROWS = 16
"""Each expert's rows are padded to a multiple of this."""

PAD_LIMIT = 3.0
"""The experts are padded to one count (one batched matmul) while that holds at most this many times the rows; else
each to its own multiple of PAD_ROWS (the grouped matmul)."""

_layout = threading.local()


def _rows_layout(offsets: torch.Tensor, groups: int) -> tuple[torch.Tensor, Optional[int], Optional[torch.Tensor]]:
    """Where each grouped row goes in the padded rows, and the padding: one `width` for every group (a batched
    matmul), or else each group's own padded end (`padded_offsets`, a grouped matmul). Kept for the last offsets: a
    block's projections share them."""
    key = tuple(offsets.tolist())
    cached = getattr(_layout, "rows", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    ends = torch.tensor(key, dtype=torch.long)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    n = key[-1] if key else 0
    group = torch.repeat_interleave(torch.arange(groups), counts, output_size=n)
    within = torch.arange(n) - (ends - counts).index_select(0, group)
    width = -(-int(counts.max()) // PAD_ROWS) * PAD_ROWS if key else 0
    if groups * width <= PAD_LIMIT * n:
        layout = (group * width + within, width, None)
    else:
        padded = (counts + PAD_ROWS - 1) // PAD_ROWS * PAD_ROWS
        padded_ends = padded.cumsum(0)
        layout = ((padded_ends - padded).index_select(0, group) + within, None, padded_ends.to(torch.int32))
    _layout.rows, _layout.input = (key, layout), None
    return layout


def _padded(a: torch.Tensor, offsets: torch.Tensor, groups: int) -> Optional[tuple]:
    """`a`'s grouped rows (those before offsets[-1]) padded per `_rows_layout` with zero rows: (the rows, each row's
    place, width, padded offsets); None where nothing is padded (not a CPU oneDNN dtype, fake tensors). The last
    padded input is kept, with a reference to it so that its identity cannot be reused: gate and up, and their
    adapters, read the same rows."""
    if a.device.type != "cpu" or a.dtype not in PADDED_DTYPES or is_fake(a) or is_fake(offsets):
        return None
    place, width, padded_offsets = _rows_layout(offsets, groups)
    version = None if a.is_inference() else a._version  # (an inference tensor has no version counter: not kept)
    kept = getattr(_layout, "input", None)
    if kept is not None and kept[0] is a and version is not None and kept[1] == version:
        return kept[2], place, width, padded_offsets
    total = groups * width if width is not None else (int(padded_offsets[-1]) if groups else 0)
    rows = a.new_zeros(total, a.size(1))
    rows.index_copy_(0, place, a[:place.numel()])
    _layout.input = (a, version, rows) if version is not None else None
    return rows, place, width, padded_offsets


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per group g of rows of `a` (rows offsets[g-1]:offsets[g]): a[rows] @ b[g]. a (M, K), b (G, K, N) -> (M, N)."""
    padded = _padded(a, offsets, b.size(0))
    if padded is not None:
        rows, place, width, padded_offsets = padded
        if width is not None:
            out = torch.bmm(rows.view(b.size(0), width, -1), b.to(a.dtype)).view(-1, b.size(2))
        else:
            out = _grouped(rows, b, padded_offsets)
        return out.index_select(0, place)
    return _grouped(a, b, offsets)


def _grouped(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    align = 16 // a.element_size()
    n = b.size(2)
    a = _pad_to(a, 1, align).contiguous()
    b = _pad_to(_pad_to(b, 1, align), 2, align)
    if b.stride(1) != 1 and b.stride(2) != 1:
        b = b.contiguous()
    out = _grouped_mm_op(a, b, offsets)
    return out if out.size(1) == n else out[:, :n].contiguous()  # not a view: callers add into it in place


def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``; on fake tensors (`litqlora estimate`) of a dtype its meta function refuses (it takes
    only bf16, where the CPU kernel takes fp32 too) the empty output the call would allocate: (M, N) for a 2D a, (G,
    K, N) for a 2D a and b (a weight gradient)."""
    if a.dtype != torch.bfloat16 and is_fake(a):
        shape = (a.size(0), b.size(-1)) if b.dim() == 3 else (offsets.numel(), a.size(0), b.size(1))
        return a.new_empty(shape)
    return torch._grouped_mm(a, b, offs=offsets)


def grouped_weight_grad(a: torch.Tensor, g: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per group: a[rows]^T @ g[rows], a (M, K), g (M, N) -> (G, K, N): the gradient of `grouped_mm`'s b."""
    groups = offsets.numel()
    padded = _padded(a, offsets, groups)
    if padded is not None:
        rows, place, width, padded_offsets = padded
        grads = g.new_zeros(rows.size(0), g.size(1))
        grads.index_copy_(0, place, g[:place.numel()])
        if width is not None:
            return torch.bmm(rows.view(groups, width, -1).transpose(1, 2), grads.view(groups, width, -1))
        a, g, offsets = rows, grads, padded_offsets
    align = 16 // a.element_size()
    k, n = a.size(1), g.size(1)
    a_t = _pad_to(_pad_to(a, 0, align), 1, align).t().contiguous()  # (K', M'): rows past the last offset are zeros
    g = _pad_to(_pad_to(g, 0, align), 1, align).contiguous()
    out = _grouped_mm_op(a_t, g, offsets)
    return out[:, :k, :n]


def group_offsets(counts: torch.Tensor) -> torch.Tensor:
    """Each group's end row, int32, as ``torch._grouped_mm`` takes them."""
    return counts.cumsum(0).to(torch.int32)


_workspace = threading.local()


def _cpu_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat buffer reused by every projection on this thread. A fresh tensor of a projection's experts (33 MiB
    in fp32 for 64 experts of 256 x 512) is a new mmap that the kernel then page-faults in: that cost 4x the
    dequantization itself (glibc maps every block over 32 MiB and unmaps it on free)."""
    buf = getattr(_workspace, "buf", None)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        _workspace.buf = None  # free the old one before the new one is allocated
        buf = _workspace.buf = torch.empty(numel, dtype=dtype)
    return buf[:numel]


@torch.compiler.disable  # raw-pointer kernels
@torch.no_grad()
def dequantize_experts(weight: NF4Tensor, n_experts: int, experts: Optional[torch.Tensor],
                       dtype: torch.dtype) -> torch.Tensor:
    """The dense (len(experts), out, in) weights of the experts `experts` (all with None) of a stacked NF4
    projection: only their codes are read, so a token routed to 8 of 128 experts dequantizes 8.

    On the CPU the result lives in a buffer the next call on this thread overwrites: use it before then (the
    grouped matmul does, and its backward dequantizes again)."""
    rows, cols = weight.shape
    out_rows = rows // n_experts
    if experts is None:
        count, codes, scales = n_experts, weight.quantized_data, block_scales(weight)
    else:
        count = experts.numel()
        codes = weight.quantized_data.view(n_experts, -1).index_select(0, experts).view(-1)
        scales = block_scales(weight).view(n_experts, -1).index_select(0, experts).view(-1)
    storage = weight.nf4.dtype
    numel = count * out_rows * cols
    if codes.device.type == "cpu" and not is_fake(codes):
        flat = _cpu_buffer(numel, dtype)
    else:
        flat = torch.empty(numel, dtype=dtype, device=codes.device)
    out = flat.view(count, out_rows, cols)
    if codes.device.type == "cpu" and dtype in (storage, torch.float32) and use_native(storage):
        dequantize_blocks(codes, scales, weight.nf4, storage, flat)
    elif dtype == storage:
        dequantize_eager(codes, scales, weight.nf4, flat)
    else:
        tmp = torch.empty(flat.numel(), dtype=storage, device=codes.device)
        dequantize_eager(codes, scales, weight.nf4, tmp)
        flat.copy_(tmp)
    return out


EXPERT_CHUNK_BYTES = 64 << 20
"""The most dense expert weight dequantized at once: an NF4 projection's experts go through the grouped matmul in
chunks of this many bytes, each over its own experts' rows (gpt-oss-20b's 32 experts of 2880 x 2880 are 0.5 GiB in
bf16, which sat beside a step's peak; in 64 MiB chunks, 4 experts, its predicted peak is 0.44 GiB lower)."""


def expert_products(rows: torch.Tensor, weight: torch.Tensor, n_experts: int, experts: Optional[torch.Tensor],
                    kept: torch.Tensor, forward: bool) -> torch.Tensor:
    """Each row times its expert's NF4 weight, W_e^T (`forward`) or W_e (the input gradient): `rows` sorted by expert,
    kept[j] of them for the j-th of `experts` (every expert with None), dequantized EXPERT_CHUNK_BYTES at a time."""
    out_rows, cols = weight.size(0) // n_experts, weight.size(1)
    count = n_experts if experts is None else experts.numel()
    per_chunk = max(1, EXPERT_CHUNK_BYTES // (out_rows * cols * rows.element_size()))
    if count <= per_chunk:
        dense = dequantize_experts(weight, n_experts, experts, rows.dtype)
        return grouped_mm(rows, dense.transpose(1, 2) if forward else dense, group_offsets(kept))
    ids = torch.arange(n_experts, device=kept.device) if experts is None else experts
    # Each chunk's rows: one host sync for the boundaries (a dry run, whose counts have no values, splits evenly).
    ends = ([round(rows.size(0) * (j + 1) / count) for j in range(count)] if is_fake(kept)
            else kept.cumsum(0).tolist())
    out = rows.new_empty(rows.size(0), out_rows if forward else cols)
    for first in range(0, count, per_chunk):
        last = min(count, first + per_chunk)
        begin, end = (ends[first - 1] if first else 0), ends[last - 1]
        if end > begin:
            dense = dequantize_experts(weight, n_experts, ids[first:last], rows.dtype)
            out[begin:end] = grouped_mm(rows[begin:end], dense.transpose(1, 2) if forward else dense,
                                        group_offsets(kept[first:last]))
            del dense  # before the next chunk's: one chunk alive at a time
    return out


def keeps_expert_products(x: torch.Tensor) -> bool:
    """Whether a checkpointed block's recompute takes its expert projections' products from the first run (kept from
    forward to backward) rather than multiplying again: on the CPU, where the matmuls are the time (a third of a
    checkpointed MoE step's expert work) and the products' memory is plentiful; not on a GPU, where that memory
    (57 KB a token a layer for Qwen3-30B-A3B in bf16: 8 experts' gate, up and down outputs) is what is short."""
    return x.device.type == "cpu"


class _ExpertMatmul(torch.autograd.Function):
    """x @ W_e^T per expert's rows for a frozen stacked W (dense or NF4), plus LoRA's scale * x_lora A_e^T B_e^T where
    factors are given (x_lora: x, or its dropout). Backward dequantizes again rather than keeping the dense experts
    (their bf16 size would sit beside every block's activations); it keeps x_lora and the r-wide x_lora A_e^T."""

    @staticmethod
    def forward(ctx, x, weight, n_experts: int, counts: torch.Tensor, x_lora, lora_a, lora_b, scale: float):
        ctx.n_experts, ctx.scale, ctx.same_input = n_experts, scale, x_lora is x
        offsets = group_offsets(counts)
        nf4 = is_nf4(weight)
        # Only the experts that got rows are dequantized. A dry run on fake tensors cannot know which: it counts
        # them all, the most this can take. (A dense stack is used whole: empty groups cost nothing.)
        active = None if not nf4 or is_fake(counts) or bool((counts > 0).all()) else counts.nonzero().view(-1)
        kept = counts if active is None else counts.index_select(0, active)

        def products() -> tuple[torch.Tensor, Optional[torch.Tensor]]:
            if nf4:
                out = expert_products(x, weight, n_experts, active, kept, forward=True)
            else:
                out = grouped_mm(x, weight.detach().to(x.dtype).transpose(1, 2), offsets)
            if lora_a is None:
                return out, None
            # The scale goes on B (out x r per expert), not on the rows x out product, and the sum is in place: at
            # 8 experts a token these are the largest tensors of the block.
            down = grouped_mm(x_lora, lora_a.to(x.dtype).transpose(1, 2), offsets)
            out.add_(grouped_mm(down, (lora_b.to(x.dtype) * scale).transpose(1, 2), offsets))
            return out, down

        key = ("experts", id(weight), tuple(x.shape), lora_a is not None)
        out, down = first_run_value(key, products) if keeps_expert_products(x) else products()
        ctx.save_for_backward(weight, offsets, kept, active, x_lora if lora_a is not None else None, down,
                              lora_a, lora_b)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        weight, offsets, kept, active, x_lora, down, lora_a, lora_b = ctx.saved_tensors  # (unpacked once: a
        # checkpointed block's recompute allows no second unpack)
        needs = ctx.needs_input_grad
        if is_nf4(weight):
            grad_x = expert_products(grad, weight, ctx.n_experts, active, kept, forward=False)
        else:
            grad_x = grouped_mm(grad, weight.detach().to(grad.dtype), offsets)
        grad_x_lora = grad_a = grad_b = None
        if lora_a is not None:
            grad_down = grouped_mm(grad, lora_b.to(grad.dtype), offsets).mul_(ctx.scale)  # scale * grad B_e
            if needs[4] or (ctx.same_input and needs[0]):
                through_a = grouped_mm(grad_down, lora_a.to(grad.dtype), offsets)
                if ctx.same_input:
                    grad_x.add_(through_a)
                else:
                    grad_x_lora = through_a
            if needs[5]:
                grad_a = grouped_weight_grad(grad_down, x_lora, offsets).to(lora_a.dtype)
            if needs[6]:
                # as down_e^T grad_e, transposed after: the r-wide side is the one grouped_weight_grad lays out
                # again (the rows x out one took 9 ms a copy at 8192 x 512 fp32)
                grad_b = grouped_weight_grad(down, grad, offsets).transpose(1, 2).mul(ctx.scale).to(lora_b.dtype)
        return grad_x if needs[0] else None, None, None, None, grad_x_lora, grad_a, grad_b, None


class ExpertLinear(nn.Module):
    """One projection of every expert of a block, frozen: `forward(x, counts)` with x's rows sorted by expert,
    counts[e] of them for expert e, gives each row times its own expert's weight (one grouped matmul).

    `weight` is (n_experts, out, in), or NF4 (n_experts * out, in); `bias` (gpt-oss) (n_experts, out), or None."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, bias: bool = False, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features, device=device, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(n_experts, out_features, device=device, dtype=dtype),
                                  requires_grad=False) if bias else None)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, lora: Optional[tuple] = None) -> torch.Tensor:
        """`lora`: (x_lora, A, B, scale), the adapter term added (LoRAExpertLinear)."""
        out = _ExpertMatmul.apply(x, self.weight, self.n_experts, counts, *(lora or (None, None, None, 1.0)))
        if self.bias is not None:  # each row its expert's bias
            out = out + self.bias.to(out.dtype).repeat_interleave(counts, dim=0, output_size=x.size(0))
        return out

    def expert_weight(self, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s (out, in) weight in `dtype` (dequantized from NF4: only its rows' blocks and scales, so an
        export that asks for every expert in turn reads each block once)."""
        if is_nf4(self.weight):
            rows = self.out_features
            return dequantize_nf4(self.weight, dtype, rows=(expert * rows, (expert + 1) * rows))
        return self.weight.detach()[expert].to(dtype)

    def extra_repr(self) -> str:
        kind = "nf4" if is_nf4(self.weight) else str(self.weight.dtype).removeprefix("torch.")
        return f"{self.n_experts} experts, {self.in_features}, {self.out_features}, base={kind}"
