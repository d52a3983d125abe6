"""`litqlora` entry point: jsonargparse subcommands over plain functions; help text comes from their docstrings.

Two kinds of failure end a command with one paragraph on stderr and no traceback (unless --debug):
- a command line jsonargparse rejects (exit 2). What is wrong is found from the structure of the input, never
  from jsonargparse's wording: the command name against the command table, each option given on the command
  line or in a --config file against the command's typed signature, each value against its type. Only when none
  of these checks names the problem is jsonargparse's own message shown.
- a user error raised by a command (exit 1): our `UserError`s and the few built-in errors that are about the
  user's input or machine (see USER_ERRORS). Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import sys
import typing
from pathlib import Path
from types import UnionType
from typing import Any, Callable, Literal, Optional

import yaml
from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser, Namespace, set_parsing_settings

from lit_qlora.errors import UserError
from lit_qlora.quiet import debug_children, quiet_library_logs
from lit_qlora.train.signals import Interrupted, TrainingStopped

Command = Callable[..., Any]


def commands() -> dict[str, Command]:
    # --help and argument errors must not wait seconds for torch and torchao (a test checks neither is imported):
    # a verb's module imports only light modules at its top, and the heavy ones inside the functions that use them,
    # when the command runs (after main() has quieted the loggers: torchao logs warnings while it is imported).
    # Names of heavy types in its annotations stay text (`from __future__ import annotations`), never imported in
    # an `if TYPE_CHECKING:` block: jsonargparse executes those blocks when it reads a signature.
    from lit_qlora.deploy.chat import chat_command
    from lit_qlora.deploy.gguf_export import export_gguf_command
    from lit_qlora.deploy.serve import serve_command
    from lit_qlora.checkpoint.download import download
    from lit_qlora.estimate.command import estimate
    from lit_qlora.eval.compare import compare
    from lit_qlora.eval.evaluate import evaluate
    from lit_qlora.deploy.export import export_peft, merge
    from lit_qlora.train.finetune import finetune
    from lit_qlora.preference.command import dpo
    from lit_qlora.deploy.generate import generate_command
    from lit_qlora.deploy.gguf_import import convert_gguf_command

    return {
        "finetune": finetune,
        "dpo": dpo,
        "estimate": estimate,
        "download": download,
        "convert_gguf": convert_gguf_command,
        "generate": generate_command,
        "chat": chat_command,
        "serve": serve_command,
        "merge": merge,
        "export_peft": export_peft,
        "export_gguf": export_gguf_command,
        "evaluate": evaluate,
        "compare": compare,
    }


# Errors a command raises whose message is the whole story for a user: besides our own, a file or directory the
# user named that is missing or unreadable, a ValueError from the checks of argument values (ours and those of
# the libraries we hand them to), and a non-finite loss or weight (FloatingPointError: only our training guards
# raise it). Out-of-memory errors are user errors too (`guards.is_oom`).
USER_ERRORS: tuple[type[Exception], ...] = (UserError, ValueError, FileNotFoundError, NotADirectoryError,
                                            PermissionError, FloatingPointError)


def is_user_error(error: Exception) -> bool:
    if isinstance(error, USER_ERRORS):
        return True
    from lit_qlora.guards import is_oom  # imports torch: asked only of errors not ours (a command's checks raise ours)

    return is_oom(error)


# Commands whose first argument may be given bare (`litqlora download REPO_ID`); every other argument is a flag.
POSITIONAL = {"download": "repo_id", "convert_gguf": "file"}


# compare's --config is a fine-tune recipe, not compare's own arguments: jsonargparse reserves the name
# `config`, so the parameter is `recipe` and --config is renamed to it.
RENAMED = {"compare": {"--config": "--recipe"}}


DESCRIPTION = ("Fine-tune LLMs with QLoRA (an NF4 base, LoRA adapters) or LoRA, then merge, export and evaluate them. "
               "`litqlora COMMAND --help` describes a command.")
CONFIG_HELP = "A YAML file of this command's options (keys as in --print_config); the command line overrides it."
COMPARE_CONFIG_HELP = ("A `litqlora finetune` recipe (e.g. config_hub/finetune/smollm2-135m/lora.yaml) that both fine-tunes "
                       "run; the same as --recipe.")
DEBUG_HELP = ("Show the full traceback of an error, and what other libraries print (torchao's import warnings, "
              "progress bars of datasets); also LITQLORA_DEBUG=1 or `debug: true` in a --config file.")

BUILTIN_OPTIONS = ("config", "print_config", "help", "debug")
"""Options every command has besides its own parameters."""

FALSE = ("false", "0", "no", "off")
"""--debug VALUE spellings that turn it off; any other value (or none) turns it on."""


def expand_positional(argv: list[str]) -> list[str]:
    if len(argv) > 1 and argv[0] in POSITIONAL and not argv[1].startswith("-"):
        return [argv[0], f"--{POSITIONAL[argv[0]]}", *argv[1:]]
    renamed = RENAMED.get(argv[0], {}) if argv else {}
    out = argv[:1]
    for arg in argv[1:]:
        flag, eq, value = arg.partition("=")
        out.append(renamed.get(flag, flag) + eq + value)
    return out


def config_files(argv: list[str]) -> list[str]:
    """The files given with --config FILE / --config=FILE."""
    files = [a.partition("=")[2] for a in argv if a.startswith("--config=")]
    return files + [b for a, b in zip(argv, argv[1:]) if a == "--config"]


def debug_flag(argv: list[str]) -> Optional[bool]:
    """The value of --debug on the command line (`--debug`, `--debug true`, `--debug=false`); None: not given."""
    for i, arg in enumerate(argv):
        if arg == "--debug":
            follows = argv[i + 1].lower() if i + 1 < len(argv) else ""
            return follows not in FALSE
        if arg.startswith("--debug="):
            return arg.partition("=")[2].lower() not in FALSE
    return None


def debug_requested(argv: list[str]) -> bool:
    """--debug on the command line, else `debug: true` in a --config file, else LITQLORA_DEBUG=1."""
    flag = debug_flag(argv)
    if flag is not None:
        return flag
    for file in config_files(argv):
        try:
            with open(file, encoding="utf-8") as f:
                config = yaml.safe_load(f)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # the parser reports it
        if isinstance(config, dict) and config.get("debug") is True:
            return True
    return os.environ.get("LITQLORA_DEBUG") == "1"


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
        hints = typing.get_type_hints(command)
        found: dict[str, Any] = {}
        groups, required = set(), []
        for name, param in inspect.signature(command).parameters.items():
            hint = hints.get(name, Any)
            if dataclasses.is_dataclass(hint):
                groups.add(name)
                fields = typing.get_type_hints(hint)
                found.update({f"{name}.{f.name}": fields[f.name] for f in dataclasses.fields(hint)})
                continue
            found[name] = hint
            if param.default is inspect.Parameter.empty:
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
            suggestion = f"; did you mean `{close[0]}`?" if close else "."
            return f"{name}: unknown option `{option.key}`{where}{suggestion} {help_hint}"
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
    from lit_qlora.hardware import PRECISION_NEAREST, PrecisionChoice

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


# -- running -----------------------------------------------------------------------------------------------------
def build_parser(table: dict[str, Command]) -> ArgumentParser:
    """One subcommand per verb, its options read from the function's typed signature and docstrings.

    exit_on_error=False: a bad command line raises ArgumentError (explained in one paragraph by `main`) instead of
    printing the whole usage; allow_abbrev=False: a typo must not silently become the option it abbreviates."""
    parser = ArgumentParser(prog="litqlora", description=DESCRIPTION, exit_on_error=False,
                            allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"litqlora {installed_version()}",
                        help="Print lit-qlora's version and exit.")
    subcommands = parser.add_subcommands(required=True)
    for name, command in table.items():
        summary = inspect.getdoc(command).split("\n\n")[0].replace("\n", " ")
        sub = ArgumentParser(description=summary, exit_on_error=False, allow_abbrev=False)
        sub.add_argument("--config", action=ActionConfigFile,
                         help=COMPARE_CONFIG_HELP if name in RENAMED else CONFIG_HELP)
        sub.add_function_arguments(command, as_group=False, as_positional=False, sub_configs=True)
        sub.add_argument("--debug", type=bool, nargs="?", const=True, default=False, help=DEBUG_HELP)
        subcommands.add_subcommand(name, sub, help=summary)
    return parser


def installed_version() -> str:
    """The installed lit-qlora's version (pyproject.toml's), or `unknown` when run from a source tree uninstalled."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lit-qlora")
    except PackageNotFoundError:
        return "unknown (not installed)"


