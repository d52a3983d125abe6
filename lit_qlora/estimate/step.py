"""`litqlora estimate`: a fine-tune recipe's peak device memory, predicted before any weights are downloaded or a
GPU is at hand.

One training step of the real code (the loader's modules and NF4 layout, LoRA, the fine-tune's loss, backward,
clipping, fused AdamW, then a second step so optimizer state is counted) runs on fake tensors: shapes and dtypes
propagate, no data exists, and `memory_trace.AllocationTrace` counts every allocation by category. What is
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
import json
import re
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Optional

from lit_qlora.hardware import PrecisionChoice, choose_precision
from lit_qlora.train.args import DataArgs, LoRAArgs, TrainArgs

# torch and the model stack are imported inside the functions, and annotations name their types as text: the CLI
# imports `estimate` to build `--help` (lit_qlora.cli.commands says why and how).

GiB = 1 << 30
CUDA_BLOCK = 512  # the caching allocator rounds every allocation up to this
OFFLOADED = "offloaded activations (host)"  # a host-memory category of the trace: beside the device's peak
CUDA_RESERVE = 1 << 29  # beside the peak on a real card: CUDA context and cuBLAS workspaces (~0.5 GiB)
FRAGMENTATION = 1.10  # reserved over allocated, as PyTorch's caching allocator typically runs


def parse_bytes(text: str) -> int:
    """'24GiB', '24 GB', '80G', '512MiB' -> bytes (GB and G read as GiB: card sizes are quoted that way)."""
    found = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not found:
        raise ValueError(f"--device_memory {text!r} is not a size; write it like 24GiB, 80GB or 512MiB.")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[found[2].upper()]
    return int(float(found[1]) * scale)


def resolve_config(checkpoint_dir: str | Path) -> tuple[Config, str]:
    """The model to estimate and where its shape came from: a directory's config.json (no weights needed), a preset
    name, or, for a recipe whose checkpoint is not downloaded, the preset its directory is named after."""
    from lit_qlora.model.config import PRESETS, Config

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
    raise ValueError(f"--checkpoint_dir {checkpoint_dir}: no config.json there and no preset of that name. Give a "
                     f"directory with the model's config.json (weights are not needed) or one of the presets: "
                     f"{', '.join(sorted(PRESETS))}.")


@contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
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
    caches = (reference._TABLE_CACHE, linear._scratch.__dict__, linear._cuda_scratch.__dict__)  # (CPU, CUDA buffers)
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

    real, seen = loss._head_ce_sum, [0]

    def head_ce_sum(head, hidden, targets):
        seen[0] = 1 if hidden.storage_offset() == 0 else seen[0] + 1
        if seen[0] <= TRACED_LOSS_CHUNKS:
            return real(head, hidden, targets)
        return hidden.float().sum() * 0.0

    return head_ce_sum


def resident_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a real run holds between steps (for `memory_trace.profiled_peak`, the measurement an estimate is checked
    against): weights, LoRA and its AdamW state, our NF4 scratch buffers. (Not the C kernels' lookup tables,
    ~0.2 MiB of process-wide constants, which no estimate counts.)"""
    import torch

    from lit_qlora.nf4 import linear

    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors + list((getattr(linear._scratch, "buffers", None) or {}).values())


@contextmanager
def _gpu_nf4_paths() -> Iterator[None]:
    """What a GPU allocates for an NF4 matmul: the whole weight dense (one Triton launch) in a buffer reused across
    calls, grown to the largest weight: the CPU's scratch buffer, on fake CPU tensors, stands in for it."""
    from lit_qlora.nf4 import linear

    with _patched(linear, "whole_weight", lambda weight: True):
        yield


def _cuda_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
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
    """CUDA's attention (lit_qlora.model.attention): flex_attention, O(L), where a window, packed documents or a soft cap
    needs a mask (unless LIT_QLORA_FLEX_ATTENTION=0), with `_FlexAllocations` standing in for its kernels."""
    from lit_qlora.model import attention, attention_mask, transformer

    if attention.flex_setting() is False:
        yield
        return
    with _patched(transformer, "use_flex_attention", lambda device: True), \
            _patched(attention, "flex_attend", _FlexAllocations.attend), \
            _patched(attention_mask, "block_mask", _FlexAllocations.block_mask):
        yield


