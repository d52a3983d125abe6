"""Why `litqlora` rejected a command line, in one paragraph: what is wrong is found from the structure of the input,
never from jsonargparse's wording: the command name against the command table, each option given on the command line
or in a --config file against the command's typed signature (or its run spec's fields), each value against its type.
Only when none of these checks names the problem is jsonargparse's own message shown."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
from pathlib import Path
from types import UnionType
from typing import Any, Callable, Literal, Optional

import yaml
from jsonargparse import ArgumentError, ArgumentParser

Command = Callable[..., Any]

BUILTIN_OPTIONS = ("config", "print_config", "help", "debug")
"""Options every command has besides its own parameters."""

def config_files(argv: list[str]) -> list[str]:
    """The files given with --config FILE / --config=FILE."""
    files = [a.partition("=")[2] for a in argv if a.startswith("--config=")]
    return files + [b for a, b in zip(argv, argv[1:]) if a == "--config"]


# -- what a command accepts --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Options:
    """A command's options, read from its typed signature (as jsonargparse reads it to build the parser)."""

    types: dict[str, Any]
    """Option key (`lr`, or `train.lr` for a field of a dataclass parameter) -> its type."""
    groups: frozenset[str]
    """Dataclass parameters: their fields are given as `--train.lr` or nested in a YAML file."""
    required: tuple[str, ...]
    """Parameters without a default."""

    @classmethod
    def of(cls, command: Command) -> Options:
        spec = spec_class(command)
        if spec is not None:  # a spec's fields are the command's options
            hints = typing.get_type_hints(spec)
            required = set(spec.required_fields())
            params = [(f.name, hints[f.name], f.name in required) for f in spec.cli_fields()]
        else:
            hints = typing.get_type_hints(command)
            params = [(name, hints.get(name, Any), param.default is inspect.Parameter.empty)
                      for name, param in inspect.signature(command).parameters.items()]
        found: dict[str, Any] = {}
        groups, required = set(), []
        for name, hint, is_required in params:
            group = next((arm for arm in union_arms(hint) if dataclasses.is_dataclass(arm)), None)
            if group is not None:  # (an optional group, `dpo: Optional[DPOArgs]`, too)
                groups.add(name)
                fields = typing.get_type_hints(group)
                found.update({f"{name}.{f.name}": fields[f.name] for f in dataclasses.fields(group)})
                continue
            found[name] = hint
            if is_required:
                required.append(name)
        return cls(found, frozenset(groups), tuple(required))

    def names(self) -> list[str]:
        return [*BUILTIN_OPTIONS, *self.types]

    def knows(self, key: str) -> bool:
        if key in self.types or key in self.groups or key in BUILTIN_OPTIONS:
            return True
        # `--train.max_steps 3` sets one entry of a dict-valued option (compare's --train).
        parent = key.rpartition(".")[0]
        while parent:
            if parent in self.types and takes_mapping(self.types[parent]):
                return True
            parent = parent.rpartition(".")[0]
        return False


def spec_class(command: Command) -> Optional[type]:
    """The spec a verb takes (its `spec` parameter's dataclass, a lit_qlora.base.spec.CommandSpec: a training run's
    RunSpec, an inference command's ModelChoice), whose fields are the verb's options; None: the verb's own
    parameters are."""
    parameter = inspect.signature(command).parameters.get("spec")
    if parameter is None:
        return None
    hint = typing.get_type_hints(command).get("spec")
    return next((arm for arm in union_arms(hint) if dataclasses.is_dataclass(arm)), None)


def union_arms(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, UnionType) else (hint,)


def takes_mapping(hint: Any) -> bool:
    return any(typing.get_origin(arm) in (dict, typing.Mapping) or arm is dict for arm in union_arms(hint))


