"""LoRA on a mixture of experts' projections: every expert has its own A and B, stacked as the base is, and the
adapter term runs as two grouped matmuls over the tokens routed to each expert (no call per expert), inside the base
projection's autograd function (lit_qlora.nf4.grouped._ExpertMatmul)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from lit_qlora.lora.rank import set_rank
from lit_qlora.nf4.grouped import ExpertLinear


class LoRAExpertLinear(ExpertLinear):
    """y_e = x W_e^T + scale * dropout(x) A_e^T B_e^T for each expert e, W frozen (bf16 or NF4), A (n_experts, r, in)
    and B (n_experts, out, r) trained. A starts Kaiming-uniform per expert and B at zero: a fresh adapter changes
    nothing."""

    def __init__(self, base: ExpertLinear, r: int, alpha: float, dropout: float = 0.0, rslora: bool = False,
                 dtype: Optional[torch.dtype] = None) -> None:
        nn.Module.__init__(self)
        dtype = set_rank(self, r, alpha, rslora, base.weight, dtype)
        self.n_experts, self.in_features, self.out_features = base.n_experts, base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        device = self.weight.device
        self.lora_A = nn.Parameter(torch.empty(self.n_experts, r, self.in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(self.n_experts, self.out_features, r, device=device, dtype=dtype))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if device.type != "meta":
            self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        for a in self.lora_A:  # per expert, as nn.Linear-shaped A's are initialized
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.scale == 0:  # adapters_disabled
            return super().forward(x, counts)
        return super().forward(x, counts, lora=(self.lora_dropout(x), self.lora_A, self.lora_B, self.scale))

    def delta_weight(self, expert: int) -> torch.Tensor:
        """scale * B_e @ A_e in fp32: what merging adds to expert `expert`'s weight."""
        return (self.lora_B[expert].float() @ self.lora_A[expert].float()).mul_(self.scale)

    @torch.no_grad()
    def merged_expert(self, expert: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """dequant(W_e) + scale * B_e @ A_e, summed in fp32 and cast to `dtype`."""
        merged = self.delta_weight(expert)
        merged += self.expert_weight(expert, torch.float32)
        return merged.to(dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, alpha={self.alpha}"


def expert_tensor(module: ExpertLinear, expert: int, dtype: torch.dtype, merge: bool) -> torch.Tensor:
    """Expert `expert`'s (out, in) weight, merged with its adapter where `merge` and it has one: what a Hugging Face
    file stores per expert (an export makes them one at a time)."""
    if merge and isinstance(module, LoRAExpertLinear):
        return module.merged_expert(expert, dtype)
    return module.expert_weight(expert, dtype)
