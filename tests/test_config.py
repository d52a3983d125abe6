"""The one precision/dtype table and the typed quantize choice in lit_qlora.model.config: consistent views, the only
such table in the package, and the CLI verbs offer exactly its values."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import torch

import lit_qlora
from lit_qlora.base.precision import (ADAPTER_DTYPES, DTYPE_NAMES, DTYPES, LOSS_SCALED_PRECISIONS, MIXED_PRECISIONS,
                                      PRECISION_ALIASES, PRECISION_DTYPES, Precision, PrecisionChoice)
from lit_qlora.model.config import Quantize


def test_views_of_the_table_agree():
    assert PRECISION_DTYPES == {"bf16-true": torch.bfloat16, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16,
                                "16-true": torch.float16, "32-true": torch.float32}
    # the mixed ones: a bf16 or fp16 base and compute, fp32 adapters (and so AdamW state); fp16's is loss-scaled
    assert ADAPTER_DTYPES == {**PRECISION_DTYPES, "bf16-mixed": torch.float32, "16-mixed": torch.float32}
    assert MIXED_PRECISIONS == {"bf16-mixed", "16-mixed"} and LOSS_SCALED_PRECISIONS == {"16-mixed"}
    assert DTYPES == {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    assert DTYPE_NAMES == {dtype: name for name, dtype in DTYPES.items()}
    assert typing.get_args(Precision) == tuple(PRECISION_DTYPES)
    # what --precision takes (lit_qlora.base.hardware, light: no torch) is auto, a row of the table or Lightning's alias
    # of one
    assert typing.get_args(PrecisionChoice) == ("auto", *PRECISION_DTYPES, *PRECISION_ALIASES)
    assert set(PRECISION_ALIASES.values()) <= set(PRECISION_DTYPES)
    assert [q.value for q in Quantize] == ["nf4", "none"]


def test_no_other_module_keeps_its_own_dtype_table():
    """A dict literal from a precision or dtype name to a torch dtype (or back) exists only in config.py."""
    package = Path(lit_qlora.__file__).parent
    pattern = re.compile(r"""["'](bf16-true|16-true|32-true|bfloat16|float16|float32)["']\s*:\s*torch\.|"""
                         r"""torch\.(bfloat16|float16|float32)\s*:\s*["']""")
    found = [f"{path.relative_to(package)}:{n}" for path in sorted(package.rglob("*.py")) if path.name != "config.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


@pytest.mark.parametrize("verb", ["finetune", "generate", "evaluate", "merge"])
def test_cli_verbs_offer_the_tables_values(verb):
    """The verbs keep their Literal flags (the CLI contract); their choices are the table's and the enum's."""
    from lit_qlora.cli import commands
    from lit_qlora.cli.usage import spec_class

    command = commands()[verb]
    hints = typing.get_type_hints(spec_class(command) or command)  # a run spec's fields are its verb's flags
    literals = {name: next((a for a in [hint, *typing.get_args(hint)] if typing.get_origin(a) is typing.Literal), None)
                for name, hint in hints.items() if name in ("quantize", "precision")}
    assert typing.get_args(literals["quantize"]) == tuple(q.value for q in Quantize)
    if "precision" in literals:
        assert typing.get_args(literals["precision"]) == ("auto", *PRECISION_DTYPES, *PRECISION_ALIASES)
