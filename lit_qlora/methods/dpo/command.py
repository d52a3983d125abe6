"""`litqlora dpo`: preference tuning (DPO, IPO, ORPO) of a LoRA adapter on the frozen NF4 (or bf16) base, with
`finetune`'s run: the same checks, Trainer, checkpoints, resume, validation, loggers and final/ exports
(lit_qlora.train), given this package's data module and LightningModule by its method object, `DPO`.

Light at import, as `finetune` is: the CLI reads the signature for `--help`."""

from __future__ import annotations

from typing import Any, Optional

from lit_qlora.methods.dpo.args import METRICS, ORPO_METRICS, DPOSpec
from lit_qlora.train.method import Method, TracedStep


def dpo(spec: Optional[DPOSpec] = None, **settings: Any) -> dict[str, Any]:
    """Preference-tune a LoRA adapter (DPO, IPO or ORPO) on a frozen base, NF4 by default: rows of a prompt, a chosen
    and a rejected answer. The reference model is the same base with the adapters off (or, with
    --train.init_adapter, the adapter the run starts from): no second copy of the weights. Metrics under TRL's names
    (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected; eval_...
    for validation) in metrics.jsonl, the loggers and summary.json.

    Args:
        spec: The run's settings (lit_qlora.methods.dpo.args.DPOSpec: `litqlora finetune`'s, with preference pairs
            for data and --dpo.*), or its fields as keywords.
    """
    from lit_qlora.train.finetune import run_method

    return run_method(DPO(DPOSpec.of(spec, settings)))


class DPO(Method):
    """Preference pairs (DPO, IPO, ORPO): a prompt, a chosen and a rejected answer, both answers in one forward."""

    name = verb = section = "dpo"
    command = staticmethod(dpo)
    spec_class = DPOSpec
    rows_per_sample = 2
    batch_unit = "pairs"
    demo_data = "PREFERENCE_DEMO_DATASET"
    metric_names = METRICS + ORPO_METRICS
    refusals = {
        "strategy tp": "tensor parallelism is finetune's.",
        "packing": "packing puts several samples into one sequence, and a preference pair is scored as a whole (its "
                   "chosen and rejected answers side by side in one batch): leave packing out.",
    }

    def check_section(self) -> None:
        self.settings.require_valid()

    def describe(self) -> str:
        """What the run optimizes and against which reference, in a line."""
        dpo, init_adapter = self.settings, self.spec.train.init_adapter
        if not dpo.kind.uses_reference:
            return f"{dpo.kind.title} (lambda {dpo.orpo_lambda}), no reference model"
        ref = (f"the base with the adapter of {init_adapter}, as the run starts from it" if init_adapter is not None
               else "the base with the adapters off")
        how = "computed once before training and cached" if dpo.reference == "cached" else "computed in every step"
        return f"{dpo.kind.title}, beta {dpo.beta}; reference: {ref} (no second copy of the weights), {how}"

    def data_module(self, *args: Any) -> Any:
        from lit_qlora.methods.dpo.datamodule import PreferenceDataModule

        return PreferenceDataModule(*args)

    def module(self, model: Any, dm: Any, config: Any) -> Any:
        """The run's PreferenceModule, with its reference: the base (adapters off) or the starting adapter."""
        from lit_qlora.methods.dpo.loss import Objective
        from lit_qlora.methods.dpo.module import PreferenceModule
        from lit_qlora.methods.dpo.reference import Reference, cache_fingerprint
        from lit_qlora.train.policy import starting_adapter

        objective = Objective.from_args(self.settings)
        reference = None
        if objective.uses_reference:
            start = starting_adapter(config.train.init_adapter)
            reference = Reference(self.settings.reference, start, config.out_dir,
                                  {"train": dm.train_set, "val": dm.val_set}, dm.collate, config.train.micro_batch_size,
                                  cache_fingerprint(config))
        return PreferenceModule(model, config.train, config.total_steps, config.start_step, compile=config.compile,
                                objective=objective, reference=reference)

    def estimate_step(self) -> Any:
        from lit_qlora.methods.dpo.estimate import PreferenceStep

        return PreferenceStep(self.settings)

    def estimate_section(self, traced: TracedStep) -> tuple[Optional[dict[str, Any]], int]:
        from lit_qlora.methods.dpo.estimate import preference_section

        return preference_section(traced.step, self.describe(), self.spec.train.init_adapter, traced.micro_batch_size,
                                  traced.peak_operation), traced.total

    @classmethod
    def render_estimate(cls, result: dict[str, Any]) -> list[str]:
        from lit_qlora.methods.dpo.estimate import render_preference

        return render_preference(result, cls.batch_size(result["micro_batch_size"]))
