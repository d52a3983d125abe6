"""q/k/v and gate/up as one base matmul (lit_qlora/model/fused_projections.py): the same outputs and gradients as each
projection's own forward, with each adapter's own A, B, scale and dropout mask; the fallbacks."""

from __future__ import annotations

import pytest
import torch

from lit_qlora.model import fused_projections as fp
from lit_qlora.lora import dropout as lora_dropout
from lit_qlora.model.config import Config
from lit_qlora.checkpoint.loading import random_base
from lit_qlora.lora.layer import apply_lora
from lit_qlora.nf4 import is_nf4, linear

from helpers import FUSED_TINY, lora_model


def step(model, fused: bool, monkeypatch) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Logits, LoRA gradients and the number of fused calls of one forward and backward (seeded alike)."""
    calls = []
    plan = fp.fusion_plan

    def counted(x, modules):
        found = plan(x, modules) if fused else None
        calls.extend([1] if found is not None else [])
        return found

    monkeypatch.setattr(fp, "fusion_plan", counted)
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the dropout seeds: drawn in module order by both paths
    logits = model(ids)
    logits.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, len(calls)


def assert_close(fused, unfused, tol: float) -> None:
    """Logits and every LoRA gradient within `tol` of the largest magnitude of each."""
    (logits, grads, _), (ref_logits, ref_grads, _) = fused, unfused
    assert grads.keys() == ref_grads.keys() and any("q_proj.lora_A" in n for n in grads)
    for name, got, want in [("logits", logits, ref_logits)] + [(n, grads[n], ref_grads[n]) for n in grads]:
        err = (got.float() - want.float()).abs().max().item()
        assert err <= tol * want.float().abs().max().item(), (name, err)


@pytest.mark.parametrize("quantize", ["nf4", "none"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_fused_forward_and_backward_match_each_projections_own(quantize, dropout, monkeypatch):
    # fp32: the same computation to rounding (the dropout masks included: each adapter's seed lines up)
    model = lora_model(quantize, dropout, dtype=torch.float32)
    assert is_nf4(model.model.layers[0].self_attn.q_proj.weight) == (quantize == "nf4")
    fused, unfused = step(model, True, monkeypatch), step(model, False, monkeypatch)
    assert fused[2] == 2 * 2 and unfused[2] == 0  # attention and MLP of both blocks
    assert_close(fused, unfused, 1e-5)


@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_in_bf16_within_its_rounding(quantize, monkeypatch):
    # The fused path rounds less (each adapter's term is added in the matmul's fp32 accumulator; one input
    # gradient matmul instead of a bf16 sum of five): measured 1.9% of the largest gradient at most.
    model = lora_model(quantize, 0.3)
    assert_close(step(model, True, monkeypatch), step(model, False, monkeypatch), 0.04)


def test_with_dropout_each_adapter_has_its_own_mask(monkeypatch):
    """Equal gradients to the unfused path (whose adapters draw a seed each) show the masks line up; here: they
    differ between q, k and v, and a different seed changes the result."""
    model = lora_model("nf4", 0.5)
    seeds = []
    draw = fp.draw_seed
    monkeypatch.setattr(fp, "draw_seed", lambda x: seeds.append(draw(x)) or seeds[-1])
    _, grads, _ = step(model, True, monkeypatch)
    assert len(seeds) == 2 * 5 and len(set(seeds)) == len(seeds)  # q, k, v, gate, up per block
    torch.manual_seed(3)
    model.zero_grad(set_to_none=True)
    model(torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))).float().pow(2).mean().backward()
    q_grad = grads["model.layers.0.self_attn.q_proj.lora_A"]
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.lora_A.grad, q_grad)


def test_qk_norm_on_the_fused_outputs(monkeypatch):
    """Qwen3 normalizes q and k, column slices of one tensor here: its fp32 backward must not write into them."""
    model = lora_model("nf4", 0.0, dtype=torch.float32, model_type="qwen3")
    assert model.config.qk_norm
    fused, unfused = step(model, True, monkeypatch), step(model, False, monkeypatch)
    assert fused[2] == 4
    assert_close(fused, unfused, 1e-5)


def test_biases_and_untargeted_projections_fuse_too(monkeypatch):
    """Qwen2's q/k/v biases are added by the one matmul; a projection without an adapter contributes its base."""
    model = lora_model("nf4", 0.0, bias=True, targets=["q", "v", "up"], dtype=torch.float32)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    fused, unfused = step(model, True, monkeypatch), step(model, False, monkeypatch)
    assert fused[2] == 4
    assert_close(fused, unfused, 1e-5)


def test_fallbacks(monkeypatch):
    model = lora_model("nf4", 0.1)
    attn = model.model.layers[0].self_attn
    modules = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = torch.randn(2, 8, 128, dtype=torch.bfloat16)
    assert fp.fusion_plan(x, modules) is not None
    monkeypatch.setattr(linear, "DENSE_CHUNK_ELEMS", 128 * 128)  # the stack would pass the dense-copy bound
    assert fp.fusion_plan(x, modules) is None
    monkeypatch.undo()
    monkeypatch.setattr(lora_dropout, "hash_dropout_applies", lambda x: False)  # dropout off the CPU: nn.Dropout per module
    assert fp.fusion_plan(x, modules) is None
    model.eval()
    assert fp.fusion_plan(x, modules) is None  # 16 rows at inference: each projection's own NF4 decode kernel
    assert fp.fusion_plan(torch.randn(2, 9, 128, dtype=torch.bfloat16), modules) is not None  # no dropout in eval
    dense = lora_model("none", 0.0).model.layers[0].self_attn
    assert fp.fusion_plan(x, (attn.q_proj, dense.k_proj)) is None  # mixed NF4 / dense
    assert fp.fusion_plan(x.half(), (dense.q_proj, dense.k_proj)) is None  # other dtype than the weights
    handle = dense.q_proj.register_forward_hook(lambda *a: None)
    assert fp.fusion_plan(x, (dense.q_proj, dense.k_proj)) is None  # hooks would be skipped
    handle.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fp.fusion_plan(x, (dense.q_proj, dense.k_proj)) is None
    from lit_qlora.parallel.tensor_parallel import ParallelLoRALinear

    assert not ParallelLoRALinear.fusable


