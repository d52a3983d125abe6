"""Count the tensor bytes a step allocates, without running it for real: every op's outputs are registered by
their storage as they are created (on fake tensors: shapes and dtypes, no data), freed storages are noticed through
weak references, and the peak of live bytes is kept with what was live at that moment, by category.

`litqlora estimate` runs one training step of the real code under `AllocationTrace`; the category of an allocation
is decided when it is made (`StepPhase`'s phase and tag say what the step is doing, shapes say what the tensor is), so the
peak's breakdown costs nothing to keep."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CATEGORIES = ("frozen base", "embeddings and norms", "LoRA weights", "gradients", "optimizer state", "activations",
              "logits/loss chunks", "NF4 dequantize scratch", "other temporaries")


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind a tensor; a wrapper subclass (NF4Tensor, DTensor) by its inner tensors."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [s for name in names for s in storages(getattr(t, name))]
    return [t.untyped_storage()]


def _all_true(index: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A boolean mask's selection has a data-dependent size, which fake tensors cannot have: a 1-D mask is taken
    as all true (every target position trained: the worst case), as the positions it would select."""
    if index is None or index.dtype != torch.bool:
        return index
    if index.dim() != 1:
        raise NotImplementedError("an estimate takes 1-D boolean masks only")
    return torch.arange(index.shape[0], device=index.device)


def masks_as_all_true(func, args: tuple) -> tuple:
    """`args` of an op about to run on fake tensors, with `aten.index`'s boolean masks taken as all true
    (`_all_true`): what a dispatch mode over a fake step passes on."""
    if func is torch.ops.aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
        return (args[0], [_all_true(i) for i in args[1]])
    return args


class AllocationTrace(TorchDispatchMode):
    """Live and peak bytes of every storage created under it (plus those `hold` registers up front).

    `categorize(tensor)` names a new tensor's category when it is created. `round_to` rounds each allocation up as
    an allocator would (CUDA's caching allocator: 512 bytes). Allocations in a `host_categories` category (offloaded
    activations) are host memory: counted apart (`host_peak`), never in the device's peak."""

    def __init__(self, categorize: Callable[[torch.Tensor], str], round_to: int = 1,
                 host_categories: frozenset[str] = frozenset(), context: Callable[[], str] = lambda: "") -> None:
        super().__init__()
        self.categorize = categorize
        self.round_to = round_to
        self.host_categories = host_categories
        self.context = context  # what the step is doing (forward, backward...): named beside each op
        self.host_current = 0
        self.host_peak = 0
        self.live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.origins: dict[int, str] = {}  # live storage -> the op (and step phase) that allocated it
        self.peak_other_by_origin: dict[str, int] = {}
        """At the peak: the live "other temporaries" bytes by the op that allocated them."""
        self.peak_op = ""
        """The op (and step phase) whose allocation set the peak."""
        self.held: dict[int, torch.UntypedStorage] = {}
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.current = 0  # an upper bound between sweeps: frees are noticed only when swept
        self.peak = 0
        self.peak_by_category = dict(self.by_category)

    def hold(self, t: torch.Tensor, category: str) -> None:
        """Count a tensor that exists before the step and outlives it (weights): never swept."""
        for storage in storages(t):
            key = StorageWeakRef(storage).cdata
            if key not in self.held and key not in self.live:
                self.held[key] = storage  # kept alive here: its address cannot be reused by a new storage
                self._count(storage.nbytes(), category)

    def _count(self, nbytes: int, category: str) -> int:
        if category in self.host_categories:
            self.host_current += nbytes
            if self.host_current > self.host_peak:
                self.sweep()  # (the new storage is not live yet: the sweep cannot drop it)
                self.host_peak = max(self.host_peak, self.host_current)
            return nbytes
        nbytes = -(-nbytes // self.round_to) * self.round_to
        self.by_category[category] += nbytes
        self.current += nbytes
        return nbytes

    def _add(self, storage: torch.UntypedStorage, category: str, origin: str = "") -> None:
        ref = StorageWeakRef(storage)
        if ref.cdata not in self.live and ref.cdata not in self.held:
            self.live[ref.cdata] = (ref, self._count(storage.nbytes(), category), category)
            self.origins[ref.cdata] = origin

    def sweep(self) -> None:
        for key in [key for key, (ref, _, _) in self.live.items() if ref.expired()]:
            self.origins.pop(key, None)
            _, nbytes, category = self.live.pop(key)
            if category in self.host_categories:
                self.host_current -= nbytes
                continue
            self.by_category[category] -= nbytes
            self.current -= nbytes

    def note_peak(self, op: str = "") -> None:
        if self.current <= self.peak:
            return  # the upper bound is below the peak: the exact figure is too
        self.sweep()
        if self.current > self.peak:
            self.peak, self.peak_by_category, self.peak_op = self.current, dict(self.by_category), op
            other: dict[str, int] = {}
            for key, (_, nbytes, category) in self.live.items():
                if category == "other temporaries":
                    other[self.origins[key]] = other.get(self.origins[key], 0) + nbytes
            self.peak_other_by_origin = other

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*masks_as_all_true(func, args), **(kwargs or {}))
        context = self.context()
        origin = f"{func.overloadpacket.__name__}{f' ({context})' if context else ''}"
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                category = None
                for storage in storages(t):
                    key = StorageWeakRef(storage).cdata
                    if key not in self.live and key not in self.held:
                        category = category or self.categorize(t)
                        self._add(storage, category, origin)
        self.note_peak(origin)
        return out


class StepPhase:
    """What the traced step is doing (forward, backward, optimizer) and inside which part (a tag): what an
    allocation's category is decided from."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.tag: Optional[str] = None

    @contextmanager
    def tagged(self, tag: str) -> Iterator[None]:
        outer, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = outer

    def wrap(self, fn: Callable, tag: str) -> Callable:
        def tagged_call(*args, **kwargs):
            with self.tagged(tag):
                return fn(*args, **kwargs)

        return tagged_call


def profiled_peak(step: Callable[[], object], alive: list[torch.Tensor]) -> int:
    """The peak of allocated bytes while `step()` runs for real, counted independently of `AllocationTrace`: the
    storages of `alive` (what exists before the step: weights, optimizer state, buffers; counted directly, since
    our C kernels read NF4 codes by pointer and no profiler sees them as op inputs) plus the highest running sum of
    the allocation and free events torch.profiler records during the step."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    before = sum({s.data_ptr(): s.nbytes() for t in alive for s in storages(t)}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events, allocations = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while events:
        event = events.pop()
        events.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.typed[1].alloc_size))
    running = during = 0
    for _, size in sorted(allocations):
        running += size
        during = max(during, running)
    return before + during
