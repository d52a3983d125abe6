"""The step `litqlora estimate` measures: a fine-tune recipe's peak device memory, predicted before any weights are
downloaded or a GPU is at hand.

One training step of the real code (the loader's modules and NF4 layout, LoRA, the fine-tune's loss, backward,
clipping, fused AdamW, then a second step so optimizer state is counted) runs on fake tensors: shapes and dtypes
propagate, no data exists, and `memory.trace.AllocationTrace` counts every allocation by category. What is
simulated (docs: tutorials/memory.md, "Will it fit?"):

* The step runs on fake CPU tensors. `--device cuda` takes the code paths a GPU takes (no CPU scratch buffer for
  NF4 weights, PyTorch dequantization instead of the C kernel, flex_attention where a sliding window, packed
  documents or a soft cap needs a mask: a stand-in allocating what its compiled kernels do, `_FlexAllocations`) and
  rounds allocations to the caching allocator's
  512 bytes; the CUDA context and cuBLAS workspaces (outside `torch.cuda.max_memory_allocated`) are not counted.
* With `--train.offload_activations` on, the checkpointed blocks' inputs leave the device as the real run's do (the
  same `ActivationOffload`, its copies standing for host memory and for the inputs fetched back in backward): the
  host copies are counted apart, as the host memory the run needs, never in the device's peak. (`auto` is decided
  as a run decides it, except for the host's available memory, which an estimate cannot know.)
* More than one rank is derived from the one-rank trace: FSDP divides weights, gradients and optimizer state by the
  ranks and adds two blocks' gathered weights; DDP adds gradient buckets; tensor parallelism divides the split
  linears' weights, their adapters' state and the attention/MLP activations by its size.
"""

from __future__ import annotations

import functools
import types
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Optional

from lit_qlora.train.args import LoRAArgs, TrainArgs

# torch and the model stack are imported inside the functions, and annotations name their types as text: the CLI
# imports `estimate` (lit_qlora.estimate.command), and with it this module, to build `--help` (lit_qlora.cli.commands
# says why and how).

CUDA_BLOCK = 512  # the caching allocator rounds every allocation up to this
OFFLOADED = "offloaded activations (host)"  # a host-memory category of the trace: beside the device's peak


PATCH_POINTS: dict[str, tuple[str, ...]] = {
    "lit_qlora.lora.dropout": ("hash_dropout_applies", "replayed_dropout_applies"),  # CUDA's dropout paths
    "lit_qlora.model.flex": ("block_mask", "flex_attend"),  # stand-ins allocating what the compiled kernels do
    "lit_qlora.model.offload": ("ActivationOffload.to_host",),  # the host copies, counted apart
    "lit_qlora.model.tiled_mlp": ("tile_starts",),  # the first tiles traced
    "lit_qlora.model.transformer": ("use_flex_attention",),  # CUDA's attention
    "lit_qlora.nf4.grouped": ("keeps_expert_products",),  # the CPU keeps the experts' products for the recompute
    "lit_qlora.nf4.linear": ("_cuda_scratch", "_scratch", "dense_rows", "dense_stack", "whole_weight"),
    "lit_qlora.nf4.reference": ("_TABLE_CACHE",),  # (caches set aside, read: `_nf4_caches_set_aside`)
    "lit_qlora.train.loss": ("head_ce_sum", "logits_chunk_elems", "nf4_head_ce_sum", "tiled_ce_sum"),
    "lit_qlora.train.tiled_loss": ("tile_starts",),  # the first tiles traced
    "torch.nn.functional": ("dropout",),  # CUDA's fused dropout
}
"""Every name of another module that the estimate replaces, wraps or sets aside while it traces a step, by module
(`Class.name` for a class's attribute, replaced on an instance the estimate made). The code reaches them only through
`_point` and `_patched`, which refuse a name not listed here; tests/test_estimate.py checks that each still exists, so
a rename in its own module fails there rather than silently making the estimate trace something else."""


