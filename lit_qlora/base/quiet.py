"""Quiet by default: what other libraries print that says nothing about the user's run stays out of its output,
unless `--debug` (LITQLORA_DEBUG=1, which the CLI sets for the processes it starts: LitServe's workers, Lightning's
ranks) asks for everything.

Called before those libraries load: by the CLI, and by lit_qlora.nf4 before it imports torchao, so a process the
CLI did not start (a LitServe worker is spawned afresh) is quiet too.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Callable

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")
"""torchao warns at import about CUDA-only kernels it cannot load (`Failed to load ..._C_mxfp8...so`), torch about a
pytree deprecation inside torchao: neither concerns NF4."""


def debugging() -> bool:
    return os.environ.get("LITQLORA_DEBUG") == "1"


def quiet_third_party() -> None:
    """Silence the import-time warnings of NOISY_LOGGERS and the datasets library's progress bars ("Generating
    train split"), unless debugging."""
    if debugging():
        return
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # read when datasets loads


def quiet_library_logs() -> None:
    """What the CLI runs unless --debug: third-party noise off (what Lightning's Trainer prints during a fine-tune:
    lit_qlora.train.progress.quiet_lightning), and Python warnings, ours included, as one line each instead of a
    file name, line number and source line."""
    quiet_third_party()
    warnings.formatwarning = lambda message, category, filename, lineno, line=None: f"litqlora: warning: {message}\n"


def debug_children(debug: bool) -> Callable[[], None]:
    """With --debug, LITQLORA_DEBUG=1 for the processes a command starts (LitServe's workers, Lightning's ranks)
    while it runs; returns what puts the environment back (a command run in-process leaves none behind)."""
    before = os.environ.get("LITQLORA_DEBUG")
    if debug:
        os.environ["LITQLORA_DEBUG"] = "1"

    def restore() -> None:
        if before is None:
            os.environ.pop("LITQLORA_DEBUG", None)
        else:
            os.environ["LITQLORA_DEBUG"] = before

    return restore
