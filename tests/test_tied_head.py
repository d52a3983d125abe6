"""A head tied to the embedding (SmolLM2, Gemma, small Qwen) stays tied: in QLoRA it reads the embedding's own
high-precision weight (no NF4 copy: less memory, and the head the checkpoint has); `--lora.targets all` leaves it out
and says how to adapt it anyway; every export (merged, PEFT, GGUF) keeps it tied, so each holds one vocabulary-sized
matrix, and the merged model computes what the online NF4 model did. Naming lm_head adapts it, and the exports untie it
knowingly. An untied head stays NF4."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from lit_qlora.lora.layer import TARGETS, resolve_targets, tied_head_note
from lit_qlora.train.finetune import finetune
from lit_qlora.train.args import ExportArgs, LoRAArgs, TrainArgs

from helpers import small_data


def test_all_leaves_a_tied_head_out_and_naming_it_adapts_it():
    every = [t for t in TARGETS if t != "router"]  # a mixture of experts' router trains only when named
    assert resolve_targets("all") == resolve_targets(["all"], tied_head=False) == every
    assert resolve_targets(["all", "router"]) == list(TARGETS)
    assert resolve_targets(["all"], tied_head=True) == every[:-1]
    assert resolve_targets(["all", "lm_head"], tied_head=True) == every
    assert resolve_targets(["q", "lm_head"], tied_head=True) == ["q", "lm_head"]
    note = tied_head_note(["all"], True)
    assert "lm_head is tied to the embedding" in note and "--lora.targets '[all, lm_head]'" in note
    assert "untie" in tied_head_note(["all", "lm_head"], True) and tied_head_note(["all"], False) is None


@pytest.mark.parametrize("targets", [["all"], ["all", "lm_head"]], ids=["default", "head-named"])
def test_a_qlora_fine_tunes_exports_keep_a_tied_head_tied_unless_it_was_adapted(targets, tiny_llama_dir, tmp_path,
                                                                                capsys):
    import gguf

    out = tmp_path / "run"
    finetune(checkpoint_dir=tiny_llama_dir, out_dir=out, precision="32-true", accelerator="cpu",
             lora=LoRAArgs(r=4, alpha=8, dropout=0.0, targets=targets), data=small_data(tmp_path),
             train=TrainArgs(micro_batch_size=2, global_batch_size=2, max_seq_length=64, max_steps=1),
             export=ExportArgs(gguf="f32"))
    adapted = "lm_head" in targets
    printed = capsys.readouterr().out
    assert ("unties it in the exports" in printed) != adapted and ("untie" in printed)
    final = out / "final"
    adapter_config = json.loads((final / "adapter_config.json").read_text())
    assert ("lm_head" in adapter_config["targets"]) == adapted
    with safe_open(final / "adapter.safetensors", "pt") as f:
        assert any(k.startswith("lm_head.") for k in f.keys()) == adapted
    # the merged model keeps the head tied unless the adapter changed it: the head QLoRA computed with is the embedding
    merged_config = json.loads((final / "merged" / "config.json").read_text())
    assert merged_config["tie_word_embeddings"] is (not adapted)
    with safe_open(final / "merged" / "model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) == adapted
    with safe_open(final / "peft" / "adapter_model.safetensors", "pt") as f:
        assert any(".lm_head." in k for k in f.keys()) == adapted
    tensors = {t.name for t in gguf.GGUFReader(final / "model-f32.gguf").tensors}
    assert ("output.weight" in tensors) == adapted and "token_embd.weight" in tensors


def test_a_lora_fine_tunes_merged_model_keeps_the_tied_head_tied(tiny_llama_dir, tmp_path):
    """On a bf16/fp32 base the unadapted head is the embedding itself: the merged model stays tied."""
    out = tmp_path / "run"
    finetune(checkpoint_dir=tiny_llama_dir, out_dir=out, quantize="none", precision="32-true", accelerator="cpu",
             lora=LoRAArgs(r=4, alpha=8, dropout=0.0), data=small_data(tmp_path),
             train=TrainArgs(micro_batch_size=2, global_batch_size=2, max_seq_length=64, max_steps=1),
             export=ExportArgs(peft=False))
    assert json.loads((out / "final" / "merged" / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(out / "final" / "merged" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()


def test_a_qlora_model_reads_a_tied_head_from_the_embedding_and_keeps_an_untied_head_nf4(tiny_llama_dir, tmp_path):
    import torch

    from lit_qlora.checkpoint.loading import load_model, random_base
    from lit_qlora.memory.accounting import module_bytes, tensor_bytes
    from lit_qlora.model.config import Config
    from lit_qlora.nf4 import count_linears, is_nf4, quantize_weight

    model = load_model(tiny_llama_dir, "nf4", "32-true")
    assert model.config.tie_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert not is_nf4(model.lm_head.weight) and model.lm_head.weight.dtype == torch.float32
    quantized, total = count_linears(model)
    assert quantized == total == 7 * model.config.n_layer  # every linear with a weight of its own is NF4
    untied = random_base(Config.from_checkpoint(tiny_llama_dir).replace(tie_embeddings=False), "nf4", torch.float32)
    assert is_nf4(untied.lm_head.weight) and count_linears(untied) == (total + 1, total + 1)
    # what the tied head no longer costs: the NF4 copy it had of the embedding
    tied = random_base(model.config, "nf4", torch.float32)
    copy = quantize_weight(tied.model.embed_tokens.weight.detach())
    assert module_bytes(untied) - module_bytes(tied) == pytest.approx(tensor_bytes(copy), rel=0.01)


@pytest.mark.parametrize("quantize", ["nf4", "none"])
def test_the_merged_model_of_a_tied_head_run_computes_what_the_online_model_did(quantize, tiny_llama_dir, tmp_path):
    """The unadapted tied head is the embedding in training and in the merged export alike: the merged model's logits
    equal the online model's (NF4 base + adapter) up to the merged directory's bf16 rounding, and its head is the
    embedding, bit for bit."""
    import torch

    from lit_qlora.checkpoint.loading import load_model

    out = tmp_path / "run"
    finetune(checkpoint_dir=tiny_llama_dir, out_dir=out, quantize=quantize, precision="32-true", accelerator="cpu",
             lora=LoRAArgs(r=4, alpha=8, dropout=0.0), data=small_data(tmp_path), export=ExportArgs(peft=False),
             train=TrainArgs(micro_batch_size=2, global_batch_size=2, max_seq_length=64, max_steps=2, lr=1e-2))
    online = load_model(tiny_llama_dir, quantize, "32-true", adapter_dir=out / "final").eval()
    merged = load_model(out / "final" / "merged", "none", "32-true").eval()
    assert merged.config.tie_embeddings and merged.lm_head.weight is merged.model.embed_tokens.weight
    idx = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, ours = merged(idx), online(idx)
        base = load_model(tiny_llama_dir, quantize, "32-true").eval()(idx)
    # The merged directory is bf16: its weights are the online ones rounded once (the head, the embedding, exactly).
    assert torch.equal(merged.model.embed_tokens.weight, online.model.embed_tokens.weight.bfloat16().float())
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-2)
    assert (ours - base).abs().max() > 10 * (theirs - ours).abs().max()  # the adapter's change is what shows
