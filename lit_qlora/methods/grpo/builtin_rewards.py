"""The built-in reward functions of `litqlora grpo` (`--grpo.rewards answer_match format`), with TRL's calling
convention: `answer_match` compares a completion's answer with the row's `answer` column, numbers as numbers;
`format` checks the completion against a regular expression (default: it ends with a tagged answer)."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any, Optional

DEFAULT_FORMAT_PATTERN = r"^.*?<answer>.+?</answer>\s*$"


ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number as a model writes one in running text: a sign (not a hyphen after a word: "pages 3-4" ends in 4), a dollar
# sign, thousands commas (only in groups of three, so "1,2,3" is three numbers), a decimal part, a fraction, a percent
# sign. A trailing period ends a sentence, not a number.
NUMBER_IN_TEXT = re.compile(r"(?:(?<![\w)])[-+\u2212])?\$?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
                            r"(?:\s*/\s*\d+(?:\.\d+)?)?%?")
DECIMAL = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")
TRAILING_PUNCTUATION = ".,;:!?"
# GSM8K's `answer` column holds the worked solution and then "#### <final answer>": the final answer is what counts.
GSM8K_MARK = "####"
_DEFAULT_FORMAT = re.compile(DEFAULT_FORMAT_PATTERN, re.DOTALL)


def answer_match(completions: list, answer: list, **kwargs: Any) -> list[Optional[float]]:
    """1.0 where a completion's answer equals its row's `answer` column, else 0.0 (None where the row has no answer).

    The completion's answer is the content of its last `<answer>...</answer>` tag; without one, the last number in
    the text when the expected answer is a number, else the last non-empty line. Numbers compare as exact fractions
    after dropping whitespace, `$`, `%`, thousands commas and a trailing period ("12.0" == "12", "1/2" == "0.5");
    other text compares case-insensitively, without surrounding whitespace or trailing punctuation. An expected
    answer holding GSM8K's "#### " mark counts only what follows the last one."""
    scores: list[Optional[float]] = []
    for completion, expected in zip(completions, answer):
        target = _expected_answer(expected)
        if target is None:
            scores.append(None)
            continue
        text = completion_text(completion)
        tagged = ANSWER_TAG.findall(text)
        number = _as_number(target)
        if tagged:
            given: Optional[str] = tagged[-1]
        elif number is not None:
            found = NUMBER_IN_TEXT.findall(text)
            given = found[-1] if found else None
        else:
            lines = [line for line in text.splitlines() if line.strip()]
            given = lines[-1] if lines else None
        if given is None:
            scores.append(0.0)
        elif number is not None:
            scores.append(1.0 if _as_number(given) == number else 0.0)
        else:
            scores.append(1.0 if _normal_text(given) == _normal_text(target) else 0.0)
    return scores


def format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 where a completion matches DEFAULT_FORMAT_PATTERN (its answer in `<answer>...</answer>` at the end), else
    0.0. `--grpo.format_pattern` binds another pattern (`load_rewards`)."""
    return _format_scores(completions, _DEFAULT_FORMAT)


BUILTINS: dict[str, Callable[..., list]] = {"answer_match": answer_match, "format": format_reward}


def _format_scores(completions: list, pattern: re.Pattern[str]) -> list[float]:
    return [1.0 if pattern.match(completion_text(c)) else 0.0 for c in completions]


def format_reward_with(pattern: re.Pattern[str]) -> Callable[..., list]:
    """format_reward with `pattern` in place of the default: a closure, not a keyword argument, so that a dataset
    column that happens to be called `pattern` cannot replace it."""

    def format_reward(completions: list, **kwargs: Any) -> list[float]:
        return _format_scores(completions, pattern)

    format_reward.__doc__ = f"1.0 where a completion matches {pattern.pattern!r}, else 0.0."
    return format_reward


def completion_text(completion: Any) -> str:
    """A completion's text: the string of a standard row, or the last assistant message's content of a
    conversational one (`[{"role": "assistant", "content": text}]`)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        messages = [m for m in completion if isinstance(m, dict)]
        replies = [m for m in messages if m.get("role") == "assistant"] or messages
        return content_text(replies[-1].get("content")) if replies else ""
    raise TypeError(f"a completion must be a string or a list of chat messages, not {type(completion).__name__}")


def content_text(content: Any) -> str:
    # A message's content is a string, or (multimodal chat templates) a list of parts of which the text ones count.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "".join(part.get("text") or "" if isinstance(part, dict) else str(part) for part in content)
    return str(content)


def _expected_answer(expected: Any) -> Optional[str]:
    """The row's answer as text, or None when the row has none (then the reward does not apply)."""
    if expected is None:
        return None
    if isinstance(expected, numbers.Real) and not isinstance(expected, numbers.Integral):
        # repr is the shortest decimal that reads back as this float: 0.1 stays 0.1, not 0.1000000000000000055...
        value = float(expected)
        return repr(value) if math.isfinite(value) else None
    text = str(expected)
    if GSM8K_MARK in text:
        text = text.rsplit(GSM8K_MARK, 1)[1]
    return text if text.strip() else None


def _as_number(text: str) -> Optional[Fraction]:
    """The exact value of a number as written ("$1,234.50", "12%", "-3/4", "42."), or None if the text is not one."""
    s = text.strip().replace("\u2212", "-").replace("$", "")
    s = s.rstrip(".").rstrip()  # "42." ends a sentence
    if s.endswith("%"):
        s = s[:-1].rstrip()
    parts = [p.strip() for p in s.split("/")]
    if len(parts) > 2 or not all(DECIMAL.fullmatch(p) for p in parts):
        return None
    try:
        values = [Fraction(p.replace(",", "")) for p in parts]
    except (ValueError, ZeroDivisionError):
        return None
    if len(values) == 2:
        return values[0] / values[1] if values[1] != 0 else None
    return values[0]


def _normal_text(text: str) -> str:
    return " ".join(text.split()).rstrip(TRAILING_PUNCTUATION).strip().casefold()


# --- Loading -------------------------------------------------------------------------------------------------------
