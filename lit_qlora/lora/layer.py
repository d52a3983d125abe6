"""LoRA: `LoRALinear` over a frozen base (bf16 or NF4), applying, merging and saving adapters."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.nn as nn

from lit_qlora.checkpoint.hf import TensorSpec, atomic_write_text, iter_safetensors, write_safetensors
from lit_qlora.guards import require_finite
from lit_qlora.lora import dropout as lora_dropout
from lit_qlora.lora.dropout import dropped_lora
from lit_qlora.nf4 import dequantize_nf4, frozen_linear, is_nf4, row_slices
from lit_qlora.parallel.distributed import full, is_sharded, reshard, shard_like

# Short target names -> module name suffixes in our (= Hugging Face) naming.
TARGETS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "lm_head": "lm_head",
}
# Merged exports are computed this many values at a time: 16 MB per fp32 temporary, whatever the weight's size.
MERGE_CHUNK_ELEMS = 1 << 22
ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class LoRALinear(nn.Linear):
    """y = x W^T + b + scale * dropout(x) A^T B^T, with W frozen (bf16 or NF4) and A, B trained.

    A starts Kaiming-uniform and B at zero, so a fresh adapter leaves the model unchanged. `scale` is alpha / r,
    or alpha / sqrt(r) with rsLoRA (stable updates at large ranks).
    """

    fusable = True
    """Attention and MLP may run this layer's base in one matmul with its neighbours' (`fused_projections`), adding
    this adapter's own term to its slice: what `forward` computes."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, rslora: bool = False,
                 dtype: Optional[torch.dtype] = None) -> None:
        nn.Module.__init__(self)
        if r <= 0:
            raise ValueError(f"LoRA rank r must be positive, got {r}.")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.r, self.alpha, self.rslora = r, alpha, rslora
        self.scale = alpha / math.sqrt(r) if rslora else alpha / r
        device = base.weight.device
        if dtype is None:
            dtype = base.weight.dtype if not is_nf4(base.weight) else torch.bfloat16
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, r, device=device, dtype=dtype))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if device.type != "meta":
            self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = frozen_linear(x, self.weight, self.bias)
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        if self.training and isinstance(self.lora_dropout, nn.Dropout):
            if lora_dropout.hash_dropout_applies(x):
                return out + dropped_lora(x, a, b, self.scale, self.lora_dropout.p)  # no per-element RNG, no mask kept
            if lora_dropout.replayed_dropout_applies(x):  # the mask is drawn again in backward, not kept
                return lora_dropout.replayed_lora(x, out, a, b, self.scale, self.lora_dropout.p)
        return out + (self.lora_dropout(x) @ a.T @ b.T) * self.scale

    def lora_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, A) as the tensors this process holds (a tensor-parallel layer: its local parts)."""
        return self.lora_B, self.lora_A

    def delta_weight(self, rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """scale * B @ A in fp32 (only its rows start:stop when given): what merging adds to the base weight."""
        b, a = self.lora_factors()
        if rows is not None:
            b = b[rows[0] : rows[1]]
        return (b.float() @ a.float()).mul_(self.scale)  # in place: one fp32 temporary fewer

    def base_weight(self, dtype: torch.dtype = torch.float32, rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """The weight the adapter trained against: dequant(NF4(W)) for an NF4 base, W otherwise."""
        return weight_rows(self.weight, dtype, rows)

    @torch.no_grad()
    def merged_weight(self, dtype: torch.dtype = torch.bfloat16,
                      rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """dequant(W) + scale * B @ A, summed in fp32 and cast to `dtype` (only rows start:stop when given)."""
        merged = self.delta_weight(rows)
        merged += self.base_weight(torch.float32, rows)  # in place, into the fresh delta: one fp32 temporary fewer
        return merged.to(dtype)

    def merged_chunks(self, dtype: torch.dtype = torch.bfloat16) -> Iterator[torch.Tensor]:
        """The merged weight as consecutive row blocks of at most MERGE_CHUNK_ELEMS values: a streaming export
        writes each and drops it, so the whole high-precision weight never exists (a 32000x2048 head merged whole
        held ~760 MiB of fp32 temporaries, issue 16)."""
        return row_chunks(self.weight, lambda rows: self.merged_weight(dtype, rows))

    def extra_repr(self) -> str:
        kind = "nf4" if is_nf4(self.weight) else str(self.weight.dtype).removeprefix("torch.")
        return f"{self.in_features}, {self.out_features}, base={kind}, r={self.r}, alpha={self.alpha}"


def weight_rows(weight: torch.Tensor, dtype: torch.dtype, rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """A frozen weight in `dtype`, dequantized if NF4 (only rows start:stop when given: on NF4 block boundaries)."""
    if is_nf4(weight):
        return dequantize_nf4(weight, rows=rows).to(dtype)
    weight = weight.detach()
    return (weight if rows is None else weight[rows[0] : rows[1]]).to(dtype)


def row_chunks(weight: torch.Tensor,
               make: Callable[[Optional[tuple[int, int]]], torch.Tensor]) -> Iterator[torch.Tensor]:
    """`make(rows)` for consecutive row ranges of `weight` of at most MERGE_CHUNK_ELEMS values (NF4: on block
    boundaries); `make(None)` once for a small weight. Each block is dropped before the next is made."""
    slices = row_slices(weight, MERGE_CHUNK_ELEMS)
    for rows in slices:
        chunk = make(None if len(slices) == 1 else rows)
        yield chunk
        del chunk  # while suspended the frame would keep it alive next to the following block


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, every LoRA layer computes its base alone (scale 0: out + 0 is exactly out), e.g. to show what the
    model answered before fine-tuning without loading it twice."""
    layers = list(lora_modules(model).values())
    scales = [layer.scale for layer in layers]
    for layer in layers:
        layer.scale = 0.0
    try:
        yield
    finally:
        for layer, scale in zip(layers, scales):
            layer.scale = scale