def describe(hint: Any) -> str:
    """A type as a user reads it: `bool or int`, `one of 'nf4', 'none'`, `float or null`."""
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    names: list[str] = []
    for arm in union_arms(hint):
        if typing.get_origin(arm) is Literal:
            names += map(repr, typing.get_args(arm))
        elif arm is type(None):
            names.append("null")
        elif isinstance(arm, type):
            names.append(arm.__name__)
        else:
            names.append(str(arm).replace("typing.", ""))
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def accepts(hint: Any, value: Any, from_file: bool) -> bool:
    """Whether jsonargparse takes `value` (a command-line string, or a value read from a YAML file) for an option
    of type `hint`: asked of a parser holding that one option, judged by whether it raises."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--value", type=hint)
    try:
        if from_file:
            parser.parse_object({"value": value})
        else:
            parser.parse_args(["--value"] if value is None else ["--value", value])
    except ArgumentError:
        return False
    return True


# -- what was given ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Given:
    """One option as the user gave it."""

    key: str
    value: Any
    """A string from the command line (None: no value followed the flag), a YAML value from a file."""
    source: Optional[str] = None
    """The --config file it came from; None: the command line."""

    def label(self) -> str:
        return f"`{self.key}` in {self.source}" if self.source else f"--{self.key}"


def command_line_options(args: list[str]) -> list[Given]:
    out = []
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        key, eq, value = arg[2:].partition("=")
        if not eq:
            follows = args[i + 1] if i + 1 < len(args) else None
            value = follows if follows is not None and not follows.startswith("--") else None
        out.append(Given(key, value))
    return out


def read_config(path: str) -> tuple[dict, Optional[str]]:
    """(the file's options, None), or ({}, what is wrong with the file)."""
    if not Path(path).is_file():
        return {}, f"--config {path} does not exist."
    try:
        with open(path, encoding="utf-8") as f:
            tree = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        return {}, f"{path} is not a valid YAML mapping of options: {' '.join(str(e).split())}."
    if tree is not None and not isinstance(tree, dict):
        return {}, f"{path} is not a valid YAML mapping of options: it holds a {type(tree).__name__}."
    return tree or {}, None


def file_options(tree: dict, groups: frozenset[str], source: str, prefix: str = "") -> list[Given]:
    """The options of a YAML mapping, the fields of a dataclass parameter as `group.field`."""
    out = []
    for key, value in tree.items():
        key = f"{prefix}{key}"
        if key in groups and isinstance(value, dict):
            out += file_options(value, groups, source, f"{key}.")
        else:
            out.append(Given(key, value, source))
    return out


def usage_error(argv: list[str], table: dict[str, Command]) -> Optional[str]:
    """What is wrong with a command line that jsonargparse rejected, found by checking it against the command
    table, the command's signature and its --config files; None when no check finds the problem."""
    quoted = ", ".join(map(repr, table))
    if not argv:
        return f"no command given; the commands are {quoted}. `litqlora --help` describes them."
    name = argv[0]
    if name.startswith("-"):
        return None
    if name not in table:
        close = difflib.get_close_matches(name, list(table), n=1)
        suggestion = f" Did you mean `{close[0]}`?" if close else ""
        return f"unknown command {name!r}: the commands are {quoted}.{suggestion}"

    options = Options.of(table[name])
    help_hint = f"`litqlora {name} --help` lists every option."
    given = command_line_options(argv[1:])
    for path in config_files(argv[1:]):
        tree, problem = read_config(path)
        if problem:
            return f"{name}: {problem} {help_hint}"
        given += file_options(tree, options.groups, path)
    for option in given:
        if not options.knows(option.key):
            # a group's field given at the top (--lr for --train.lr) is the likeliest slip; then a typo
            in_group = [key for key in options.types if key.rpartition(".")[2] == option.key and "." in key]
            close = in_group or difflib.get_close_matches(option.key, options.names(), n=1, cutoff=0.6)
            where = f" in {option.source}" if option.source else ""
            dashes = "" if option.source else "--"  # written as given: a flag on the command line, a key in a file
            suggestion = f"; did you mean `{dashes}{close[0]}`?" if close else "."
            return f"{name}: unknown option `{dashes}{option.key}`{where}{suggestion} {help_hint}"
    for option in given:
        hint = options.types.get(option.key)
        if hint is not None and not accepts(hint, option.value, from_file=option.source is not None):
            got = "no value" if option.value is None and not option.source else repr(option.value)
            nearest = nearest_value(hint, option.value)
            suggestion = f" The nearest lit-qlora takes: {nearest!r}." if nearest else ""
            return f"{name}: {option.label()}: expected {describe(hint)}, got {got}.{suggestion} {help_hint}"
    missing = [key for key in options.required if key not in {option.key for option in given}]
    if missing:
        return f"{name}: --{missing[0]} is required. {help_hint}"
    return None


def nearest_value(hint: Any, value: Any) -> Optional[str]:
    """For a choice option given a value it does not take: the nearest choice (a precision name users type from
    elsewhere, PRECISION_NEAREST; else the closest spelling), or None."""
    from lit_qlora.base.precision import PRECISION_NEAREST, PrecisionChoice

    choices = [str(c) for arm in union_arms(hint) if typing.get_origin(arm) is Literal for c in typing.get_args(arm)]
    if not choices or value is None:
        return None
    if set(typing.get_args(PrecisionChoice)) <= set(choices) and str(value).lower() in PRECISION_NEAREST:
        return PRECISION_NEAREST[str(value).lower()]
    close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
    return close[0] if close else None


def jsonargparse_message(error: ArgumentError, argv: list[str], table: dict[str, Command]) -> str:
    """jsonargparse's own message, on one line, for the problems the checks of `usage_error` do not name."""
    name = argv[0] if argv and argv[0] in table else None
    prefix, help_hint = (f"{name}: ", f"`litqlora {name} --help`") if name else ("", "`litqlora --help`")
    return f"{prefix}{' '.join(str(error).split()).rstrip('.')}. {help_hint} lists every option."


