"""`litqlora` entry point: jsonargparse subcommands over plain functions; help text comes from their docstrings.

Two kinds of failure end a command with one paragraph on stderr and no traceback (unless --debug):
- a command line jsonargparse rejects (exit 2), explained from the input's structure (lit_qlora.cli.usage).
- a user error raised by a command (exit 1): a `UserError` (lit_qlora.base.errors; every check of the user's input,
  files or machine raises one) or running out of memory. Any other exception is a bug: it keeps its traceback,
  after a line asking for a report.
"""

from __future__ import annotations

import inspect
import os
import shlex
import sys
from typing import Optional

import yaml
from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser, Namespace, set_parsing_settings

from lit_qlora.cli.usage import (Command, config_files,
                                 jsonargparse_message, spec_class, usage_error)
from lit_qlora.base import switches
from lit_qlora.base.errors import InvalidInput, UserError
from lit_qlora.base.quiet import debug_children, quiet_library_logs
from lit_qlora.train.signals import Interrupted, TrainingStopped


def commands() -> dict[str, Command]:
    # --help and argument errors must not wait seconds for torch and torchao (a test checks neither is imported):
    # a verb's module imports only light modules at its top, and the heavy ones inside the functions that use them,
    # when the command runs (after main() has quieted the loggers: torchao logs warnings while it is imported).
    # Names of heavy types in its annotations stay text (`from __future__ import annotations`), never imported in
    # an `if TYPE_CHECKING:` block: jsonargparse executes those blocks when it reads a signature.
    from lit_qlora.deploy.chat import chat_command
    from lit_qlora.export.gguf import export_gguf_command
    from lit_qlora.deploy.serve import serve_command
    from lit_qlora.checkpoint.download import download
    from lit_qlora.estimate.command import estimate
    from lit_qlora.eval.compare import compare
    from lit_qlora.eval.evaluate import evaluate
    from lit_qlora.export.hf import export_peft, merge
    from lit_qlora.methods import METHODS
    from lit_qlora.deploy.generate import generate_command
    from lit_qlora.export.gguf_import import convert_gguf_command

    return {
        **{method.verb: method.command for method in METHODS.values()},  # finetune, dpo, grpo, kto
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


# Errors a command raises whose message is the whole story for a user: only ours. A check of the user's flags,
# files, rows or machine raises a UserError (or a subclass: InvalidInput and MissingFile are a ValueError and a
# FileNotFoundError too); a bare ValueError, FileNotFoundError, ... is a bug of ours or a library's and keeps its
# traceback. Out-of-memory errors are user errors too (`lit_qlora.train.guards.is_oom`).
USER_ERRORS: tuple[type[Exception], ...] = (UserError,)


def is_user_error(error: Exception) -> bool:
    if isinstance(error, USER_ERRORS):
        return True
    from lit_qlora.train.guards import is_oom  # imports torch: asked only of errors not ours (a command's checks raise ours)

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


# -- running -----------------------------------------------------------------------------------------------------
def build_parser(table: dict[str, Command]) -> ArgumentParser:
    """One subcommand per verb, its options read from the function's typed signature and docstrings.

    exit_on_error=False: a bad command line raises ArgumentError (explained in one paragraph by `main`) instead of
    printing the whole usage; allow_abbrev=False: a typo must not silently become the option it abbreviates."""
    parser = ArgumentParser(prog="litqlora", description=DESCRIPTION, exit_on_error=False,
                            allow_abbrev=False)
    parser.add_argument("--version", action="version", version=version_text(),
                        help="Print lit-qlora's version and the LIT_QLORA_* switches in effect, and exit.")
    subcommands = parser.add_subcommands(required=True)
    for name, command in table.items():
        summary = inspect.getdoc(command).split("\n\n")[0].replace("\n", " ")
        sub = ArgumentParser(description=summary, exit_on_error=False, allow_abbrev=False)
        sub.add_argument("--config", action=ActionConfigFile,
                         help=COMPARE_CONFIG_HELP if name in RENAMED else CONFIG_HELP)
        spec = spec_class(command)
        if spec is not None:
            spec.add_arguments(sub)
        else:
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


def version_text() -> str:
    """`--version`: the version, then one line per LIT_QLORA_* switch set (docs/switches.md), or why one is refused."""
    try:
        set_now = switches.in_effect()
    except InvalidInput as e:
        return f"litqlora {installed_version()}\n{e}"
    return "\n".join([f"litqlora {installed_version()}", *(f"{name}={value}" for name, value in set_now.items())])


def run(parser: ArgumentParser, table: dict[str, Command], cfg: Namespace) -> None:
    init = parser.instantiate(cfg)  # dataclass groups become their dataclasses
    name = init.subcommand
    arguments = init[name]
    for option in ("config", "debug"):
        arguments.pop(option, None)
    spec = spec_class(table[name])
    if spec is not None:  # the spec is built once, here, and the verb passes it on
        table[name](spec(**arguments))
    else:
        table[name](**arguments)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # QLoRA dequantizes weights of many sizes into short-lived buffers; with fixed segments the CUDA caching
    # allocator reserved 15.6 GiB for an 8B step that allocated 6.8 GiB at its peak (H100). Read at the first CUDA
    # allocation, so setting it here is in time; a user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if argv[:1] == ["--version"]:  # here, not argparse's action, which would fold the switches onto one line
        print(version_text())
        sys.exit(0)
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
        switches.in_effect()  # a misspelt switch name or value is refused before any work
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
        if not is_user_error(e):  # a bug: the traceback is what its report needs
            print(f"litqlora: internal error: a bug in lit-qlora (or a library it uses); please report it with "
                  f"the command (litqlora {shlex.join(argv)}) and the traceback below.", file=sys.stderr)
            raise
        if debug:
            raise
        print(f"litqlora: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("litqlora: interrupted", file=sys.stderr)
        raise Interrupted(130) from None
    finally:
        restore()


if __name__ == "__main__":
    main()
