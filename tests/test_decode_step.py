"""The C decode step (lit_qlora/model/decode_step.c): every block of a Llama-style NF4 model for one token, equal to the
model's own decode forward (float32 within its sums' order, bf16 within its rounding, the same greedy tokens on the
real SmolLM2), the KV cache it writes equal to the model's, and the models and settings it leaves to PyTorch."""

import shutil

import pytest
import torch

from lit_qlora.base.threads import govern_threads
from lit_qlora.model import decode_step
from lit_qlora.model.config import Config
from lit_qlora.model.decode_step import DecodeStep
from lit_qlora.model.sampling import generate
from lit_qlora.model.transformer import Transformer
from lit_qlora.nf4 import quantize_linears

TINY = dict(vocab_size=128, n_layer=3, n_embd=128, n_head=4, n_query_groups=2, intermediate_size=192,
            max_seq_length=64)


def nf4_model(dtype=torch.float32, **overrides) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(Config(**{**TINY, **overrides}))
    model.init_weights(std=0.1)
    with torch.no_grad():
        for block in model.model.layers:
            for p in (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj):
                if p.bias is not None:
                    p.bias.normal_(0, 0.1)
            block.input_layernorm.weight.uniform_(0.5, 1.5)
    model = model.to(dtype).eval()
    quantize_linears(model)
    return model


def need_library():
    if decode_step._library() is None:
        if shutil.which("gcc") or shutil.which("cc"):  # a compiler and no library: a build error or a wrong result
            pytest.fail(f"the C decode step is unavailable: {decode_step.library_error()}")
        pytest.skip("no C compiler here")


def steps_both_ways(model, dtype, prompt, tokens):
    """Logits of each token of `tokens` after `prompt`: through DecodeStep, then through the model's forward; and
    the two KV caches afterwards."""
    out = {}
    with torch.inference_mode():
        for way in ("c", "model"):
            model.set_kv_cache(1, 48)
            model(torch.tensor([prompt]), input_pos=torch.arange(len(prompt)))
            step = DecodeStep(model, dtype) if way == "c" else None
            logits = []
            for i, t in enumerate(tokens):
                pos = len(prompt) + i
                logits.append(step(t, pos) if step else model(torch.tensor([[t]]), input_pos=torch.tensor([pos]))[0, -1])
            caches = [(b.self_attn.kv_cache.k.clone(), b.self_attn.kv_cache.v.clone()) for b in model.model.layers]
            out[way] = (torch.stack(logits), caches)
            model.clear_kv_cache()
    return out


@pytest.mark.parametrize("overrides", [{}, {"qkv_bias": True}, {"sliding_window": 6}, {"tie_embeddings": True},
                                       {"n_query_groups": 4}])
def test_float32_steps_equal_the_models_decode(overrides):
    need_library()
    model = nf4_model(torch.float32, **overrides)
    out = steps_both_ways(model, torch.float32, [5, 9, 77, 3, 40, 11, 2], [60, 8, 100, 33, 7, 91, 19, 4])
    got, expected = out["c"][0], out["model"][0]
    assert got.shape == expected.shape == (8, 128)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    for (kc, vc), (ke, ve) in zip(out["c"][1], out["model"][1]):  # what a later prefill or fallback reads
        torch.testing.assert_close(kc, ke, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vc, ve, rtol=1e-5, atol=1e-5)


def test_bf16_steps_equal_the_models_decode_within_its_rounding():
    need_library()
    model = nf4_model(torch.bfloat16, qkv_bias=True, sliding_window=6)
    out = steps_both_ways(model, torch.bfloat16, [5, 9, 77, 3, 40, 11, 2], [60, 8, 100, 33, 7, 91, 19, 4])
    got, expected = out["c"][0].float(), out["model"][0].float()
    # each step rounds where the model rounds; only float32 sums' order differs, which can move a value one bf16 step
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.02 * expected.abs().max().item())
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.85


def test_generate_decodes_through_it_with_the_same_tokens(monkeypatch):
    need_library()
    model = nf4_model(torch.float32)
    calls = []
    call = DecodeStep.__call__
    monkeypatch.setattr(DecodeStep, "__call__", lambda self, *a: calls.append(a) or call(self, *a))
    prompt = [5, 17, 33, 2, 99, 41]
    fast = list(generate(model, prompt, 20))
    assert [pos for _, pos in calls] == list(range(len(prompt), len(prompt) + 19))  # every step after the prefill
    monkeypatch.setenv("LIT_QLORA_NF4_GEMV", "0")  # the decode kernels off: through the model
    calls.clear()
    assert list(generate(model, prompt, 20)) == fast and not calls


