"""LoRA: `LoRALinear` over a frozen base (bf16 or NF4), applied to a model's linears and merged back a block of rows
at a time. Its files on disk: lit_qlora.checkpoint.adapter."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.nn as nn

from lit_qlora.base.errors import InvalidInput
from lit_qlora.lora import dropout as lora_dropout
from lit_qlora.lora.dropout import dropped_lora
from lit_qlora.nf4 import dequantize_nf4, frozen_linear, is_nf4, row_slices
from lit_qlora.lora.experts import LoRAExpertLinear
from lit_qlora.lora.rank import set_rank
from lit_qlora.nf4.grouped import ExpertLinear

# Short target names -> module name suffixes in our (= Hugging Face) naming.
TARGETS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "experts": ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj"),
    "router": "mlp.gate",
    "lm_head": "lm_head",
}
NOT_IN_ALL = ("router",)
"""Targets `all` leaves out: a mixture of experts' router trains only when named (its aux loss then joins in)."""
# Merged exports are computed this many values at a time: 16 MB per fp32 temporary, whatever the weight's size.
MERGE_CHUNK_ELEMS = 1 << 22


class LoRALinear(nn.Linear):
    """y = x W^T + b + scale * dropout(x) A^T B^T, with W frozen (bf16 or NF4) and A, B trained.

    A starts Kaiming-uniform and B at zero, so a fresh adapter leaves the model unchanged. `scale` is alpha / r,
    or alpha / sqrt(r) with rsLoRA (stable updates at large ranks).
    """

    fusable = True
    """Attention and MLP may run this layer's base in one matmul with its neighbours' (`fused_projections`), adding
    this adapter's own term to its slice: what `forward` computes."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, rslora: bool = False,
                 dtype: Optional[torch.dtype] = None) -> None:
        nn.Module.__init__(self)
        dtype = set_rank(self, r, alpha, rslora, base.weight, dtype)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, r, device=device, dtype=dtype))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if device.type != "meta":
            self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = frozen_linear(x, self.weight, self.bias)
        if self.scale == 0:  # adapters_disabled (a DPO reference pass): out + 0 is out, without the adapter's matmuls
            return out
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        if self.training and isinstance(self.lora_dropout, nn.Dropout):
            if lora_dropout.hash_dropout_applies(x):
                return out + dropped_lora(x, a, b, self.scale, self.lora_dropout.p)  # no per-element RNG, no mask kept
            if lora_dropout.replayed_dropout_applies(x):  # the mask is drawn again in backward, not kept
                return lora_dropout.replayed_lora(x, out, a, b, self.scale, self.lora_dropout.p)
        return out + (self.lora_dropout(x) @ a.T @ b.T) * self.scale

    def lora_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, A) as the tensors this process holds (a tensor-parallel layer: its local parts)."""
        return self.lora_B, self.lora_A

    def delta_weight(self, rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """scale * B @ A in fp32 (only its rows start:stop when given): what merging adds to the base weight."""
        b, a = self.lora_factors()
        if rows is not None:
            b = b[rows[0] : rows[1]]
        return (b.float() @ a.float()).mul_(self.scale)  # in place: one fp32 temporary fewer

    def base_weight(self, dtype: torch.dtype = torch.float32, rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """The weight the adapter trained against: dequant(NF4(W)) for an NF4 base, W otherwise."""
        return weight_rows(self.weight, dtype, rows)

    @torch.no_grad()
    def merged_weight(self, dtype: torch.dtype = torch.bfloat16,
                      rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """dequant(W) + scale * B @ A, summed in fp32 and cast to `dtype` (only rows start:stop when given)."""
        merged = self.delta_weight(rows)
        merged += self.base_weight(torch.float32, rows)  # in place, into the fresh delta: one fp32 temporary fewer
        return merged.to(dtype)

    def merged_chunks(self, dtype: torch.dtype = torch.bfloat16) -> Iterator[torch.Tensor]:
        """The merged weight as consecutive row blocks of at most MERGE_CHUNK_ELEMS values: a streaming export
        writes each and drops it, so the whole high-precision weight never exists (a 32000x2048 head merged whole
        held ~760 MiB of fp32 temporaries, issue 16)."""
        return row_chunks(self.weight, lambda rows: self.merged_weight(dtype, rows))

    def extra_repr(self) -> str:
        kind = "nf4" if is_nf4(self.weight) else str(self.weight.dtype).removeprefix("torch.")
        return f"{self.in_features}, {self.out_features}, base={kind}, r={self.r}, alpha={self.alpha}"


def weight_rows(weight: torch.Tensor, dtype: torch.dtype, rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """A frozen weight in `dtype`, dequantized if NF4 (only rows start:stop when given: on NF4 block boundaries)."""
    if is_nf4(weight):
        return dequantize_nf4(weight, rows=rows).to(dtype)
    weight = weight.detach()
    return (weight if rows is None else weight[rows[0] : rows[1]]).to(dtype)


def row_chunks(weight: torch.Tensor,
               make: Callable[[Optional[tuple[int, int]]], torch.Tensor]) -> Iterator[torch.Tensor]:
    """`make(rows)` for consecutive row ranges of `weight` of at most MERGE_CHUNK_ELEMS values (NF4: on block
    boundaries); `make(None)` once for a small weight. Each block is dropped before the next is made."""
    slices = row_slices(weight, MERGE_CHUNK_ELEMS)
    for rows in slices:
        chunk = make(None if len(slices) == 1 else rows)
        yield chunk
        del chunk  # while suspended the frame would keep it alive next to the following block


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, every LoRA layer computes its base alone (scale 0: out + 0 is exactly out), e.g. to show what the
    model answered before fine-tuning without loading it twice."""
    layers = list(lora_modules(model).values())
    scales = [layer.scale for layer in layers]
    for layer in layers:
        layer.scale = 0.0
    try:
        yield
    finally:
        for layer, scale in zip(layers, scales):
            layer.scale = scale


def resolve_targets(targets: Iterable[str] | str, tied_head: bool = False, experts: bool = True) -> list[str]:
    """The targets `targets` names, in canonical order. `all` leaves out a head tied to the embedding (`tied_head`):
    adapting it would untie it in every export (a larger file, `tie_word_embeddings` false, peft's warning); naming
    lm_head adapts it anyway."""
    names = [targets] if isinstance(targets, str) else list(targets)
    if "all" in names:  # (a model without experts, `experts` false: none to name)
        left_out = set(NOT_IN_ALL) | ({"lm_head"} if tied_head else set()) | (set() if experts else {"experts"})
        return [t for t in TARGETS if t not in left_out or t in names]
    unknown = [t for t in names if t not in TARGETS]
    if unknown:
        raise InvalidInput(f"Unknown LoRA target(s) {unknown} (--lora.targets): choose from {', '.join(TARGETS)} or "
                           "'all'.")
    if not names:
        raise InvalidInput("LoRA needs at least one target (--lora.targets): choose from " + ", ".join(TARGETS)
                           + " or 'all'.")
    return [t for t in TARGETS if t in names]  # canonical order


def tied_head_note(targets: Iterable[str] | str, tied_head: bool, experts: bool = False) -> Optional[str]:
    """What a run says about a head tied to the embedding: left out by `all` (and how to adapt it), or adapted by
    name (and what that does to the exports); None for an untied head. `experts`: the model has experts."""
    if not tied_head:
        return None
    resolved = resolve_targets(targets, tied_head, experts)
    if "lm_head" not in resolved:
        return (f"LoRA targets: {', '.join(resolved)} (lm_head is tied to the embedding, "
                "so `all` leaves it out and every export keeps it tied; to adapt it anyway, name it: --lora.targets "
                "'[all, lm_head]', which unties it in the exports)")
    return ("LoRA targets include lm_head, which is tied to the embedding: the merged, PEFT and GGUF exports untie it "
            "(the head is written apart from the embedding, and the files grow by its size)")


def apply_lora(model: nn.Module, r: int, alpha: float, dropout: float = 0.0, targets: Iterable[str] | str = "all",
               rslora: bool = False, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Wrap every targeted linear of `model` in a LoRALinear (in place), freeze everything else. `all` leaves out a
    head tied to the embedding (resolve_targets)."""
    suffixes = tuple(s for t in resolve_targets(targets, tied_head(model))
                     for s in (TARGETS[t] if isinstance(TARGETS[t], tuple) else (TARGETS[t],)))
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in list(model.named_modules()):
        if not name.endswith(suffixes) or isinstance(module, (LoRALinear, LoRAExpertLinear)):
            continue
        if isinstance(module, nn.Linear):
            wrapped = LoRALinear(module, r, alpha, dropout, rslora, dtype)
            wrapped.keeps_precision = getattr(module, "keeps_precision", False)  # a router stays out of NF4
        elif isinstance(module, ExpertLinear):
            wrapped = LoRAExpertLinear(module, r, alpha, dropout, rslora, dtype)
        else:
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, wrapped)
    return model


def tied_head(model: nn.Module) -> bool:
    """Whether `model`'s checkpoint ties its head to the embedding (config.tie_embeddings: the head reads the
    embedding's weight, in QLoRA too)."""
    return bool(getattr(getattr(model, "config", None), "tie_embeddings", False))


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every adapted layer: LoRALinear, and a mixture of experts' LoRAExpertLinear (the same lora_A, lora_B, scale,
    r and alpha, stacked per expert)."""
    # Adapter names are the model's own: a module wrapped by `fabric.setup` would otherwise prefix them all with
    # "_forward_module." and the file would fit no other model.
    model = getattr(model, "_original_module", model)
    return {n: m for n, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAExpertLinear))}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors by name; under FSDP2 they are DTensor shards (see `full_lora_state_dict`)."""
    return {f"{n}.{p}": getattr(m, p).detach() for n, m in lora_modules(model).items() for p in ("lora_A", "lora_B")}
