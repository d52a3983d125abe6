"""Checkpoint tensors whose Hugging Face layout differs from the model's: Phi-3 and Phi-4 store q, k and v as one
`qkv_proj` and gate and up as one `gate_up_proj`. The model keeps one linear per projection, so each gets its own
NF4 weight and its own LoRA adapter and tensor parallelism splits them by name as for every other family; they are
split as a checkpoint loads and put back together wherever a Hugging Face file is written (merged model, PEFT
adapter)."""

from __future__ import annotations

import math
import re
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


# -- mixtures of experts -------------------------------------------------------------------------------------------
# The Hub stores one tensor per expert (mlp.experts.{e}.gate_proj.weight; Mixtral: block_sparse_moe.experts.{e}.w1);
# the model stacks each projection of a block (mlp.experts.gate_proj.weight, n_experts x out x in), the layout its
# grouped matmul reads. Mixtral's names are transformers 5's in the model (mlp, gate/up/down_proj).
_MIXTRAL_NAMES = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                  (".w2.", ".down_proj."))
_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def model_name(config: Config, name: str) -> str:
    """A checkpoint tensor's name in the model (Mixtral's block_sparse_moe/w1/w2/w3 renamed)."""
    if config.model_type == "mixtral" and "block_sparse_moe." in name:
        for hub, ours in _MIXTRAL_NAMES:
            name = name.replace(hub, ours)
    return name


def hub_name(config: Config, name: str) -> str:
    """A model tensor's name in the family's Hub checkpoints (model_name's inverse; gpt-oss's router)."""
    if config.model_type == "gpt_oss":
        return name.replace(".mlp.gate.", ".mlp.router.")
    if config.model_type == "mixtral" and ".mlp." in name and config.n_experts:
        for hub, ours in _MIXTRAL_NAMES:
            name = name.replace(ours, hub)
    return name


def expert_key(name: str) -> tuple[str, int] | None:
    """(the stacked weight's name, expert index) for one expert's checkpoint tensor, else None."""
    found = _EXPERT_KEY.match(name)
    if found is None:
        return None
    return f"{found[1]}.{found[3]}.weight", int(found[2])


def expert_names(stacked: str, n_experts: int) -> list[str]:
    """The per-expert checkpoint names of a stacked weight (expert_key's inverse)."""
    module, _, proj = stacked.removesuffix(".weight").rpartition(".")
    return [f"{module}.{e}.{proj}.weight" for e in range(n_experts)]


class ExpertStacker:
    """Collects one expert's tensor at a time and hands back a projection's (n_experts, out, in) stack once every
    expert of it arrived: a block's stack is the only high-precision copy alive (then quantized as one NF4 tensor)."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts
        self.pending: dict[str, tuple[torch.Tensor, set[int]]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        found = expert_key(name) if self.n_experts else None
        if found is None:
            return [(name, tensor)]
        stacked, expert = found
        if expert >= self.n_experts:
            return [(name, tensor)]  # the loader names it as having no place in the model
        if stacked not in self.pending:
            self.pending[stacked] = (tensor.new_empty(self.n_experts, *tensor.shape), set())
        buffer, seen = self.pending[stacked]
        if tuple(buffer.shape[1:]) != tuple(tensor.shape):
            return [(name, tensor)]  # the loader reports the shape under the checkpoint's own name
        buffer[expert].copy_(tensor)
        seen.add(expert)
        if len(seen) < self.n_experts:
            return []
        del self.pending[stacked]
        return [(stacked, buffer)]

    def missing(self) -> list[str]:
        """Per-expert names of stacks still incomplete after the whole checkpoint was read."""
        return [n for stacked, (_, seen) in self.pending.items()
                for e, n in enumerate(expert_names(stacked, self.n_experts)) if e not in seen]


PEFT_EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""What peft targets in transformers' mixtures of experts (`target_parameters`): its modules hold gate and up as one
(n_experts, 2 * I, hidden) parameter, down as (n_experts, hidden, I)."""


