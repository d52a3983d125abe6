"""The CUDA code path, executed without a GPU: a tiny model on fake `cuda` tensors (shapes, dtypes and devices, no
data) through NF4 quantization, the NF4 linear, LoRA and the fine-tune's loss (and backward as far as fake CUDA
goes), for QLoRA and LoRA, and FSDP2's sharding of the NF4 base over two fake ranks. Any CPU-only code on the device path (our C kernel, `.data_ptr()`, numpy, a buffer left on the CPU)
raises here; the last test shows that it does.

Needs the CUDA build of torch (on the CPU build, fake CUDA cannot even slice a tensor), which is ~4.7 GB: it has
its own environment, `make test-fake-cuda`, and is skipped elsewhere. Where fake CUDA stops (the autograd engine and
FSDP2's streams ask the CUDA driver for a device context), the test stops; `litqlora estimate` counts backward and
the optimizer step on fake CPU tensors.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.backends.cuda.is_built(),
                                reason="needs the CUDA build of torch: `make test-fake-cuda`")

from lit_qlora.model.config import Config  # noqa: E402
from lit_qlora.estimate.step import _nf4_caches_set_aside  # noqa: E402
from lit_qlora.checkpoint.loading import random_base  # noqa: E402
from lit_qlora.memory.trace import AllocationTrace  # noqa: E402
from lit_qlora.lora.layer import apply_lora, lora_modules  # noqa: E402
from lit_qlora.nf4 import dequantize_nf4, is_nf4, quantize_nf4  # noqa: E402
from lit_qlora.train.loss import lm_loss_sum  # noqa: E402

CONFIG = Config.from_hf_config({"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "max_position_embeddings": 128, "tie_word_embeddings": True})


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=False)  # a real (CPU) tensor reaching the step is an error too


def dry_run(quantize: str) -> dict:
    """Build the base on cuda (weights quantized there: a fake tensor cannot be moved, FakeTensorMode holds weak
    references that `Module.to` cannot swap), add LoRA, run the loss; what ran where."""
    with _nf4_caches_set_aside(), fake_mode(), torch.device("cuda"):
        model = random_base(CONFIG, quantize, torch.bfloat16)
        apply_lora(model, 4, 8, 0.05, dtype=torch.bfloat16)
        model.train()
        ids = torch.zeros(2, 32, dtype=torch.long, device="cuda")
        backward = "done"
        with AllocationTrace(lambda t: "other temporaries"):  # (it takes the loss's target mask as all true)
            try:  # the loss computes its head's gradients as it goes: the autograd engine runs inside forward
                loss = lm_loss_sum(model, ids, ids)
                loss.backward()
            except RuntimeError as e:  # fake CUDA's limit, not ours: run the forward through every chunk alone
                if "hasPrimaryContext" not in str(e) and "device_index" not in str(e):
                    raise
                backward = "stopped by fake CUDA"
                with torch.no_grad():
                    loss = lm_loss_sum(model, ids, ids)
        devices = {p.device.type for p in model.parameters()} | {p.device.type for p in model.buffers()}
        nf4 = [p for p in model.parameters() if is_nf4(p)]
        return {"loss": loss, "devices": devices, "nf4": nf4, "adapters": lora_modules(model), "backward": backward}


def test_nf4_quantize_and_dequantize_run_on_cuda():
    with _nf4_caches_set_aside(), fake_mode():
        w = torch.empty(256, 192, dtype=torch.bfloat16, device="cuda")
        q = quantize_nf4(w)
        assert q.quantized_data.device.type == "cuda" and q.quantized_scalers.device.type == "cuda"
        dense = dequantize_nf4(q, rows=(0, 64))
        assert dense.device.type == "cuda" and tuple(dense.shape) == (64, 192)


@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_the_fine_tune_loss_runs_on_cuda(quantize):
    ran = dry_run(quantize)
    assert ran["devices"] == {"cuda"}
    assert ran["loss"].device.type == "cuda" and ran["loss"].dtype == torch.float32
    assert len(ran["adapters"]) == 2 * 7 + 1
    assert all(p.quantized_data.device.type == "cuda" for p in ran["nf4"])
    assert (len(ran["nf4"]) == 2 * 7 + 1) == (quantize == "nf4")
    print(f"{quantize}: backward {ran['backward']}")


def test_fsdp2_over_two_fake_ranks_shards_the_nf4_base_on_cuda(monkeypatch):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lit_qlora.parallel.distributed import is_sharded, local_tensor

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # FSDP2 asks the driver which device is ours
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = DeviceMesh("cuda", [0, 1])  # (outside fake mode: it reads its rank layout from real tensors)
        with _nf4_caches_set_aside(), fake_mode(), torch.device("cuda"):
            model = random_base(CONFIG, "nf4", torch.bfloat16, world_size=2)
            apply_lora(model, 4, 8, 0.0, dtype=torch.bfloat16)
            from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            register_fsdp_forward_method(model, "forward_hidden")
            assert is_sharded(model)
            q = local_tensor(model.blocks[0].self_attn.q_proj.weight)
            assert is_nf4(q) and q.shape[0] == CONFIG.n_head * CONFIG.head_dim // 2
            ids = torch.zeros(1, 16, dtype=torch.long, device="cuda")
            try:  # FSDP2's first forward creates its CUDA streams: fake CUDA stops here, after the sharding
                with AllocationTrace(lambda t: "other temporaries"):
                    loss = lm_loss_sum(model, ids, ids)
                assert loss.device.type == "cuda"
            except RuntimeError as e:
                if "driver" not in str(e).lower():
                    raise
    finally:
        dist.destroy_process_group()


def test_a_cpu_only_call_on_the_device_path_fails_the_dry_run(monkeypatch):
    """What the tests above guard against: here the dequantization reads its codes through numpy, as a CPU-only
    shortcut would; on fake CUDA that raises."""
    from lit_qlora.nf4 import codec

    eager = codec.dequantize_eager

    def cpu_only(qdata, scales, levels, out):
        qdata.numpy()
        return eager(qdata, scales, levels, out)

    monkeypatch.setattr(codec, "dequantize_eager", cpu_only)
    monkeypatch.setattr(codec, "triton_available", lambda: False)  # the PyTorch path (with Triton: one kernel)
    with pytest.raises((RuntimeError, TypeError, NotImplementedError)):
        dry_run("nf4")
