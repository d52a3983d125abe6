"""LoRA dropout on CPU (lit_qlora/lora/dropout.py): the C kernel's mask equals the PyTorch ops', it drops p of the
values, gradients equal autograd through the same mask, nothing of x's size is saved, and checkpointing's
recompute sees the same mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from lit_qlora.lora import dropout as lora_dropout
from lit_qlora.lora.layer import LoRALinear
from lit_qlora.lora.dropout import _dropped_eager, dropped, dropped_lora, keep_mask_eager, keep_threshold
from lit_qlora.lora import native
from lit_qlora.base.recompute import reusing_first_run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_and_pytorch_ops_drop_the_same_elements_at_rate_p(dtype):
    if not native.use_native(dtype):
        pytest.skip("no C kernel for this dtype here")
    x = torch.randn(301, 577, generator=torch.Generator().manual_seed(0)).to(dtype)  # ragged: scalar tails too
    out = torch.empty_like(x)
    native.dropout_elements(x, out, 987654321, keep_threshold(0.05), 1 / 0.95)
    assert torch.equal(out, _dropped_eager(x, 987654321, keep_threshold(0.05), 1 / 0.95))
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.95) < 0.003  # 173,677 draws: 4 sigma is 0.0021
    assert torch.equal(out[kept], (x[kept].float() * (1 / 0.95)).to(dtype))  # kept: scaled, rounded once


def test_masks_of_two_seeds_are_independent_and_the_same_seed_repeats():
    n, t = 1 << 20, keep_threshold(0.5)
    a, b = keep_mask_eager(n, 1, t), keep_mask_eager(n, 2, t)
    assert torch.equal(a, keep_mask_eager(n, 1, t))
    both = (a & b).float().mean().item()
    assert abs(both - 0.25) < 0.003  # independent halves overlap on a quarter
    # neighbouring elements are not correlated either
    assert abs((a[1:] & a[:-1]).float().mean().item() - 0.25) < 0.003


def test_gradients_equal_autograd_through_the_same_mask():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 48, generator=g, requires_grad=True)
    a = torch.randn(4, 48, generator=g, requires_grad=True)
    b = torch.randn(32, 4, generator=g, requires_grad=True)
    torch.manual_seed(7)
    y = dropped_lora(x, a, b, 2.0, 0.25)
    torch.manual_seed(7)
    seed = int(torch.randint(0, 2**32, (), dtype=torch.int64).item())  # the seed dropped_lora drew
    keep = keep_mask_eager(x.numel(), seed, keep_threshold(0.25)).view(x.shape)
    xr, ar, br = (t.detach().clone().requires_grad_() for t in (x, a, b))
    ref = ((xr * keep / 0.75) @ ar.T @ br.T) * 2.0
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn(y.shape, generator=g)
    y.backward(grad)
    ref.backward(grad)
    for got, want in ((x.grad, xr.grad), (a.grad, ar.grad), (b.grad, br.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (x.grad[~keep] == 0).all()  # a dropped input gets no gradient through the adapter


def test_saves_the_input_and_the_rank_wide_product_only():
    layer = LoRALinear(nn.Linear(64, 96, bias=False), r=4, alpha=8, dropout=0.1).train()
    x = torch.randn(3, 10, 64, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum().backward()
    saved.pop(layer.weight.untyped_storage().data_ptr(), None)  # the frozen base matmul's own
    # x, A, B and x A^T (3 x 10 x 4): no mask, no dropped copy of x (torch's dropout would add 2 x.nbytes)
    assert sum(saved.values()) == x.nbytes + layer.lora_A.nbytes + layer.lora_B.nbytes + 3 * 10 * 4 * 4


def test_checkpointing_recomputes_the_same_mask_and_eval_drops_nothing():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(32, 32, bias=False), r=4, alpha=8, dropout=0.3)
    nn.init.normal_(layer.lora_B)
    x = torch.randn(2, 5, 32, requires_grad=True)
    grads = []
    for use_checkpoint in (False, True):
        torch.manual_seed(3)
        x.grad = None
        layer.zero_grad()
        y = checkpoint(layer, x, use_reentrant=False) if use_checkpoint else layer(x)
        y.pow(2).sum().backward()
        grads.append((x.grad.clone(), layer.lora_A.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    layer.eval()
    with torch.no_grad():
        base_plus_adapter = layer.weight @ x[0, 0] + layer.scale * layer.lora_B @ (layer.lora_A @ x[0, 0])
        torch.testing.assert_close(layer(x)[0, 0], base_plus_adapter, rtol=1e-5, atol=1e-5)


def test_without_the_kernel_the_pytorch_ops_give_the_same_values(monkeypatch):
    x = torch.randn(4, 333).bfloat16()
    with_kernel = dropped(x, 42, 0.05)
    monkeypatch.setattr(lora_dropout, "_use_kernel", lambda dtype: False)
    assert torch.equal(dropped(x, 42, 0.05), with_kernel)


def test_the_kernels_are_trusted_when_first_used_under_a_bf16_default_dtype():
    """A LoRA (bf16 base) run first needs the C kernels inside a training step, where bf16-true precision has made
    bf16 the default dtype: their self-tests must not depend on it (they did: the NF4 thresholds were built with
    torch.tensor's default dtype, the self-test failed and the dropout fell back to PyTorch ops, 2x slower)."""
    import subprocess
    import sys

    code = ("import torch\ntorch.set_default_dtype(torch.bfloat16)\n"
            "from lit_qlora.lora import dropout as lora_dropout\nfrom lit_qlora.lora import native\n"
            "lora_dropout.dropped(torch.randn(4, 100, dtype=torch.bfloat16), 1, 0.1)\n"
            "print(native.native_error(), lora_dropout._kernel_checked)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    if "no C compiler" in out:
        pytest.skip(out)
    assert out.strip() == "None {torch.bfloat16: True}"


def test_the_kernels_ship_with_lora_and_build_with_nf4s_helpers(tmp_path, monkeypatch):
    """lora/kernels.c is package data of lit_qlora.lora (pyproject.toml), built by NF4's build_library with NF4's
    simd.h beside it; the cached library's name changes with either text."""
    from pathlib import Path

    from lit_qlora.nf4 import native as nf4_native

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")

    data = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert "kernels.c" in data["tool"]["setuptools"]["package-data"]["lit_qlora.lora"]
    assert "simd.h" in data["tool"]["setuptools"]["package-data"]["lit_qlora.nf4"]
    source = native.kernel_source()
    assert "void lora_drop_down(" in source and '#include "simd.h"' in source
    assert "lora_" not in nf4_native.kernel_source()  # NF4's kernels are NF4's alone
    if native.native_lib() is None:
        pytest.skip(f"no LoRA kernels here: {native.native_error()}")
    monkeypatch.setenv("LIT_QLORA_KERNEL_CACHE", str(tmp_path))
    sources = {"kernels.c": source, "simd.h": nf4_native.simd_header()}
    nf4_native.build_library("lora", sources, {})
    nf4_native.build_library("lora", {**sources, "simd.h": sources["simd.h"] + "\n/* edited */\n"}, {})
    assert len(list(tmp_path.glob("lora_*.so"))) == 2


def test_in_place_masking_equals_the_copy():
    x = torch.randn(5, 300).bfloat16()
    copy = dropped(x, 9, 0.2)
    same = x.clone()
    assert dropped(same, 9, 0.2, inplace=True).data_ptr() == same.data_ptr()
    assert torch.equal(same, copy)


def _reference(x, a, grad_h, seeds, p, grad_x):
    """The fused kernels' results from the mask's definition, in fp32: h, grad_a, grad_x."""
    keep = [keep_mask_eager(x.numel(), s, keep_threshold(p)).view(x.shape) for s in seeds]
    xm = [x.float() * k / (1 - p) for k in keep]
    h = [m @ t.float().T for m, t in zip(xm, a)]
    grad_a = [g.float().T @ m for g, m in zip(grad_h, xm)]
    gx = sum((g.float() @ t.float()) * k / (1 - p) for g, t, k in zip(grad_h, a, keep))
    return h, grad_a, gx + (0 if grad_x is None else grad_x.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rank", [5, 8, 16, 24])
def test_fused_kernels_equal_the_dropped_copy_and_matmuls(dtype, rank):
    """Dropout and the down projection in one pass (three adapters of one input, each its own seed): the same
    values as dropping a copy of x and multiplying, in forward and backward, for ragged shapes (tails), ranks
    that fill one, part of one or several rank blocks, with grad_x added to or made new."""
    if not native.use_native(dtype):
        pytest.skip("no C kernel for this dtype here")
    assert lora_dropout._fused_kernel(torch.empty(1, 1, dtype=dtype), [torch.empty(rank, 1)])  # passed its check
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(67, 301, generator=g).to(dtype)
    a = [(torch.randn(rank, 301, generator=g) * 0.1).to(dtype) for _ in range(3)]
    grad_h = [torch.randn(67, rank, generator=g).to(dtype) for _ in range(3)]
    seeds, p = [1, 12345, 2**32 - 7], 0.1
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for base in (None, torch.randn(67, 301, generator=g).to(dtype)):
        h = lora_dropout.down(x, a, seeds, p)
        grad_a, grad_x = lora_dropout.down_backward(x, a, grad_h, seeds, p, None if base is None else base.clone(),
                                                    True)
        want_h, want_a, want_x = _reference(x, a, grad_h, seeds, p, base)
        for got, want in [*zip(h, want_h), *zip(grad_a, want_a), (grad_x, want_x)]:
            assert got.dtype == dtype and got.shape == want.shape
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    kept_grad = grad_x.float() - base.float()
    dropped_everywhere = ~torch.stack([keep_mask_eager(x.numel(), s, keep_threshold(p)).view(x.shape)
                                       for s in seeds]).any(0)
    assert dropped_everywhere.sum() > 0 and (kept_grad[dropped_everywhere].abs() < 1e-2).all()


def test_fused_kernels_serve_ranks_up_to_the_limit_and_the_dropped_copy_beyond(monkeypatch):
    calls = []
    monkeypatch.setattr(native, "lora_drop_down", lambda *args: calls.append(args[1][0].shape[0]))
    x = torch.randn(8, 64)
    for r in (lora_dropout.FUSED_MAX_RANK, lora_dropout.FUSED_MAX_RANK + 1):
        h = lora_dropout.down(x, [torch.randn(r, 64)], [3], 0.1)
        assert h[0].shape == (8, r)
    assert calls == [lora_dropout.FUSED_MAX_RANK]
    assert not lora_dropout._fused_kernel(x, [torch.randn(4, 64), torch.randn(8, 64)])  # one rank per call


def test_fused_kernels_that_disagree_are_not_used(monkeypatch):
    monkeypatch.setattr(lora_dropout, "_fused_checked", {})
    monkeypatch.setattr(native, "lora_drop_down", lambda x, a, h, *rest: [t.fill_(1.0) for t in h])
    x = torch.randn(4, 33)
    assert not lora_dropout._fused_kernel(x, [torch.randn(2, 33)])
    want = dropped(x, 3, 0.1) @ torch.ones(2, 33).T
    assert torch.equal(lora_dropout.down(x, [torch.ones(2, 33)], [3], 0.1)[0], want)


def test_a_lora_layer_trains_the_same_through_the_fused_kernel_and_without_it(monkeypatch):
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(96, 80, bias=False), r=8, alpha=16, dropout=0.2).bfloat16()
    nn.init.normal_(layer.lora_B)
    x = torch.randn(3, 11, 96, dtype=torch.bfloat16, requires_grad=True)
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(lora_dropout, "_fused_kernel", lambda *args: False)
        x.grad = None
        layer.zero_grad()
        torch.manual_seed(5)
        y = layer(x)
        y.float().pow(2).sum().backward()
        results.append([y, x.grad, layer.lora_A.grad, layer.lora_B.grad])
    for got, want in zip(*results):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_checkpointing_reuses_the_first_runs_down_products_and_changes_no_gradient(quantize, monkeypatch):
    """A checkpointed block's recompute takes each adapter's dropout(x) A^T from the block's first run (the same
    seeds), so dropout's forward kernel runs once per adapter call, not twice, and every gradient is what the
    model without checkpointing computes, bit for bit."""
    from lit_qlora.model.config import Config
    from lit_qlora.checkpoint.loading import random_base
    from lit_qlora.lora.layer import apply_lora
    from lit_qlora.train.loss import lm_loss_sum

    config = Config.from_hf_config({"model_type": "llama", "vocab_size": 256, "hidden_size": 128,
                                    "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "max_position_embeddings": 64})
    torch.manual_seed(0)
    model = apply_lora(random_base(config, quantize, torch.bfloat16), r=8, alpha=16, dropout=0.1,
                       dtype=torch.bfloat16).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    lora_dropout._fused_kernel(torch.empty(1, 8, dtype=torch.bfloat16), [torch.empty(8, 8)])  # its check runs `down`
    computed = []
    compute = lora_dropout._down
    monkeypatch.setattr(lora_dropout, "_down", lambda *args: computed.append(1) or compute(*args))
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    runs = {}
    for blocks in (0, config.n_layer):
        model.checkpoint_blocks = blocks
        model.zero_grad(set_to_none=True)
        computed.clear()
        torch.manual_seed(4)
        lm_loss_sum(model, ids, ids).backward()
        runs[blocks] = (len(computed), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (plain_calls, plain), (ckpt_calls, ckpt) = runs[0], runs[config.n_layer]
    # per block: q/k/v, o, gate/up, down; plus the head (NF4: in the vocabulary-sliced loss); the recompute adds none
    assert (plain_calls, ckpt_calls) == (4 * config.n_layer + 1,) * 2
    assert plain.keys() == ckpt.keys() and len(plain) == 2 * (7 * config.n_layer + 1)
    for name in plain:
        assert torch.equal(plain[name], ckpt[name]), name


def test_a_recompute_that_takes_another_path_computes_afresh():
    x = torch.randn(6, 32)
    a = [torch.randn(4, 32)]
    run = reusing_first_run(lambda seed: lora_dropout.down(x, a, [seed], 0.2)[0])
    first = run(7)
    assert torch.equal(run(8), lora_dropout._down(x, a, [8], 0.2)[0])  # another seed: not the stashed product
    assert not torch.equal(first, run(8))


# The GPU's path (replayed mask), exercised on CPU tensors: it is device-generic, only the choice is CUDA-only.


def _replay_reference(x: torch.Tensor, a: torch.Tensor, p: float, state: torch.Tensor):
    gen = torch.Generator()
    gen.set_state(state)
    keep = torch.empty_like(x, dtype=torch.uint8).bernoulli_(1 - p, generator=gen)
    return x * keep / (1 - p) @ a.T, keep


def test_replayed_dropout_equals_the_same_mask_through_autograd_and_drops_p():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 300, 64, generator=gen, requires_grad=True)
    a = torch.randn(8, 64, generator=gen, requires_grad=True)
    state = torch.get_rng_state()
    h = lora_dropout.replayed_dropout_down(x, a, 0.1)
    xr, ar = x.detach().clone().requires_grad_(), a.detach().clone().requires_grad_()
    want, keep = _replay_reference(xr, ar, 0.1, state)
    assert torch.allclose(h, want, atol=1e-5)
    assert abs(keep.float().mean().item() - 0.9) < 0.004  # 76,800 draws: 4 sigma is 0.0043
    g = torch.randn(h.shape, generator=gen)
    h.backward(g)
    want.backward(g)
    assert torch.allclose(x.grad, xr.grad, atol=1e-5) and torch.allclose(a.grad, ar.grad, rtol=1e-5, atol=1e-4)


def test_replayed_dropout_saves_the_input_and_no_mask():
    x = torch.randn(2, 256, 64, dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        h = lora_dropout.replayed_dropout_down(x, a, 0.05)
    assert [t.data_ptr() for t in saved] == [x.data_ptr(), a.data_ptr()]  # nn.Dropout: + mask + dropped copy
    h.float().sum().backward()
    assert x.grad is not None and a.grad is not None


def test_replayed_lora_term_equals_the_same_mask_through_autograd_and_saves_no_mask():
    """The GPU's whole LoRA term in one node (`_ReplayedLoRA`): out + scale * dropout(x) a^T b^T, its gradients to
    x, out, a and b as autograd's through the same mask; saved: x, a, b and the r-wide product, no mask."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 150, 64, generator=gen, requires_grad=True)
    out = torch.randn(2, 150, 48, generator=gen, requires_grad=True)
    a = torch.randn(8, 64, generator=gen, requires_grad=True)
    b = torch.randn(48, 8, generator=gen, requires_grad=True)
    torch.manual_seed(11)
    state = torch.get_rng_state()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = lora_dropout.replayed_lora(x, out, a, b, 2.0, 0.1)
    assert [tuple(t.shape) for t in saved] == [(2, 150, 64), (8, 64), (48, 8), (300, 8)]
    leaves = [t.detach().clone().requires_grad_() for t in (x, out, a, b)]
    dropped, keep = _replay_reference(leaves[0], leaves[2], 0.1, state)
    want = leaves[1] + dropped @ leaves[3].T * 2.0
    assert (y - want).norm() <= 1e-6 * want.norm()
    assert abs(keep.float().mean().item() - 0.9) < 0.0087  # 19,200 draws: 4 sigma
    g = torch.randn(y.shape, generator=gen)
    y.backward(g)
    want.backward(g)
    for got, ref in zip((x, out, a, b), leaves):
        assert (got.grad - ref.grad).norm() <= 1e-6 * ref.grad.norm()


def test_replayed_dropout_under_checkpointing_equals_no_checkpointing(monkeypatch):
    monkeypatch.setattr(lora_dropout, "hash_dropout_applies", lambda x: False)
    monkeypatch.setattr(lora_dropout, "replayed_dropout_applies", lambda x: True)  # as on a GPU
    layer = LoRALinear(nn.Linear(64, 48, bias=False), r=4, alpha=8, dropout=0.2)
    nn.init.normal_(layer.lora_B, std=0.1)
    x = torch.randn(3, 20, 64, generator=torch.Generator().manual_seed(1))
    grads = []
    for use_checkpoint in (False, True):
        torch.manual_seed(5)
        xi = x.clone().requires_grad_()
        y = checkpoint(layer, xi, use_reentrant=False) if use_checkpoint else layer(xi)
        y.square().sum().backward()
        grads.append((xi.grad.clone(), layer.lora_A.grad.clone(), layer.lora_B.grad.clone()))
        layer.zero_grad()
    for plain, checkpointed in zip(*grads):
        assert torch.equal(plain, checkpointed)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    want, _ = _replay_reference(x, layer.lora_A.detach(), 0.2, state)
    got = layer(x) - torch.nn.functional.linear(x, layer.weight)
    assert torch.allclose(got, want @ layer.lora_B.detach().T * layer.scale, atol=1e-5)
