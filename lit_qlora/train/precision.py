"""`NF4Precision`: the QLoRA precision plugin, one class for Lightning Fabric and the Trainer.

Under `bf16-mixed` the trainable weights and AdamW's state are fp32 over the bf16 (or NF4) base, which computes in
bf16 as under `bf16-true`: Lightning's meaning of the name, without a second fp32 copy of the base. Under `16-mixed`
(GPUs without bf16) it also does what Lightning's 16-mixed does for the trainable weights: they
stay fp32, the loss is scaled before backward and the gradients unscaled before clipping and the step, which a
torch.amp.GradScaler skips (and lowers its scale) when they overflowed. Unlike Lightning's 16-mixed, the frozen base
is stored in fp16 and computes in fp16 without autocast (LoRA casts its fp32 factors to the activations' dtype): a
base kept in fp32 would double its memory, which is what QLoRA exists to save. The LoRA baseline uses the same
plugin with `quantize=False` under 16-mixed.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Iterable, Optional

import torch
import torch.nn as nn
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch import LightningModule
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning_utilities import apply_to_collection

from lit_qlora.base.precision import LOSS_SCALED_PRECISIONS, MIXED_PRECISIONS, PRECISION_DTYPES, Precision
from lit_qlora.nf4 import count_linears, is_nf4, quantize_linears


def _under_trainer(module: Any) -> bool:
    return isinstance(module, LightningModule) and module._trainer is not None


class NF4Precision(TrainerPrecision, FabricPrecision):
    """QLoRA precision: every base `nn.Linear` becomes NF4 at setup, everything else runs in `precision`'s dtype.

    Works as a Fabric plugin (`Fabric(plugins=NF4Precision())`) and a Trainer plugin
    (`Trainer(plugins=[NF4Precision()])`). `ignore_modules` names modules (prefixes) kept in high precision.
    After `convert_module`, `quantized_linears` / `total_linears` count the base linears (lm_head included).
    `quantize=False`: the same precision handling without NF4 (the LoRA baseline under 16-mixed).
    """

    def __init__(self, precision: Precision = "bf16-true", ignore_modules: Iterable[str] = (),
                 world_size: int = 1, quantize: bool = True) -> None:
        if precision not in PRECISION_DTYPES:
            raise ValueError(f"NF4Precision supports {', '.join(PRECISION_DTYPES)}; got {precision!r}.")
        self.precision = precision  # type: ignore[assignment]
        self.dtype = PRECISION_DTYPES[precision]
        self.mixed = precision in MIXED_PRECISIONS
        self.loss_scaled = precision in LOSS_SCALED_PRECISIONS
        self.ignore_modules = tuple(ignore_modules)
        self.world_size = world_size
        self.quantize = quantize
        self.quantized_linears = 0
        self.total_linears = 0
        self.scaler: Optional[torch.amp.GradScaler] = None  # 16-mixed: made at the first backward, on its device
        self._scaler_state: Optional[dict[str, Any]] = None  # a resumed run's, loaded into the scaler once made

    def convert_module(self, module: nn.Module) -> nn.Module:
        # Cast first (so quantized weights carry the compute dtype), never touching trainable Parameters'
        # identity: Fabric has already handed them to the optimizer. Mixed precision keeps trainable ones fp32.
        for param in module.parameters():
            if self.mixed and param.requires_grad:
                continue
            if not is_nf4(param) and param.is_floating_point() and param.dtype != self.dtype:
                param.data = param.data.to(self.dtype)
        for buf in module.buffers():
            if buf.is_floating_point() and buf.dtype != self.dtype:
                buf.data = buf.data.to(self.dtype)
        if self.quantize:
            quantize_linears(module, self.ignore_modules, self.world_size)
        self.quantized_linears, self.total_linears = count_linears(module)
        return module

    # -- dynamic loss scaling (16-mixed) ------------------------------------------------------------------------
    def _scaler_for(self, device: torch.device) -> torch.amp.GradScaler:
        if self.scaler is None:
            self.scaler = torch.amp.GradScaler(device.type)
            if self._scaler_state is not None:
                self.scaler.load_state_dict(self._scaler_state)
        return self.scaler

    def unscale_gradients(self, optimizer: Any) -> None:
        """Divide the gradients by the loss scale (before they are checked, measured and clipped); a no-op without
        loss scaling. The GradScaler records whether they overflowed: its step then skips the update."""
        if self.scaler is not None:
            self.scaler.unscale_(getattr(optimizer, "optimizer", optimizer))  # Lightning wraps it

    def loss_scale(self) -> Optional[float]:
        """The current loss scale (16-mixed), else None."""
        return self.scaler.get_scale() if self.scaler is not None else None

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state (a resumable checkpoint records it: an exact resume needs the same scale)."""
        return self.scaler.state_dict() if self.scaler is not None else (self._scaler_state or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self._scaler_state = dict(state_dict)
        if self.scaler is not None:
            self.scaler.load_state_dict(self._scaler_state)

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
        if self.loss_scaled:
            tensor = self._scaler_for(tensor.device).scale(tensor)
        base = TrainerPrecision if _under_trainer(module) else FabricPrecision
        return base.pre_backward(self, tensor, module)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        base = TrainerPrecision if _under_trainer(model) else FabricPrecision
        base.backward(self, tensor, model, *args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        base = TrainerPrecision if _under_trainer(module) else FabricPrecision
        return base.post_backward(self, tensor, module)

    def optimizer_step(self, optimizer: Any, model: Any = None, closure: Any = None, **kwargs: Any) -> Any:
        if self.scaler is not None:
            if closure is not None:
                closure()
            # Unscales first where unscale_gradients was not called; skips the update after an overflow.
            out = self.scaler.step(getattr(optimizer, "optimizer", optimizer), **kwargs)
            self.scaler.update()
            return out
        if _under_trainer(model):
            return TrainerPrecision.optimizer_step(self, optimizer, model, closure, **kwargs)
        return FabricPrecision.optimizer_step(self, optimizer, **kwargs)
