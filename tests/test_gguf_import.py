"""GGUF import: synthetic files (every supported quant type, the q/k permutation, bad files, byte-level and
SentencePiece vocabularies) and the real SmolLM2."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

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

T = gguf.GGMLQuantizationType
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (printable latin-1 maps to itself, the rest to 256+)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows (rotate-half pairs -> adjacent pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def k_quant_bytes(rng: np.random.Generator, rows: int, cols: int, qtype: T) -> np.ndarray:
    """Random but valid Q4_K / Q6_K blocks (gguf cannot quantize to them): random bits, finite fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, size=(data.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == T.Q4_K:
        data[:, :4] = scales  # d, dmin
    else:
        data[:, -2:] = scales[:, :2]  # d is the last field of a Q6_K block
    return data.reshape(rows, -1)


# Quant type per tensor kind: all types the converter must read. K-quants need rows of 256.
QTYPES = {"token_embd": T.F16, "attn_q": T.Q8_0, "attn_k": T.Q4_0, "attn_v": T.Q4_1, "attn_output": T.BF16,
          "ffn_gate": T.Q5_0, "ffn_up": T.Q6_K, "ffn_down": T.Q4_K, "output": T.Q8_0}


def write_gpt2_tokenizer(w: gguf.GGUFWriter, add_bos: bool = False) -> int:
    """A byte-level BPE vocabulary (SmolLM2's kind) with a chat template; returns the vocabulary size."""
    tokens = SPECIAL + byte_alphabet() + ["Ġt", "he", "Ġthe"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}")
    return len(tokens)


def write_tiny_llama(path: Path, tied: bool = False, add_bos: bool = False, arch: str = "llama",
                     raw: dict[str, tuple[np.ndarray, T]] | None = None,
                     tokenizer: Callable[[gguf.GGUFWriter], int] | None = None,
                     ) -> tuple[Config, dict[str, np.ndarray]]:
    """A 2-layer llama GGUF with random weights; returns its Config and the HF-layout weights we expect back.
    `raw` writes the given (data, type) under a name instead of the generated tensor (or in addition to them).
    arch="qwen3" adds per-head q/k norms and heads narrower than hidden / heads, as Qwen3-0.6B has.
    `tokenizer` writes the vocabulary metadata and returns its size (default: `write_gpt2_tokenizer`)."""
    raw = dict(raw or {})
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, arch)
    n_vocab = tokenizer(w) if tokenizer else write_gpt2_tokenizer(w, add_bos)
    qwen3 = arch == "qwen3"
    config = Config(vocab_size=n_vocab, n_layer=2, n_embd=256, n_head=4, n_query_groups=2,
                    head_dim=32 if qwen3 else None, intermediate_size=256, norm_eps=1e-5, rope_base=500000.0,
                    max_seq_length=512, tie_embeddings=tied, qk_norm=qwen3, bos_token_id=1, eos_token_id=2)
    hd = config.head_dim
    shapes = {"token_embd": (config.vocab_size, 256), "attn_q": (4 * hd, 256), "attn_k": (2 * hd, 256),
              "attn_v": (2 * hd, 256), "attn_output": (256, 4 * hd), "ffn_gate": (256, 256), "ffn_up": (256, 256),
              "ffn_down": (256, 256), "output": (config.vocab_size, 256)}
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(hd)
    if qwen3:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf: str, value: np.ndarray, qtype: T, n_heads: int | None = None) -> None:
        if qtype in (T.Q4_K, T.Q6_K):
            data = k_quant_bytes(rng, *value.shape, qtype)
            value = gguf.quants.dequantize(data, qtype)
        else:
            data = gguf.quants.quantize(value, qtype)
            value = gguf.quants.dequantize(data, qtype)  # what the file really holds
        expected[hf] = value
        if n_heads is not None:  # store rows permuted as llama.cpp does (quant blocks never span rows)
            data = llama_cpp_permute(data, n_heads)
        if gguf_name in raw:
            data, qtype = raw.pop(gguf_name)
        w.add_tensor(gguf_name, data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)

    def rand(kind: str) -> np.ndarray:
        return rng.standard_normal(shapes[kind]).astype(np.float32) * 0.05

    hf_names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
    add("token_embd.weight", "model.embed_tokens.weight", rand("token_embd"), QTYPES["token_embd"])
    for i in range(2):
        for kind, hf in hf_names.items():
            heads = {"attn_q": 4, "attn_k": 2}.get(kind) if arch == "llama" else None
            add(f"blk.{i}.{kind}.weight", f"model.layers.{i}.{hf}.weight", rand(kind), QTYPES[kind], heads)
        for kind, hf in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            add(f"blk.{i}.{kind}.weight", f"model.layers.{i}.{hf}.weight", 1 + rand("ffn_up")[0], T.F32)
        if qwen3:
            for kind, hf in (("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")):
                add(f"blk.{i}.{kind}.weight", f"model.layers.{i}.{hf}.weight", 1 + rand("ffn_up")[0, :hd], T.F32)
    add("output_norm.weight", "model.norm.weight", 1 + rand("ffn_up")[0], T.F32)
    if not tied:
        add("output.weight", "lm_head.weight", rand("output"), QTYPES["output"])
    for name, (data, qtype) in raw.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return config, expected


