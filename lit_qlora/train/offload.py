"""When a run offloads its activation checkpoints (`--train.offload_activations` true, false or auto) and what it
reports of them; how they are offloaded is `lit_qlora.model.offload`."""

from __future__ import annotations

from typing import Any, Optional

import torch

from lit_qlora.model.offload import ActivationOffload

# `auto` turns offloading on (CUDA, checkpointing on) when one micro-batch's checkpointed block inputs reach this many
# bytes. Reasoning, not yet a GPU measurement (re-measure on a GPU: tokens/s and peak with and without, e.g. the 8B
# preset at 1x2048 ... 1x16384): the per-block transfer is 2 x n_embd bytes per token each way against ~8 x 12 x
# n_embd^2 FLOPs of recompute + backward per token, so with the copies overlapped its cost is small for n_embd >= 1024,
# and below 1 GiB the memory saved is small next to any card's (6% of a 16 GB T4). Llama-3.1-8B reaches it at 4096
# tokens per micro-batch (32 blocks x 8 KiB x 4096), SmolLM2-135M at ~31k.
AUTO_MIN_BYTES = 1 << 30
# ... and at least this share of the card's memory: below it the memory saved is small next to what the card has, and
# the copies are time spent for nothing (the 8B preset at 2 x 2048, 1 GiB, on a 141 GB H200: the offloaded run did not
# finish where the same run without offload took 87 s). On a 24 GB card that is 1.5 GiB, on an 80 GB card 5 GiB.
AUTO_MIN_DEVICE_SHARE = 1 / 16
# `auto` stays off when the pinned host memory would take more than this share of the host's available memory:
# pinned pages cannot be swapped, and a host that runs out of them stalls every process on it.
AUTO_MAX_HOST_SHARE = 0.5


def block_input_bytes(n_embd: int, checkpoint_blocks: int, micro_batch_size: int, max_seq_length: int,
                      dtype_bytes: int) -> int:
    """What the checkpointed blocks' inputs of one micro-batch take: what offloading moves to host memory."""
    return checkpoint_blocks * micro_batch_size * max_seq_length * n_embd * dtype_bytes


def available_host_bytes() -> Optional[int]:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def offload_for_run(choice: Any, device: torch.device, checkpoint_blocks: int, n_embd: int, micro_batch_size: int,
                    max_seq_length: int, dtype: torch.dtype) -> tuple[Optional[ActivationOffload], str]:
    """A run's ActivationOffload (None: off) on `device` and why (offload_choice, with this host's free memory)."""
    input_bytes = block_input_bytes(n_embd, checkpoint_blocks, micro_batch_size, max_seq_length, dtype.itemsize)
    cuda = device.type == "cuda"
    device_total = torch.cuda.get_device_properties(device).total_memory if cuda else None
    on, why = offload_choice(choice, cuda, checkpoint_blocks, input_bytes, available_host_bytes(), device_total)
    return (ActivationOffload() if on else None), why


def offload_summary(offload: Optional[ActivationOffload]) -> dict[str, Any]:
    """summary.json's report of it: whether it ran, the host memory the offloaded inputs took at most, and the
    pinned buffers that held them."""
    return {"offload_activations": offload is not None,
            "offload_host_bytes": offload.peak_host_bytes if offload else 0,
            "offload_pinned_bytes": offload.pinned_bytes if offload else 0}


def offload_choice(choice: Any, cuda: bool, checkpoint_blocks: int, input_bytes: int,
                   host_available: Optional[int] = None, device_total: Optional[int] = None) -> tuple[bool, str]:
    """(whether to offload, why) for `--train.offload_activations` `choice` (true, false or auto): a run on CUDA or
    not, with `checkpoint_blocks` checkpointed blocks whose inputs take `input_bytes` per micro-batch, on a host with
    `host_available` bytes free and a card of `device_total` bytes (None: not known, e.g. an estimate without
    --device_memory). `true` where it cannot apply is a UserError (lit_qlora.train.args.require_offload_applies)."""
    from lit_qlora.train.args import require_offload_applies

    require_offload_applies(choice, cuda, checkpoint_blocks > 0)
    if choice is True:
        return True, "--train.offload_activations true"
    if choice is False:
        return False, "--train.offload_activations false"
    if not cuda:
        return False, "auto: not on CUDA"
    if checkpoint_blocks == 0:
        return False, "auto: no activation checkpointing"
    size = f"{input_bytes / (1 << 30):.2f} GiB of checkpointed block inputs per micro-batch"
    if input_bytes < AUTO_MIN_BYTES:
        return False, f"auto: {size}, under {AUTO_MIN_BYTES >> 30} GiB"
    if device_total is not None and input_bytes < AUTO_MIN_DEVICE_SHARE * device_total:
        return False, (f"auto: {size}, under 1/{round(1 / AUTO_MIN_DEVICE_SHARE)} of the card's "
                       f"{device_total / (1 << 30):.1f} GiB: too little saved to be worth the copies")
    if host_available is not None and input_bytes > AUTO_MAX_HOST_SHARE * host_available:
        return False, f"auto: {size}, more than half the host's available memory ({host_available / (1 << 30):.1f} GiB)"
    share = "" if device_total is None else f" and 1/{round(1 / AUTO_MIN_DEVICE_SHARE)} of the card's memory"
    return True, f"auto: {size}, at least {AUTO_MIN_BYTES >> 30} GiB{share}"
