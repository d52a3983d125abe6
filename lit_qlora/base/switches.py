"""Every `LIT_QLORA_*` environment variable: what it means, its type, its default, and the one place it is read.

The switches are for A/B measurements and for machines that need a workaround (a compiler, a cache directory);
a run's settings belong in its flags and config. Code asks `flag`, `choice`, `choice_list` or `text` here, never
`os.environ` itself, so each variable has one parser: an unknown value is refused with the variable named (a
misspelt value never measures the default unnoticed). `in_effect` lists what is set, for summary.json and
`litqlora --version`, and refuses a `LIT_QLORA_*` name that is not in `SWITCHES` (a misspelt name would be the
default silently). docs/switches.md lists them all (tests/test_switches.py checks it against `SWITCHES`).

Read at each use, not cached: a benchmark may flip a switch in-process. No torch here: the package root imports
this before torch loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from lit_qlora.base.errors import InvalidInput

PREFIX = "LIT_QLORA_"


@dataclass(frozen=True)
class Switch:
    """One environment variable. `kind`: `flag` (on/off), `choice` (one of `choices`), `choices` (a comma list of
    them) or `text` (free: a path, compiler flags, a key). `default`: what unset means, in words for `text`."""

    name: str
    kind: str
    default: str
    meaning: str
    choices: tuple[str, ...] = ()
    secret: bool = False


SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("LIT_QLORA_API_KEY", "text", "none: the /v1 routes are open",
           "`litqlora serve`'s key when `--api_key` is not given: every /v1 route requires `Authorization: Bearer "
           "KEY`.", secret=True),
    Switch("LIT_QLORA_CC", "text", "gcc, else cc, from PATH",
           "The C compiler that builds the CPU kernels (NF4 dequantize and decode, LoRA dropout)."),
    Switch("LIT_QLORA_CFLAGS", "text", "none", "Extra compiler flags for the CPU kernels (e.g. for debugging)."),
    Switch("LIT_QLORA_KERNEL_CACHE", "text", "$XDG_CACHE_HOME/lit_qlora/kernels (~/.cache/...)",
           "Where the built CPU kernels are cached, keyed by source, compiler, flags and CPU."),
    Switch("LIT_QLORA_COMPILE_MODE", "choice", "torch.compile's default",
           "torch.compile's `mode` for every block under `--train.compile true`.",
           ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")),
    Switch("LIT_QLORA_DECODE_BACKEND", "text", "inductor",
           "torch.compile's backend for GRPO's compiled decode step (the tests trace with aot_eager)."),
    Switch("LIT_QLORA_DROPOUT_REPLAY", "flag", "1",
           "CUDA LoRA dropout saves the RNG state and redraws its mask in backward (0: nn.Dropout, which saves it)."),
    Switch("LIT_QLORA_FLEX_ATTENTION", "flag", "on CUDA with Triton",
           "flex_attention for full-sequence forwards that need a mask or a soft cap (0: the dense SDPA paths)."),
    Switch("LIT_QLORA_SDPA_BACKEND", "choices", "PyTorch's choice",
           "The SDPA kernels attention may use, in order of preference (a comma list).",
           ("flash", "cudnn", "efficient", "math")),
    Switch("LIT_QLORA_LORA_GROUPED", "flag", "0",
           "Where a block's projections cannot be fused, one grouped matmul computes their LoRA terms."),
    Switch("LIT_QLORA_NF4_BACKEND", "choice", "auto",
           "CPU NF4 kernels: `auto` builds and checks the C kernels, `eager` uses PyTorch ops only.",
           ("auto", "eager")),
    Switch("LIT_QLORA_NF4_TRITON", "flag", "1",
           "The Triton NF4 dequantize on CUDA (0: the PyTorch path in 16M-value slices)."),
    Switch("LIT_QLORA_NF4_FUSED", "flag", "0",
           "NF4 linears compute their products with the dequantize fused in (Triton), no dense weight."),
    Switch("LIT_QLORA_NF4_GEMV", "flag", "1",
           "CPU decode (a few rows, no gradient) multiplies by the NF4 codes directly, no dense weight; a bf16 tied "
           "head reads its weight with the dense bf16 kernel; a Llama-style NF4 model's decode step runs in one C "
           "call (model/decode_step.c); on CUDA a decode step's NF4 product is the few-row Triton kernel "
           "(nf4/triton_rows.py). 0: all four off."),
    Switch("LIT_QLORA_NF4_SAVE_DENSE", "flag", "0",
           "NF4 linears save the dense weight for backward instead of redoing the dequantize (memory for time)."),
    Switch("LIT_QLORA_NF4_SCRATCH", "flag", "1",
           "NF4 linears dequantize into one reused buffer per thread instead of a fresh tensor per call."),
)}


def _switch(name: str) -> Switch:
    if name not in SWITCHES:  # a programming error: every read names a listed switch
        raise KeyError(f"{name} is not a lit-qlora switch (lit_qlora/base/switches.py lists them)")
    return SWITCHES[name]


def _raw(s: Switch, environ: Optional[Mapping[str, str]] = None) -> str:
    return (os.environ if environ is None else environ).get(s.name, "").strip()


def _refuse(s: Switch, value: str, accepted: str) -> InvalidInput:
    return InvalidInput(f"{s.name}={value!r}: this switch takes {accepted}; unset, it is {s.default}. What it does: "
                        f"{s.meaning} Fix the value or unset the variable (docs/switches.md lists every switch).")


def flag(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    """An on/off switch: True (1), False (0), None when unset or empty (the caller's default, which may depend on
    the device). Nothing else: "true" or "off" are refused, not read as the default."""
    s = _switch(name)
    value = _raw(s, environ)
    if s.kind != "flag":
        raise KeyError(f"{name} is a {s.kind} switch, not a flag")
    if not value:
        return None
    if value in ("0", "1"):
        return value == "1"
    raise _refuse(s, value, "1 (on) or 0 (off)")


def enabled(name: str) -> bool:
    """An on/off switch with its listed default (1 or 0) when unset."""
    value = flag(name)
    return SWITCHES[name].default == "1" if value is None else value


def choice(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A one-of switch, lower-cased; None when unset."""
    s = _switch(name)
    value = _raw(s, environ).lower()
    if value and value not in s.choices:
        raise _refuse(s, value, "one of " + ", ".join(s.choices))
    return value or None


