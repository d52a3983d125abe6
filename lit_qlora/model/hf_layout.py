"""Checkpoint tensors whose Hugging Face layout differs from the model's: Phi-3 and Phi-4 store q, k and v as one
`qkv_proj` and gate and up as one `gate_up_proj`. The model keeps one linear per projection, so each gets its own
NF4 weight and its own LoRA adapter and tensor parallelism splits them by name as for every other family; they are
split as a checkpoint loads and put back together wherever a Hugging Face file is written (merged model, PEFT
adapter)."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from lit_qlora.model.config import Config

# Fused module -> the model's modules it holds, in the order of its output rows.
PHI3_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fused_modules(config: Config) -> dict[str, tuple[str, ...]]:
    return PHI3_FUSED if config.model_type == "phi3" else {}


def _part_rows(config: Config, fused: str) -> list[int]:
    if fused == "self_attn.qkv_proj":
        kv = config.n_query_groups * config.head_dim
        return [config.n_head * config.head_dim, kv, kv]
    return [config.intermediate_size] * 2


def _match(name: str, suffixes: Iterable[str]) -> tuple[str, str, str] | None:
    """(prefix, suffix, leaf) when `name` is PREFIX + SUFFIX + "." + LEAF for one of `suffixes`."""
    module, _, leaf = name.rpartition(".")
    for suffix in suffixes:
        if module == suffix or module.endswith("." + suffix):
            return module[: len(module) - len(suffix)], suffix, leaf
    return None


def split_fused(config: Config, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor as the model's tensors: a fused projection's rows split per part, anything else as is."""
    fused = fused_modules(config)
    found = _match(name, fused)
    if found is None:
        return [(name, tensor)]
    prefix, suffix, leaf = found
    rows = _part_rows(config, suffix)
    if tensor.size(0) != sum(rows):
        return [(name, tensor)]  # the loader reports the shape mismatch under the checkpoint's own name
    return [(f"{prefix}{part}.{leaf}", chunk) for part, chunk in zip(fused[suffix], tensor.split(rows))]


def fuse_plan(config: Config, names: Iterable[str]) -> dict[str, tuple[str, list[str]]]:
    """For each model tensor name, where it goes in the Hugging Face file: {first part's name: (fused name, the
    parts' names in row order)}, and {other part's name: ("", [])} (written with the first). Names not listed are
    written as they are."""
    plan: dict[str, tuple[str, list[str]]] = {}
    for name in names:
        for fused, parts in fused_modules(config).items():
            found = _match(name, [parts[0]])
            if found is not None:
                prefix, _, leaf = found
                members = [f"{prefix}{part}.{leaf}" for part in parts]
                plan[name] = (f"{prefix}{fused}.{leaf}", members)
                plan.update({member: ("", []) for member in members[1:]})
    return plan


def fuse_lora(config: Config, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], alpha: float,
              rslora: bool) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, int], dict[str, float]]:
    """Adapters {module: (A, B)} in the Hugging Face layout, with peft's per-module rank and alpha overrides.

    The parts of a fused module keep independent adapters: A stacks theirs (rank n * r), B is block-diagonal, so
    B @ A gives each part's rows exactly its own B_i @ A_i. peft scales by alpha / rank (alpha / sqrt(rank) with
    rslora); the fused module's alpha grows with its rank so the scale stays each part's."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    done: set[str] = set()
    for name, (a, b) in adapters.items():
        found = _match(name + ".weight", [part for parts in fused_modules(config).values() for part in parts])
        if found is None:
            out[name] = (a, b)
            continue
        prefix, part, _ = found
        fused, parts = next((f, p) for f, p in fused_modules(config).items() if part in p)
        if prefix + fused in done:
            continue
        done.add(prefix + fused)
        rows = _part_rows(config, fused)
        present = [(i, adapters[prefix + p]) for i, p in enumerate(parts) if prefix + p in adapters]
        r = a.size(0)
        fused_b = b.new_zeros(sum(rows), r * len(present))
        for col, (i, (_, part_b)) in enumerate(present):
            start = sum(rows[:i])
            fused_b[start:start + rows[i], col * r:(col + 1) * r] = part_b
        out[prefix + fused] = (torch.cat([part_a for _, (part_a, _) in present]), fused_b)
        leaf = fused.rpartition(".")[2]
        ranks[leaf] = r * len(present)
        alphas[leaf] = alpha * (math.sqrt(len(present)) if rslora else len(present))
    return out, ranks, alphas
