"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral, OLMoE): a router picks each token's top k experts, the tokens are
sorted by expert, and each projection runs as one grouped matmul over all experts (lit_qlora.nf4.grouped).

Module names follow transformers' (`mlp.gate` is the router, `mlp.experts.{gate,up,down}_proj` the stacked expert
weights); the checkpoint's per-expert tensors are stacked as they load and unstacked on export (hf_layout.py).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_qlora.model.config import Config
from lit_qlora.nf4.grouped import ExpertLinear


class Experts(nn.Module):
    """Every expert's gated MLP, stacked: down(act(gate(x)) * up(x)) with each row through its own expert."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        n, h, i, bias = config.n_experts, config.n_embd, config.moe_intermediate_size, config.expert_bias
        self.gate_proj = ExpertLinear(n, h, i, bias)
        self.up_proj = ExpertLinear(n, h, i, bias)
        self.down_proj = ExpertLinear(n, i, h, bias)
        self.act = partial(F.gelu, approximate="tanh") if config.mlp_activation == "gelu_tanh" else F.silu
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    def forward(self, x: torch.Tensor, counts: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
        """x: rows sorted by expert, counts[e] rows for expert e; each output row times its row_weights value."""
        gate, up = self.gate_proj(x, counts), self.up_proj(x, counts)
        if self.limit is not None:  # gpt-oss's clamped SwiGLU
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            hidden = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        else:
            hidden = self.act(gate) * up
        # Scaling before the projection equals scaling after it without a bias, and touches fewer values where the
        # experts are narrower than the model (OLMoE, Qwen3-MoE: 8 rows a token, forward and backward); a bias is
        # weighted too, so it scales after.
        if self.down_proj.bias is None and hidden.size(-1) < self.down_proj.out_features:
            return self.down_proj(hidden * row_weights[:, None], counts)
        return self.down_proj(hidden, counts) * row_weights[:, None]


class SparseMoE(nn.Module):
    """Routes each token to its top k experts and sums their outputs weighted by the router's probabilities."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.n_experts, self.top_k = config.n_experts, config.n_experts_per_token
        self.norm_topk_prob, self.topk_softmax = config.norm_topk_prob, config.router_topk_softmax
        self.gate = nn.Linear(config.n_embd, config.n_experts, bias=config.expert_bias)
        """The router: kept in high precision (never NF4) and frozen unless `router` is a LoRA target."""
        self.gate.keeps_precision = True
        self.experts = Experts(config)
        self.load: Optional[torch.Tensor] = None
        """Tokens routed to each expert in the last forward (n_experts,): the router's load, for logging."""
        self.router_logits: Optional[torch.Tensor] = None
        """The last training forward's router logits (tokens, n_experts) while the router trains: the auxiliary
        loss's input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        if self.topk_softmax:  # gpt-oss: the top k logits, then a softmax over those k
            weights, chosen = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(weights, dim=-1)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat = chosen.view(-1)
        order = torch.argsort(flat, stable=True)  # rows grouped by expert, tokens in order within each
        # (scatter_add, not bincount: its output shape is static, so `litqlora estimate` traces it on fake tensors)
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        token = order // self.top_k
        y = self.experts(x.index_select(0, token), counts, weights.view(-1).index_select(0, order))
        out = torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))
        self.load = counts.detach()
        trains = self.training and torch.is_grad_enabled() and any(p.requires_grad for p in self.gate.parameters())
        self.router_logits = logits if trains else None  # the auxiliary loss's input while the router trains
        return out.view(shape)


def load_balancing_loss(router_logits: list[torch.Tensor], n_experts: int, top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss over the layers' router logits: n_experts * sum_e f_e * P_e, f_e the
    share of top-k assignments expert e got and P_e its mean router probability (over all layers' tokens)."""
    assigned = torch.zeros(n_experts, dtype=torch.float32, device=router_logits[0].device)
    prob_sum = torch.zeros_like(assigned)
    rows = 0
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        assigned = assigned + torch.bincount(chosen.reshape(-1), minlength=n_experts).float()
        prob_sum = prob_sum + probs.sum(0)
        rows += logits.size(0)
    return (assigned / rows * (prob_sum / rows)).sum() * n_experts


def moe_blocks(model: nn.Module) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def auxiliary_loss(model: nn.Module) -> Optional[torch.Tensor]:
    """router_aux_loss_coef x the load-balancing loss of the last forward, while the router trains (else None):
    transformers adds it to the mean token loss the same way."""
    blocks = moe_blocks(model)
    logits = [b.router_logits for b in blocks if b.router_logits is not None]
    coef = getattr(getattr(model, "config", None), "router_aux_loss_coef", 0.0)
    if not logits or not coef:
        return None
    return coef * load_balancing_loss(logits, blocks[0].n_experts, blocks[0].top_k)


def router_load(counts: list[torch.Tensor]) -> dict[str, float]:
    """How evenly each layer's router spread its tokens: `router/max_load` and `router/min_load` over the layers (an
    expert's share of the layer's assignments times the number of experts: 1.0 is an even share, 0 an expert that
    got nothing), and each layer's max as `router/layer{i}_max_load`."""
    if not counts:
        return {}
    loads = [c.float() * c.numel() / c.sum().clamp(min=1) for c in counts]
    per_layer = {f"router/layer{i}_max_load": load.max().item() for i, load in enumerate(loads)}
    return {"router/max_load": max(per_layer.values()), "router/min_load": min(ld.min().item() for ld in loads),
            **per_layer}
