"""LoRA dropout on CPU (lit_qlora/lora_dropout.py): the C kernel's mask equals the PyTorch ops', it drops p of the
values, gradients equal autograd through the same mask, nothing of x's size is saved, and checkpointing's
recompute sees the same mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from lit_qlora import lora_dropout
from lit_qlora.lora import LoRALinear
from lit_qlora.lora_dropout import _dropped_eager, dropped, dropped_lora, keep_mask_eager, keep_threshold
from lit_qlora.nf4 import native


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
            "from lit_qlora import lora_dropout\nfrom lit_qlora.nf4 import native\n"
            "lora_dropout.dropped(torch.randn(4, 100, dtype=torch.bfloat16), 1, 0.1)\n"
            "print(native.native_error(), lora_dropout._kernel_checked)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    if "no C compiler" in out:
        pytest.skip(out)
    assert out.strip() == "None {torch.bfloat16: True}"


def test_in_place_masking_equals_the_copy():
    x = torch.randn(5, 300).bfloat16()
    copy = dropped(x, 9, 0.2)
    same = x.clone()
    assert dropped(same, 9, 0.2, inplace=True).data_ptr() == same.data_ptr()
    assert torch.equal(same, copy)
