"""NF4 quantization of every base linear: the precision plugin (Fabric and Trainer) and the NF4 loader."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Iterable, Literal

import torch
import torch.nn as nn
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning_utilities import apply_to_collection

from lit_qlora.lora import frozen_linear, is_nf4

PRECISION_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "32-true": torch.float32}


class FrozenNF4Linear(nn.Linear):
    """A frozen linear whose weight is an NF4Tensor; forward goes through our fast NF4 kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.weight, self.bias)


def quantize_weight(weight: torch.Tensor, world_size: int = 1) -> torch.Tensor:
    """NF4 (double-quantized) copy of `weight`, in row chunks so the transient stays near the tensor's size."""
    from lit_qlora.nf4 import quantize_nf4

    return quantize_nf4(weight.detach(), world_size=world_size)


def is_ignored(name: str, ignore_modules: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in ignore_modules)


def base_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every base linear, lm_head included; LoRA's A and B are Parameters of LoRALinear, never Linear modules."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _dequantize_on_save(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    # Saving exposes NF4 weights as plain tensors in the compute dtype, moved to CPU one layer at a time, so a
    # full state dict never raises device memory and safetensors (which cannot store NF4) can write it.
    from lit_qlora.nf4 import dequantize_nf4

    key = prefix + "weight"
    if key in state_dict and is_nf4(state_dict[key]):
        state_dict[key] = dequantize_nf4(state_dict[key]).cpu()


def quantize_linears(model: nn.Module, ignore_modules: Iterable[str] = (), world_size: int = 1) -> int:
    """NF4-quantize every base linear still in high precision (in place); returns how many were quantized.

    With tied embeddings the embedding stays in high precision and the head gets its own NF4 copy.
    """
    ignore_modules = tuple(ignore_modules)
    count = 0
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    for name, linear in base_linears(model).items():
        if is_ignored(name, ignore_modules):
            continue
        if not is_nf4(linear.weight):
            linear.weight = nn.Parameter(quantize_weight(linear.weight, world_size), requires_grad=False)
            count += 1
        if type(linear) is nn.Linear:
            linear.__class__ = FrozenNF4Linear  # same parameters, fast forward
        if not getattr(linear, "_nf4_save_hook", False):
            linear._register_state_dict_hook(_dequantize_on_save)
            linear._nf4_save_hook = True
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    if config is not None and config.tie_embeddings and head is not None and is_nf4(head.weight):
        if embedding is not None and embedding.weight is not head.weight:
            model.config = config.replace(tie_embeddings=False)  # exports now write their own lm_head.weight
    return count


def count_linears(model: nn.Module) -> tuple[int, int]:
    """(NF4 base linears, all base linears), lm_head included, adapters excluded."""
    linears = base_linears(model).values()
    return sum(is_nf4(m.weight) for m in linears), len(linears)


class NF4Precision(TrainerPrecision, FabricPrecision):
    """QLoRA precision: every base `nn.Linear` becomes NF4 at setup, everything else runs in `precision`'s dtype.

    Works as a Fabric plugin (`Fabric(plugins=NF4Precision())`) and a Trainer plugin
    (`Trainer(plugins=[NF4Precision()])`). `ignore_modules` names modules (prefixes) kept in high precision.
    After `convert_module`, `quantized_linears` / `total_linears` count the base linears (lm_head included).
    """

    def __init__(self, precision: Literal["bf16-true", "16-true", "32-true"] = "bf16-true",
                 ignore_modules: Iterable[str] = (), world_size: int = 1) -> None:
        if precision not in PRECISION_DTYPES:
            raise ValueError(f"NF4Precision supports {', '.join(PRECISION_DTYPES)}; got {precision!r}.")
        self.precision = precision  # type: ignore[assignment]
        self.dtype = PRECISION_DTYPES[precision]
        self.ignore_modules = tuple(ignore_modules)
        self.world_size = world_size
        self.quantized_linears = 0
        self.total_linears = 0

    def convert_module(self, module: nn.Module) -> nn.Module:
        # Cast first (so quantized weights carry the compute dtype), never touching trainable Parameters'
        # identity: Fabric has already handed them to the optimizer.
        for name, param in module.named_parameters():
            if not is_nf4(param) and param.is_floating_point() and param.dtype != self.dtype:
                param.data = param.data.to(self.dtype)
        for buf_name, buf in module.named_buffers():
            if buf.is_floating_point() and buf.dtype != self.dtype:
                buf.data = buf.data.to(self.dtype)
        quantize_linears(module, self.ignore_modules, self.world_size)
        self.quantized_linears, self.total_linears = count_linears(module)
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(self.dtype)

    def module_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(self.dtype)

    def forward_context(self) -> AbstractContextManager:
        return _DtypeContextManager(self.dtype)

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=self.dtype)

    def convert_output(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor,
                                   dst_type=torch.get_default_dtype())


def is_linear_weight(name: str, model: nn.Module) -> bool:
    module_name, _, leaf = name.rpartition(".")
    return leaf == "weight" and isinstance(model.get_submodule(module_name), nn.Linear)


def load_nf4_checkpoint(checkpoint_dir: Path | str, dtype: torch.dtype = torch.bfloat16,
                        ignore_modules: Iterable[str] = (), world_size: int = 1, device="cpu", shard=None):
    """Stream a HF checkpoint into an NF4 model: each linear weight is quantized as it is read, so the full
    high-precision model is never resident (peak ~ NF4 model + one tensor).

    `shard(name, tensor)`, when given, cuts each tensor to this rank's part first (tensor parallelism), so each
    part is quantized on its own."""
    from lit_qlora.checkpoint import load_checkpoint
    from lit_qlora.config import Config

    config = Config.from_checkpoint(checkpoint_dir)
    with torch.device("meta"):
        from lit_qlora.model import Transformer

        skeleton = Transformer(config)
    linear_names = {n + ".weight" for n, _ in base_linears(skeleton).items() if not is_ignored(n, ignore_modules)}
    del skeleton

    def transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if shard is not None:
            tensor = shard(name, tensor)
        return quantize_weight(tensor, world_size) if name in linear_names else tensor

    model = load_checkpoint(checkpoint_dir, dtype=dtype, device=device, transform=transform, config=config)
    if config.tie_embeddings and "lm_head.weight" in linear_names:
        model.lm_head.weight = nn.Parameter(quantize_weight(model.model.embed_tokens.weight, world_size),
                                            requires_grad=False)
    quantize_linears(model, ignore_modules, world_size)  # marks, hooks and counts; nothing left to quantize
    return model

