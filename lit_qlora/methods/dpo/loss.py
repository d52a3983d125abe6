"""The preference objectives of `litqlora dpo` and their metrics, from the papers' formulas:

- sigmoid (DPO, Rafailov et al. 2023): -log sigmoid(beta * h), h = (log pi(y_w) - log pi(y_l)) - (log ref(y_w) -
  log ref(y_l)) over each answer's summed token log-probabilities; with label smoothing e (conservative DPO), the
  loss is -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h).
- ipo (Azar et al. 2023): (h - 1 / (2 beta))^2, with h over each answer's mean token log-probability (as TRL does).
- orpo (Hong et al. 2024, reference-free): the chosen answer's token-mean negative log-likelihood plus
  lambda * -log sigmoid(log odds(y_w) - log odds(y_l)), odds(y) = p / (1 - p) with p = exp(mean token log-prob).

Rewards are TRL's: beta * (log pi - log ref) for sigmoid and ipo (on the log-probabilities the loss uses), beta *
mean token log-prob for orpo. A step's metrics are sums over pairs (`PairSums`), reduced over ranks and micro-batches
before they are divided, so an accumulated or distributed step reports what one large batch would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from lit_qlora.methods.dpo.args import DPO_LOSSES, METRICS, ORPO_METRICS, DPOArgs
from lit_qlora.train.policy import token_logps




@dataclass(frozen=True)
class Objective:
    """A run's preference loss (`--dpo.*`)."""

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    orpo_lambda: float = 0.1

    @classmethod
    def from_args(cls, dpo: DPOArgs) -> Objective:
        """The run's objective from `--dpo.*` (the one translation of those settings into it)."""
        return cls(dpo.loss, dpo.beta, dpo.label_smoothing, dpo.orpo_lambda)

    @property
    def uses_reference(self) -> bool:
        return DPO_LOSSES[self.loss].uses_reference

    @property
    def mean_logps(self) -> bool:
        """IPO and ORPO compare each answer's mean token log-probability, DPO its sum."""
        return DPO_LOSSES[self.loss].mean_logps

    @property
    def metric_names(self) -> tuple[str, ...]:
        return METRICS + (ORPO_METRICS if self.loss == "orpo" else ())


def answer_logps(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per answer of a PairCollate batch (B pairs: chosen answers 0..B-1, rejected B..2B-1): the summed
    log-probability (fp32) of its trained tokens, and how many there are. One forward of the B rows (each prompt once,
    its two answers as branches)."""
    return sequence_logps(model, batch, 2 * batch["index"].numel())


def sequence_logps(model, batch: dict[str, torch.Tensor], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence 0..count-1 of a batch laid out as PairCollate lays it (`src`, `tgt`, `seq`): the summed
    log-probability (fp32) of its trained tokens, and how many there are. One forward; only the trained tokens'
    hidden states go through the head, a chunk at a time."""
    hidden = model.forward_hidden(batch["input_ids"], positions=batch.get("positions"))
    hidden = hidden.reshape(-1, hidden.size(-1))[batch["src"]]
    logps = token_logps(model, hidden, batch["tgt"])
    zeros = torch.zeros(count, device=hidden.device, dtype=torch.float32)
    return zeros.index_add(0, batch["seq"], logps), zeros.index_add(0, batch["seq"], torch.ones_like(logps))


@dataclass
class PairSums:
    """A micro-batch's loss terms and metric sums (tensors; the loss terms carry gradients)."""

    pair_loss: torch.Tensor  # summed over pairs: divide by the global pair count
    nll_sum: torch.Tensor  # orpo: the chosen answers' summed token NLL, divide by the global chosen token count
    chosen_tokens: torch.Tensor
    pairs: int
    metrics: dict[str, torch.Tensor]  # summed over pairs, detached


def pair_sums(objective: Objective, logps: torch.Tensor, counts: torch.Tensor,
              reference: Optional[torch.Tensor]) -> PairSums:
    """The loss terms and metrics of a micro-batch of B pairs: `logps` and `counts` (2B,) are the policy's summed
    answer log-probabilities and answer lengths, chosen rows first; `reference` (2B,) the reference's sums (None
    for orpo)."""
    pairs = logps.size(0) // 2
    counts = counts.clamp(min=1)
    chosen, rejected = logps[:pairs], logps[pairs:]
    if objective.mean_logps:
        chosen, rejected = chosen / counts[:pairs], rejected / counts[pairs:]
    beta, metrics = objective.beta, {}
    nll_sum = logps.new_zeros(())
    if objective.loss == "orpo":
        # log(1 - p) = log(-expm1(log p)): exact where p is near 1, where log1p(-exp) loses digits
        log_odds = (chosen - rejected) - (torch.log(-torch.expm1(chosen)) - torch.log(-torch.expm1(rejected)))
        ratio = F.logsigmoid(log_odds)
        losses = -objective.orpo_lambda * ratio
        nll_sum = -logps[:pairs].sum()
        reward_chosen, reward_rejected = beta * chosen.detach(), beta * rejected.detach()
        metrics["log_odds_ratio"] = ratio.detach().sum()
    else:
        ref = reference / counts if objective.mean_logps else reference
        ref_chosen, ref_rejected = ref[:pairs], ref[pairs:]
        h = (chosen - rejected) - (ref_chosen - ref_rejected)
        if objective.loss == "ipo":
            losses = (h - 1 / (2 * beta)) ** 2
        else:
            eps = objective.label_smoothing
            losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
        reward_chosen = beta * (chosen - ref_chosen).detach()
        reward_rejected = beta * (rejected - ref_rejected).detach()
    metrics.update({
        "rewards/chosen": reward_chosen.sum(), "rewards/rejected": reward_rejected.sum(),
        "rewards/accuracies": (reward_chosen > reward_rejected).float().sum(),
        "rewards/margins": (reward_chosen - reward_rejected).sum(),
        "logps/chosen": chosen.detach().sum(), "logps/rejected": rejected.detach().sum(),
        "logps/accuracies": (chosen > rejected).float().sum(),
    })
    return PairSums(losses.sum(), nll_sum, counts[:pairs].sum(), pairs, metrics)
