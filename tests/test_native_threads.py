"""How the C kernels and torch share the CPU (issue 16, contention): the kernels run on torch's own OpenMP team
(the libgomp torch calls, no pool of our own), give the same bits on 1, 2 or 3 threads, and `litqlora` has
OpenMP workers spin briefly before they sleep unless the user chose otherwise."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from lit_qlora.lora import dropout as lora_dropout
from lit_qlora.lora.dropout import keep_threshold
from lit_qlora.lora import native as lora_native
from lit_qlora.nf4 import native
from lit_qlora.nf4.reference import level_table

pytestmark = pytest.mark.skipif(native.native_lib() is None, reason=f"no native kernels: {native.native_error()}")


def on_threads(n: int, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


def same_on_1_2_and_3_threads(fn) -> None:
    one = on_threads(1, fn)
    for n in (2, 3):
        for got, want in zip(on_threads(n, fn), one, strict=True):
            assert torch.equal(got, want), f"{n} threads changed a result"


@pytest.mark.parametrize("kernels", [native, lora_native], ids=["nf4", "lora"])
def test_the_kernels_call_the_openmp_runtime_torch_calls(kernels):
    """Each library (NF4's, LoRA's) links libgomp.so.1 and must bind the copy torch loaded: a second runtime is a
    second thread pool. (Other wheels may bundle their own renamed libgomp, e.g. sentencepiece's; neither torch nor we
    call that one.)"""
    lib = kernels.native_lib()
    if lib is None or not hasattr(lib, "omp_get_thread_num"):
        pytest.skip("kernels built without OpenMP here (they run on one thread)")
    ours = ctypes.cast(lib.omp_get_thread_num, ctypes.c_void_p).value
    torchs = ctypes.cast(ctypes.CDLL(torch._C.__file__).omp_get_thread_num, ctypes.c_void_p).value
    assert ours == torchs


def test_quantize_and_dequantize_give_the_same_bits_on_any_thread_count():
    blocks = 31_001  # 3.97 MB of bf16: three threads' worth, split unevenly
    w = torch.randn(blocks * 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert on_threads(3, lambda: native.kernel_threads(blocks, w.numel() * 2)) == 3

    def quantize():
        q, s = torch.empty(w.numel() // 2, dtype=torch.uint8), torch.empty(blocks, dtype=torch.bfloat16)
        native.quantize_blocks(w, 64, q, s)
        return q, s

    same_on_1_2_and_3_threads(quantize)
    q, s = quantize()

    def dequantize():
        outs = [torch.empty(w.numel(), dtype=dtype) for dtype in (torch.bfloat16, torch.float32)]
        for out in outs:
            native.dequantize_blocks(q, s.float(), level_table(torch.bfloat16), torch.bfloat16, out)
        return outs

    same_on_1_2_and_3_threads(dequantize)
    assert (dequantize()[0] - w).abs().max() < 0.25 * w.abs().max()  # it did dequantize


def test_dropout_kernels_give_the_same_bits_on_any_thread_count():
    g = torch.Generator().manual_seed(1)
    rows, cols, rank = 1001, 577, 8  # 3.5 MB over three adapters; ragged rows and columns
    x = torch.randn(rows, cols, generator=g).bfloat16()
    a = [(torch.randn(rank, cols, generator=g) * 0.1).bfloat16() for _ in range(3)]
    grad_h = [torch.randn(rows, rank, generator=g) for _ in range(3)]
    base = torch.randn(rows, cols, generator=g).bfloat16()
    seeds, p = [3, 99, 2**31 + 5], 0.05
    assert lora_dropout._fused_kernel(x, a)
    assert on_threads(3, lambda: native.kernel_threads(-(-cols // 16), x.numel() * 2 * 3)) == 3

    def elementwise():
        out = torch.empty_like(x)
        lora_native.dropout_elements(x, out, 12345, keep_threshold(p), 1 / (1 - p))
        return [out]

    def fused():
        h = lora_dropout.down(x, a, seeds, p)
        grad_a, grad_x = lora_dropout.down_backward(x, a, grad_h, seeds, p, base.clone(), True)
        return [*h, *grad_a, grad_x]

    same_on_1_2_and_3_threads(elementwise)
    same_on_1_2_and_3_threads(fused)
    assert (elementwise()[0] == 0).float().mean().item() == pytest.approx(p, abs=0.003)


def spin_count(env: dict, code: str = "import lit_qlora.cli, torch") -> int:
    """How long libgomp's workers spin before sleeping, as it reports at load (OMP_DISPLAY_ENV=verbose)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    proc = subprocess.run([sys.executable, "-c", code], env={**clean, "OMP_DISPLAY_ENV": "verbose", **env},
                          capture_output=True, text=True, check=True)
    line = next(x for x in proc.stderr.splitlines() if x.strip().startswith("GOMP_SPINCOUNT ="))
    return int(line.split("=")[1].strip(" '"))


def test_litqlora_sets_openmp_spinning_unless_the_user_chose():
    assert spin_count({}, "import torch") == 300_000  # libgomp's own default, ~3 ms
    assert spin_count({}) == 30_000  # set before torch loads libgomp (lit_qlora.base.threads.SPIN_COUNT)
    assert spin_count({"OMP_WAIT_POLICY": "passive"}) == 0
    assert spin_count({"GOMP_SPINCOUNT": "12345"}) == 12345
