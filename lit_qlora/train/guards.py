"""Out-of-memory failures in the middle of a run (or a command's loading) turned into errors a user can act on: the
settings that lower memory. (Non-finite weights: lit_qlora.checkpoint.files.require_finite.)"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from lit_qlora.base.errors import UserError


class OutOfMemory(UserError, RuntimeError):
    """Training ran out of GPU or CPU memory; the message names the settings that lower it."""


def is_oom(error: BaseException) -> bool:
    # CPU allocations that fail raise MemoryError or a RuntimeError from torch's allocator.
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


@contextmanager
def oom_advice(where: Callable[[], str], settings: str, quantized: bool) -> Iterator[None]:
    """Re-raise out-of-memory errors inside the block as OutOfMemory: where it happened and what to change."""
    try:
        yield
    except BaseException as e:
        if not is_oom(e):
            raise
        device = "GPU" if isinstance(e, torch.OutOfMemoryError) else "CPU"
        nf4 = "" if quantized else ", or quantize the base with --quantize nf4"
        offload = " (with it, --train.offload_activations true keeps the block inputs in host memory)" \
            if device == "GPU" else ""
        raise OutOfMemory(
            f"Out of {device} memory {where()} ({settings}). Lower --train.micro_batch_size (the global batch stays "
            "the same: more accumulation steps), lower --train.max_seq_length, or turn on "
            f"--train.activation_checkpointing true{offload}{nf4}; resume with --resume auto."
        ) from None