def test_loaded_dense_groups_are_read_in_place_with_the_same_results(monkeypatch):
    """The loader makes q/k/v and gate/up (weights and biases) row slices of one tensor: the fused matmul then reads
    them without a copy, and outputs and gradients are bitwise those of concatenating them in every call."""
    model = lora_model("none", 0.3, bias=True)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        stack = fp.stacked_view([m.weight for m in group])
        assert stack is not None and stack.data_ptr() == group[0].weight.data_ptr()
        assert torch.equal(stack, torch.cat([m.weight for m in group]))
    stack = fp.stacked_view([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    assert stack is not None and stack.data_ptr() == attn.q_proj.bias.data_ptr()
    copies = []
    cat = torch.cat

    def counted(tensors, *args, **kwargs):  # a concatenation of weights (n, 128) or biases (n,)
        if all(t.dim() == 1 or (t.dim() == 2 and t.shape[1] == 128) for t in tensors):
            copies.append(len(tensors))
        return cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", counted)
    shared = step(model, True, monkeypatch)
    assert copies == []
    for block in model.model.layers:  # the same weights, each in its own tensor: concatenated per call
        for m in (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj, block.mlp.gate_proj,
                  block.mlp.up_proj):
            m.weight = torch.nn.Parameter(m.weight.detach().clone(), requires_grad=False)
            m.bias = None if m.bias is None else torch.nn.Parameter(m.bias.detach().clone(), requires_grad=False)
    assert fp.stacked_view([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is None
    copies.clear()
    separate = step(model, True, monkeypatch)
    assert copies.count(3) >= 2 * 2 and copies.count(2) >= 2 * 2  # per block: q/k/v (+ biases), gate/up
    assert torch.equal(shared[0], separate[0]) and shared[1].keys() == separate[1].keys()
    assert all(torch.equal(shared[1][n], separate[1][n]) for n in shared[1])
    model.share_projection_storage()  # again: each group back in one tensor, the values unchanged
    assert fp.stacked_view([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is not None
    assert torch.equal(step(model, True, monkeypatch)[0], shared[0])


def test_share_storage_leaves_nf4_and_trainable_weights_alone():
    model = lora_model("nf4", 0.0)
    attn = model.model.layers[0].self_attn
    assert not fp.share_storage((attn.q_proj, attn.k_proj, attn.v_proj))
    assert all(is_nf4(m.weight) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    dense = lora_model("none", 0.0).model.layers[0].mlp
    dense.gate_proj.weight.requires_grad_(True)
    dense.gate_proj.weight = torch.nn.Parameter(dense.gate_proj.weight.detach().clone())
    assert not fp.share_storage((dense.gate_proj, dense.up_proj))


def test_the_nf4_stack_is_the_dequantized_weights_in_the_scratch_buffer():
    model = lora_model("nf4", 0.0)
    attn = model.model.layers[0].self_attn
    weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    stack = linear.dense_stack(weights, torch.bfloat16)
    assert torch.equal(stack, torch.cat([w.get_original_weight() for w in weights]))
    assert stack.data_ptr() == linear.dense_rows(weights[0], torch.bfloat16, 0, 128).data_ptr()  # one buffer


def test_inference_and_adapters_disabled_use_the_fused_path(monkeypatch):
    from lit_qlora.lora.layer import adapters_disabled

    model = lora_model("none", 0.0).eval()
    ids = torch.randint(0, 256, (1, 10))
    with torch.inference_mode():
        fused = model(ids)
        with adapters_disabled(model):
            base = model(ids)
        monkeypatch.setattr(fp, "fusion_plan", lambda x, m: None)
        ref = model(ids)
        with adapters_disabled(model):
            ref_base = model(ids)
    torch.testing.assert_close(fused.float(), ref.float(), atol=0.03, rtol=0.02)
    assert torch.equal(base, ref_base)  # the base alone: the same matmul values either way (exact)


def finetune_losses(fused: bool, monkeypatch, steps: int = 6) -> list[float]:
    """A tiny QLoRA fine-tune (bf16, dropout, activation checkpointing, AdamW): its losses step by step."""
    from lit_qlora.train.loss import lm_loss_sum

    monkeypatch.setattr(fp, "fusion_plan", fp.fusion_plan if fused else (lambda x, modules: None))
    config = Config.from_hf_config(FUSED_TINY)
    torch.manual_seed(0)
    model = apply_lora(random_base(config, "nf4", torch.bfloat16), r=4, alpha=8, dropout=0.05, dtype=torch.bfloat16)
    model.checkpoint_blocks = config.n_layer
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = lm_loss_sum(model, ids, ids) / ids.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    monkeypatch.undo()
    return losses


def test_a_tiny_qlora_finetune_has_the_same_losses(monkeypatch):
    fused, unfused = finetune_losses(True, monkeypatch), finetune_losses(False, monkeypatch)
    assert fused[-1] < fused[0] - 0.5  # it learns (the same batch again)
    assert fused == pytest.approx(unfused, rel=1e-3)  # measured: 1.7e-4 at most (bf16 roundings)
