"""`PreferenceModule`: `FinetuneModule`'s optimizer step, checkpoints and validation with a preference loss.

A micro-batch of B pairs is one forward of B rows (each prompt once, its chosen and rejected answers as branches).
The step's loss is the mean over the global batch's pairs (ORPO adds the chosen answers' NLL, token-weighted over the
global batch), so an accumulated or distributed step equals one large batch, as for `finetune`."""

from __future__ import annotations

from typing import Any, Optional

import torch

from lit_qlora.methods.dpo.loss import Objective, PairSums, answer_logps, pair_sums
from lit_qlora.methods.dpo.reference import Reference
from lit_qlora.train.module import FinetuneModule

# The validation's names: TRL's, as its Trainer logs an evaluation (eval_ + the training name).
EVAL_PREFIX = "eval_"


def chosen_tokens(batch: dict[str, Any]) -> int:
    """Trained tokens of a batch's chosen answers (answers 0..B-1)."""
    return int((batch["seq"] < len(batch["index"])).sum())


class PreferenceModule(FinetuneModule):
    """`objective`: the loss (`--dpo.*`); `reference`: where the reference log-probabilities come from (None for
    ORPO, which has none). Each step's metrics (TRL's names: rewards/chosen, ...) go into its metrics.jsonl row and
    the loggers' train/ section; a validation's into `val_metrics` (eval_rewards/chosen, ...) and eval/."""

    def __init__(self, model, train, total_steps: int, start_step: int = 0, compile: bool = False, *,
                 objective: Objective, reference: Optional[Reference]) -> None:
        super().__init__(model, train, total_steps, start_step, compile=compile)
        self.objective, self.reference = objective, reference
        self._val_sums: list[PairSums] = []

    def micro_sums(self, batch: dict[str, Any], split: str) -> PairSums:
        """The loss terms and metric sums of a micro-batch (PairCollate's layout), its reference first."""
        ref = self.reference.logps(self, batch, split) if self.objective.uses_reference else None
        logps, counts = answer_logps(self.model, batch)
        return pair_sums(self.objective, logps, counts, ref)

    def accumulate_gradients(self, micro_batches: list[dict[str, Any]]) -> torch.Tensor:
        pairs = self.sum_over_data(self._scalar(sum(len(mb["index"]) for mb in micro_batches)))
        tokens = self.sum_over_data(self._scalar(sum(chosen_tokens(mb) for mb in micro_batches))).clamp(min=1)

        def loss_of(mb: dict[str, Any]) -> tuple[torch.Tensor, PairSums]:
            sums = self.micro_sums(mb, "train")
            self.count_routed_tokens()  # a mixture of experts' router load (FinetuneModule)
            return sums.pair_loss / pairs + sums.nll_sum / tokens, sums

        step_sums = self.backward_each(micro_batches, loss_of, router_aux_weight=1 / len(micro_batches))
        loss, self.extra_metrics = self.reduce(step_sums)
        return loss

    def _scalar(self, value: float) -> torch.Tensor:
        return torch.tensor(float(value), device=self.device, dtype=torch.float64)

    def reduce(self, sums: list[PairSums], prefix: str = "") -> tuple[torch.Tensor, dict[str, float]]:
        """The loss and the metrics of `sums` (micro-batches), over every rank: (tensor, {name: value})."""
        names = [n for n in self.objective.metric_names if n != "nll_loss"]
        rows = [torch.stack([s.pair_loss.detach().double(), s.nll_sum.detach().double(), s.chosen_tokens.double(),
                             self._scalar(s.pairs), *(s.metrics[n].double() for n in names)]) for s in sums]
        totals = self.sum_over_data(torch.stack(rows).sum(0) if rows else self._scalar(0).repeat(4 + len(names)))
        pairs, tokens = totals[3].clamp(min=1), totals[2].clamp(min=1)
        loss = (totals[0] / pairs + totals[1] / tokens).float()
        metrics = {f"{prefix}{n}": (totals[4 + i] / pairs).item() for i, n in enumerate(names)}
        if self.objective.loss == "orpo":
            metrics[f"{prefix}nll_loss"] = (totals[1] / tokens).item()
        return loss, metrics

    def on_validation_epoch_start(self) -> None:
        self._val_sums = []

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        sums = self.micro_sums(batch, "val")
        self._val_sums.append(PairSums(sums.pair_loss.detach(), sums.nll_sum.detach(), sums.chosen_tokens, sums.pairs,
                                       sums.metrics))

    def reduced_val_loss(self) -> float:
        loss, self.val_metrics = self.reduce(self._val_sums, EVAL_PREFIX)
        return loss.item()

    def validation_scalars(self) -> dict[str, float]:
        return {**super().validation_scalars(),
                **{f"eval/{k[len(EVAL_PREFIX):]}": v for k, v in self.val_metrics.items()}}
