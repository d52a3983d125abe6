"""`litqlora grpo`: reinforcement learning with verifiable rewards (GRPO, DAPO, Dr. GRPO) of a LoRA adapter on the
frozen NF4 (or bf16) base, with `finetune`'s run: the same checks, Trainer, checkpoints, resume, validation, loggers
and final/ exports (lit_qlora.train), given this package's data module and LightningModule by its method object,
`GRPO`.

Light at import, as `finetune` is: the CLI reads the signature for `--help`."""

from __future__ import annotations

from functools import cached_property
from typing import Any, Optional

from lit_qlora.methods.grpo.args import GRPOSpec
from lit_qlora.train.method import Method, TracedStep


def grpo(spec: Optional[GRPOSpec] = None, **settings: Any) -> dict[str, Any]:
    """Train a LoRA adapter with GRPO on a frozen base, NF4 by default: for each prompt, sample a group of
    completions on the training model, score them with reward functions (built-ins or your own Python functions,
    called as TRL calls them), and move the policy toward the completions that beat their group's mean. The
    reference for the KL penalty (--grpo.beta > 0) is the same base with the adapters off (or the --train.init_adapter
    adapter): no second copy of the weights. Metrics under TRL's names (reward, reward_std, rewards/<function>/mean,
    kl, clip_ratio/*, completions/*; eval_... for validation) in metrics.jsonl, the loggers and summary.json.

    Args:
        spec: The run's settings (lit_qlora.methods.grpo.args.GRPOSpec: `litqlora finetune`'s, with prompts for data and
            --grpo.*), or its fields as keywords.
    """
    from lit_qlora.train.finetune import run_method

    return run_method(GRPO(GRPOSpec.of(spec, settings)))


class GRPO(Method):
    """Reinforcement learning with verifiable rewards: groups of sampled completions per prompt, scored."""

    name = verb = section = "grpo"
    command = staticmethod(grpo)
    spec_class = GRPOSpec
    demo_data = "GRPO_DEMO_DATASET"
    metric_names = ("reward", "reward_std", "frac_reward_zero_std", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
                    "clip_ratio/region_mean", "completions/mean_length", "completions/min_length",
                    "completions/max_length", "completions/clipped_ratio")
    refusals = {
        "strategy fsdp": "under FSDP every rank must run the same forwards, and the ranks' rollouts stop at different "
                         "lengths.",
        "strategy tp": "tensor parallelism is finetune's.",
        "packing": "packing puts samples into one sequence, and GRPO samples completions of each prompt on its own: "
                   "leave packing out.",
        "compile": "its rollouts decode one token at a time through the same blocks, each decode a new shape that a "
                   "compiled block would compile again. Leave --compile off; --grpo.compile_decode true compiles the "
                   "decode step itself, once.",
    }

    def require_valid(self) -> None:
        spec, g = self.spec, self.settings
        g.require_valid(spec.train.global_batch_size, spec.devices * spec.num_nodes, spec.train.max_seq_length)
        self.rewards  # noqa: B018  (a reward that cannot load fails before anything else loads)

    @cached_property
    def rewards(self) -> list[Any]:
        """The reward functions, loaded once per run."""
        from lit_qlora.methods.grpo.rewards import load_rewards

        g = self.settings
        return load_rewards(g.rewards, g.reward_weights, g.format_pattern)

    def describe(self) -> str:
        """What the run optimizes, in a line."""
        g, init_adapter = self.settings, self.spec.train.init_adapter
        kl = "no KL penalty (beta 0: no reference pass)" if not g.uses_reference else (
            f"KL penalty beta {g.beta} to " + (f"the adapter of {init_adapter}, as the run starts from it"
                                               if init_adapter is not None else "the base with the adapters off"))
        clip = f"clip [{1 - g.epsilon:g}, {1 + g.eps_high:g}]"
        return (f"GRPO ({g.loss_type} loss), {g.num_generations} completions per prompt of at most "
                f"{g.max_completion_length} tokens at temperature {g.temperature:g}; rewards: "
                f"{', '.join(g.rewards)}; {clip}; {kl}")

    def data_module(self, *args: Any) -> Any:
        from lit_qlora.methods.grpo.datamodule import GRPODataModule

        g = self.settings
        return GRPODataModule(*args, num_generations=g.num_generations, max_completion_length=g.max_completion_length,
                              num_iterations=g.num_iterations)

    def module(self, model: Any, dm: Any, config: Any) -> Any:
        """The run's GRPOModule, with its rewards and its reference (the base with the adapters off, or the starting
        adapter; only with beta > 0)."""
        from lit_qlora.methods.grpo.module import GRPOModule
        from lit_qlora.train.datamodule import pad_id_of
        from lit_qlora.train.policy import starting_adapter

        g = self.settings
        start = starting_adapter(config.train.init_adapter) if g.uses_reference else None
        return GRPOModule(model, config.train, config.total_steps, config.start_step, compile=config.compile, grpo=g,
                          rewards=self.rewards, tokenizer=dm.tokenizer,
                          reference_start=start, seed=config.seed, source=dm.source, pad_id=pad_id_of(dm.tokenizer),
                          out_dir=config.out_dir)

    def estimate_step(self) -> Any:
        from lit_qlora.methods.grpo.estimate import GRPOStep

        return GRPOStep(self.settings)

    def estimate_section(self, traced: TracedStep) -> tuple[Optional[dict[str, Any]], int]:
        """The larger of the training step and the rollouts' sampling sets the peak."""
        from lit_qlora.base.precision import PRECISION_DTYPES
        from lit_qlora.methods.grpo.estimate import kept_cache_bytes, sampling_phase

        g, config, length = self.settings, traced.config, traced.max_seq_length
        dtype_bytes = PRECISION_DTYPES[traced.precision].itemsize
        kept = kept_cache_bytes(config, g, length, dtype_bytes, traced.device)
        sampling = sampling_phase(config, g, traced.by_category, length, dtype_bytes, traced.step.fixed_pass_bytes, kept)
        training = traced.total + kept
        section = {"num_generations": g.num_generations, "training_peak_bytes": training,
                   "reference_pass": g.uses_reference, **sampling,
                   "sets_the_peak": "sampling" if sampling["sampling_peak_bytes"] > training else "training"}
        return section, max(training, sampling["sampling_peak_bytes"])

    @classmethod
    def render_estimate(cls, result: dict[str, Any]) -> list[str]:
        from lit_qlora.methods.grpo.estimate import render_grpo

        return render_grpo(result)
