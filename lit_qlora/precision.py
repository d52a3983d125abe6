"""`NF4Precision`: the QLoRA precision plugin, one class for Lightning Fabric and the Trainer."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Iterable

import torch
import torch.nn as nn
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch import LightningModule
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning_utilities import apply_to_collection

from lit_qlora.config import PRECISION_DTYPES, Precision
from lit_qlora.nf4 import count_linears, is_nf4, quantize_linears


def _under_trainer(module: Any) -> bool:
    return isinstance(module, LightningModule) and module._trainer is not None


class NF4Precision(TrainerPrecision, FabricPrecision):
    """QLoRA precision: every base `nn.Linear` becomes NF4 at setup, everything else runs in `precision`'s dtype.

    Works as a Fabric plugin (`Fabric(plugins=NF4Precision())`) and a Trainer plugin
    (`Trainer(plugins=[NF4Precision()])`). `ignore_modules` names modules (prefixes) kept in high precision.
    After `convert_module`, `quantized_linears` / `total_linears` count the base linears (lm_head included).
    """

    def __init__(self, precision: Precision = "bf16-true", ignore_modules: Iterable[str] = (),
                 world_size: int = 1) -> None:
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
        for param in module.parameters():
            if not is_nf4(param) and param.is_floating_point() and param.dtype != self.dtype:
                param.data = param.data.to(self.dtype)
        for buf in module.buffers():
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

    # The Trainer's backward hooks call into `module.trainer`, which a plain module in a user's Fabric loop lacks
    # (the first `fabric.backward` crashed before this): each call goes to the base class of whoever drives it.
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        base = TrainerPrecision if _under_trainer(module) else FabricPrecision
        return base.pre_backward(self, tensor, module)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        base = TrainerPrecision if _under_trainer(model) else FabricPrecision
        base.backward(self, tensor, model, *args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        base = TrainerPrecision if _under_trainer(module) else FabricPrecision
        return base.post_backward(self, tensor, module)

    def optimizer_step(self, optimizer: Any, model: Any = None, closure: Any = None, **kwargs: Any) -> Any:
        if _under_trainer(model):
            return TrainerPrecision.optimizer_step(self, optimizer, model, closure, **kwargs)
        return FabricPrecision.optimizer_step(self, optimizer, **kwargs)
