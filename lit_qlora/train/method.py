"""A training method as one object: what makes SFT, DPO, GRPO or KTO itself, asked by its verb, the run and
`litqlora estimate --method`.

A method owns its spec (`--dpo.*` and the rest), its checks and its refusals (the settings it does not run with, and
why: stated once, here, and read by its verb, its spec's `--strategy` choices and the estimate), its data module and
LightningModule, the rows a sample takes in a forward, the estimate's step, its one-line description and its metric
names. `SFT` is train/'s own (lit_qlora.train.finetune); the others live in lit_qlora.methods (its `METHODS` is the registry), above train/,
which never imports them: a verb hands its method object to lit_qlora.train.finetune.run_method.

Light at import: the CLI reads the methods for `--help`, which must not wait for torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, ClassVar, Optional

from lit_qlora.base.errors import UserError
from lit_qlora.train.spec import RunSpec

STRATEGIES = ("auto", "ddp", "fsdp", "tp")
"""What --strategy offers a method that refuses none."""


@dataclass(frozen=True)
class TracedStep:
    """What `litqlora estimate` traced of a method's training step on a rank, handed to the method's own section of
    the report (`Method.estimate_section`)."""

    step: Any
    """The method's `estimate_step()` object (None: SFT's step)."""
    config: Any
    """The model's lit_qlora.model.config.Config."""
    by_category: dict[str, int]
    """The step's peak bytes per rank by category."""
    peak_operation: str
    total: int
    """The step's peak bytes per rank."""
    micro_batch_size: int
    max_seq_length: int
    precision: str
    device: str


class Method:
    """SFT: next-token loss on the answers (`litqlora finetune`). A subclass is another method; each class attribute
    and method below is one thing it may change."""

    name: ClassVar[str] = "sft"
    """state.json's and final/adapter_config.json's `method`, and `estimate --method`'s choice."""
    verb: ClassVar[str] = "finetune"
    """The `litqlora` command that runs it."""
    command: ClassVar[Callable[..., dict[str, Any]]]
    """That command's function (its signature and docstring are the verb's `--help`)."""
    spec_class: ClassVar[type[RunSpec]] = RunSpec
    section: ClassVar[Optional[str]] = None
    """The spec's field holding the method's own settings (`dpo` for `--dpo.*`); None: it has none."""
    rows_per_sample: ClassVar[int] = 1
    """Sequences one sample puts through a forward (a preference pair: 2), for the offload decision."""
    batch_unit: ClassVar[str] = ""
    """What its micro-batch counts where that is not sequences ("pairs": rows_per_sample sequences each)."""
    refusals: ClassVar[dict[str, str]] = {}
    """Settings the method does not run with -> why. Keys: "strategy NAME" (`strategy tp` also stands for any
    --tensor_parallel other than 1), "packing", "compile"."""
    demo_data: ClassVar[Optional[str]] = None
    """The name in lit_qlora.data.files of the data a run without a dataset option trains on; None: the SFT demo."""
    metric_names: ClassVar[tuple[str, ...]] = ()
    """Its numbers beside loss in metrics.jsonl and summary.json (TRL's names where TRL has the method)."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec

    @property
    def settings(self) -> Any:
        """The method's own settings (`spec.dpo`), or None."""
        return getattr(self.spec, self.section) if self.section else None

    # -- what it accepts ------------------------------------------------------------------------------------------

    @classmethod
    def strategies(cls) -> tuple[str, ...]:
        """The --strategy values it runs with: its spec offers exactly these."""
        return tuple(s for s in STRATEGIES if f"strategy {s}" not in cls.refusals)

    @classmethod
    def refusal(cls, spec: Any) -> Optional[str]:
        """Why `spec` asks for a setting this method does not run with, in a paragraph; None: it asks for none."""
        strategy = "tp" if getattr(spec, "tensor_parallel", 1) != 1 else spec.strategy
        if f"strategy {strategy}" in cls.refusals:
            allowed = cls.strategies()
            return (f"`litqlora {cls.verb}` runs with --strategy {', '.join(allowed[:-1])} or {allowed[-1]}, not "
                    f"{strategy}{' (--tensor_parallel)' if strategy == 'tp' else ''}: {cls.refusals[f'strategy {strategy}']}")
        if getattr(spec.data, "packing", False) and "packing" in cls.refusals:
            return f"`litqlora {cls.verb}` does not take --data.packing true: {cls.refusals['packing']}"
        if getattr(spec, "compile", False) and "compile" in cls.refusals:
            return f"`litqlora {cls.verb}` does not take --compile: {cls.refusals['compile']}"
        return None

    def check(self) -> None:
        """Refuse what the method does not run with, then check its own settings: before anything loads."""
        message = self.refusal(self.spec)
        if message:
            raise UserError(message)
        self.require_valid()

    def require_valid(self) -> None:
        """The method's checks of the run's settings before it starts (a clear UserError each): its section's, and
        those that need the whole recipe."""
        self.check_section()

    def check_section(self) -> None:
        """The checks of the method's own settings alone, which `litqlora estimate --method` makes too."""

    # -- what it records and says ---------------------------------------------------------------------------------

    def recorded(self) -> dict[str, Any]:
        """What state.json's run adds for this method: part of the recipe a resume must match."""
        if self.section is None:
            return {}
        return {"method": self.name, self.section: asdict(self.settings)}

    def describe(self) -> str:
        """What the run optimizes, in a line (printed as it starts)."""
        return "next-token cross-entropy on the answers' tokens"

    # -- what it builds -------------------------------------------------------------------------------------------

    def data_module(self, data: Any, tokenizer: Any, max_seq_length: int, micro_batch_size: int, seed: int) -> Any:
        from lit_qlora.train.datamodule import SFTDataModule

        return SFTDataModule(data, tokenizer, max_seq_length, micro_batch_size, seed)

    def module(self, model: Any, dm: Any, config: Any) -> Any:
        """The run's LightningModule (a FinetuneModule) on `model`, from the data module and the RunConfig."""
        from lit_qlora.train.module import FinetuneModule

        return FinetuneModule(model, config.train, config.total_steps, config.start_step, compile=config.compile)

    def estimate_step(self) -> Optional[Any]:
        """The step `litqlora estimate` traces instead of SFT's (lit_qlora.estimate.step.trace_step's objective), or
        None: SFT's step."""
        return None

    @classmethod
    def batch_size(cls, micro_batch_size: int) -> str:
        """A micro-batch as the estimate's report names it: `4`, or `4 pairs (8 sequences)`."""
        if not cls.batch_unit:
            return str(micro_batch_size)
        return f"{micro_batch_size} {cls.batch_unit} ({cls.rows_per_sample * micro_batch_size} sequences)"

    def estimate_section(self, traced: TracedStep) -> tuple[Optional[dict[str, Any]], int]:
        """estimate.json's section on what this method's step adds (under the method's name), and the peak per rank
        with it; SFT: none, the traced step's peak."""
        return None, traced.total

    @classmethod
    def render_estimate(cls, result: dict[str, Any]) -> list[str]:
        """The estimate report's lines on this method's section of `result` (estimate.json)."""
        return []
