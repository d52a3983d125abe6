"""When CPU training hands freed heap back to the OS: only once the heap holds enough resident free memory.

glibc keeps freed blocks in its heap. Training's temporaries (multi-MB activations, under glibc's dynamic mmap
threshold) leave holes between longer-lived tensors, and each block's forward lands partly on pages the previous
block did not touch: without a release the resident heap grows ~10 MB per block and a SmolLM2 4x512 QLoRA run
peaks 600 MB higher (benchmarks/ab/results/heap_release.md). `malloc_trim` after every block keeps the peak, but it
hands back each block's whole working set, which the next block faults in again (~1.4 M page faults, ~5 GB, per
step). Trimming only once the resident free bytes have grown by a budget beyond that working set lets several
blocks run between trims, each reusing the pages the previous one freed.

Resident free bytes are estimated as VmRSS minus what malloc has handed out (mallinfo2's in-use heap chunks and
mmapped blocks): the rest of the RSS (code, Python's arenas, thread stacks) barely moves during a step, so the
estimate's growth since the last trim is the growth of resident free heap. (mallinfo2's own free-byte count is no
use here: it includes holes whose pages were already handed back.)

mallinfo2 walks every arena's free chunks: 3 ms a call in a `litqlora dpo` process (where a SmolLM2 block of two
short rows takes ~10 ms), against 25 us to read VmRSS. So the heap is measured only once RSS has grown by the budget
since it was last measured: below that a trim could not lower the peak, since the freed pages are reused before RSS
grows again (and resident free heap that RSS growth brings past the budget is caught at that next measurement).
"""

from __future__ import annotations

from typing import Callable, Optional

from lit_qlora.memory.accounting import heap_in_use_bytes, release_free_memory, rss_bytes

# Resident free heap allowed to build up beyond a block's working set between trims. Each trim costs re-faulting
# everything free (the working set, tens of MB), and blocks add ~3-10 MB each of pages the previous block did not
# touch, so 32 MB lets ~4-10 blocks run between trims; it is also about what the peak may exceed a
# trim-every-block peak by.
DEFAULT_BUDGET_BYTES = 32 << 20


class HeapTrimmer:
    """Calls `release` when the resident free heap has grown by more than `budget_bytes` over its level at the
    first check after the last release, looking at the heap only once RSS has grown by the budget since it last
    looked (module doc).

    That level, not the level right after the release, is the floor: between a release and the next check the
    block being run faults its working set in again and frees it, so measured from the release itself every
    check would see a working set of resident free heap (~75 MB per SmolLM2 4x512 block) and trim again. The
    very first check releases (what loading and validation left behind). Without an estimate (not glibc, or
    glibc before 2.33: `in_use` returns None) every check releases, as training did before this policy."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 rss: Callable[[], Optional[int]] = rss_bytes,
                 in_use: Callable[[], Optional[int]] = heap_in_use_bytes,
                 release: Optional[Callable[[], None]] = None) -> None:
        self.budget_bytes = budget_bytes
        self._rss, self._in_use, self._release = rss, in_use, release
        self._floor: Optional[int] = None  # resident bytes not handed out, at the first check after a release
        self._measured_rss: Optional[int] = None  # RSS when the heap was last measured
        self._released = False  # since the last check
        self.checks = self.releases = self.measurements = 0

    def _not_handed_out(self, rss: Optional[int]) -> Optional[int]:
        self.measurements += 1
        in_use = self._in_use()
        if rss is None or in_use is None:
            return None
        self._measured_rss = rss
        return rss - in_use

    def __call__(self) -> bool:
        """Release if the budget is exceeded (or nothing can be estimated); returns whether it released."""
        self.checks += 1
        rss = self._rss()
        if (rss is not None and not self._released and self._floor is not None
                and rss - self._measured_rss <= self.budget_bytes):
            return False  # RSS has not grown by the budget since the heap was measured
        now = self._not_handed_out(rss)
        if now is not None and self._released:
            self._floor, self._released = now, False
            return False
        if now is not None and self._floor is not None and now - self._floor <= self.budget_bytes:
            return False
        (self._release or release_free_memory)()  # looked up per call: profiling scripts count the releases
        self.releases += 1
        self._released = True
        return True
