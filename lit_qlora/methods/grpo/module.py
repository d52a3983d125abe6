"""`GRPOModule`: `FinetuneModule`'s optimizer step, checkpoints and validation with GRPO's objective.

A step samples `num_generations` completions of each of its prompts on the training model (eval mode: no adapter
dropout), scores them with the reward functions, and turns the rewards into advantages within each group; then
forwards and backwards the completions in micro-batches of `micro_batch_size` rows, their part of the loss each
(lit_qlora.methods.grpo.loss). With `num_iterations` above 1, a batch of rollouts trains that many steps, against the
log-probabilities of the policy that sampled them. A validation scores greedy completions of the validation prompts;
its "loss" is minus the mean reward, so best/ and early stopping keep the most rewarded adapter."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lit_qlora.data.prompts import prompt_text
from lit_qlora.methods.grpo.args import GRPOArgs
from lit_qlora.methods.grpo.loss import StepCounts, advantages, micro_loss, token_terms
from lit_qlora.methods.grpo.rewards import Reward, score, total
from lit_qlora.methods.grpo.rollout import EAGER, Decoder, sample_group
from lit_qlora.parallel.distributed import reshard
from lit_qlora.train.module import FinetuneModule
from lit_qlora.train.policy import evaluating, reference_policy, token_logps
from lit_qlora.train.validation import SAMPLES_FILE

EVAL_PREFIX = "eval_"  # TRL's names for an evaluation: eval_ + the training name
LOGGED_PROMPTS = 2  # prompts (with their whole group) samples.jsonl keeps at each logging step


def rollout_seed(seed: int, step: int, position: int) -> int:
    """The sampling seed of the prompt at `position` of step `step`'s global batch: a pure function, so a resumed
    run (or one on another number of ranks) samples what the uninterrupted run did."""
    digest = hashlib.sha256(f"{seed}/{step}/{position}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class Rollouts:
    """One batch of rollouts (this rank's share of a step): sequences, where their completions start and end, their
    rewards and advantages, and the log-probabilities kept from when they were sampled."""

    sequences: list[torch.Tensor]  # prompt + completion ids, each [P + C]
    prompt_lengths: list[int]
    completion_lengths: list[int]
    stopped: torch.Tensor  # bool [N]: ended with a stop token (else cut at max_completion_length)
    per_function: torch.Tensor  # [N, F], NaN where a function returned None
    rewards: torch.Tensor  # [N] weighted sum
    advantages: torch.Tensor  # [N]
    old_logps: Optional[list[torch.Tensor]] = None  # per row [C]: the sampling policy's (num_iterations > 1)
    ref_logps: Optional[list[torch.Tensor]] = None  # per row [C]: the reference's (beta > 0)
    step: int = 0  # the step that sampled them


def completion_batch(rollouts: Rollouts, rows: range, pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Rows of `rollouts` as one right-padded forward: input_ids [B, T], and for the completion tokens in row order,
    the flat index of the hidden state predicting each (src), the token (tgt), and mask [B, C] (C: the longest)."""
    seqs = [rollouts.sequences[i] for i in rows]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    src, tgt = [], []
    lengths = [rollouts.completion_lengths[i] for i in rows]
    for b, (i, seq) in enumerate(zip(rows, seqs)):
        ids[b, : len(seq)] = seq
        p = rollouts.prompt_lengths[i]
        src.append(torch.arange(p - 1, len(seq) - 1) + b * width)
        tgt.append(seq[p:])
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    return {"input_ids": ids.to(device), "src": torch.cat(src).to(device), "tgt": torch.cat(tgt).to(device),
            "mask": mask.to(device)}


def completion_logps(model: Any, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """[B, C] log-probabilities of each row's completion tokens (zero past a row's end)."""
    hidden = model.forward_hidden(batch["input_ids"])
    flat = token_logps(model, hidden.reshape(-1, hidden.size(-1))[batch["src"]], batch["tgt"], temperature)
    return torch.zeros(batch["mask"].shape, device=flat.device, dtype=flat.dtype).masked_scatter(batch["mask"], flat)


class GRPOModule(FinetuneModule):
    """`grpo`: the settings; `rewards`: the loaded reward functions; `tokenizer`: for the completions' text and stop
    tokens; `reference_start`: the adapter the reference holds (None: the base with the adapters off); `source`:
    the data's name, for messages about a row."""

    def __init__(self, model, train, total_steps: int, start_step: int = 0, compile: bool = False, *, grpo: GRPOArgs,
                 rewards: list[Reward], tokenizer: Any, reference_start: Optional[dict[str, torch.Tensor]], seed: int,
                 source: str, pad_id: int, out_dir: Optional[Path] = None) -> None:
        super().__init__(model, train, total_steps, start_step, compile=compile)
        self.grpo, self.reward_fns, self.tokenizer = grpo, rewards, tokenizer
        self.reference_start, self.seed, self.source, self.pad_id = reference_start, seed, source, pad_id
        self.out_dir = out_dir  # samples.jsonl gets a few prompts' completions at each logging step
        self.rollouts: Optional[Rollouts] = None
        self._val_rows: list[torch.Tensor] = []
        self.decoder = Decoder(train.max_seq_length) if grpo.compile_decode else EAGER

    def traces_weights(self) -> bool:  # --grpo.compile_decode: the decode step's graph holds the weights too
        return super().traces_weights() or self.decoder.compiled

    def traced_weights(self) -> bool:
        return super().traced_weights() or self.decoder.traced

    # ------------------------------------------------------------------------------------------------- rollouts

    def sample(self, prompts: list[Any], step: int, temperature: float, n: int, rank: int, ranks: int,
               ) -> tuple[list[Any], list[list[int]], list[bool]]:
        """n completions of each prompt, on this rank (the prompt at local index i is the step's i * ranks + rank):
        (the prompt samples, one per completion), the completions' ids, whether each stopped."""
        g = self.grpo
        owners, completions, stopped = [], [], []
        device = self.model.model.embed_tokens.weight.device
        try:
            with evaluating(self.model):
                for i, prompt in enumerate(prompts):
                    seed = rollout_seed(self.seed, step, i * ranks + rank)
                    group = sample_group(self.model, prompt.input_ids.tolist(), n, g.max_completion_length,
                                         temperature, g.top_k, g.top_p, self.tokenizer.eos_ids,
                                         torch.Generator(device=device).manual_seed(seed), self.decoder)
                    owners += [prompt] * n
                    completions += group.completions
                    stopped += group.stopped
        finally:
            reshard(self.model)
        return owners, completions, stopped

    def rewards_of(self, owners: list[Any], completions: list[list[int]]) -> torch.Tensor:
        """[N, F] each reward function's reward for each completion (TRL's calling convention)."""
        prompts = [p.row["prompt"] for p in owners]
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completions]
        shown = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]
        names = sorted({k for p in owners for k in p.row if k != "prompt"})
        columns = {k: [p.row.get(k) for p in owners] for k in names}
        return score(self.reward_fns, prompts, shown, completions, columns, [p.number for p in owners], self.source)

    def make_rollouts(self, prompts: list[Any], step: int) -> Rollouts:
        g, ranks = self.grpo, self.trainer.world_size
        started = time.perf_counter()
        owners, completions, stopped = self.sample(prompts, step, g.temperature, g.num_generations,
                                                   self.trainer.global_rank, ranks)
        self.rollout_seconds = time.perf_counter() - started  # this rank's sampling, for the step's metrics
        per_function = self.rewards_of(owners, completions).to(self.device)
        rewards = total(per_function, self.reward_fns)
        batch_std = None
        if g.scaling == "batch":  # every rank's rewards: sums, then the unbiased std
            n, s, sq = self.sum_over_data(torch.stack([torch.tensor(float(len(rewards)), device=self.device,
                                                                   dtype=torch.float64),
                                                       rewards.double().sum(), rewards.double().square().sum()]))
            batch_std = ((sq - s * s / n) / (n - 1).clamp(min=1)).clamp(min=0).sqrt().float()
        sequences = [torch.cat([p.input_ids, torch.tensor(c, dtype=torch.long)]) for p, c in zip(owners, completions)]
        rollouts = Rollouts(sequences, [len(p) for p in owners], [len(c) for c in completions],
                            torch.tensor(stopped, device=self.device), per_function, rewards,
                            advantages(rewards, g.num_generations, g.scaling, batch_std), step=step)
        self.log_completions(owners, completions, per_function, rewards, step + 1)
        if g.num_iterations > 1:
            rollouts.old_logps = self.fixed_logps(rollouts, None)
        if g.uses_reference:
            rollouts.ref_logps = self.fixed_logps(rollouts, self.reference_start, reference=True)
        return rollouts

    def log_completions(self, owners: list[Any], completions: list[list[int]], per_function: torch.Tensor,
                        rewards: torch.Tensor, step: int) -> None:
        """At a logging step, rank 0's first LOGGED_PROMPTS prompts with every completion of their group and its
        rewards, appended to samples.jsonl (beside the validations' replies, which have `reply` instead)."""
        if self.out_dir is None or not self.trainer.is_global_zero or step % self.train_args.log_interval:
            return
        g = self.grpo.num_generations
        rows = []
        for first in range(0, min(len(owners), LOGGED_PROMPTS * g), g):
            prompt = owners[first]
            rows.append({"step": step, "prompt": self.tokenizer.decode(prompt.input_ids),
                         "prompt_text": prompt_text({"prompt": prompt.row["prompt"]}), "completions": [
                             {"text": self.tokenizer.decode(completions[i], skip_special_tokens=True),
                              "reward": round(float(rewards[i]), 6),
                              "rewards": {fn.name: None if torch.isnan(per_function[i, k]) else
                                          round(float(per_function[i, k]), 6) for k, fn in enumerate(self.reward_fns)}}
                             for i in range(first, first + g)]})
        with open(Path(self.out_dir) / SAMPLES_FILE, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)

    def fixed_logps(self, rollouts: Rollouts, start: Any, reference: bool = False) -> list[torch.Tensor]:
        """Per row, its completion's log-probabilities without gradients: the reference's, or (eval mode) the
        policy's as it sampled them."""
        out = []
        with reference_policy(self.model, start) if reference else evaluating(self.model), torch.no_grad():
            for rows in micro_batches_of(len(rollouts.sequences), self.train_args.micro_batch_size):
                batch = completion_batch(rollouts, rows, self.pad_id, self.device)
                logps = completion_logps(self.model, batch, self.grpo.temperature)
                out += [logps[b, : rollouts.completion_lengths[i]].detach() for b, i in enumerate(rows)]
        reshard(self.model)
        return out

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """With num_iterations > 1, the batch of rollouts the next steps still train on (a resume mid-batch cannot
        sample it again: the adapter that sampled it is gone). Under DDP each rank holds its own share: every rank
        calls this when a checkpoint is saved, and the shares are gathered under `rank{r}.` names with the number
        of ranks, so a resume on as many ranks gives each its own back."""
        r = self.rollouts
        if self.grpo.num_iterations == 1 or r is None:
            return {}
        tensors = {"sequences": torch.cat(r.sequences), "prompt_lengths": torch.tensor(r.prompt_lengths),
                   "completion_lengths": torch.tensor(r.completion_lengths), "stopped": r.stopped,
                   "per_function": r.per_function, "rewards": r.rewards, "advantages": r.advantages,
                   "step": torch.tensor(r.step)}
        for name in ("old_logps", "ref_logps"):
            if getattr(r, name) is not None:
                tensors[name] = torch.cat(getattr(r, name))
        tensors = {k: v.detach().cpu() for k, v in tensors.items()}
        ranks = self.trainer.world_size
        if ranks == 1:
            return tensors
        shares = {f"rank{rank}.{name}": part for name, t in tensors.items()  # the same names, in the same order,
                  for rank, part in enumerate(self._gather_uneven(t))}     # on every rank: collectives in step
        return shares | {"ranks": torch.tensor(ranks)}

    def _gather_uneven(self, t: torch.Tensor) -> list[torch.Tensor]:
        """`t` as every rank holds it (its shape may differ between ranks), through an all_gather of padded copies."""
        flat = (t.to(torch.uint8) if t.dtype == torch.bool else t).reshape(-1).to(self.device)
        shapes = self.all_gather(torch.tensor([*t.shape, flat.numel()], device=self.device)).reshape(-1, t.dim() + 1)
        padded = torch.zeros(int(shapes[:, -1].max()), dtype=flat.dtype, device=self.device)
        padded[: flat.numel()] = flat
        parts = self.all_gather(padded).reshape(len(shapes), -1).cpu()
        return [part[: int(shape[-1])].reshape(shape[:-1].tolist()).to(t.dtype) for part, shape in zip(parts, shapes)]

    def restore_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        ranks = int(tensors.pop("ranks", 1)) if tensors else 1
        if ranks != self.trainer.world_size:  # other ranks held other shares: the batch is sampled again
            return
        if ranks > 1:
            prefix = f"rank{self.trainer.global_rank}."
            tensors = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not tensors:
            return
        prompt, completion = tensors["prompt_lengths"].tolist(), tensors["completion_lengths"].tolist()
        sequences = list(torch.split(tensors["sequences"], [p + c for p, c in zip(prompt, completion)]))
        move = {k: v.to(self.device) for k, v in tensors.items() if k in ("stopped", "per_function", "rewards",
                                                                          "advantages")}
        self.rollouts = Rollouts(sequences, prompt, completion, **move, step=int(tensors["step"]))
        for name in ("old_logps", "ref_logps"):
            if name in tensors:
                setattr(self.rollouts, name, [t.to(self.device) for t in torch.split(tensors[name], completion)])

    # --------------------------------------------------------------------------------------------------- step

    def accumulate_gradients(self, micro_batches: list[dict[str, Any]]) -> torch.Tensor:
        g, step = self.grpo, self.step
        window = step - step % g.num_iterations  # the step whose rollouts this one trains on
        self.rollout_seconds = 0.0  # a step that trains on earlier rollouts (num_iterations > 1) samples none
        if self.rollouts is None or self.rollouts.step != window:
            self.rollouts = self.make_rollouts(micro_batches[0]["prompts"], window)
        r = self.rollouts
        micro_batches[0]["num_tokens"] = sum(len(s) for s in r.sequences)
        size = self.train_args.micro_batch_size
        parts = micro_batches_of(len(r.sequences), size)
        totals = self.sum_over_data(torch.tensor([float(len(r.sequences)), float(sum(r.completion_lengths)),
                                                  float(len(parts))], device=self.device, dtype=torch.float64))
        counts = StepCounts(totals[0].item(), max(totals[1].item(), 1.0), totals[2].item(), g.max_completion_length)
        sums = train_on(self.model, r, g, size, self.pad_id, self.device, counts,
                        lambda parts, loss_of: self.backward_each(parts, loss_of, router_aux_weight=1 / len(parts)))
        loss_sum, kl_sum, low, high = sums
        self.count_routed_tokens()  # a mixture of experts' router load, from the step's last micro-batch
        self.extra_metrics = self.step_metrics(r, kl_sum, low, high, totals[1].clamp(min=1))
        return self.sum_over_data(loss_sum)

    def step_metrics(self, r: Rollouts, kl_sum: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                     tokens: torch.Tensor) -> dict[str, float]:
        """TRL's metric names, over every rank's completions of the step."""
        g = self.grpo
        metrics = reward_metrics(self, r.per_function, r.rewards, self.reward_fns, g.num_generations)
        lengths = torch.tensor(r.completion_lengths, device=self.device, dtype=torch.float64)
        sums = self.sum_over_data(torch.stack([lengths.sum(), (~r.stopped).double().sum(), kl_sum, low, high,
                                               torch.tensor(float(len(lengths)), device=self.device,
                                                            dtype=torch.float64)]))
        n = sums[5].item()
        extremes = self.all_gather(torch.stack([lengths.min(), -lengths.max()]))
        extremes = extremes.reshape(-1, 2).min(0).values
        metrics.update({
            "completions/mean_length": (sums[0] / n).item(), "completions/min_length": extremes[0].item(),
            "completions/max_length": (-extremes[1]).item(), "completions/clipped_ratio": (sums[1] / n).item(),
            "clip_ratio/low_mean": (sums[3] / tokens).item(), "clip_ratio/high_mean": (sums[4] / tokens).item(),
            "clip_ratio/region_mean": ((sums[3] + sums[4]) / tokens).item(),
            "rollout_seconds": self.rollout_seconds,  # of the step's seconds: generation's share
        })
        if g.uses_reference:
            metrics["kl"] = (sums[2] / tokens).item()
        return metrics

    # ---------------------------------------------------------------------------------------------- validation

    def on_validation_epoch_start(self) -> None:
        self._val_rows = []

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        prompts = batch["prompts"]
        owners, completions, _ = self.sample(prompts, 0, 0.0, 1, 0, 1)  # greedy: no generator draws
        self._val_rows.append(self.rewards_of(owners, completions).to(self.device))

    def reduced_val_loss(self) -> float:
        per_function = torch.cat(self._val_rows) if self._val_rows else torch.zeros(0, len(self.reward_fns),
                                                                                      device=self.device)
        rewards = total(per_function, self.reward_fns)
        metrics = reward_metrics(self, per_function, rewards, self.reward_fns, None)
        self.val_metrics = {f"{EVAL_PREFIX}{k}": v for k, v in metrics.items()}
        return -metrics["reward"]

    def validation_scalars(self) -> dict[str, float]:
        return {**super().validation_scalars(),
                **{f"eval/{k[len(EVAL_PREFIX):]}": v for k, v in self.val_metrics.items()}}


