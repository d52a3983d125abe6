"""Tokenizer: the real SmolLM2 tokenizer against transformers, BOS/EOS rules and chat templates on small fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers, processors

from lit_qlora.export.gguf_import import bundled_smollm2_path
from lit_qlora.checkpoint.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces, internal    runs and trailing  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "Café naïve résumé — 你好，世界！ 😀👍🏽 Россия",
    "def f(x):\n    return x ** 2  # square\n",
    "I'm sure they'll say it's fine, don't you?",
    "Numbers 12345, 3.14159 and 1,000,000",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2 + 2 = ?"}],
]


@pytest.fixture(scope="module")
def hf_tokenizers(smollm2_dir: Path):
    """transformers' tokenizer of our converted directory, and transformers' own tokenizer of the GGUF file."""
    transformers = pytest.importorskip("transformers")
    gguf_path = bundled_smollm2_path()
    return (transformers.AutoTokenizer.from_pretrained(smollm2_dir),
            transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name))


def test_smollm2_encode_matches_transformers(smollm2_dir: Path, hf_tokenizers) -> None:
    tok, (converted, from_gguf) = Tokenizer(smollm2_dir), hf_tokenizers
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == converted.encode(text), text
        assert tok.decode(ids) == text
        # transformers' GGUF reader does not know llama.cpp's 'smollm' pre-tokenizer (digits split one by one
        # *before* GPT-2's regex), so it differs where a digit follows whitespace; elsewhere it must agree.
        if not any(c.isdigit() for c in text):
            assert ids == from_gguf.encode(text), text


def test_smollm2_digits_are_split_before_the_gpt2_regex(smollm2_dir: Path) -> None:
    # SmolLM2's tokenizer.json: Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]. Digits cut
    # "a  3" into "a  " + "3", so the two spaces stay one "ĠĠ" token instead of "Ġ" + "Ġ3"-less "Ġ", "3".
    tok = Tokenizer(smollm2_dir)
    assert [tok.backend.id_to_token(i) for i in tok.encode("a  3 45")] == ["a", "ĠĠ", "3", "Ġ", "4", "5"]


def test_smollm2_special_tokens(smollm2_dir: Path) -> None:
    tok = Tokenizer(smollm2_dir)
    assert (tok.bos_id, tok.eos_id, tok.bos_token, tok.eos_token) == (1, 2, "<|im_start|>", "<|im_end|>")
    assert tok.eos_ids == [2] and tok.vocab_size == 49152 and tok.has_chat_template
    hi = tok.token_to_id("Hi")
    assert tok.encode("Hi") == [hi]  # SmolLM2 adds no BOS by default
    assert tok.encode("Hi", bos=True, eos=True) == [1, hi, 2]
    assert tok.encode("<|im_start|>Hi", bos=True) == [1, hi]  # an explicit BOS is not doubled
    ids = tok.encode(TEXTS[-1])
    assert ids.count(1) == 2 and ids.count(2) == 1  # control tokens stay whole
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi there\nassistant\n"


def test_smollm2_chat_template_matches_transformers(smollm2_dir: Path, hf_tokenizers) -> None:
    tok = Tokenizer(smollm2_dir)
    for messages in MESSAGES:
        text = tok.apply_chat_template(messages)
        for hf in hf_tokenizers:
            assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.encode(text) == hf_tokenizers[0].encode(text)
    assert tok.apply_chat_template(MESSAGES[0], add_generation_prompt=False).endswith("<|im_end|>\n")


# -- small hand-built tokenizers -------------------------------------------------------------------------------
def write_tokenizer(path: Path, tokenizer_config: dict, post_bos: bool, **extra_files: dict) -> Path:
    """A byte-level BPE over "abc" with <s>/</s>/<|eot_id|> specials; optionally a Llama-3-style BOS post-processor."""
    vocab = {"<s>": 0, "</s>": 1, "<|eot_id|>": 2, "a": 3, "b": 4, "c": 5, "Ġ": 6, "ab": 7}
    backend = Backend(models.BPE(vocab=vocab, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>", "<|eot_id|>")])
    if post_bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, content in extra_files.items():
        (path / f"{name}.json").write_text(json.dumps(content))
    return path


@pytest.mark.parametrize("config", [{}, {"add_bos_token": True, "bos_token": "<s>"}])
def test_bos_from_the_post_processor_is_never_doubled(tmp_path: Path, config: dict) -> None:
    tok = Tokenizer(write_tokenizer(tmp_path, config, post_bos=True, generation_config={"bos_token_id": 0}))
    assert tok.add_bos and tok.bos_id == 0
    assert tok.encode("ab c") == [0, 7, 6, 5]
    assert tok.encode("<s>ab") == [0, 7]
    assert tok.encode("ab", bos=False) == [7]


def test_ids_fall_back_to_generation_config_and_eos_ids_include_end_of_turn(tmp_path: Path) -> None:
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}"
    path = write_tokenizer(tmp_path, {"chat_template": template}, post_bos=False,
                           generation_config={"bos_token_id": 0, "eos_token_id": [1]}, config={"eos_token_id": 1})
    tok = Tokenizer(path)
    assert (tok.bos_token, tok.bos_id, tok.eos_id, tok.add_bos) == ("<s>", 0, 1, False)
    assert tok.eos_ids == [1, 2]
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}]) == "<s>ab<|eot_id|>"


def test_chat_template_helpers(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}\n"
        "  {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}\n"
        "[{{ m['role'] }}] {{ m['content'] | tojson }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tok = Tokenizer(write_tokenizer(tmp_path, {"chat_template": template, "bos_token": "<s>"}, post_bos=False))
    # trim_blocks/lstrip_blocks: block tags take their own line and indentation with them, as in transformers.
    assert tok.apply_chat_template([{"role": "user", "content": "é <b>"}]) == '[user] "é <b>"\n[assistant]'
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(write_tokenizer(tmp_path / "plain", {}, post_bos=False)).apply_chat_template([])


def test_chat_template_sandbox(tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__ }}"
    tok = Tokenizer(write_tokenizer(tmp_path, {"chat_template": template}, post_bos=False))
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        tok.apply_chat_template([])


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} has no tokenizer.json"):
        Tokenizer(tmp_path)
