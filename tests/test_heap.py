"""The CPU heap release policy: trim only once resident free heap has grown by the budget (lit_qlora.train.heap)."""

import sys
from types import SimpleNamespace

import pytest
import torch

from lit_qlora.model.presets import PRESETS
from lit_qlora.memory.accounting import heap_in_use_bytes
from lit_qlora.model.transformer import Transformer
from lit_qlora.train.callbacks import HeapRelease, release_heap_around_blocks
from lit_qlora.train.heap import HeapTrimmer

MIB = 1 << 20


class FakeProcess:
    """RSS and malloc's in-use bytes as numbers a test moves; a release hands all resident free heap back."""

    def __init__(self) -> None:
        self.other, self.in_use, self.free_resident, self.releases = 300 * MIB, 200 * MIB, 0, 0

    def rss(self) -> int:
        return self.other + self.in_use + self.free_resident

    def release(self) -> None:
        self.releases += 1
        self.free_resident = 0

    def trimmer(self, budget: int) -> HeapTrimmer:
        return HeapTrimmer(budget, rss=self.rss, in_use=lambda: self.in_use, release=self.release)


def test_trims_only_when_resident_free_heap_grew_past_the_budget_over_the_working_set():
    proc = FakeProcess()
    trim = proc.trimmer(32 * MIB)
    proc.free_resident = 200 * MIB  # what loading and validation left
    assert trim() and proc.releases == 1 and proc.free_resident == 0
    proc.free_resident = 75 * MIB  # the next block faulted its working set in again and freed it: the floor
    assert not trim()
    proc.free_resident = 75 * MIB + 30 * MIB
    assert not trim()
    proc.in_use += 500 * MIB  # live tensors raise RSS and in-use alike: nothing to hand back
    assert not trim()
    proc.free_resident = 75 * MIB + 64 * MIB  # RSS grew by 34 MiB since that look, all of it free heap
    assert trim() and proc.releases == 2 and proc.free_resident == 0
    proc.free_resident = 40 * MIB  # a new floor
    assert not trim()
    proc.free_resident = 40 * MIB + 20 * MIB
    assert not trim()
    assert (trim.checks, trim.releases) == (7, 2)


def test_the_heap_is_measured_only_once_rss_has_grown_by_the_budget():
    proc = FakeProcess()
    trim = proc.trimmer(32 * MIB)
    trim(), trim()  # a release, then the floor: two measurements
    assert trim.measurements == 2
    proc.in_use -= 100 * MIB  # a backward frees activations: resident free heap grows, RSS does not
    proc.free_resident += 100 * MIB
    assert not any(trim() for _ in range(5))  # freed pages are reused before RSS grows: no trim lowers the peak
    assert trim.measurements == 2
    proc.free_resident += 20 * MIB  # RSS grows, but less than the budget: still not measured
    assert not trim() and trim.measurements == 2
    proc.free_resident += 13 * MIB  # now past it: measured, and 133 MiB of free heap over the floor is handed back
    assert trim() and trim.measurements == 3 and proc.free_resident == 0
    proc.in_use += 33 * MIB  # the first check after that release sets the floor; then live growth past the budget
    assert not trim()
    proc.in_use += 33 * MIB
    assert not trim() and trim.measurements == 5  # measured, nothing free: no trim, and the next look 32 MiB later
    proc.in_use += 16 * MIB
    assert not trim() and trim.measurements == 5


def test_the_floor_follows_rss_outside_the_heap():
    proc = FakeProcess()
    trim = proc.trimmer(32 * MIB)
    trim(), trim()
    proc.other += 40 * MIB  # e.g. Python's arenas grew: one trim, then the floor includes it
    assert trim()
    assert not trim()
    proc.free_resident = 31 * MIB
    assert not trim()


def test_without_an_estimate_every_call_releases():
    calls = []
    trim = HeapTrimmer(32 * MIB, rss=lambda: 1 << 30, in_use=lambda: None, release=lambda: calls.append(1))
    assert all(trim() for _ in range(3)) and len(calls) == 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_heap_in_use_counts_a_live_tensor():
    before = heap_in_use_bytes()
    if before is None:
        pytest.skip("glibc without mallinfo2")
    t = torch.ones(64 * MIB, dtype=torch.uint8)
    assert heap_in_use_bytes() - before >= 64 * MIB
    del t
    assert heap_in_use_bytes() - before < 8 * MIB


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    config = PRESETS["TinyLlama-1.1B"].replace(n_layer=2, vocab_size=128, n_embd=64, n_head=4, n_query_groups=2,
                                               head_dim=16, intermediate_size=32)
    return Transformer(config).train()


def test_nothing_on_cuda():
    checks = []
    callback = HeapRelease(trimmer=lambda: checks.append(1))
    module = SimpleNamespace(device=torch.device("cuda"), model=tiny_model())
    callback.on_train_start(None, module)
    callback.on_before_backward(None, module, None)
    callback.on_train_batch_end(None, module, None, None, 0)
    assert callback._hooks == [] and checks == []


@pytest.mark.parametrize("compiled", [False, True])
def test_block_hooks_offer_a_release_after_forward_and_before_backward(compiled):
    model = tiny_model()
    if compiled:  # regional compilation: the hooks run, outside the traced graph
        for block in model.blocks:
            block.compile(backend="eager")
    checks = []
    release_heap_around_blocks(model, lambda: checks.append(1))
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        model(ids)
    assert checks == []  # inference: nothing to release
    model(ids).float().sum().backward()
    assert len(checks) == 2 * model.config.n_layer
