"""The CUDA dequantize kernel (nf4/triton.py) under Triton's interpreter on CPU tensors, the custom op that lets
torch.compile trace the NF4 linear (nf4/ops.py), and compiled QLoRA blocks with no graph break.

The interpreter has no bf16 arithmetic: the kernel is compared with torchao bit for bit on fp32 and fp16 weights
(tests/test_cuda.py compares bf16 on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from lit_qlora.model.config import Config
from lit_qlora.checkpoint.loading import random_base
from lit_qlora.lora.layer import apply_lora, lora_modules
from lit_qlora.nf4 import dequantize_nf4, nf4_linear, quantize_nf4
from lit_qlora.nf4.native import triton_available
from lit_qlora.nf4.ops import dequantize_op
from lit_qlora.train.loss import lm_loss_sum

needs_interpreter = pytest.mark.skipif(not triton_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="needs triton and TRITON_INTERPRET=1 (tests/conftest.py sets it)")
CONFIG = Config.from_hf_config({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "max_position_embeddings": 128, "tie_word_embeddings": False})
# (shape, layout): the default layout on multiples of 64x256 values; odd shapes whose layout has another scaler block
# size; sizes that leave a partial program of code bytes at the end
SHAPES = [(256, 128), (192, 576), (100, 192), (7, 128), (4096, 130), (1, 16384 + 128)]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_kernel_equals_torchao_bit_for_bit(shape, dtype):
    from lit_qlora.nf4 import triton as kernel

    gen = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen)).to(dtype)
    t = quantize_nf4(w)
    if shape == (256, 128):
        assert (t.block_size, t.scaler_block_size) == (64, 256)
    else:
        assert t.numel() % (kernel.BYTES_PER_PROGRAM * 2) != 0 or t.scaler_block_size != 256
    want = t.get_original_weight()
    got = kernel.dequantize(t)
    assert got.dtype == dtype and torch.equal(got, want)
    # to fp32 from the storage dtype: rounded to it first, as get_original_weight().float()
    assert torch.equal(kernel.dequantize(t, torch.float32), want.float())


@needs_interpreter
def test_triton_kernel_writes_a_row_slice_into_the_buffer_given():
    from lit_qlora.nf4 import triton as kernel

    t = quantize_nf4(torch.randn(512, 128, generator=torch.Generator().manual_seed(3)))
    want = t.get_original_weight()
    out = torch.full((64, 128), float("nan"))
    kernel.dequantize_into(t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4,
                           t.block_size, t.scaler_block_size, out, first_value=320 * 128)
    assert torch.equal(out, want[320:384])
    with pytest.raises(ValueError, match="whole code bytes"):
        kernel.dequantize_into(t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4,
                               t.block_size, t.scaler_block_size, torch.empty(3), first_value=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_custom_op_equals_dequantize_and_passes_opcheck(dtype):
    t = quantize_nf4(torch.randn(192, 576, generator=torch.Generator().manual_seed(4)).to(dtype))
    got = dequantize_op(t, torch.float32)
    assert torch.equal(got, dequantize_nf4(t, torch.float32))
    args = (t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4, t.block_size,
            t.scaler_block_size, 192, 576, dtype)
    torch.library.opcheck(torch.ops.lit_qlora.nf4_dequantize.default, args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.lit_qlora.nf4_dequantize(*(mode.from_tensor(a) if torch.is_tensor(a) else a for a in args))
    assert fake.shape == (192, 576) and fake.dtype == dtype


def _lora_model(dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    model = random_base(CONFIG, "nf4", torch.float32)
    apply_lora(model, 4, 8, dropout, dtype=torch.float32)
    for layer in lora_modules(model).values():  # B != 0: every adapter's gradient is non-trivial
        torch.nn.init.normal_(layer.lora_B, std=0.02)
    return model.train()


def test_a_compiled_qlora_block_is_one_graph_with_gpu_dropout(monkeypatch):
    """NF4 projections, LoRA and the dropout GPUs run (nn.Dropout: the CPU's hash dropout is a C kernel) trace into
    one graph per block: no graph break, as `--compile true` runs each block on CUDA."""
    from lit_qlora.lora import dropout as lora_dropout

    monkeypatch.setattr(lora_dropout, "hash_dropout_applies", lambda x: False)
    model = _lora_model(0.05)
    block = model.blocks[0]
    x = torch.randn(2, 16, CONFIG.n_embd, requires_grad=True)
    cos, sin = model.rope(torch.arange(16), x.dtype)
    explained = torch._dynamo.explain(block)(x, cos, sin)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_compiled_qlora_step_equals_eager():
    from lit_qlora.train.compile import compile_blocks

    ids = torch.randint(0, CONFIG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(5))
    results = []
    for compiled in (False, True):
        model = _lora_model(0.0)
        if compiled:
            torch._dynamo.reset()
            assert compile_blocks(model) == CONFIG.n_layer
        loss = lm_loss_sum(model, ids, ids)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.item(), grads))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
    assert eager_grads.keys() == compiled_grads.keys() and len(eager_grads) == 2 * 7 * CONFIG.n_layer + 2
    for name, g in eager_grads.items():
        assert torch.allclose(compiled_grads[name], g, rtol=1e-4, atol=1e-6 * g.abs().max().item()), name


def test_nf4_linear_under_compile_saves_no_dense_weight_for_backward():
    """The compiled joint graph dequantizes again in backward (the op's `recompute` keeps CSE from merging the two
    calls), so what forward saves is the NF4 weight, not a dense copy."""
    gen = torch.Generator().manual_seed(6)
    w = quantize_nf4(torch.randn(256, 128, generator=gen))
    x = torch.randn(8, 128, generator=gen, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    compiled = torch.compile(lambda x: nf4_linear(x, w), fullgraph=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = compiled(x)
    y.square().sum().backward()
    assert (256, 128) not in saved
    assert torch.allclose(x.grad, 2 * (x.detach() @ dequantize_nf4(w).T) @ dequantize_nf4(w), rtol=1e-4, atol=1e-4)