def peft_expert_lora(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], alpha: float, rslora: bool,
                     interleaved: bool = False
                     ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, int], dict[str, float]]:
    """Stacked expert adapters {module: (A (E, r, in), B (E, out, r))} as peft's ParamWrappers hold them, with its rank
    and alpha overrides; other adapters pass as they are.

    peft keeps an expert parameter's adapter as one A of (r * E, in) (expert e's rows e*r:(e+1)*r) and one B of
    (out, r * E) (expert e's column j at j * E + e). Gate and up share peft's gate_up_proj: their A's stack (rank 2r)
    and B is block-diagonal, so each keeps its own update; alpha doubles with the rank so the scale stays ours. peft
    nests the wrappers in the order of the parameters' names: down_proj outside (`experts`), gate_up_proj inside
    (`experts.base_layer`). `interleaved` (gpt-oss): gate_up_proj holds gate and up in alternate rows of B."""
    out, ranks, alphas = {}, {}, {}
    for name, (a, b) in adapters.items():
        if not name.endswith(".mlp.experts.gate_proj"):
            if not name.endswith((".mlp.experts.up_proj", ".mlp.experts.down_proj")):
                out[name] = (a, b)
            continue
        prefix = name.removesuffix(".gate_proj")
        (up_a, up_b), (down_a, down_b) = adapters[prefix + ".up_proj"], adapters[prefix + ".down_proj"]
        n, i, r = b.shape
        block = b.new_zeros(n, i, 2, 2 * r) if interleaved else b.new_zeros(n, 2, i, 2 * r)
        gate_rows, up_rows = (block[:, :, 0], block[:, :, 1]) if interleaved else (block[:, 0], block[:, 1])
        gate_rows[..., :r], up_rows[..., r:] = b, up_b
        block = block.reshape(n, 2 * i, 2 * r)
        out[prefix + ".base_layer"] = (torch.cat([a, up_a], dim=1).reshape(n * 2 * r, -1),
                                       block.permute(1, 2, 0).reshape(2 * i, 2 * r * n))
        out[prefix] = (down_a.reshape(n * r, -1), down_b.permute(1, 2, 0).reshape(down_b.size(1), r * n))
        ranks["gate_up_proj"] = 2 * r
        alphas["gate_up_proj"] = alpha * (math.sqrt(2) if rslora else 2)
    return out, ranks, alphas


def experts_plan(config: Config, names: Iterable[str]) -> dict[str, tuple[str, list[str]]]:
    """fuse_plan's form for a GGUF file, which keeps each projection of a block's experts as one tensor: {expert 0's
    name: (the stacked weight's name + "_exps", every expert's name in order)}, {other experts': ("", [])}."""
    plan: dict[str, tuple[str, list[str]]] = {}
    if not config.n_experts:
        return plan
    for name in names:
        found = expert_key(name)
        if found is not None and found[1] == 0:
            members = expert_names(found[0], config.n_experts)
            plan[name] = (found[0] + "_exps", members)
            plan.update({member: ("", []) for member in members[1:]})
    return plan


# -- gpt-oss ---------------------------------------------------------------------------------------------------------
# Its checkpoints keep experts stacked and transposed (x @ W): gate_up_proj (E, hidden, 2I) with gate and up in
# alternate columns, down_proj (E, I, hidden), a bias each, the router as mlp.router (with a bias); the released ones
# store the two expert weights in MXFP4 (`*_blocks`: (E, out, in / 32, 16) bytes of two 4-bit values, `*_scales`:
# (E, out, in / 32) power-of-two exponents biased by 127), which dequantize to (E, out, in), our own orientation.
FP4_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an MXFP4 (e2m1) code, by code."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     chunk_rows: int = 1 << 16) -> torch.Tensor:
    """MXFP4 blocks (..., groups, 16) bytes and scales (..., groups) as (..., groups * 32) values of `dtype`: each
    byte's low nibble the even value and its high nibble the odd one, times 2 ** (scale - 127); a chunk of rows at a
    time, so the transient stays small beside the result."""
    *prefix, groups, width = blocks.shape
    rows = math.prod(prefix) * groups
    flat_blocks, exponents = blocks.reshape(rows, width), scales.reshape(rows, 1).to(torch.int32) - 127
    levels = torch.tensor(FP4_LEVELS, dtype=torch.float32, device=blocks.device)
    out = torch.empty(rows, width * 2, dtype=dtype, device=blocks.device)
    for r0 in range(0, rows, chunk_rows):
        part = flat_blocks[r0:r0 + chunk_rows].to(torch.int64)
        values = torch.stack([levels[part & 0x0F], levels[part >> 4]], dim=-1).reshape(part.size(0), -1)
        out[r0:r0 + chunk_rows] = torch.ldexp(values, exponents[r0:r0 + chunk_rows].float()).to(dtype)
    return out.reshape(*prefix, groups * width * 2)