def run(parser: ArgumentParser, table: dict[str, Command], cfg: Namespace) -> None:
    init = parser.instantiate(cfg)  # dataclass groups become their dataclasses
    name = init.subcommand
    arguments = init[name]
    for option in ("config", "debug"):
        arguments.pop(option, None)
    table[name](**arguments)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # QLoRA dequantizes weights of many sizes into short-lived buffers; with fixed segments the CUDA caching
    # allocator reserved 15.6 GiB for an 8B step that allocated 6.8 GiB at its peak (H100). Read at the first CUDA
    # allocation, so setting it here is in time; a user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    debug = debug_requested(argv)
    argv = expand_positional(argv)
    if not debug:
        quiet_library_logs()
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # dataclass field docstrings become --help
    table = commands()
    parser = build_parser(table)
    try:
        cfg = parser.parse_args(argv)
    except ArgumentError as e:
        if debug:
            raise
        print(f"litqlora: error: {usage_error(argv, table) or jsonargparse_message(e, argv, table)}",
              file=sys.stderr)
        sys.exit(2)

    restore = debug_children(debug)
    try:
        run(parser, table, cfg)
    except TrainingStopped as e:
        print(f"litqlora: {e}", file=sys.stderr)
        raise Interrupted(e.exit_code) from None
    except MemoryError:
        if debug:
            raise
        print("litqlora: error: out of CPU memory. Free memory, or load the base as NF4 (--quantize nf4).",
              file=sys.stderr)
        sys.exit(1)
    except Exception as e:
        if debug or not is_user_error(e):
            raise  # a bug: the traceback is what its report needs
        print(f"litqlora: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("litqlora: interrupted", file=sys.stderr)
        raise Interrupted(130) from None
    finally:
        restore()


if __name__ == "__main__":
    main()
