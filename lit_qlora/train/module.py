"""Training pieces: arguments, the LightningModule (manual, token-weighted accumulation), step-indexed data order."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler

from lit_qlora.data.module import DataArgs, SFTDataModule
from lit_qlora.data.sampler import epoch_order
from lit_qlora.train.loss import chunked_cross_entropy_sum, target_count
from lit_qlora.memory import release_free_memory
from lit_qlora.model import Transformer


@dataclass
class LoRAArgs:
    r: int = 8
    """Rank of the adapters."""
    alpha: float = 16.0
    """Scale numerator: updates are multiplied by alpha / r (alpha / sqrt(r) with rslora)."""
    dropout: float = 0.05
    """Dropout on the adapters' input."""
    targets: list[str] = field(default_factory=lambda: ["all"])
    """Projections that get adapters: q, k, v, o, gate, up, down, lm_head, or all."""
    rslora: bool = False
    """Rank-stabilized scaling alpha / sqrt(r)."""


@dataclass
class TrainArgs:
    max_steps: Optional[int] = None
    """Optimizer steps to run; default: `epochs` passes over the training split."""
    epochs: int = 1
    """Passes over the training split when max_steps is not set."""
    micro_batch_size: int = 4
    """Samples per forward/backward pass."""
    global_batch_size: int = 16
    """Samples per optimizer step; accumulates global / (micro * devices) micro-batches."""
    max_seq_length: int = 512
    """Samples are truncated to this many tokens."""
    lr: float = 2e-4
    """Peak learning rate (AdamW), reached after warmup, then cosine decay."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    weight_decay: float = 0.0
    """AdamW weight decay on the adapters."""
    max_norm: float = 1.0
    """Gradient clipping (global norm); 0 disables it."""
    save_interval: Optional[int] = None
    """Write a resumable checkpoint every N optimizer steps (and always at the end)."""
    log_interval: int = 1
    """Write metrics every N optimizer steps."""
    activation_checkpointing: Union[bool, int] = False
    """Recompute block activations in backward: true (all blocks), false, or N (the first N blocks)."""
    keep_last: int = 2
    """Resumable checkpoints to keep (older ones are deleted)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss stops the run (naming the step), or skips that batch's update."""

    def accumulation(self, world_size: int) -> int:
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of train.micro_batch_size "
                f"x devices ({self.micro_batch_size} x {world_size} = {per_step})."
            )
        return self.global_batch_size // per_step


def lr_multiplier(step: int, warmup: int, total: int) -> float:
    """Linear warmup to 1, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class StepSampler(Sampler[list[int]]):
    """One item per optimizer step: this rank's sample indices of global batch `step`.

    The order is a pure function of (seed, epoch), so starting at `start_step` replays exactly what an
    uninterrupted run would have seen from there; each epoch drops its last partial global batch.
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int, start_step: int, total_steps: int,
                 rank: int = 0, world_size: int = 1) -> None:
        self.steps_per_epoch = num_samples // global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"The training split has {num_samples} samples, fewer than one global batch "
                             f"({global_batch}). Lower train.global_batch_size or add data.")
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.start_step, self.total_steps, self.rank, self.world_size = start_step, total_steps, rank, world_size

    def __len__(self) -> int:
        return self.total_steps - self.start_step

    def __iter__(self):
        order, order_epoch = None, -1
        for step in range(self.start_step, self.total_steps):
            epoch, index = divmod(step, self.steps_per_epoch)
            if epoch != order_epoch:
                order, order_epoch = epoch_order(self.num_samples, self.seed, epoch), epoch
            batch = order[index * self.global_batch : (index + 1) * self.global_batch]
            yield batch[self.rank :: self.world_size]


class MicroBatches:
    """Collate one step's samples into its micro-batches (each a padded dict, plus its non-padding token count)."""

    def __init__(self, collate, micro_batch_size: int) -> None:
        self.collate, self.micro_batch_size = collate, micro_batch_size

    def __call__(self, samples) -> list[dict[str, Any]]:
        out = []
        for i in range(0, len(samples), self.micro_batch_size):
            part = samples[i : i + self.micro_batch_size]
            batch = self.collate(part)
            batch["num_tokens"] = sum(len(s) for s in part)
            out.append(batch)
        return out


def _release_heap_around_block(block: torch.nn.Module, args, output) -> None:
    """CPU training: return freed heap to the OS after each block's forward and before its backward.

    glibc serves the blocks' multi-MB temporaries from the heap (its mmap threshold rises to 32 MB) and cannot
    reuse the holes that the longer-lived checkpointed block inputs leave between them, so RSS climbed by ~200 MB
    over a forward and ~300 MB over a backward of a 1.1B model at 1x512 (benchmarks/README.md). Trimming once per
    block keeps RSS near what is live: whole-run peak 1569 -> 1395 MiB, at ~11 ms per trim."""
    if not (block.training and torch.is_grad_enabled()):
        return
    release_free_memory()
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(_release_before_backward)


