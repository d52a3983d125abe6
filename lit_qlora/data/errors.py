"""The one error type of the data pipeline, and the message that lists a dataset's unusable rows."""

from __future__ import annotations

from typing import Optional, Sequence

from lit_qlora.base.errors import UserError


class DataError(UserError, ValueError):
    """A dataset or prompt-style problem the user can fix; the message says what is wrong and what to do.

    A `UserError`, so the CLI prints it without a traceback (and a `ValueError`, as bad input)."""


def row_place(index: int, lines: Optional[Sequence[int]]) -> str:
    """Row `index`'s 1-based number as an error names it, with its line in the file where that differs (a JSONL
    file's blank lines, a JSON list spread over lines)."""
    number = index + 1
    return f"{number}" if lines is None or lines[index] == number else f"{number} (line {lines[index]})"


def unusable_rows(source: str, kind: str, bad: dict[str, list[str]], help_text: str) -> DataError:
    """One paragraph listing each problem with its rows (`bad`: problem -> row_place()s, the first five named):
    "{source} has {kind}rows that cannot be used: ... {help_text} Fix or remove those rows."."""
    def some(numbers: list[str]) -> str:
        more = f" and {len(numbers) - 5} more" if len(numbers) > 5 else ""
        return ("row " if len(numbers) == 1 else "rows ") + ", ".join(numbers[:5]) + more

    details = "; ".join(f"{some(numbers)}: {problem}" for problem, numbers in bad.items())
    return DataError(f"{source} has {kind}rows that cannot be used: {details}. {help_text} Fix or remove those rows.")
