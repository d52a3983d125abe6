"""The attention dispatch (lit_qlora.model.attention, lit_qlora.model.flex): flex_attention over a BlockMask, as CUDA
runs it for sliding windows, packed documents and Gemma 2's soft cap, gives what the dense path gives (outputs and
gradients, fp32), per mask kind and through whole packed models; plain causal SDPA stays where it is exact; the CUDA
estimate counts flex_attention's O(L) memory, not an L x L mask.

On CPU flex_attention runs without inductor (`LIT_QLORA_FLEX_ATTENTION=1`; AOTAutograd over its dense math): the
reference semantics of the compiled kernels, not their memory or speed, which only a GPU shows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_qlora.model import attention, flex
from lit_qlora.model.attention import FLEX_ENV, attend, use_flex_attention
from lit_qlora.model.attention_mask import attention_mask
from lit_qlora.model.config import Config, Quantize
from lit_qlora.data.sft import Collate, pack
from lit_qlora.lora.layer import apply_lora

from helpers import FAMILY_CASES, packable_documents, reference_and_ours  # tiny random models of every family

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
    _, model, config = reference_and_ours(*FAMILY_CASES["llama-untied"])
    sdpa, calls = F.scaled_dot_product_attention, []
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append((kw["attn_mask"], kw["is_causal"])) or sdpa(*a, **kw))
    monkeypatch.setattr(flex, "flex_attend", lambda *a, **kw: pytest.fail("flex_attention on plain causal"))
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
    _, model, config = reference_and_ours(*FAMILY_CASES[case])
    assert config.sliding_window < 19  # the longest document passes the window
    apply_lora(model, r=4, alpha=8)
    model.checkpoint_blocks = config.n_layer if checkpointing else 0
    g = torch.Generator().manual_seed(1)
    for _name, p in model.named_parameters():
        if p.requires_grad:  # LoRA B starts at 0: make every adapter count
            p.data = torch.randn(p.shape, generator=g) * 0.1
    batch = Collate(pad_id=0)(pack(packable_documents(config.vocab_size), max_seq_length=30))
    flex_calls = []
    real_flex = flex.flex_attend
    monkeypatch.setattr(flex, "flex_attend", lambda *a: flex_calls.append(a[3]) or real_flex(*a))
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


class _LoweringError(RuntimeError):
    """Stands in for inductor's `InductorError: LoweringException: NoValidChoicesError` (seen on an H200)."""


def _failing_flex(where: str):
    """A compiled flex_attention that cannot run: it raises in its forward, or only in its backward."""

    class BackwardFails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            return torch.zeros_like(q)

        @staticmethod
        def backward(ctx, grad):
            raise _LoweringError("No choices to select, please consider adding ATEN into max_autotune_gemm_backends "
                                 "config. target: flex_attention_backward")

    def flex(q, k, v, **kwargs):
        flex.calls += 1
        if where == "forward":
            raise _LoweringError("No choices to select, please consider adding ATEN into max_autotune_gemm_backends "
                                 "config. target: flex_attention")
        return BackwardFails.apply(q, k, v)

    flex.calls = 0
    return lambda backend: flex


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("case", ["gemma2-tight-softcaps", "mistral-sliding-window"])
def test_a_shape_flex_attention_cannot_lower_falls_back_once_to_the_dense_path(case, where, monkeypatch, capsys):
    """flex_attention that fails to compile for a shape (forced here: its forward raises, or only its backward) does
    not break the run: each shape is tried once, said once on stderr, and that forward attends with the dense mask;
    logits and the LoRA gradients of a packed, checkpointed batch equal the dense path's (fp32)."""
    _, model, config = reference_and_ours(*FAMILY_CASES[case])
    apply_lora(model, r=4, alpha=8)
    model.checkpoint_blocks = config.n_layer
    g = torch.Generator().manual_seed(1)
    for _name, p in model.named_parameters():
        if p.requires_grad:
            p.data = torch.randn(p.shape, generator=g) * 0.1
    batch = Collate(pad_id=0)(pack(packable_documents(config.vocab_size), max_seq_length=30))
    monkeypatch.setattr(flex, "_flex_verdicts", {})

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(batch["input_ids"], positions=batch["positions"])
        logits.float().square().mean().backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    monkeypatch.setenv(FLEX_ENV, "0")
    dense_logits, dense_grads = run()
    monkeypatch.setenv(FLEX_ENV, "1")
    failing = _failing_flex(where)
    monkeypatch.setattr(flex, "_compiled_flex_attention", failing)
    monkeypatch.setattr(flex, "flex_attend", lambda *a: pytest.fail("flex_attention after it failed"))
    capsys.readouterr()
    for _ in range(2):  # the second forward reuses the verdict: no new try, nothing said again
        logits, grads = run()
        assert (logits - dense_logits).abs().max() <= 1e-5
        assert grads.keys() == dense_grads.keys()
        for name in grads:
            assert (grads[name] - dense_grads[name]).abs().max() <= 1e-5, name
    assert failing("inductor").calls == 1  # sliding and global layers' masks share a shape: tried once
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("flex_attention failed")]
    assert len(said) == 1, said
    assert "_LoweringError" in said[0] and "target: flex_attention" in said[0] and "dense mask" in said[0]
    assert f"{batch['input_ids'].size(1)} tokens x {batch['input_ids'].size(0)} rows" in said[0]
    # validation (no grad) is another shape, tried once more, forward only: where only the backward failed, it runs
    monkeypatch.setattr(flex, "flex_attend", flex._flex_attention)
    with torch.no_grad():
        logits = model(batch["input_ids"], positions=batch["positions"])
    verdicts = {shape.grad: ran for shape, ran in flex._flex_verdicts.items()}
    assert verdicts == {True: False, False: where == "backward"}
    if where == "forward":
        assert (logits - dense_logits).abs().max() <= 1e-5 and failing("inductor").calls == 2
    else:  # the stand-in's forward ran in every layer
        assert failing("inductor").calls == 2 + config.n_layer