@pytest.mark.parametrize("tied", [False, True])
def test_synthetic_llama_weights_are_exact(tmp_path: Path, tied: bool) -> None:
    config, expected = write_tiny_llama(tmp_path / "tiny.gguf", tied=tied)
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
    _, expected = write_tiny_llama(tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", dtype="bfloat16")
    got = load_file(out / "model.safetensors")["model.layers.1.self_attn.k_proj.weight"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.from_numpy(expected["model.layers.1.self_attn.k_proj.weight"]).bfloat16())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", dtype="int8")


def test_qwen2_is_not_permuted(tmp_path: Path) -> None:
    # llama.cpp only permutes q/k for its llama architecture; qwen2 keeps HF's layout.
    _, expected = write_tiny_llama(tmp_path / "qwen.gguf", arch="qwen2")
    out = convert_gguf(tmp_path / "qwen.gguf", tmp_path / "out")
    assert Config.from_checkpoint(out).model_type == "qwen2"
    got = load_file(out / "model.safetensors")
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                       torch.from_numpy(expected["model.layers.0.self_attn.q_proj.weight"]))


def test_qwen3_converts_with_its_head_dim_and_qk_norms_and_transformers_agrees(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config, expected = write_tiny_llama(tmp_path / "qwen3.gguf", arch="qwen3")
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
    write_tiny_llama(tmp_path / "l3.gguf", raw={"rope_freqs.weight": (np.array(divisors, np.float32), T.F32)})
    config = Config.from_checkpoint(convert_gguf(tmp_path / "l3.gguf", tmp_path / "out"))
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    divisors[5] *= 1.5  # not a llama3 schedule: refuse rather than guess
    write_tiny_llama(tmp_path / "odd.gguf", raw={"rope_freqs.weight": (np.array(divisors, np.float32), T.F32)})
    with pytest.raises(ValueError, match="rope_freqs.weight does not match Llama 3 rope scaling"):
        convert_gguf(tmp_path / "odd.gguf", tmp_path / "out2")


def test_synthetic_tokenizer(tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "tiny.gguf", add_bos=True)
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


# -- SentencePiece vocabularies (tokenizer.ggml.model "llama": Llama 2, TinyLlama, Mistral, Gemma) ------------------
SPM_USER_DEFINED, SPM_CONTROL = ["<|user|>", "<sep>"], ["<|ctrl|>"]
SPM_WORDS = ("the quick brown fox jumps over lazy dog tokenizer model vocabulary merge byte fallback llama mistral "
             "gemma sentence piece hello world python code function return value numbers data science learning "
             "deep neural network attention naïve café résumé über straße Paris France capital").split()
# Spaces (leading, trailing, runs), newlines and tabs (absent from the training text: bytes), digits, punctuation,
# unicode and emoji (bytes), words never seen, the control and user-defined symbols (and text glued to them).
SPM_TEXTS = [
    "Hello world", "the quick brown fox jumps over the lazy dog.", " leading space", "  two leading", "trailing ",
    "multiple   spaces    inside", " ", "   ", "", "line one\nline two\n\n", "tabs\tand\r\nwindows",
    "digits 0123456789 and 3.14159, 2024-01-31", "punctuation: (a), [b]; {c}! ?¿ — “quotes” 'single' \"double\"",
    "naïve café résumé über straße", "日本語のテキスト", "emoji 😀🚀 mixed🤖text", "unseenwordzzz qwertyuiop xylophone",
    "UPPER CASE THE QUICK", "e\u0301 vs é, non\u00a0breaking", "<|user|>hello<sep> world<|ctrl|>bye", "a<sep>b",
    "<sep>", "x <|user|> y", "Paris</s> <s><unk> x", "<|ctrl|>\n<|user|>  spaced",
]


def train_sentencepiece(tmp_path: Path, add_dummy_prefix: bool) -> Path:
    """A tiny SentencePiece BPE model trained as Llama's was: byte fallback, digits split, whitespace kept as is."""
    spm = pytest.importorskip("sentencepiece")
    rng = np.random.default_rng(0)
    lines = []
    for i in range(300):
        words = list(rng.choice(SPM_WORDS, size=rng.integers(3, 14)))
        if i % 7 == 0:
            words.append(str(rng.integers(0, 99999)))
        lines.append(str(rng.choice([" ", " ", "  ", "    ", ", "])).join(words) + str(rng.choice([".", "!", "?", ""])))
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "spm"), model_type="bpe", vocab_size=500,
        byte_fallback=True, split_digits=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, add_dummy_prefix=add_dummy_prefix,
        user_defined_symbols=SPM_USER_DEFINED, control_symbols=SPM_CONTROL, num_threads=1, minloglevel=2)
    return tmp_path / "spm.model"


