"""`CommandSpec`: a command's options as one typed dataclass. The CLI offers its fields as the command's flags, at
the top level (`--checkpoint_dir`, `--lora.r`; their attribute docstrings are `--help`), builds it once from flags and
YAML and hands it to the command; Python callers pass one, or its fields as keywords.

Subclasses: lit_qlora.train.spec.RunSpec (every training verb's), lit_qlora.deploy.choice.ModelChoice (which model
generate, chat, serve and evaluate run).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, Optional


@dataclass
class CommandSpec:
    """The behaviour a command's options dataclass shares (a dataclass without fields: jsonargparse builds the
    nested groups of a dataclass whose bases are all dataclasses)."""

    cli_skip: ClassVar[frozenset[str]] = frozenset()
    """Fields a command does not offer as flags (they keep their defaults), e.g. dpo's tensor_parallel."""

    @classmethod
    def of(cls, spec: Optional[Any], settings: dict[str, Any]) -> Any:
        """A command's spec from what its caller gave: a spec, or its fields as keywords (`finetune(out_dir=...)`,
        as Python callers and the tests write it), not both."""
        if spec is None:
            return cls(**settings)
        if settings:
            raise TypeError(f"pass a {cls.__name__} or its fields as keywords, not both (got {sorted(settings)})")
        return spec

    @classmethod
    def add_arguments(cls, parser: Any) -> None:
        """This spec's fields as a jsonargparse parser's options, at the top level (`--out_dir`, `--lora.r`)."""
        parser.add_class_arguments(cls, nested_key=None, as_group=False, skip=set(cls.cli_skip), sub_configs=True,
                                   fail_untyped=False)

    @classmethod
    def cli_fields(cls) -> list[Any]:
        """The dataclass fields a user can set from the command line or a YAML file."""
        return [f for f in fields(cls) if f.name not in cls.cli_skip]  # type: ignore[arg-type]

    @classmethod
    def required_fields(cls) -> list[str]:
        """The fields without a default: the command's required flags."""
        return [f.name for f in cls.cli_fields() if f.default is MISSING and f.default_factory is MISSING]
