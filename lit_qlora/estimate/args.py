"""What `litqlora estimate` accepts: a finetune or dpo recipe's run spec, read as it is, and the card to fit it on.
Plain dataclasses: the CLI reads them for `--help` without torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Optional

from lit_qlora.methods.grpo.args import GRPOArgs
from lit_qlora.base.precision import PrecisionChoice
from lit_qlora.methods.dpo.args import DPOArgs
from lit_qlora.methods.kto.args import KTOArgs
from lit_qlora.train.args import DataArgs
from lit_qlora.train.spec import RunSpec


@dataclass
class RecipeDataArgs(DataArgs):
    format: Literal["auto", "alpaca", "messages", "sharegpt", "prompt_completion", "text",  # type: ignore[assignment]
                    "explicit", "implicit", "prompt"] = "auto"
    """A finetune recipe's row format, a dpo recipe's pair format or a grpo recipe's (read, not used: the estimate's
    sequences are max_seq_length tokens)."""


@dataclass
class EstimateSpec(RunSpec):
    """A recipe's settings as the estimate reads them (what sets the step's memory), and the card."""

    # What changes no byte of the traced step is not an estimate option (a recipe's file may still not hold it).
    cli_skip: ClassVar[frozenset[str]] = frozenset({"accelerator", "nf4_shards", "resume", "ignore_modules", "compile",
                                                    "overwrite", "logger", "export"})

    checkpoint_dir: str = "checkpoints/SmolLM2-135M-Instruct"  # type: ignore[assignment]
    """A model directory (only its config.json is read), a preset name from lit_qlora/model/config.py (e.g.
    Llama-2-7b), or a recipe's checkpoint directory that is not downloaded yet (its preset is used)."""
    out_dir: Path = Path("out/estimate")
    """Where estimate.json goes."""
    quantize: Literal["nf4", "none"] = "nf4"
    """nf4 (QLoRA) or none (LoRA), as for finetune."""
    precision: PrecisionChoice = "auto"
    """As for finetune; auto is what finetune's auto picks on the target --device: bf16-true for cuda (it assumes a
    GPU with bf16, compute capability >= 8.0; for a T4 or V100 pass 16-mixed), and for cpu what this machine's CPU
    would pick."""
    seed: int = 1337
    """Accepted so a finetune recipe reads as it is (an estimate has no randomness)."""
    data: RecipeDataArgs = field(default_factory=RecipeDataArgs)
    """Accepted so a finetune or dpo recipe reads as it is (the step runs on max_seq_length tokens per sequence)."""
    device: Literal["cuda", "cpu"] = "cuda"
    """cuda (predict torch.cuda.max_memory_allocated on a GPU) or cpu (allocated tensor bytes on a CPU)."""
    device_memory: Optional[str] = None
    """The card: its name (t4, l4, a10g, rtx3090, rtx4090, a100-40gb, a100-80gb, h100-80gb, h200: its memory as
    nvidia-smi reports it, of which the fit leaves 0.5 GiB to the CUDA context) or its memory, e.g. 24GiB: also find
    the largest micro-batch size that fits, with and without activation checkpointing; with --train.max_seq_length
    auto, the longest sequence that fits at the given micro-batch instead (and the host memory it needs for offloaded
    activations). Units as written: GiB (2^30 bytes), GB (10^9: said so, as cards sold in "GB" have GiB), a bare G
    reads as GiB; the bytes are echoed."""
    method: Optional[Literal["sft", "dpo", "grpo", "kto"]] = None
    """sft (`litqlora finetune`'s step), dpo (`litqlora dpo`'s: micro_batch_size pairs, two sequences each, in one
    forward and backward, and the reference's no-grad forward with --dpo.reference adapters_off) or grpo (`litqlora
    grpo`'s: the training step on micro_batch_size completions, and the sampling of num_generations rows with the KV
    cache; the peak is the larger) or kto (`litqlora kto`'s: sft's step on micro_batch_size rows; its KL and reference
    passes run without gradients, below the step's peak). Default: the method whose section the recipe has or a
    --dpo.* / --grpo.* / --kto.* flag gives (a config_hub/dpo/, grpo/ or kto/ preset), else sft."""
    dpo: Optional[DPOArgs] = None
    """The preference objective, as for `litqlora dpo` (--dpo.help lists its options): --dpo.loss and --dpo.reference
    decide whether a reference forward runs in the step. Given (a recipe's `dpo:` section or a --dpo.* flag), the
    method is dpo unless --method sft says otherwise."""
    grpo: Optional[GRPOArgs] = None
    """The GRPO settings, as for `litqlora grpo` (--grpo.help lists them): num_generations and the sequence length
    size the rollouts' KV cache."""
    kto: Optional[KTOArgs] = None
    """The KTO settings, as for `litqlora kto` (read so a kto recipe reads as it is; they change no byte of the
    step)."""
