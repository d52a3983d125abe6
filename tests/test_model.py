"""Our decoder against transformers' reference implementations, on tiny random configs."""

import pytest
import torch

from lit_qlora.model.config import Config
from lit_qlora.model.presets import PRESETS
from lit_qlora.model.transformer import Transformer

from helpers import FAMILY_BASE, FAMILY_CASES, reference_and_ours

transformers = pytest.importorskip("transformers")

@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_logits_match_transformers(case):
    kind, extra = FAMILY_CASES[case]
    hf_model, ours, _ = reference_and_ours(kind, extra)
    idx = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        expected = hf_model(idx).logits
        actual = ours(idx)
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= 1e-4


def test_sliding_window_changes_the_result():
    # Guards the Mistral case above: a window shorter than the sequence must matter.
    _, ours, config = reference_and_ours("MistralConfig", dict(sliding_window=5))
    idx = torch.randint(0, 97, (1, 30))
    full = Transformer(config.replace(sliding_window=None)).eval()
    full.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert torch.allclose(ours(idx)[:, :5], full(idx)[:, :5], atol=1e-5)
        assert (ours(idx)[:, 10:] - full(idx)[:, 10:]).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["llama-untied", "mistral-sliding-window", "qwen2-qkv-bias-tied",
                                  "qwen3-untied-head-dim-bias", "gemma2", "gemma2-tight-softcaps",
                                  "gemma3-local-rope-scaled", "gemma3-untied-softcapped", "phi3-sliding"])
def test_kv_cache_decoding_matches_full_forward(case):
    kind, extra = FAMILY_CASES[case]
    _, ours, _ = reference_and_ours(kind, extra)
    idx = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        full = ours(idx)
        ours.set_kv_cache(batch_size=2, max_len=32, dtype=torch.float32)
        prefill = ours(idx[:, :16], input_pos=torch.arange(16))
        steps = [ours(idx[:, t : t + 1], input_pos=torch.tensor([t])) for t in range(16, 24)]
        ours.clear_kv_cache()
    assert torch.allclose(prefill, full[:, :16], atol=1e-5)
    assert torch.allclose(torch.cat(steps, dim=1), full[:, 16:], atol=1e-5)


def test_hf_config_round_trip():
    for name, config in PRESETS.items():
        again = Config.from_hf_config(config.to_hf_config(), name=name)
        assert again == config, name


def test_tied_embeddings_share_storage():
    model = Transformer(PRESETS["SmolLM2-135M"].replace(n_layer=1))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model = Transformer(PRESETS["TinyLlama-1.1B"].replace(n_layer=1, vocab_size=128, n_embd=64, n_head=4,
                                                        n_query_groups=2, head_dim=16, intermediate_size=32))
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_unsupported_model_type_is_rejected():
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        Config(model_type="gpt2")


def test_qwen3_sliding_window_layers_are_refused_not_ignored():
    hf = transformers.Qwen3Config(**FAMILY_BASE, use_sliding_window=True, sliding_window=8).to_dict()
    with pytest.raises(ValueError, match="use_sliding_window: true"):
        Config.from_hf_config(hf)
    assert Config.from_hf_config({**hf, "use_sliding_window": False}).qk_norm


def test_gemma2_softcaps_and_sliding_layers_change_the_result():
    """Guards the Gemma 2 cases above: capping, the (1 + w) norms and the sliding layers all matter."""
    _, ours, config = reference_and_ours(*FAMILY_CASES["gemma2-tight-softcaps"])
    idx = torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        logits = ours(idx)
        assert logits.abs().max() <= 1.5
        for change in (dict(final_softcap=None), dict(attn_softcap=None), dict(layer_types=None, sliding_window=None)):
            other = Transformer(config.replace(**change)).eval()
            other.load_state_dict(ours.state_dict())
            assert (other(idx) - logits).abs().max() > 1e-3, change


def test_phi3_long_factors_apply_past_the_pretraining_length_and_partial_rotary_leaves_the_rest():
    """Guards the longrope case above: within 16 tokens the short factors (transformers agrees there too), past them
    the long ones; the unrotated half of each head matters."""
    reference, ours, config = reference_and_ours(*FAMILY_CASES["phi3-partial-longrope"])
    short_idx, long_idx = torch.randint(0, 97, (1, 12)), torch.randint(0, 97, (1, 40))
    only_short = dict(config.rope_scaling, long_factor=config.rope_scaling["short_factor"])
    with torch.no_grad():
        assert (ours(short_idx) - reference(short_idx).logits).abs().max() <= 1e-4
        other = Transformer(config.replace(rope_scaling=only_short)).eval()
        other.load_state_dict(ours.state_dict())
        assert (other(long_idx) - ours(long_idx)).abs().max() > 1e-3
        half, whole = (Transformer(config.replace(rope_scaling=None, partial_rotary_factor=f)).eval() for f in (0.5, 1))
        half.load_state_dict(ours.state_dict()), whole.load_state_dict(ours.state_dict())
        assert (half(short_idx) - whole(short_idx)).abs().max() > 1e-3


