"""The few-row NF4 matmul on CUDA (nf4/triton_rows.py) under Triton's interpreter on CPU tensors, and its routing in
nf4_linear (nf4/linear.py: a decode step's product on CUDA; on CPU only with the interpreter and
``LIT_QLORA_NF4_FUSED=1``, which is how these tests reach it).

Exactness as tests/test_nf4_triton_matmul.py checks it: a row of the identity picks one dequantized value (a sum of
that value and exact zeros), so it must equal torchao's ``get_original_weight()`` bit for bit; random rows equal the
dense product to fp32 rounding. The interpreter has no bf16 arithmetic: fp32 and fp16 here, bf16 on a GPU (last
test)."""

from __future__ import annotations

import pytest
import torch

from lit_qlora.nf4 import nf4_linear
from lit_qlora.nf4.native import triton_available

from helpers import needs_interpreter, nf4_test_weight

# ((N, K), block size), with the interpreter's (16, 64) tiles: N and K tails ((7, 128), (40, 96)), two blocks a tile
# and a half-empty last tile (blocks of 32, K 96), four blocks a tile (16), and one output tile over eight K tiles
# (16, 512), which the kernel splits into four partial sums
SHAPES = [((192, 320), 64), ((7, 128), 64), ((40, 96), 32), ((24, 128), 16), ((16, 512), 64)]


def _rows(m: int, width: int, dtype, seed: int):
    """m rows: the first random, the others rows of the identity (the last column first: every tile's tail)."""
    gen = torch.Generator().manual_seed(seed)
    picked = torch.randint(0, width, (m,), generator=gen)
    picked[1 if m > 1 else 0] = width - 1
    rows = torch.eye(width)[picked]
    rows[0] = torch.randn(width, generator=gen)
    return rows.to(dtype), picked


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("shape, block_size", SHAPES)
def test_few_rows_equal_the_dense_product(shape, block_size, m, dtype):
    from lit_qlora.nf4.triton_rows import nf4_linear_rows

    weight = nf4_test_weight(shape, dtype, seed=m, block_size=block_size)
    dense = weight.get_original_weight()
    x, picked = _rows(m, shape[1], dtype, seed=m)
    got = nf4_linear_rows(x, weight)
    assert got.shape == (m, shape[0]) and got.dtype == dtype
    if m > 1:  # identity rows: the weight's values, bit for bit
        assert torch.equal(got[1:], dense[:, picked[1:]].T.to(dtype))
    want = (x[:1].float() @ dense.float().T).to(dtype)
    rtol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got[:1], want, rtol=rtol, atol=1e-6 * want.abs().max().item())
    assert torch.equal(nf4_linear_rows(x, weight), got)  # partial sums in a fixed order: the same answer again


@needs_interpreter
def test_leading_dims_bias_and_an_fp32_weight_under_fp16_rows():
    """(2, 3, K) rows keep their leading dims; the bias is added to the rounded product; an fp32 weight's values are
    rounded to the rows' fp16 first, as the dense weight in fp16 would hold them."""
    from lit_qlora.nf4.triton_rows import nf4_linear_rows

    weight = nf4_test_weight((48, 128), torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 128, generator=gen).half()
    bias = torch.randn(48, generator=gen)
    got = nf4_linear_rows(x, weight, bias)
    dense16 = weight.get_original_weight().half()
    want = (x.float() @ dense16.float().T).half() + bias.half()
    assert got.shape == (2, 3, 48) and got.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    identity = torch.eye(128)[[0, 127]].half()
    assert torch.equal(nf4_linear_rows(identity, weight), dense16[:, [0, 127]].T)


@needs_interpreter
def test_nf4_linear_routes_a_decode_step_to_the_kernel_and_nothing_else(monkeypatch):
    """With the interpreter and LIT_QLORA_NF4_FUSED=1 a CPU product takes the route a CUDA one takes by default: up
    to 16 rows with nothing to differentiate go to the few-row kernel; 17 rows, a product that needs x's gradient,
    ``LIT_QLORA_NF4_GEMV=0`` or K not in whole blocks do not."""
    from lit_qlora.nf4 import triton_rows

    calls = []
    real = triton_rows.nf4_linear_rows

    def counted(x, weight, bias=None):
        calls.append(x.shape)
        return real(x, weight, bias)

    monkeypatch.setattr(triton_rows, "nf4_linear_rows", counted)
    monkeypatch.setenv("LIT_QLORA_NF4_FUSED", "1")
    weight = nf4_test_weight((32, 128), torch.float32, seed=5)
    dense = weight.get_original_weight()
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        y = nf4_linear(torch.randn(16, 128, generator=gen), weight)
        assert calls == [(16, 128)] and y.shape == (16, 32)
        nf4_linear(torch.randn(17, 128, generator=gen), weight)
        assert len(calls) == 1
    x = torch.randn(2, 128, generator=gen, requires_grad=True)
    y = nf4_linear(x, weight)
    y.sum().backward()
    assert len(calls) == 1 and torch.allclose(x.grad, dense.sum(0).expand(2, -1), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("LIT_QLORA_NF4_GEMV", "0")
    with torch.no_grad():
        nf4_linear(torch.randn(2, 128, generator=gen), weight)
    assert len(calls) == 1
    monkeypatch.delenv("LIT_QLORA_NF4_GEMV")
    odd = nf4_test_weight((16, 100), torch.float32, seed=7)  # rows straddle blocks: the tile kernel's flat indexing instead
    with torch.no_grad():
        nf4_linear(torch.randn(2, 100, generator=gen), odd)
    assert len(calls) == 1


@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("m", [1, 4, 16])
def test_bf16_rows_on_cuda_equal_the_dense_product(m):
    from lit_qlora.nf4.triton_rows import nf4_linear_rows

    weight = nf4_test_weight((4096, 4096), torch.bfloat16, seed=m).to("cuda")
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    dense = weight.get_original_weight()
    want = (x.float() @ dense.float().T)
    got = nf4_linear_rows(x, weight)
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3 * want.abs().max().item())
    assert torch.equal(nf4_linear_rows(x, weight), got)
