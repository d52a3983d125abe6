"""The attention dispatch (lit_qlora.model.attention): flex_attention over a BlockMask, as CUDA runs it for sliding windows,
packed documents and Gemma 2's soft cap, gives what the dense path gives (outputs and gradients, fp32), per mask kind
and through whole packed models; plain causal SDPA stays where it is exact; the CUDA estimate counts flex_attention's
O(L) memory, not an L x L mask.

On CPU flex_attention runs without inductor (`LIT_QLORA_FLEX_ATTENTION=1`; AOTAutograd over its dense math): the
reference semantics of the compiled kernels, not their memory or speed, which only a GPU shows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_qlora.model import attention
from lit_qlora.model.attention import FLEX_ENV, attend, use_flex_attention
from lit_qlora.model.attention_mask import attention_mask
from lit_qlora.model.config import Config, Quantize
from lit_qlora.data.sft import Collate, pack
from lit_qlora.lora.layer import apply_lora

from test_model import CASES, reference_and_ours  # tiny random models of every family (tests/ is on sys.path)
from test_packing import documents

# Two rows of 300 tokens (more than one 128-token block, so full, partial and empty blocks all occur): documents of
# 40, 150, 7 and 103 tokens, and of 260 tokens then 40 of padding (each padding token a document of its own).
LENGTHS = ([40, 150, 7, 103], [260] + [1] * 40)
T = 300


def packed_positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])


MASK_KINDS = {"sliding": (False, 50), "documents": (True, None), "documents-sliding": (True, 50)}


def masks(packed: bool, window, capped: bool):
    positions = packed_positions() if packed else None
    args = (torch.arange(T), T, window, False, positions)
    return attention_mask(*args, flex=True, capped=capped), attention_mask(*args)


# (plain causal attention without a cap is SDPA's is_causal on every device: the next test)
@pytest.mark.parametrize("kind, cap", [(kind, cap) for kind in MASK_KINDS for cap in (None, 1.5)] + [("causal", 1.5)])
def test_flex_attention_equals_the_dense_path_outputs_and_gradients(kind, cap):
    packed, window = MASK_KINDS.get(kind, (False, None))
    block, dense = masks(packed, window, capped=cap is not None)
    assert block is not None and not isinstance(block, torch.Tensor)  # a BlockMask
    assert block.shape == ((2 if packed else 1), 1, T, T)
    g = torch.Generator().manual_seed(0)
    # grouped-query attention: 4 query heads over 2 kv heads; a scale that is not 1/sqrt(d)
    q, k, v = (torch.randn(2, h, T, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    grad_out = torch.randn(2, 4, T, 16, generator=g)
    outs, grads = [], []
    for mask in (block, dense):
        y = attend(q, k, v, mask, 0.3, cap)
        outs.append(y)
        grads.append(torch.autograd.grad(y, (q, k, v), grad_out))
    assert (outs[0] - outs[1]).abs().max() <= 1e-5
    for flex_grad, dense_grad in zip(*grads):
        assert (flex_grad - dense_grad).abs().max() <= 1e-5
    # and the rule is what it says: without the mask (or the cap) the results differ
    if kind != "causal":
        assert (attend(q, k, v, masks(False, None, True)[0], 0.3, cap) - outs[1]).abs().max() > 1e-2
    if cap is not None:
        assert (attend(q, k, v, block, 0.3) - outs[1]).abs().max() > 1e-2


def test_plain_causal_attention_stays_sdpa_is_causal_with_flex_on(monkeypatch):
    monkeypatch.setenv(FLEX_ENV, "1")
    pos = torch.arange(T)
    assert attention_mask(pos, T, None, False, flex=True) is None
    assert attention_mask(pos, T, T, False, flex=True) is None  # a window as long as the row: plain causal
    assert attention_mask(pos, T, T - 1, False, flex=True) is not None
    # KV-cache decoding keeps the dense masks
    assert isinstance(attention_mask(pos[:1], 64, 8, True, flex=True), torch.Tensor)
    # an unpacked Llama batch through the model: SDPA with is_causal and no mask, flex_attention never called
    _, model, config = reference_and_ours(*CASES["llama-untied"])
    sdpa, calls = F.scaled_dot_product_attention, []
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append((kw["attn_mask"], kw["is_causal"])) or sdpa(*a, **kw))
    monkeypatch.setattr(attention, "flex_attend", lambda *a, **kw: pytest.fail("flex_attention on plain causal"))
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (2, 40)))
    assert calls and all(mask is None and causal for mask, causal in calls)


def test_new_lengths_and_new_documents_reuse_the_compiled_flex_attention():
    """After two lengths (static, then dynamic: the length and its number of 128-token blocks both changed), other
    lengths and other batches' documents compile nothing new."""
    from torch._dynamo.utils import counters

    def step(lengths):
        positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
        T = positions.size(1)
        mask = attention_mask(torch.arange(T), T, 50, False, positions, flex=True, capped=True)
        q, k, v = (torch.randn(2, h, T, 16, requires_grad=True) for h in (4, 2, 2))
        attend(q, k, v, mask, 0.3, 1.5).sum().backward()

    step(([100, 60], [160]))
    step(([260], [10, 250]))
    graphs = counters["stats"]["unique_graphs"]
    for lengths in (([30, 170], [200]), ([5, 295], [300]), ([390], [1] * 390), ([100, 400], [500])):
        step(lengths)
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_flex_switch(monkeypatch):
    monkeypatch.delenv(FLEX_ENV, raising=False)
    assert not use_flex_attention(torch.device("cpu"))
    monkeypatch.setattr(attention, "_triton_installed", lambda: True)
    assert use_flex_attention(torch.device("cuda"))
    monkeypatch.setenv(FLEX_ENV, "0")
    assert not use_flex_attention(torch.device("cuda"))
    monkeypatch.setenv(FLEX_ENV, "1")
    assert use_flex_attention(torch.device("cpu"))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored", "checkpointed"])
