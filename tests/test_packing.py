"""Packing without leaks (issue 29): a packed document attends only within itself, at positions from 0, so its logits
and loss are those it has alone, for every family (sliding windows, Gemma 2's soft cap, Gemma 3's local RoPE base,
Phi-3's longrope); the masks against a masked softmax written out by hand; a packed `finetune` step's loss against
its documents' losses alone; unpacked batches keep plain causal attention."""

from __future__ import annotations

import json
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import lit_qlora.model.transformer as model_module
from lit_qlora.model.attention_mask import attention_mask, document_ids, document_lengths
from lit_qlora.data.sft import IGNORE_INDEX, Collate, pack
from lit_qlora.model.attention import capped_attention
from lit_qlora.train.loss import lm_loss_sum

from helpers import FAMILY_CASES, packable_documents, reference_and_ours  # tiny random models of every family

def spans(positions: torch.Tensor, lengths: list[int]) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document of a padded packed batch whose rows hold `lengths` real tokens."""
    out = []
    for row, length in enumerate(lengths):
        starts = (positions[row, :length] == 0).nonzero().flatten().tolist()
        out += [(row, start, end) for start, end in zip(starts, starts[1:] + [length])]
    return out


# ---------------------------------------------------------------------------------------------- every family

@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_each_packed_document_has_its_logits_and_loss_alone(case):
    _, model, config = reference_and_ours(*FAMILY_CASES[case])
    samples = packable_documents(config.vocab_size)
    packed = pack(samples, max_seq_length=30)
    assert [len(s) for s in packed] == [30, 20]
    batch = Collate(pad_id=0)(packed)
    docs = spans(batch["positions"], [30, 20])
    assert [(row, end - start) for row, start, end in docs] == [(0, 7), (0, 19), (0, 4), (1, 11), (1, 9)]
    with torch.no_grad():
        logits = model(batch["input_ids"], positions=batch["positions"])
        total = lm_loss_sum(model, batch["input_ids"], batch["labels"], batch["positions"])
        alone_total = 0.0
        for sample, (row, start, end) in zip(samples, docs):
            alone = model(sample.input_ids[None])[0]
            assert (logits[row, start:end] - alone).abs().max() <= 1e-5, (row, start)
            # The document's next-token loss over the same targets (its first label is no target either way).
            targets = sample.labels[1:]
            in_pack = F.cross_entropy(logits[row, start : end - 1], targets, ignore_index=IGNORE_INDEX)
            assert in_pack.item() == pytest.approx(F.cross_entropy(alone[:-1], targets, ignore_index=IGNORE_INDEX)
                                                   .item(), abs=1e-5)
            alone_total += lm_loss_sum(model, sample.input_ids[None], sample.labels[None]).item()
        assert total.item() == pytest.approx(alone_total, rel=1e-5)
        # Without positions the documents see each other and run on in position: the check above can fail.
        leaky = model(batch["input_ids"])
        assert (leaky[0, 7:26] - model(samples[1].input_ids[None])[0]).abs().max() > 1e-2


def test_packed_positions_with_activation_checkpointing_give_the_same_gradients():
    _, model, config = reference_and_ours(*FAMILY_CASES["gemma2-tight-softcaps"])
    batch = Collate(pad_id=0)(pack(packable_documents(config.vocab_size), max_seq_length=30))
    grads = []
    for blocks in (0, config.n_layer):
        model.zero_grad()
        model.checkpoint_blocks = blocks
        lm_loss_sum(model, batch["input_ids"], batch["labels"], batch["positions"]).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    assert all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(*grads))


def test_packed_positions_are_refused_while_decoding():
    _, model, _ = reference_and_ours(*FAMILY_CASES["llama-untied"])
    model.set_kv_cache(1, 16)
    with pytest.raises(ValueError, match="not KV-cache decoding"):
        model(torch.tensor([[5, 6]]), input_pos=torch.arange(2), positions=torch.arange(2)[None])


# ---------------------------------------------------------------------------------------------- the masks

ROWS = [[5, 4, 3], [7, 2]]  # document lengths of two rows of 12 tokens (the second padded by 3)
T = 12


def row_positions() -> torch.Tensor:
    positions = torch.zeros(len(ROWS), T, dtype=torch.long)
    for r, lengths in enumerate(ROWS):
        positions[r, : sum(lengths)] = torch.cat([torch.arange(n) for n in lengths])
    return positions


def reference_allowed(packed: bool, window: Optional[int]) -> torch.Tensor:
    """(B, T, T): may query i attend key j, written out: j <= i, same document (padding: each token its own), and
    i - j < window."""
    allowed = torch.zeros(len(ROWS), T, T, dtype=torch.bool)
    for r, lengths in enumerate(ROWS):
        doc = [d for d, n in enumerate(lengths) for _ in range(n)] + list(range(100, 100 + T - sum(lengths)))
        for i in range(T):
            for j in range(T):
                same = doc[i] == doc[j] if packed else True
                allowed[r, i, j] = j <= i and same and (window is None or i - j < window)
    return allowed


def reference_attention(q, k, v, allowed, scale: float, cap: Optional[float] = None) -> torch.Tensor:
    """Each query's softmax over the keys it may attend, one at a time (float64)."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros_like(q)
    for b in range(q.size(0)):
        for h in range(q.size(1)):
            for i in range(q.size(2)):
                keys = allowed[b, i].nonzero().flatten()
                scores = k[b, h, keys] @ q[b, h, i] * scale
                if cap is not None:
                    scores = torch.tanh(scores / cap) * cap
                out[b, h, i] = torch.softmax(scores, dim=0) @ v[b, h, keys]
    return out.float()


