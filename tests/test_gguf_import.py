"""GGUF import: synthetic files (every supported quant type, the q/k permutation, bad files, byte-level and
SentencePiece vocabularies) and the real SmolLM2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lit_qlora.model.config import Config
from lit_qlora.model.presets import preset as named_preset
from lit_qlora.export.gguf_import import bundled_smollm2_path, convert_gguf, unpermute_rope_rows
from lit_qlora.export.gguf_tokenizer import tokenizer_from_gguf
from lit_qlora.model.transformer import Transformer
from lit_qlora.checkpoint.tokenizer import Tokenizer

from helpers import (GGML, SPM_CONTROL, SPM_TEXTS, SPM_USER_DEFINED, llama_cpp_permute,
                     sentencepiece_gguf_vocab, train_sentencepiece, write_tiny_gguf)

@pytest.mark.parametrize("tied", [False, True])
def test_synthetic_llama_weights_are_exact(tmp_path: Path, tied: bool) -> None:
    config, expected = write_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    got = load_file(out / "model.safetensors")
    assert set(got) == set(expected)  # no lm_head.weight when tied
    for name, value in expected.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], torch.from_numpy(value), rtol=0, atol=0, msg=name)

    written = Config.from_checkpoint(out)
    for field in ("vocab_size", "n_layer", "n_embd", "n_head", "n_query_groups", "head_dim", "intermediate_size",
                  "norm_eps", "rope_base", "max_seq_length", "tie_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(written, field) == getattr(config, field), field
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left

    model = Transformer(written)
    assert model.load_state_dict(got, strict=False).missing_keys == (["lm_head.weight"] if tied else [])
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, config.vocab_size)


def test_dtype_option(tmp_path: Path) -> None:
    _, expected = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", dtype="bfloat16")
    got = load_file(out / "model.safetensors")["model.layers.1.self_attn.k_proj.weight"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.from_numpy(expected["model.layers.1.self_attn.k_proj.weight"]).bfloat16())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", dtype="int8")


def test_qwen2_is_not_permuted(tmp_path: Path) -> None:
    # llama.cpp only permutes q/k for its llama architecture; qwen2 keeps HF's layout.
    _, expected = write_tiny_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    out = convert_gguf(tmp_path / "qwen.gguf", tmp_path / "out")
    assert Config.from_checkpoint(out).model_type == "qwen2"
    got = load_file(out / "model.safetensors")
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                       torch.from_numpy(expected["model.layers.0.self_attn.q_proj.weight"]))


def test_qwen3_converts_with_its_head_dim_and_qk_norms_and_transformers_agrees(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config, expected = write_tiny_gguf(tmp_path / "qwen3.gguf", arch="qwen3")
    out = convert_gguf(tmp_path / "qwen3.gguf", tmp_path / "out")
    got = load_file(out / "model.safetensors")
    assert set(got) == set(expected) and "model.layers.1.self_attn.k_norm.weight" in got
    assert all(torch.equal(got[name], torch.from_numpy(value)) for name, value in expected.items())  # not permuted
    written = Config.from_checkpoint(out)
    assert (written.model_type, written.qk_norm, written.head_dim) == ("qwen3", True, 32)
    ours = Transformer(written).eval()
    ours.load_state_dict(got, strict=True)  # raises on a tensor missing or left over
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    idx = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(idx) - theirs(idx).logits).abs().max() <= 1e-4


def test_unpermute_makes_interleaved_rope_equal_rotate_half_rope() -> None:
    """Why the permutation exists: llama.cpp rotates adjacent pairs (2i, 2i+1), HF rotates (i, i + d/2). With the
    rows permuted, interleaved rope on the GGUF weights gives the same attention scores as HF rope on ours."""
    n_heads, hd, dim, T_ = 2, 8, 16, 5
    g = torch.Generator().manual_seed(0)
    wq, wk = torch.randn(2, n_heads * hd, dim, generator=g)
    x = torch.randn(T_, dim, generator=g)
    angles = torch.arange(T_)[:, None] * (1.0 / 10000 ** (torch.arange(0, hd, 2) / hd))[None]  # (T, hd/2)
    cos, sin = angles.cos(), angles.sin()

    def rotate_half_rope(q: torch.Tensor) -> torch.Tensor:  # (T, heads, hd)
        a, b = q[..., : hd // 2], q[..., hd // 2:]
        return torch.cat((a * cos[:, None] - b * sin[:, None], b * cos[:, None] + a * sin[:, None]), -1)

    def interleaved_rope(q: torch.Tensor) -> torch.Tensor:
        a, b = q[..., 0::2], q[..., 1::2]
        return torch.stack((a * cos[:, None] - b * sin[:, None], b * cos[:, None] + a * sin[:, None]), -1).flatten(-2)

    def scores(wq_, wk_, rope):
        q, k = (rope((x @ w_.T).view(T_, n_heads, hd)) for w_ in (wq_, wk_))
        return torch.einsum("thd,shd->hts", q, k)

    gq, gk = (torch.from_numpy(llama_cpp_permute(w_.numpy(), n_heads)) for w_ in (wq, wk))
    hf_q, hf_k = (torch.from_numpy(unpermute_rope_rows(w_.numpy(), n_heads)) for w_ in (gq, gk))
    assert torch.equal(hf_q, wq) and torch.equal(hf_k, wk)
    torch.testing.assert_close(scores(gq, gk, interleaved_rope), scores(hf_q, hf_k, rotate_half_rope))
    assert not torch.allclose(scores(gq, gk, rotate_half_rope), scores(hf_q, hf_k, rotate_half_rope))


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    # llama.cpp writes Llama 3.x rope scaling as per-frequency divisors (rope_freqs.weight), computed like this.
    factor, low, high, original, hd = 32.0, 1.0, 4.0, 8192, 64
    divisors = []
    for freq in 1.0 / 500000.0 ** (np.arange(0, hd, 2) / hd):
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    write_tiny_gguf(tmp_path / "l3.gguf", raw={"rope_freqs.weight": (np.array(divisors, np.float32), GGML.F32)})
    config = Config.from_checkpoint(convert_gguf(tmp_path / "l3.gguf", tmp_path / "out"))
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    divisors[5] *= 1.5  # not a llama3 schedule: refuse rather than guess
    write_tiny_gguf(tmp_path / "odd.gguf", raw={"rope_freqs.weight": (np.array(divisors, np.float32), GGML.F32)})
    with pytest.raises(ValueError, match="rope_freqs.weight does not match Llama 3 rope scaling"):
        convert_gguf(tmp_path / "odd.gguf", tmp_path / "out2")


def test_synthetic_tokenizer(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", add_bos=True)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    tok = Tokenizer(out)
    text = "the then 2024 héllo\n\t<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(1) == 1  # add_bos_token was true in the GGUF
    pieces = [tok.backend.id_to_token(i) for i in ids[1:]]
    assert pieces[:4] == ["t", "he", "Ġthe", "n"] and pieces[-1] == "<|im_end|>"
    assert ["2", "0", "2", "4"] == pieces[5:9]  # smollm splits digits one by one
    assert tok.decode(ids[1:]) == text
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["bos_token"] == "<|im_start|>"
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert hf.encode(text) == ids  # BOS from the post-processor, once


@pytest.mark.parametrize("add_dummy_prefix", [True, False], ids=["llama", "no-space-prefix"])
def test_sentencepiece_tokenizer_encodes_like_the_source(tmp_path: Path, add_dummy_prefix: bool) -> None:
    import sentencepiece
    from tokenizers import Tokenizer as Backend

    transformers = pytest.importorskip("transformers")
    model_file = train_sentencepiece(tmp_path, add_dummy_prefix)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    write_tiny_gguf(tmp_path / "spm.gguf", tokenizer=sentencepiece_gguf_vocab(model_file, add_dummy_prefix))
    out = convert_gguf(tmp_path / "spm.gguf", tmp_path / "out")

    # The source tokenizer.json: Hugging Face's conversion of the .model file (Llama's legacy behaviour).
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tokenizer.model").write_bytes(model_file.read_bytes())
    source = transformers.LlamaTokenizerFast.from_pretrained(
        tmp_path / "src", legacy=True, add_prefix_space=add_dummy_prefix, from_slow=True)
    source.save_pretrained(tmp_path / "src")
    source = Backend.from_file(str(tmp_path / "src" / "tokenizer.json"))
    ours, lit, hf = (Backend.from_file(str(out / "tokenizer.json")), Tokenizer(out),
                     transformers.AutoTokenizer.from_pretrained(out))

    added = {piece: sp.piece_to_id(piece) for piece in [*SPM_USER_DEFINED, *SPM_CONTROL, "<s>", "</s>", "<unk>"]}
    cut = re.compile("(" + "|".join(map(re.escape, added)) + ")")

    def reference(text: str) -> list[int]:
        """SentencePiece's ids, with llama.cpp's (and Llama 2 tokenizer.json's) "legacy" handling of control and
        user-defined symbols: the text between them is encoded piece by piece, each with its own "▁" prefix."""
        return [sp.bos_id()] + [i for part in cut.split(text) if part
                                for i in ([added[part]] if part in added else sp.encode(part))]

    for text in SPM_TEXTS:
        expected = reference(text)
        assert ours.encode(text).ids == expected, text
        assert lit.encode(text) == expected, text
        assert hf.encode(text) == expected, text
        # transformers 5's conversion (Metaspace) skips the "▁" prefix of text that starts with a space;
        # SentencePiece, llama.cpp and Llama 2's published tokenizer.json (Prepend "▁") keep it.
        if not any(part.startswith(" ") for part in cut.split(text)) or not add_dummy_prefix:
            assert source.encode(text, add_special_tokens=False).ids == expected[1:], text
        assert lit.decode(expected) == source.decode(expected, skip_special_tokens=False), text
        if not cut.search(text):
            assert lit.decode(expected[1:]) == sp.decode(expected[1:]) == text  # round trip
    assert "▁▁▁▁" in sp.id_to_piece(list(range(sp.vocab_size())))  # the whitespace runs were merged too

    config = json.loads((out / "tokenizer_config.json").read_text())
    assert {k: v for k, v in config.items() if k not in ("model_max_length", "chat_template")} == {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False, "legacy": True}
    assert lit.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|user|>hi</s>"
    assert lit.decode(lit.encode("<|ctrl|>x <sep>"), skip_special_tokens=True) == "x <sep>"  # control is special


def test_unknown_tokenizer_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="tokenizer model 'bert' is not supported"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "bert", "general.architecture": "llama"}, "x.gguf")


def test_bad_files(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    for name, content in {"truncated.gguf": data[: len(data) // 2], "header.gguf": data[:100],
                          "random.gguf": np.random.default_rng(0).bytes(4096), "empty.gguf": b""}.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=f"{name} is not a valid GGUF file"):
            convert_gguf(tmp_path / name, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def test_unsupported_architecture_and_quant_type(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    w.add_block_count(1)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match=r"gpt2\.gguf: GGUF architecture 'gpt2' is not supported"):
        convert_gguf(tmp_path / "gpt2.gguf", tmp_path / "out")

    write_tiny_gguf(tmp_path / "odd.gguf", raw={"blk.0.ffn_norm.bias": (np.zeros(256, np.float32), GGML.F32)})
    with pytest.raises(ValueError, match="unexpected tensors .*blk.0.ffn_norm.bias"):
        convert_gguf(tmp_path / "odd.gguf", tmp_path / "out")
    block, size = gguf.GGML_QUANT_SIZES[GGML.Q8_1]  # gguf has no dequantizer for Q8_1
    q8_1 = np.zeros(256 // block * size, dtype=np.uint8)
    write_tiny_gguf(tmp_path / "q81.gguf", raw={"output_norm.weight": (q8_1, GGML.Q8_1)})
    with pytest.raises(ValueError, match="tensor output_norm.weight uses quantization type Q8_1"):
        convert_gguf(tmp_path / "q81.gguf", tmp_path / "out")


# -- the real SmolLM2-135M-Instruct ------------------------------------------------------------------------------
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_smollm2_config(smollm2_dir: Path) -> None:
    config = Config.from_checkpoint(smollm2_dir)
    preset = named_preset("SmolLM2-135M")
    for field in ("vocab_size", "n_layer", "n_embd", "n_head", "n_query_groups", "head_dim", "intermediate_size",
                  "norm_eps", "rope_base", "max_seq_length", "tie_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(config, field) == getattr(preset, field), field


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loading(smollm2_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    gguf_path = bundled_smollm2_path()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    converted = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ours = Transformer(Config.from_checkpoint(smollm2_dir))
    loaded = ours.load_state_dict(load_file(smollm2_dir / "model.safetensors"), strict=False)
    assert loaded.missing_keys == ["lm_head.weight"]  # tied to the embedding
    ours.eval()

    ids = torch.tensor([Tokenizer(smollm2_dir).encode(PROMPT)])
    with torch.no_grad():
        expected = reference(ids).logits
        assert (converted(ids).logits - expected).abs().max() <= 1e-3
        assert (ours(ids) - expected).abs().max() <= 1e-3

        # With the right q/k layout the model knows the answer (greedy, no cache: 135M is fast enough).
        for _ in range(8):
            ids = torch.cat([ids, ours(ids)[:, -1:].argmax(-1)], dim=1)
    assert "Paris" in Tokenizer(smollm2_dir).decode(ids[0, -8:])


def test_convert_refuses_to_replace_a_checkpoint_unless_told(tmp_path: Path) -> None:
    from lit_qlora.cli import main

    write_tiny_gguf(tmp_path / "tiny.gguf", tied=False)
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "model-00002-of-00002.safetensors").write_bytes(b"a user's shard")
    with pytest.raises(SystemExit) as refused:
        main(["convert_gguf", str(tmp_path / "tiny.gguf"), "--out_dir", str(out)])
    assert refused.value.code == 1
    assert [p.name for p in out.iterdir()] == ["model-00002-of-00002.safetensors"]  # untouched

    main(["convert_gguf", str(tmp_path / "tiny.gguf"), "--out_dir", str(out), "--overwrite", "true"])
    # Replaced as a whole: nothing of the old directory is left beside the new checkpoint, no staging dir remains.
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                      "tokenizer.json", "tokenizer_config.json"]
    assert Config.from_checkpoint(out).n_layer == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "tiny.gguf"]


def test_convert_into_an_empty_or_new_directory_needs_no_flag(tmp_path: Path) -> None:
    from lit_qlora.export.gguf_import import convert_gguf_command

    write_tiny_gguf(tmp_path / "tiny.gguf", tied=True)
    (tmp_path / "empty").mkdir()
    for name in ("empty", "new"):
        assert Config.from_checkpoint(convert_gguf_command(str(tmp_path / "tiny.gguf"), tmp_path / name)).tie_embeddings
