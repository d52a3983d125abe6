"""`FinetuneModule`: the LoRA model under manual optimization, one `training_step` per optimizer step."""

from __future__ import annotations

import itertools
import math
import time
from contextlib import nullcontext
from typing import Any, Callable, Optional, Sequence

import lightning as L
import torch

from lit_qlora.train.compile import compile_blocks, compile_seconds, is_compiled
from lit_qlora.base.errors import NonFinite
from lit_qlora.memory.accounting import peak_memory_stats
from lit_qlora.model.moe import auxiliary_loss, moe_blocks, router_load
from lit_qlora.model.transformer import Transformer
from lit_qlora.parallel.distributed import full, no_gradient_sync, reshard, shard_model
from lit_qlora.parallel.tensor_parallel import average_over_data, parallelize
from lit_qlora.train.args import TrainArgs
from lit_qlora.train.loss import lm_loss_sum, target_count
from lit_qlora.train.tensorboard import TAGS


def lr_multiplier(step: int, warmup: int, total: int) -> float:
    """Linear warmup to 1, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class FinetuneModule(L.LightningModule):
    """One `training_step` is one optimizer step over all of its micro-batches, with the loss token-weighted across
    them (an accumulated step equals one large batch). Each step appends its row to `history` and logs its numbers
    through `self.log` (TensorBoard); `lit_qlora.train.callbacks` does the rest (metrics.jsonl, checkpoints,
    signals, heap release)."""

    def __init__(self, model: Transformer, train: TrainArgs, total_steps: int, start_step: int = 0,
                 compile: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = model
        self.train_args = train
        self.total_steps, self.start_step = total_steps, start_step
        # One row per optimizer step of this process: metrics.jsonl's columns plus the step's `seconds`.
        self.history: list[dict[str, Any]] = []
        self.val_loss: Optional[float] = None
        # An objective's own numbers (lit_qlora.methods.dpo: rewards/chosen, ...): the step's, in its metrics row
        # and under train/ in the loggers; the last validation's, in its metrics row and under eval/.
        self.extra_metrics: dict[str, float] = {}
        self.routed_tokens: list[torch.Tensor] = []
        """A mixture of experts' tokens per expert and layer in this step so far (count_routed_tokens)."""
        self.val_metrics: dict[str, float] = {}
        self.initial_val_loss: Optional[float] = None  # before the run's first step (a resumed run: from its checkpoint)
        self.initial_val_metrics: dict[str, float] = {}
        # --train.eval_interval: what the validations during training decided (lit_qlora.train.validation), which
        # each checkpoint records; None without it.
        self.validation_record: Optional[Any] = None
        self._val = [0.0, 0]
        self._last_step_end: Optional[float] = None
        # --compile: the blocks are compiled once the model is laid out (configure_model); each step's row counts
        # the seconds it spent compiling, so warm-up steps can be told from steady ones.
        self.compile_enabled = compile
        self._compile_mark = 0.0

    @property
    def step(self) -> int:
        """Optimizer steps completed, counting those before a resume."""
        return self.start_step + self.trainer.global_step

    def on_train_start(self) -> None:
        self._last_step_end = None
        if not self.compile_enabled:  # (compiled blocks do not fuse projections)
            self.model.share_projection_storage()  # again on the device Lightning moved the model to
        self._compile_mark = compile_seconds() if self.compile_enabled else 0.0

    # Lightning moves the module to its device for every fit and validate, and to the CPU when each ends. A move
    # replaces every NF4 weight (a tensor subclass) by a swapped-in copy even when nothing moves, which fails once
    # compiled graphs were traced with those weights (the fake-tensor records they keep hold weak references to
    # them). So a move to where every tensor already is does nothing, and with --compile the module stays on its
    # device after a fit (the next validate would move it back). One thing the move did still matters under FSDP2:
    # it reshards first. The root unit keeps its parameters gathered after a forward (the validation's, under
    # inference mode); without the reshard every step after the first diverged from eager (tests/test_compile.py).
    # Only with --compile (or an objective's own compiled code: `traces_weights`), so eager runs keep Lightning's
    # moves as they are.
    def to(self, *args: Any, **kwargs: Any) -> FinetuneModule:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if self.traces_weights() and device is not None and dtype is None and memory_format is None \
                and self._all_on(device):
            reshard(self.model)
            return self
        return super().to(*args, **kwargs)

    def cpu(self) -> FinetuneModule:
        if self.traces_weights() and (self._all_on(torch.device("cpu")) or self.traced_weights()):
            return self
        return super().cpu()

    def traces_weights(self) -> bool:
        """Whether this run compiles graphs with the weights (--compile's blocks; an objective may add its own)."""
        return self.compile_enabled

    def traced_weights(self) -> bool:
        """Whether such graphs exist now (then a move would fail: see `to`)."""
        return any(is_compiled(b) for b in self.model.blocks)

    def _all_on(self, device: torch.device) -> bool:
        return all(t.device == device for t in itertools.chain(self.parameters(), self.buffers()))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """What an objective keeps between steps beyond the adapter and optimizer, for a checkpoint (rank 0's is
        written); SFT keeps nothing."""
        return {}

    def restore_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take back what `checkpoint_tensors` gave, as a resumed run starts."""

    def configure_model(self) -> None:
        # Lightning's ModelParallelStrategy hands over a device mesh: --strategy tp splits the blocks over its
        # tensor-parallel dimension, --strategy fsdp shards with FSDP2 over the data-parallel one.
        if self.tensor_parallel_size > 1:
            parallelize(self.model, self.device_mesh["tensor_parallel"])
        elif self.device_mesh is not None:
            shard_model(self.model, self.device_mesh["data_parallel"])
        if self.compile_enabled:  # after sharding: each compiled block then sees its final (sharded) layout
            compile_blocks(self.model)

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
        optimizer = torch.optim.AdamW(params, **self.train_args.adamw(), fused=fused)
        warmup, total, offset = self.train_args.warmup_steps, self.total_steps, self.start_step
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s + offset, warmup, total))
        return [optimizer], [scheduler]

    def micro_loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = lm_loss_sum(self.model, batch["input_ids"], batch["labels"], batch.get("positions"))
        self.count_routed_tokens()
        aux = auxiliary_loss(self.model)  # a mixture of experts whose router trains: its load-balancing term
        return loss if aux is None else loss + aux * target_count(batch["labels"])

    def with_router_aux(self, loss: torch.Tensor, weight: float) -> torch.Tensor:
        """`loss` plus `weight` x the last forward's load-balancing term while a mixture of experts' router trains
        (dpo and grpo: each forward's term, averaged over the step's forwards, as transformers adds it per forward)."""
        aux = auxiliary_loss(self.model)
        return loss if aux is None else loss + aux * weight

    def count_routed_tokens(self) -> None:
        """Add the last forward's tokens per expert of every MoE block to the step's (logged as the router's load)."""
        loads = [block.load for block in moe_blocks(self.model) if block.load is not None]
        if loads:
            steps = self.routed_tokens or [torch.zeros_like(load) for load in loads]
            self.routed_tokens = [total + load for total, load in zip(steps, loads)]

    def global_router_load(self) -> dict[str, float]:
        """The step's router load over every rank's tokens (each rank routed its own share of the batch)."""
        if not self.routed_tokens:
            return {}
        return router_load(list(self.sum_over_data(torch.stack(self.routed_tokens).double())))

    def global_target_count(self, micro_batches: list[dict[str, Any]]) -> torch.Tensor:
        count = torch.tensor(float(sum(target_count(mb["labels"]) for mb in micro_batches)), device=self.device,
                             dtype=torch.float32)
        return self.sum_over_data(count)

    def training_step(self, micro_batches: list[dict[str, Any]], batch_idx: int) -> torch.Tensor:
        # A step's time runs from the previous step's end, so data loading counts too.
        started = self._last_step_end or time.perf_counter()
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        lr = scheduler.get_last_lr()[0]
        loss = self.accumulate_gradients(micro_batches)
        step = self.step + 1
        precision = self.trainer.precision_plugin
        loss_scale = getattr(precision, "loss_scale", lambda: None)()
        if loss_scale is not None:
            precision.unscale_gradients(optimizer)  # 16-mixed: the checks, norm and clipping see true gradients
        problem = self.nonfinite_problem(loss)
        overflow = problem is not None and loss_scale is not None and bool(torch.isfinite(loss))
        if overflow:
            # Dynamic loss scaling at work, not a diverging run: the scaler skips this update and halves its scale.
            problem = f"The gradients overflowed fp16 at loss scale {loss_scale:g} (loss {loss.item():.4f})"
        if problem and self.train_args.on_nonfinite == "stop" and not overflow:
            raise NonFinite(
                f"{problem} at optimizer step {step}; nothing from this step was saved (earlier checkpoints are "
                "unaffected). Lower --train.lr, use --precision bf16-true, 16-mixed or 32-true instead of 16-true, or "
                "pass --train.on_nonfinite skip to skip such batches; then resume with --resume auto."
            )
        grad_norm = None
        if problem:
            # Drop the gradients but still step: parameters without gradients are left untouched, and the step
            # count, schedule and data position stay in line with an ordinary step.
            optimizer.zero_grad(set_to_none=True)
            self.print(f"step {step}: {problem.lower()}, batch skipped")
        else:
            grad_norm = self.grad_norm()
            if self.train_args.max_norm > 0:
                self.clip_gradients(optimizer, gradient_clip_val=self.train_args.max_norm,
                                    gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        tokens = self.sum_over_data(
            torch.tensor(float(sum(mb["num_tokens"] for mb in micro_batches)), device=self.device, dtype=torch.float64))
        self.record_step(step, None if problem else loss.item(), lr, grad_norm, int(tokens.item()), started, problem)
        return loss

    def accumulate_gradients(self, micro_batches: list[dict[str, Any]]) -> torch.Tensor:
        """Forward and backward every micro-batch; returns the step's token-weighted mean loss over all ranks."""
        targets = self.global_target_count(micro_batches).clamp(min=1)

        def loss_of(mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
            mb_loss = self.micro_loss_sum(mb)
            return mb_loss / targets, mb_loss.detach()

        # Explicit fp32: the precision plugin makes bf16 the default dtype inside steps.
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for mb_loss in self.backward_each(micro_batches, loss_of):
            loss_sum += mb_loss
        if self.tensor_parallel_size > 1:
            average_over_data(self.model, self.device_mesh["data_parallel"])
        return self.sum_over_data(loss_sum) / targets

    def backward_each(self, parts: Sequence[Any], loss_of: Callable[[Any], tuple[torch.Tensor, Any]],
                      router_aux_weight: Optional[float] = None) -> list[Any]:
        """The step's micro-batch loop, every method's: `loss_of(part)` gives the part's share of the step's loss
        (divided by the global batch's count) and what to keep of it, which the loop returns, one per part. With
        `router_aux_weight`, a training router's load-balancing term of the part's forward joins its backward."""
        # DDP and FSDP2 average gradients over ranks; scaling by the number of data-parallel ranks makes that
        # average the sum over all ranks' parts: one process's gradient on the global batch.
        data_ranks = self.trainer.world_size // self.tensor_parallel_size
        kept = []
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            # Only the last part's backward reduces gradients across ranks: once per step, not per micro-batch.
            with nullcontext() if last else no_gradient_sync(self, self.trainer.strategy):
                loss, keep = loss_of(part)
                if router_aux_weight is not None:
                    loss = self.with_router_aux(loss, router_aux_weight)
                self.manual_backward(loss * data_ranks)
            kept.append(keep)
        return kept

    def record_step(self, step: int, loss: Optional[float], lr: float, grad_norm: Optional[float], tokens: int,
                    started: float, skipped: Optional[str]) -> None:
        """Append the step's row to `history` and log its numbers under their TensorBoard tags (Lightning sends
        them to TensorBoard every `log_every_n_steps`, under the run's own step)."""
        self._last_step_end = time.perf_counter()
        seconds = self._last_step_end - started
        peak_memory = max(peak_memory_stats(self.device).values())
        routing, self.routed_tokens = self.global_router_load(), []
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "tokens_per_sec": tokens / max(seconds, 1e-9), "peak_memory_bytes": peak_memory, "tokens": tokens,
               **self.extra_metrics, **routing, **({"skipped": skipped} if skipped else {}), **self._step_compile_seconds()}
        self.history.append({**row, "seconds": seconds})
        # A skipped step logs NaN for its loss and gradient norm: left out, Lightning would repeat the last ones.
        numbers = {TAGS[k]: float("nan") if v is None else float(v) for k, v in row.items() if k in TAGS}
        numbers.update({f"train/{k}": float(v) for k, v in self.extra_metrics.items()})
        numbers.update(routing)  # (already tagged router/...)
        self.log_dict({**numbers, "step": float(step)})  # "step": Lightning's logger takes it as the x-axis value

    def _step_compile_seconds(self) -> dict[str, float]:
        """{"compile_seconds": what this step spent compiling} with --compile, else nothing."""
        if not self.compile_enabled:
            return {}
        total = compile_seconds()
        seconds, self._compile_mark = total - self._compile_mark, total
        return {"compile_seconds": round(seconds, 3)}

    def nonfinite_problem(self, loss: torch.Tensor) -> Optional[str]:
        """'The loss became nan' / 'The gradients became non-finite', or None for a healthy step."""
        if not torch.isfinite(loss):
            return f"The loss became {loss.item()}"
        grads = self.gradients()
        # The largest |gradient| is finite exactly when all are (a 2-norm could overflow in fp16 on its own).
        norm = full(torch.nn.utils.get_total_norm(grads, norm_type=float("inf"))) if grads else torch.zeros(())
        norm = self.trainer.strategy.reduce(norm.float(), reduce_op="sum")  # any rank's inf/nan reaches all
        if not torch.isfinite(norm):
            return f"The gradients became non-finite (loss {loss.item():.4f})"
        return None

    def grad_norm(self) -> float:
        """Global L2 norm of the (rank-reduced) gradients before clipping."""
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

    def reduced_val_loss(self) -> float:
        """The validation loss of the batches seen since `on_validation_epoch_start`, token-weighted over all ranks."""
        totals = self.trainer.strategy.reduce(torch.tensor(self._val, device=self.device, dtype=torch.float64),
                                              reduce_op="sum")
        return (totals[0] / totals[1].clamp(min=1)).item()

    def on_validation_epoch_end(self) -> None:
        self.val_loss = self.reduced_val_loss()
        # Every rank holds the same reduced value: sync_dist only tells Lightning so (it averages equal numbers).
        self.log_dict({**self.validation_scalars(), "step": float(self.step)}, sync_dist=True)

    def validation_scalars(self) -> dict[str, float]:
        """The last validation's numbers by logger tag."""
        return {TAGS["val_loss"]: self.val_loss}
