"""SIGTERM / SIGINT during a fine-tune: stop within seconds, keeping a resumable checkpoint.

A preempted machine gets SIGTERM and some seconds of grace; Ctrl+C sends SIGINT. The first such signal asks the run
to stop at its next safe point: the end of the current optimizer step (where it saves a checkpoint) or of the current
validation batch (nothing to save: validation changes no state). When no safe point comes within GRACE_SECONDS (a
step that compiles for minutes, a slow validation batch, the export), the process ends anyway, naming the newest
checkpoint on disk, which is intact: checkpoints are written under a temporary name and renamed when complete. A
second signal ends the process at once, the same way.

Those two ways end with `os._exit` from outside the interrupted code: Python runs a signal handler only between
bytecodes of the main thread, and raising KeyboardInterrupt in there would go through Lightning's interrupt handling,
whose teardown (moving the model off the device in the middle of a step) can fail with a traceback and exits 1.
What `os._exit` skips: the work of the unfinished step (by design), `finally` blocks and atexit handlers (a
half-written `step-NNNNNN.tmp` directory stays behind: resuming ignores it and the next save replaces it), the
TensorBoard events still buffered (its writer flushes every 2 minutes; metrics.jsonl, written line by line, is
complete), and DataLoader workers, which end themselves once they see their parent gone.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Optional

SIGNALS = (signal.SIGTERM, signal.SIGINT)

# How long the first signal waits for a safe point before the process ends without one. A warm step of the models
# this trains takes under a few seconds (SmolLM2 4x512 on 2 CPU cores, an 8B QLoRA step on one GPU), so the step in
# flight usually ends in time and its work is saved. A step still running after 5 s is compiling or very long:
# waiting more would keep little and the user asked to stop. 5 s, plus a second to exit, keeps the promise of an
# exit within 10 s, well inside the notice that preempting schedulers give (30 s on Kubernetes and Slurm by default).
GRACE_SECONDS = 5.0


class StopRequested(Exception):
    """Raised inside Lightning's trainer calls at a safe point after a signal. An ordinary Exception on purpose:
    Lightning turns a KeyboardInterrupt raised in a trainer call into sys.exit(1). `StopSignals` makes it a
    TrainingStopped once the trainer call has returned."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class TrainingStopped(KeyboardInterrupt):
    """Training stopped on a signal at a safe point; the CLI prints the message and exits 128 + signal.

    A KeyboardInterrupt so that code calling the fine-tune in-process stops as the signal asked (pytest ends its
    session instead of recording a failed test and running the next) and an `except Exception` does not swallow it."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class Interrupted(SystemExit, KeyboardInterrupt):
    """How the CLI ends after a signal: a SystemExit with 128 + signal (Python exits with that code and prints no
    traceback), which is also a KeyboardInterrupt, so that pytest running `main()` in-process stops its session."""


class StopSignals:
    """The signal handling of one run, as a context manager around everything the run does after loading.

    Entering it remembers the current handlers and installs ours; leaving it, whichever way, puts the remembered ones
    back (so Ctrl+C after an in-process run goes to the caller's handler again) and turns a StopRequested into
    TrainingStopped. `install()` puts ours back over the SIGTERM handler each Lightning trainer call sets (it would
    stop without saving). `describe()` says, from the files on disk, which checkpoint holds the run's state and how
    to resume; it is called when the process ends without reaching a safe point."""

    def __init__(self, describe: Callable[[], str], grace: float = GRACE_SECONDS) -> None:
        self.describe, self.grace = describe, grace
        self.received: Optional[signal.Signals] = None
        self._previous: dict[int, object] = {}
        self._lock = threading.Lock()  # held from a safe point's start, or by the watchdog while it ends the process
        self._safe_point_reached = False
        self._watchdog: Optional[threading.Timer] = None

    def __enter__(self) -> "StopSignals":
        # Only the main thread may set handlers; a run in another thread keeps its process's handlers.
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
            self.install()
        return self

    def install(self) -> None:
        for signum in self._previous:
            signal.signal(signum, self._handle)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        if isinstance(exc, StopRequested):
            raise TrainingStopped(str(exc), exc.signum) from None
        if isinstance(exc, SystemExit) and self.received is not None:
            # Lightning's own SIGTERM handling (its SIGTERMException, a SystemExit without a code): its handler, set
            # at the start of each trainer call, saw the signal before `install()` had put ours back over it.
            raise TrainingStopped(f"stopped by {self.received.name}; {self.describe()}", self.received) from None
        if exc is None and self.received is not None:  # the signal came as the run was ending, and it ended
            raise TrainingStopped(f"{self.received.name} arrived as the run was finishing; it finished and its "
                                  "results are complete.", self.received)

    def reached_safe_point(self) -> None:
        """The run is at a safe point and stops from here on its own: the watchdog stands down. Should the watchdog
        already be ending the process, this waits on its lock until the process is gone."""
        with self._lock:
            self._safe_point_reached = True
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            self._exit_now(signum, f"stopped at once by a second {signal.Signals(signum).name}, without saving")
        self.received = signal.Signals(signum)
        print(f"\nlitqlora: received {self.received.name}: stopping at the end of the current step (saving a "
              f"checkpoint there) or validation batch, or in {self.grace:g} s at the latest with the newest checkpoint "
              "on disk. Ctrl+C again stops at once.", file=sys.stderr, flush=True)
        self._watchdog = threading.Timer(self.grace, self._grace_expired)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _grace_expired(self) -> None:
        with self._lock:
            if not self._safe_point_reached:
                self._exit_now(self.received, f"stopped by {self.received.name}: the current step or validation did "
                                              f"not reach a safe point within {self.grace:g} s")

    def _exit_now(self, signum: int, what: str) -> None:
        """End the process with 128 + signum after one line on stderr (see the module's docstring for what is lost)."""
        try:
            line = f"\nlitqlora: {what}; {self.describe()}\n"
        except Exception as e:  # the line must not keep the process alive
            line = f"\nlitqlora: {what} (the newest checkpoint could not be read: {e}).\n"
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or broken stream: what it held is lost either way
                pass
        os.write(2, line.encode())
        os._exit(128 + signum)
