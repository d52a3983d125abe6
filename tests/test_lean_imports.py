"""lit_qlora.train.lean_imports: inside the block the hidden packages are not installed, for both of the checks
Lightning and torchmetrics make; after it, they import as before. (A whole fine-tune: tests/test_cli.py.)"""

import subprocess
import sys

import pytest

CHECK = """
import importlib, importlib.metadata, importlib.util
from lightning_utilities.core.imports import RequirementCache
from lit_qlora.train.lean_imports import lean_imports

def absent():
    try:
        importlib.metadata.version("matplotlib")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        raise AssertionError("matplotlib's metadata is visible")
    try:
        importlib.import_module("matplotlib.pyplot")
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("matplotlib imported")
    try:
        importlib.util.find_spec("matplotlib")
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("matplotlib found")
    assert not RequirementCache("matplotlib") and not RequirementCache("matplotlib>=3")
    assert RequirementCache("torch>=2") and importlib.metadata.version("jinja2")  # the others are untouched

with lean_imports(("matplotlib",)):
    absent()
assert importlib.metadata.version("matplotlib") and RequirementCache("matplotlib>=3")
import matplotlib.pyplot
import sys
assert "matplotlib" in sys.modules
print("OK")
"""


def test_hidden_inside_the_block_and_importable_after_it():
    pytest.importorskip("lightning_utilities")
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr


def test_a_package_already_imported_is_left_alone():
    """There is nothing to save, and hiding its metadata would contradict the module everyone already holds."""
    import importlib.metadata

    import torch

    from lit_qlora.train.lean_imports import lean_imports

    with lean_imports(("torch",)):
        assert importlib.metadata.version("torch") == torch.__version__
