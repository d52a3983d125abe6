"""A head tied to the embedding (SmolLM2, Gemma, small Qwen) stays tied: `--lora.targets all` leaves it out and says
how to adapt it anyway; the GGUF export of a QLoRA fine-tune writes it tied (the embedding W, where QLoRA computed with
an NF4 copy), so the GGUF holds one vocabulary-sized matrix; the merged Hugging Face model keeps the head QLoRA
computed, dequant(NF4(W)), exactly. Naming lm_head adapts it, and the exports untie it knowingly."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from lit_qlora.lora.layer import TARGETS, resolve_targets, tied_head_note
from lit_qlora.train.finetune import finetune
from lit_qlora.train.args import ExportArgs, LoRAArgs, TrainArgs

from test_finetune import small_data


def test_all_leaves_a_tied_head_out_and_naming_it_adapts_it():
    every = list(TARGETS)
    assert resolve_targets("all") == resolve_targets(["all"], tied_head=False) == every
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
    # the merged model keeps what QLoRA computed exactly: the head's NF4 copy, dequant(NF4(W)), a weight of its own
    merged_config = json.loads((final / "merged" / "config.json").read_text())
    assert merged_config["tie_word_embeddings"] is False
    with safe_open(final / "merged" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" in f.keys()
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
