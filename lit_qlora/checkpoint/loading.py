"""The one model loader: a Hugging Face checkpoint as the base a fine-tune trains (or trained) on, plain or NF4,
whole or this rank's tensor-parallel shard, optionally with a fine-tune's LoRA adapter on top.

The checkpoint streams in one tensor at a time and every base linear weight is quantized as it arrives, so the
full high-precision model never exists (peak ~ the NF4 model + one tensor).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from lit_qlora.checkpoint.hf import load_checkpoint
from lit_qlora.model.config import Config, Quantize
from lit_qlora.base.precision import DTYPES, PRECISION_DTYPES, Precision
from lit_qlora.lora.layer import apply_lora
from lit_qlora.checkpoint.adapter import load_adapter, read_adapter_config
from lit_qlora.model.transformer import Transformer
from lit_qlora.nf4 import base_linears, expert_linears, is_ignored, is_nf4, quantize_linears, quantize_weight
from lit_qlora.parallel.tensor_parallel import TensorParallelShard, check_divisible, tp_layout_weight, tp_style


def resolve_quantize(quantize: Quantize | str | None, adapter_config: Optional[dict] = None) -> Quantize:
    """The explicit choice, else what the adapter trained with (its adapter_config.json), else none."""
    if quantize is None:
        quantize = (adapter_config or {}).get("quantize", Quantize.NONE)
    return Quantize(quantize)


def load_model(
    checkpoint_dir: Path | str,
    quantize: Quantize | str | None = None,
    precision: Optional[Precision] = None,
    adapter_dir: Path | str | None = None,
    shard: Optional[TensorParallelShard] = None,
    *,
    ignore_modules: Iterable[str] = (),
    nf4_world_size: int = 1,
    nf4_tensor_parallel: int = 1,
    device: torch.device | str | None = None,
    base_of: Path | str | None = None,
) -> Transformer:
    """Load `checkpoint_dir` as a base model (in eval mode; training callers switch it to train mode).

    Args:
        checkpoint_dir: Hugging Face model directory.
        quantize: nf4 = every base linear not in `ignore_modules` stored as NF4 (QLoRA); none = plain weights.
            Default: what the adapter trained with, else none.
        precision: Compute dtype (Lightning's name, resolved: a caller with `auto` asks lit_qlora.base.precision).
            Default: the adapter's, else bf16-true.
        adapter_dir: A fine-tune's output: its base is rebuilt exactly as it trained (NF4 codes from the dtype
            training quantized, the same NF4 layout and ignored modules, from adapter_config.json) and its LoRA
            adapter is applied on top.
        shard: This rank's place in a tensor-parallel group: only its part of every split weight is kept, each
            part quantized on its own (tensor-parallel training).
        ignore_modules: Module names (prefixes) kept in high precision with nf4.
        nf4_world_size: NF4 layout: every NF4 weight splits into this many FSDP shards.
        nf4_tensor_parallel: One process, the base of an N-rank tensor-parallel QLoRA run: the split linears hold
            every rank's shard NF4-quantized on its own, dequantized and put back together (dense); the rest NF4.
        device: Where the model goes once loaded (loading and quantization run on the CPU).
        base_of: A fine-tune's output whose base is rebuilt as it trained (as with adapter_dir) without its adapter:
            the base `serve --adapters` puts many fine-tunes' adapters on.
    """
    if precision is not None and precision not in PRECISION_DTYPES:  # `auto` is resolved once, by the caller
        raise ValueError(f"load_model takes a resolved precision ({', '.join(PRECISION_DTYPES)}) or None, got "
                         f"{precision!r}: resolve it first (lit_qlora.base.precision.resolved).")
    if base_of is not None and adapter_dir is None:
        model = load_trained_base(Path(checkpoint_dir), read_adapter_config(Path(base_of)), quantize, precision)
    elif adapter_dir is None:
        quantize = resolve_quantize(quantize)
        model = _load_base(Path(checkpoint_dir), quantize, PRECISION_DTYPES[precision or "bf16-true"], ignore_modules,
                           nf4_world_size, nf4_tensor_parallel, shard)
    else:
        if shard is not None or tuple(ignore_modules) or (nf4_world_size, nf4_tensor_parallel) != (1, 1):
            raise ValueError("load_model: an adapter's base is rebuilt from its adapter_config.json; pass no shard, "
                             "ignore_modules or NF4 layout with adapter_dir.")
        model = _load_adapted(Path(checkpoint_dir), Path(adapter_dir), quantize, precision)
    model = model.eval()
    if device is not None and torch.device(device).type != "cpu":
        model = model.to(device)
    model.share_projection_storage(trainable=True)  # (no optimizer holds the weights yet)
    return model


def _load_adapted(checkpoint_dir: Path, adapter_dir: Path, quantize: Quantize | str | None,
                  precision: Optional[Precision]) -> Transformer:
    acfg = read_adapter_config(adapter_dir)
    model = load_trained_base(checkpoint_dir, acfg, quantize, precision)
    dtype = PRECISION_DTYPES[precision] if precision else None
    lora_dtype = dtype or DTYPES[acfg.get("lora_dtype", "bfloat16")]
    apply_lora(model, acfg["r"], acfg["alpha"], 0.0, acfg["targets"], acfg.get("rslora", False), lora_dtype)
    load_adapter(model, adapter_dir)
    return model


def load_trained_base(checkpoint_dir: Path, acfg: dict, quantize: Quantize | str | None = None,
                      precision: Optional[Precision] = None) -> Transformer:
    """The base an adapter with config `acfg` trained on, without the adapter (eval mode not set): what `serve
    --adapters` puts many adapters on."""
    quantize = resolve_quantize(quantize, acfg)
    dtype = PRECISION_DTYPES[precision] if precision else None
    trained_dtype = DTYPES[acfg.get("base_dtype", "bfloat16")]
    # NF4 codes always come from the weights training quantized (bf16 for a float32 checkpoint): quantizing the
    # float32 originals instead gives other codes, a model that never trained. Only the compute dtype moves.
    base_dtype = trained_dtype if quantize is Quantize.NF4 else (dtype or trained_dtype)
    model = _load_base(checkpoint_dir, quantize, base_dtype, acfg.get("ignore_modules", ()),
                       acfg.get("nf4_world_size", 1), acfg.get("nf4_tensor_parallel", 1))
    if dtype is not None and dtype != base_dtype:
        for param in model.parameters():
            if not is_nf4(param):  # NF4 weights dequantize to the activations' dtype
                param.data = param.data.to(dtype)
    return model


def _load_base(checkpoint_dir: Path, quantize: Quantize, dtype: torch.dtype, ignore_modules: Iterable[str],
               world_size: int = 1, tensor_parallel: int = 1,
               shard: Optional[TensorParallelShard] = None) -> Transformer:
    config = Config.from_checkpoint(checkpoint_dir)
    if shard is not None:
        check_divisible(config, shard.size)
    if quantize is Quantize.NONE:
        return load_checkpoint(checkpoint_dir, dtype=dtype, config=config,
                               transform=None if shard is None else shard.cut)
    ignore_modules = list(ignore_modules)
    with torch.device("meta"):
        skeleton = Transformer(config)
    quantized = {n + ".weight" for n in (*base_linears(skeleton), *expert_linears(skeleton))
                 if not is_ignored(n, ignore_modules)}
    del skeleton

    def transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if shard is not None:
            tensor = shard.cut(name, tensor)
        if name not in quantized:
            return tensor
        style = tp_style(name.removesuffix(".weight")) if tensor_parallel > 1 else None
        return tp_layout_weight(tensor, style, tensor_parallel) if style else quantize_weight(tensor, world_size)

    model = load_checkpoint(checkpoint_dir, dtype=dtype, transform=transform, config=config)
    dense = [n for n in base_linears(model) if tp_style(n)] if tensor_parallel > 1 else []
    quantize_linears(model, ignore_modules + dense, world_size)  # marks, hooks and counts; nothing left to quantize
    return model


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype inside (what the precision plugin sets for module init and training steps)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def random_base(config: Config, quantize: Quantize | str, dtype: torch.dtype, ignore_modules: Iterable[str] = (),
                world_size: int = 1) -> Transformer:
    """The model `load_model` builds from a checkpoint of this config, with random weights in place of the
    checkpoint's: the same modules, dtypes and NF4 layout (a tied head reads the embedding). For dry runs
    (`litqlora estimate` builds it from fake tensors) and benchmarks."""
    with default_dtype(dtype):
        model = Transformer(config)
    if Quantize(quantize) is Quantize.NF4:
        quantize_linears(model, list(ignore_modules), world_size)
    model.share_projection_storage(trainable=True)  # (no optimizer holds the weights yet)
    return model.eval()