def micro_batches_of(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def train_on(model: Any, r: Rollouts, g: GRPOArgs, micro_batch_size: int, pad_id: int, device: torch.device,
             counts: StepCounts, backward_each: Callable[[list[range], Callable], list]) -> tuple[torch.Tensor, ...]:
    """Forward and backward the rollouts' completions in micro-batches, each its part of the step's loss, through
    `backward_each(parts, loss_of)` (FinetuneModule.backward_each: gradient sync on the last part only). Returns
    this rank's sums: the loss parts, the KL over tokens, the low- and high-clipped token counts."""

    def loss_of(rows: range) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        batch = completion_batch(r, rows, pad_id, device)
        logps = completion_logps(model, batch, g.temperature)
        old = pad_rows(r.old_logps, rows, batch["mask"]) if r.old_logps is not None else logps.detach()
        ref = pad_rows(r.ref_logps, rows, batch["mask"]) if r.ref_logps is not None else None
        terms = token_terms(logps, old, ref, r.advantages[rows.start : rows.stop], batch["mask"], g.epsilon,
                            g.eps_high, g.beta)
        loss = micro_loss(terms, batch["mask"], g.loss_type, counts)
        return loss, (loss.detach().float(), terms.kl.sum().double(), terms.low_clipped.sum().double(),
                      terms.high_clipped.sum().double())

    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    kl_sum, low, high = (torch.zeros((), device=device, dtype=torch.float64) for _ in range(3))
    for part_loss, kl, part_low, part_high in backward_each(micro_batches_of(len(r.sequences), micro_batch_size),
                                                             loss_of):
        loss_sum += part_loss
        kl_sum += kl
        low += part_low
        high += part_high
    return loss_sum, kl_sum, low, high


def pad_rows(values: list[torch.Tensor], rows: range, mask: torch.Tensor) -> torch.Tensor:
    """Per-row tensors of `rows` as one [B, C] tensor laid out as `mask` (zeros past each row's end)."""
    out = torch.zeros(mask.shape, device=mask.device, dtype=values[rows.start].dtype)
    return out.masked_scatter(mask, torch.cat([values[i] for i in rows]).to(mask.device))


def reward_metrics(module: FinetuneModule, per_function: torch.Tensor, rewards: torch.Tensor,
                   fns: list[Reward], group: Optional[int]) -> dict[str, float]:
    """reward, rewards/<name>/mean and /std (over the completions a function scored), and with `group`,
    reward_std (the mean of the groups' standard deviations) and frac_reward_zero_std; over every rank."""
    f = per_function.double()
    scored = ~torch.isnan(f)
    values = torch.where(scored, f, torch.zeros_like(f))
    rows = [torch.tensor([float(len(rewards))], device=f.device, dtype=torch.float64), rewards.double().sum()[None],
            scored.double().sum(0), values.sum(0), values.square().sum(0)]
    if group is not None:
        std = rewards.view(-1, group).double().std(1)
        rows += [std.sum()[None], torch.isclose(std, torch.zeros_like(std)).double().sum()[None],
                 torch.tensor([float(len(std))], device=f.device, dtype=torch.float64)]
    totals = module.sum_over_data(torch.cat(rows))
    k = len(fns)
    n, reward_sum = totals[0].clamp(min=1), totals[1]
    count, s, sq = totals[2 : 2 + k], totals[2 + k : 2 + 2 * k], totals[2 + 2 * k : 2 + 3 * k]
    metrics = {"reward": (reward_sum / n).item()}
    for i, fn in enumerate(fns):
        c = count[i].clamp(min=1)
        mean = s[i] / c
        var = (sq[i] - c * mean * mean) / (c - 1).clamp(min=1)
        metrics[f"rewards/{fn.name}/mean"] = mean.item()
        metrics[f"rewards/{fn.name}/std"] = var.clamp(min=0).sqrt().item()
    if group is not None:
        groups = totals[-1].clamp(min=1)
        metrics["reward_std"] = (totals[-3] / groups).item()
        metrics["frac_reward_zero_std"] = (totals[-2] / groups).item()
    return metrics
