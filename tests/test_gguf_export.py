"""`litqlora export_gguf` (lit_qlora/deploy/gguf_export.py): files our own GGUF import reads back to the merged
model's logits (f32), to the weights rounded as the type says (f16, bf16, q8_0), with the tokenizer, chat template
and an Ollama Modelfile; what it cannot write is refused before anything is written."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from lit_qlora.deploy.gguf_export import GGUFExportError, export_gguf, permute_rope_rows
from lit_qlora.gguf_import import convert_gguf, unpermute_rope_rows
from lit_qlora.loading import load_model
from lit_qlora.tokenizer import Tokenizer
from test_families import hf_checkpoint, random_adapter, tokens

FAMILIES = {"llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
            "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
            "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=32))}
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
@pytest.mark.parametrize("family", list(FAMILIES))
def test_f32_export_reads_back_to_the_merged_models_logits(family, quantize, smollm2_dir, tmp_path):
    kind, extra = FAMILIES[family]
    hf_checkpoint(kind, extra, tmp_path / "base", smollm2_dir)
    adapter = random_adapter(load_model(tmp_path / "base", quantize, "32-true"), tmp_path / "adapter", quantize)
    merged = load_model(tmp_path / "base", quantize, "32-true", adapter_dir=adapter)
    path = export_gguf(tmp_path / "base", tmp_path / "model.gguf", adapter_dir=adapter, dtype="f32")
    back = load_model(convert_gguf(path, tmp_path / "back"), "none", "32-true")
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
    hf_checkpoint("Gemma2Config", dict(head_dim=16), tmp_path / "gemma", smollm2_dir)
    with pytest.raises(GGUFExportError, match="'gemma2'.*convert_hf_to_gguf"):
        export_gguf(tmp_path / "gemma", tmp_path / "g.gguf")
    from tokenizers import Tokenizer as Backend, models

    hf_checkpoint("LlamaConfig", {}, tmp_path / "unigram", smollm2_dir)
    Backend(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0, False)).save(str(tmp_path / "unigram" / "tokenizer.json"))
    with pytest.raises(GGUFExportError, match="Unigram tokenizer"):
        export_gguf(tmp_path / "unigram", tmp_path / "u.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*.tmp"))


def test_cli_writes_a_quantized_file_and_refuses_an_unknown_type(tiny_llama_dir, tmp_path):
    cmd = [sys.executable, "-m", "lit_qlora.cli", "export_gguf", "--checkpoint_dir", str(tiny_llama_dir),
           "--out", str(tmp_path / "tiny.gguf")]
    done = subprocess.run(cmd + ["--dtype", "q4_0"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "tiny.gguf").is_file() and (tmp_path / "Modelfile").is_file()
    bad = subprocess.run(cmd + ["--dtype", "q3_k"], capture_output=True, text=True)
    assert bad.returncode != 0 and "q8_0" in bad.stderr


def test_finetune_export_gguf_writes_the_trained_models_file_into_final(tiny_llama_dir, tmp_path):
    from lit_qlora.finetune import finetune
    from lit_qlora.train.args import ExportArgs, LoRAArgs, TrainArgs
    from test_finetune import small_data

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

    from test_gguf_import import SPM_TEXTS, sentencepiece_gguf_vocab, train_sentencepiece, write_tiny_llama

    model_file = train_sentencepiece(tmp_path, add_dummy_prefix)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    write_tiny_llama(tmp_path / "spm.gguf", tokenizer=sentencepiece_gguf_vocab(model_file, add_dummy_prefix))
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
