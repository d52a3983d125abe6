"""NF4 layouts: which ``(block_size, scaler_block_size)`` makes a weight quantizable and shardable, and how rows
map onto quantization blocks.

torchao's ``to_nf4`` needs ``numel % (block_size * scaler_block_size) == 0``; real layers break this (SmolLM2's
k_proj is 192x576), so :func:`nf4_layout` picks a ``scaler_block_size`` that fits any shape whose element count
is a multiple of the block size, and that FSDP2 can split along dim 0.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

from torchao.quantization import NF4Tensor

from lit_qlora.base.errors import InvalidInput


class NF4Layout(NamedTuple):
    """``(block_size, scaler_block_size)`` to pass to :func:`~lit_qlora.nf4.quantize_nf4` or torchao's ``to_nf4``."""

    block_size: int
    scaler_block_size: int


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending."""
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def check_layout(shape: Sequence[int], block_size: int, scaler_block_size: int, world_size: int) -> None:
    """Raise ``ValueError`` unless ``shape`` quantizes with this layout and splits along dim 0 into
    ``world_size`` shards of whole blocks and whole scaler groups."""
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (1, 2):
        raise ValueError(f"NF4 quantizes 1-D or 2-D tensors, got shape {shape}")
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size must be a positive even number, got {block_size}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    numel = math.prod(shape)
    if numel == 0 or numel % block_size:
        raise InvalidInput(
            f"cannot quantize shape {shape} to NF4: numel {numel} is not a multiple of block_size {block_size}; "
            "NF4 needs whole blocks (pad the tensor, e.g. in_features, to a multiple of the block size)"
        )
    n_blocks = numel // block_size
    if scaler_block_size <= 0 or n_blocks % scaler_block_size:
        raise ValueError(
            f"scaler_block_size {scaler_block_size} does not divide the {n_blocks} blocks of shape {shape} "
            f"(block_size {block_size}); use nf4_layout() to pick one"
        )
    if world_size > 1:
        if shape[0] % world_size:
            raise InvalidInput(
                f"shape {shape} cannot be sharded along dim 0 across {world_size} ranks: {shape[0]} rows are "
                "not divisible by the world size (FSDP2 would pad the last shard, which NF4Tensor cannot hold); "
                "choose another --nf4_shards (or devices x num_nodes with --strategy fsdp)"
            )
        if n_blocks % world_size:
            raise InvalidInput(
                f"shape {shape} cannot be sharded along dim 0 across {world_size} ranks: a shard of "
                f"{shape[0] // world_size} rows holds a fraction of a {block_size}-element block; choose another "
                "--nf4_shards (or devices x num_nodes with --strategy fsdp)"
            )
        if (n_blocks // scaler_block_size) % world_size:
            raise ValueError(
                f"shape {shape}: {n_blocks // scaler_block_size} scaler blocks cannot be split evenly across "
                f"{world_size} ranks (scaler_block_size {scaler_block_size}); use nf4_layout(world_size=...)"
            )


def nf4_layout(
    shape: Sequence[int],
    block_size: int = 64,
    scaler_block_size: int = 256,
    world_size: int = 1,
    *,
    min_scaler_block_size: int = 8,
) -> NF4Layout:
    """Choose the NF4 layout for a weight of ``shape`` so that it quantizes without padding and shards.

    ``to_nf4`` needs ``numel % (block_size * scaler_block_size) == 0``. ``block_size`` (elements per absmax
    scale, 64 in QLoRA) is kept; the ``scaler_block_size`` (number of blocks whose scales share one
    double-quantization factor) is chosen among the divisors ``d`` of ``n_blocks / world_size`` as the one
    closest to the requested value on a log scale (the requested value itself when it divides; on a tie the
    smaller one, i.e. finer double quantization). Divisors below ``min_scaler_block_size`` are only used
    when nothing else exists: below 8 the per-group factors push storage above ~0.52 bytes/parameter.
    A divisor always exists (``n_blocks / world_size`` itself: one group per shard), e.g. for a prime block
    count, so every shape whose numel is a multiple of ``block_size`` gets a layout.

    FSDP2 rule (torchao 0.18's ``NF4Tensor``): FSDP2 shards a parameter with ``torch.chunk(dim=0)``
    (``aten.split``), ``new_zeros`` for the padded shard, ``narrow``/``copy_`` and ``view(-1)``; NF4Tensor
    implements these by splitting ``quantized_data``, ``quantized_scalers`` and ``quantization_factor``
    into ``world_size`` equal flat pieces (``scaler_mean`` and ``nf4`` are replicated, and ``n_blocks`` and
    ``scaler_block_size`` are kept). The pieces line up with whole rows and whole scaler groups only if

    * ``shape[0] % world_size == 0`` (an uneven dim-0 split makes FSDP2 pad, which NF4Tensor cannot do), and
    * ``(n_blocks / scaler_block_size) % world_size == 0`` (every shard holds whole scaler groups).

    The all-gather (``fsdp_pre/post_all_gather``) concatenates the same three tensors, so a layout valid
    for ``world_size`` N is valid for every divisor of N. Quantize the *full* tensor and then shard
    (``scaler_mean`` is the mean over the whole tensor).

    Raises ``ValueError`` (never silently skips) when ``numel`` is not a multiple of ``block_size``, or
    ``shape[0]`` is not a multiple of ``world_size``, or a dim-0 shard would hold a fraction of a block.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (1, 2):
        raise ValueError(f"NF4 quantizes 1-D or 2-D tensors, got shape {shape}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_layout(shape, block_size, 1, world_size)  # whole blocks, whole blocks per dim-0 shard
    n_blocks = math.prod(shape) // block_size
    per_rank = n_blocks // world_size
    target = max(1, int(scaler_block_size))
    found = divisors(per_rank)
    candidates = [d for d in found if d >= min_scaler_block_size] or found
    best = min(candidates, key=lambda d: (abs(math.log(d / target)), d))
    check_layout(shape, block_size, best, world_size)
    return NF4Layout(block_size, best)


def rows_per_chunk(cols: int, block_size: int, rows: Optional[int], default_elems: int) -> int:
    """Rows per quantization chunk: ``rows`` (default: ``default_elems`` worth), rounded down to whole blocks."""
    unit = block_size // math.gcd(cols, block_size)  # rows per chunk must hold whole blocks
    if rows is None:
        rows = default_elems // max(cols, 1)
    return max(unit, (int(rows) // unit) * unit)


def block_aligned_rows(t: NF4Tensor, max_elems: int) -> int:
    """The most rows of the 2-D ``t``, at most ``max_elems`` elements (but at least one block), whose slices
    start and end on quantization-block boundaries."""
    cols = t.shape[-1]
    step = t.block_size // math.gcd(cols, t.block_size)  # rows per whole number of blocks
    return max(step, (max_elems // cols) // step * step)


def row_slices(t, max_elems: int) -> list[tuple[int, int]]:
    """``(start, stop)`` row ranges covering the tensor ``t`` in order, each at most ``max_elems`` elements (but
    at least one row; NF4: at least one block, on block boundaries); one range for a small or 0-/1-row tensor."""
    rows = t.shape[0] if t.dim() else 1
    if t.dim() == 0 or t.numel() <= max_elems:
        return [(0, rows)]
    if isinstance(t, NF4Tensor):
        step = block_aligned_rows(t, max_elems)
    else:
        step = max(1, max_elems // (t.numel() // rows))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def row_blocks(t: NF4Tensor, start: int, stop: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shape of rows ``start:stop`` of the 2-D ``t`` and the quantization blocks ``(b0, b1)`` they span."""
    if t.dim() != 2 or not 0 <= start < stop <= t.shape[0]:
        raise ValueError(f"rows=({start}, {stop}) is not a row range of a 2-D tensor of shape {tuple(t.shape)}")
    cols, bs = t.shape[1], t.block_size
    e0, e1 = start * cols, stop * cols
    if e0 % bs or (e1 % bs and stop != t.shape[0]):
        raise ValueError(f"rows=({start}, {stop}) do not start and end on {bs}-element quantization blocks")
    return (stop - start, cols), (e0 // bs, -(-e1 // bs))
