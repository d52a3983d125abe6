"""`litqlora estimate`: a fine-tune recipe's peak device memory per rank, by category (lit_qlora.estimate.step traces
its training step; --method dpo, `litqlora dpo`'s: lit_qlora.methods.dpo.estimate), and with a card's memory the
largest micro-batch or the longest sequence that fits (lit_qlora.estimate.search); printed and written to
estimate.json."""

from __future__ import annotations

import functools
import json
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Callable, Optional

from lit_qlora.methods import METHODS
from lit_qlora.estimate.search import AUTO_LENGTH_TRACES, LENGTH_STEP, largest_batches, longest_context
from lit_qlora.estimate.args import EstimateSpec
from lit_qlora.estimate.cards import GiB, device_memory as card_memory
from lit_qlora.estimate.step import offload_decision, other_temporaries, parallel_bytes, trace_step
from lit_qlora.base.errors import InvalidInput
from lit_qlora.base.precision import choose_precision
from lit_qlora.train.method import Method, TracedStep

# torch and the model stack are imported inside the functions, and annotations name their types as text: the CLI
# imports `estimate` to build `--help` (lit_qlora.cli.commands says why and how).


def resolve_config(checkpoint_dir: str | Path) -> tuple[Config, str]:  # noqa: F821
    """The model to estimate and where its shape came from: a directory's config.json (no weights needed), a preset
    name, or, for a recipe whose checkpoint is not downloaded, the preset its directory is named after."""
    from lit_qlora.model.config import Config
    from lit_qlora.model.presets import PRESETS

    path = Path(checkpoint_dir)
    if (path / "config.json").is_file():
        return Config.from_checkpoint(path), f"{path / 'config.json'}"
    if str(checkpoint_dir) in PRESETS:
        return PRESETS[str(checkpoint_dir)], f"preset {checkpoint_dir}"
    name = path.name.lower()
    matches = [preset for preset in PRESETS if name.startswith(preset.lower())]
    if matches:
        preset = max(matches, key=len)
        return PRESETS[preset], f"preset {preset} ({path} has no config.json: not downloaded)"
    raise InvalidInput(f"--checkpoint_dir {checkpoint_dir}: no config.json there and no preset of that name. Give a "
                     f"directory with the model's config.json (weights are not needed) or one of the presets: "
                     f"{', '.join(sorted(PRESETS))}.")


