"""The NF4 decode kernel (lit_qlora/nf4/gemv.c): exact against dequantize + matmul for every build this CPU runs,
the layouts the project's weights get, and the NF4 linear's routing of decode steps to it (generate's greedy tokens
unchanged)."""

import pytest
import torch
import torch.nn.functional as F

from lit_qlora.base.errors import InvalidInput
from lit_qlora.lora.layer import LoRALinear
from lit_qlora.model.config import Config
from lit_qlora.model.sampling import generate
from lit_qlora.model.transformer import Transformer
from lit_qlora.nf4 import dequantize_nf4, gemv, nf4_layout, nf4_linear, quantize_linears, quantize_nf4
from lit_qlora.nf4.linear import FrozenNF4Linear, NF4Linear, decode_applies
from lit_qlora.nf4.native import default_march, is_x86

# SmolLM2-135M's projections (q/o 576x576, k/v 192x576: a non-default scaler block, gate/up 1536x576, down 576x1536);
# rows that are not whole blocks (blocks span rows; 33 columns start rows mid-byte); 32-element blocks.
SHAPES = [((192, 576), 64), ((576, 576), 64), ((1536, 576), 64), ((576, 1536), 64), ((10, 96), 64), ((64, 33), 64),
          ((48, 64), 32)]
ROWS = (1, 2, 5, 16)


def build_or_skip(isa):
    if isa in ("avx2", "avx512", "avx512_bf16") and not is_x86():
        pytest.skip(f"the {isa} build is for x86")
    if isa == "avx512" and not gemv.cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512")
    if isa == "avx512_bf16" and not gemv.cpu_has_avx512_bf16():
        pytest.skip("this CPU has no AVX512-BF16")
    if isa == "avx2" and not torch.cpu.get_capabilities().get("avx2"):
        pytest.skip("this CPU has no AVX2")
    lib = gemv.gemv_lib(isa)
    assert lib is not None, gemv.gemv_error(isa)
    assert lib.isa == (isa or lib.isa)
    return lib


def storages(lib):
    return [torch.bfloat16, torch.float32] + ([torch.float16] if lib.has_f16 else [])


@pytest.mark.parametrize("isa", ["avx512_bf16", "avx512", "avx2", "scalar"])
@pytest.mark.parametrize("shape,block_size", SHAPES)
def test_float32_matches_dequantize_and_matmul(isa, shape, block_size):
    lib = build_or_skip(isa)
    gen = torch.Generator().manual_seed(sum(shape))
    for storage in storages(lib):
        w = quantize_nf4(torch.randn(*shape, generator=gen).to(storage), block_size)
        dense = dequantize_nf4(w, torch.float32)
        bias = torch.randn(shape[0], generator=gen)
        for m in ROWS:
            x = torch.randn(m, shape[1], generator=gen)
            got = gemv.nf4_matmul_rows(x, w, bias, isa=isa)
            assert got.dtype == torch.float32 and got.shape == (m, shape[0])
            assert gemv.close_enough(got, x, w, bias), (storage, m)
            # and against the path it replaces, within float32 sums of this size (their order differs)
            atol = 1e-5 * (x.abs() @ dense.abs().T).max().item()
            torch.testing.assert_close(got, F.linear(x, dense, bias), rtol=1e-5, atol=atol)


@pytest.mark.parametrize("isa", ["avx512_bf16", "avx512", "avx2", "scalar"])
@pytest.mark.parametrize("shape,block_size", SHAPES)
def test_bf16_matches_within_its_rounding(isa, shape, block_size):
    lib = build_or_skip(isa)
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    for storage in storages(lib):
        w = quantize_nf4(torch.randn(*shape, generator=gen).to(storage), block_size)
        bias = torch.randn(shape[0], generator=gen).bfloat16()
        for m in ROWS:
            x = torch.randn(m, shape[1], generator=gen).bfloat16()
            got = gemv.nf4_matmul_rows(x, w, bias, isa=isa)
            assert got.dtype == torch.bfloat16
            # against the float64 product of the bf16 dense weight: the float32 sum, then one bf16 rounding
            assert gemv.close_enough(got, x, w, bias), (storage, m)
            dense = F.linear(x, dequantize_nf4(w, torch.bfloat16), bias)  # the path it replaces, bf16 throughout
            torch.testing.assert_close(got.float(), dense.float(), rtol=2**-7, atol=2**-7 * dense.abs().max().item())


def test_layouts_the_project_picks_need_the_kernels_general_scaler_groups():
    # k/v of SmolLM2: 1728 blocks, so the scaler groups are not torchao's 256; one group for a small weight
    assert nf4_layout((192, 576)).scaler_block_size != 256
    w = quantize_nf4(torch.randn(8, 64))  # one block per row, one scaler group of 8
    assert w.scaler_block_size == 8
    x = torch.randn(3, 64)
    assert gemv.close_enough(gemv.nf4_matmul_rows(x, w), x, w)


