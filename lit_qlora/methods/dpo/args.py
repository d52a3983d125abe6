"""What `litqlora dpo --dpo.* --data.*` accept. Plain dataclasses: the CLI reads them for `--help` without torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Optional, Union

from lit_qlora.base.errors import UserError
from lit_qlora.train.args import DataArgs, TrainArgs
from lit_qlora.train.spec import RunSpec


@dataclass(frozen=True)
class LossKind:
    """What a preference loss needs and reports, as the run, the estimate and the messages read it."""

    title: str  # how messages name it
    uses_reference: bool  # whether a reference model's log-probabilities enter it
    mean_logps: bool  # each answer's mean token log-probability (else its sum)
    label_smoothing: bool  # whether --dpo.label_smoothing applies


DPO_LOSSES = {
    "sigmoid": LossKind("DPO (sigmoid)", uses_reference=True, mean_logps=False, label_smoothing=True),
    "ipo": LossKind("IPO", uses_reference=True, mean_logps=True, label_smoothing=False),
    "orpo": LossKind("ORPO", uses_reference=False, mean_logps=True, label_smoothing=False),
}
"""The registry of `--dpo.loss` choices (their formulas: lit_qlora.methods.dpo.loss.pair_sums)."""

DPOLossName = Literal[tuple(DPO_LOSSES)]  # type: ignore[valid-type]

# metrics.jsonl's keys, TRL's names (and logps/accuracies: the share of pairs whose chosen answer the policy itself
# finds likelier, which, unlike the rewards, means something before the first step): summed over pairs, then divided
# by the pair count.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logps/accuracies")
ORPO_METRICS = ("nll_loss", "log_odds_ratio")


@dataclass
class DPOArgs:
    beta: float = 0.1
    """How far the policy may move from the reference: the scale of the implicit reward beta * (log pi - log ref).
    Lower lets it move further (TRL's default is 0.1)."""
    loss: DPOLossName = "sigmoid"
    """sigmoid: DPO (Rafailov et al.); ipo: IPO (Azar et al.), a squared loss on mean token log-probabilities that
    does not drive the margin to infinity; orpo: ORPO (Hong et al.), reference-free: the chosen answer's NLL plus
    orpo_lambda x the odds-ratio term (SFT and preference in one run, from the base)."""
    label_smoothing: float = 0.0
    """sigmoid only: the share of pairs assumed mislabeled (conservative DPO), in [0, 0.5)."""
    orpo_lambda: float = 0.1
    """orpo only: the weight of the odds-ratio term beside the NLL."""
    reference: Literal["adapters_off", "cached"] = "adapters_off"
    """The reference model is the same base with the adapters switched off (or, after --train.init_adapter, set back
    to that adapter): no second copy of the weights. adapters_off computes it in every step (one more forward,
    without gradients); cached computes each pair's once before training into out_dir/reference_logps.safetensors
    (reused on resume)."""

    @property
    def kind(self) -> LossKind:
        return DPO_LOSSES[self.loss]

    def require_valid(self) -> None:
        if not self.beta > 0:
            raise UserError(f"--dpo.beta must be > 0 (the implicit reward's scale; TRL's default is 0.1), got "
                            f"{self.beta}.")
        if not 0 <= self.label_smoothing < 0.5:
            raise UserError(f"--dpo.label_smoothing is the share of pairs taken for mislabeled, in [0, 0.5); got "
                            f"{self.label_smoothing}.")
        if self.label_smoothing and not self.kind.label_smoothing:
            raise UserError(f"--dpo.label_smoothing applies to --dpo.loss sigmoid (conservative DPO), and this run uses "
                            f"{self.loss}: leave it out or use sigmoid.")
        if not self.orpo_lambda > 0:
            raise UserError(f"--dpo.orpo_lambda must be > 0, got {self.orpo_lambda}.")


@dataclass
class PreferenceDataArgs(DataArgs):
    path: Optional[str] = None
    """The preference pairs: a local file (.json, .jsonl, .csv, .parquet, .arrow), a folder (of such files, or one
    written by `datasets`' save_to_disk), or a Hugging Face Hub dataset name. Default: the demo pairs shipped with
    lit-qlora (lit_qlora/data/preference_demo.jsonl)."""
    format: Literal["auto", "explicit", "implicit"] = "auto"  # type: ignore[assignment]
    """explicit: `prompt`, `chosen`, `rejected` (strings, or lists of chat messages as TRL's conversational form);
    implicit: `chosen` and `rejected` only (the common start is the prompt); auto tells them apart by the columns.
    A string prompt is one user turn in the prompt style; implicit strings are raw text."""
    columns: Optional[dict[str, str]] = None
    """Rename columns before reading rows, e.g. {question: prompt, good: chosen, bad: rejected}."""
    packing: bool = False
    """Not for preference pairs (each pair is scored as a whole): leave it false."""


@dataclass
class PairTrainArgs(TrainArgs):
    micro_batch_size: int = 4
    """Preference pairs per forward/backward pass (a pair is one row: its prompt once, then both answers)."""
    global_batch_size: int = 16
    """Pairs per optimizer step; accumulates global / (micro * devices) micro-batches."""
    max_seq_length: Union[int, Literal["auto"]] = 512
    """A prompt with its chosen (or its rejected) answer is truncated to this many tokens, keeping the start; a pair
    whose prompt alone fills it is left out. `litqlora estimate --device_memory SIZE` also takes auto."""


@dataclass
class DPOSpec(RunSpec):
    """`litqlora dpo`'s settings: a fine-tune's run spec with preference pairs for data, and the objective."""

    cli_skip: ClassVar[frozenset[str]] = frozenset({"tensor_parallel"})

    out_dir: Path = Path("out/dpo")
    """Where adapters, merged model, logs, metrics and resumable checkpoints go."""
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"  # type: ignore[assignment]
    """auto (one device), ddp or fsdp (FSDP2), as for `litqlora finetune`."""
    train: PairTrainArgs = field(default_factory=PairTrainArgs)
    """Optimization settings; the batch sizes count pairs."""
    data: PreferenceDataArgs = field(default_factory=PreferenceDataArgs)
    """The preference pairs; with nothing given, the demo pairs shipped with lit-qlora."""
    dpo: DPOArgs = field(default_factory=DPOArgs)
    """The preference objective."""
