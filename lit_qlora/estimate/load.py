"""What loading the checkpoint takes on the host, in one process: the model as it trains (built on the CPU, NF4
quantized there, then moved to the device) plus the most checkpoint data the loader holds at once.

The loader reads one tensor at a time (lit_qlora.checkpoint.files.iter_safetensors, plain reads, no memory map), so a
30B checkpoint loads on a machine with less RAM than its bf16 size. What it holds beyond the model is the largest
group that waits in the checkpoint's precision: a weight being quantized (the largest NF4 target), or a mixture of
experts' block, whose per-expert tensors wait in their projections' stacks until the last expert arrived
(lit_qlora.model.hf_layout.ExpertStacker; the Hub's files interleave a block's three projections expert by expert,
so the three stacks fill together). benchmarks/memory/load_memory.py measures it against this.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lit_qlora.model.config import Config

from lit_qlora.base.precision import DTYPES


def checkpoint_dtype(source: Path) -> torch.dtype:
    """The dtype config.json says the weights are stored in (bf16 where it says nothing, or there is no file)."""
    if source.is_file():
        fields = json.loads(source.read_text())
        return DTYPES.get(str(fields.get("torch_dtype") or fields.get("dtype")), torch.bfloat16)
    return torch.bfloat16


def largest_held(config: Config, quantized: bool, dtype: torch.dtype) -> tuple[int, str]:
    """(bytes, what): the most checkpoint data in `dtype` the loader holds beside the model."""
    from lit_qlora.model.moe import moe_blocks
    from lit_qlora.model.transformer import Transformer
    from lit_qlora.nf4.convert import base_linears

    with torch.device("meta"):
        model = Transformer(config)
    size = dtype.itemsize
    held, what = 0, "one tensor at a time"
    if quantized:
        name, linear = max(base_linears(model).items(), key=lambda item: item[1].weight.numel())
        held, what = linear.weight.numel() * size, f"{name}'s weight, read before it is quantized"
    blocks = moe_blocks(model)
    if blocks:
        experts = blocks[0].experts
        stacks = sum(p.weight.numel() for p in (experts.gate_proj, experts.up_proj, experts.down_proj)) * size
        if stacks > held:
            held, what = stacks, "one block's expert stacks (gate, up and down of every expert), filled expert by expert"
    return held, what


def load_host_bytes(config: Config, source: Path, quantized: bool, model_bytes: int) -> dict[str, Any]:
    """estimate.json's load fields: the host's predicted peak while loading and what makes it up."""
    dtype = checkpoint_dtype(source)
    held, what = largest_held(config, quantized, dtype)
    return {"load_host_bytes": model_bytes + held, "load_model_bytes": model_bytes, "load_held_bytes": held,
            "load_held": f"{what} ({str(dtype).removeprefix('torch.')})"}


def render_load(result: dict[str, Any]) -> list[str]:
    return ["", f"Loading (host memory, one process): about {result['load_host_bytes'] / 2**30:.2f} GiB at its peak: "
                f"the model as it trains, built on the CPU ({result['load_model_bytes'] / 2**30:.2f} GiB), plus "
                f"{result['load_held_bytes'] / 2**30:.2f} GiB read at once: {result['load_held']}"]