@contextmanager
def cuda_code_paths() -> Iterator[None]:
    """Inside, the model's code takes the paths a GPU takes, on fake CPU tensors: NF4 weights dequantized whole,
    flex_attention where a mask needs it, CUDA's fused dropout, LoRA dropout replayed in backward (not the CPU's
    hash mask). `trace_step` counts their allocations; `benchmarks/launch_count.py` counts their kernels."""
    import torch

    from lit_qlora.lora import dropout as lora_dropout
    from lit_qlora.train import loss

    with ExitStack() as stack:
        stack.enter_context(_patched(loss, "logits_chunk_elems", lambda device: loss.CUDA_LOGITS_CHUNK_ELEMS))
        stack.enter_context(_gpu_nf4_paths())
        stack.enter_context(_cuda_attention())
        stack.enter_context(_patched(torch.nn.functional, "dropout", _cuda_dropout))
        stack.enter_context(_patched(lora_dropout, "hash_dropout_applies", lambda x: False))
        stack.enter_context(_patched(lora_dropout, "replayed_dropout_applies", lambda x: True))
        yield


def offload_decision(config: Config, precision: Precision, train: TrainArgs, device: str,
                     micro_batch_size: Optional[int] = None) -> tuple[bool, str, int]:
    """(offload or not, why, the pinned bytes it takes) for the recipe as a run on `device` would decide it
    (lit_qlora.train.offload.offload_choice), but for the host's available memory, which is not known here."""
    from lit_qlora.model.config import PRECISION_DTYPES
    from lit_qlora.model.offload import pinned_size
    from lit_qlora.train.offload import block_input_bytes, offload_choice

    n_ckpt = train.activation_checkpointing
    blocks = config.n_layer if n_ckpt is True else int(n_ckpt or 0)
    batch = micro_batch_size or train.micro_batch_size
    one = block_input_bytes(config.n_embd, 1, batch, train.max_seq_length, PRECISION_DTYPES[precision].itemsize)
    on, why = offload_choice(train.offload_activations, device == "cuda", blocks, one * blocks)
    if not on:
        return on, why, 0
    # CUDA's pinned pieces: only each block's last one is rounded up to a power of two (lit_qlora.model.offload)
    return on, why, blocks * (pinned_size(one) if device == "cuda" else one)


