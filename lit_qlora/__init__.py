"""lit-qlora: QLoRA fine-tuning on Lightning (the `litqlora` command is lit_qlora/cli/; how the packages fit:
docs/architecture.md).

Here: the process settings that must precede torch, and `public_names`, with which each package names its public API."""

import importlib
import os
from typing import Any, Callable

# OpenMP workers spin ~0.3 ms for the next op before they sleep (libgomp's own ~3 ms; a short spin paid a wake-up
# per op), and lit_qlora.base.threads.ThreadGovernor hands cores back to any other busy process. libgomp reads the spin
# once, when torch loads it, hence here, before anything imports torch; a user's own GOMP_SPINCOUNT or
# OMP_WAIT_POLICY wins.
from lit_qlora.base.threads import set_openmp_spin

set_openmp_spin()

# Under an ISA cap (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA: lit_qlora.base.hardware.AVX2_ENV), torch.compile gets an
# inductor cache of its own: inductor's cache keys do not tell the capped process from the uncapped one, and a
# compiled SmolLM2-shaped step that reused the uncapped process's cached kernels gave NaN losses (tests/test_compile.py
# under the cap; the same tests pass with a fresh cache). A user's own TORCHINDUCTOR_CACHE_DIR wins.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    from lit_qlora.base.hardware import isa_cap_label

    _cap = isa_cap_label()
    if _cap:
        import getpass
        import tempfile

        try:
            _user = getpass.getuser()
        except (KeyError, OSError):  # no name for this uid (some containers)
            _user = str(os.getuid()) if hasattr(os, "getuid") else "user"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{_user}_{_cap}")


def public_names(package: str, **modules: str) -> tuple[Callable[[str], Any], list[str]]:
    """A package's `__getattr__` and `__all__` (PEP 562) for its public names, each imported from its module on first
    use: `public_names(__name__, sft="Sample pack")` makes `from PACKAGE import pack` import PACKAGE.sft then, so that
    importing one module of a package imports none of the others (nor torch, where that one needs none)."""
    where = {name: module for module, names in modules.items() for name in names.split()}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return __getattr__, list(where)