def test_smollm2_greedy_tokens_are_the_models_in_bf16(monkeypatch, smollm2_dir):
    """Real weights in bf16 (the precision a CPU with native bf16 decodes in): 48 greedy tokens equal the model's
    own decode, the thread governor's hooks on the blocks as `litqlora generate` sets them."""
    need_library()
    from lit_qlora.deploy.choice import ModelChoice

    model = ModelChoice(checkpoint_dir=smollm2_dir, quantize="nf4", precision="bf16-true", device="cpu").load()
    govern_threads(model)
    prompt = list(range(200, 240))
    with torch.inference_mode():
        model.set_kv_cache(1, 8)
        assert decode_step.applies(model, torch.bfloat16)
        model.clear_kv_cache()
    fast = list(generate(model, prompt, 48))
    monkeypatch.setattr(decode_step, "applies", lambda *a: False)
    assert list(generate(model, prompt, 48)) == fast


def test_what_it_leaves_to_the_model(monkeypatch):
    need_library()
    from lit_qlora.lora.layer import apply_lora

    def applies(model, dtype=torch.float32):
        with torch.inference_mode():
            model.set_kv_cache(1, 8)
            try:
                return decode_step.applies(model, dtype)
            finally:
                model.clear_kv_cache()

    model = nf4_model()
    assert applies(model)
    assert not applies(model, torch.bfloat16)  # the caches and weights are float32
    handle = model.model.layers[1].register_forward_hook(lambda *a: None)  # a caller's hook would be skipped
    assert not applies(model)
    handle.remove()
    govern_threads(model)  # the thread governor's hooks: run once per step instead
    assert applies(model)
    from lit_qlora.train.callbacks import release_heap_around_blocks

    release_heap_around_blocks(model, lambda: None)  # training's heap release: nothing to do without gradients
    assert applies(model)
    monkeypatch.setenv("LIT_QLORA_NF4_GEMV", "0")
    assert not applies(model)
    monkeypatch.delenv("LIT_QLORA_NF4_GEMV")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not applies(model)
    assert not applies(nf4_model(qk_norm=True))  # Qwen3's q/k norms: through the model
    assert not applies(nf4_model(partial_rotary_factor=0.5))
    plain = nf4_model()
    plain.model.layers[0].mlp.up_proj = torch.nn.Linear(128, 192)  # a dense projection
    assert not applies(plain)
    adapted = nf4_model()
    apply_lora(adapted, r=4, alpha=8, dropout=0.1, dtype=torch.float32)
    assert applies(adapted.eval())  # a fine-tune's adapters, unmerged: their terms beside the kernel
    assert not applies(adapted.train())  # dropout draws: training's forward


def adapted_model(dtype, targets=("q", "k", "v", "o", "gate", "up", "down")):
    from lit_qlora.lora.layer import apply_lora, lora_modules

    model = nf4_model(dtype, qkv_bias=True)
    torch.manual_seed(1)
    apply_lora(model, r=8, alpha=16, targets=list(targets), dtype=torch.bfloat16)  # bf16 adapters, as trained
    with torch.no_grad():
        for layer in lora_modules(model).values():
            layer.lora_B.normal_(0, 0.1)
    return model.eval()


@pytest.mark.parametrize("targets", [("q", "k", "v", "o", "gate", "up", "down"), ("q", "v"), ("down",)])
def test_lora_adapters_terms_equal_the_models(targets):
    need_library()
    model = adapted_model(torch.float32, targets)
    out = steps_both_ways(model, torch.float32, [5, 9, 77, 3, 40], [60, 8, 100, 33, 7, 91])
    got, expected = out["c"][0], out["model"][0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    base = nf4_model(torch.float32, qkv_bias=True)  # the adapters change the answer: this is not the base's
    assert (steps_both_ways(base, torch.float32, [5, 9, 77, 3, 40], [60])["c"][0][0] - got[0]).abs().max() > 1e-2


def test_lora_in_bf16_and_disabled_adapters():
    from lit_qlora.lora.layer import adapters_disabled

    need_library()
    model = adapted_model(torch.bfloat16)
    out = steps_both_ways(model, torch.bfloat16, [5, 9, 77, 3, 40], [60, 8, 100, 33, 7, 91])
    got, expected = out["c"][0].float(), out["model"][0].float()
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.02 * expected.abs().max().item())
    with adapters_disabled(model):  # scale 0: the base alone, as the model computes it then
        out = steps_both_ways(model, torch.bfloat16, [5, 9, 77, 3, 40], [60, 8])
    torch.testing.assert_close(out["c"][0].float(), out["model"][0].float(), rtol=0.02,
                               atol=0.02 * out["model"][0].float().abs().max().item())


