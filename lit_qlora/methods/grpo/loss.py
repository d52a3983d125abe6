"""GRPO's objective from the papers' formulas (Shao et al. 2024, DeepSeekMath; DAPO, Yu et al. 2025; Dr. GRPO, Liu et
al. 2025), with TRL's names for the settings and metrics.

For completion i of a group and its token t:
- advantage A_i = (r_i - mean(r of the group)) / (std(r of the group) + 1e-4) (scale_rewards group; batch: the
  std of every reward of the step; none: not divided), r_i the weighted sum of the reward functions (None counts 0);
- ratio rho_it = exp(log pi(y_it) - log pi_old(y_it)), pi_old the policy that sampled it (rho = 1 exactly when each
  batch of rollouts trains one step);
- loss l_it = -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) + beta * KL_it, with the KL estimator
  KL_it = exp(ref - logp) - (ref - logp) - 1 to the reference policy (Schulman's k3, as the paper uses).

The step's loss averages l over completion tokens as --grpo.loss_type says. Each micro-batch's part is computed so
that the parts of every micro-batch on every rank sum to the step's loss: an accumulated or distributed step is one
large batch, as for `finetune`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-4  # added to a standard deviation before dividing (TRL's)


def advantages(rewards: torch.Tensor, group: int, scale: str, batch_std: torch.Tensor | None = None) -> torch.Tensor:
    """Per completion (N,), groups of `group` consecutive completions. `batch_std`: for scale batch, the standard
    deviation of the whole step's rewards (every rank's); by default these rewards'."""
    grouped = rewards.view(-1, group)
    centered = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
    if scale == "group":
        return centered / (grouped.std(1).repeat_interleave(group) + STD_EPS)
    if scale == "batch":
        return centered / ((rewards.std() if batch_std is None else batch_std) + STD_EPS)
    return centered


@dataclass
class TokenTerms:
    """A micro-batch's per-token loss and what the metrics count, each (rows, tokens), zero where `mask` is."""

    loss: torch.Tensor  # carries gradients
    kl: torch.Tensor  # detached; zeros when beta is 0
    low_clipped: torch.Tensor  # bool: the ratio fell below 1 - epsilon on a negative advantage
    high_clipped: torch.Tensor  # bool: it rose above 1 + epsilon_high on a positive advantage


def token_terms(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None, adv: torch.Tensor,
                mask: torch.Tensor, epsilon: float, epsilon_high: float, beta: float) -> TokenTerms:
    """Per-token GRPO loss of (rows, tokens) log-probabilities: the policy's (with gradients), the sampling policy's
    and the reference's (None when beta is 0); `adv` (rows,); `mask` (rows, tokens) marks completion tokens."""
    ratio = torch.exp(logps - old_logps)
    a = adv[:, None]
    loss = -torch.min(ratio * a, ratio.clamp(1 - epsilon, 1 + epsilon_high) * a)
    kl = torch.zeros_like(logps)
    if beta:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + beta * kl
    mask_f = mask.to(loss.dtype)
    return TokenTerms(loss * mask_f, kl.detach() * mask_f, (ratio < 1 - epsilon) & (a < 0) & mask,
                      (ratio > 1 + epsilon_high) & (a > 0) & mask)


@dataclass(frozen=True)
class StepCounts:
    """What a step's loss is divided by, over every rank and micro-batch."""

    completions: float
    tokens: float  # completion tokens
    micro_batches: float
    max_completion_length: int


def micro_loss(terms: TokenTerms, mask: torch.Tensor, loss_type: str, counts: StepCounts) -> torch.Tensor:
    """This micro-batch's part of the step's loss: the parts of all micro-batches on all ranks sum to it."""
    per_row = terms.loss.sum(1)
    if loss_type == "grpo":  # each completion's token mean, then the mean over the step's completions
        return (per_row / mask.sum(1).clamp(min=1)).sum() / counts.completions
    if loss_type == "bnpo":  # this micro-batch's token mean, then the mean over micro-batches
        return per_row.sum() / mask.sum().clamp(min=1) / counts.micro_batches
    if loss_type == "dr_grpo":  # a constant normalizer: rows x the longest a completion may be
        return per_row.sum() / (mask.size(0) * counts.max_completion_length) / counts.micro_batches
    if loss_type == "dapo":
        return per_row.sum() / counts.tokens
    raise ValueError(f"unknown loss_type {loss_type!r}")
