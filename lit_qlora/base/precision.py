"""Precision, in one home: the names a run computes in (Lightning's), what `--precision` accepts, each one's dtypes
(the base and compute, the adapters and AdamW state, the name our files record), and `auto` resolved for the device
a run lands on, with why (lit_qlora.base.hardware reads the CPU and its ISA caps).

Who resolves `auto`: a training run's `decide()` (lit_qlora.train.spec) and an inference command's `ModelChoice`
(lit_qlora.deploy.choice), once each; everything downstream (the loader, the NF4 plugin) takes a concrete name.

Light at import: the dtype tables (`PRECISION_DTYPES` and the rest) are torch dtypes, built on first use (the module's
`__getattr__`), so the CLI reads `PrecisionChoice` for `--help` without loading torch.
"""

from __future__ import annotations

from typing import Any, Literal

from lit_qlora.base.hardware import cpu_native_bf16, cuda_precision, uses_cuda

PRECISIONS = ("bf16-true", "bf16-mixed", "16-mixed", "16-true", "32-true")
"""The precisions a run computes in (Lightning's names): the registry that `--precision`'s choices, its help, the
dtype table below (one row each) and `choose_precision` read. A new one is a name here and a row there."""

PRECISION_ALIASES = {"bf16": "bf16-mixed", "16": "16-mixed", "32": "32-true"}
"""Lightning's short names and what they mean there (and here)."""

PrecisionChoice = Literal[("auto", *PRECISIONS, *PRECISION_ALIASES)]  # type: ignore[valid-type]
"""What `--precision` accepts: auto, one of Lightning's names, or one of Lightning's short aliases (PRECISION_ALIASES)."""

Precision = Literal[PRECISIONS]  # type: ignore[valid-type]
"""A resolved precision (what `--precision auto` becomes: `choose_precision`)."""

PRECISION_NEAREST = {"64": "32-true", "64-true": "32-true", "double": "32-true", "fp32": "32-true",
                     "float32": "32-true", "fp16": "16-mixed", "float16": "16-mixed", "half": "16-mixed",
                     "bfloat16": "bf16-true", "bf16-true-mixed": "bf16-mixed", "transformer-engine": "bf16-true",
                     "transformer-engine-float16": "16-mixed"}
"""Names users type that lit-qlora does not take, and the nearest it does (a base in fp64 or Transformer Engine's FP8
is not something QLoRA computes in)."""

# The one precision/dtype table: the precision, the dtype of the base and the compute (its name in our files:
# adapter_config.json's base_dtype / lora_dtype, `convert_gguf --dtype`), the adapters' and AdamW state's dtype.
# Everything below is a view of it. (`auto` is not a row: `choose_precision` resolves it to one.)
_TABLE = (
    ("bf16-true", "bfloat16", "bfloat16"),
    ("bf16-mixed", "bfloat16", "float32"),  # bf16 compute, fp32 adapters and AdamW state
    ("16-mixed", "float16", "float32"),  # fp16 compute, fp32 adapters and AdamW state
    ("16-true", "float16", "float16"),
    ("32-true", "float32", "float32"),
)
assert tuple(row[0] for row in _TABLE) == PRECISIONS

MIXED_PRECISIONS = frozenset(p for p, compute, adapters in _TABLE if compute != adapters)
"""Precisions whose trainable weights (and AdamW state) are fp32 over a narrower base and compute."""
LOSS_SCALED_PRECISIONS = frozenset(p for p, compute, _ in _TABLE if p in MIXED_PRECISIONS and compute == "float16")
"""Mixed precisions that train with dynamic loss scaling: fp16's range needs it, bf16's does not."""
DTYPE_NAMES_IN_FILES = tuple(dict.fromkeys(compute for _, compute, _ in _TABLE))
"""The dtype names our files record (bfloat16, float16, float32)."""


def _dtype_tables() -> dict[str, Any]:
    import torch

    dtype = {name: getattr(torch, name) for name in DTYPE_NAMES_IN_FILES}
    return {
        "PRECISION_DTYPES": {p: dtype[compute] for p, compute, _ in _TABLE},  # the base's and the compute's
        "ADAPTER_DTYPES": {p: dtype[adapters] for p, _, adapters in _TABLE},  # the adapters' and AdamW state's
        "DTYPES": dtype,  # a name in our files -> its dtype
        "DTYPE_NAMES": {d: name for name, d in dtype.items()},
    }


_tables: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """PRECISION_DTYPES, ADAPTER_DTYPES, DTYPES and DTYPE_NAMES, built (importing torch) on first use."""
    if name in ("PRECISION_DTYPES", "ADAPTER_DTYPES", "DTYPES", "DTYPE_NAMES"):
        if not _tables:
            _tables.update(_dtype_tables())
        return _tables[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def choose_precision(precision: str, accelerator: str = "auto") -> tuple[str, str]:
    """(the precision a run uses, why): an explicit choice wins; `auto` looks at the device the run lands on."""
    if precision in PRECISION_ALIASES:
        return PRECISION_ALIASES[precision], f"--precision {precision}, Lightning's short name for it"
    if precision != "auto":
        return precision, "given with --precision"
    if uses_cuda(accelerator):
        import torch

        major, minor = torch.cuda.get_device_capability()
        chosen, why = cuda_precision(major, minor, torch.cuda.get_device_name())
        return chosen, f"auto: {why}"
    native, why = cpu_native_bf16()
    if native:
        return "bf16-true", f"auto: {why}"
    return "32-true", f"auto: {why}, so bf16 would be emulated (~5-10x slower than fp32)"


def resolved(precision: str, accelerator: str = "auto") -> str:
    """`choose_precision` without the why."""
    return choose_precision(precision, accelerator)[0]
