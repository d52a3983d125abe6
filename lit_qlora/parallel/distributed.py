"""Several processes through Lightning strategies: `ddp` replicates the NF4 base, `fsdp` shards it with FSDP2,
`tp` splits every block's weights over `--tensor_parallel N` ranks (lit_qlora/parallel/tensor_parallel.py).

Lightning launches and connects the processes; nothing here starts one. `build_strategy` turns `--strategy fsdp`
into Lightning's `ModelParallelStrategy` (data-parallel size = devices x nodes, tensor-parallel size 1), and
`FinetuneModule.configure_model` calls `shard_model` with its data-parallel mesh. Under FSDP2 the parameters and
optimizer state are DTensors: `full` gathers one into a plain tensor (a collective: every rank must call it) and
`shard_like` cuts a full tensor back to a parameter's shard, so checkpoints stay plain safetensors whatever the
strategy and number of processes.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from lit_qlora.base.errors import InvalidInput

STRATEGIES = ("auto", "ddp", "fsdp", "tp")


def build_strategy(strategy: str, world_size: int, tensor_parallel: int = 1):
    """What `L.Trainer(strategy=...)` gets: FSDP2 for `fsdp` (Lightning's own "fsdp" is FSDP1), a data x tensor
    mesh for `tp`, else the name."""
    if strategy not in STRATEGIES:
        raise InvalidInput(f"--strategy {strategy!r} is not supported: choose one of {', '.join(STRATEGIES)}.")
    if tensor_parallel != 1 and strategy != "tp":
        raise InvalidInput(f"--tensor_parallel {tensor_parallel} needs --strategy tp.")
    if strategy in ("fsdp", "tp"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        if tensor_parallel < 1 or world_size % tensor_parallel:
            raise InvalidInput(f"--tensor_parallel {tensor_parallel} must divide devices x num_nodes ({world_size}).")
        return ModelParallelStrategy(data_parallel_size=world_size // tensor_parallel,
                                     tensor_parallel_size=tensor_parallel)
    return strategy


def nf4_shards_for(strategy: str, world_size: int, requested: Union[int, None] = None) -> int:
    """How many dim-0 shards every NF4 weight's layout must split into: devices x nodes under FSDP, else 1.

    DDP and one process need no split, so they quantize exactly like an ordinary single-device run. `requested`
    overrides it, e.g. to quantize a 1-process run to the same bits as an FSDP run of `requested` processes.
    """
    if requested is not None and requested < 1:
        raise InvalidInput(f"--nf4_shards must be at least 1, got {requested}.")
    if strategy == "tp" and requested not in (None, 1):
        raise InvalidInput("--nf4_shards does not apply to --strategy tp: every rank quantizes its own shards.")
    shards = requested or (world_size if strategy == "fsdp" else 1)
    if strategy == "fsdp" and shards % world_size:
        raise InvalidInput(f"nf4_shards ({shards}) must be a multiple of devices x num_nodes ({world_size}) with "
                           "--strategy fsdp: every rank holds whole NF4 scaler groups.")
    return shards


@contextmanager
def no_gradient_sync(module: nn.Module, strategy: Any) -> Iterator[None]:
    """Backward passes inside keep their gradients on this rank, accumulated in `.grad`: no all-reduce under DDP
    (Lightning's `block_backward_sync`, DDP's `no_sync`), no reduce-scatter under FSDP2. The next backward outside
    reduces the accumulated sum once, so every micro-batch of an optimizer step but the last runs inside it."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in fsdp:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        with getattr(strategy, "block_backward_sync", nullcontext)():
            yield
    finally:
        for m in fsdp:
            m.set_requires_gradient_sync(True, recurse=False)


def keep_frozen_out_of_ddp(module: nn.Module) -> None:
    """DDP must not broadcast the frozen base at wrap time: every rank already loaded the same bits, and DDP's
    coalesced broadcast does not round-trip an NF4Tensor (its dequantized values change). Only trainable
    parameters are then broadcast from rank 0 and all-reduced."""
    module._ddp_params_and_buffers_to_ignore = [n for n, p in module.named_parameters() if not p.requires_grad]


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as is."""
    return t.to_local() if is_dtensor(t) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: all-gathered from every rank for a DTensor (call it on every rank), else `t`."""
    return t.full_tensor() if is_dtensor(t) else t


def shard_like(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`tensor` (the full value) laid out like `param`: this rank's shard when `param` is a DTensor."""
    if not is_dtensor(param) or tuple(tensor.shape) != tuple(param.shape):
        return tensor
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(tensor.to(param.device_mesh.device_type), param.device_mesh, param.placements)


def is_sharded(model: nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


def reshard(model: nn.Module) -> None:
    """Put every FSDP2 unit back in its sharded state (the root keeps its parameters gathered after a forward)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def broadcast_trainable(model: nn.Module, group=None) -> None:
    """Copy rank 0's trainable parameters (the LoRA init) to every rank: FSDP2, unlike DDP, does not."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                dist.broadcast(p.data, src=src, group=group)


def shard_model(model: nn.Module, mesh) -> None:
    """FSDP2 over `mesh`: one unit per transformer block plus the root (embeddings, final norm, head).

    The NF4 weights shard as torchao NF4Tensors (their layout must be `nf4_shards_for(...)`-compatible) and are
    all-gathered per block in forward and backward. Idempotent: Lightning calls `configure_model` for every
    validate/fit.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if is_sharded(model):
        return
    if mesh.device_type != "cpu":  # onto this rank's device first (the whole NF4 base, briefly), like one-GPU runs
        model.to(torch.device(mesh.device_type, torch.accelerator.current_device_index()))
    broadcast_trainable(model, mesh.get_group())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "forward_hidden")  # training and validation call it, not forward