def test_shapes_flex_attention_runs_keep_their_block_masks_and_are_tried_once(monkeypatch):
    """Where flex_attention runs, the forward keeps the BlockMask (flex_attention, O(L) memory) and the shape is tried
    once, on zeros: no random numbers drawn, so a run's dropout and data order are what they were."""
    _, model, config = reference_and_ours(*FAMILY_CASES["mistral-sliding-window"])
    monkeypatch.setattr(flex, "_flex_verdicts", {})
    monkeypatch.setenv(FLEX_ENV, "1")
    tries, real_try = [], flex._try_flex
    monkeypatch.setattr(flex, "_try_flex", lambda mask, shape: tries.append(shape) or real_try(mask, shape))
    flex_masks, real_flex = [], flex.flex_attend
    monkeypatch.setattr(flex, "flex_attend", lambda *a: flex_masks.append(a[3]) or real_flex(*a))
    batch = Collate(pad_id=0)(pack(packable_documents(config.vocab_size), max_seq_length=30))
    rng = torch.get_rng_state()
    for _ in range(2):
        model(batch["input_ids"], positions=batch["positions"]).sum().backward()
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(tries) == 1 and tries[0].grad and tries[0].mask_kind == "document_mask_mod"
    assert tries[0][2:7] == (*batch["input_ids"].shape, config.n_head, config.n_query_groups, config.head_dim)
    assert flex._flex_verdicts == {tries[0]: True}
    assert len(flex_masks) == 2 * config.n_layer and not any(isinstance(m, torch.Tensor) for m in flex_masks)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind", ["causal", "packed", "window"])
def test_short_half_precision_training_rows_attend_in_float32(dtype, mask_kind, monkeypatch):
    """bf16/fp16 training rows of up to UPCAST_MAX_TOKENS tokens on CPU take SDPA's flash kernel in float32 (its bf16
    backward is slower there): outputs and gradients as close to float64 attention as SDPA's own kernel comes, or
    closer; the path is not taken for longer rows, without gradients or in float32."""
    B, H, KV, L, D = 2, 4, 2, 37, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, L, D, generator=g).to(dtype).requires_grad_() for n in (H, KV, KV))
    grad = torch.randn(B, H, L, D, generator=g).to(dtype)
    positions = torch.cat([torch.arange(20), torch.arange(10, 27)]).expand(B, L).clone()  # a prompt, two branches
    positions[1] = torch.cat([torch.arange(30), torch.zeros(7, dtype=torch.long)])  # a document, then padding
    mask = {"causal": None, "packed": attention_mask(torch.arange(L), L, None, False, positions),
            "window": attention_mask(torch.arange(L), L, 8, False)}[mask_kind]
    calls = []
    monkeypatch.setattr(attention._Float32Attention, "apply",
                        lambda *a, f=attention._Float32Attention.apply: calls.append(1) or f(*a))

    def run(q, k, v, fn):
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v)
        out.backward(grad.to(q.dtype))
        return [out.detach().double()] + [t.grad.double() for t in (q, k, v)]

    exact = run(*(t.detach().double().requires_grad_() for t in (q, k, v)),
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                               scale=0.25, enable_gqa=True))
    ours = run(q, k, v, lambda q, k, v: attend(q, k, v, mask, 0.25))
    assert len(calls) == 1
    sdpa = run(q, k, v, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                                       scale=0.25, enable_gqa=True))
    for got, ref, want in zip(ours, sdpa, exact):
        scale = want.abs().max()
        assert (got - want).abs().max() <= 1.25 * (ref - want).abs().max() + 1e-3 * scale
        assert (got - want).abs().max() <= (2e-2 if dtype == torch.bfloat16 else 3e-3) * scale

    with torch.no_grad():
        attend(q, k, v, mask, 0.25)
    attend(q.float(), k.float(), v.float(), mask, 0.25)
    monkeypatch.setattr(attention, "UPCAST_MAX_TOKENS", L - 1)
    attend(q, k, v, mask, 0.25)
    assert len(calls) == 1


