"""The vocabulary-sliced loss over an NF4 head equals the token-chunked one: loss, hidden-state and LoRA gradients."""

from __future__ import annotations

import pytest
import torch

from lit_qlora.lora.layer import LoRALinear, adapters_disabled
from lit_qlora.nf4 import quantize_nf4
from lit_qlora.nf4.linear import FrozenNF4Linear
from lit_qlora.train import loss as loss_module
from lit_qlora.train.loss import chunked_cross_entropy_sum
from lit_qlora.train.nf4_head_loss import nf4_head_ce_sum, vocab_sliced_head


def nf4_head(vocab: int, dim: int, dtype: torch.dtype, lora: bool) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(dim, vocab, bias=False, dtype=dtype)
    base.weight = torch.nn.Parameter(quantize_nf4((torch.randn(vocab, dim, generator=gen) * 0.05).to(dtype)),
                                     requires_grad=False)
    if not lora:
        head = FrozenNF4Linear(dim, vocab, bias=False, device="meta")
        head.weight = base.weight
        return head
    head = LoRALinear(base, r=4, alpha=8, dtype=dtype)
    torch.nn.init.normal_(head.lora_B, std=0.05, generator=gen)
    return head


@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_vocab_sliced_loss_equals_the_token_chunked_loss(lora, dtype, tol):
    vocab, dim, n = 1000, 64, 90
    head = nf4_head(vocab, dim, dtype, lora)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, n + 1, dim, generator=gen).to(dtype)
    labels = torch.randint(0, vocab, (1, n + 1), generator=gen)
    labels[0, 5:9] = -100
    results = []
    for sliced in (False, True):
        h = hidden.clone().requires_grad_()
        if sliced:  # 2048 logits a slice: 22 rows of 1000, so several slices (on 64-value block boundaries)
            flat, targets = h[:, :-1].reshape(-1, dim), labels[:, 1:].reshape(-1)
            keep = targets != -100
            total = nf4_head_ce_sum(head, flat[keep], targets[keep], logits_elems=2048)
        else:
            total = chunked_cross_entropy_sum(head, h, labels, chunk_tokens=7)
        (total * 0.5).backward()
        grads = [h.grad] + ([head.lora_A.grad, head.lora_B.grad] if lora else [])
        results.append((total.detach().float(), [g.float().clone() for g in grads]))
        if lora:
            head.lora_A.grad = head.lora_B.grad = None
    (ref, ref_grads), (got, got_grads) = results
    assert got == pytest.approx(ref.item(), rel=tol)
    for r, g in zip(ref_grads, got_grads):
        assert (r - g).norm() <= tol * r.norm() + 1e-6


def test_gpu_slices_are_wider_and_give_the_same_loss_and_gradients(monkeypatch):
    """Where weights are dequantized whole (CUDA), a slice's dense rows are bounded by the logits it holds, not by
    the CPU's DENSE_CHUNK_ELEMS: fewer slices, each one launch fewer per step, and the same loss and gradients."""
    from lit_qlora.nf4 import linear
    from lit_qlora.train import nf4_head_loss

    vocab, dim, n = 1000, 64, 86
    head = nf4_head(vocab, dim, torch.float32, lora=True)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(n, dim, generator=gen)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    monkeypatch.setattr(nf4_head_loss, "DENSE_CHUNK_ELEMS", 16 * dim)  # the CPU's bound: 16 rows a slice
    real, calls = nf4_head_loss.dense_rows, []
    monkeypatch.setattr(nf4_head_loss, "dense_rows", lambda *args: calls.append(args[2:4]) or real(*args))
    results = []
    for gpu in (False, True):
        monkeypatch.setattr(linear, "whole_weight", lambda weight, gpu=gpu: gpu)
        calls.clear()
        h = hidden.clone().requires_grad_()
        total = nf4_head_ce_sum(head, h, targets, logits_elems=2048)  # 23 rows of logits a slice
        total.backward()
        results.append((total.detach(), h.grad, head.lora_A.grad, head.lora_B.grad, len(calls) // 2))
        head.lora_A.grad = head.lora_B.grad = None
    (cpu_total, *cpu_grads, cpu_slices), (gpu_total, *gpu_grads, gpu_slices) = results
    assert (cpu_slices, gpu_slices) == (63, 44)  # 1000 rows in 16 (CPU) or 23 rounded to NF4 blocks (GPU)
    assert gpu_total == pytest.approx(cpu_total.item(), rel=1e-6)
    for c, g in zip(cpu_grads, gpu_grads):
        assert (c - g).norm() <= 1e-5 * c.norm()


def test_cuda_loss_chunks_hold_more_logits():
    assert loss_module.logits_chunk_elems(torch.device("cpu")) == loss_module.LOGITS_CHUNK_ELEMS == 1 << 22
    assert loss_module.logits_chunk_elems(torch.device("cuda")) == loss_module.CUDA_LOGITS_CHUNK_ELEMS == 1 << 25


def test_vocab_sliced_loss_sees_the_adapter_without_gradients_and_not_when_disabled():
    head = nf4_head(512, 64, torch.float32, lora=True)
    hidden, targets = torch.randn(40, 64), torch.randint(0, 512, (40,))
    # the token-chunked loss pairs position t with label t + 1: one more position, one label shifted in
    padded, labels = torch.cat([hidden, hidden[:1]])[None], torch.cat([targets[:1], targets])[None]
    with torch.no_grad():
        reference = chunked_cross_entropy_sum(head, padded, labels)
        sliced = nf4_head_ce_sum(head, hidden, targets, logits_elems=1024)
        with adapters_disabled(head):
            base = nf4_head_ce_sum(head, hidden, targets, logits_elems=1024)
            base_reference = chunked_cross_entropy_sum(head, padded, labels)
    assert sliced.item() == pytest.approx(reference.item(), rel=1e-5)
    assert base.item() == pytest.approx(base_reference.item(), rel=1e-5)
    assert abs(base.item() - sliced.item()) > 1e-3  # the adapter changes the loss


def test_which_heads_take_the_vocab_sliced_loss(monkeypatch):
    nf4 = nf4_head(512, 64, torch.bfloat16, lora=True)
    dense = torch.nn.Linear(64, 512, bias=False)
    assert vocab_sliced_head(nf4, None) and vocab_sliced_head(nf4_head(512, 64, torch.bfloat16, False), None)
    assert not vocab_sliced_head(nf4, 30.0)  # Gemma 2's soft-capped logits: the token-chunked loss
    assert not vocab_sliced_head(dense, None)  # a dense head is not dequantized: nothing to save
    calls = []
    monkeypatch.setattr(loss_module, "nf4_head_ce_sum", lambda *a: calls.append(a) or torch.zeros(()))
    model = torch.nn.Module()
    model.lm_head, model.config = nf4, type("C", (), {"final_softcap": None, "vocab_size": 512})()
    model.forward_hidden = lambda ids: torch.randn(1, ids.shape[1], 64, dtype=torch.bfloat16)
    loss_module.lm_loss_sum(model, torch.zeros(1, 9, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long))
    assert len(calls) == 1 and calls[0][1].shape == (8, 64)
