"""KTO's loss (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eq. 8) and TRL's
metrics, on each completion's summed token log-probabilities:

    r(x, y) = log pi(y|x) - log ref(y|x)                     (the implied reward, over beta)
    z0 = max(0, mean over mismatched pairs (x_i, y_j) of r)   (the KL estimate: no gradient flows through it)
    desirable:   L = w_d * (1 - sigmoid(beta * (r - z0)))
    undesirable: L = w_u * (1 - sigmoid(beta * (z0 - r)))

The step's loss is the mean of L over its rows (all ranks and micro-batches; TRL's `losses.nanmean()` over one
batch). z0 is the mean over the step's KL rows, all ranks (TRL's: gathered over the processes of one batch), so an
accumulated step equals one large batch. Rewards are beta * r, as TRL logs them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lit_qlora.methods.kto.args import KTOArgs


@dataclass
class RowSums:
    """A micro-batch's loss sum (carrying gradients) and metric sums (detached), to divide once reduced."""

    loss: torch.Tensor  # summed over rows: divide by the step's row count
    metrics: dict[str, torch.Tensor]  # rewards/chosen, ... summed over their rows; count/chosen, count/rejected


def kto_sums(kto: KTOArgs, logps: torch.Tensor, reference: torch.Tensor, desirable: torch.Tensor,
             kl: torch.Tensor) -> RowSums:
    """`logps` and `reference` (B,): the policy's and the reference's summed completion log-probabilities; `desirable`
    (B,) bool; `kl` the step's estimate z0 (a detached scalar, clamped at 0)."""
    reward = logps - reference
    good = desirable.to(logps.dtype)
    losses = good * kto.desirable_weight * (1 - torch.sigmoid(kto.beta * (reward - kl))) \
        + (1 - good) * kto.undesirable_weight * (1 - torch.sigmoid(kto.beta * (kl - reward)))
    rewards, lp = kto.beta * reward.detach(), logps.detach()
    metrics = {"rewards/chosen": (rewards * good).sum(), "rewards/rejected": (rewards * (1 - good)).sum(),
               "logps/chosen": (lp * good).sum(), "logps/rejected": (lp * (1 - good)).sum(),
               "count/chosen": good.sum(), "count/rejected": (1 - good).sum()}
    return RowSums(losses.sum(), metrics)


def step_metrics(totals: dict[str, float], kl: float) -> dict[str, float]:
    """TRL's logged numbers from the step's (or validation's) sums over every rank: each kind's mean reward and
    log-probability, the margin between them, the KL estimate and the counts."""
    chosen, rejected = totals["count/chosen"], totals["count/rejected"]
    out = {"count/chosen": chosen, "count/rejected": rejected, "kl": kl}
    for kind, n in (("chosen", chosen), ("rejected", rejected)):
        if n:  # (a step without rows of a kind has no mean for it: left out, as TRL leaves it)
            for what in ("rewards", "logps"):
                out[f"{what}/{kind}"] = totals[f"{what}/{kind}"] / n
    if chosen and rejected:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out