def test_the_sdpa_backend_setting_restricts_the_kernel_and_keeps_the_values(monkeypatch):
    """LIT_QLORA_SDPA_BACKEND (issue 48 item 3's A/B switch): the plain-causal and boolean-mask SDPA calls run only
    the kernels named, with the same values (fp32); a kernel the device lacks raises rather than falling back
    silently, so an A/B row measures what it names; an unknown name is the user's error, naming the setting."""
    from lit_qlora.base.errors import InvalidInput

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, 16, generator=gen)
    k, v = torch.randn(2, 2, 37, 16, generator=gen), torch.randn(2, 2, 37, 16, generator=gen)
    mask = torch.rand(37, 37, generator=gen) > 0.3
    mask |= torch.eye(37, dtype=torch.bool)
    monkeypatch.delenv(attention.SDPA_ENV, raising=False)
    plain = [attend(q, k, v, None, 0.25), attend(q, k, v, mask, 0.25)]
    for setting in ("math", "flash,math", "MATH"):
        monkeypatch.setenv(attention.SDPA_ENV, setting)
        for got, want in zip([attend(q, k, v, None, 0.25), attend(q, k, v, mask, 0.25)], plain):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    monkeypatch.setenv(attention.SDPA_ENV, "efficient")  # no CPU kernel: restricted means restricted
    with pytest.raises(RuntimeError, match="No viable backend|No available kernel"):
        attend(q, k, v, None, 0.25)
    monkeypatch.setenv(attention.SDPA_ENV, "flash,fast")
    with pytest.raises(InvalidInput, match=r"LIT_QLORA_SDPA_BACKEND='flash,fast': this switch takes a comma list of .* \(not fast\)"):
        attend(q, k, v, None, 0.25)


def _sink_reference(q, k, v, mask, scale, sinks):
    """gpt-oss's definition: the head's sink logit as one more softmax column with no value (dense scores, fp32)."""
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v


@pytest.mark.parametrize("kind", ["causal", "sliding", "decode"])
def test_sink_attention_through_sdpa_equals_the_sink_softmax_outputs_and_gradients(kind):
    """gpt-oss's sinks run as SDPA over one extra key (no L x L scores kept): outputs and the gradients of q, k, v and
    the sinks equal the definition's, with grouped-query heads (8 query heads on 2 kv heads, width 64)."""
    gen = torch.Generator().manual_seed(0)
    b, h, kv, t, d = 2, 8, 2, 37, 64
    s = t + 5 if kind == "decode" else t
    q = torch.randn(b, h, t, d, generator=gen, requires_grad=True)
    k = torch.randn(b, kv, s, d, generator=gen, requires_grad=True)
    v = torch.randn(b, kv, s, d, generator=gen, requires_grad=True)
    sinks = (torch.randn(h, generator=gen) * 2).requires_grad_()
    causal = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    mask = None if kind == "causal" else causal & ~torch.ones(t, s, dtype=torch.bool).tril(s - t - 9)
    if kind == "decode":
        mask = causal[None, None].expand(b, 1, t, s)
    scale = d ** -0.5
    out = attention.sink_attention(q, k, v, mask, scale, sinks)
    ref = _sink_reference(q, k, v, causal if mask is None else mask, scale, sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn(out.shape, generator=gen)
    ours = torch.autograd.grad(out, (q, k, v, sinks), grad)
    theirs = torch.autograd.grad(ref, (q, k, v, sinks), grad)
    for name, a, r in zip("qkv", ours, theirs):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5, msg=f"d{name}")
    torch.testing.assert_close(ours[3], theirs[3], atol=1e-5, rtol=1e-5)
    assert theirs[3].abs().min() > 1e-3  # every sink takes a share, so its gradient checks something


def test_decode_attention_equals_sdpa_for_one_query_a_row():
    """A decode step's attention (one query per row, GQA, a per-row or shared mask) in float32 through two matmuls
    equals SDPA's, and `attend` takes that path only for one query a row without gradients."""


    torch.manual_seed(0)
    B, heads, groups, S, d = 5, 9, 3, 37, 16
    q, k, v = torch.randn(B, heads, 1, d), torch.randn(B, groups, S, d), torch.randn(B, groups, S, d)
    rows = torch.arange(S) <= torch.tensor([3, 36, 20, 0, 11])[:, None]
    for mask in (rows[:, None, None, :], rows[3:4]):  # per row (a continuous batch); (1, S) (one stream)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(attention.decode_attention(q, k, v, mask, 0.3), expected, rtol=1e-5,
                                   atol=1e-6)
        with torch.no_grad():
            torch.testing.assert_close(attention.attend(q, k, v, mask, 0.3, None, True), expected, rtol=1e-5,
                                       atol=1e-6)
    got = attention.decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), rows[:, None, None, :], 0.3)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.scaled_dot_product_attention(
        q, k, v, attn_mask=rows[:, None, None, :], scale=0.3, enable_gqa=True), rtol=0.02, atol=0.02)
    assert not attention._decode_applies(q.requires_grad_(), k, rows)  # training: SDPA, with its backward
