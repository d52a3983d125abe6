"""The run spec: every setting of a training run (the base and how it is stored, precision, devices, resume, LoRA,
optimization, data, loggers, exports) as one typed object. The CLI builds it once from flags and YAML (its fields
are the flags: `--checkpoint_dir`, `--lora.r`; their docstrings are `--help`), and every verb passes it on: finetune,
dpo (which adds `--dpo.*`), estimate, and the ones to come. A verb that adds settings subclasses it.

`decide()` turns the spec's open choices (precision `auto`, `--compile`, the loggers, `--resume`) into what the run
does, once, with why; that `Decided` travels with the spec into `setup()`.

Light at import: the CLI reads these classes for `--help`, which must not wait for torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

from lit_qlora.checkpoint.download import DEFAULT_CHECKPOINT
from lit_qlora.base.errors import UserError
from lit_qlora.base.spec import CommandSpec
from lit_qlora.base.hardware import cpu_emulates, uses_cuda
from lit_qlora.base.precision import PrecisionChoice, choose_precision
from lit_qlora.train.args import DataArgs, ExportArgs, LoRAArgs, TrainArgs
from lit_qlora.train.loggers import LoggerName


@dataclass
class RunSpec(CommandSpec):
    """A training run's settings: `litqlora finetune`'s options, which every training verb shares."""

    checkpoint_dir: Path = DEFAULT_CHECKPOINT
    """Base model (Hugging Face directory). The default is the bundled SmolLM2-135M-Instruct, converted on first
    use."""
    out_dir: Path = Path("out/finetune")
    """Where adapters, merged model, logs, metrics and resumable checkpoints go."""
    quantize: Literal["nf4", "none"] = "nf4"
    """nf4 = every base linear stored as NF4 (QLoRA); none = base in the precision's dtype (LoRA)."""
    precision: PrecisionChoice = "auto"
    """auto picks by hardware: bf16-true on a GPU with bf16 (compute capability >= 8.0) or a CPU with native bf16
    (AVX512-BF16, AMX); 16-mixed on older GPUs (T4, V100: fp16 compute, fp32 adapters and AdamW state, dynamic loss
    scaling); 32-true on other CPUs (they emulate bf16, 5-10x slower than fp32). An explicit bf16-true, bf16-mixed
    (bf16 compute, fp32 adapters and AdamW state), 16-mixed, 16-true or 32-true wins; Lightning's short names bf16,
    16 and 32 mean bf16-mixed, 16-mixed and 32-true."""
    seed: int = 1337
    """Seeds adapter init, data order and dropout: CPU runs repeat exactly."""
    accelerator: str = "auto"
    """cpu, cuda, auto..."""
    devices: int = 1
    """Devices per node."""
    num_nodes: int = 1
    """Nodes."""
    strategy: Literal["auto", "ddp", "fsdp", "tp"] = "auto"
    """auto (one device), ddp (every rank holds the whole NF4 base) or fsdp (FSDP2: each of the devices x num_nodes
    ranks holds 1/N of it) or tp (tensor parallelism: the blocks' weights split over `tensor_parallel` ranks).
    Lightning starts the processes; see tutorials/distributed.md."""
    tensor_parallel: int = 1
    """With --strategy tp, ranks per tensor-parallel group (it must divide devices x num_nodes, the number of heads,
    of kv groups and the MLP width); the rest is data parallelism."""
    nf4_shards: Optional[int] = None
    """NF4 layout: how many FSDP shards every NF4 weight must split into. Default: devices x num_nodes with fsdp,
    else 1. Give an FSDP run's value to a smaller run to quantize to the same bits."""
    resume: Union[bool, Literal["auto"], Path] = False
    """auto = continue from the newest checkpoint in out_dir (fresh start if none); a checkpoint directory; or
    false."""
    lora: LoRAArgs = field(default_factory=LoRAArgs)
    """Adapter settings."""
    train: TrainArgs = field(default_factory=TrainArgs)
    """Optimization settings."""
    data: DataArgs = field(default_factory=DataArgs)
    """Dataset settings; with nothing given, the dataset shipped with lit-qlora."""
    ignore_modules: Optional[list[str]] = None
    """Module names (prefixes) whose linears stay in high precision with nf4, e.g. lm_head."""
    compile: Union[bool, Literal["force"]] = False
    """torch.compile each transformer block (regional compilation): faster steps after a warm-up, which
    summary.json reports apart (compile_seconds; tokens_per_sec excludes the steps that compiled). A resume may
    change it. Refused on a CPU that emulates the precision's matmuls (bf16 without AVX512-BF16/AMX: minutes per
    step for nothing); `force` compiles anyway."""
    overwrite: bool = False
    """Start a new run (no --resume) in an out_dir that holds another run's checkpoints or results, deleting them,
    its metrics.jsonl and logs first; without it, such an out_dir is refused."""
    logger: Union[LoggerName, list[LoggerName]] = "tensorboard"
    """Where the scalars (and the settings as hyperparameters) go besides metrics.jsonl, one or several
    (--logger '[tensorboard,csv]'): tensorboard (out_dir/logs), csv (out_dir/csv/metrics.csv), wandb (offline in
    out_dir/wandb unless you are logged in; pip install wandb) or mlflow (out_dir/mlruns unless MLFLOW_TRACKING_URI
    is set; pip install mlflow)."""
    export: ExportArgs = field(default_factory=ExportArgs)
    """More exports of the fine-tune beside final/'s adapter, merged model and PEFT adapter."""