MASK_KINDS = {"causal": (False, None), "sliding": (False, 3), "documents": (True, None),
              "documents-sliding": (True, 3)}


@pytest.mark.parametrize("kind", list(MASK_KINDS))
def test_masks_give_each_query_its_reference_masked_softmax(kind):
    packed, window = MASK_KINDS[kind]
    positions = row_positions() if packed else None
    mask = attention_mask(torch.arange(T), T, window, decoding=False, positions=positions)
    allowed = reference_allowed(packed, window)
    if kind == "causal":
        assert mask is None  # plain `is_causal` attention: no mask is built
    else:
        assert torch.equal(mask.expand(len(ROWS), 1, T, T)[:, 0], allowed)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(len(ROWS), 2, T, 8, generator=g) for _ in range(3))
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=0.3)
    assert (sdpa - reference_attention(q, k, v, allowed, 0.3)).abs().max() <= 1e-5
    # Gemma 2's soft-capped scores take the same mask.
    capped = capped_attention(q, k, v, mask, 0.3, cap=1.5)
    assert (capped - reference_attention(q, k, v, allowed, 0.3, cap=1.5)).abs().max() <= 1e-5


def test_documents_and_their_lengths_come_from_the_positions():
    positions = row_positions()
    assert document_ids(positions).tolist() == [[1] * 5 + [2] * 4 + [3] * 3, [1] * 7 + [2] * 2 + [3, 4, 5]]
    assert document_lengths(positions).tolist() == [[5] * 5 + [4] * 4 + [3] * 3, [7] * 7 + [2] * 2 + [1, 1, 1]]


# ---------------------------------------------------------------------------------------------- the data

def test_pack_and_collate_carry_positions_restarting_at_each_document_and_padding_at_zero():
    samples = packable_documents(50, [3, 4, 2])
    packed = pack(samples, max_seq_length=7)
    assert [s.positions.tolist() for s in packed] == [[0, 1, 2, 0, 1, 2, 3], [0, 1]]
    batch = Collate(pad_id=9)(packed)
    assert batch["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 0, 0, 0, 0]]
    assert batch["input_ids"][1, 2:].tolist() == [9] * 5 and batch["labels"][1, 2:].tolist() == [IGNORE_INDEX] * 5
    # An unpacked sample in a packed batch runs from 0 as one document.
    mixed = Collate(pad_id=9)([packed[1], samples[1]])
    assert mixed["positions"].tolist() == [[0, 1, 0, 0], [0, 1, 2, 3]]


def test_unpacked_batches_carry_no_positions_and_attend_with_plain_causal_sdpa(monkeypatch):
    samples = packable_documents(97, [5, 8])
    batch = Collate(pad_id=0)(samples)
    assert set(batch) == {"input_ids", "labels"}
    _, model, _ = reference_and_ours(*FAMILY_CASES["llama-untied"])
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append((kwargs["attn_mask"], kwargs["is_causal"]))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        lm_loss_sum(model, batch["input_ids"], batch["labels"], batch.get("positions"))
    assert calls and all(mask is None and causal for mask, causal in calls)
    calls.clear()
    packed = Collate(pad_id=0)(pack(samples, max_seq_length=13))
    with torch.no_grad():
        lm_loss_sum(model, packed["input_ids"], packed["labels"], packed["positions"])
    assert calls and all(mask.shape == (1, 1, 13, 13) and not causal for mask, causal in calls)


# ---------------------------------------------------------------------------------------------- finetune

def test_a_packed_finetune_steps_loss_is_the_token_weighted_mean_of_its_documents_alone(tiny_llama_dir, tmp_path):
    from helpers import small_data, tiny_finetune

    from lit_qlora.train.datamodule import SFTDataModule
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.checkpoint.tokenizer import Tokenizer
    from lit_qlora.train.sampler import StepSampler

    data = small_data(tmp_path)
    data.packing = True
    settings = dict(micro_batch_size=2, global_batch_size=2, max_seq_length=192)
    out = tmp_path / "run"
    # Two steps, the first block checkpointed; LoRA's B starts at 0 and dropout is 0, so step 1 runs the base.
    tiny_finetune(tiny_llama_dir, out, data, quantize="none", precision="32-true", max_steps=2, activation_checkpointing=1,
        **settings)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    dm = SFTDataModule(data, Tokenizer(tiny_llama_dir), settings["max_seq_length"], 2, seed=1337)
    dm.setup()
    step1 = [dm.train_set[i] for i in next(iter(StepSampler(len(dm.train_set), 2, 1337, 0, 1)))]
    batch = Collate(0)(step1)
    documents_alone = spans(batch["positions"], [len(s) for s in step1])
    assert len(documents_alone) > len(step1)  # the rows hold several documents each
    base = load_model(tiny_llama_dir, "none", "32-true")
    loss_sum, targets = 0.0, 0
    with torch.no_grad():
        for row, start, end in documents_alone:
            ids, labels = batch["input_ids"][row : row + 1, start:end], batch["labels"][row : row + 1, start:end]
            loss_sum += lm_loss_sum(base, ids, labels).item()
            targets += int((labels[:, 1:] != IGNORE_INDEX).sum())
        leaky = lm_loss_sum(base, batch["input_ids"], batch["labels"]).item() / targets
    assert len(losses) == 2 and all(loss is not None for loss in losses)
    assert losses[0] == pytest.approx(loss_sum / targets, rel=1e-5)
    assert abs(leaky - loss_sum / targets) > 1e-4  # attending across documents would be another loss
