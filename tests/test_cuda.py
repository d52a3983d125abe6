"""The CUDA path on a real GPU (skipped without one; run on the lent GPU machine, benchmarks/README.md "GPU").

The CPU results are the reference: NF4 codes quantized on the GPU equal the CPU kernel's, the NF4 linear's forward and
backward on the GPU match the CPU's, a QLoRA loss and its adapter gradients agree across devices, and a real
`litqlora finetune --accelerator cuda` run trains, reports torch's CUDA memory peaks and writes its exports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from lit_qlora.model.config import Config  # noqa: E402
from lit_qlora.checkpoint.loading import random_base  # noqa: E402
from lit_qlora.lora.layer import apply_lora, lora_modules  # noqa: E402
from lit_qlora.nf4 import dequantize_nf4, nf4_linear, quantize_nf4  # noqa: E402
from lit_qlora.train.loss import lm_loss_sum  # noqa: E402

CONFIG = Config.from_hf_config({"model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "max_position_embeddings": 256, "tie_word_embeddings": False})


@pytest.mark.parametrize("shape", [(576, 192 * 3), (1536, 576), (4096, 128)])
def test_nf4_quantized_on_the_gpu_equals_the_cpu_kernel(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    cpu, gpu = quantize_nf4(w), quantize_nf4(w.cuda())
    assert gpu.quantized_data.is_cuda
    assert torch.equal(cpu.quantized_data, gpu.quantized_data.cpu())
    assert torch.equal(dequantize_nf4(cpu), dequantize_nf4(gpu).cpu())


def test_nf4_linear_forward_and_backward_match_the_cpu():
    gen = torch.Generator().manual_seed(1)
    w = quantize_nf4((torch.randn(768, 512, generator=gen) * 0.05).to(torch.bfloat16))
    x = torch.randn(3, 40, 512, generator=gen).to(torch.bfloat16)
    results = []
    for device in ("cpu", "cuda"):
        xd = x.to(device, copy=True).requires_grad_()
        wd = w if device == "cpu" else quantize_nf4(dequantize_nf4(w).cuda())
        y = nf4_linear(xd, wd)
        y.float().pow(2).sum().backward()
        results.append((y.float().cpu(), xd.grad.float().cpu()))
    (y_cpu, g_cpu), (y_gpu, g_gpu) = results
    assert torch.allclose(y_cpu, y_gpu, rtol=2e-2, atol=2e-2)
    assert (g_cpu - g_gpu).norm() / g_cpu.norm() < 1e-2


@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_lora_loss_and_gradients_agree_across_devices(quantize):
    torch.manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 64))
    out = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)  # built, quantized and given adapters on the CPU, then moved as Lightning moves it
        model = random_base(CONFIG, quantize, torch.float32)
        apply_lora(model, 4, 8, 0.0, dtype=torch.float32)
        for layer in lora_modules(model).values():  # B != 0 so every adapter's gradient is non-trivial
            torch.nn.init.normal_(layer.lora_B, std=0.02)
        model = model.to(device)
        assert all(p.device.type == device for p in model.parameters())
        model.train()
        loss = lm_loss_sum(model, ids.to(device), ids.to(device))
        loss.backward()
        grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        out[device] = (loss.item(), grads)
    (loss_cpu, g_cpu), (loss_gpu, g_gpu) = out["cpu"], out["cuda"]
    assert loss_gpu == pytest.approx(loss_cpu, rel=1e-3)
    assert g_cpu.keys() == g_gpu.keys() and len(g_cpu) == 2 * 7 * CONFIG.n_layer + 2
    for name in g_cpu:
        assert (g_cpu[name] - g_gpu[name]).norm() <= 2e-2 * g_cpu[name].norm() + 1e-6, name


@pytest.fixture(scope="module")
def tiny_dir(request, tmp_path_factory):
    """conftest's tiny Llama; on a GPU machine without the bundled GGUF (it is too large to carry there), the same
    tiny model with the tokenizer files found in $LIT_QLORA_TEST_TOKENIZER."""
    tokenizer_dir = os.environ.get("LIT_QLORA_TEST_TOKENIZER")
    if not tokenizer_dir:
        return request.getfixturevalue("tiny_llama_dir")
    from helpers import write_tiny_llama

    return write_tiny_llama(Path(tokenizer_dir), tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_finetune_on_cuda_trains_and_reports_cuda_memory(tiny_dir, tmp_path, quantize):
    from lit_qlora.train.finetune import finetune
    from lit_qlora.train.args import DataArgs, LoRAArgs, TrainArgs

    summary = finetune(checkpoint_dir=tiny_dir, out_dir=tmp_path, quantize=quantize, accelerator="cuda",
                       lora=LoRAArgs(r=4, alpha=8, dropout=0.05),
                       train=TrainArgs(max_steps=8, micro_batch_size=4, global_batch_size=4, max_seq_length=128,
                                       lr=3e-3, warmup_steps=1),
                       data=DataArgs(packing=True))
    assert summary["val_loss"] < summary["initial_val_loss"]
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_active_bytes", "peak_allocated_train_bytes"):
        assert summary[key] > 0, key
    assert summary["peak_reserved_bytes"] >= summary["peak_allocated_bytes"]
    assert summary["quantized_linears"] == (summary["total_linears"] if quantize == "nf4" else 0)
    final = tmp_path / "final"
    for name in ("adapter.safetensors", "merged/model.safetensors", "peft/adapter_model.safetensors"):
        assert (final / name).is_file(), name
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["loss"] is not None for r in rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(4096, 1024), (192, 576), (100, 192), (14336 // 7, 4096)])
def test_triton_kernel_equals_torchao_on_the_gpu(shape, dtype):
    from lit_qlora.nf4 import triton as kernel

    w = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype).cuda()
    t = quantize_nf4(w)
    want = t.get_original_weight()
    assert torch.equal(kernel.dequantize(t), want)
    assert torch.equal(dequantize_nf4(t, torch.float32), want.float())
    rows = (64, 128) if shape[0] >= 128 else (0, 64)
    assert torch.equal(dequantize_nf4(t, rows=rows), want[rows[0] : rows[1]])


def test_custom_op_on_the_gpu_is_the_triton_kernel():
    from lit_qlora.nf4.ops import dequantize_op

    t = quantize_nf4(torch.randn(1024, 512, device="cuda").to(torch.bfloat16))
    got = dequantize_op(t, torch.bfloat16)
    assert got.is_cuda and torch.equal(got, t.get_original_weight())
    torch.library.opcheck(torch.ops.lit_qlora.nf4_dequantize.default,
                          (t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4,
                           t.block_size, t.scaler_block_size, 1024, 512, torch.bfloat16))


def test_compiled_qlora_block_on_the_gpu_is_one_graph_and_two_steps_match_eager():
    from lit_qlora.train.compile import compile_blocks

    ids = torch.randint(0, CONFIG.vocab_size, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = random_base(CONFIG, "nf4", torch.bfloat16)
        apply_lora(model, 4, 8, 0.0, dtype=torch.bfloat16)
        model = model.cuda().train()
        if compiled:
            torch._dynamo.reset()
            cos, sin = model.rope(torch.arange(64, device="cuda"), torch.bfloat16)
            x = torch.randn(2, 64, CONFIG.n_embd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            explained = torch._dynamo.explain(model.blocks[0])(x, cos, sin)
            assert explained.graph_count == 1 and explained.graph_break_count == 0
            compile_blocks(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses[compiled] = []
        for _ in range(2):
            loss = lm_loss_sum(model, ids, ids) / ids.numel()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[compiled].append(loss.item())
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)
