"""`ModelChoice`: which model an inference command runs, the options generate, chat, serve and evaluate share (the
checkpoint, a fine-tune's adapter on it, how the base is stored, the precision, the device), with one default each,
checked before any heavy work and loaded one way.

Light at import: the CLI reads these classes for `--help`; torch and the model load inside the methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Optional

from lit_qlora.base.errors import InvalidInput
from lit_qlora.base.precision import PrecisionChoice, resolved
from lit_qlora.base.spec import CommandSpec
from lit_qlora.checkpoint.download import DEFAULT_CHECKPOINT


@dataclass(kw_only=True)
class ModelChoice(CommandSpec):
    """Which model an inference command runs; an inference command's options subclass it."""

    checkpoint_dir: Path = DEFAULT_CHECKPOINT
    """Hugging Face model directory (config.json, safetensors, tokenizer.json): a base, or a merged fine-tune. The
    default is the bundled SmolLM2-135M-Instruct, converted on first use."""
    adapter_dir: Optional[Path] = None
    """A fine-tune's out_dir (or its final/ directory): its LoRA adapter on top of the base, unmerged."""
    quantize: Optional[Literal["nf4", "none"]] = None
    """nf4 = NF4-quantize every base linear as the checkpoint loads (QLoRA's base; with --adapter_dir, the exact model
    it trained); none = the precision's dtype. Default: what the adapter trained with (its adapter_config.json), else
    none."""
    precision: PrecisionChoice = "auto"
    """Weights and compute dtype: auto (bf16 where the device computes it natively, else fp32 on a CPU and fp16 on a
    GPU), bf16-true, 16-true (fp16) or 32-true (fp32); a mixed precision (bf16-mixed, 16-mixed) computes in its
    narrow dtype here, with nothing to train."""
    device: Optional[str] = None
    """cpu, cuda, cuda:1, ...; default: cuda when available, else cpu."""

    def check(self, tokenizer: bool = True) -> None:
        """The checkpoint (the bundled default converted on first use) and the adapter's config, each problem a
        one-paragraph error now, before the model loads (or, for serve, before a worker starts)."""
        from lit_qlora.checkpoint.hf import require_checkpoint
        from lit_qlora.export.gguf_import import ensure_default_checkpoint

        self.checkpoint_dir = Path(self.checkpoint_dir)
        ensure_default_checkpoint(self.checkpoint_dir)
        require_checkpoint(self.checkpoint_dir, tokenizer=tokenizer)
        if self.adapter_dir is not None:
            self.adapter_dir = Path(self.adapter_dir)
            self.adapter_config  # noqa: B018  (read and checked now; kept for the quantize and results.json)

    @cached_property
    def run_device(self) -> Any:
        """The torch.device the model runs on."""
        import torch

        if not self.device:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise InvalidInput(f"--device {self.device!r} is not a device: give cpu, cuda or cuda:N.") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidInput(f"--device {self.device}: this machine has no CUDA GPU that torch can use; leave "
                               "--device out (cpu here) or give cpu.")
        return device

    @cached_property
    def run_precision(self) -> str:
        """The precision the model computes in (`auto` resolved for the device, once)."""
        return resolved(self.precision, self.run_device.type)

    @cached_property
    def adapter_config(self) -> Optional[dict]:
        from lit_qlora.checkpoint.adapter import read_adapter_config

        return None if self.adapter_dir is None else read_adapter_config(Path(self.adapter_dir))

    @property
    def run_quantize(self) -> str:
        """nf4 or none: the explicit choice, else what the adapter trained with, else none."""
        from lit_qlora.checkpoint.loading import resolve_quantize

        return resolve_quantize(self.quantize, self.adapter_config).value

    def load(self) -> Any:
        """The model (lit_qlora.model.Transformer, eval mode) on its device, the adapter applied."""
        from lit_qlora.checkpoint.loading import load_model

        return load_model(self.checkpoint_dir, self.quantize, self.run_precision, self.adapter_dir,
                          device=self.run_device)

    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer, formatting prompts as the adapter's fine-tune trained (lit_qlora.data.inference)."""
        from lit_qlora.data.inference import trained_tokenizer

        return trained_tokenizer(Path(self.checkpoint_dir), self.adapter_dir)

    def describe(self) -> str:
        """`CHECKPOINT` or `CHECKPOINT + ADAPTER`, for a command's first line."""
        return f"{self.checkpoint_dir}{f' + {self.adapter_dir}' if self.adapter_dir else ''}"
