"""The reward functions of `litqlora grpo`: loading them from `--grpo.rewards`, calling them as TRL's GRPOTrainer
does, and turning what they return into a checked tensor.

A reward function is called `fn(prompts=..., completions=..., completion_ids=..., **columns)`, each argument a list
with one entry per completion (`columns`: every other column of the dataset rows, e.g. `answer=[...]`), and returns
one float per completion, or None where the reward does not apply. A function written for TRL works unchanged; a
function that declares no `**kwargs` gets only the arguments it names, so `def f(completions, answer)` is fine too.

`--grpo.rewards` names each function as a built-in (`BUILTINS`: `answer_match`, `format`), `path/to/file.py:function`
or `package.module:function`. torch is imported only by `score` and `total`, so the CLI can list the built-ins
without it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lit_qlora.base.errors import UserError
from lit_qlora.methods.grpo.builtin_rewards import (BUILTINS, DEFAULT_FORMAT_PATTERN, completion_text, content_text,
                                            format_reward_with)


# The arguments every call gets besides the dataset's columns (TRL's names).
CALL_ARGUMENTS = ("prompts", "completions", "completion_ids")
FORMS = "a built-in ({builtins}), path/to/file.py:function, or package.module:function"
# How much of a prompt (and a completion) an error quotes: enough to find the row, not a whole page.
QUOTE_CHARS = 80
# How many of a module's callables an error lists when the named one is not there.
LISTED_CALLABLES = 10


@dataclass(frozen=True)
class Reward:
    """One reward function and its weight in the total. `name` is its metrics key (rewards/<name>/mean): a built-in's
    name or the function's `__name__`, made unique among the run's rewards."""

    name: str
    fn: Callable[..., list]
    weight: float = 1.0


def load_rewards(specs: Sequence[str], weights: Optional[Sequence[float]] = None,
                 format_pattern: str = DEFAULT_FORMAT_PATTERN) -> list[Reward]:
    """The rewards `--grpo.rewards` names, weighted by `--grpo.reward_weights` (TRL's reward_weights; default 1.0
    each). Each spec is a built-in name ("answer_match", "format"), "path/to/file.py:function" (relative paths are
    against the current directory) or "package.module:function". Two rewards of the same name get distinct metric
    names (`name`, `name_2`, `name_3`, ...). Raises UserError for anything that cannot be loaded."""
    specs = [str(spec).strip() for spec in specs]
    if not specs:
        raise UserError("--grpo.rewards is empty: name at least one reward function, as " + _forms() + ".")
    try:
        pattern = re.compile(format_pattern, re.DOTALL)
    except re.error as e:
        raise UserError(f"--grpo.format_pattern {format_pattern!r} is not a valid regular expression ({e}). Fix it; "
                        "it is matched from the start of each completion with re.DOTALL (. matches newlines too), "
                        f"and the default is {DEFAULT_FORMAT_PATTERN!r}.") from None
    if weights is None:
        weights = [1.0] * len(specs)
    weights = list(weights)
    if len(weights) != len(specs):
        raise UserError(f"--grpo.reward_weights has {len(weights)} weight(s) but --grpo.rewards names {len(specs)} "
                        f"reward(s) ({', '.join(specs)}): give one weight per reward, in the same order, or leave "
                        "--grpo.reward_weights out to weight each 1.0.")
    for spec, weight in zip(specs, weights):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise UserError(f"--grpo.reward_weights gives the reward {spec} the weight {weight!r}; a weight must be "
                            "a finite number.")

    modules: dict[str, Any] = {}  # one load per file or module, however many of its functions are named
    rewards: list[Reward] = []
    taken: set[str] = set()
    for spec, weight in zip(specs, weights):
        name, fn = _load_one(spec, pattern, modules)
        unique, n = name, 1
        while unique in taken:
            n += 1
            unique = f"{name}_{n}"
        taken.add(unique)
        rewards.append(Reward(name=unique, fn=fn, weight=float(weight)))
    return rewards


def _forms() -> str:
    return FORMS.format(builtins=", ".join(BUILTINS))


def _load_one(spec: str, pattern: re.Pattern[str], modules: dict[str, Any]) -> tuple[str, Callable[..., list]]:
    """The metric name and function of one spec."""
    if ":" not in spec:
        if spec not in BUILTINS:
            raise UserError(f"--grpo.rewards names {spec!r}, which is not a built-in reward. Name "
                            f"{_forms()} (e.g. ./my_rewards.py:correct or my_package.rewards:correct).")
        if spec == "format" and pattern.pattern != DEFAULT_FORMAT_PATTERN:
            return spec, format_reward_with(pattern)
        return spec, BUILTINS[spec]
    where, _, attr = spec.rpartition(":")
    if not where or not attr.isidentifier():
        raise UserError(f"--grpo.rewards names {spec!r}, which is not {_forms()}: after the last ':' must come the "
                        "name of a function.")
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    module = modules.get(where)
    if module is None:
        module = _load_file(spec, where) if is_file else _import_module(spec, where)
        modules[where] = module
    missing = object()
    fn = getattr(module, attr, missing)
    holder = f"the file {where}" if is_file else f"the module {where}"
    if fn is missing:
        raise UserError(f"--grpo.rewards names {spec!r}, but {holder} has no {attr!r}; "
                        f"{_callables_of(module)}. Check the spelling, or define it there.")
    if not callable(fn):
        raise UserError(f"--grpo.rewards names {spec!r}, but {attr} in {holder} is not a function (it is of "
                        f"type {type(fn).__name__}). Name a function that takes the completions and returns one "
                        "float per completion.")
    return getattr(fn, "__name__", None) or attr, fn


def _load_file(spec: str, where: str) -> Any:
    path = Path(where).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    if not path.is_file():
        state = "is a folder" if path.is_dir() else "does not exist"
        raise UserError(f"--grpo.rewards names {spec!r}, but the file {where} {state} (looked for {path}). Pass the "
                        "path of a Python file, relative to the current directory or absolute, then ':' and the "
                        "function's name.")
    # A name of its own per file, so two reward files called rewards.py do not replace each other (or a package).
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", path.stem)
    name = f"lit_qlora_user_rewards_{stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"--grpo.rewards names {spec!r}, but Python cannot load {path} as a module. Name a .py file.")
    module = importlib.util.module_from_spec(module_spec)
    # In sys.modules while it runs, as an import would be: dataclasses and pickling look the module up there.
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise UserError(f"--grpo.rewards names {spec!r}, but running the file {where} raised {type(e).__name__}: "
                        f"{e}. Fix the file (run `python {where}` to see the whole traceback).") from e
    return module


def _import_module(spec: str, where: str) -> Any:
    try:
        return importlib.import_module(where)
    except ImportError as e:
        raise UserError(f"--grpo.rewards names {spec!r}, but the module {where} cannot be imported ({e}). Install "
                        "it or put its folder on PYTHONPATH; a file's path needs the .py extension "
                        "(path/to/file.py:function).") from e
    except Exception as e:
        raise UserError(f"--grpo.rewards names {spec!r}, but importing the module {where} raised "
                        f"{type(e).__name__}: {e}. Fix the module (`python -c 'import {where}'` shows the whole "
                        "traceback).") from e


def _callables_of(module: Any) -> str:
    """A few of the public callables a module defines, for an error about one it lacks."""
    mine = getattr(module, "__name__", None)
    names = [k for k, v in vars(module).items()
             if not k.startswith("_") and callable(v) and getattr(v, "__module__", None) == mine]
    if not names:
        return "it defines no public function"
    more = f" and {len(names) - LISTED_CALLABLES} more" if len(names) > LISTED_CALLABLES else ""
    return "its functions and classes are: " + ", ".join(names[:LISTED_CALLABLES]) + more


# --- Calling -------------------------------------------------------------------------------------------------------

def check_columns(rewards: Sequence[Reward], columns: Sequence[str], source: str) -> None:
    """Raise UserError now if a reward function needs an argument the dataset's columns do not provide, rather than
    at the first step, after the first generation. (`score` checks the same on every call.)"""
    available = set(CALL_ARGUMENTS) | set(columns)
    for reward in rewards:
        _arguments(reward, available, sorted(columns), source)


def score(rewards: Sequence[Reward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], rows: Sequence[int], source: str) -> torch.Tensor:  # noqa: F821
    """[len(completions), len(rewards)] float32: each function's reward per completion, NaN where it returned None.

    `rows`: where each completion's row is in its source (its line in a JSONL file, else its 1-based place; the
    messages say "line" for a .jsonl `source`, else "row") and `source`: the data file's name, both for the
    messages: a function that raises, returns the wrong number of values or a value that is not a finite number
    raises UserError naming the function, the row and what to do, never a traceback from inside the loop."""
    import torch

    n = len(completions)
    lengths = {"prompts": len(prompts), "completion_ids": len(completion_ids), "rows": len(rows),
               **{f"columns[{k!r}]": len(v) for k, v in columns.items()}}
    uneven = {k: v for k, v in lengths.items() if v != n}
    if uneven:  # the caller's mistake, not the user's
        raise ValueError(f"score: {n} completions but {uneven}")
    out = torch.full((n, len(rewards)), math.nan, dtype=torch.float32)
    if n == 0:
        return out
    # The explicit arguments win over a column of the same name, as they describe the completions themselves.
    everything = {**columns, "prompts": prompts, "completions": completions, "completion_ids": completion_ids}
    for j, reward in enumerate(rewards):
        names = _arguments(reward, everything.keys(), sorted(columns), source)
        kwargs = {k: everything[k] for k in names}
        try:
            values = reward.fn(**kwargs)
        except UserError:
            raise  # already says what to do (answer_match's missing column, a user's own checks)
        except Exception as e:
            raise _failure(reward, kwargs, prompts, completions, rows, source, e) from e
        out[:, j] = torch.tensor(_checked(reward, values, n, rows, source), dtype=torch.float32)
    return out


def total(per_function: torch.Tensor, rewards: Sequence[Reward]) -> torch.Tensor:  # noqa: F821
    """Per completion: the sum over functions of weight x reward, a NaN (None: not applicable) counted as 0, as
    TRL's nansum does. `per_function` is `score`'s [completions, functions]."""
    import torch

    if per_function.dim() != 2 or per_function.shape[1] != len(rewards):
        raise ValueError(f"total: {len(rewards)} rewards but per_function has the shape {tuple(per_function.shape)}")
    weights = torch.tensor([r.weight for r in rewards], dtype=per_function.dtype, device=per_function.device)
    return torch.nansum(per_function * weights, dim=1)


def _arguments(reward: Reward, available: Any, columns: list[str], source: str) -> list[str]:
    """The names to pass `reward.fn`: everything when it takes **kwargs, else the parameters it declares that we
    have. A required parameter we do not have raises UserError."""
    try:
        params = list(inspect.signature(reward.fn).parameters.values())
    except (TypeError, ValueError):  # no signature (a builtin, some C callables): pass everything, as TRL does
        return list(available)
    wanted: list[str] = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in available and p.kind != p.POSITIONAL_ONLY:
            wanted.append(p.name)
        elif p.default is p.empty and p.kind == p.POSITIONAL_ONLY:
            raise UserError(f"The reward function {reward.name} ({_where(reward.fn)}) declares {p.name!r} "
                            "positional-only, but reward functions get every argument by name, as TRL passes them: "
                            "remove the '/' from its parameters.")
        elif p.default is p.empty:
            raise UserError(
                f"The reward function {reward.name} ({_where(reward.fn)}) needs {p.name!r}, which is not prompts, "
                f"completions or completion_ids, so {source} must have a column {p.name!r}; its columns are: "
                f"{', '.join(columns) or 'none besides the prompt'}. Rename the column that holds it with "
                f"--data.columns (e.g. '{{solution: {p.name}}}' when {source} calls it solution)"
                + ("." if reward.fn in BUILTINS.values() else ", or give the parameter a default."))
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return list(available)
    return wanted


def _checked(reward: Reward, values: Any, n: int, rows: Sequence[int], source: str) -> list[float]:
    """`values` as n floats (NaN for None), or a UserError saying what is wrong with them."""
    if hasattr(values, "ndim") and hasattr(values, "tolist"):  # a numpy array or a torch tensor
        if values.ndim != 1:
            raise UserError(f"The reward function {reward.name} ({_where(reward.fn)}) returned a "
                            f"{type(values).__name__} of shape {tuple(values.shape)} for {n} completions; it must "
                            "return a list of one float (or None) per completion, in order.")
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise UserError(f"The reward function {reward.name} ({_where(reward.fn)}) returned a {type(values).__name__}, "
                        f"not a list; it must return a list of {n} floats (or None where a reward does not apply), "
                        "one per completion, in order.")
    if len(values) != n:
        raise UserError(f"The reward function {reward.name} ({_where(reward.fn)}) returned {len(values)} values for "
                        f"{n} completions ({_row_span(rows, source)} of {source}); it must return one float (or None) "
                        "per completion, in order: a list as long as `completions`.")
    floats: list[float] = []
    for value, row in zip(values, rows):
        if getattr(value, "ndim", None) == 0:
            value = value.item()  # a numpy scalar or a 0-d tensor (np.bool_ is no numbers.Real, its item() is)
        if value is None:
            floats.append(math.nan)
            continue
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            kind = "not a real number" if not isinstance(value, numbers.Real) else "not finite"
            raise UserError(f"The reward function {reward.name} ({_where(reward.fn)}) returned {_short(repr(value))} "
                            f"for {_row_span([row], source)} of {source}, which is {kind}. A reward must be a finite "
                            "number, or None where it does not apply to a completion; fix the function.")
        floats.append(float(value))
    return floats


def _failure(reward: Reward, kwargs: dict[str, Any], prompts: list, completions: list, rows: Sequence[int],
             source: str, error: Exception) -> UserError:
    """The error for a function that raised on a batch: call it again one completion at a time to name the first
    completion it fails on (a function may fail only on a mix, then the message names the batch's rows)."""
    for i in range(len(completions)):
        one = {k: v[i:i + 1] if isinstance(v, (list, tuple)) else v for k, v in kwargs.items()}
        try:
            reward.fn(**one)
        except Exception as e:
            return UserError(
                f"The reward function {reward.name} ({_where(reward.fn)}) raised {type(e).__name__}: {e} on "
                f"{_row_span([rows[i]], source)} of {source} (prompt: {_quote(_prompt_text(prompts[i]))}; "
                f"completion: {_quote(completion_text(completions[i]))}). Fix the function so that it handles this "
                "completion (return None where a reward does not apply), or fix or remove the row.")
    return UserError(
        f"The reward function {reward.name} ({_where(reward.fn)}) raised {type(error).__name__}: {error} on the "
        f"completions of {_row_span(rows, source)} of {source}, though on none of them alone. Fix the function: it "
        "must return one float (or None) per completion for any batch of them.")


def _where(fn: Any) -> str:
    """Where a function is defined, as file:line, for messages."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    try:
        target = inspect.unwrap(target)
    except ValueError:
        pass
    if not (inspect.isfunction(target) or inspect.ismethod(target) or inspect.isclass(target)):
        target = type(target)  # a callable object: its class holds the code
    try:
        return f"{inspect.getsourcefile(target) or inspect.getfile(target)}:{inspect.getsourcelines(target)[1]}"
    except (TypeError, OSError):
        return f"in {getattr(target, '__module__', None) or 'an unknown module'}"


def _prompt_text(prompt: Any) -> str:
    """A prompt's text: the string of a standard row, or the last user message's content of a conversational one."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        messages = [m for m in prompt if isinstance(m, dict)]
        users = [m for m in messages if m.get("role") == "user"] or messages
        return content_text(users[-1].get("content")) if users else ""
    return str(prompt)


def _quote(text: str) -> str:
    return repr(_short(text))


def _short(text: str) -> str:
    """The start of a text on one line, for a message."""
    line = " ".join(text.split())
    return line if len(line) <= QUOTE_CHARS else line[:QUOTE_CHARS] + "..."


def _row_span(rows: Sequence[int], source: str) -> str:
    """"line 5", "lines 1-8" or "lines 1, 4, 9" of a JSONL file (a row is a line there, and the line is what a user
    edits); "row 5", ... of any other source."""
    word = "line" if str(source).endswith(".jsonl") else "row"
    ordered = sorted(set(rows))
    if len(ordered) == 1:
        return f"{word} {ordered[0]}"
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{word}s {ordered[0]}-{ordered[-1]}"
    return f"{word}s " + ", ".join(map(str, ordered))
