"""Merged Hugging Face export and PEFT export, streamed layer by layer (never a second full-size model copy)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal, Optional

# torch and the model stack are imported inside the functions, and annotations name their types as text: the CLI
# imports `merge` and `export_peft` to build `--help` (lit_qlora.cli.commands says why and how).


def hf_tensor_specs(model: nn.Module, dtype: torch.dtype, merge: bool = True) -> list[TensorSpec]:  # noqa: F821
    """Specs of the model's Hugging Face state dict; each tensor is produced (dequantized, merged, cast) only
    when written, a block of rows at a time (`LoRALinear.merged_chunks`, `MERGE_CHUNK_ELEMS` values), so no whole
    high-precision weight exists: a merged head or MLP weight costs a few 16 MB blocks, not 3x its fp32 size.

    merge=True writes dequant(W) + scale * B @ A for LoRA layers; merge=False writes their base weight alone.
    """
    from lit_qlora.checkpoint.files import TensorSpec
    from lit_qlora.lora.experts import expert_tensor
    from lit_qlora.lora.layer import LoRALinear, row_chunks, weight_rows
    from lit_qlora.model.hf_layout import expert_names
    from lit_qlora.nf4.grouped import ExpertLinear

    specs = []
    tied = export_config(model, merge).tie_embeddings
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    for name, tensor in named:
        module_name, _, leaf = name.rpartition(".")
        if leaf in ("lora_A", "lora_B") or (tied and name == "lm_head.weight"):
            continue
        module = model.get_submodule(module_name)
        out_dtype = dtype if tensor.is_floating_point() else tensor.dtype
        if isinstance(module, ExpertLinear) and model.config.model_type == "gpt_oss":
            if leaf == "weight" and module_name.endswith(".gate_proj"):  # the block's experts, in gpt-oss's layout
                specs.extend(_gpt_oss_experts(model, module_name.removesuffix(".gate_proj"), dtype, merge))
            continue
        if isinstance(module, ExpertLinear) and leaf == "weight":  # the Hub's layout: a tensor per expert
            shape = (module.out_features, module.in_features)
            specs.extend(TensorSpec(expert, shape, dtype, chunks=lambda m=module, e=e: iter([expert_tensor(m, e, dtype,
                                                                                                         merge)]))
                         for e, expert in enumerate(expert_names(name, module.n_experts)))
            continue
        if isinstance(module, LoRALinear) and leaf == "weight" and merge:
            chunks = lambda m=module: m.merged_chunks(dtype)  # noqa: E731
        else:
            # Dequantized (NF4) or cast, a block of rows at a time.
            chunks = lambda t=tensor, d=out_dtype: row_chunks(t, lambda rows: weight_rows(t, d, rows))  # noqa: E731
        specs.append(TensorSpec(name, tensor.shape, out_dtype, chunks=chunks))
    return specs


def _gpt_oss_experts(model, experts_name: str, dtype, merge: bool) -> list:
    """A gpt-oss block's expert tensors as its checkpoints hold them (lit_qlora.model.hf_layout), made when written."""
    from lit_qlora.checkpoint.files import TensorSpec
    from lit_qlora.lora.experts import expert_tensor
    from lit_qlora.model.hf_layout import gpt_oss_expert_tensors

    experts = model.get_submodule(experts_name)
    parts = gpt_oss_expert_tensors(experts_name, experts.gate_proj, experts.up_proj, experts.down_proj)

    def weight_of(module, e):
        return expert_tensor(module, e, dtype, merge)

    return [TensorSpec(name, shape, dtype, chunks=lambda pieces=pieces: (t.to(dtype) for t in pieces(weight_of)))
            for name, shape, pieces in parts]


def merged_bytes(model: nn.Module, dtype: torch.dtype) -> int:  # noqa: F821
    """The bytes of the tensors `merge` writes for `model` (a meta-device model will do: nothing is computed)."""
    return sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in hf_tensor_specs(model, dtype))


def export_config(model: nn.Module, merged: bool):  # noqa: F821
    """The model config to write: a merged adapter on a tied head unties it (the head now differs); an unadapted tied
    head stays tied (it computed with the embedding's own weight, in QLoRA too: lit_qlora.nf4.convert.base_linears)."""
    from lit_qlora.lora.layer import LoRALinear

    config = model.config
    head = getattr(model, "lm_head", None)
    if merged and config.tie_embeddings and isinstance(head, LoRALinear):
        return config.replace(tie_embeddings=False)
    return config


def merge(checkpoint_dir: Path, adapter_dir: Path, out_dir: Path,
          quantize: Optional[Literal["nf4", "none"]] = None) -> Path:
    """Merge a LoRA adapter into its base and write a bf16 Hugging Face directory.

    Args:
        checkpoint_dir: The base model's Hugging Face directory.
        adapter_dir: A fine-tune's out_dir, or its final/ directory (adapter.safetensors + adapter_config.json).
        out_dir: Where the merged model goes.
        quantize: Base to merge into: nf4 = dequant(NF4(W)), the weights QLoRA trained against; none = the
            original W. Defaults to what the adapter was trained with.
    """
    import torch

    from lit_qlora.checkpoint.hf import require_checkpoint, save_hf_checkpoint
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.data.inference import trained_chat_template

    require_checkpoint(checkpoint_dir, tokenizer=False)  # (its tokenizer files are copied where they exist)
    model = load_model(checkpoint_dir, quantize, adapter_dir=adapter_dir)
    specs = hf_tensor_specs(model, torch.bfloat16, merge=True)
    return save_hf_checkpoint(out_dir, export_config(model, True), specs, tokenizer_dir=Path(checkpoint_dir),
                              dtype=torch.bfloat16, chat_template=trained_chat_template(adapter_dir))


