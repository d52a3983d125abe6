"""What `litqlora grpo --grpo.* --data.*` accept, with TRL's names and meanings (GRPOConfig), so that a TRL recipe
carries over by renaming flags. Plain dataclasses: the CLI reads them for `--help` without torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Optional, Union

from lit_qlora.base.errors import UserError
from lit_qlora.methods.grpo.builtin_rewards import DEFAULT_FORMAT_PATTERN
from lit_qlora.train.args import DataArgs, TrainArgs
from lit_qlora.train.spec import RunSpec

# The registry of --grpo.loss_type choices: how the per-token losses of a step become one number (lit_qlora.methods.grpo.loss).
LOSS_TYPES = {
    "grpo": "each completion's token mean, averaged over completions (DeepSeekMath's GRPO: longer completions weigh "
            "less per token)",
    "bnpo": "the token mean of each micro-batch, averaged over micro-batches",
    "dr_grpo": "the token sum over micro_batch_size x max_completion_length (Dr. GRPO: no length bias)",
    "dapo": "the token mean over every completion token of the step, all ranks and micro-batches (DAPO; TRL's "
            "default)",
}
LossType = Literal[tuple(LOSS_TYPES)]  # type: ignore[valid-type]
SCALE_REWARDS = ("group", "batch", "none")
DEMO_REWARDS = ["answer_match", "format"]


@dataclass
class GRPOArgs:
    num_generations: int = 8
    """Completions sampled per prompt (the group). --train.global_batch_size and --train.micro_batch_size count
    completions, as TRL's batch sizes do: a step trains on global_batch_size / num_generations prompts."""
    max_completion_length: int = 256
    """The most tokens a completion may have; one cut there counts in completions/clipped_ratio."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (the log-probabilities are taken at it too, as TRL does)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of likeliest tokens whose probabilities sum to top_p (1: all)."""
    top_k: Optional[int] = None
    """Sample among the k likeliest tokens only (None or 0: all)."""
    compile_decode: bool = False
    """Compile the rollouts' decode step once (torch.compile, a KV cache of max_seq_length positions; on CUDA with CUDA
    graphs, the cache then kept through training). Off by default until a GPU measures what it pays."""
    beta: float = 0.0
    """The weight of the KL penalty to the reference model (the base with the adapters off, or the starting adapter
    after --train.init_adapter). 0, TRL's default, skips the reference pass."""
    epsilon: float = 0.2
    """The clip range: a token's probability ratio to the policy that sampled it is clipped to [1 - epsilon,
    1 + epsilon_high]."""
    epsilon_high: Optional[float] = None
    """The clip range's upper side (DAPO's clip-higher, e.g. 0.28); default: epsilon."""
    num_iterations: int = 1
    """Optimizer steps on each batch of rollouts (TRL's num_iterations, the paper's mu). Above 1, the log-probs of
    the policy that sampled them are kept and each later step's ratio is taken against them; at 1 the ratio is
    exactly 1."""
    loss_type: LossType = "dapo"
    """How a step's per-token losses are averaged: grpo (per completion, then over completions), bnpo (per
    micro-batch), dr_grpo (sum over micro_batch_size x max_completion_length), dapo (over every completion token of
    the step)."""
    scale_rewards: Union[bool, Literal["group", "batch", "none"]] = "group"
    """Advantages are rewards minus their group's mean, divided by the group's standard deviation (group, or true),
    by the whole batch's (batch), or not divided (none, or false: Dr. GRPO)."""
    rewards: list[str] = field(default_factory=lambda: list(DEMO_REWARDS))
    """The reward functions, summed with reward_weights: built-ins (answer_match: the row's `answer` column against
    the completion's <answer> tag or last answer; format: the completion matches format_pattern), or your own as
    path/to/file.py:function or package.module:function, called as TRL calls them: fn(prompts, completions,
    completion_ids, **columns) -> a float (or None) per completion."""
    reward_weights: Optional[list[float]] = None
    """One weight per reward function (default: all 1)."""
    format_pattern: str = DEFAULT_FORMAT_PATTERN
    """The format reward's regular expression, matched from the completion's start (re.DOTALL)."""

    @property
    def uses_reference(self) -> bool:
        """Whether the KL penalty needs the reference's log-probabilities (beta > 0): a reference pass per batch of
        rollouts, the `kl` metric and the starting adapter kept."""
        return self.beta > 0

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def scaling(self) -> str:
        """scale_rewards as one of SCALE_REWARDS (TRL's true and false mean group and none)."""
        if isinstance(self.scale_rewards, bool):
            return "group" if self.scale_rewards else "none"
        return self.scale_rewards

    def require_valid(self, global_batch_size: int, data_ranks: int, max_seq_length: int) -> None:
        """A UserError for settings that cannot run together, naming the flags."""
        g = self.num_generations
        if g < 2:
            raise UserError(f"--grpo.num_generations must be >= 2 (a group's advantages compare its completions with "
                            f"each other; one alone has nothing to compare with), got {g}.")
        if global_batch_size % (g * data_ranks):
            raise UserError(
                f"--train.global_batch_size ({global_batch_size}) counts completions and must be a multiple of "
                f"--grpo.num_generations x data-parallel ranks ({g} x {data_ranks} = {g * data_ranks}), so that each "
                f"rank samples whole groups; e.g. --train.global_batch_size {g * data_ranks * 2}.")
        if not 1 <= self.max_completion_length < max_seq_length:
            raise UserError(f"--grpo.max_completion_length ({self.max_completion_length}) must be at least 1 and leave "
                            f"room for the prompt within --train.max_seq_length ({max_seq_length}).")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or (self.top_k is not None and self.top_k < 0):
            raise UserError(f"--grpo.temperature must be >= 0, --grpo.top_p in (0, 1] and --grpo.top_k >= 0 (got "
                            f"{self.temperature}, {self.top_p}, {self.top_k}).")
        if self.beta < 0 or self.epsilon < 0 or self.eps_high < 0:
            raise UserError(f"--grpo.beta, --grpo.epsilon and --grpo.epsilon_high must be >= 0 (got {self.beta}, "
                            f"{self.epsilon}, {self.epsilon_high}).")
        if self.num_iterations < 1:
            raise UserError(f"--grpo.num_iterations must be >= 1, got {self.num_iterations}.")
        if self.scaling not in SCALE_REWARDS:
            raise UserError(f"--grpo.scale_rewards must be one of {', '.join(SCALE_REWARDS)} (or true / false), got "
                            f"{self.scale_rewards!r}.")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise UserError(f"--grpo.reward_weights has {len(self.reward_weights)} weights for "
                            f"{len(self.rewards)} reward functions ({', '.join(self.rewards)}): give one each.")