def estimate(spec: Optional[EstimateSpec] = None, **settings: Any) -> dict[str, Any]:
    """Predict a training recipe's peak device memory per rank (any method: sft, dpo, grpo, kto), by category,
    without weights or a GPU.

    Args:
        spec: The recipe and the card (lit_qlora.estimate.args.EstimateSpec: a finetune or dpo recipe's settings,
            with --device, --device_memory, --method and --dpo.*), or its fields as keywords.
    """
    from lit_qlora.checkpoint.files import atomic_write_text
    from lit_qlora.model.config import Quantize

    spec = EstimateSpec.of(spec, settings)
    checkpoint_dir, out_dir, quantize, precision = spec.checkpoint_dir, spec.out_dir, spec.quantize, spec.precision
    devices, num_nodes, strategy, tensor_parallel = spec.devices, spec.num_nodes, spec.strategy, spec.tensor_parallel
    lora, train, device, device_memory, method = spec.lora, spec.train, spec.device, spec.device_memory, spec.method
    auto_length = train.max_seq_length == "auto"
    for flag, value, least in (("--devices", devices, 1), ("--num_nodes", num_nodes, 1),
                               ("--train.micro_batch_size", train.micro_batch_size, 1),
                               ("--train.max_seq_length", AUTO_LENGTH_TRACES[0] if auto_length else train.max_seq_length,
                                2)):
        if not isinstance(value, int):
            raise InvalidInput(f"{flag} takes a whole number, got {value!r}.")
        if value < least:
            raise InvalidInput(f"{flag} must be at least {least}, got {value}.")
    runs = method_for(spec, method)
    method = runs.name
    config, source = resolve_config(checkpoint_dir)
    quantize = Quantize(quantize)
    world_size = devices * num_nodes
    strategy = strategy if strategy != "auto" else ("ddp" if world_size > 1 else "auto")
    if strategy == "tp" and (tensor_parallel < 2 or world_size % tensor_parallel):
        raise InvalidInput(f"--strategy tp needs --tensor_parallel >= 2 dividing devices x num_nodes ({world_size}).")
    train.accumulation(world_size // (tensor_parallel if strategy == "tp" else 1))  # checks the batch sizes
    train.require_valid_offload(device == "cuda")
    budget = None
    if device_memory is not None:
        budget, said = card_memory(device_memory)
        print(said)
    if auto_length and budget is None:
        raise InvalidInput("--train.max_seq_length auto asks for the longest sequence that fits a card: give the card's "
                         "memory too, e.g. --device_memory 24GiB.")
    precision, precision_reason = estimate_precision(precision, device)
    print(f"Estimating {config.name} ({source}): {'QLoRA (NF4 base)' if quantize is Quantize.NF4 else 'LoRA'}, "
          f"{method}, micro-batch {runs.batch_size(train.micro_batch_size)} x {train.max_seq_length} tokens, "
          f"activation checkpointing {train.activation_checkpointing}, {world_size} rank(s), {device}, precision "
          f"{precision} ({precision_reason})")

    @functools.cache  # the batch and length searches may ask again for a size and setting already traced
    def predict(micro_batch_size: int, checkpointing: Any = train.activation_checkpointing,
                length: Optional[int] = None, offload: Any = None) -> tuple[int, dict, int, dict]:
        """(peak device bytes, by category, host bytes of offloaded activations, what the peak is made of beyond the
        categories) at this batch, checkpointing, sequence length and offload setting (defaults: the recipe's)."""
        offload = (train.offload_activations if offload is None else offload) if checkpointing else False
        objective = runs.estimate_step()
        trace = trace_step(config, quantize, precision, lora, replace(
            train, activation_checkpointing=checkpointing, offload_activations=offload,
            max_seq_length=length or train.max_seq_length), device, micro_batch_size, budget, objective)
        parts = parallel_bytes(trace.peak_by_category, config, strategy, world_size, tensor_parallel)
        peak = {"peak_operation": trace.peak_op, "other_temporaries_by_op": other_temporaries(trace, parts)}
        section, total = runs.estimate_section(TracedStep(
            objective, config, parts, trace.peak_op, sum(parts.values()), micro_batch_size,
            length or train.max_seq_length, precision, device))
        if section is not None:
            peak[runs.name] = section
        return total, parts, trace.host_peak, peak

    def traced(what: str, search: Callable) -> Callable:
        """`search` (a predict) that prints each trace as it ends: a search takes minutes at 8B and said nothing."""
        def run(*args):
            started = time.perf_counter()
            result = search(*args)
            print(f"  traced {what.format(*args)}: peak {result[0] / GiB:.2f} GiB "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
            return result
        return run

    searched: dict[str, Any] = {}
    searched_with_offload = False
    if auto_length:
        if train.offload_activations == "auto" and train.activation_checkpointing and device == "cuda":
            searched_with_offload = True
            # auto turns offload on at the lengths this search is about; one setting for every trace keeps the
            # growth a line (auto switching on between two traces would bend it)
            train = replace(train, offload_activations=True)
            print("Offloaded activation checkpoints: on for the length search (auto is on wherever it saves 1 GiB)")
        print(f"Searching the longest sequence that fits {budget / GiB:.1f} GiB (one step traced per try):",
              flush=True)
        at_length = traced("{2} tokens", predict)
        searched = longest_context(lambda length: at_length(train.micro_batch_size, train.activation_checkpointing,
                                                            length, train.offload_activations)[0], budget, device)
        train = replace(train, max_seq_length=searched["max_seq_length"] or LENGTH_STEP)
    offload, offload_reason, pinned = offload_decision(config, precision, train, device, device_total=budget,
                                                       rows=runs.rows_per_sample)
    if searched_with_offload:  # (the flag the search set stands for the user's auto)
        offload_reason = "auto: the longest-context search traces with it on, as auto turns it on at such lengths"
    print(f"Offloaded activation checkpoints: {'on' if offload else 'off'} ({offload_reason})")
    peak, by_category, host, breakdown = predict(train.micro_batch_size, train.activation_checkpointing,
                                                 train.max_seq_length, train.offload_activations)
    result: dict[str, Any] = {
        "model": config.name, "source": source, "method": method, "quantize": str(quantize), "precision": precision,
        "precision_reason": precision_reason, "device": device,
        "world_size": world_size, "strategy": strategy, "tensor_parallel": tensor_parallel,
        "micro_batch_size": train.micro_batch_size, "max_seq_length": train.max_seq_length,
        "activation_checkpointing": train.activation_checkpointing, "peak_bytes": peak, "by_category": by_category,
        "offload_activations": offload, "offload_reason": offload_reason, "offload_host_bytes": host,
        "offload_pinned_bytes": pinned, "max_micro_batch_size": None, **breakdown,
    }
    if world_size == 1:  # (ranks of a parallel run each hold their shard, which by_category counts instead)
        from lit_qlora.estimate.load import load_host_bytes

        weights = by_category["frozen base"] + by_category["embeddings and norms"]
        result.update(load_host_bytes(config, Path(source), quantize is Quantize.NF4, weights))
    if auto_length:
        result.update(device_memory_bytes=budget, **searched)
    elif budget is not None:
        print(f"Searching the largest micro-batch that fits {budget / GiB:.1f} GiB, with activation checkpointing "
              f"and without (one step traced per try):", flush=True)
        by_batch = traced("micro-batch {0}, checkpointing {1}", predict)
        result.update(device_memory_bytes=budget, **largest_batches(by_batch, budget, device))
        result["max_micro_batch_size"] = result["max_micro_batch_size_by_checkpointing"][
            "on" if train.activation_checkpointing else "off"]
    print(render(result))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "estimate.json", json.dumps(result, indent=2) + "\n")
    print(f"Wrote {out_dir / 'estimate.json'}")
    return result


def method_for(spec: EstimateSpec, name: Optional[str]) -> Method:
    """The method whose step the estimate traces (--method; else the one whose section the recipe has, else sft), on
    `spec` with its section's defaults where the recipe has none; refused as its verb refuses the recipe."""
    name = name or next((m.name for m in METHODS.values() if m.section and getattr(spec, m.section, None) is not None),
                        "sft")
    cls = METHODS[name]
    if cls.section is not None and getattr(spec, cls.section) is None:
        default = next(f for f in fields(cls.spec_class) if f.name == cls.section).default_factory()  # type: ignore[misc]
        spec = replace(spec, **{cls.section: default})
    message = cls.refusal(spec)
    if message:
        raise InvalidInput(f"--method {name}: {message}")
    method = cls(spec)
    method.check_section()
    return method


def estimate_precision(precision: str, device: str) -> tuple[str, str]:
    """(the precision the estimate models, why): --precision auto on a cuda target assumes an Ampere-or-newer GPU."""
    if precision == "auto" and device == "cuda":
        return "bf16-true", ("auto on cuda, assuming a GPU with bf16 (compute capability >= 8.0); a T4 or V100 "
                             "runs 16-mixed: pass --precision 16-mixed")
    return choose_precision(precision, device)


def render(result: dict[str, Any]) -> str:
    from lit_qlora.memory.trace import CATEGORIES

    rank = f" per rank ({result['world_size']} ranks, {result['strategy']})" if result["world_size"] > 1 else ""
    lines = [f"Predicted peak {result['device']} memory{rank}: {result['peak_bytes'] / GiB:.2f} GiB", "",
             f"{'category':<24}{'GiB':>9}"]
    lines += [f"{name:<24}{result['by_category'][name] / GiB:>9.3f}" for name in CATEGORIES]
    lines += [f"  {part}: {nbytes / GiB:.3f}" for part, nbytes in result.get("other_temporaries_by_op", {}).items()]
    if result.get("peak_operation"):
        lines += ["", f"The peak is reached at: {result['peak_operation']}"]
    if result.get(result["method"]):  # the method's own section (estimate_section)
        lines += METHODS[result["method"]].render_estimate(result)
    if "load_host_bytes" in result:
        from lit_qlora.estimate.load import render_load

        lines += render_load(result)
    if result.get("offload_activations"):
        lines += ["", f"Host memory for offloaded activations: {result['offload_host_bytes'] / GiB:.2f} GiB (not in "
                      f"the peak above; {result['offload_pinned_bytes'] / GiB:.2f} GiB of pinned buffers)"]
    if "traced_peaks" in result:
        batch = METHODS[result["method"]].batch_size(result["micro_batch_size"])
        lines += ["", f"On {result['device_memory_bytes'] / GiB:.0f} GiB: the longest sequence that fits micro-batch "
                      f"{batch} is {result['max_seq_length']} tokens "
                      f"({result['bytes_per_token'] / 1024:.0f} KiB more per token; traced at "
                      f"{', '.join(result['traced_peaks'])})"]
    elif "device_memory_bytes" in result:
        lines += render_batch_search(result)
    return "\n".join(lines)


def render_batch_search(result: dict[str, Any]) -> list[str]:
    """The report's lines on the largest micro-batch that fits --device_memory (a size at the search's limit is a
    lower bound, and says so)."""
    lines: list[str] = []
    sizes = result["max_micro_batch_size_by_checkpointing"]
    unit = f" {METHODS[result['method']].batch_unit}".rstrip()
    limit = result["micro_batch_search_limit"]
    size = {k: f"{v} or more (the search stops at {limit})" if v == limit else str(v) for k, v in sizes.items()}
    lines += ["", f"On {result['device_memory_bytes'] / GiB:.0f} GiB: largest micro-batch {size['on']}{unit} with "
                  f"activation checkpointing, {size['off']} without"
                  + (" (checkpointing is needed)" if result["activation_checkpointing_needed"] else "")]
    if sizes["on"] == 0:
        lines.append("Not even micro-batch 1 fits: use --quantize nf4, a shorter --train.max_seq_length, or "
                     "more devices with --strategy fsdp.")
    return lines
