"""The one error type of the data pipeline."""

from __future__ import annotations


class DataError(ValueError):
    """A dataset or prompt-style problem the user can fix; the message says what is wrong and what to do.

    A `ValueError`, so the CLI prints it without a traceback."""