@dataclass(frozen=True)
class Decided:
    """What a run does where its spec leaves a choice, decided once by `decide()`, with why where it depends on the
    machine; it travels with the spec, and nothing downstream decides again."""

    precision: str
    """A concrete precision (never auto)."""
    precision_reason: str
    """Why (summary.json's precision_reason)."""
    compile: bool
    loggers: tuple[str, ...]
    """The loggers besides metrics.jsonl, checked (their packages are installed)."""
    resume_from: Optional[Path]
    """The checkpoint a resume continues from, or None: a fresh start."""


def decide(spec: RunSpec) -> Decided:
    """The run's precision, compile and loggers from the spec and this machine, and the checkpoint --resume
    names (None: a fresh start); each a clear UserError where the spec asks for what cannot run here, as are the
    training settings that cannot go together (checked here, once, before anything loads)."""
    from lit_qlora.train.loggers import require_loggers
    from lit_qlora.train.resume import resolve_resume

    spec.train.require_fixed_length()
    spec.train.require_valid_validation(spec.data)
    spec.train.require_valid_offload(uses_cuda(spec.accelerator))
    precision, reason = choose_precision(spec.precision, spec.accelerator)
    return Decided(precision, reason, compile_choice(spec.compile, spec.accelerator, precision),
                   tuple(require_loggers(spec.logger)), resolve_resume(spec.resume, Path(spec.out_dir)))


COMPILE_EMULATED = (
    "--compile true with --precision {precision} on a CPU: {why}, so every matmul is emulated, and compiling that "
    "costs far more than it saves (measured on a 2-core AVX2-only CPU: the SmolLM2 QLoRA preset at 4x512 in bf16 spent "
    "7 min 50 s in step 1 and 6 min 35 s in step 2, and step 3 had not finished after 21 minutes). Use --precision "
    "auto ({auto} here: compiled, the preset warms up in well under a minute and then runs faster than eager, "
    "benchmarks/README.md \"Compile on CPU\"), or leave --compile off; --compile force compiles anyway.")


def compile_choice(compile: Union[bool, str], accelerator: str, precision: str) -> bool:
    """Whether to compile: `force` always; `true` unless the run is on a CPU that emulates its precision (a clear
    refusal with the measured why: that combination compiles for many minutes and never pays off)."""
    if compile == "force":
        return True
    if compile and not uses_cuda(accelerator):
        why = cpu_emulates(precision)
        if why is not None:
            raise UserError(COMPILE_EMULATED.format(precision=precision, why=why,
                                                    auto=choose_precision("auto", "cpu")[0]))
    return bool(compile)

