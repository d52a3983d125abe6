"""`litqlora export_gguf` (lit_qlora/export/gguf.py): files our own GGUF import reads back to the merged
model's logits (f32), to the weights rounded as the type says (f16, bf16, q8_0), with the tokenizer, chat template
and an Ollama Modelfile; what it cannot write is refused before anything is written."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from lit_qlora.export.gguf import GGUFExportError, export_gguf, permute_rope_rows
from lit_qlora.export.gguf_import import convert_gguf, unpermute_rope_rows
from lit_qlora.checkpoint.loading import load_model
from lit_qlora.checkpoint.tokenizer import Tokenizer
from helpers import random_adapter  # noqa: E402
from helpers import GGUF_FAMILIES, family_export, hf_checkpoint, tokens

TEXTS = ["Hello world! 12345 What's the capital of France?", "<|im_start|>user\nhi<|im_end|>\n",
         "  tabs\tand\nnewlines"]


def logits(model, ids):
    with torch.no_grad():
        return model(ids)


def test_the_rope_permutation_is_the_inverse_of_the_imports():
    w = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    assert not np.array_equal(permute_rope_rows(w, 4), w)
    assert np.array_equal(unpermute_rope_rows(permute_rope_rows(w, 4), 4), w)


@pytest.mark.parametrize("quantize", ["none", "nf4"])
@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_f32_export_reads_back_to_the_merged_models_logits(family, quantize, smollm2_dir, tmp_path):
    _, _, merged, path = family_export(family, quantize, tmp_path, smollm2_dir)
    back = load_model(convert_gguf(path, tmp_path / "back"), "none", "32-true")
    assert back.config.model_type == merged.config.model_type.replace("mistral", "llama")
    ids = tokens((2, 24))
    want, got = logits(merged, ids), logits(back, ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    base = logits(load_model(tmp_path / "base", quantize, "32-true"), ids)
    assert (base - want).abs().max() > 100 * (got - want).abs().max()  # the adapter is in the file
    assert Tokenizer(tmp_path / "back").encode(TEXTS[0]) == Tokenizer(tmp_path / "base").encode(TEXTS[0])


@pytest.fixture(scope="module")
def smollm2_exports(smollm2_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smollm2-gguf")
    return {dtype: convert_gguf(export_gguf(smollm2_dir, tmp / f"smollm2-{dtype}.gguf", dtype=dtype), tmp / dtype)
            for dtype in ("f16", "bf16", "q8_0")}, tmp


def test_smollm2_f16_and_bf16_hold_the_weights_rounded_once(smollm2_dir, smollm2_exports):
    from safetensors.torch import load_file

    backs, _ = smollm2_exports
    original = load_file(str(smollm2_dir / "model.safetensors"))
    for dtype, torch_dtype in (("f16", torch.float16), ("bf16", torch.bfloat16)):
        got = load_file(str(backs[dtype] / "model.safetensors"))
        assert got.keys() == original.keys()
        for name, w in original.items():
            want = w if w.dim() == 1 else w.to(torch_dtype).float()  # norms stay f32
            assert torch.equal(got[name], want), (dtype, name)


def test_smollm2_q8_0_is_within_q8_0s_error_and_answers_alike(smollm2_dir, smollm2_exports):
    from safetensors.torch import load_file

    backs, _ = smollm2_exports
    original = load_file(str(smollm2_dir / "model.safetensors"))
    got = load_file(str(backs["q8_0"] / "model.safetensors"))
    for name, w in original.items():
        if w.dim() == 1:
            assert torch.equal(got[name], w)
            continue
        blocks, err = w.reshape(-1, 32), (got[name] - w).reshape(-1, 32)
        # Q8_0: 32 values share a step absmax/127 stored in fp16, each value rounded to the nearest step: half a
        # step, plus up to 127 times the step's fp16 rounding (2^-11 of it) for the block's largest values
        step = blocks.abs().amax(1) / 127
        assert (err.abs().amax(1) <= step * (0.5 + 127 * 2**-11) + 1e-7).all(), name
    ids = Tokenizer(smollm2_dir).encode("The capital of France is")
    a, b = load_model(smollm2_dir, "none", "32-true"), load_model(backs["q8_0"], "none", "32-true")
    assert logits(a, torch.tensor([ids]))[0, -1].argmax() == logits(b, torch.tensor([ids]))[0, -1].argmax()


def test_smollm2_tokenizer_chat_template_and_modelfile(smollm2_dir, smollm2_exports):
    backs, tmp = smollm2_exports
    want, got = Tokenizer(smollm2_dir), Tokenizer(backs["f16"])
    assert all(got.encode(t) == want.encode(t) for t in TEXTS)
    assert got.chat_template == want.chat_template and got.eos_ids == want.eos_ids
    assert (tmp / "Modelfile").read_text() == 'FROM ./smollm2-q8_0.gguf\nPARAMETER stop "<|im_end|>"\n'
    assert sorted(p.name for p in tmp.glob("*.gguf")) == ["smollm2-bf16.gguf", "smollm2-f16.gguf", "smollm2-q8_0.gguf"]


def test_what_llama_cpp_would_not_get_right_is_refused_before_writing(smollm2_dir, tmp_path):
    refused = {  # llama.cpp fixes Gemma's query scale and sliding layers, and has no final soft-cap for Gemma 3
        "query_pre_attn_scalar 256": ("Gemma2Config", dict(head_dim=16)),
        "sliding layers": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16,
                                                    layer_types=["full_attention", "sliding_attention"])),
        "final logit soft-cap on Gemma 3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16,
                                                                   final_logit_softcapping=3.0)),
    }
    for reason, (kind, extra) in refused.items():
        hf_checkpoint(kind, extra, tmp_path / "model", smollm2_dir)
        with pytest.raises(GGUFExportError, match=f"cannot write this .*{reason}.*merged Hugging Face export"):
            export_gguf(tmp_path / "model", tmp_path / "g.gguf")
    from tokenizers import Tokenizer as Backend, models

    hf_checkpoint("LlamaConfig", {}, tmp_path / "unigram", smollm2_dir)
    Backend(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0, False)).save(str(tmp_path / "unigram" / "tokenizer.json"))
    with pytest.raises(GGUFExportError, match="Unigram tokenizer"):
        export_gguf(tmp_path / "unigram", tmp_path / "u.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*.tmp"))


def test_a_gemma2_head_adapter_is_refused_and_finetune_says_so_before_training(smollm2_dir, tmp_path):
    """llama.cpp's gemma2 reads its head from the embedding: an adapter on lm_head (named: `all` leaves a tied head
    out) cannot go into the file, and `finetune --export.gguf` refuses before its first step."""
    from lit_qlora.train.args import ExportArgs, LoRAArgs, TrainArgs
    from lit_qlora.train.finetune import finetune

    kind, extra = GGUF_FAMILIES["gemma2"]
    hf_checkpoint(kind, extra, tmp_path / "base", smollm2_dir)
    adapter = random_adapter(load_model(tmp_path / "base", "none", "32-true"), tmp_path / "adapter", "none",
                             ["all", "lm_head"])
    with pytest.raises(GGUFExportError, match="head apart from the embedding.*--lora.targets"):
        export_gguf(tmp_path / "base", tmp_path / "g.gguf", adapter_dir=adapter)
    with pytest.raises(GGUFExportError, match="head apart from the embedding"):
        finetune(checkpoint_dir=tmp_path / "base", out_dir=tmp_path / "out", precision="32-true",
                 lora=LoRAArgs(targets=["all", "lm_head"]), train=TrainArgs(max_steps=1),
                 export=ExportArgs(gguf="f16"))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("*.gguf"))


def test_a_sliding_window_llama_cpp_does_not_have_bounds_the_files_context(smollm2_dir, tmp_path, capfd):
    """Mistral's (and Phi-3's) window does not exist in llama.cpp's llama (phi3): the file says the window is its
    context, within which full attention is what the model computes."""
    import gguf

    hf_checkpoint("MistralConfig", dict(sliding_window=8), tmp_path / "mistral", smollm2_dir)
    path = export_gguf(tmp_path / "mistral", tmp_path / "m.gguf", dtype="f32")
    assert "context length is the 8-token window" in capfd.readouterr().err
    assert gguf.GGUFReader(path).fields["llama.context_length"].contents() == 8
    back = load_model(convert_gguf(path, tmp_path / "back"), "none", "32-true")
    ids = tokens((1, 8))
    want = logits(load_model(tmp_path / "mistral", "none", "32-true"), ids)
    assert (logits(back, ids) - want).abs().max() <= 1e-5 * want.abs().max()


def test_large_weights_are_written_a_block_of_rows_at_a_time(smollm2_dir):
    """The SmolLM2 embedding (49152 x 576) reaches the file in row blocks of at most MERGE_CHUNK_ELEMS values, Gemma
    norms come out as 1 + w, Phi-3's fused projections as their parts in row order."""
    from lit_qlora.export.gguf import gguf_tensors
    from lit_qlora.lora.layer import MERGE_CHUNK_ELEMS

    model = load_model(smollm2_dir, "nf4", "32-true")
    entries = {name: (shape, pieces) for name, shape, pieces in gguf_tensors(model, model.config, "llama", False)}
    shape, pieces = entries["token_embd.weight"]
    blocks = list(pieces())
    assert shape == (49152, 576) and len(blocks) > 1
    assert all(b.size <= MERGE_CHUNK_ELEMS for b in blocks) and sum(b.shape[0] for b in blocks) == 49152
    assert np.array_equal(np.concatenate(blocks), model.model.embed_tokens.weight.detach().numpy())


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_family_tensors_are_laid_out_as_llama_cpp_reads_them(family, smollm2_dir, tmp_path):
    from lit_qlora.export.gguf import gguf_tensors

    kind, extra = GGUF_FAMILIES[family]
    hf_checkpoint(kind, extra, tmp_path / "base", smollm2_dir)
    model = load_model(tmp_path / "base", "none", "32-true")
    arch = {"gemma3": "gemma3", "phi3": "phi3"}[family]
    entries = {name: np.concatenate(list(pieces())) for name, _, pieces in
               gguf_tensors(model, model.config, arch, False)}
    layer = model.model.layers[0]
    if family == "gemma3":
        pre_mlp = layer.pre_feedforward_layernorm.weight.detach().numpy()
        assert np.array_equal(entries["blk.0.ffn_norm.weight"], pre_mlp + 1)
        assert np.array_equal(entries["blk.0.post_ffw_norm.weight"],
                              layer.post_feedforward_layernorm.weight.detach().numpy() + 1)
        assert np.array_equal(entries["blk.0.attn_q_norm.weight"], layer.self_attn.q_norm.weight.detach().numpy() + 1)
    else:
        attn, mlp = layer.self_attn, layer.mlp
        assert np.array_equal(entries["blk.0.attn_qkv.weight"], torch.cat(
            [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach().numpy())
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().numpy()
        assert np.array_equal(entries["blk.0.ffn_up.weight"], gate_up)
        assert "blk.0.ffn_gate.weight" not in entries and "blk.0.attn_q.weight" not in entries


def test_cli_writes_a_quantized_file_and_refuses_an_unknown_type(tiny_llama_dir, tmp_path):
    cmd = [sys.executable, "-m", "lit_qlora.cli", "export_gguf", "--checkpoint_dir", str(tiny_llama_dir),
           "--out", str(tmp_path / "tiny.gguf")]
    done = subprocess.run(cmd + ["--dtype", "q4_0"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "tiny.gguf").is_file() and (tmp_path / "Modelfile").is_file()
    bad = subprocess.run(cmd + ["--dtype", "q3_k"], capture_output=True, text=True)
    assert bad.returncode != 0 and "q8_0" in bad.stderr


def test_finetune_export_gguf_writes_the_trained_models_file_into_final(tiny_llama_dir, tmp_path):
    from lit_qlora.train.finetune import finetune
    from lit_qlora.train.args import ExportArgs, LoRAArgs, TrainArgs
    from helpers import small_data

    summary = finetune(checkpoint_dir=tiny_llama_dir, out_dir=tmp_path / "out", precision="32-true", accelerator="cpu",
                       lora=LoRAArgs(r=4, alpha=8), data=small_data(tmp_path),
                       train=TrainArgs(micro_batch_size=2, global_batch_size=2, max_seq_length=64, lr=1e-2,
                                       warmup_steps=1, max_steps=2), export=ExportArgs(gguf="f32"))
    final = tmp_path / "out" / "final"
    assert summary["gguf"] == str(final / "model-f32.gguf") and (final / "Modelfile").is_file()
    back = load_model(convert_gguf(final / "model-f32.gguf", tmp_path / "back"), "none", "32-true")
    trained = load_model(tiny_llama_dir, adapter_dir=final, precision="32-true")
    ids = tokens((1, 16))
    want, got = logits(trained, ids), logits(back, ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("add_dummy_prefix", [True, False], ids=["llama", "no-space-prefix"])
def test_a_sentencepiece_vocabulary_exports_with_its_scores_and_encodes_alike(tmp_path, add_dummy_prefix):
    """Llama 2 / TinyLlama / Mistral style: a trained SentencePiece BPE model (byte fallback, user-defined and control
    pieces), read from a GGUF as llama.cpp's converter writes it, exported back: the same pieces, types and
    space prefix, scores whose order gives the same merges, and the same token ids for every test text."""
    import gguf
    import sentencepiece

    from helpers import SPM_TEXTS, sentencepiece_gguf_vocab, train_sentencepiece, write_tiny_gguf

    model_file = train_sentencepiece(tmp_path, add_dummy_prefix)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    write_tiny_gguf(tmp_path / "spm.gguf", tokenizer=sentencepiece_gguf_vocab(model_file, add_dummy_prefix))
    source = convert_gguf(tmp_path / "spm.gguf", tmp_path / "source")
    exported = export_gguf(source, tmp_path / "exported.gguf", dtype="f32")
    fields = {name: f.contents() for name, f in gguf.GGUFReader(exported).fields.items()}
    assert fields["tokenizer.ggml.model"] == "llama"
    assert fields["tokenizer.ggml.tokens"] == [sp.id_to_piece(i) for i in range(sp.vocab_size())]
    assert fields["tokenizer.ggml.add_space_prefix"] == add_dummy_prefix
    assert fields["tokenizer.ggml.unknown_token_id"] == sp.unk_id()
    types = fields["tokenizer.ggml.token_type"]
    assert [types[i] for i in range(sp.vocab_size()) if sp.is_byte(i)] == [6] * 256
    back = convert_gguf(exported, tmp_path / "back")
    want, got = Tokenizer(source), Tokenizer(back)
    for text in SPM_TEXTS:
        assert got.encode(text) == want.encode(text), text
        assert got.decode(got.encode(text)) == want.decode(want.encode(text)), text
    ids = tokens((1, 12)) % sp.vocab_size()
    source_logits = logits(load_model(source, "none", "32-true"), ids)
    assert torch.equal(logits(load_model(back, "none", "32-true"), ids), source_logits)
