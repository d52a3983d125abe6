"""Offloaded activation checkpoints (`--train.offload_activations`): how the model moves them.

With activation checkpointing the one tensor a checkpointed block keeps for backward is its input x (B, T, n_embd):
for Llama-3.1-8B 32 blocks x 8 KiB = 256 KiB per token, the largest device memory that grows with the sequence.
`ActivationOffload` moves these block inputs to pinned host memory as the forward passes each block and brings each
back ahead of its block's backward.

How it works:

* `Transformer.forward_hidden` runs each checkpointed block inside `block_input_saved(offload, x)`: saved-tensor
  hooks active only while `torch.utils.checkpoint` (non-reentrant) saves the block's inputs; inside the block,
  checkpoint's own hooks take over and save nothing but placeholders. Of those inputs only x itself (matched by
  identity) is offloaded: the RoPE tables and the mask are shared by every block and stay where they are.
* Pack (forward), CUDA: a side stream waits for the compute stream (which produced x), copies x into a pinned host
  buffer (non_blocking), and `x.record_stream(side)` keeps the caching allocator from handing x's memory to anyone
  before that copy has run. The autograd graph then holds only the host copy: x's device memory is released as soon
  as the forward drops x (the block's output replaces it).
* Unpack (backward: checkpoint recomputes block i and asks for its input): block i's input comes back on the side
  stream into memory allocated on that stream (unless it was prefetched already); the compute stream waits on the
  copy's event, and the tensor is `record_stream`ed on the compute stream so its memory is not reused before the
  recompute and backward have read it. Then block i-1's input starts coming back on the side stream, overlapped with
  block i's recompute and backward: in backward at most two block inputs are on the device instead of all of them.
* CPU tensors (tests, and `litqlora estimate`'s fake step) take the same path with plain copies: one CPU tensor
  stands for the host copy, another for the copy fetched back to the device. What is released, what is read back,
  the prefetch and the host bytes are thereby checked without a GPU.

Host memory: `host_bytes` (held now) and `peak_host_bytes` count the offloaded tensors' own bytes: all checkpointed
block inputs of one micro-batch at the end of its forward. PyTorch's pinned-memory allocator rounds each buffer up to
a power of two (an 8B block input of 1.07 GiB at 140k tokens would take 2 GiB), so a block input goes to host memory
in pieces of PINNED_PIECE bytes, a power of two, and only its last piece is rounded: the pinned memory reserved
(`pinned_bytes`, `pinned_size`) is the inputs' bytes plus less than one piece per block; the allocator reuses the
pieces from one step to the next.

When `auto` turns it on: `lit_qlora.train.offload`. Numerics are unchanged (the copies are exact), so a resume may
change it.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator, Optional

import torch

PINNED_PIECE = 64 << 20  # a power of two: pinned pieces of this size are not rounded up


def pinned_size(nbytes: int, piece: int = PINNED_PIECE) -> int:
    """Pinned bytes that `nbytes` take in pieces: whole pieces, and the rest rounded up to a power of two."""
    rest = nbytes % piece
    return nbytes - rest + (1 << max(rest - 1, 0).bit_length() if rest else 0)


def host_pieces(flat: torch.Tensor, pin: bool, piece: int = PINNED_PIECE) -> list[torch.Tensor]:
    """Empty host buffers (uint8, pinned when `pin`) for the bytes of `flat`, at most `piece` bytes each."""
    n = flat.numel()
    return [torch.empty(min(piece, n - start), dtype=torch.uint8, pin_memory=pin) for start in range(0, n, piece)]


def copy_pieces(pieces: list[torch.Tensor], flat: torch.Tensor, to_pieces: bool) -> None:
    """Copy the bytes of `flat` (a uint8 view) into `pieces` in order, or back from them (non_blocking on CUDA: the
    caller orders the stream)."""
    start = 0
    for piece in pieces:
        part = flat[start:start + piece.numel()]
        (piece.copy_(part, non_blocking=True) if to_pieces else part.copy_(piece, non_blocking=True))
        start += piece.numel()


class _Offloaded:
    """One block input in host memory, and the copy being fetched back to its device for the block's backward."""

    __slots__ = ("host", "shape", "dtype", "device", "nbytes", "fetched", "ready", "previous", "__weakref__")

    def __init__(self, host: Any, shape: torch.Size, dtype: torch.dtype, device: torch.device, nbytes: int,
                 previous: Optional[weakref.ref]):
        self.host = host  # CUDA: pinned byte pieces (host_pieces); CPU: a tensor standing for host memory
        self.shape, self.dtype = shape, dtype
        self.device = device
        self.nbytes = nbytes
        self.fetched: Optional[torch.Tensor] = None  # on the device again (or on its way), until unpacked
        self.ready: Optional[torch.cuda.Event] = None  # CUDA: the fetch's copy has run on the side stream
        self.previous = previous  # the block input offloaded before this one (the block whose backward comes next)