@pytest.mark.parametrize("case", ["gemma2-tight-softcaps", "mistral-sliding-window"])
def test_a_packed_batch_through_flex_attention_equals_the_dense_path(case, checkpointing, monkeypatch):
    """Gemma 2 (soft cap on every layer, sliding and global layers) and Mistral (sliding window): logits and the
    LoRA parameters' gradients of a packed batch with flex_attention forced equal those of the dense path, with the
    blocks' activations stored or recomputed (activation checkpointing: flex_attention runs again in backward)."""
    _, model, config = reference_and_ours(*CASES[case])
    assert config.sliding_window < 19  # the longest document passes the window
    apply_lora(model, r=4, alpha=8)
    model.checkpoint_blocks = config.n_layer if checkpointing else 0
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if p.requires_grad:  # LoRA B starts at 0: make every adapter count
            p.data = torch.randn(p.shape, generator=g) * 0.1
    batch = Collate(pad_id=0)(pack(documents(config.vocab_size), max_seq_length=30))
    flex_calls = []
    real_flex = attention.flex_attend
    monkeypatch.setattr(attention, "flex_attend", lambda *a: flex_calls.append(a[3]) or real_flex(*a))
    results = []
    for setting in ("0", "1"):
        monkeypatch.setenv(FLEX_ENV, setting)
        model.zero_grad(set_to_none=True)
        logits = model(batch["input_ids"], positions=batch["positions"])
        (logits.float().square().mean()).backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    # every layer ran flex_attention once (and again in its recompute), with "1" only
    assert len(flex_calls) == config.n_layer * (2 if checkpointing else 1)
    (dense_logits, dense_grads), (flex_logits, flex_grads) = results
    assert (flex_logits - dense_logits).abs().max() <= 1e-5
    assert dense_grads.keys() == flex_grads.keys() and len(dense_grads) >= 4 * config.n_layer
    for name in dense_grads:
        assert (flex_grads[name] - dense_grads[name]).abs().max() <= 1e-5, name


def test_the_cuda_estimate_counts_flex_attentions_linear_memory_for_a_sliding_window(monkeypatch):
    """A Mistral-like model with a 256-token window at 1024 to 4096 tokens: on CUDA (flex_attention) the traced
    activations double with the length; with the dense path (LIT_QLORA_FLEX_ATTENTION=0) they quadruple, the
    (L, L) mask and scores."""
    from lit_qlora.estimate.step import trace_step
    from lit_qlora.train.args import LoRAArgs, TrainArgs

    config = Config.from_hf_config({"model_type": "mistral", "vocab_size": 512, "hidden_size": 64,
                                    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "max_position_embeddings": 8192,
                                    "tie_word_embeddings": True, "sliding_window": 256})

    def activations(length):
        train = TrainArgs(micro_batch_size=1, global_batch_size=1, max_seq_length=length,
                          activation_checkpointing=True)
        return trace_step(config, Quantize("none"), "bf16-true", LoRAArgs(r=4, alpha=8), train,
                          "cuda").peak_by_category["activations"]

    monkeypatch.delenv(FLEX_ENV, raising=False)
    flex = [activations(n) for n in (1024, 2048, 4096)]
    assert all(1.8 <= b / a <= 2.2 for a, b in zip(flex, flex[1:])), flex
    monkeypatch.setenv(FLEX_ENV, "0")
    dense = [activations(n) for n in (1024, 2048, 4096)]
    assert all(b / a >= 3.5 for a, b in zip(dense, dense[1:])), dense
    assert dense[-1] > 20 * flex[-1]
