"""Preference tuning, `litqlora dpo`: the objectives and their metrics (`loss`), the reference model for free
(`reference`: the same base with the adapters off), the LightningModule (`module`) and data module (`datamodule`)
that `finetune`'s run trains with, and the verb (`command`). Preference rows are read in lit_qlora.data.preference."""

from lit_qlora import public_names

__getattr__, __all__ = public_names(
    __name__, command="dpo", loss="Objective answer_logps pair_sums METRICS", module="PreferenceModule",
    reference="Reference reference_policy")
