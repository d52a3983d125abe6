"""One `litqlora finetune` optimizer step without the Trainer around it, for the profiling scripts.

Loads the base (NF4 for "nf4", `dtype` for "none", bf16 unless told; a preset name instead of a directory: random
weights), adds LoRA (r=8, alpha=16, in `dtype`, on `targets`: every linear unless told), and returns the model, its
optimizer and `step()`: FinetuneModule.micro_loss_sum on fixed random tokens (seed 0), backward, clipping at
1.0, fused AdamW, with the HeapRelease callback's heap-release checks on CPU (before backward, around each block, after
the update).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lit_qlora  # noqa: F401  (before torch: sets the OpenMP wait policy `litqlora` runs with, read as libgomp loads)
import torch

from lit_qlora.model.presets import PRESETS
from lit_qlora.checkpoint.loading import load_model, random_base
from lit_qlora.lora.layer import apply_lora
from lit_qlora.base.threads import govern_threads
from lit_qlora.train.args import TrainArgs
from lit_qlora.train.callbacks import release_heap_around_blocks
from lit_qlora.train.heap import HeapTrimmer
from lit_qlora.train.module import FinetuneModule  # imported here so callers' RSS baselines include Lightning


def build_step(checkpoint_dir: str, quantize: str, batch: int, seq: int, checkpointing: bool, dropout: float = 0.0,
               dtype: torch.dtype = torch.bfloat16, targets: str = "all"):
    torch.manual_seed(0)
    if checkpoint_dir in PRESETS:  # a preset name: its shape with random weights, built as the loader builds it
        model = random_base(PRESETS[checkpoint_dir], quantize, dtype)
    else:
        model = load_model(checkpoint_dir, quantize, "bf16-true" if dtype == torch.bfloat16 else "32-true")
        govern_threads(model)  # as `litqlora finetune` runs it
    apply_lora(model, r=8, alpha=16, dropout=dropout, targets=targets.split(","), dtype=dtype)
    model.checkpoint_blocks = model.config.n_layer if checkpointing else 0
    train = TrainArgs(max_steps=2, micro_batch_size=batch, global_batch_size=batch, max_seq_length=seq,
                      activation_checkpointing=checkpointing)
    module = FinetuneModule(model, train, total_steps=2)
    model.train()
    trimmer = HeapTrimmer()
    release_heap_around_blocks(model, trimmer)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=True)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    tokens = {"input_ids": ids, "labels": ids.clone()}

    def step(before_zero_grad: Optional[Callable[[], Any]] = None) -> Any:
        """One optimizer step; returns what `before_zero_grad` (called with the gradients present) returns."""
        trimmer()
        (module.micro_loss_sum(tokens) / ids.numel()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        result = before_zero_grad() if before_zero_grad is not None else None
        optimizer.zero_grad(set_to_none=True)
        trimmer()
        return result

    return model, optimizer, step