def test_rows_at_their_own_positions_equal_each_row_alone():
    """Several cache rows in one step (a GRPO group's completions, rows at different positions): each row's logits
    and cache equal that sequence decoded through the model alone, adapters included."""
    need_library()
    model = adapted_model(torch.float32, ("q", "v", "down"))
    prompts = [[5, 9, 77], [3, 40, 11, 2, 8, 60], [100, 7]]
    nexts = [[33, 4, 91], [19, 6, 1], [50, 71, 12]]
    with torch.inference_mode():
        alone = []
        for prompt, tokens in zip(prompts, nexts):
            model.set_kv_cache(1, 16)
            model(torch.tensor([prompt]), input_pos=torch.arange(len(prompt)))
            alone.append(torch.stack([model(torch.tensor([[t]]), input_pos=torch.tensor([len(prompt) + i]))[0, -1]
                                      for i, t in enumerate(tokens)]))
        model.set_kv_cache(3, 16)
        caches = [b.self_attn.kv_cache for b in model.model.layers]
        for r, prompt in enumerate(prompts):  # each row's prompt into its cache row
            model.set_kv_cache(1, 16)
            model(torch.tensor([prompt]), input_pos=torch.arange(len(prompt)))
            for block, cache in zip(model.model.layers, caches):
                cache.k[r], cache.v[r] = block.self_attn.kv_cache.k[0], block.self_attn.kv_cache.v[0]
        for block, cache in zip(model.model.layers, caches):
            block.self_attn.kv_cache = cache
        step = DecodeStep(model, torch.float32)
        together = torch.stack([step(torch.tensor([row[i] for row in nexts]),
                                     torch.tensor([len(p) + i for p in prompts])) for i in range(3)], 1)
        model.clear_kv_cache()
    assert together.shape == (3, 3, 128)
    for r in range(3):
        torch.testing.assert_close(together[r], alone[r], rtol=1e-5, atol=1e-5 * alone[r].abs().max().item())
    with pytest.raises(ValueError, match="4 tokens for a KV cache of 3 rows"):
        step(torch.tensor([1, 2, 3, 4]), 5)


def test_a_grpo_group_samples_through_it_as_through_the_model(monkeypatch):
    from lit_qlora.methods.grpo.rollout import sample_group

    need_library()
    model = adapted_model(torch.float32)
    calls = []
    call = DecodeStep.__call__
    monkeypatch.setattr(DecodeStep, "__call__", lambda self, *a: calls.append(self.rows) or call(self, *a))
    prompt = [5, 17, 33, 2, 99, 41]
    fast = sample_group(model, prompt, 4, 10, 1.0, 50, 0.9, [], torch.Generator().manual_seed(3))
    assert calls == [4] * 9  # every step after the first token, the group's four rows at once
    monkeypatch.setattr(decode_step, "applies", lambda *a: False)
    slow = sample_group(model, prompt, 4, 10, 1.0, 50, 0.9, [], torch.Generator().manual_seed(3))
    assert fast.completions == slow.completions and len(set(map(tuple, fast.completions))) > 1


def test_chat_turns_decode_through_it_and_answer_as_the_model(monkeypatch, tiny_llama_dir):
    from lit_qlora.checkpoint.loading import load_model
    from lit_qlora.checkpoint.tokenizer import Tokenizer
    from lit_qlora.deploy.chat import ChatSession

    need_library()
    model, tok = load_model(tiny_llama_dir, "nf4", "32-true"), Tokenizer(tiny_llama_dir)
    calls = []
    call = DecodeStep.__call__
    monkeypatch.setattr(DecodeStep, "__call__", lambda self, *a: calls.append(a[1]) or call(self, *a))

    def conversation():
        session = ChatSession(model, tok, system="You are terse.")
        replies = ["".join(session.reply(text, max_new_tokens=12)) for text in ("Hello there", "And again")]
        session.reset()
        return replies + ["".join(session.reply("Once more", max_new_tokens=12))]

    fast = conversation()
    assert len(calls) >= 10  # the replies' tokens after each turn's prompt, one position at a time
    monkeypatch.setattr(decode_step, "applies", lambda *a: False)
    calls.clear()
    assert conversation() == fast and not calls


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 6}])
def test_a_continuous_batch_decodes_through_it_as_through_the_model(monkeypatch, overrides):
    """`serve`'s batches: rows joining at different steps, at their own positions, in a cache that grows; every row's
    tokens equal those of the batch decoding through the model."""
    from lit_qlora.model.batch_decode import DecodeBatch

    from helpers import rows_of, run_batch as run

    need_library()
    model = adapted_model(torch.float32)
    if overrides:
        model.config.sliding_window = overrides["sliding_window"]
    made = []
    init = DecodeStep.__init__
    monkeypatch.setattr(DecodeStep, "__init__", lambda self, *a, **k: made.append(1) or init(self, *a, **k))
    prompts = [[3, 9, 27, 81, 5, 6, 7, 8], [7, 1], [40, 41, 42], list(range(50, 90))]
    settings = dict(limit=[15, 9, 20, 12], temperature=[0.0, 1.0, 0.0, 0.8], seed=[1, 2, 3, 4])
    def joins():
        rows = rows_of(prompts, **settings)
        return {0: rows[:1], 2: rows[1:]}

    fast, _, widest = run(DecodeBatch(model), joins())
    assert widest == 4 and len(fast) == 4 and all(fast.values())
    assert len(made) >= 2  # made again when the cache grew
    monkeypatch.setattr(decode_step, "applies", lambda *a: False)
    slow, _, _ = run(DecodeBatch(model), joins())
    assert fast == slow