def peft_config(acfg: dict, base_name: str) -> dict:
    from lit_qlora.model.hf_layout import PEFT_EXPERT_PARAMETERS

    names = acfg.get("module_names", [])
    experts = [name for name in names if name.endswith((".mlp.experts", ".mlp.experts.base_layer"))]
    modules = sorted({name.rpartition(".")[2] for name in names if name not in experts}) or None
    extra = {"target_parameters": list(PEFT_EXPERT_PARAMETERS)} if experts else {}
    if experts:  # peft's expert wrapper refuses dropout; it only ever acted in training, which is over
        extra["lora_dropout"] = 0.0
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": acfg["r"],
        "lora_alpha": acfg["alpha"],
        "lora_dropout": acfg.get("dropout", 0.0),
        "use_rslora": acfg.get("rslora", False),
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        **extra,
    }


def export_peft(checkpoint_dir: Path, adapter_dir: Path, out_dir: Path, with_dequantized_base: bool = False) -> Path:
    """Write the adapter in PEFT's format (adapter_model.safetensors + adapter_config.json).

    Args:
        checkpoint_dir: The base model's Hugging Face directory.
        adapter_dir: A fine-tune's out_dir, or its final/ directory.
        out_dir: Destination; `peft.PeftModel.from_pretrained(base, out_dir)` loads it.
        with_dequantized_base: Also write dequant(NF4(W)), the base QLoRA trained against, to OUT_DIR/base/ so
            the adapter applies exactly in other runtimes.
    """
    import torch

    from lit_qlora.checkpoint.hf import require_checkpoint, save_hf_checkpoint
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.checkpoint.adapter import read_adapter_config

    require_checkpoint(checkpoint_dir, tokenizer=False)
    model = load_model(checkpoint_dir, adapter_dir=adapter_dir)
    acfg = read_adapter_config(adapter_dir)
    base_dir = Path(out_dir) / "base" if with_dequantized_base else Path(checkpoint_dir)
    write_peft_adapter(model, acfg, out_dir, str(base_dir.resolve()))
    if with_dequantized_base:
        save_hf_checkpoint(base_dir, export_config(model, False), hf_tensor_specs(model, torch.bfloat16, merge=False),
                           tokenizer_dir=Path(checkpoint_dir), dtype=torch.bfloat16)
    return Path(out_dir)


def write_peft_adapter(model: nn.Module, acfg: dict, out_dir: Path, base_name: str) -> Path:  # noqa: F821
    """adapter_model.safetensors (PEFT key names) + adapter_config.json for the LoRA layers of `model`."""
    from lit_qlora.checkpoint.files import atomic_write_text, write_safetensors

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs, adapters, ranks, alphas = peft_tensor_specs(model, acfg["alpha"], acfg.get("rslora", False))
    write_safetensors(out_dir / "adapter_model.safetensors", specs, metadata={"format": "pt"})
    config = peft_config({**acfg, "module_names": list(adapters)}, base_name)
    config.update(rank_pattern=ranks, alpha_pattern=alphas)
    atomic_write_text(out_dir / "adapter_config.json", json.dumps(config, indent=2) + "\n")
    return out_dir


def peft_tensor_specs(model: nn.Module, alpha: float, rslora: bool):  # noqa: F821
    """(the PEFT adapter's tensor specs, its adapters by module, peft's rank and alpha overrides) for the LoRA layers
    of `model`: Phi-3's fused projections get one adapter per fused module, as peft sees the Hugging Face model."""
    from lit_qlora.checkpoint.files import TensorSpec

    adapters = peft_adapters(model, alpha, rslora)
    specs = [TensorSpec(f"base_model.model.{name}.{leaf}.weight", t.shape, t.dtype, lambda t=t: t)
             for name, pair in adapters[0].items() for leaf, t in zip(("lora_A", "lora_B"), pair)]
    return specs, *adapters


def peft_adapters(model: nn.Module, alpha: float, rslora: bool, factors=None):  # noqa: F821
    """({module: (A, B)} as peft names and shapes them, its rank and alpha overrides) for `model`'s LoRA layers:
    Phi-3's fused projections one adapter per fused module, a mixture of experts' as peft's `target_parameters`
    (lit_qlora.model.hf_layout). `factors(layer)` gives what to lay out (default its (lora_A, lora_B); their
    gradients lay out the same way)."""
    from lit_qlora.lora.layer import lora_modules
    from lit_qlora.model.hf_layout import fuse_lora, peft_expert_lora

    factors = factors or (lambda m: (m.lora_A.detach(), m.lora_B.detach()))
    adapters = {name: factors(m) for name, m in lora_modules(model).items()}
    adapters, expert_ranks, expert_alphas = peft_expert_lora(adapters, alpha, rslora,
                                                             interleaved=model.config.model_type == "gpt_oss")
    adapters, ranks, alphas = fuse_lora(model.config, adapters, alpha, rslora)
    return adapters, {**ranks, **expert_ranks}, {**alphas, **expert_alphas}


def peft_bytes(model: nn.Module, alpha: float = 16.0, rslora: bool = False) -> int:  # noqa: F821
    """The bytes of the tensors `export_peft` writes for `model`'s adapters (a meta-device model will do)."""
    return sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in peft_tensor_specs(model, alpha, rslora)[0])
