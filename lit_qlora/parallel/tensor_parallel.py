"""Tensor parallelism (Megatron-style) for LoRA and QLoRA: `--strategy tp --tensor_parallel N`.

Each of the N ranks of a tensor-parallel group holds its part of every block's base weights as a plain local
tensor (an NF4Tensor with QLoRA): the rows of q/k/v/gate/up (column-parallel: its heads, its kv groups, its
slice of the MLP's hidden units) and the matching columns of o/down (row-parallel). Embeddings, norms and the
head are replicated. Every shard is quantized on its own rank, after slicing, so row-parallel weights need no
dim-1 split of an NF4Tensor (torchao splits those along dim 0 only); the price is that the NF4 bits depend on N
(the double-quantization statistics are per shard), which `load_model(..., nf4_tensor_parallel=N)` reproduces in
one process.

LoRA parameters are DTensors on the tensor-parallel mesh, so gathering them (saves) and cutting them (loads,
resume) works as under FSDP2:

| base | lora_A (r x in) | lora_B (out x r) |
|---|---|---|
| column-parallel | Replicate; its gradient summed over the group | Shard(0) |
| row-parallel | Shard(1) | Replicate; its input is the group-summed A-projection, so its gradient is already whole |
| head (replicated) | Replicate | Replicate |

Forward computes on the local tensors: a column-parallel layer's input gradient is summed over the group
(`copy_to_group`), a row-parallel layer's output and A-projection are summed in forward (`sum_over_group`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from lit_qlora.base.errors import InvalidInput
from lit_qlora.lora.layer import LoRALinear
from lit_qlora.nf4 import dequantize_nf4, frozen_linear, quantize_nf4
from lit_qlora.parallel.distributed import broadcast_trainable

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (Megatron's `f`)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    """Sum over the group forward; identity backward (Megatron's `g`)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToGroup.apply(x, group)


def sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    return _SumOverGroup.apply(x, group)


def tp_style(module_name: str) -> Optional[str]:
    """'column', 'row' or None (replicated) for a base linear's module name."""
    leaf = module_name.rpartition(".")[2]
    return "column" if leaf in COLUMN else "row" if leaf in ROW else None


def shard_tensor(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name`: rows of column-parallel weights and biases, columns of
    row-parallel weights; anything else whole. A contiguous copy, so the full tensor can be freed."""
    module_name, _, leaf = name.rpartition(".")
    style = tp_style(module_name)
    if size == 1 or style is None or (style == "row" and leaf != "weight"):
        return tensor
    dim = 0 if style == "column" else 1
    if tensor.shape[dim] % size:
        raise InvalidInput(f"{name} has {tensor.shape[dim]} {'rows' if dim == 0 else 'columns'}, not divisible by "
                           f"--tensor_parallel {size}.")
    return tensor.chunk(size, dim)[rank].clone(memory_format=torch.contiguous_format)


class TensorParallelShard(NamedTuple):
    """This rank's place in a tensor-parallel group: `load_model(..., shard=...)` keeps only its part."""

    rank: int
    size: int

    def cut(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return shard_tensor(name, tensor, self.rank, self.size)


def check_divisible(config, size: int) -> None:
    for what, n in (("n_head", config.n_head), ("n_query_groups", config.n_query_groups),
                    ("intermediate_size", config.intermediate_size)):
        if n % size:
            raise InvalidInput(f"--tensor_parallel {size} must divide the model's {what} ({n}): every rank holds "
                               "whole attention heads, whole kv groups and an equal slice of the MLP.")


def tp_layout_weight(tensor: torch.Tensor, style: str, size: int) -> torch.Tensor:
    """The whole weight a tensor-parallel QLoRA run of `size` ranks trains against: every rank's shard
    NF4-quantized on its own, dequantized and put back together."""
    dim = 0 if style == "column" else 1
    parts = [dequantize_nf4(quantize_nf4(p.contiguous())) for p in tensor.chunk(size, dim)]
    return torch.cat(parts, dim)


def _group_of(mesh) -> tuple:
    return mesh.get_group(), mesh.get_local_rank(), mesh.size()


def _dtensor(local: torch.Tensor, mesh, placement) -> nn.Parameter:
    from torch.distributed.tensor import DTensor

    return nn.Parameter(DTensor.from_local(local.contiguous(), mesh, [placement], run_check=False))


class ParallelLinear(nn.Linear):
    """A frozen base linear holding this rank's shard (`style` 'column' or 'row'); in/out_features stay whole."""

    style: str
    group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "column":
            return frozen_linear(copy_to_group(x, self.group), self.weight, self.bias)
        out = sum_over_group(frozen_linear(x, self.weight, None), self.group)
        return out if self.bias is None else out + self.bias


class ParallelLoRALinear(LoRALinear):
    """LoRALinear over a tensor-parallel base (`style` 'column', 'row' or 'replicate'); A and B are DTensors."""

    style: str
    group = None
    fusable = False  # its base is a shard and its input gradient a group sum: it runs its own forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A.to_local().to(x.dtype), self.lora_B.to_local().to(x.dtype)
        if self.style == "replicate":
            out = frozen_linear(x, self.weight, self.bias)
            return out + (self.lora_dropout(x) @ a.T @ b.T) * self.scale
        if self.style == "column":
            x = copy_to_group(x, self.group)  # input gradient: the sum of every rank's output slice's
            a = copy_to_group(a, self.group)  # A's gradient: likewise, so A stays identical on every rank
            out = frozen_linear(x, self.weight, self.bias)
            return out + (self.lora_dropout(x) @ a.T @ b.T) * self.scale
        out = sum_over_group(frozen_linear(x, self.weight, None), self.group)
        if self.bias is not None:
            out = out + self.bias
        h = sum_over_group(self.lora_dropout(x) @ a.T, self.group)  # whole on every rank: B's gradient is too
        return out + (h @ b.T) * self.scale

    def lora_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's parts of B and A: delta_weight() is then its part of scale * B @ A (what its shard gets)."""
        return self.lora_B.to_local(), self.lora_A.to_local()


def is_parallel(model: nn.Module) -> bool:
    return any(isinstance(m, (ParallelLinear, ParallelLoRALinear)) for m in model.modules())


def parallelize(model: nn.Module, tp_mesh) -> None:
    """Make a model loaded with `load_model(..., shard=...)` (base shards in place) tensor-parallel over `tp_mesh`.

    Rank 0's LoRA init is broadcast to every rank first, then A and B become DTensors (see the module's table).
    Idempotent: Lightning calls `configure_model` for every validate/fit."""
    from torch.distributed.tensor import Replicate, Shard

    if is_parallel(model):
        return
    group, rank, size = _group_of(tp_mesh)
    check_divisible(model.config, size)
    broadcast_trainable(model)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        style = tp_style(name)
        if style is not None:
            dim = 0 if style == "column" else 1
            whole = module.out_features if dim == 0 else module.in_features
            if module.weight.shape[dim] != whole // size:
                raise ValueError(f"{name}.weight has shape {tuple(module.weight.shape)}: load the base with "
                                 "`load_model(..., shard=...)` (this rank's shard) before `parallelize`.")
        if isinstance(module, LoRALinear):
            a, b = module.lora_A.detach(), module.lora_B.detach()
            if style == "column":
                module.lora_A = _dtensor(a, tp_mesh, Replicate())
                module.lora_B = _dtensor(b.chunk(size, 0)[rank], tp_mesh, Shard(0))
            elif style == "row":
                module.lora_A = _dtensor(a.chunk(size, 1)[rank], tp_mesh, Shard(1))
                module.lora_B = _dtensor(b, tp_mesh, Replicate())
            else:
                module.lora_A, module.lora_B = _dtensor(a, tp_mesh, Replicate()), _dtensor(b, tp_mesh, Replicate())
            module.__class__ = ParallelLoRALinear
            module.style = style or "replicate"
        elif style is not None:
            module.__class__ = ParallelLinear
            module.style = style
        module.group = group


def average_over_data(model: nn.Module, dp_mesh) -> None:
    """Average the LoRA gradients over the data-parallel ranks (tensor parallelism with data-parallel size > 1)."""
    if dp_mesh.size() == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(local, group=dp_mesh.get_group())
            local.div_(dp_mesh.size())