def trace_step(config: Config, quantize: Quantize, precision: Precision, lora: LoRAArgs, train: TrainArgs,
               device: str = "cuda", micro_batch_size: Optional[int] = None) -> AllocationTrace:
    """Two optimizer steps of a fine-tune (each: forward, loss, backward per micro-batch, clipping, AdamW) on fake
    tensors; the trace holds the peak of allocated bytes and its categories."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lit_qlora.model.config import ADAPTER_DTYPES, PRECISION_DTYPES
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
        n_ckpt = train.activation_checkpointing
        model.checkpoint_blocks = config.n_layer if n_ckpt is True else int(n_ckpt or 0)
        if offload_decision(config, precision, train, device, batch)[0]:
            from lit_qlora.model.offload import ActivationOffload

            model.activation_offload = ActivationOffload()
            model.activation_offload._to_host = phase.wrap(model.activation_offload._to_host, OFFLOADED)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        shapes = {(tuple(p.shape), p.dtype) for p in params}
        optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay, betas=(0.9, 0.95),
                                      fused=True)

        def categorize(t: torch.Tensor) -> str:
            if phase.tag is not None:
                return phase.tag
            if t.dim() and t.shape[-1] == config.vocab_size:
                return "logits/loss chunks"
            if phase.phase == "optimizer":
                return "optimizer state" if (tuple(t.shape), t.dtype) in shapes or t.dim() == 0 else "other temporaries"
            if phase.phase == "forward" or torch.is_grad_enabled():  # (in backward: a checkpointed block's recompute)
                return "activations"
            return "gradients" if (tuple(t.shape), t.dtype) in shapes else "other temporaries"

        trace = AllocationTrace(categorize, CUDA_BLOCK if device == "cuda" else 1, frozenset({OFFLOADED}))
        for name, p in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
            if p.requires_grad:
                trace.hold(p, "LoRA weights")
            elif is_nf4(p) or (p.dim() == 2 and "embed_tokens" not in name):
                trace.hold(p, "frozen base")
            else:
                trace.hold(p, "embeddings and norms")
        for name in ("_dense_rows", "dense_stack"):  # one weight's dense rows; a fused group's stacked weights
            stack.enter_context(_patched(linear, name, phase.wrap(getattr(linear, name), "NF4 dequantize scratch")))
        stack.enter_context(_patched(loss, "_head_ce_sum", _first_loss_chunks_traced()))
        # Every tile allocates alike: trace the first few (an 8B step at 100k+ tokens has thousands). But for CPU
        # dropout, whose first run keeps each tile's down products for the recompute (tokens x r per adapter).
        tiles_alike = (tiled_loss, tiled_mlp) if device == "cuda" or not lora.dropout else (tiled_loss,)
        for tiled in tiles_alike:
            stack.enter_context(_patched(tiled, "tile_starts",
                                         lambda n, tile: range(0, min(n, TRACED_LOSS_CHUNKS * tile), tile)))
        # an NF4 head's loss runs slice by slice of the vocabulary: no tensor is vocabulary-wide, so it is tagged
        stack.enter_context(_patched(loss, "nf4_head_ce_sum", phase.wrap(loss.nf4_head_ce_sum, "logits/loss chunks")))
        stack.enter_context(_patched(loss, "tiled_ce_sum", phase.wrap(loss.tiled_ce_sum, "logits/loss chunks")))
        ids = torch.zeros(batch, train.max_seq_length, dtype=torch.long)
        stack.enter_context(default_dtype(dtype))  # as the precision plugin sets it inside training steps
        if device == "cuda":
            stack.enter_context(cuda_code_paths())
        with trace:
            for _ in range(2):
                for _ in range(min(accumulation, 2)):  # a second micro-batch runs with the gradients present
                    phase.phase = "forward"
                    loss = lm_loss_sum(model, ids, ids) / ids.numel()
                    phase.phase = "backward"
                    loss.backward()
                    del loss
                phase.phase = "optimizer"
                if train.max_norm > 0:
                    torch.nn.utils.clip_grad_norm_(params, train.max_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return trace


def parallel_bytes(by_category: dict[str, int], config: Config, strategy: str, world_size: int,
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


def estimate(
    checkpoint_dir: str = "checkpoints/SmolLM2-135M-Instruct",
    out_dir: Path = Path("out/estimate"),
    quantize: Literal["nf4", "none"] = "nf4",
    precision: PrecisionChoice = "auto",
    seed: int = 1337,
    devices: int = 1,
    num_nodes: int = 1,
    strategy: Literal["auto", "ddp", "fsdp", "tp"] = "auto",
    tensor_parallel: int = 1,
    lora: LoRAArgs = LoRAArgs(),
    train: TrainArgs = TrainArgs(),
    data: DataArgs = DataArgs(),
    device: Literal["cuda", "cpu"] = "cuda",
    device_memory: Optional[str] = None,
) -> dict[str, Any]:
    """Predict a fine-tune's peak device memory per rank, by category, without weights or a GPU.

    Args:
        checkpoint_dir: A model directory (only its config.json is read), a preset name from lit_qlora/model/config.py
            (e.g. Llama-2-7b), or a recipe's checkpoint directory that is not downloaded yet (its preset is used).
        out_dir: Where estimate.json goes.
        quantize: nf4 (QLoRA) or none (LoRA), as for finetune.
        precision: As for finetune; auto is what finetune's auto picks on the target --device: bf16-true for
            cuda (it assumes a GPU with bf16, compute capability >= 8.0; for a T4 or V100 pass 16-mixed), and for
            cpu what this machine's CPU would pick.
        seed: Accepted so a finetune recipe reads as it is (an estimate has no randomness).
        devices: Devices per node, as for finetune.
        num_nodes: Nodes, as for finetune.
        strategy: auto, ddp, fsdp or tp, as for finetune.
        tensor_parallel: Ranks per tensor-parallel group with --strategy tp.
        lora: Adapter settings, as for finetune.
        train: Optimization settings, as for finetune (micro_batch_size, max_seq_length, activation_checkpointing
            set the step's size).
        data: Accepted so a finetune recipe reads as it is (the step runs on max_seq_length tokens per sequence).
        device: cuda (predict torch.cuda.max_memory_allocated on a GPU) or cpu (allocated tensor bytes on a CPU).
        device_memory: The card's memory, e.g. 24GiB: also find the largest micro-batch size that fits, with and
            without activation checkpointing; with --train.max_seq_length auto, the longest sequence that fits at
            the given micro-batch instead (and the host memory it needs for offloaded activations).
    """
    from lit_qlora.checkpoint.files import atomic_write_text
    from lit_qlora.model.config import Quantize

    auto_length = train.max_seq_length == "auto"
    for flag, value, least in (("--devices", devices, 1), ("--num_nodes", num_nodes, 1),
                               ("--train.micro_batch_size", train.micro_batch_size, 1),
                               ("--train.max_seq_length", AUTO_LENGTH_TRACES[0] if auto_length else train.max_seq_length,
                                2)):
        if not isinstance(value, int):
            raise ValueError(f"{flag} takes a whole number, got {value!r}.")
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}.")
    config, source = resolve_config(checkpoint_dir)
    quantize = Quantize(quantize)
    world_size = devices * num_nodes
    strategy = strategy if strategy != "auto" else ("ddp" if world_size > 1 else "auto")
    if strategy == "tp" and (tensor_parallel < 2 or world_size % tensor_parallel):
        raise ValueError(f"--strategy tp needs --tensor_parallel >= 2 dividing devices x num_nodes ({world_size}).")
    train.accumulation(world_size // (tensor_parallel if strategy == "tp" else 1))  # checks the batch sizes
    train.require_valid_offload(device == "cuda")
    budget = parse_bytes(device_memory) if device_memory is not None else None
    if auto_length and budget is None:
        raise ValueError("--train.max_seq_length auto asks for the longest sequence that fits a card: give the card's "
                         "memory too, e.g. --device_memory 24GiB.")
    precision, precision_reason = estimate_precision(precision, device)
    print(f"Estimating {config.name} ({source}): {'QLoRA (NF4 base)' if quantize is Quantize.NF4 else 'LoRA'}, "
          f"micro-batch {train.micro_batch_size} x {train.max_seq_length} tokens, activation checkpointing "
          f"{train.activation_checkpointing}, {world_size} rank(s), {device}, precision {precision} "
          f"({precision_reason})")

    @functools.cache  # the batch and length searches may ask again for a size and setting already traced
    def predict(micro_batch_size: int, checkpointing: Any = train.activation_checkpointing,
                length: Optional[int] = None, offload: Any = None) -> tuple[int, dict, int]:
        """(peak device bytes, by category, host bytes of offloaded activations) at this batch, checkpointing,
        sequence length and offload setting (defaults: the recipe's)."""
        offload = (train.offload_activations if offload is None else offload) if checkpointing else False
        trace = trace_step(config, quantize, precision, lora, replace(
            train, activation_checkpointing=checkpointing, offload_activations=offload,
            max_seq_length=length or train.max_seq_length), device, micro_batch_size)
        parts = parallel_bytes(trace.peak_by_category, config, strategy, world_size, tensor_parallel)
        return sum(parts.values()), parts, trace.host_peak

    searched: dict[str, Any] = {}
    if auto_length:
        if train.offload_activations == "auto" and train.activation_checkpointing and device == "cuda":
            # auto turns offload on at the lengths this search is about; one setting for every trace keeps the
            # growth a line (auto switching on between two traces would bend it)
            train = replace(train, offload_activations=True)
            print("Offloaded activation checkpoints: on for the length search (auto is on wherever it saves 1 GiB)")
        searched = longest_context(lambda length: predict(train.micro_batch_size, train.activation_checkpointing,
                                                          length, train.offload_activations)[0], budget, device)
        train = replace(train, max_seq_length=searched["max_seq_length"] or LENGTH_STEP)
    offload, offload_reason, pinned = offload_decision(config, precision, train, device)
    print(f"Offloaded activation checkpoints: {'on' if offload else 'off'} ({offload_reason})")
    peak, by_category, host = predict(train.micro_batch_size, train.activation_checkpointing, train.max_seq_length,
                                      train.offload_activations)
    result: dict[str, Any] = {
        "model": config.name, "source": source, "quantize": str(quantize), "precision": precision,
        "precision_reason": precision_reason, "device": device,
        "world_size": world_size, "strategy": strategy, "tensor_parallel": tensor_parallel,
        "micro_batch_size": train.micro_batch_size, "max_seq_length": train.max_seq_length,
        "activation_checkpointing": train.activation_checkpointing, "peak_bytes": peak, "by_category": by_category,
        "offload_activations": offload, "offload_reason": offload_reason, "offload_host_bytes": host,
        "offload_pinned_bytes": pinned, "max_micro_batch_size": None,
    }
    if auto_length:
        result.update(device_memory_bytes=budget, **searched)
    elif budget is not None:
        result.update(device_memory_bytes=budget, **largest_batches(predict, budget, device))
        result["max_micro_batch_size"] = result["max_micro_batch_size_by_checkpointing"][
            "on" if train.activation_checkpointing else "off"]
    print(render(result))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "estimate.json", json.dumps(result, indent=2) + "\n")
    print(f"Wrote {out_dir / 'estimate.json'}")
    return result


def estimate_precision(precision: str, device: str) -> tuple[str, str]:
    """(the precision the estimate models, why): --precision auto on a cuda target assumes an Ampere-or-newer GPU."""
    if precision == "auto" and device == "cuda":
        return "bf16-true", ("auto on cuda, assuming a GPU with bf16 (compute capability >= 8.0); a T4 or V100 "
                             "runs 16-mixed: pass --precision 16-mixed")
    return choose_precision(precision, device)


def fits(peak: int, budget: int, device: str) -> bool:
    if device == "cuda":
        return peak * FRAGMENTATION + CUDA_RESERVE <= budget
    return peak <= budget


def largest_batches(predict, budget: int, device: str, limit: int = 256, traces: int = 5) -> dict[str, Any]:
    """The largest micro-batch size that fits `budget`, with activation checkpointing on and off. Memory grows
    about linearly with the batch: the line through the two latest traces guesses the answer (a secant search),
    at most `traces` traces per setting (an 8B trace takes about a minute). The answer is
    always a size whose trace fits."""
    usable = (budget - CUDA_RESERVE) / FRAGMENTATION if device == "cuda" else budget
    found = {}
    for key, checkpointing in (("on", True), ("off", False)):
        peaks: dict[int, int] = {}
        best, over, size = 0, limit + 1, 1  # largest size known to fit, smallest known not to, next to trace
        while len(peaks) < traces and best < size < over:
            peaks[size] = predict(size, checkpointing)[0]
            if fits(peaks[size], budget, device):
                best = size
            else:
                over = size
            if best == 0:
                break  # not even one sequence fits
            if size == 1:
                size = 2
                continue
            last, before = list(peaks)[-1], list(peaks)[-2]  # the line through the two latest traces
            per_sample = max(1.0, (peaks[last] - peaks[before]) / (last - before))
            size = min(over - 1, max(best + 1, last + int((usable - peaks[last]) // per_sample)))
        found[key] = best
    needed = found["off"] == 0 and found["on"] > 0
    return {"max_micro_batch_size_by_checkpointing": found, "activation_checkpointing_needed": needed}


AUTO_LENGTH_TRACES = (8192, 32768)  # the first line is fitted through these (the fixed part is settled by 8k)
LENGTH_STEP = 256


def longest_context(predict: Callable[[int], int], budget: int, device: str, traces: int = 6,
                    limit: int = 1 << 24) -> dict[str, Any]:
    """The longest sequence (a multiple of LENGTH_STEP tokens) whose traced peak fits `budget`, by a secant search.

    With offloaded activation checkpoints and the tiled MLP and loss, the peak grows linearly with the length (O(L)
    attention, no L x intermediate or L x vocabulary buffer) but for two kinks where tiling starts (the MLP past
    one tile, the loss past V / 2 tokens), after which it grows more slowly. So the line through two traces is
    followed to the budget, the guess is traced, and the line through the two latest traces gives the next guess,
    until a traced length fits with less than one more step of room (the line being exact past the last kink,
    this takes one or two traces beyond the first two), at most `traces` in all. The answer is always a length
    whose trace fits (0: not even LENGTH_STEP tokens)."""
    usable = (budget - CUDA_RESERVE) / FRAGMENTATION if device == "cuda" else budget
    peaks = {length: predict(length) for length in AUTO_LENGTH_TRACES}
    best = max((n for n, p in peaks.items() if fits(p, budget, device)), default=0)
    over = min((n for n, p in peaks.items() if not fits(p, budget, device)), default=limit + LENGTH_STEP)
    while len(peaks) < traces and over - best > LENGTH_STEP:
        (x0, p0), (x1, p1) = list(peaks.items())[-2:]
        slope = max(1.0, (p1 - p0) / (x1 - x0))
        guess = int(x1 + (usable - p1) / slope) // LENGTH_STEP * LENGTH_STEP
        guess = min(over - LENGTH_STEP, max(best + LENGTH_STEP, guess))
        if guess in peaks:
            break
        peaks[guess] = predict(guess)
        if not fits(peaks[guess], budget, device):
            over = guess
            continue
        best = guess
        slope = max(1.0, (peaks[guess] - p1) / (guess - x1))
        if peaks[guess] + slope * LENGTH_STEP > usable:
            break  # one step more would not fit by the line through the two latest traces
    low, high = AUTO_LENGTH_TRACES
    return {"max_seq_length": best, "traced_peaks": {str(n): p for n, p in sorted(peaks.items())},
            "bytes_per_token": round((peaks[high] - peaks[low]) / (high - low))}


def render(result: dict[str, Any]) -> str:
    from lit_qlora.memory.trace import CATEGORIES

    rank = f" per rank ({result['world_size']} ranks, {result['strategy']})" if result["world_size"] > 1 else ""
    lines = [f"Predicted peak {result['device']} memory{rank}: {result['peak_bytes'] / GiB:.2f} GiB", "",
             f"{'category':<24}{'GiB':>9}"]
    lines += [f"{name:<24}{result['by_category'][name] / GiB:>9.3f}" for name in CATEGORIES]
    if result.get("offload_activations"):
        lines += ["", f"Host memory for offloaded activations: {result['offload_host_bytes'] / GiB:.2f} GiB (not in "
                      f"the peak above; {result['offload_pinned_bytes'] / GiB:.2f} GiB of pinned buffers)"]
    if "traced_peaks" in result:
        lines += ["", f"On {result['device_memory_bytes'] / GiB:.0f} GiB: the longest sequence that fits micro-batch "
                      f"{result['micro_batch_size']} is {result['max_seq_length']} tokens "
                      f"({result['bytes_per_token'] / 1024:.0f} KiB more per token; traced at "
                      f"{', '.join(result['traced_peaks'])})"]
    elif "device_memory_bytes" in result:
        sizes = result["max_micro_batch_size_by_checkpointing"]
        lines += ["", f"On {result['device_memory_bytes'] / GiB:.0f} GiB: largest micro-batch {sizes['on']} with "
                      f"activation checkpointing, {sizes['off']} without"
                      + (" (checkpointing is needed)" if result["activation_checkpointing_needed"] else "")]
        if sizes["on"] == 0:
            lines.append("Not even micro-batch 1 fits: use --quantize nf4, a shorter --train.max_seq_length, or "
                         "more devices with --strategy fsdp.")
    return "\n".join(lines)
