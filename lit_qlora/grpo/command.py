"""`litqlora grpo`: reinforcement learning with verifiable rewards (GRPO, DAPO, Dr. GRPO) of a LoRA adapter on the
frozen NF4 (or bf16) base, with `finetune`'s run: the same checks, Trainer, checkpoints, resume, validation, loggers
and final/ exports (lit_qlora.train), given this package's data module and LightningModule through `RunHooks`.

Light at import, as `finetune` is: the CLI reads the signature for `--help`."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from lit_qlora.base.errors import UserError
from lit_qlora.grpo.args import GRPOArgs, GRPOSpec


def grpo(spec: Optional[GRPOSpec] = None, **settings: Any) -> dict[str, Any]:
    """Train a LoRA adapter with GRPO on a frozen base, NF4 by default: for each prompt, sample a group of
    completions on the training model, score them with reward functions (built-ins or your own Python functions,
    called as TRL calls them), and move the policy toward the completions that beat their group's mean. The
    reference for the KL penalty (--grpo.beta > 0) is the same base with the adapters off (or the --train.init_adapter
    adapter): no second copy of the weights. Metrics under TRL's names (reward, reward_std, rewards/<function>/mean,
    kl, clip_ratio/*, completions/*; eval_... for validation) in metrics.jsonl, the loggers and summary.json.

    Args:
        spec: The run's settings (lit_qlora.grpo.args.GRPOSpec: `litqlora finetune`'s, with prompts for data and
            --grpo.*), or its fields as keywords.
    """
    from lit_qlora.data.files import GRPO_DEMO_DATASET
    from lit_qlora.grpo.rewards import load_rewards
    from lit_qlora.train.finetune import run_objective

    spec = GRPOSpec.of(spec, settings)
    if spec.strategy == "fsdp" or spec.tensor_parallel != 1:
        raise UserError("`litqlora grpo` runs with --strategy auto or ddp: under FSDP every rank must run the same "
                        "forwards, and the ranks' rollouts stop at different lengths.")
    if spec.compile:
        raise UserError("--compile is not offered by `litqlora grpo` yet: its rollouts decode one token at a time "
                        "through the same blocks, each decode a new shape that a compiled block would compile again. "
                        "Leave --compile off; --grpo.compile_decode true compiles the decode step itself, once.")
    if spec.data.packing:
        raise UserError("--data.packing true packs samples into one sequence, and GRPO samples completions of each "
                        "prompt on its own: leave packing out for `litqlora grpo`.")
    world = spec.devices * spec.num_nodes
    spec.grpo.require_valid(spec.train.global_batch_size, world, spec.train.max_seq_length)
    load_rewards(spec.grpo.rewards, spec.grpo.reward_weights, spec.grpo.format_pattern)  # fail before any loading
    return run_objective(spec, grpo_hooks(spec.grpo), GRPO_DEMO_DATASET, describe(spec.grpo, spec.train.init_adapter))


def describe(g: GRPOArgs, init_adapter: Optional[Path]) -> str:
    """What the run optimizes, in a line."""
    kl = "no KL penalty (beta 0: no reference pass)" if not g.beta else (
        f"KL penalty beta {g.beta} to " + (f"the adapter of {init_adapter}, as the run starts from it"
                                           if init_adapter is not None else "the base with the adapters off"))
    clip = f"clip [{1 - g.epsilon:g}, {1 + g.eps_high:g}]"
    return (f"GRPO ({g.loss_type} loss), {g.num_generations} completions per prompt of at most "
            f"{g.max_completion_length} tokens at temperature {g.temperature:g}; rewards: "
            f"{', '.join(g.rewards)}; {clip}; {kl}")


def grpo_hooks(g: GRPOArgs) -> Any:
    from lit_qlora.train.run import RunHooks

    recipe = {"grpo": {k: v for k, v in asdict(g).items()}}
    return RunHooks(method="grpo", recipe=recipe, data_module=lambda *args: data_module(g, *args),
                    module=lambda model, dm, config: build_module(model, dm, config, g), rows_per_sample=1)


def data_module(g: GRPOArgs, *args: Any) -> Any:
    from lit_qlora.grpo.datamodule import GRPODataModule

    return GRPODataModule(*args, num_generations=g.num_generations, max_completion_length=g.max_completion_length,
                          num_iterations=g.num_iterations)


def build_module(model: Any, dm: Any, config: Any, g: GRPOArgs) -> Any:
    """The run's GRPOModule, with its rewards and its reference (the base with the adapters off, or the starting
    adapter; only with beta > 0)."""
    from lit_qlora.grpo.module import GRPOModule
    from lit_qlora.grpo.rewards import load_rewards
    from lit_qlora.train.datamodule import pad_id_of
    from lit_qlora.train.policy import starting_adapter

    start = starting_adapter(config.train.init_adapter) if g.beta else None
    return GRPOModule(model, config.train, config.total_steps, config.start_step, compile=config.compile, grpo=g,
                      rewards=load_rewards(g.rewards, g.reward_weights, g.format_pattern), tokenizer=dm.tokenizer,
                      reference_start=start, seed=config.seed, source=dm.source, pad_id=pad_id_of(dm.tokenizer),
                      out_dir=config.out_dir)