def resolve_targets(targets: Iterable[str] | str) -> list[str]:
    names = [targets] if isinstance(targets, str) else list(targets)
    if "all" in names:
        return list(TARGETS)
    unknown = [t for t in names if t not in TARGETS]
    if unknown:
        raise ValueError(f"Unknown LoRA target(s) {unknown}: choose from {', '.join(TARGETS)} or 'all'.")
    if not names:
        raise ValueError("LoRA needs at least one target: choose from " + ", ".join(TARGETS) + " or 'all'.")
    return [t for t in TARGETS if t in names]  # canonical order


def apply_lora(model: nn.Module, r: int, alpha: float, dropout: float = 0.0, targets: Iterable[str] | str = "all",
               rslora: bool = False, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Wrap every targeted linear of `model` in a LoRALinear (in place), freeze everything else."""
    suffixes = tuple(TARGETS[t] for t in resolve_targets(targets))
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not isinstance(module, LoRALinear) and name.endswith(suffixes):
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, leaf, LoRALinear(module, r, alpha, dropout, rslora, dtype))
    return model


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    # Adapter names are the model's own: a module wrapped by `fabric.setup` would otherwise prefix them all with
    # "_forward_module." and the file would fit no other model.
    model = getattr(model, "_original_module", model)
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors by name; under FSDP2 they are DTensor shards (see `full_lora_state_dict`)."""
    return {f"{n}.{p}": getattr(m, p).detach() for n, m in lora_modules(model).items() for p in ("lora_A", "lora_B")}


def full_lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole adapter tensors, gathered from every rank under FSDP2 (a collective then: call it on every rank)."""
    if not is_sharded(model):
        return lora_state_dict(model)
    reshard(model)
    return {k: full(v).cpu() for k, v in lora_state_dict(model).items()}


def save_adapter(model: nn.Module, out_dir: Path, config: dict,
                 tensors: Optional[dict[str, torch.Tensor]] = None) -> Path:
    """Write `adapter.safetensors` and `adapter_config.json` (r, alpha, targets, base model, quantization...).

    `tensors`: the adapter, when already gathered (`full_lora_state_dict`); default: read from `model`."""
    tensors = lora_state_dict(model) if tensors is None else tensors
    require_finite(tensors, f"the adapter in {out_dir}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = [TensorSpec(k, v.shape, v.dtype, lambda v=v: v) for k, v in tensors.items()]
    write_safetensors(out_dir / ADAPTER_WEIGHTS, specs, metadata={"format": "pt"})
    atomic_write_text(out_dir / ADAPTER_CONFIG, json.dumps(config, indent=2) + "\n")
    return out_dir


def find_adapter_dir(adapter_dir: Path) -> Path:
    """The directory holding the adapter: `adapter_dir` itself (a fine-tune's final/ or a training checkpoint),
    or, given a fine-tune's out_dir, its final/."""
    adapter_dir = Path(adapter_dir)
    final = adapter_dir / "final"
    if not (adapter_dir / ADAPTER_CONFIG).is_file() and (final / ADAPTER_CONFIG).is_file():
        return final
    return adapter_dir


def read_adapter_config(adapter_dir: Path) -> dict:
    adapter_dir = find_adapter_dir(adapter_dir)
    path = adapter_dir / ADAPTER_CONFIG
    what = (f"--adapter_dir must be a fine-tune's out_dir or its final/ directory (which holds {ADAPTER_WEIGHTS} "
            f"and {ADAPTER_CONFIG})")
    if not adapter_dir.is_dir():
        raise FileNotFoundError(f"Adapter directory {adapter_dir} does not exist: {what}.")
    if not path.is_file():
        has_checkpoints = (adapter_dir / "checkpoints").is_dir()
        hint = (" This out_dir has training checkpoints but no final/: the run has not finished; continue it with "
                "the same `litqlora finetune` command with --resume auto."
                if has_checkpoints else "")
        raise FileNotFoundError(f"{path} does not exist: {what}.{hint}")
    try:
        config = json.loads(path.read_text())
        missing = [k for k in ("r", "alpha", "targets") if k not in config]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}). Re-run the fine-tune or restore the file.") from None
    if missing:
        raise ValueError(f"{path} lacks the key(s) {missing}; it was not written by `litqlora finetune`.")
    return config


