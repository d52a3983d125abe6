"""Model families beyond Llama, end to end against transformers and peft: a published config.json reads and writes
back, a checkpoint transformers wrote loads with its logits and greedy tokens, keeps its norms out of NF4 and LoRA,
trains with QLoRA through `litqlora finetune`, and its merged and PEFT exports load back in transformers and peft
with the same outputs. Tiny random models built by transformers itself; a family is one entry of FAMILIES (and its
published configs in PUBLISHED). Block-level parity of many config variants and the KV cache is in test_model.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from helpers import hf_checkpoint, random_adapter, tokens  # noqa: E402
from lit_qlora.model.config import HF_DEFAULTS, Config  # noqa: E402
from lit_qlora.model.presets import PRESETS  # noqa: E402
from lit_qlora.export.hf import export_peft, merge  # noqa: E402
from lit_qlora.model.sampling import generate  # noqa: E402
from lit_qlora.checkpoint.loading import load_model  # noqa: E402
from lit_qlora.lora.layer import apply_lora, lora_modules  # noqa: E402
from lit_qlora.nf4 import count_linears, is_nf4  # noqa: E402

LINEARS = 2 * 7 + 1  # two blocks of q, k, v, o, gate, up, down, and the head
PEFT_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}

# (transformers config class, its arguments beyond the shared tiny shape).
FAMILIES = {
    # Tied like Qwen3-0.6B, whose head_dim (128) is not hidden_size / heads (64) either.
    "qwen3-tied": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32)),
    "qwen3-untied-bias": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=16, attention_bias=True)),
    "gemma2-sliding-softcapped": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                                                       attn_logit_softcapping=0.05, final_logit_softcapping=3.0)),
    "gemma2-untied-wide-window": ("Gemma2Config", dict(head_dim=16, sliding_window=64, tie_word_embeddings=False)),
    "gemma3-untied-final-softcap": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=64, tie_word_embeddings=False,
                                                             final_logit_softcapping=3.0)),
    "gemma3-local-rope": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                                                   rope_local_base_freq=1000.0,
                                                   layer_types=["sliding_attention", "full_attention"])),
    # Phi-4-mini's shape of RoPE (partial, longrope; short factors within 64 tokens), fused q/k/v and gate/up.
    "phi3-partial-longrope-tied": ("Phi3Config", dict(partial_rotary_factor=0.5, original_max_position_embeddings=64,
                                                      tie_word_embeddings=True, pad_token_id=0,
                                                      rope_scaling={"type": "longrope",
                                                                    "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                                    "long_factor": [2.0, 5.0, 9.0, 20.0]})),
    "phi3-sliding-untied": ("Phi3Config", dict(sliding_window=6, pad_token_id=0)),
}
# peft sees Phi-3's fused modules: one adapter on each (ours, per projection, stacked block-diagonally).
PHI3_PEFT_TARGETS = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}

# config.json as published on the Hugging Face Hub, field for field.
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
          "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
          "initializer_range": 0.02, "max_position_embeddings": 40960, "model_type": "qwen3", "num_key_value_heads": 8,
          "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
          "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
          "vocab_size": 151936}
_PHI4_MINI = {"architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 199999, "embd_pdrop": 0.0, "eos_token_id": 200020, "full_attn_mod": 1,
              "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
              "interpolate_factor": 1, "lm_head_bias": False, "max_position_embeddings": 131072, "mlp_bias": False,
              "model_type": "phi3", "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
              "original_max_position_embeddings": 4096, "pad_token_id": 199999, "partial_rotary_factor": 0.75,
              "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
              "rope_scaling": {key: value for key, value in PRESETS["Phi-4-mini"].rope_scaling.items()
                               if key != "original_max_position_embeddings"},
              "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "transformers_version": "4.45.0", "use_cache": True, "vocab_size": 200064}
PUBLISHED = {
    "Phi-4-mini": _PHI4_MINI,
    "Qwen3-0.6B": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "max_window_layers": 28,
                   "num_attention_heads": 16, "num_hidden_layers": 28, "tie_word_embeddings": True},
    "Qwen3-8B": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "max_window_layers": 36,
                 "num_attention_heads": 32, "num_hidden_layers": 36, "tie_word_embeddings": False},
}
TRAINING_ONLY = {"attention_dropout", "initializer_range", "transformers_version"}  # at transformers' defaults
# Fields of a published config.json that transformers' class for it does not read (Phi-4-mini's are vLLM's), and more
# training-only ones at their defaults.
UNREAD = {"Phi-4-mini": {"full_attn_mod", "interpolate_factor", "lm_head_bias", "mlp_bias", "attention_bias"}}
MORE_TRAINING_ONLY = {"Phi-4-mini": {"embd_pdrop", "resid_pdrop"}}


def tied_head(checkpoint_dir: Path) -> set[str]:
    """{"lm_head"} where the checkpoint ties its head to the embedding (`--lora.targets all` then leaves it out)."""
    return {"lm_head"} if Config.from_checkpoint(checkpoint_dir).tie_embeddings else set()


def hf_read(hf: dict) -> dict:
    """What transformers makes of a config.json dict, less its own version stamp."""
    read = transformers.AutoConfig.for_model(**hf).to_dict()
    read.pop("transformers_version", None)
    return read


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config_json_reads_as_the_preset_and_writes_back_the_same_model(name):
    published = PUBLISHED[name]
    config = Config.from_hf_config(published, name=name)
    assert config == PRESETS[name]
    written = config.to_hf_config()
    assert set(published) - set(written) == TRAINING_ONLY | UNREAD.get(name, set()) | MORE_TRAINING_ONLY.get(name, set())
    assert {k: written[k] for k in published if k in written} == {k: published[k] for k in written if k in published}
    unread = UNREAD.get(name, set())
    assert hf_read(written) == {k: v for k, v in hf_read(published).items() if k not in unread}  # the same model


@pytest.mark.parametrize("model_type", list(HF_DEFAULTS))
def test_a_field_left_out_means_what_it_means_to_transformers(model_type):
    minimal = {"model_type": model_type, "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    config, theirs = Config.from_hf_config(minimal), transformers.AutoConfig.for_model(**minimal)
    assert config == Config.from_hf_config(theirs.to_dict())  # the config transformers fills in reads the same
    ours = config.to_hf_config()
    flat = [key for key in HF_DEFAULTS[model_type] if hasattr(theirs, key)]  # (Gemma 3 nests its RoPE bases)
    assert {key: ours[key] for key in flat} == {key: getattr(theirs, key) for key in flat}
    # (Qwen3: 128, not 64 / 4; transformers 5 writes None for "hidden_size / heads")
    assert ours.get("head_dim", 64 // 4) == (getattr(theirs, "head_dim", None) or 64 // 4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpoint_loads_with_transformers_logits_and_generates_its_greedy_tokens(family, tmp_path):
    reference = hf_checkpoint(*FAMILIES[family], tmp_path / "hf")
    ours = load_model(tmp_path / "hf", "none", "32-true")
    idx = tokens((2, 24))
    prompt = [5, 17, 300, 42, 7]
    with torch.no_grad():
        diff = (ours(idx) - reference(idx).logits).abs().max().item()
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(prompt):].tolist()
    assert diff <= 1e-4
    assert list(generate(ours, prompt, 20)) == expected


@pytest.mark.parametrize("family", list(FAMILIES))
def test_nf4_load_quantizes_every_linear_and_leaves_the_norms_alone(family, tmp_path):
    """q_norm and k_norm (per head) are norms, not linears: high precision, their checkpoint values, no adapter."""
    reference = hf_checkpoint(*FAMILIES[family], tmp_path / "hf").state_dict()
    model = apply_lora(load_model(tmp_path / "hf", "nf4", "bf16-true"), r=4, alpha=8)
    linears = LINEARS - len(tied_head(tmp_path / "hf"))  # a tied head reads the embedding: not a linear of its own
    assert count_linears(model) == (linears, linears)
    norms = {name: p for name, p in model.named_parameters() if "norm" in name}
    assert set(norms) == {name for name in reference if "norm" in name}  # by their Hugging Face names
    for name, p in norms.items():
        assert not is_nf4(p) and not p.requires_grad and torch.equal(p, reference[name].bfloat16()), name
    assert {name.rpartition(".")[2] for name in lora_modules(model)} == PEFT_TARGETS - tied_head(tmp_path / "hf")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_merged_and_peft_exports_load_in_transformers_and_peft_with_our_outputs(family, tmp_path):
    hf_checkpoint(*FAMILIES[family], tmp_path / "hf")
    model = load_model(tmp_path / "hf", "none", "32-true")
    adapter_dir = random_adapter(model, tmp_path / "adapter", "none")
    idx = tokens((2, 12))
    with torch.no_grad():
        ours = model.eval()(idx).float()

    merged = transformers.AutoModelForCausalLM.from_pretrained(merge(tmp_path / "hf", adapter_dir, tmp_path / "m"),
                                                               dtype=torch.float32).eval()
    assert merged.config.model_type == json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"]
    peft_dir = export_peft(tmp_path / "hf", adapter_dir, tmp_path / "p")
    targets = (PHI3_PEFT_TARGETS if family.startswith("phi3") else PEFT_TARGETS) - tied_head(tmp_path / "hf")
    assert set(json.loads((peft_dir / "adapter_config.json").read_text())["target_modules"]) == targets
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, peft_dir)
    with torch.no_grad():
        from_merged, from_peft = merged(idx).logits.float(), with_adapter.eval()(idx).logits.float()
    assert (from_peft - ours).abs().max() <= 1e-4  # fp32 adapter on the fp32 base: the same computation
    assert (from_merged - ours).abs().max() <= 0.02 * ours.abs().max()  # the merged file is bf16
    with torch.no_grad():  # (peft wrapped `base` in place: the original is read again)
        untouched = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(idx).logits.float()
    assert (untouched - ours).abs().max() > 10 * (from_merged - ours).abs().max()  # the adapter mattered


@pytest.mark.parametrize("family", ["qwen3-tied", "gemma2-sliding-softcapped", "gemma3-local-rope",
                                    "phi3-partial-longrope-tied"])
def test_qlora_finetune_writes_every_artifact_and_lowers_the_loss(family, smollm2_dir, tmp_path):
    from helpers import finetune_sums

    hf_checkpoint(*FAMILIES[family], tmp_path / "hf", tokenizer_dir=smollm2_dir)
    summary = finetune_sums(tmp_path / "hf", tmp_path, max_steps=6)
    out = tmp_path / "run"
    # every linear, lm_head too unless it is tied (then it reads the embedding)
    assert summary["quantized_linears"] == summary["total_linears"] == LINEARS - len(tied_head(tmp_path / "hf"))
    assert json.loads((out / "summary.json").read_text()) == summary
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0] and summary["val_loss"] < summary["initial_val_loss"]
    final = out / "final"
    for name in ("adapter.safetensors", "adapter_config.json", "merged/model.safetensors", "merged/config.json",
                 "peft/adapter_model.safetensors", "peft/adapter_config.json"):
        assert (final / name).is_file(), name
    adapted = LINEARS - len(tied_head(tmp_path / "hf"))  # `all` leaves a tied head out
    assert len(load_file(str(final / "adapter.safetensors"))) == 2 * adapted  # A and B of each; none on a norm

    # The merged model is the trained one: NF4 base + adapter here, dequant(NF4(W)) + BA in bf16 there. Its norms,
    # never quantized, are the checkpoint's (in bf16).
    merged = transformers.AutoModelForCausalLM.from_pretrained(final / "merged", dtype=torch.bfloat16).eval()
    model_type = json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"]
    # a tied head stays tied (QLoRA computed it with the embedding itself, and `all` does not adapt it)
    assert merged.config.model_type == model_type
    assert merged.config.tie_word_embeddings is bool(tied_head(tmp_path / "hf"))
    trained = load_model(tmp_path / "hf", adapter_dir=final)
    idx = tokens((2, 16))
    with torch.no_grad():
        ours, theirs = trained(idx).float(), merged(idx).logits.float()
    assert (ours - theirs).abs().max() <= 0.05 * ours.abs().max()  # bf16: merged weights vs rounded activations
    assert torch.allclose(ours.softmax(-1), theirs.softmax(-1), atol=2e-2)
    original, exported = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(final / "merged" /
                                                                                               "model.safetensors"))
    norms = [name for name in original if "norm" in name]
    if family.startswith("qwen3"):
        assert any(".q_norm." in name for name in norms) and any(".k_norm." in name for name in norms)
    assert all(torch.equal(exported[name], original[name].bfloat16()) for name in norms)


@pytest.mark.slow
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
@pytest.mark.parametrize("family", ["qwen3-tied", "phi3-sliding-untied"])
def test_tensor_parallel_qlora_equals_one_process(family, tmp_path):
    """Each rank normalizes its own heads' q and k with the whole (replicated) q_norm and k_norm; Phi-3's fused
    q/k/v and gate/up, split on load, split across ranks like any other family's."""
    from helpers import spawn_ranks
    from helpers import assert_equals_one_process, tensor_parallel_worker

    hf_checkpoint(*FAMILIES[family], tmp_path / "hf")
    assert_equals_one_process(spawn_ranks(tensor_parallel_worker, 2, str(tmp_path / "hf"), "nf4",
                                          str(tmp_path / "store")))
