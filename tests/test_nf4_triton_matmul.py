"""The NF4 matmul with the dequantize fused in (nf4/triton_matmul.py) under Triton's interpreter on CPU tensors, and
``LIT_QLORA_NF4_FUSED=1`` in NF4Linear (nf4/linear.py).

Exactness: a row of the identity as input picks one value of the dequantized weight (a sum of that value and exact
zeros), so those output rows must equal torchao's ``get_original_weight()`` bit for bit; the other rows are random
and compared with the dense product to fp32 rounding. The interpreter has no bf16 arithmetic: fp32 and fp16 here,
bf16 on a GPU (the last test)."""

from __future__ import annotations

import pytest
import torch

from lit_qlora.nf4 import nf4_linear, quantize_nf4
from lit_qlora.nf4 import linear as nf4_linear_module
from lit_qlora.nf4.native import triton_available

from helpers import needs_interpreter, nf4_test_weight

# ((N, K), block size): block tiles (the interpreter's tiles span 64 along K) where N and K are odd multiples of the
# 64-value block (3 and 5 blocks) and with fewer rows than a tile; values by flat index where K = 100 (blocks straddle
# rows), K is odd (code bytes straddle rows), or the block is 50 values (rows of whole blocks, not a tile's extent)
SHAPES = [((192, 320), 64), ((7, 128), 64), ((64, 100), 64), ((128, 33), 64), ((30, 150), 50)]