def _trained_on(adapter_dir: Path) -> str:
    """': BASE' from the adapter's config, when it says."""
    try:
        base = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text()).get("base_model")
    except (OSError, ValueError):
        base = None
    return f": {base}" if base else ""


def load_adapter(model: nn.Module, adapter_dir: Path) -> None:
    """Copy the adapter's tensors into the LoRA layers of `model`; a mismatch is a clear error, not a warning."""
    adapter_dir = find_adapter_dir(adapter_dir)
    path = adapter_dir / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: --adapter_dir must hold {ADAPTER_WEIGHTS}.")
    own = {k: v for k, v in lora_state_dict(model).items()}
    params = {n: m for n, m in lora_modules(model).items()}
    fix = f"Pass the --checkpoint_dir the adapter was trained on{_trained_on(adapter_dir)}."
    seen = set()
    for name, tensor in iter_safetensors(path):
        if name not in own:
            raise ValueError(f"{path}: adapter tensor {name!r} has no LoRA layer in this model: the adapter was "
                             f"trained with other targets than {ADAPTER_CONFIG} lists, or on another base model. {fix}")
        if tensor.shape != own[name].shape:
            rank_axis = 0 if name.endswith("lora_A") else 1
            if tensor.shape[rank_axis] != own[name].shape[rank_axis]:
                why = (f"the file has rank {tensor.shape[rank_axis]}, the model was set up with r="
                       f"{own[name].shape[rank_axis]} ({ADAPTER_CONFIG}'s r, or --lora.r when resuming). Use the "
                       f"rank the adapter was trained with; an edited {ADAPTER_CONFIG} must be restored.")
            else:
                why = "the adapter was trained on a base model of another size. " + fix
            raise ValueError(f"{path}: {name!r} has shape {tuple(tensor.shape)} but the model expects "
                             f"{tuple(own[name].shape)}: {why}")
        module_name, _, leaf = name.rpartition(".")
        param = getattr(params[module_name], leaf)
        with torch.no_grad():
            param.copy_(shard_like(tensor, param))  # every rank reads the file and keeps its FSDP2 shard
        seen.add(name)
    if set(own) - seen:
        missing = sorted(set(own) - seen)
        raise ValueError(f"{path} lacks {len(missing)} LoRA tensor(s) the model has, e.g. {missing[0]!r}: "
                         f"it was trained with fewer targets than {ADAPTER_CONFIG} lists.")