class ActivationOffload:
    """Offloads the input of each checkpointed block to host memory in forward and fetches it back, prefetching one
    block ahead, in backward (module doc). One per model: `Transformer.activation_offload`."""

    def __init__(self) -> None:
        self.host_bytes = 0
        """Bytes of block inputs held in host memory now."""
        self.peak_host_bytes = 0
        """The most held at once: the host memory the run needs for it."""
        self.pinned_bytes = 0
        """The pinned memory those buffers took at the peak (CUDA: each rounded up to a power of two)."""
        self.offloaded = 0
        """Block inputs offloaded so far (all steps)."""
        self._pinned_now = 0
        self._target: Optional[torch.Tensor] = None
        self._last: Optional[weakref.ref] = None
        self._streams: dict[torch.device, Any] = {}

    @contextmanager
    def saving(self, block_input: torch.Tensor) -> Iterator[None]:
        """Around one `checkpoint(block, x, ...)` call: `block_input` (x), as checkpoint saves it, goes to host
        memory; every other tensor saved here is kept as is."""
        self._target = block_input
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._target = None  # no reference to x may outlive the call: the point is to let it go

    def _pack(self, t: torch.Tensor) -> Any:
        if t is not self._target:
            return t
        self._target = None
        nbytes = t.numel() * t.element_size()
        if t.device.type == "cuda" and t.is_contiguous():
            side = self._side_stream(t.device)
            flat = t.detach().reshape(-1).view(torch.uint8)  # (detached: the copies must not join the graph)
            host = host_pieces(flat, pin=True)
            side.wait_stream(torch.cuda.current_stream(t.device))  # x is written on the compute stream
            with torch.cuda.stream(side):
                copy_pieces(host, flat, to_pieces=True)
            t.record_stream(side)  # x's memory goes back to the allocator only once these copies have run
            pinned = pinned_size(nbytes)
        elif t.device.type == "cuda":
            return t  # (a block input is contiguous: the residual stream's sum)
        else:
            host, pinned = self.to_host(t), nbytes
        packed = _Offloaded(host, t.shape, t.dtype, t.device, nbytes, self._last)
        self._last = weakref.ref(packed)
        self.offloaded += 1
        self._held(nbytes, pinned)
        weakref.finalize(packed, self._held, -nbytes, -pinned)  # the graph lets go of it: after its backward
        return packed

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        self._fetch(packed)
        t, packed.fetched = packed.fetched, None  # unpacked again (retain_graph): fetched again
        if packed.ready is not None:
            compute = torch.cuda.current_stream(packed.device)
            compute.wait_event(packed.ready)
            t.record_stream(compute)  # its memory is not reused before the recompute and backward have read it
            packed.ready = None
        previous = packed.previous() if packed.previous is not None else None
        if previous is not None:
            self._fetch(previous)  # the next block's backward overlaps this one's
        return t

    def _fetch(self, packed: _Offloaded) -> None:
        """Start bringing `packed` back to its device (no-op if it is on its way)."""
        if packed.fetched is not None:
            return
        if packed.device.type == "cuda":
            side = self._side_stream(packed.device)
            with torch.cuda.stream(side):  # allocated on the side stream: free to write there now
                fetched = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
                copy_pieces(packed.host, fetched.view(-1).view(torch.uint8), to_pieces=False)  # after the offload
                packed.ready = side.record_event()
            packed.fetched = fetched
        else:
            packed.fetched = self._to_device(packed.host)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """CPU tensors (tests, the estimate): a separate copy stands for host memory (the estimate counts it as
        host memory, beside the device's)."""
        return t.detach().clone()

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.clone()

    def _held(self, nbytes: int, pinned: int) -> None:
        self.host_bytes += nbytes
        self._pinned_now += pinned
        if self.host_bytes > self.peak_host_bytes:
            self.peak_host_bytes, self.pinned_bytes = self.host_bytes, self._pinned_now

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def block_input_saved(offload: Optional[ActivationOffload], block_input: torch.Tensor) -> ContextManager:
    """What `Transformer.forward_hidden` runs a checkpointed block in: offloading its input, or nothing."""
    return offload.saving(block_input) if offload is not None else nullcontext()
