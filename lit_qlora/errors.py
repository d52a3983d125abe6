"""The root of the errors a user can fix.

A command that fails with a `UserError` has nothing to show but its message: the CLI prints it as one paragraph
and exits 1. Anything else that escapes a command is a bug in lit-qlora or a library, and keeps its traceback.
Each subsystem names its own subclass (`CheckpointError`, `DataError`, `DownloadError`, `OutOfMemory`, ...),
so a caller can catch the errors of one concern.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, files, machine or network; the message says what is wrong and what to
    do about it."""
