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


class InvalidInput(UserError, ValueError):
    """A flag value, or the contents of a file the user named, that lit-qlora cannot use. A `ValueError` too, as
    these checks raised before: code and tests that catch ValueError keep catching them."""


class MissingFile(UserError, FileNotFoundError):
    """A file or directory the user named (or one that a named directory must hold) does not exist. A
    `FileNotFoundError` too, as these checks raised before."""


class NonFinite(UserError, FloatingPointError):
    """A loss, gradient or weight became NaN or inf; the message names the step and the settings to change. A
    `FloatingPointError` too, as these guards raised before."""

