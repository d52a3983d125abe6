"""`--compile true`: regional torch.compile, one compiled region per transformer block (as torchtune and
torchtitan do), so compile time does not grow with depth: every block runs the same code and, with the same
shapes, the same compiled graphs.

`block.compile()` keeps module names and state-dict keys, and composes with what wraps the blocks: activation
checkpointing (forward_hidden calls the compiled block inside `torch.utils.checkpoint`), LoRA, FSDP2 and tensor
parallelism (the blocks are compiled after they are sharded) and DDP (which wraps the whole module).

The NF4 linear is traced, not a graph break: its dense weight comes from the custom op `lit_qlora::nf4_dequantize`
(nf4/ops.py; the Triton kernel on CUDA, the C kernel on CPU), so with CUDA's dropout a block is ONE graph (NF4
projections, LoRA, dropout, RMSNorm, RoPE, attention, SwiGLU) and backward re-dequantizes instead of saving dense
weights. On CPU the LoRA dropout (a raw-pointer C kernel drawing a host seed) stays `torch.compiler.disable`d: with
dropout > 0 each LoRA layer's dropout is a graph break there, and the LoRA layer's `forward` a frame of its own,
compiled once per weight shape and grad mode: a block of 7 adapters needs more than dynamo's default 8 entries per
code object, hence RECOMPILE_LIMIT.

`LIT_QLORA_COMPILE_MODE` (an A/B switch, issue 48 item 3): torch.compile's `mode` for every block, e.g.
`reduce-overhead` (CUDA graphs where shapes are static: fewer launches, more memory held by the graphs' pools),
`max-autotune-no-cudagraphs` or `max-autotune`; unset, torch's default mode. Which pays is for the GPU kit's A/B call
to measure; the default stays until it does.

Shapes: the first call compiles for its exact shapes; the first recompilation for another shape (a packed run's
validation, an unpacked run's next batch) marks the changed dimensions dynamic, so later shapes reuse it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from lit_qlora.base import switches

RECOMPILE_LIMIT = 64
"""Compiled entries dynamo keeps per code object: 5 LoRA weight shapes x {training, validation} x {static, dynamic}
for NF4 bases, with room to spare. Beyond it dynamo would silently run those frames eagerly."""


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Compile each of `model.blocks` in place (idempotent: Lightning calls configure_model for every validate and
    fit); returns how many were newly compiled. `backend`: torch.compile's (a test of dynamo's guards and
    recompilations may trace with aot_eager, without inductor's C++ code generation)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    todo = [block for block in model.blocks if not is_compiled(block)]
    mode = compile_mode()
    for block in todo:
        block.compile(backend=backend, **({"mode": mode} if mode else {}))
    return len(todo)


COMPILE_MODES = switches.SWITCHES["LIT_QLORA_COMPILE_MODE"].choices


def compile_mode() -> Optional[str]:
    """`LIT_QLORA_COMPILE_MODE` (module doc), checked; None when unset."""
    return switches.choice("LIT_QLORA_COMPILE_MODE")


def is_compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def compile_seconds() -> float:
    """Seconds this process has spent compiling (dynamo's tracing and inductor's code generation, every frame and
    recompilation): what the warm-up cost, apart from the steps' own time."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))