def _point(obj: Any, name: str) -> Any:
    """`obj.name`, one of PATCH_POINTS (obj: a module, or an instance of a listed class)."""
    if isinstance(obj, types.ModuleType):
        module, qualified = obj.__name__, name
    else:
        module, qualified = type(obj).__module__, f"{type(obj).__name__}.{name}"
    if qualified not in PATCH_POINTS.get(module, ()):
        raise RuntimeError(f"the estimate reaches {module}.{qualified}, which lit_qlora.estimate.step.PATCH_POINTS "
                           "does not list: list it there")
    return getattr(obj, name)


@contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """`obj.name` is `value` inside (a name PATCH_POINTS lists)."""
    old = _point(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextmanager
def _nf4_caches_set_aside() -> Iterator[None]:
    """Our NF4 code's process-wide caches set aside: a fake tensor must not stay cached for a later real run, nor a
    real one reach the fake step."""
    import torch

    from lit_qlora.nf4 import linear, reference
    from lit_qlora.nf4.native import use_native

    use_native(torch.bfloat16)  # compile and self-test the C kernels for real now: on fake tensors the test fails
    caches = (_point(reference, "_TABLE_CACHE"), _point(linear, "_scratch").__dict__,
              _point(linear, "_cuda_scratch").__dict__)  # (CPU, CUDA buffers)
    saved = [dict(cache) for cache in caches]
    for cache in caches:
        cache.clear()
    try:
        yield
    finally:
        for cache, kept in zip(caches, saved):
            cache.clear()
            cache.update(kept)


TRACED_LOSS_CHUNKS = 2


def _first_loss_chunks_traced() -> Callable:
    """The loss's chunks allocate alike, one chunk's logits and gradients at a time, but each costs fake ops: an 8B
    step at 20 x 2048 has 1,280 chunks of 32 NF4 head slices each, minutes of tracing per batch size. So each
    loss traces its first TRACED_LOSS_CHUNKS chunks for real and the rest as a zero loss of the chunk (whose hidden
    gradient is still allocated). A loss's first chunk starts at offset 0 of the hidden states it slices."""
    from lit_qlora.train import loss

    real, seen = _point(loss, "head_ce_sum"), [0]

    def head_ce_sum(head, hidden, targets):
        seen[0] = 1 if hidden.storage_offset() == 0 else seen[0] + 1
        if seen[0] <= TRACED_LOSS_CHUNKS:
            return real(head, hidden, targets)
        return hidden.float().sum() * 0.0

    return head_ce_sum


def resident_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:  # noqa: F821
    """What a real run holds between steps (for `memory.trace.profiled_peak`, the measurement an estimate is checked
    against): weights, LoRA and its AdamW state, our NF4 scratch buffers. (Not the C kernels' lookup tables,
    ~0.2 MiB of process-wide constants, which no estimate counts.)"""
    import torch

    from lit_qlora.nf4 import linear

    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors + list((getattr(_point(linear, "_scratch"), "buffers", None) or {}).values())


@contextmanager
def _gpu_nf4_paths() -> Iterator[None]:
    """What a GPU allocates for an NF4 matmul: the whole weight dense (one Triton launch) in a buffer reused across
    calls, grown to the largest weight: the CPU's scratch buffer, on fake CPU tensors, stands in for it."""
    from lit_qlora.nf4 import linear

    with _patched(linear, "whole_weight", lambda weight: True):
        yield


def _cuda_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True,  # noqa: F821
                  inplace: bool = False) -> torch.Tensor:  # noqa: F821
    """Dropout as CUDA runs it: one fused kernel that keeps a 1-byte mask for backward."""
    import torch

    return torch.native_dropout(x, p, training)[0] if training and 0 < p < 1 else x


