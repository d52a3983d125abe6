"""`litqlora dpo`: preference tuning (DPO, IPO, ORPO) of a LoRA adapter on the frozen NF4 (or bf16) base, with
`finetune`'s run: the same checks, Trainer, checkpoints, resume, validation, loggers and final/ exports
(lit_qlora.train), given this package's data module and LightningModule through `RunHooks`.

Light at import, as `finetune` is: the CLI reads the signature for `--help`."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from lit_qlora.base.errors import UserError
from lit_qlora.preference.args import DPOArgs, DPOSpec


def dpo(spec: Optional[DPOSpec] = None, **settings: Any) -> dict[str, Any]:
    """Preference-tune a LoRA adapter (DPO, IPO or ORPO) on a frozen base, NF4 by default: rows of a prompt, a chosen
    and a rejected answer. The reference model is the same base with the adapters off (or, with
    --train.init_adapter, the adapter the run starts from): no second copy of the weights. Metrics under TRL's names
    (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected; eval_...
    for validation) in metrics.jsonl, the loggers and summary.json.

    Args:
        spec: The run's settings (lit_qlora.preference.args.DPOSpec: `litqlora finetune`'s, with preference pairs
            for data and --dpo.*), or its fields as keywords.
    """
    from lit_qlora.data.files import PREFERENCE_DEMO_DATASET
    from lit_qlora.train.finetune import run_objective

    spec = DPOSpec.of(spec, settings)
    spec.dpo.require_valid()
    if spec.tensor_parallel != 1 or spec.strategy == "tp":
        raise UserError("`litqlora dpo` runs with --strategy auto, ddp or fsdp; tensor parallelism is finetune's.")
    if spec.data.packing:
        raise UserError("--data.packing true packs several samples into one sequence, and a preference pair is scored "
                        "as a whole (its chosen and rejected answers side by side in one batch): leave packing out "
                        "for `litqlora dpo`.")
    return run_objective(spec, preference_hooks(spec.dpo), PREFERENCE_DEMO_DATASET,
                         describe(spec.dpo, spec.train.init_adapter))


def describe(dpo: DPOArgs, init_adapter: Optional[Path]) -> str:
    """What the run optimizes and against which reference, in a line."""
    if not dpo.kind.uses_reference:
        return f"{dpo.kind.title} (lambda {dpo.orpo_lambda}), no reference model"
    what = dpo.kind.title
    ref = (f"the base with the adapter of {init_adapter}, as the run starts from it" if init_adapter is not None
           else "the base with the adapters off")
    how = "computed once before training and cached" if dpo.reference == "cached" else "computed in every step"
    return f"{what}, beta {dpo.beta}; reference: {ref} (no second copy of the weights), {how}"


def preference_hooks(dpo: DPOArgs) -> Any:
    from lit_qlora.train.run import RunHooks

    return RunHooks(method="dpo", recipe={"dpo": asdict(dpo)}, data_module=data_module, module=lambda model, dm, config:
                    build_module(model, dm, config, dpo), rows_per_sample=2)


def data_module(*args: Any) -> Any:
    from lit_qlora.preference.datamodule import PreferenceDataModule

    return PreferenceDataModule(*args)


def build_module(model: Any, dm: Any, config: Any, dpo: DPOArgs) -> Any:
    """The run's PreferenceModule, with its reference: the base (adapters off) or the starting adapter."""
    from lit_qlora.preference.loss import Objective
    from lit_qlora.preference.module import PreferenceModule
    from lit_qlora.preference.reference import Reference, cache_fingerprint
    from lit_qlora.train.policy import starting_adapter

    objective = Objective.from_args(dpo)
    reference = None
    if objective.uses_reference:
        start = starting_adapter(config.train.init_adapter)
        reference = Reference(dpo.reference, start, config.out_dir, {"train": dm.train_set, "val": dm.val_set},
                              dm.collate, config.train.micro_batch_size, cache_fingerprint(config))
    return PreferenceModule(model, config.train, config.total_steps, config.start_step, compile=config.compile,
                            objective=objective, reference=reference)