def _probe(n_random: int, width: int, dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(2, (n_random + 20) // 2, width) inputs: random rows, then 20 rows of the identity (their indices returned)."""
    gen = torch.Generator().manual_seed(seed)
    picked = torch.randint(0, width, (20,), generator=gen)
    picked[0] = width - 1  # the last column: the tails of every tile
    rows = torch.cat([torch.randn(n_random, width, generator=gen), torch.eye(width)[picked]]).to(dtype)
    return rows.reshape(2, -1, width), picked


def _check(got, x, dense, picked, n_random):
    """``got`` is ``x @ dense`` (to fp32 rounding; the fp16 reference rounded once from fp32) and its identity rows
    are the rows ``picked`` of ``dense``, bit for bit."""
    want = (x.float() @ dense.float()).to(x.dtype)
    got_rows, want_rows = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    assert got.shape == want.shape and got.dtype == x.dtype
    assert torch.equal(got_rows[n_random:], dense[picked].to(x.dtype))
    rtol = 1e-5 if x.dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got_rows[:n_random], want_rows[:n_random], rtol=rtol,
                               atol=1e-6 * want_rows.abs().max().item())


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape, block_size", SHAPES)
def test_fused_forward_and_dx_equal_the_dense_products(shape, block_size, dtype):
    from lit_qlora.nf4.triton_matmul import _block_tiles, nf4_grad_input_fused, nf4_linear_fused

    t = nf4_test_weight(shape, dtype, seed=sum(shape), block_size=block_size)
    assert t.block_size == block_size
    tiles = {"BLOCK_SIZE": block_size, "BLOCK_P": 64, "BLOCK_R": 64}  # the interpreter's configuration
    assert _block_tiles({**tiles, "P": shape[1], "R": shape[0], "TRANS": True}) == (shape[1] % 64 == 0 and block_size == 64)
    dense = t.get_original_weight()  # torchao's values
    x, picked = _probe(18, shape[1], dtype, seed=1)  # 38 rows: 3 tiles of 16, the last a tail
    _check(nf4_linear_fused(x, t), x, dense.T, picked, 18)
    g, picked = _probe(18, shape[0], dtype, seed=2)
    _check(nf4_grad_input_fused(g, t), g, dense, picked, 18)


@needs_interpreter
def test_fused_forward_adds_the_bias_and_takes_a_single_row():
    from lit_qlora.nf4.triton_matmul import nf4_linear_fused

    t = nf4_test_weight((64, 128), torch.float32)
    x, b = torch.randn(1, 128), torch.randn(64)
    torch.testing.assert_close(nf4_linear_fused(x, t, b), x @ t.get_original_weight().T + b, rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("bias", [False, True])
def test_nf4_linear_with_the_setting_on_matches_it_off(bias, monkeypatch):
    from lit_qlora.nf4 import triton_matmul

    calls = []
    for name in ("nf4_linear_fused", "nf4_grad_input_fused"):
        original = getattr(triton_matmul, name)
        monkeypatch.setattr(triton_matmul, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    t = nf4_test_weight((192, 320), torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    x0, grad = torch.randn(2, 9, 320, generator=gen), torch.randn(2, 9, 192, generator=gen)
    b0 = torch.randn(192, generator=gen) if bias else None
    results = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("LIT_QLORA_NF4_FUSED", setting)
        x = x0.clone().requires_grad_()
        b = None if b0 is None else b0.clone().requires_grad_()
        assert nf4_linear_module.fused_matmul_applies(x, t) == (setting == "1")
        y = nf4_linear(x, t, b)
        y.backward(grad)
        results[setting] = (y.detach(), x.grad, None if b is None else b.grad)
        # off: the path is the unfused one, untouched; on: forward and dX both fused
        assert calls == ([] if setting == "0" else ["nf4_linear_fused", "nf4_grad_input_fused"])
    (y_off, gx_off, gb_off), (y_on, gx_on, gb_on) = results["0"], results["1"]
    torch.testing.assert_close(y_on, y_off, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gx_on, gx_off, rtol=1e-5, atol=1e-4)
    if bias:
        assert torch.equal(gb_on, gb_off)


def test_the_setting_needs_a_device_the_kernel_runs_on(monkeypatch):
    t = nf4_test_weight((64, 128), torch.float32)
    x = torch.randn(2, 128)
    monkeypatch.setenv("LIT_QLORA_NF4_FUSED", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors, compiled Triton: not applicable
    assert not nf4_linear_module.fused_matmul_applies(x, t)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert nf4_linear_module.fused_matmul_applies(x, t) == triton_available()
    assert not nf4_linear_module.fused_matmul_applies(x.double(), t)
    monkeypatch.delenv("LIT_QLORA_NF4_FUSED")
    assert not nf4_linear_module.fused_matmul_applies(x, t)
    from lit_qlora.base.errors import InvalidInput

    monkeypatch.setenv("LIT_QLORA_NF4_FUSED", "on")  # misspelt: refused, never read as off
    with pytest.raises(InvalidInput, match="LIT_QLORA_NF4_FUSED='on': this switch takes 1 .on. or 0 .off."):
        nf4_linear_module.fused_matmul_applies(x, t)


@needs_interpreter
def test_fake_impls_give_shape_and_dtype_and_opcheck_passes():
    from lit_qlora.nf4.triton_matmul import _inner

    t = nf4_test_weight((64, 100), torch.float16)
    x, g = torch.randn(3, 100, dtype=torch.float16), torch.randn(2, 3, 64, dtype=torch.float16)
    for op, a, shape in ((torch.ops.lit_qlora.nf4_matmul, x, (3, 64)), (torch.ops.lit_qlora.nf4_matmul_dx, g,
                                                                         (2, 3, 100))):
        torch.library.opcheck(op.default, (a, *_inner(t)))
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake = op(mode.from_tensor(a), *(mode.from_tensor(v) if torch.is_tensor(v) else v for v in _inner(t)))
        assert fake.shape == shape and fake.dtype == torch.float16


@needs_interpreter
def test_compiled_nf4_linear_with_the_setting_on_is_one_graph_of_the_fused_ops_and_equals_eager(monkeypatch):
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setenv("LIT_QLORA_NF4_FUSED", "1")
    t = nf4_test_weight((64, 128), torch.float32, seed=5)
    b = torch.randn(64)
    x0 = torch.randn(2, 5, 128)
    counter = CompileCounterWithBackend("aot_eager")
    outs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        fn = torch.compile(lambda x: nf4_linear(x, t, b), backend=counter, fullgraph=True) if compiled else (
            lambda x: nf4_linear(x, t, b))
        x = x0.clone().requires_grad_()
        y = fn(x)
        y.square().sum().backward()
        outs.append((y.detach(), x.grad))
    graph = counter.graphs[0].print_readable(print_output=False)
    assert counter.frame_count == 1 and "lit_qlora.nf4_matmul(" in graph and "lit_qlora.nf4_matmul_dx(" in graph
    assert "nf4_dequantize" not in graph
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(1024, 4096), (192, 576), (128, 33)])
def test_fused_kernels_on_the_gpu_in_bf16(shape):
    from lit_qlora.nf4.triton_matmul import nf4_grad_input_fused, nf4_linear_fused

    t = quantize_nf4(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
    dense = t.get_original_weight()
    for fn, width, matrix in ((nf4_linear_fused, shape[1], dense.T), (nf4_grad_input_fused, shape[0], dense)):
        x, picked = _probe(300, width, torch.bfloat16, seed=6)
        got = fn(x.cuda(), t).reshape(-1, matrix.shape[1])
        assert torch.equal(got[300:], matrix[picked.cuda()])
        want = (x.cuda().float().reshape(-1, width) @ matrix.float())[:300]
        torch.testing.assert_close(got[:300].float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