def test_leading_dims_non_contiguous_x_and_zero_blocks():
    w = torch.randn(64, 128)
    w[3] = 0.0  # all-zero blocks: scale 0
    w = quantize_nf4(w)
    x = torch.randn(4, 128, 2)[..., 0].reshape(2, 2, 128)  # strided
    got = gemv.nf4_matmul_rows(x, w)
    assert got.shape == (2, 2, 64)
    torch.testing.assert_close(got, x @ dequantize_nf4(w, torch.float32).T, rtol=1e-5, atol=1e-5)
    assert torch.all(got[..., 3] == 0)


def test_unknown_isa_is_refused():
    with pytest.raises(ValueError, match="isa"):
        gemv.gemv_lib("sse9")


def test_the_avx2_cap_builds_the_avx2_path(monkeypatch):
    # lit_qlora.base.hardware.AVX2_ENV: the cap every C kernel honours, so a newer CPU decodes as a laptop would
    if not is_x86():
        pytest.skip("x86 only")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert default_march() == "x86-64-v3"
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert default_march() == "native"


# ---- routing: which forwards of the NF4 linear take the kernel

def test_decode_steps_take_the_kernel_training_does_not(monkeypatch):
    w = quantize_nf4(torch.randn(96, 64).bfloat16())
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        assert decode_applies(x, w)
        assert not decode_applies(torch.randn(1, gemv.MAX_ROWS + 1, 64), w)  # a prefill: the dense matmul
        assert decode_applies(torch.randn(2, gemv.MAX_ROWS // 2, 64), w)
        assert not decode_applies(x.half(), w)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert decode_applies(x, w)
            assert nf4_linear(x, w).dtype == torch.bfloat16
        monkeypatch.setenv("LIT_QLORA_NF4_GEMV", "0")
        assert not decode_applies(x, w)
        monkeypatch.setenv("LIT_QLORA_NF4_GEMV", "off")
        with pytest.raises(InvalidInput, match="LIT_QLORA_NF4_GEMV"):
            decode_applies(x, w)
        monkeypatch.delenv("LIT_QLORA_NF4_GEMV")
    assert decode_applies(x, w)  # grad mode on, but nothing requires grad
    assert not decode_applies(x.requires_grad_(), w)  # training: the autograd function


def test_nf4_linear_takes_the_kernel_and_keeps_its_gradients(monkeypatch):
    w = quantize_nf4(torch.randn(96, 64))
    bias = torch.randn(96)
    x = torch.randn(2, 64)
    calls = []
    kernel = gemv.nf4_matmul_rows
    monkeypatch.setattr(gemv, "nf4_matmul_rows", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    with torch.no_grad():
        got = nf4_linear(x, w, bias)
    assert calls and gemv.close_enough(got, x, w, bias)
    torch.testing.assert_close(got, NF4Linear.apply(x, w, bias), rtol=1e-5, atol=1e-5)
    calls.clear()
    xg = x.clone().requires_grad_()
    nf4_linear(xg, w, bias).sum().backward()
    assert not calls and xg.grad is not None


def test_lora_over_an_nf4_base_decodes_with_the_kernel():
    torch.manual_seed(0)
    base = torch.nn.Linear(64, 96)
    base.weight = torch.nn.Parameter(quantize_nf4(base.weight.detach()), requires_grad=False)
    base.__class__ = FrozenNF4Linear
    layer = LoRALinear(base, r=4, alpha=8)
    torch.nn.init.normal_(layer.lora_B, std=0.1)
    layer.eval()
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        got = layer(x)
        a, b = layer.lora_A.float(), layer.lora_B.float()  # bf16 adapters over an NF4 base, as LoRALinear casts
        expected = NF4Linear.apply(x, base.weight, base.bias) + (x @ a.T @ b.T) * layer.scale
        assert decode_applies(x, base.weight, base.bias)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def tiny_nf4_model(tie_embeddings: bool = False) -> Transformer:
    config = Config(vocab_size=320, n_layer=2, n_embd=128, n_head=4, n_query_groups=2, intermediate_size=352,
                    max_seq_length=64, tie_embeddings=tie_embeddings)
    torch.manual_seed(0)
    model = Transformer(config)
    model.init_weights(std=0.1)
    return model


def test_generate_gives_the_same_greedy_tokens_with_and_without_the_kernel(monkeypatch):
    model = tiny_nf4_model()
    assert quantize_linears(model) == 2 * 7 + 1  # the head too: it decodes through the kernel
    model.eval()
    prompt = [5, 17, 33, 2, 99, 41]
    calls = []
    kernel = gemv.nf4_matmul_rows
    monkeypatch.setattr(gemv, "nf4_matmul_rows", lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    with_kernel = list(generate(model, prompt, 20))
    assert calls and all(s[:-1].numel() <= gemv.MAX_ROWS for s in calls)  # this short prompt's prefill too
    monkeypatch.setenv("LIT_QLORA_NF4_GEMV", "0")
    calls.clear()
    without = list(generate(model, prompt, 20))
    assert not calls
    assert with_kernel == without and len(with_kernel) == 20


def test_an_adapted_nf4_model_decodes_every_projection_with_the_kernel(monkeypatch):
    """With adapters on q/k/v and gate/up, a decode step runs each projection's own kernel call instead of one
    dequantized stack (fused_projections steps aside), and greedy tokens are those of the kernel switched off."""
    from lit_qlora.lora.layer import apply_lora, lora_modules

    model = tiny_nf4_model()
    quantize_linears(model)
    apply_lora(model, r=4, alpha=8, dtype=torch.float32)
    with torch.no_grad():
        for layer in lora_modules(model).values():
            layer.lora_B.normal_(0, 0.05)
    model.eval()
    from lit_qlora.model import decode_step

    monkeypatch.setattr(decode_step, "applies", lambda *a: False)  # through the model's modules (not the C step)
    weights = []
    kernel = gemv.nf4_matmul_rows
    monkeypatch.setattr(gemv, "nf4_matmul_rows", lambda x, w, *a, **k: weights.append(w.quantized_data.data_ptr()) or kernel(x, w, *a, **k))
    with_kernel = list(generate(model, [5, 17, 33], 6))
    every = {m.weight.quantized_data.data_ptr() for m in lora_modules(model).values()}
    # q, k, v, gate and up too, each its own kernel call at every step (the rest: the kernel's first-use self-test)
    assert len(every) == 2 * 7 + 1 and all(weights.count(w) == 6 for w in every)
    monkeypatch.setenv("LIT_QLORA_NF4_GEMV", "0")
    assert list(generate(model, [5, 17, 33], 6)) == with_kernel


# ---- the dense bf16 decode product (a tied head under NF4): AVX512-BF16 builds

@pytest.mark.parametrize("n,k", [(49152 // 64, 576), (40, 96), (33, 200), (8, 16)])
def test_dense_bf16_rows_match_the_matmul_within_its_rounding(n, k):
    lib = build_or_skip("avx512_bf16")
    assert lib.has_dense
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    for m in ROWS:
        x = torch.randn(m, k, generator=gen).bfloat16()
        got = gemv.dense_matmul_rows(x, w, isa="avx512_bf16")
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        ref = x.double() @ w.double().T  # exact products; the float32 sum, then one bf16 rounding
        bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 2**-8 * ref.abs()
        assert bool(((got.double() - ref).abs() <= bound).all()), m
        torch.testing.assert_close(got.float(), (x @ w.T).float(), rtol=2**-7, atol=2**-7 * ref.abs().max().item())


def test_builds_without_bf16_dot_have_no_dense_kernel():
    lib = build_or_skip("avx512")
    assert not lib.has_dense
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        gemv.dense_matmul_rows(torch.randn(1, 64).bfloat16(), torch.randn(8, 64).bfloat16(), isa="avx512")


def test_a_bf16_decode_steps_tied_head_takes_the_dense_kernel(monkeypatch):
    lib = gemv.gemv_lib()
    if lib is None or not lib.has_dense:
        pytest.skip("this CPU's build has no dense bf16 kernel (AVX512-BF16)")
    w, x = torch.randn(96, 64).bfloat16(), torch.randn(1, 1, 64).bfloat16()
    with torch.no_grad():
        assert gemv.dense_applies(x, w)
        assert not gemv.dense_applies(x.float(), w.float())  # float32: PyTorch's matmul
        assert not gemv.dense_applies(torch.randn(1, gemv.MAX_ROWS + 1, 64).bfloat16(), w)  # a prefill
        assert not gemv.dense_applies(x, w.T.contiguous().T)  # strided weight
    assert not gemv.dense_applies(x, w.clone().requires_grad_())  # training the head
    model = tiny_nf4_model(tie_embeddings=True)
    quantize_linears(model)
    model.to(torch.bfloat16).eval()
    calls = []
    kernel = gemv.dense_matmul_rows
    monkeypatch.setattr(gemv, "dense_matmul_rows", lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    prompt = [5, 17, 33, 2, 99, 41]
    with_kernel = list(generate(model, prompt, 12))
    assert len(calls) == 12  # the prefill's last position and each decode step
    with torch.no_grad():
        hidden = model.forward_hidden(torch.tensor([prompt]))[:, -1:]
        torch.testing.assert_close(model.logits(hidden).float(), F.linear(hidden, model.lm_head.weight).float(),
                                   rtol=2**-7, atol=2**-7 * 8)
    monkeypatch.setenv("LIT_QLORA_NF4_GEMV", "0")
    calls.clear()
    assert list(generate(model, prompt, 12)) == with_kernel and not calls
