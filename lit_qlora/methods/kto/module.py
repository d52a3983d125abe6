"""`KTOModule`: `FinetuneModule`'s optimizer step, checkpoints and validation with KTO's loss.

A step first estimates the KL term over all of its micro-batches (no gradients: each prompt with another row's
completion, on the policy and on the reference), and the reference's log-probabilities of its rows; then each
micro-batch's rows go forward and backward with the step's estimate. The reference is the base with the adapters
off (or the --train.init_adapter adapter): no second copy of the weights (lit_qlora.train.policy)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from lit_qlora.methods.dpo.loss import sequence_logps
from lit_qlora.methods.kto.args import KTOArgs
from lit_qlora.methods.kto.loss import RowSums, kto_sums, step_metrics
from lit_qlora.train.module import FinetuneModule
from lit_qlora.train.policy import reference_policy

EVAL_PREFIX = "eval_"  # TRL's names for an evaluation's numbers


class KTOModule(FinetuneModule):
    def __init__(self, model, train, total_steps: int, start_step: int = 0, compile: bool = False, *, kto: KTOArgs,
                 start: Optional[dict[str, torch.Tensor]] = None) -> None:
        super().__init__(model, train, total_steps, start_step, compile=compile)
        self.kto, self.start = kto, start
        self._val: list[tuple[RowSums, torch.Tensor]] = []

    def _logps(self, batch: dict[str, Any]) -> torch.Tensor:
        return sequence_logps(self.model, batch, len(batch["index"]))[0]

    def kl_and_reference(self, micro_batches: list[dict[str, Any]], over_ranks: bool = True
                         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The KL estimate z0 over the micro-batches' mismatched rows (and every rank's: `over_ranks`), detached and
        clamped at 0, and each micro-batch's reference log-probabilities of its rows."""
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)
        references = []
        for mb in micro_batches:
            with torch.no_grad():  # the policy as it trains (dropout on), as TRL computes it
                policy_kl = self._logps(mb["kl"])
            with reference_policy(self.model, self.start):
                reference_kl = self._logps(mb["kl"])
                references.append(self._logps(mb))
            totals += torch.stack([(policy_kl - reference_kl).double().sum(),
                                   torch.tensor(float(len(mb["index"])), device=self.device, dtype=torch.float64)])
        totals = self.sum_over_data(totals) if over_ranks else totals
        return (totals[0] / totals[1].clamp(min=1)).clamp(min=0).float(), references

    def accumulate_gradients(self, micro_batches: list[dict[str, Any]]) -> torch.Tensor:
        kl, references = self.kl_and_reference(micro_batches)
        rows = self.sum_over_data(torch.tensor(float(sum(len(mb["index"]) for mb in micro_batches)),
                                               device=self.device, dtype=torch.float64))

        def loss_of(part: tuple[dict[str, Any], torch.Tensor]) -> tuple[torch.Tensor, RowSums]:
            mb, reference = part
            sums = kto_sums(self.kto, self._logps(mb), reference, mb["label"], kl)
            self.count_routed_tokens()  # a mixture of experts' router load (FinetuneModule)
            return sums.loss / rows, sums

        kept = self.backward_each(list(zip(micro_batches, references)), loss_of,
                                  router_aux_weight=1 / len(micro_batches))
        loss, self.extra_metrics = self.reduce(kept, kl)
        return loss

    def reduce(self, sums: list[RowSums], kl: torch.Tensor, prefix: str = "") -> tuple[torch.Tensor, dict[str, float]]:
        """The loss (mean over rows) and TRL's metrics of `sums` (micro-batches), over every rank."""
        names = sorted(sums[0].metrics) if sums else []
        stacked = torch.stack([torch.stack([s.loss.detach().double(), *(s.metrics[n].double() for n in names)])
                               for s in sums]).sum(0)
        totals = self.sum_over_data(stacked)
        by_name = {n: totals[1 + i].item() for i, n in enumerate(names)}
        rows = by_name["count/chosen"] + by_name["count/rejected"]
        metrics = step_metrics(by_name, float(kl))
        return (totals[0] / max(rows, 1)).float(), {f"{prefix}{k}": v for k, v in metrics.items()}

    def on_validation_epoch_start(self) -> None:
        self._val = []

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # each validation batch's own estimate, as TRL's (this rank's: a validation step runs no collective)
        kl, (reference,) = self.kl_and_reference([batch], over_ranks=False)
        sums = kto_sums(self.kto, self._logps(batch), reference, batch["label"], kl)
        self._val.append((RowSums(sums.loss.detach(), sums.metrics), kl))

    def reduced_val_loss(self) -> float:
        kls = torch.stack([kl for _, kl in self._val]) if self._val else torch.zeros(1)
        loss, self.val_metrics = self.reduce([s for s, _ in self._val], kls.mean(), EVAL_PREFIX)
        return loss.item()

    def validation_scalars(self) -> dict[str, float]:
        return {**super().validation_scalars(),
                **{f"eval/{k[len(EVAL_PREFIX):]}": v for k, v in self.val_metrics.items()}}
