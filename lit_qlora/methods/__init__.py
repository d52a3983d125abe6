"""The training methods beside SFT, each a package (dpo/, grpo/, kto/) whose method object (lit_qlora.train.method)
owns its spec, refusals, data, LightningModule and estimate step; `METHODS` is the registry that the CLI's verbs and
`litqlora estimate --method` read. A new method is a package here and one line in METHODS."""

from __future__ import annotations

from lit_qlora.methods.dpo.command import DPO
from lit_qlora.methods.grpo.command import GRPO
from lit_qlora.methods.kto.command import KTO
from lit_qlora.train.finetune import SFT
from lit_qlora.train.method import Method

METHODS: dict[str, type[Method]] = {m.name: m for m in (SFT, DPO, GRPO, KTO)}
"""Every training method by its name (state.json's `method`, `estimate --method`)."""