def test_gemma3_sliding_layers_use_their_own_rope_base():
    _, ours, config = reference_and_ours(*FAMILY_CASES["gemma3-local-rope-scaled"])
    assert (config.rope_local_base, config.rope_base) == (700.0, 50000.0) and config.qk_norm and config.norm_plus_one
    idx = torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        for change in (dict(rope_local_base=None), dict(rope_scaling=None)):
            other = Transformer(config.replace(**change)).eval()
            other.load_state_dict(ours.state_dict())
            assert (other(idx) - ours(idx)).abs().max() > 1e-3, change


def test_multimodal_gemma3_and_bidirectional_configs_get_a_clear_error():
    with pytest.raises(ValueError, match="gemma3_text"):
        Config.from_hf_config({"model_type": "gemma3", "text_config": {}})
    hf = transformers.Gemma3TextConfig(**FAMILY_BASE, use_bidirectional_attention=True).to_dict()
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Config.from_hf_config(hf)


def test_longrope_factors_of_the_wrong_length_are_a_clear_error():
    hf = transformers.Phi3Config(**FAMILY_BASE).to_dict()
    hf["rope_scaling"] = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7}
    with pytest.raises(ValueError, match="rope_scaling.long_factor needs 8 values"):
        Config.from_hf_config(hf)


# ------------------------------------------------------------------ lean autograd (issue 17: 8B at 2x2048 < 6.5 GiB)
def _saved_bytes(fn, *inputs) -> tuple[torch.Tensor, int]:
    """fn(*inputs) and the bytes autograd saves for its backward (each storage once)."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return out, sum(saved.values())


@pytest.mark.parametrize("plus_one", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_keeps_no_fp32_copy_and_its_gradient_equals_autograds(plus_one, dtype):
    from lit_qlora.model.transformer import RMSNorm, rms_norm

    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6, plus_one).requires_grad_(False)
    norm.weight.copy_(torch.randn(64) * 0.5)
    x = (torch.randn(3, 7, 64) * 3).to(dtype).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, lean = _saved_bytes(norm, x)
    y_ref, plain = _saved_bytes(rms_norm, x_ref, norm.weight, norm.eps, plus_one)
    assert torch.equal(y, y_ref)  # the same forward ops
    # Saved: x, a (3, 7, 1) fp32 scale and the 64-value weight, never an fp32 copy of x (in fp32 x is its own copy).
    assert lean <= x.nbytes + 3 * 7 * 4 + 64 * 4
    if dtype == torch.bfloat16:  # autograd keeps x in fp32 (4 bytes a value), we keep x (2; in a block, x is
        assert plain >= lean + x.numel() * 2  # saved anyway as the residual or checkpoint input)
    grad = torch.randn(y.shape).to(dtype)
    y.backward(grad)
    y_ref.backward(grad)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_activation_saves_gate_and_up_only_with_bitwise_gradients(act):
    from lit_qlora.model.transformer import MLP

    config = Config(n_embd=32, intermediate_size=96, mlp_activation=act)
    mlp = MLP(config).to(torch.bfloat16)
    torch.manual_seed(1)
    gate, up = (torch.randn(4, 5, 96, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    ref_gate, ref_up = (t.detach().clone().requires_grad_() for t in (gate, up))
    from lit_qlora.model.transformer import _LeanGatedActivation

    y, lean = _saved_bytes(_LeanGatedActivation.apply, gate, up, mlp.act)
    y_ref, plain = _saved_bytes(lambda g, u: mlp.act(g) * u, ref_gate, ref_up)
    assert torch.equal(y, y_ref)
    assert lean == gate.nbytes + up.nbytes and plain > lean  # autograd also keeps act(gate)
    grad = torch.randn(y.shape, dtype=torch.bfloat16)
    y.backward(grad)
    y_ref.backward(grad)
    assert torch.equal(gate.grad, ref_gate.grad) and torch.equal(up.grad, ref_up.grad)
