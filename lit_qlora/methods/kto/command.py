"""`litqlora kto`: Kahneman-Tversky optimization of a LoRA adapter on the frozen NF4 (or bf16) base, with `finetune`'s
run (checks, Trainer, checkpoints, resume, validation, loggers, final/ exports), given this package's data module
and LightningModule by its method object, `KTO`.

Light at import, as `finetune` is: the CLI reads the signature for `--help`."""

from __future__ import annotations

from typing import Any, Optional

from lit_qlora.methods.kto.args import METRICS, KTOSpec
from lit_qlora.train.method import Method


def kto(spec: Optional[KTOSpec] = None, **settings: Any) -> dict[str, Any]:
    """Tune a LoRA adapter with KTO on a frozen base, NF4 by default: rows of a prompt, one completion and a label
    (desirable or not, as thumbs-up/down feedback gives them; TRL's KTOTrainer format), no pairs needed. The
    reference is the same base with the adapters off (or the --train.init_adapter adapter): no second copy of the
    weights. Metrics under TRL's names (rewards/chosen, rewards/rejected, rewards/margins, logps/chosen,
    logps/rejected, kl; eval_... for validation) in metrics.jsonl, the loggers and summary.json.

    Args:
        spec: The run's settings (lit_qlora.methods.kto.args.KTOSpec: `litqlora finetune`'s, with unpaired rows for
            data and --kto.*), or its fields as keywords.
    """
    from lit_qlora.train.finetune import run_method

    return run_method(KTO(KTOSpec.of(spec, settings)))


class KTO(Method):
    """Unpaired feedback: a prompt, a completion, and whether it is desirable."""

    name = verb = section = "kto"
    command = staticmethod(kto)
    spec_class = KTOSpec
    rows_per_sample = 2  # its row and its KL partner (the partner's forward runs without gradients)
    demo_data = "KTO_DEMO_DATASET"
    metric_names = METRICS
    refusals = {
        "strategy tp": "tensor parallelism is finetune's.",
        "packing": "packing puts samples into one sequence, and each KTO row is scored beside its own KL partner: "
                   "leave packing out.",
    }

    def check_section(self) -> None:
        self.settings.require_valid()

    def require_valid(self) -> None:
        from lit_qlora.base.errors import UserError

        super().require_valid()
        if self.spec.train.micro_batch_size < 2:
            raise UserError("`litqlora kto` needs --train.micro_batch_size of at least 2: its KL estimate pairs each "
                            "prompt with another row's completion in the same micro-batch (with one row, that is its "
                            "own completion, and the estimate equals the reward: TRL refuses it too).")

    def describe(self) -> str:
        k, init_adapter = self.settings, self.spec.train.init_adapter
        ref = (f"the base with the adapter of {init_adapter}, as the run starts from it" if init_adapter is not None
               else "the base with the adapters off")
        return (f"KTO, beta {k.beta}, weights desirable {k.desirable_weight:g} / undesirable "
                f"{k.undesirable_weight:g}; KL estimate from mismatched pairs; reference: {ref} (no second copy of the "
                "weights), computed in every step")

    def data_module(self, *args: Any) -> Any:
        from lit_qlora.methods.kto.datamodule import UnpairedDataModule

        return UnpairedDataModule(*args)

    def module(self, model: Any, dm: Any, config: Any) -> Any:
        from lit_qlora.methods.kto.module import KTOModule
        from lit_qlora.train.policy import starting_adapter

        return KTOModule(model, config.train, config.total_steps, config.start_step, compile=config.compile,
                         kto=self.settings, start=starting_adapter(config.train.init_adapter))
