"""CPU threads: how long torch's OpenMP workers spin, and how many of them run while another process wants the cores.

Two settings pull against each other on a CPU. Between ops, torch's OpenMP workers spin before they sleep; a short
spin (libgomp's GOMP_SPINCOUNT=1000, ~10 us) pays a futex wake-up for nearly every op, and a training step is
thousands of small ops: a SmolLM2 `litqlora dpo` step took 8.0 s at 1000 spins, 5.8 s at 30000, and two threads ran
no faster than one (the demo fine-tune: 163 tok/s at 1000, 211 at 30000, 169 on one thread; AMX Xeon, 2 cores).
But beside another busy process a long spin takes the cores that a descheduled worker needs to reach the next
barrier: the demo beside one 2-thread job kept 0.25x its quiet speed at 30000 spins (0.94x at 1000).

So the spin is long (SPIN_COUNT, set by `lit_qlora/__init__.py` before torch loads libgomp) and `ThreadGovernor`
gives cores back: every second or so (checked after each transformer block's forward, training or not) it reads how
much CPU the other processes used on this process's CPUs since its last look (/proc/stat minus what this process
and its descendants used) and, if this process was busy itself in that time, runs torch on the cores they left
free, between one and the count it started with. One thread spins nowhere: beside that 2-thread job the demo ran at
108.7 tok/s, 0.518x its quiet 210.0 (issue 16's floor: 0.4x; benchmarks/ab/results/contention.json).

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

BUSY_OWN_CORES = 0.5
"""A window in which this process used less than this many cores was mostly idle time here (between two runs in one
process, waiting for a request or for a child process to finish): what the others did then says nothing about
contention, so it is skipped (a test process resuming a run after a child trained it had dropped to one thread)."""

STARVED_OWN_CORES = 0.1
"""On a machine with more busy processes than cores a working process gets less than BUSY_OWN_CORES (beside four
spinning processes on two cores: about 0.4): a window in which the CPUs were full and this process still used this
much counts too (it was working, and starved), where skipping it left the count where it was (issue 47: `make test`
beside a 2-thread busy loop)."""


def set_openmp_spin(environ: Optional[dict] = None) -> None:
    """GOMP_SPINCOUNT=SPIN_COUNT in `environ` (os.environ), unless GOMP_SPINCOUNT or OMP_WAIT_POLICY is set there.
    libgomp reads it once, when torch loads it: call this before anything imports torch."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = str(SPIN_COUNT)


@dataclass(frozen=True)
class CpuTimes:
    """Busy clock ticks on this process's CPUs (all processes) and this process tree's own ticks, at `seconds`."""

    seconds: float
    busy_ticks: int
    own_ticks: int


def cpu_times(cpus: frozenset[int], clock: Callable[[], float] = time.monotonic) -> Optional[CpuTimes]:
    """Read /proc/stat (the per-CPU lines of `cpus`) and this process tree's ticks; None where /proc cannot be read.

    Busy is user + nice + system + irq + softirq: not idle, not iowait, and not steal (time the hypervisor gave to
    other machines, which fewer threads here would not get back)."""
    try:
        with open("/proc/stat") as f:
            stat = f.read()
    except OSError:
        return None
    own = tree_ticks()
    if own is None:
        return None
    busy = 0
    for line in stat.splitlines():
        if not line.startswith("cpu") or line[3:4] in (" ", ""):
            continue  # the aggregate line, or past the cpu lines
        name, *fields = line.split()
        if int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
            busy += user + nice + system + irq + softirq
    return CpuTimes(clock(), busy, own)


def tree_ticks(pid: Optional[int] = None) -> Optional[int]:
    """CPU ticks of process `pid` (this one) and of every live descendant, each with its reaped children's.

    Work this process started is its own, not a competitor's: torch.compile's compiler workers and their gcc, a
    DataLoader's workers, a child process a test or a script waits for. A descendant that exits moves its ticks into
    its parent's reaped-children count, so the sum only grows. None if `pid`'s own stat cannot be read."""
    total, stack, first = 0, [str(pid or os.getpid())], True
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/stat") as f:
                stat = f.read()
        except OSError:
            if first:
                return None
            continue  # it exited meanwhile
        first = False
        # "pid (comm) state ...": comm may hold spaces; utime, stime, cutime, cstime are fields 14-17
        fields = stat.rsplit(")", 1)[1].split()
        total += sum(int(v) for v in fields[11:15])
        try:
            threads = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in threads:
            try:
                with open(f"/proc/{current}/task/{tid}/children") as f:
                    stack.extend(f.read().split())
            except OSError:
                continue
    return total


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity; all of them where the OS has no affinity call: macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def others_cores(before: CpuTimes, after: CpuTimes, ticks_per_second: float) -> float:
    """Cores' worth of CPU the other processes used between two readings."""
    seconds = after.seconds - before.seconds
    if seconds <= 0:
        return 0.0
    others = (after.busy_ticks - before.busy_ticks) - (after.own_ticks - before.own_ticks)
    return max(0.0, others / ticks_per_second / seconds)


def own_cores(before: CpuTimes, after: CpuTimes, ticks_per_second: float) -> float:
    """Cores' worth of CPU this process used between two readings."""
    seconds = after.seconds - before.seconds
    return (after.own_ticks - before.own_ticks) / ticks_per_second / seconds if seconds > 0 else 0.0


