"""`litqlora` entry point: jsonargparse subcommands over plain functions; help text comes from their docstrings."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import os
import re
import sys
import warnings

from lit_qlora.train.signals import TrainingStopped


def commands() -> dict:
    from lit_qlora.download import download
    from lit_qlora.eval.compare import compare
    from lit_qlora.eval.evaluate import evaluate
    from lit_qlora.export import export_peft, merge
    from lit_qlora.finetune import finetune
    from lit_qlora.generate import generate_command
    from lit_qlora.gguf_import import convert_gguf_command

    return {
        "finetune": finetune,
        "download": download,
        "convert_gguf": convert_gguf_command,
        "generate": generate_command,
        "merge": merge,
        "export_peft": export_peft,
        "evaluate": evaluate,
        "compare": compare,
    }


# Errors whose message is the whole story for a user: print it, exit 1, no traceback (unless --debug).
def user_errors() -> tuple[type[BaseException], ...]:
    # RuntimeError includes torch.OutOfMemoryError; FloatingPointError is a non-finite loss or gradient.
    return (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, RuntimeError, FloatingPointError)


def quiet_library_logs() -> None:
    # torchao warns at import about CUDA-only kernels it cannot load on CPU, torch about a pytree
    # deprecation inside torchao: neither concerns NF4, and both would bury our output.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # Lightning advertises a cloud logger, warns about its own use of a deprecated pytree API, and about the
    # validation_step we run only through trainer.validate (fit gets no val loader on purpose).
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: "litlogger" not in record.getMessage())
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=r".*defined a `validation_step` but have no `val_dataloader`.*")


# Commands whose first argument may be given bare (`litqlora download REPO_ID`); every other argument is a flag.
POSITIONAL = {"download": "repo_id", "convert_gguf": "file"}


# compare's --config is a fine-tune recipe, not compare's own arguments: jsonargparse reserves the name
# `config`, so the parameter is `recipe` and --config is renamed to it.
RENAMED = {"compare": {"--config": "--recipe"}}


CONFIG_HELP = "A YAML file of this command's arguments (compare: a `litqlora finetune` recipe, see --recipe)."


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


def debug_requested(argv: list[str]) -> bool:
    """--debug on the command line, LITQLORA_DEBUG=1, or `debug: true` in a --config file."""
    if "--debug" in argv or os.environ.get("LITQLORA_DEBUG") == "1":
        return True
    import yaml

    for file in config_files(argv):
        try:
            with open(file, encoding="utf-8") as f:
                config = yaml.safe_load(f)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # the parser reports it
        if isinstance(config, dict) and config.get("debug") is True:
            return True
    return False


def option_names(command) -> list[str]:
    """Every option of a command, nested dataclass fields as `group.field`."""
    names = ["config", "print_config"]
    for name, param in inspect.signature(command).parameters.items():
        default = param.default
        if dataclasses.is_dataclass(default):
            names += [f"{name}.{f.name}" for f in dataclasses.fields(default)]
        else:
            names.append(name)
    return names


def usage_error(message: str, argv: list[str]) -> str:
    """One paragraph for a jsonargparse error: the bad key or value, the closest valid option, where to look."""
    message = " ".join(message.split())
    name = argv[0] if argv and argv[0] in commands() else None
    prefix = f"{name}: " if name else ""
    help_hint = f"`litqlora {name} --help`" if name else "`litqlora --help`"
    group = re.search(r"Group '([\w.]+)' does not accept option '([\w.]+)'", message)
    unknown = ([f"{group[1]}.{group[2]}"] if group else
               re.findall(r"does not accept option '([\w.]+)'", message) or
               [a[2:].partition("=")[0] for a in re.findall(r"--[\w.=-]+", message.partition("unrecognized arguments:")[2])])
    if name and unknown and ("does not accept option" in message or "unrecognized arguments" in message):
        key = unknown[0]
        on_command_line = any(a == f"--{key}" or a.startswith(f"--{key}=") for a in argv)
        where = "" if on_command_line or not config_files(argv) else f" in {', '.join(config_files(argv))}"
        close = difflib.get_close_matches(key, option_names(commands()[name]), n=1, cutoff=0.6)
        suggestion = f"; did you mean `{close[0]}`?" if close else "."
        return f"{prefix}unknown option `{key}`{where}{suggestion} {help_hint} lists every option."
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        close = difflib.get_close_matches(choice[1], list(commands()), n=1)
        suggestion = f" Did you mean `{close[0]}`?" if close else ""
        return f"unknown command {choice[1]!r}: the commands are {choice[2]}.{suggestion}"
    if message.startswith(("Problems parsing config", "Unexpected config")) and config_files(argv):
        message = f"{', '.join(config_files(argv))} is not a valid YAML mapping of options: {message}"
    message = re.sub(r'Parser key "([\w.]+)":', r"--\1:", message)
    union = re.search(r"Union subtypes.*?Errors: (.*) Given value type: .* Given value: (.*)$", message)
    if union:  # jsonargparse lists each subtype's failure: keep the expected types and the value
        expected = " or ".join(re.findall(r"Expected an? ([^-]+?)(?= -|$)", union[1]))
        message = f"{message.partition(' Does not')[0]} expected {expected}, got {union[2]!r}"
    message = re.sub(r"<class '(\w+)'>", r"\1", message).replace(' in "<unicode string>",', "")
    return f"{prefix}{message.rstrip('.')}. {help_hint} lists every option."


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    if not debug:
        quiet_library_logs()
    from jsonargparse import ArgumentError, auto_cli, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # dataclass field docstrings become --help

    argv = expand_positional(argv)
    try:
        # exit_on_error=False: a bad option raises ArgumentError (printed below as one paragraph) instead of
        # printing the whole usage.
        auto_cli(commands(), args=argv, as_positional=False, config_help=CONFIG_HELP, exit_on_error=False,
                 allow_abbrev=False)  # a typo must not silently become the option it abbreviates
    except ArgumentError as e:
        if debug:
            raise
        print(f"litqlora: error: {usage_error(str(e), argv)}", file=sys.stderr)
        sys.exit(2)
    except TrainingStopped as e:
        print(f"litqlora: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except user_errors() as e:
        if debug:
            raise
        print(f"litqlora: error: {e}", file=sys.stderr)
        sys.exit(1)
    except MemoryError:
        if debug:
            raise
        print("litqlora: error: out of CPU memory. Free memory, or load the base as NF4 (--quantize nf4).",
              file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("litqlora: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