def _release_before_backward(grad: torch.Tensor) -> None:
    release_free_memory()


class FinetuneModule(L.LightningModule):
    """The LoRA model under manual optimization: one `training_step` is one optimizer step over all of its
    micro-batches, with the loss token-weighted across them (an accumulated step equals one large batch)."""

    def __init__(self, model: Transformer, train: TrainArgs, total_steps: int, start_step: int = 0) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = model
        self.train_args = train
        self.total_steps, self.start_step = total_steps, start_step
        self.history: list[dict[str, float]] = []  # one row per optimizer step (this process)
        self.on_step = None  # set by the runner: called after every optimizer step with the row
        self.on_train_start_hook = None  # set by the runner: restores a resumed run's state
        self._val = [0.0, 0]
        self._last_step_end: Optional[float] = None
        self._heap_hooks: list = []

    @property
    def step(self) -> int:
        """Optimizer steps completed, counting those before a resume."""
        return self.start_step + self.trainer.global_step

    def on_train_start(self) -> None:
        if self.on_train_start_hook is not None:
            self.on_train_start_hook()
        self._last_step_end = None
        self.release_heap_around_blocks()

    def configure_model(self) -> None:
        # Lightning's ModelParallelStrategy hands over a device mesh: --strategy tp splits the blocks over its
        # tensor-parallel dimension, --strategy fsdp shards with FSDP2 over the data-parallel one.
        if self.tensor_parallel_size > 1:
            from lit_qlora.parallel.tensor_parallel import parallelize

            parallelize(self.model, self.device_mesh["tensor_parallel"])
        elif self.device_mesh is not None:
            from lit_qlora.parallel.distributed import shard_model

            shard_model(self.model, self.device_mesh["data_parallel"])

    @property
    def tensor_parallel_size(self) -> int:
        return self.device_mesh["tensor_parallel"].size() if self.device_mesh is not None else 1

    def sum_over_data(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks that see different data: the ranks of one tensor-parallel group hold the same."""
        return self.trainer.strategy.reduce(tensor, reduce_op="sum") / self.tensor_parallel_size

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        fused = params[0].device.type in ("cuda", "cpu") and params[0].dtype in (torch.float32, torch.bfloat16,
                                                                                  torch.float16)
        fused = fused and type(params[0]).__name__ != "DTensor"  # FSDP2 shards: the foreach path
        optimizer = torch.optim.AdamW(params, lr=self.train_args.lr, weight_decay=self.train_args.weight_decay,
                                      betas=(0.9, 0.95), fused=fused)
        warmup, total, offset = self.train_args.warmup_steps, self.total_steps, self.start_step
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s + offset, warmup, total))
        return [optimizer], [scheduler]

    def micro_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self.model.forward_hidden(batch["input_ids"])
        return chunked_cross_entropy_sum(self.model.lm_head, hidden, batch["labels"])

    def global_target_count(self, micro_batches: list[dict[str, Any]]) -> torch.Tensor:
        count = torch.tensor(float(sum(target_count(mb["labels"]) for mb in micro_batches)), device=self.device,
                             dtype=torch.float32)
        return self.sum_over_data(count)

    def training_step(self, micro_batches: list[dict[str, Any]], batch_idx: int) -> torch.Tensor:
        # A step's time runs from the previous step's end, so data loading counts too.
        started = self._last_step_end or time.perf_counter()
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        lr = scheduler.get_last_lr()[0]
        targets = self.global_target_count(micro_batches).clamp(min=1)
        # Explicit fp32: the precision plugin makes bf16 the default dtype inside steps.
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        # DDP and FSDP2 average gradients over ranks; scaling by the number of data-parallel ranks makes that
        # average the sum over all ranks' tokens / global target count: one process's gradient on the global batch.
        data_ranks = self.trainer.world_size // self.tensor_parallel_size
        for mb in micro_batches:
            mb_loss = self.micro_loss_sum(mb)
            self.release_host_heap()  # the forward's freed temporaries, before backward's peak
            self.manual_backward(mb_loss * data_ranks / targets)
            loss_sum += mb_loss.detach()
        if self.tensor_parallel_size > 1:
            from lit_qlora.parallel.tensor_parallel import average_over_data

            average_over_data(self.model, self.device_mesh["data_parallel"])
        loss = self.sum_over_data(loss_sum) / targets
        step = self.step + 1
        problem = self.nonfinite_problem(loss, optimizer)
        if problem:
            if self.train_args.on_nonfinite == "stop":
                raise FloatingPointError(
                    f"{problem} at optimizer step {step}; nothing from this step was saved (earlier checkpoints are "
                    "unaffected). Lower --train.lr, use --precision bf16-true or 32-true instead of 16-true, or "
                    "pass --train.on_nonfinite skip to skip such batches; then resume with --resume auto."
                )
            # Drop the gradients but still step: parameters without gradients are left untouched, and the step
            # count, schedule and data position stay in line with an ordinary step.
            optimizer.zero_grad(set_to_none=True)
            optimizer.step()
            scheduler.step()
            self.print(f"step {step}: {problem.lower()}, batch skipped")
            grad_norm = None
        else:
            grad_norm = self.grad_norm()
            if self.train_args.max_norm > 0:
                self.clip_gradients(optimizer, gradient_clip_val=self.train_args.max_norm,
                                    gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        self.release_host_heap()
        tokens = self.sum_over_data(
            torch.tensor(float(sum(mb["num_tokens"] for mb in micro_batches)), device=self.device, dtype=torch.float64))
        self._last_step_end = time.perf_counter()
        row = {"step": step, "loss": None if problem else loss.item(), "lr": lr, "grad_norm": grad_norm,
               "tokens": int(tokens.item()), "seconds": self._last_step_end - started,
               **({"skipped": problem} if problem else {})}
        self.history.append(row)
        if not problem:
            self.log("loss", row["loss"], prog_bar=True, logger=False)
        if self.on_step is not None:
            self.on_step(row)
        return loss

    def release_heap_around_blocks(self) -> None:
        """On CPU, release freed heap after each block's forward and before its backward (once per module)."""
        if self.device.type == "cpu" and not self._heap_hooks:
            self._heap_hooks = [block.register_forward_hook(_release_heap_around_block) for block in self.model.blocks]

    def release_host_heap(self) -> None:
        """On CPU, hand the heap that freed activations leave behind back to the OS (glibc's malloc_trim).

        glibc keeps freed blocks below its (dynamic, up to 32 MB) mmap threshold in the heap: on a 1.1B model at
        1x512 (checkpointing on) a QLoRA step left ~0.5 GB of freed activations resident, and the next backward
        stacked its own peak on top: peak RSS after 2 steps 2.05 GB without this, 1.71 GB with it (same script).
        Costs re-faulting those pages once per step; a no-op on GPUs and outside Linux."""
        if self.device.type == "cpu":
            release_free_memory()

    def nonfinite_problem(self, loss: torch.Tensor, optimizer) -> Optional[str]:
        """'The loss became nan' / 'The gradients became non-finite', or None for a healthy step."""
        if not torch.isfinite(loss):
            return f"The loss became {loss.item()}"
        from lit_qlora.parallel.distributed import full

        grads = self.gradients()
        # The largest |gradient| is finite exactly when all are (a 2-norm could overflow in fp16 on its own).
        norm = full(torch.nn.utils.get_total_norm(grads, norm_type=float("inf"))) if grads else torch.zeros(())
        norm = self.trainer.strategy.reduce(norm.float(), reduce_op="sum")  # any rank's inf/nan reaches all
        if not torch.isfinite(norm):
            return f"The gradients became non-finite (loss {loss.item():.4f})"
        return None

    def grad_norm(self) -> float:
        """Global L2 norm of the (rank-reduced) gradients before clipping."""
        from lit_qlora.parallel.distributed import full

        grads = self.gradients()
        return full(torch.nn.utils.get_total_norm(grads)).item() if grads else 0.0

    def gradients(self) -> list[torch.Tensor]:
        """The adapters' gradients (DTensor shards under FSDP2 / tensor parallelism)."""
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def on_validation_epoch_start(self) -> None:
        self._val = [0.0, 0]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._val[0] += self.micro_loss_sum(batch).item()
        self._val[1] += target_count(batch["labels"])

    def on_validation_epoch_end(self) -> None:
        totals = self.trainer.strategy.reduce(torch.tensor(self._val, device=self.device, dtype=torch.float64),
                                              reduce_op="sum")
        self.val_loss = (totals[0] / totals[1].clamp(min=1)).item()


def train_loader(dm: SFTDataModule, train: TrainArgs, seed: int, start_step: int, total_steps: int,
                 rank: int, world_size: int) -> DataLoader:
    sampler = StepSampler(len(dm.train_set), train.global_batch_size, seed, start_step, total_steps, rank,
                          world_size)
    return DataLoader(dm.train_set, batch_sampler=sampler, collate_fn=MicroBatches(dm.collate, train.micro_batch_size),
                      num_workers=dm.args.num_workers)


def total_steps_for(train: TrainArgs, num_samples: int) -> int:
    if train.max_steps is not None:
        if train.max_steps < 1:
            raise ValueError(f"train.max_steps must be at least 1, got {train.max_steps}.")
        return train.max_steps
    return train.epochs * max(1, num_samples // train.global_batch_size)


def args_dict(obj: Any) -> dict:
    return asdict(obj) if hasattr(obj, "__dataclass_fields__") else dict(obj)