def sentencepiece_gguf_vocab(model_file: Path, add_dummy_prefix: bool) -> Callable[[gguf.GGUFWriter], int]:
    """Writes the vocabulary as llama.cpp's converter does: pieces, scores, types from the piece kinds."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if sp.id_to_piece(i) in SPM_USER_DEFINED else 1

    def write(w: gguf.GGUFWriter) -> int:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list([sp.id_to_piece(i) for i in range(sp.vocab_size())])
        w.add_token_scores([sp.get_score(i) for i in range(sp.vocab_size())])
        w.add_token_types([kind(i) for i in range(sp.vocab_size())])
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_unk_token_id(sp.unk_id())
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(add_dummy_prefix)
        w.add_chat_template("{% for m in messages %}<|user|>{{ m['content'] }}</s>{% endfor %}")
        return sp.vocab_size()

    return write


@pytest.mark.parametrize("add_dummy_prefix", [True, False], ids=["llama", "no-space-prefix"])
def test_sentencepiece_tokenizer_encodes_like_the_source(tmp_path: Path, add_dummy_prefix: bool) -> None:
    import sentencepiece
    from tokenizers import Tokenizer as Backend

    transformers = pytest.importorskip("transformers")
    model_file = train_sentencepiece(tmp_path, add_dummy_prefix)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    write_tiny_llama(tmp_path / "spm.gguf", tokenizer=sentencepiece_gguf_vocab(model_file, add_dummy_prefix))
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
    write_tiny_llama(tmp_path / "tiny.gguf")
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

    write_tiny_llama(tmp_path / "odd.gguf", raw={"blk.0.ffn_norm.bias": (np.zeros(256, np.float32), T.F32)})
    with pytest.raises(ValueError, match="unexpected tensors .*blk.0.ffn_norm.bias"):
        convert_gguf(tmp_path / "odd.gguf", tmp_path / "out")
    block, size = gguf.GGML_QUANT_SIZES[T.Q8_1]  # gguf has no dequantizer for Q8_1
    q8_1 = np.zeros(256 // block * size, dtype=np.uint8)
    write_tiny_llama(tmp_path / "q81.gguf", raw={"output_norm.weight": (q8_1, T.Q8_1)})
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

    write_tiny_llama(tmp_path / "tiny.gguf", tied=False)
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

    write_tiny_llama(tmp_path / "tiny.gguf", tied=True)
    (tmp_path / "empty").mkdir()
    for name in ("empty", "new"):
        assert Config.from_checkpoint(convert_gguf_command(str(tmp_path / "tiny.gguf"), tmp_path / name)).tie_embeddings
