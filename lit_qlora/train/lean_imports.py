"""Import the training stack without the libraries a fine-tune never calls: transformers, matplotlib, scipy.

They are installed (matplotlib draws `litqlora compare`'s report, transformers is the tests' reference, scipy comes
with lm-eval's dependencies), and because they are, `import lightning` loads all three, ~215 MiB of a fine-tune's
RSS (benchmarks/README.md, "Lean process"). The chain: lightning.fabric.utilities.imports checks torchmetrics'
version by importing it, and torchmetrics/__init__ imports

- scipy: `if package_available("scipy"): import scipy.signal` (a compatibility patch for an audio metric);
- matplotlib: torchmetrics.utilities.plot, `if _MATPLOTLIB_AVAILABLE` (for Metric.plot);
- transformers: torchmetrics.functional.text.bert and .text.bert, `if _TRANSFORMERS_GREATER_EQUAL_4_4` (BERTScore).

Lightning needs torchmetrics (its logging and LightningModule use torchmetrics.Metric), not those metrics. Both
checks (lightning_utilities' `package_available` and `RequirementCache`) ask the import system: `find_spec`, and
`importlib.metadata.version` for the installed version. While `lean_imports()` is open, a finder first on
`sys.meta_path` answers both for the three packages as "not installed" (ModuleNotFoundError from find_spec,
PackageNotFoundError from a named metadata lookup, the documented protocols: importlib's "Import system" and
importlib.metadata's "Extending the search algorithm"), so torchmetrics imports without them, as it does where they
are not installed. When the block ends the finder is gone: the packages import normally again (`litqlora evaluate`,
or a test in the same process). What stays: the checks evaluated inside keep their answer (torchmetrics' BERTScore,
plotting and scipy-based metrics stay unavailable in this process; lit-qlora uses none), and a package already
imported is left alone (there is nothing to save).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.abc import MetaPathFinder
from importlib.metadata import PackageNotFoundError

UNUSED = ("transformers", "matplotlib", "scipy")


class HidePackages(MetaPathFinder):
    """A `sys.meta_path` finder for which `packages` (top-level names, also their distribution names) are not
    installed: no module spec, no distribution metadata. Everything else goes on to the next finders."""

    def __init__(self, packages: tuple[str, ...]) -> None:
        self.packages = frozenset(packages)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.packages:
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden by lit_qlora.train.lean_imports)",
                                      name=fullname)
        return None

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)  # None: a listing of every distribution (entry points): not ours to edit
        if name and name.lower().replace("-", "_") in self.packages:
            raise PackageNotFoundError(name)
        return iter(())


@contextmanager
def lean_imports(packages: tuple[str, ...] = UNUSED) -> Iterator[None]:
    """Imports inside the block see `packages` as not installed (those already imported are left as they are)."""
    finder = HidePackages(tuple(p for p in packages if p not in sys.modules))
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