def choice_list(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[list[str]]:
    """A comma-list switch, in its order; None when unset."""
    s = _switch(name)
    value = _raw(s, environ).lower()
    names = [n.strip() for n in value.split(",") if n.strip()]
    if unknown := [n for n in names if n not in s.choices]:
        raise _refuse(s, value, f"a comma list of {', '.join(s.choices)} (not {', '.join(unknown)})")
    return names or None


def text(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A free-text switch (a path, flags, a key); None when unset or empty."""
    return _raw(_switch(name), environ) or None


def check(name: str, environ: Optional[Mapping[str, str]] = None) -> None:
    """Parse `name` as its kind does (refusing a bad value)."""
    kind = _switch(name).kind
    {"flag": flag, "choice": choice, "choices": choice_list, "text": text}[kind](name, environ)


def in_effect(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Every switch set in the environment, each checked (a secret's value is shown as `set`); a `LIT_QLORA_*`
    variable that is no switch is refused with the list of those that are."""
    env = os.environ if environ is None else environ
    found = {k: v for k, v in env.items() if k.startswith(PREFIX) and v.strip()}
    if unknown := sorted(k for k in found if k not in SWITCHES):
        raise InvalidInput(f"{', '.join(unknown)}: no lit-qlora switch has this name, so it would change nothing. "
                           f"The switches are {', '.join(SWITCHES)} (docs/switches.md); fix the name or unset it.")
    for name in found:
        check(name, env)
    return {k: ("set" if SWITCHES[k].secret else v.strip()) for k, v in sorted(found.items())}
