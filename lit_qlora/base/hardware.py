"""The hardware a run lands on: whether the CPU computes bf16 and fp16 natively, what a CUDA device of a compute
capability computes in (which `--precision auto` reads: lit_qlora.base.precision), and the ISA caps that make any
x86 CPU behave like an AVX2-only one (tests, benchmarks, and a user reproducing a laptop's speed).

Without native bf16 a CPU emulates bf16 (and fp16) matmuls in oneDNN: on a 2-core AVX2-only EPYC a 1024x576x1536
linear ran at 43 GFLOPS in fp32, 7.7 in bf16, 9.1 in fp16, and the SmolLM2 QLoRA preset at 4.7 tok/s in bf16-true
against 59 in 32-true (benchmarks/README.md, "Every CPU"). A GPU without bf16 (T4, V100: compute capability < 8.0) has
fp16 tensor cores: fp16 compute with fp32 adapters and dynamic loss scaling (`16-mixed`) is what its users expect.

torch is imported inside the functions: the CLI's `--help` must not load it.
"""

from __future__ import annotations

import os

# oneDNN's ISA levels, oldest first, as ONEDNN_MAX_CPU_ISA names them (oneDNN's enum dnnl_cpu_isa_t). bf16 matmuls
# are native from AVX512_CORE_BF16 on (vdpbf16ps; AMX after it).
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
               "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "ALL")

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""The environment that caps a newer x86 CPU at AVX2, as many laptops and cloud VMs are: ATen's vectorized kernels
(ATEN_CPU_CAPABILITY) and oneDNN's matmuls (ONEDNN_MAX_CPU_ISA) both honour it, read once when torch loads, and so
do lit-qlora's C kernels (built with -march=x86-64-v3 under it). Set both before the process starts."""


def onednn_cap_variable() -> str:
    """The variable that caps oneDNN: ONEDNN_MAX_CPU_ISA, or its older name DNNL_MAX_CPU_ISA when only that is set."""
    return "DNNL_MAX_CPU_ISA" if os.environ.get("DNNL_MAX_CPU_ISA") and not os.environ.get("ONEDNN_MAX_CPU_ISA") \
        else "ONEDNN_MAX_CPU_ISA"


def onednn_cap() -> str | None:
    """The ISA oneDNN is capped at by the environment, upper-cased; None when uncapped."""
    value = os.environ.get(onednn_cap_variable(), "").strip()
    return value.upper() or None


def aten_cap() -> str | None:
    """ATEN_CPU_CAPABILITY, lower-cased (avx2, avx512, default...); None when unset."""
    value = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    return value or None


def onednn_capped_below(level: str) -> bool:
    """Whether ONEDNN_MAX_CPU_ISA caps oneDNN below `level` (one of ONEDNN_ISAS)."""
    cap = onednn_cap()
    return cap in ONEDNN_ISAS and ONEDNN_ISAS.index(cap) < ONEDNN_ISAS.index(level)


def aten_capped_below_avx512() -> bool:
    return aten_cap() in ("avx2", "default", "no_avx")


def avx2_capped() -> bool:
    """Whether the environment caps this process below AVX-512 (ATen or oneDNN)."""
    return aten_capped_below_avx512() or onednn_capped_below("AVX512_CORE")


def cpu_flags() -> dict[str, bool]:
    """The CPU's own feature flags as torch reads them (whatever the caps)."""
    import torch

    return torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}


def isa_cap_label() -> str:
    """A name for the ISA caps in the environment ("" when uncapped), e.g. "aten-avx2_onednn-AVX2"."""
    parts = [f"aten-{aten_cap()}" if aten_cap() else "", f"onednn-{onednn_cap()}" if onednn_cap() else ""]
    return "_".join(p for p in parts if p)


def cpu_native_bf16() -> tuple[bool, str]:
    """(whether bf16 matmuls run natively on this CPU as this process sees it, a short why)."""
    flags = [name for name, present in cpu_flags().items() if name in ("amx_bf16", "avx512_bf16") and present]
    if not flags:
        return False, "this CPU has no native bf16 (no AVX512-BF16 or AMX)"
    if onednn_capped_below("AVX512_CORE_BF16"):
        return False, f"{onednn_cap_variable()}={onednn_cap()} caps this CPU below native bf16"
    if aten_capped_below_avx512():
        return False, f"ATEN_CPU_CAPABILITY={aten_cap()} caps this CPU below native bf16"
    return True, f"this CPU has native bf16 ({'/'.join(flags)})"


def cpu_emulates(precision: str) -> str | None:
    """Why this CPU emulates `precision`'s matmuls (bf16 or fp16 without native support), else None."""
    if precision == "32-true":
        return None
    if precision.startswith("bf16"):
        native, why = cpu_native_bf16()
        return None if native else why
    caps = cpu_flags()
    if (caps.get("amx_fp16") or caps.get("avx512_fp16")) and not avx2_capped():
        return None
    return "this CPU has no native fp16 (no AVX512-FP16 or AMX-FP16)"


def cuda_precision(major: int, minor: int, name: str) -> tuple[str, str]:
    """What auto picks on a CUDA device of compute capability major.minor."""
    if (major, minor) >= (8, 0):
        return "bf16-true", f"{name} (compute capability {major}.{minor}) has bf16"
    return "16-mixed", (f"{name} (compute capability {major}.{minor}) has no bf16: fp16 compute, fp32 adapters, "
                        "dynamic loss scaling")


def uses_cuda(accelerator: str) -> bool:
    """Whether a run with this `--accelerator` runs on CUDA."""
    import torch

    if accelerator in ("cuda", "gpu"):
        return True
    return accelerator == "auto" and torch.cuda.is_available()
