"""`litqlora` entry point: jsonargparse subcommands over plain functions; help text comes from their docstrings."""

from __future__ import annotations

import logging
import os
import sys
import warnings


def commands() -> dict:
    from lit_qlora.download import download
    from lit_qlora.eval.compare import compare
    from lit_qlora.evaluate import evaluate
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
    return (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, RuntimeError)


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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("LITQLORA_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    if not debug:
        quiet_library_logs()
    from jsonargparse import auto_cli, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # dataclass field docstrings become --help

    try:
        auto_cli(commands(), args=expand_positional(argv), as_positional=False, config_help=CONFIG_HELP)
    except user_errors() as e:
        if debug:
            raise
        print(f"litqlora: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("litqlora: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
