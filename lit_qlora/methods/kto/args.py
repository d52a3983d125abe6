"""What `litqlora kto --kto.* --data.*` accept, with TRL's names (KTOConfig). Plain dataclasses: the CLI reads them
for `--help` without torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Optional

from lit_qlora.base.errors import UserError
from lit_qlora.train.args import DataArgs, TrainArgs
from lit_qlora.train.spec import RunSpec

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl",
           "count/chosen", "count/rejected")
"""metrics.jsonl's keys, TRL's names: chosen means the desirable rows, rejected the undesirable ones; the rewards
and logps are their means over those rows of the step (all ranks), count/* how many there were."""


@dataclass
class KTOArgs:
    beta: float = 0.1
    """How far the policy may move from the reference: the scale of the implied reward beta * (log pi - log ref)
    (TRL's default 0.1)."""
    desirable_weight: float = 1.0
    """The weight of the desirable rows' losses. With more desirable than undesirable rows (or fewer), TRL advises
    desirable_weight x desirable rows / (undesirable_weight x undesirable rows) in [1, 4/3]."""
    undesirable_weight: float = 1.0
    """The weight of the undesirable rows' losses."""

    def require_valid(self) -> None:
        if not self.beta > 0:
            raise UserError(f"--kto.beta must be > 0 (the implied reward's scale; TRL's default is 0.1), got "
                            f"{self.beta}.")
        if not (self.desirable_weight > 0 and self.undesirable_weight > 0):
            raise UserError(f"--kto.desirable_weight and --kto.undesirable_weight must be > 0, got "
                            f"{self.desirable_weight} and {self.undesirable_weight}.")


@dataclass
class KTODataArgs(DataArgs):
    path: Optional[str] = None
    """The rows: a local file (.json, .jsonl, .csv, .parquet, .arrow), a folder, or a Hugging Face Hub dataset name.
    Rows of `prompt`, `completion` and `label` (true: desirable), strings or lists of chat messages as TRL reads
    them; preference pairs (`chosen`, `rejected`) count as two rows each. Default: the demo rows shipped with
    lit-qlora (lit_qlora/data/kto_demo.jsonl)."""
    format: Literal["auto"] = "auto"  # type: ignore[assignment]
    """auto: unpaired rows or preference pairs, told apart by their columns (--data.columns renames them)."""
    columns: Optional[dict[str, str]] = None
    """Rename columns before reading rows, e.g. {question: prompt, reply: completion, thumbs_up: label}."""
    packing: bool = False
    """Not for KTO (each row is scored with its own KL partner): leave it false."""


@dataclass
class KTOTrainArgs(TrainArgs):
    micro_batch_size: int = 4
    """Rows per forward/backward pass, at least 2: the KL estimate pairs each prompt with another row's completion
    of the same micro-batch."""
    global_batch_size: int = 16
    """Rows per optimizer step; accumulates global / (micro * devices) micro-batches."""


@dataclass
class KTOSpec(RunSpec):
    """`litqlora kto`'s settings: a fine-tune's run spec with unpaired rows for data, and the objective."""

    cli_skip: ClassVar[frozenset[str]] = frozenset({"tensor_parallel"})

    out_dir: Path = Path("out/kto")
    """Where adapters, merged model, logs, metrics and resumable checkpoints go."""
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"  # type: ignore[assignment]
    """auto (one device), ddp or fsdp (FSDP2), as for `litqlora finetune`."""
    train: KTOTrainArgs = field(default_factory=KTOTrainArgs)
    """Optimization settings; the batch sizes count rows."""
    data: KTODataArgs = field(default_factory=KTODataArgs)
    """The rows; with nothing given, the demo rows shipped with lit-qlora."""
    kto: KTOArgs = field(default_factory=KTOArgs)
    """The KTO objective."""
