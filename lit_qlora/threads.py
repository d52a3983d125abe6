"""CPU threads: how long torch's OpenMP workers spin, and how many of them run while another process wants the cores.

Two settings pull against each other on a CPU. Between ops, torch's OpenMP workers spin before they sleep; a short
spin (libgomp's GOMP_SPINCOUNT=1000, ~10 us) pays a futex wake-up for nearly every op, and a training step is
thousands of small ops: a SmolLM2 `litqlora dpo` step took 8.0 s at 1000 spins, 5.8 s at 30000, and two threads ran
no faster than one (the demo fine-tune: 163 tok/s at 1000, 211 at 30000, 169 on one thread; AMX Xeon, 2 cores).
But beside another busy process a long spin takes the cores that a descheduled worker needs to reach the next
barrier: the demo beside one 2-thread job kept 0.25x its quiet speed at 30000 spins (0.94x at 1000).

So the spin is long (SPIN_COUNT, set by `lit_qlora/__init__.py` before torch loads libgomp) and `ThreadGovernor`
gives cores back: every second or so (checked after each transformer block's forward, training or not) it reads
how much CPU the other processes used on this process's CPUs since its last look (/proc/stat minus
/proc/self/stat) and runs torch on the cores they left free, between one and the count it started with. One thread
spins nowhere, so beside that 2-thread job the demo ran at 120 tok/s, 0.57x its quiet 211 (issue 16's floor: 0.4x;
benchmarks/ab/results/contention.json).

The count torch runs with changes the order of some float sums, so a run that shared its cores is not bitwise equal
to a quiet one. Set OMP_NUM_THREADS (or GOMP_SPINCOUNT / OMP_WAIT_POLICY for the spin) to fix the choice yourself:
the governor then leaves the count alone, as it does where Lightning set OMP_NUM_THREADS for a multi-process CPU run.

torch is imported inside the functions: the package root imports this module before torch loads.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

SPIN_COUNT = 30_000
"""GOMP_SPINCOUNT that lit-qlora sets unless the user chose a spin (module doc): ~0.3 ms; libgomp's own is 300000."""

SAMPLE_SECONDS = 1.0
"""The least time between two looks at /proc/stat: shorter windows are a few 10 ms clock ticks, too coarse."""


def set_openmp_spin(environ: Optional[dict] = None) -> None:
    """GOMP_SPINCOUNT=SPIN_COUNT in `environ` (os.environ), unless GOMP_SPINCOUNT or OMP_WAIT_POLICY is set there.
    libgomp reads it once, when torch loads it: call this before anything imports torch."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = str(SPIN_COUNT)


@dataclass(frozen=True)
class CpuTimes:
    """Busy clock ticks on this process's CPUs (all processes) and this process's own ticks, at `seconds`."""

    seconds: float
    busy_ticks: int
    own_ticks: int


def cpu_times(cpus: frozenset[int], clock: Callable[[], float] = time.monotonic) -> Optional[CpuTimes]:
    """Read /proc/stat (the per-CPU lines of `cpus`) and /proc/self/stat; None where they cannot be read.

    Busy is user + nice + system + irq + softirq: not idle, not iowait, and not steal (time the hypervisor gave to
    other machines, which fewer threads here would not get back)."""
    try:
        with open("/proc/stat") as f:
            stat = f.read()
        with open("/proc/self/stat") as f:
            own = f.read()
    except OSError:
        return None
    busy = 0
    for line in stat.splitlines():
        if not line.startswith("cpu") or line[3:4] in (" ", ""):
            continue  # the aggregate line, or past the cpu lines
        name, *fields = line.split()
        if int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
            busy += user + nice + system + irq + softirq
    # /proc/self/stat: "pid (comm) state ..." where comm may hold spaces; utime and stime are fields 14 and 15
    after_comm = own.rsplit(")", 1)[1].split()
    return CpuTimes(clock(), busy, int(after_comm[11]) + int(after_comm[12]))


def others_cores(before: CpuTimes, after: CpuTimes, ticks_per_second: float) -> float:
    """Cores' worth of CPU the other processes used between two readings."""
    seconds = after.seconds - before.seconds
    if seconds <= 0:
        return 0.0
    others = (after.busy_ticks - before.busy_ticks) - (after.own_ticks - before.own_ticks)
    return max(0.0, others / ticks_per_second / seconds)