def worked(own: float, others: float, cpus: int) -> bool:
    """Whether this process was working in a window (what the others did then tells contention): it used
    BUSY_OWN_CORES, or STARVED_OWN_CORES while the CPUs were full (within a tenth of a core)."""
    return own >= BUSY_OWN_CORES or (own >= STARVED_OWN_CORES and own + others >= cpus - 0.1)


def target_threads(wanted: int, cpus: int, others: float) -> int:
    """Threads for torch when the other processes keep `others` of `cpus` cores busy: the free cores, rounded to
    the nearest (background noise under half a core takes none away), between 1 and `wanted`."""
    return max(1, min(wanted, int(cpus - others + 0.5)))


def local_processes(environ: dict) -> int:
    """How many processes of one multi-process run share this machine: torchrun's LOCAL_WORLD_SIZE, else
    WORLD_SIZE (Lightning's launcher sets it for every rank; on several machines this over-counts); 1 alone."""
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        if environ.get(name, "").strip().isdigit():
            return max(1, int(environ[name]))
    return 1


class ThreadGovernor:
    """Runs torch on the cores other processes leave free (module doc). Call it often; it looks at /proc at most
    every `interval` seconds, changes its target when two windows in a row ask for the same new count, and sets the
    calling thread's count (OpenMP's count is per thread) when it differs.

    The ranks of a multi-process CPU run (WORLD_SIZE > 1) each get a fixed share of the cores instead, as Lightning
    gives them where it sets OMP_NUM_THREADS (its FSDP2 launcher left rank 1 on every core beside rank 0): ranks
    that changed their counts mid-run would each take their own path through the float sums, and a compiled block
    would compile again for each count."""

    def __init__(self, wanted: Optional[int] = None, cpus: Optional[frozenset[int]] = None,
                 interval: float = SAMPLE_SECONDS,
                 read: Optional[Callable[[frozenset[int]], Optional[CpuTimes]]] = None,
                 ticks_per_second: Optional[float] = None, environ: Optional[dict] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import torch

        self.cpus = cpus if cpus is not None else allowed_cpus()
        self._environ = os.environ if environ is None else environ
        ranks = local_processes(self._environ)
        self.wanted = wanted or (torch.get_num_threads() if ranks == 1 else max(1, len(self.cpus) // ranks))
        self.interval = interval
        self._read = read or (lambda cpus: cpu_times(cpus, clock))
        self._clock = clock
        self._ticks = ticks_per_second or os.sysconf("SC_CLK_TCK")
        self._last = self._read(self.cpus) if ranks == 1 else None
        self.target = self.wanted
        self.others = 0.0  # cores' worth the other processes used in the last window
        self.changes = 0  # how often `target` changed
        self.fewest = self.wanted  # the lowest target so far
        self._pending: Optional[int] = None  # a target one window asked for

    @property
    def fixed(self) -> bool:
        """Whether the user (or Lightning) fixed the count: OMP_NUM_THREADS is set. Then the count is left alone."""
        return "OMP_NUM_THREADS" in self._environ

    @property
    def enabled(self) -> bool:
        """Whether it follows the other processes: /proc readable, one process of its run (not a rank of a
        multi-process one), more than one thread to give, the count not fixed."""
        return self._last is not None and self.wanted > 1 and not self.fixed

    def __call__(self) -> int:
        """Look again if the window is over, and apply the target to this thread; returns the count it runs on."""
        import torch

        if self.fixed:
            return torch.get_num_threads()
        if self.enabled and self._clock() - self._last.seconds >= self.interval:
            now = self._read(self.cpus)
            if now is not None:
                others = others_cores(self._last, now, self._ticks)
                if worked(own_cores(self._last, now, self._ticks), others, len(self.cpus)):
                    self.others = others
                    self._propose(target_threads(self.wanted, len(self.cpus), self.others))
                self._last = now
        if torch.get_num_threads() != self.target:
            torch.set_num_threads(self.target)
        return self.target

    def _propose(self, target: int) -> None:
        # A change takes two windows in a row that agree: one alone may be a burst (a process starting or exiting,
        # the kernel writing a checkpoint back), and each change costs a compiled block a recompilation.
        if target == self.target:
            self._pending = None
        elif target != self._pending:
            self._pending = target
        else:
            self.target, self._pending = target, None
            self.changes += 1
            self.fewest = min(self.fewest, target)


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
    (torch.compiler.disable): a compiled block calls its hooks, and dynamo cannot trace reads of /proc.

    Each command calls it on the model it loaded (`litqlora finetune`/`dpo` in train.run's setup, evaluate, generate,
    chat, serve): scheduling is the command's choice, not the loader's, so a model built for anything else (estimate's
    fake-tensor `random_base`, an export) reads no /proc and sets no thread count."""
    import torch

    @torch.compiler.disable
    def after_forward(block: Any, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.device.type == "cpu":
            process_governor()()

    after_forward.governs_threads = True  # lit_qlora.model.decode_step runs the blocks itself, then the governor
    return [block.register_forward_hook(after_forward) for block in model.blocks]