class GptOssLayout:
    """gpt-oss checkpoint tensors as the model's: the router renamed, gate and up split from their alternate columns,
    the experts' weights transposed to (E, out, in), MXFP4 pairs dequantized once both halves arrived."""

    def __init__(self) -> None:
        self.halves: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        if name.endswith(("_blocks", "_scales")):
            stem, _, half = name.rpartition("_")
            pair = self.halves.setdefault(stem, {})
            pair[half] = tensor
            if len(pair) < 2:
                return []
            del self.halves[stem]
            return self._experts(stem, dequantize_mxfp4(pair["blocks"], pair["scales"]), transposed=False)
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            return self._experts(name, tensor, transposed=True)
        if name.endswith(".mlp.experts.gate_up_proj_bias"):
            prefix = name.removesuffix("gate_up_proj_bias")
            return [(prefix + "gate_proj.bias", tensor[:, 0::2]), (prefix + "up_proj.bias", tensor[:, 1::2])]
        if name.endswith(".mlp.experts.down_proj_bias"):
            return [(name.removesuffix("_bias") + ".bias", tensor)]
        return [(name, tensor)]

    @staticmethod
    def _experts(name: str, tensor: torch.Tensor, transposed: bool) -> list[tuple[str, torch.Tensor]]:
        if transposed:  # the checkpoint's (E, in, out) -> (E, out, in)
            tensor = tensor.transpose(1, 2)
        if name.endswith("down_proj"):
            return [(name + ".weight", tensor.contiguous())]
        prefix = name.removesuffix("gate_up_proj")
        return [(prefix + "gate_proj.weight", tensor[:, 0::2].contiguous()),
                (prefix + "up_proj.weight", tensor[:, 1::2].contiguous())]

    def missing(self) -> list[str]:
        return [f"{stem}_{'scales' if 'blocks' in pair else 'blocks'}" for stem, pair in self.halves.items()]


def gpt_oss_expert_tensors(module_name: str, gate, up, down) -> list[tuple[str, tuple[int, ...], object]]:
    """The checkpoint's expert tensors of one gpt-oss block from our projections (ExpertLinear-like: `n_experts`,
    `in_features`, `out_features`, `bias`), as (name, shape, pieces(expert_weight) -> row blocks) for a streaming
    writer: gate_up_proj one expert at a time (gate and up interleaved, transposed), its bias, down_proj, its bias."""
    n, hidden, inter = gate.n_experts, gate.in_features, gate.out_features

    def gate_up(weight_of):
        for e in range(n):
            yield torch.stack([weight_of(gate, e), weight_of(up, e)], dim=1).reshape(2 * inter, hidden).t()[None]

    def down_rows(weight_of):
        for e in range(n):
            yield weight_of(down, e).t()[None]

    def gate_up_bias(_):
        yield torch.stack([gate.bias.detach(), up.bias.detach()], dim=-1).reshape(n, 2 * inter)

    def down_bias(_):
        yield down.bias.detach()

    return [(f"{module_name}.gate_up_proj", (n, hidden, 2 * inter), gate_up),
            (f"{module_name}.gate_up_proj_bias", (n, 2 * inter), gate_up_bias),
            (f"{module_name}.down_proj", (n, inter, hidden), down_rows),
            (f"{module_name}.down_proj_bias", (n, hidden), down_bias)]