def target_threads(wanted: int, cpus: int, others: float) -> int:
    """Threads for torch when the other processes keep `others` of `cpus` cores busy: the free cores, rounded to
    the nearest (background noise under half a core takes none away), between 1 and `wanted`."""
    return max(1, min(wanted, int(cpus - others + 0.5)))


class ThreadGovernor:
    """Runs torch on the cores other processes leave free (module doc). Call it often; it looks at /proc at most
    every `interval` seconds and sets the calling thread's count (OpenMP's count is per thread) when it differs."""

    def __init__(self, wanted: Optional[int] = None, cpus: Optional[frozenset[int]] = None,
                 interval: float = SAMPLE_SECONDS,
                 read: Optional[Callable[[frozenset[int]], Optional[CpuTimes]]] = None,
                 ticks_per_second: Optional[float] = None, environ: Optional[dict] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import torch

        self.wanted = wanted or torch.get_num_threads()
        self.cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        self.interval = interval
        self._read = read or (lambda cpus: cpu_times(cpus, clock))
        self._clock = clock
        self._ticks = ticks_per_second or os.sysconf("SC_CLK_TCK")
        self._environ = os.environ if environ is None else environ
        self._last = self._read(self.cpus)
        self.target = self.wanted
        self.others = 0.0  # cores' worth the other processes used in the last window
        self.changes = 0  # how often `target` changed
        self.fewest = self.wanted  # the lowest target so far

    @property
    def enabled(self) -> bool:
        """Whether it sets counts: /proc readable, more than one thread to give, OMP_NUM_THREADS not fixed."""
        return self._last is not None and self.wanted > 1 and "OMP_NUM_THREADS" not in self._environ

    def __call__(self) -> int:
        """Look again if the window is over, and apply the target to this thread; returns the target."""
        if not self.enabled:
            return self.target
        if self._clock() - self._last.seconds >= self.interval:
            now = self._read(self.cpus)
            if now is not None:
                self.others = others_cores(self._last, now, self._ticks)
                target = target_threads(self.wanted, len(self.cpus), self.others)
                self.changes += target != self.target
                self.target, self._last = target, now
                self.fewest = min(self.fewest, target)
        import torch

        if torch.get_num_threads() != self.target:
            torch.set_num_threads(self.target)
        return self.target


_governor: Optional[ThreadGovernor] = None


def process_governor() -> ThreadGovernor:
    """The process's one governor (the thread count is process state), made on first use."""
    global _governor
    if _governor is None:
        _governor = ThreadGovernor()
    return _governor


def threads_summary() -> dict[str, Any]:
    """summary.json's report of the process's CPU threads: the count it started with, the fewest it ran on and how
    often the count changed (a run that changed it is not bitwise equal to a quiet one); {} if no CPU forward ran."""
    if _governor is None or not _governor.enabled:
        return {}
    return {"cpu_threads": _governor.wanted, "cpu_threads_fewest": _governor.fewest,
            "cpu_thread_changes": _governor.changes}


def govern_threads(model: Any) -> list:
    """Have the process's governor look after each forward of `model.blocks` that ran on the CPU (checkpointed
    blocks run theirs again in backward); returns the hook handles. Outside any compiled graph
    (torch.compiler.disable): a compiled block calls its hooks, and dynamo cannot trace reads of /proc."""
    import torch

    @torch.compiler.disable
    def after_forward(block: Any, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.device.type == "cpu":
            process_governor()()

    return [block.register_forward_hook(after_forward) for block in model.blocks]
