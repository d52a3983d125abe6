"""SIGTERM / SIGINT during training: finish the current optimizer step, save a resumable checkpoint, stop.

A preempted machine gets SIGTERM and some seconds of grace; Ctrl+C sends SIGINT. The first such signal only sets a
flag that the training loop reads at each step boundary; a second SIGINT interrupts at once (the newest complete
checkpoint stays loadable either way: checkpoints are written atomically).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Optional

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(Exception):
    """Training stopped on a signal after saving a checkpoint; the CLI prints the message and exits 128 + signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class StopSignals:
    """Made before training starts (it remembers the handlers of that moment); `install()` puts its own in place
    (call it once the trainer has set its handlers: ours replace Lightning's SIGTERM handler, which would stop
    without saving), `restore()` puts the remembered ones back."""

    def __init__(self) -> None:
        self.received: Optional[signal.Signals] = None
        # Only the main thread may set handlers; a run in another thread keeps the defaults.
        main = threading.current_thread() is threading.main_thread()
        self._previous = {signum: signal.getsignal(signum) for signum in SIGNALS} if main else {}

    def install(self) -> None:
        for signum in self._previous:
            signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def __enter__(self) -> "StopSignals":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum)
        print(f"\nlitqlora: received {self.received.name}: saving a checkpoint after the current step, then "
              "stopping (Ctrl+C again stops at once).", file=sys.stderr, flush=True)
