"""The one error type of the data pipeline."""

from __future__ import annotations

from lit_qlora.base.errors import UserError


class DataError(UserError, ValueError):
    """A dataset or prompt-style problem the user can fix; the message says what is wrong and what to do.

    A `UserError`, so the CLI prints it without a traceback (and a `ValueError`, as bad input)."""
