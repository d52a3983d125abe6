"""lit_qlora.base.hardware: what `--precision auto` picks on each class of hardware (faked), and the AVX2 cap (real)."""

import json
import platform
import subprocess
import sys

import pytest
import torch

from lit_qlora.base import hardware
from lit_qlora.estimate.command import estimate_precision
from lit_qlora.base.hardware import AVX2_ENV
from lit_qlora.base.precision import choose_precision


def fake_cuda(monkeypatch, capability, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)


def fake_cpu(monkeypatch, **flags):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    caps = {"avx2": True, "avx512_bf16": False, "amx_bf16": False, **flags}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("capability, name, expected", [
    ((9, 0), "NVIDIA H100", "bf16-true"),
    ((8, 0), "NVIDIA A100", "bf16-true"),
    ((8, 6), "NVIDIA GeForce RTX 3090", "bf16-true"),
    ((7, 5), "Tesla T4", "16-mixed"),
    ((7, 0), "Tesla V100", "16-mixed"),
])
def test_auto_on_cuda_is_bf16_from_ampere_on_and_16_mixed_before(monkeypatch, capability, name, expected):
    fake_cuda(monkeypatch, capability, name)
    for accelerator in ("auto", "cuda", "gpu"):
        chosen, why = choose_precision("auto", accelerator)
        assert chosen == expected
        assert name in why and f"{capability[0]}.{capability[1]}" in why


def test_auto_on_cpu_is_bf16_only_with_native_bf16(monkeypatch):
    fake_cpu(monkeypatch, avx512_bf16=True)
    assert choose_precision("auto", "auto") == ("bf16-true", "auto: this CPU has native bf16 (avx512_bf16)")
    fake_cpu(monkeypatch, amx_bf16=True)
    assert choose_precision("auto", "cpu")[0] == "bf16-true"
    fake_cpu(monkeypatch)  # AVX2 only (or AVX-512 without BF16)
    chosen, why = choose_precision("auto", "cpu")
    assert chosen == "32-true" and "no native bf16" in why and "emulated" in why


@pytest.mark.parametrize("variable, value", [("ONEDNN_MAX_CPU_ISA", "AVX2"), ("ONEDNN_MAX_CPU_ISA", "avx512_core"),
                                             ("DNNL_MAX_CPU_ISA", "AVX2_VNNI"), ("ATEN_CPU_CAPABILITY", "avx2")])
def test_an_isa_cap_below_native_bf16_means_32_true_on_a_bf16_cpu(monkeypatch, variable, value):
    fake_cpu(monkeypatch, avx512_bf16=True)
    monkeypatch.setenv(variable, value)
    chosen, why = choose_precision("auto", "cpu")
    assert chosen == "32-true" and variable in why


@pytest.mark.parametrize("value", ["AVX512_CORE_BF16", "AVX10_1_512_AMX", "ALL"])
def test_a_cap_at_or_above_native_bf16_keeps_bf16(monkeypatch, value):
    fake_cpu(monkeypatch, avx512_bf16=True)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", value)
    assert choose_precision("auto", "cpu")[0] == "bf16-true"


def test_an_explicit_precision_wins_everywhere(monkeypatch):
    fake_cuda(monkeypatch, (7, 5), "Tesla T4")
    assert choose_precision("bf16-true", "auto") == ("bf16-true", "given with --precision")
    fake_cpu(monkeypatch)
    assert choose_precision("16-mixed", "cpu")[0] == "16-mixed"


def test_a_cpu_run_on_a_cuda_machine_uses_the_cpu_rule(monkeypatch):
    fake_cuda(monkeypatch, (7, 5), "Tesla T4")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})
    assert choose_precision("auto", "cpu")[0] == "32-true"


def test_the_estimate_assumes_an_ampere_gpu_for_cuda_and_says_so(monkeypatch):
    fake_cpu(monkeypatch)  # the machine running the estimate does not matter for a cuda target
    chosen, why = estimate_precision("auto", "cuda")
    assert chosen == "bf16-true" and "compute capability >= 8.0" in why and "16-mixed" in why
    assert estimate_precision("auto", "cpu")[0] == "32-true"
    assert estimate_precision("16-mixed", "cuda")[0] == "16-mixed"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 ISA cap")
def test_the_avx2_environment_caps_aten_and_the_auto_choice(tmp_path):
    """The real thing, in a fresh process (both caps are read when torch loads): ATen reports AVX2, auto picks
    32-true, and a bf16 matmul runs much slower than fp32 (oneDNN emulates it) where the CPU has native bf16."""
    script = """
import json, time, torch
from lit_qlora.base.hardware import avx2_capped
from lit_qlora.base.precision import choose_precision
def gflops(dtype):
    a, b = torch.randn(512, 576).to(dtype), torch.randn(1536, 576).to(dtype)
    for _ in range(3): a @ b.T
    t = time.perf_counter()
    for _ in range(10): a @ b.T
    return 2 * 512 * 576 * 1536 * 10 / (time.perf_counter() - t) / 1e9
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "auto": choose_precision("auto", "cpu"),
                  "capped": avx2_capped(), "fp32": gflops(torch.float32), "bf16": gflops(torch.bfloat16)}))
"""
    env = {k: v for k, v in __import__("os").environ.items() if k not in AVX2_ENV}
    out = subprocess.run([sys.executable, "-c", script], env={**env, **AVX2_ENV}, capture_output=True, text=True,
                         check=True, timeout=300)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["capability"] == "AVX2" and got["capped"] is True
    assert got["auto"][0] == "32-true"
    if hardware.cpu_native_bf16()[0]:  # on this (uncapped) CPU bf16 is native: capped, oneDNN must emulate it
        assert got["bf16"] < got["fp32"], got


def test_a_capped_process_gets_an_inductor_cache_of_its_own(tmp_path):
    """Inductor's cache keys do not tell a capped process from an uncapped one, and a compiled step reusing the
    uncapped kernels gave NaN losses: `import lit_qlora` points a capped process at its own cache (a user's own
    TORCHINDUCTOR_CACHE_DIR wins)."""
    code = "import os, lit_qlora; print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))"
    env = {k: v for k, v in __import__("os").environ.items() if k not in (*AVX2_ENV, "TORCHINDUCTOR_CACHE_DIR")}

    def cache_dir(**extra):
        return subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert cache_dir() == "None"  # uncapped: inductor's own default
    capped = cache_dir(**AVX2_ENV)
    assert capped.endswith("_aten-avx2_onednn-AVX2") and "torchinductor_" in capped
    assert cache_dir(**AVX2_ENV, TORCHINDUCTOR_CACHE_DIR=str(tmp_path)) == str(tmp_path)


def test_the_precision_registry_is_what_the_cli_the_table_and_auto_read():
    import typing

    from lit_qlora.base import precision

    assert list(precision.PRECISION_DTYPES) == list(precision.PRECISIONS)  # one dtype row per precision
    assert list(precision.ADAPTER_DTYPES) == list(precision.PRECISIONS)
    assert typing.get_args(precision.Precision) == precision.PRECISIONS
    assert typing.get_args(precision.PrecisionChoice) == ("auto", *precision.PRECISIONS, *precision.PRECISION_ALIASES)
    assert set(precision.PRECISION_ALIASES.values()) <= set(precision.PRECISIONS)
    assert set(precision.PRECISION_NEAREST.values()) <= set(precision.PRECISIONS)
    for name in precision.PRECISIONS:  # an explicit precision resolves to itself, wherever the run lands
        assert choose_precision(name, "cpu")[0] == name