class _FlexAllocations:
    """What compiled flex_attention allocates (its Triton kernels, never an L x L matrix), as a stand-in for it on
    fake tensors (the real one cannot run under the trace's dispatch mode): forward, the output and a float32
    log-sum-exp per query, saved with q, k and v; backward, the gradients of q, k (per kv head) and v and a float32
    sum(out * grad_out) per query."""

    @staticmethod
    def attend(q, k, v, block_mask, scale, cap=None, gqa=None):
        return _flex_allocations_function().apply(q, k, v)

    @staticmethod
    def block_mask(mask_mod, batch, length, device):
        """A BlockMask of the real one's size: compiled create_block_mask's int32 block tables,
        O((length / 128)^2), never the (length, length) mask."""
        import torch
        from torch.nn.attention.flex_attention import BlockMask

        blocks = -(-length // 128)
        tables = [torch.zeros(batch or 1, 1, blocks, *extra, dtype=torch.int32, device=device)
                  for extra in ((), (blocks,), (), (blocks,))]
        return BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=128, mask_mod=mask_mod, seq_lengths=(length, length))


@functools.lru_cache(maxsize=None)
def _flex_allocations_function():
    import torch

    class FlexAllocations(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out = q.new_empty(q.shape[:-1] + v.shape[-1:])
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, out, lse = ctx.saved_tensors
            grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            torch.empty_like(lse)  # delta, sum(out * grad_out) per query: live with the gradients
            return grads

    return FlexAllocations


@contextmanager
def _cuda_attention() -> Iterator[None]:
    """CUDA's attention (lit_qlora.model.attention, lit_qlora.model.flex): flex_attention, O(L), where a window,
    packed documents or a soft cap needs a mask (unless LIT_QLORA_FLEX_ATTENTION=0), with `_FlexAllocations` standing
    in for its kernels."""
    from lit_qlora.model import attention, flex, transformer

    if attention.flex_setting() is False:
        yield
        return
    with _patched(transformer, "use_flex_attention", lambda device: True), \
            _patched(flex, "flex_attend", _FlexAllocations.attend), \
            _patched(flex, "block_mask", _FlexAllocations.block_mask):
        yield


@contextmanager
def cuda_code_paths() -> Iterator[None]:
    """Inside, the model's code takes the paths a GPU takes, on fake CPU tensors: NF4 weights dequantized whole,
    flex_attention where a mask needs it, CUDA's fused dropout, LoRA dropout replayed in backward (not the CPU's
    hash mask). `trace_step` counts their allocations; `benchmarks/gpu/launch_count.py` counts their kernels."""
    import torch

    from lit_qlora.lora import dropout as lora_dropout
    from lit_qlora.nf4 import grouped
    from lit_qlora.train import loss

    with ExitStack() as stack:
        stack.enter_context(_patched(loss, "logits_chunk_elems", lambda device: loss.CUDA_LOGITS_CHUNK_ELEMS))
        stack.enter_context(_patched(grouped, "keeps_expert_products", lambda x: False))
        stack.enter_context(_gpu_nf4_paths())
        stack.enter_context(_cuda_attention())
        stack.enter_context(_patched(torch.nn.functional, "dropout", _cuda_dropout))
        stack.enter_context(_patched(lora_dropout, "hash_dropout_applies", lambda x: False))
        stack.enter_context(_patched(lora_dropout, "replayed_dropout_applies", lambda x: True))
        yield


def offload_decision(config: Config, precision: Precision, train: TrainArgs, device: str,  # noqa: F821
                     micro_batch_size: Optional[int] = None, device_total: Optional[int] = None,
                     rows: int = 1) -> tuple[bool, str, int]:
    """(offload or not, why, the pinned bytes it takes) for the recipe as a run on `device` (a card of
    `device_total` bytes, where known: --device_memory) would decide it (lit_qlora.train.offload.offload_choice),
    but for the host's available memory, which is not known here. `rows`: sequences per sample (a preference pair's
    2: the run decides on its micro_batch_size alone, and the pinned buffers hold every row)."""
    from lit_qlora.base.precision import PRECISION_DTYPES
    from lit_qlora.model.offload import pinned_size
    from lit_qlora.train.offload import block_input_bytes, offload_choice

    blocks = train.checkpointed_blocks(config.n_layer)
    batch = micro_batch_size or train.micro_batch_size
    one = block_input_bytes(config.n_embd, 1, batch, train.max_seq_length, PRECISION_DTYPES[precision].itemsize)
    on, why = offload_choice(train.offload_activations, device == "cuda", blocks, one * blocks,
                             device_total=device_total)
    if not on:
        return on, why, 0
    # CUDA's pinned pieces: only each block's last one is rounded up to a power of two (lit_qlora.model.offload)
    one *= rows
    return on, why, blocks * (pinned_size(one) if device == "cuda" else one)


def trace_step(config: Config, quantize: Quantize, precision: Precision, lora: LoRAArgs, train: TrainArgs,  # noqa: F821
               device: str = "cuda", micro_batch_size: Optional[int] = None, device_total: Optional[int] = None,
               objective: Optional[PreferenceStep | GRPOStep] = None) -> AllocationTrace:  # noqa: F821
    """Two optimizer steps of a fine-tune (each: forward, loss, backward per micro-batch, clipping, AdamW) on fake
    tensors; the trace holds the peak of allocated bytes and its categories. With `objective`, that objective's
    micro-batch instead of the language-model loss: `litqlora dpo`'s (lit_qlora.methods.dpo.estimate.PreferenceStep:
    micro_batch_size pairs, two sequences each) or `litqlora grpo`'s (lit_qlora.methods.grpo.estimate.GRPOStep)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lit_qlora.base.precision import ADAPTER_DTYPES, PRECISION_DTYPES
    from lit_qlora.lora.layer import apply_lora
    from lit_qlora.checkpoint.loading import default_dtype, random_base
    from lit_qlora.memory.trace import AllocationTrace, StepPhase
    from lit_qlora.nf4 import is_nf4, linear
    from lit_qlora.model import tiled_mlp
    from lit_qlora.train import loss, tiled_loss
    from lit_qlora.train.loss import lm_loss_sum

    dtype = PRECISION_DTYPES[precision]
    lora_dtype = ADAPTER_DTYPES[precision]  # fp32 under 16-mixed
    batch = micro_batch_size or train.micro_batch_size
    accumulation = train.accumulation(1)
    phase = StepPhase()
    with ExitStack() as stack:
        stack.enter_context(_nf4_caches_set_aside())
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        model = random_base(config, quantize, dtype)
        apply_lora(model, lora.r, lora.alpha, lora.dropout, lora.targets, lora.rslora, lora_dtype)
        model.checkpoint_blocks = train.checkpointed_blocks(config.n_layer)
        if offload_decision(config, precision, train, device, batch, device_total)[0]:
            from lit_qlora.model.offload import ActivationOffload

            model.activation_offload = offload = ActivationOffload()
            offload.to_host = phase.wrap(_point(offload, "to_host"), OFFLOADED)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        shapes = {(tuple(p.shape), p.dtype) for p in params}
        optimizer = torch.optim.AdamW(params, **train.adamw(), fused=True)

        def categorize(t: torch.Tensor) -> str:
            if phase.tag is not None:
                return phase.tag
            if t.dim() and t.shape[-1] == config.vocab_size:
                return "logits/loss chunks"
            if phase.phase == "optimizer":
                return "optimizer state" if (tuple(t.shape), t.dtype) in shapes or t.dim() == 0 else "other temporaries"
            if phase.phase in ("forward", "reference") or torch.is_grad_enabled():  # (backward: a block's recompute)
                return "activations"
            return "gradients" if (tuple(t.shape), t.dtype) in shapes else "other temporaries"

        def context() -> str:  # named beside each op in the peak's breakdown
            recomputing = phase.phase == "backward" and torch.is_grad_enabled()
            return "backward, recomputing a checkpointed block" if recomputing else phase.phase

        trace = AllocationTrace(categorize, CUDA_BLOCK if device == "cuda" else 1, frozenset({OFFLOADED}), context)
        for name, p in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
            if p.requires_grad:
                trace.hold(p, "LoRA weights")
            elif is_nf4(p) or (p.dim() in (2, 3) and "embed_tokens" not in name):  # (3: a block's stacked experts)
                trace.hold(p, "frozen base")
            else:
                trace.hold(p, "embeddings and norms")
        for name in ("dense_rows", "dense_stack"):  # one weight's dense rows; a fused group's stacked weights
            stack.enter_context(_patched(linear, name, phase.wrap(_point(linear, name), "NF4 dequantize scratch")))
        stack.enter_context(_patched(loss, "head_ce_sum", _first_loss_chunks_traced()))
        # Every tile allocates alike: trace the first few (an 8B step at 100k+ tokens has thousands). But for CPU
        # dropout, whose first run keeps each tile's down products for the recompute (tokens x r per adapter).
        tiles_alike = (tiled_loss, tiled_mlp) if device == "cuda" or not lora.dropout else (tiled_loss,)
        for tiled in tiles_alike:
            stack.enter_context(_patched(tiled, "tile_starts",
                                         lambda n, tile: range(0, min(n, TRACED_LOSS_CHUNKS * tile), tile)))
        # an NF4 head's loss runs slice by slice of the vocabulary: no tensor is vocabulary-wide, so it is tagged
        for name in ("nf4_head_ce_sum", "tiled_ce_sum"):
            stack.enter_context(_patched(loss, name, phase.wrap(_point(loss, name), "logits/loss chunks")))
        ids = torch.zeros(batch, train.max_seq_length, dtype=torch.long)
        if objective is not None:
            objective.prepare(model, batch, train.max_seq_length, phase, trace, train.init_adapter is not None)
        stack.enter_context(default_dtype(dtype))  # as the precision plugin sets it inside training steps
        if device == "cuda":
            stack.enter_context(cuda_code_paths())
        with trace:
            if objective is not None:
                objective.before_training()
            for _ in range(2):
                for _ in range(min(accumulation, 2)):  # a second micro-batch runs with the gradients present
                    phase.phase = "forward"
                    loss = lm_loss_sum(model, ids, ids) / ids.numel() if objective is None else objective.loss()
                    phase.phase = "backward"
                    if objective is None:
                        loss.backward()
                    else:
                        objective.backward(loss)
                    del loss
                phase.phase = "optimizer"
                if train.max_norm > 0:
                    torch.nn.utils.clip_grad_norm_(params, train.max_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return trace


FSDP_GATHER = "FSDP's gathered block and the prefetched next one"
"""The part of "other temporaries" parallel_bytes adds under FSDP."""


def other_temporaries(trace: AllocationTrace, parts: dict[str, int], largest: int = 3) -> dict[str, int]:  # noqa: F821
    """"other temporaries" at the peak by what allocated them (the op, and the step's phase), the `largest` named and
    the rest summed; FSDP's gathered blocks (parallel_bytes) apart."""
    ranked = sorted(trace.peak_other_by_origin.items(), key=lambda item: -item[1])
    named = dict(ranked[:largest])
    rest = sum(nbytes for _, nbytes in ranked[largest:])
    if rest:
        named["everything else"] = rest
    gathered = parts["other temporaries"] - trace.peak_by_category["other temporaries"]
    if gathered:
        named[FSDP_GATHER] = gathered
    return named


def parallel_bytes(by_category: dict[str, int], config: Config, strategy: str, world_size: int,  # noqa: F821
                   tensor_parallel: int) -> dict[str, int]:
    """One rank's bytes by category under a parallel strategy, from the one-rank trace (see the module doc)."""
    parts = dict(by_category)
    if strategy == "fsdp" and world_size > 1:
        block_share = (parts["frozen base"] + parts["LoRA weights"]) / config.n_layer
        for key in ("frozen base", "embeddings and norms", "LoRA weights", "gradients", "optimizer state"):
            parts[key] = parts[key] // world_size
        parts["other temporaries"] += int(2 * block_share)  # the gathered block and the prefetched next one
    elif strategy == "ddp" and world_size > 1:
        parts["gradients"] *= 2  # DDP's flat bucket beside each gradient
    elif strategy == "tp" and tensor_parallel > 1:
        for key in ("frozen base", "LoRA weights", "gradients", "optimizer state"):
            parts[key] = parts[key] // tensor_parallel
        parts["activations"] = parts["activations"] * 2 // (tensor_parallel + 1)  # the residual stream stays whole
    return parts