@dataclass
class GRPODataArgs(DataArgs):
    path: Optional[str] = None
    """The prompts: a local file (.json, .jsonl, .csv, .parquet, .arrow), a folder, or a Hugging Face Hub dataset
    name, with a `prompt` column (a string: raw text, as TRL's standard rows; or a list of chat messages, rendered
    with the prompt style and ending where the reply starts) and any others the reward functions read (e.g.
    `answer`). Default: the arithmetic task shipped with lit-qlora (lit_qlora/data/grpo_demo.jsonl)."""
    format: Literal["auto", "prompt"] = "auto"  # type: ignore[assignment]
    """GRPO reads one row format, a `prompt` column and the columns the rewards read: auto and prompt both mean it
    (kept so a recipe may name it)."""
    columns: Optional[dict[str, str]] = None
    """Rename columns before reading rows, e.g. {question: prompt, solution: answer}."""
    packing: bool = False
    """Not for GRPO (completions are sampled per prompt): leave it false."""


@dataclass
class GRPOTrainArgs(TrainArgs):
    micro_batch_size: int = 4
    """Completions per forward/backward pass of the training step (the sampling takes a prompt's whole group)."""
    global_batch_size: int = 16
    """Completions per optimizer step (prompts x --grpo.num_generations); a multiple of num_generations x ranks."""
    max_seq_length: Union[int, Literal["auto"]] = 512
    """A prompt and its completion together: prompts longer than max_seq_length - --grpo.max_completion_length are
    left out (not truncated: a cut prompt would ask another question), with a counted warning."""


@dataclass
class GRPOSpec(RunSpec):
    """`litqlora grpo`'s settings: a fine-tune's run spec with prompts for data, and the GRPO objective."""

    cli_skip: ClassVar[frozenset[str]] = frozenset({"tensor_parallel"})

    out_dir: Path = Path("out/grpo")
    """Where adapters, merged model, logs, metrics and resumable checkpoints go."""
    strategy: Literal["auto", "ddp"] = "auto"  # type: ignore[assignment]
    """auto (one device) or ddp, as for `litqlora finetune`; each rank samples its share of the step's prompts (not
    fsdp: lit_qlora.methods.grpo.command.GRPO.refusals says why)."""
    train: GRPOTrainArgs = field(default_factory=GRPOTrainArgs)
    """Optimization settings; the batch sizes count completions."""
    data: GRPODataArgs = field(default_factory=GRPODataArgs)
    """The prompts; with nothing given, the arithmetic task shipped with lit-qlora."""
    grpo: GRPOArgs = field(default_factory=GRPOArgs)
    """The GRPO objective, its sampling and its rewards."""
