"""The tokenizer in a GGUF file, both ways: the fields llama.cpp reads (`tokenizer.ggml.*`), taken from a checkpoint's
tokenizer.json when exporting (`tokenizer_metadata`), and a tokenizer.json + tokenizer_config.json rebuilt from them
when importing (`tokenizer_from_gguf`). Byte-level BPE (Llama 3, Qwen, SmolLM2) travels as `gpt2` with its merges and
the name of its split regex; SentencePiece BPE (Llama 2, TinyLlama) as `llama` with its pieces' scores."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Optional

from lit_qlora.export.gguf_families import GGUFExportError
from lit_qlora.base.errors import InvalidInput

# -- from GGUF metadata (import) --------------------------------------------------------------------------------
# Split regexes of the published tokenizer.json files, keyed by llama.cpp's `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# StarCoder-style vocabularies (SmolLM2 included) isolate every digit, then apply GPT-2's regex.
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell")
_GPT2_PRE = ("default", "gpt-2", "gpt2")
# Llama 3's tokenizer.json sets ignore_merges (llama.cpp too): a pre-token found whole in the vocab skips BPE.
_IGNORE_MERGES_PRE = ("llama-bpe", "llama3", "llama-v3")
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4  # llama.cpp token types (5 unused, 6 byte: <0x0A>)


def tokenizer_from_gguf(meta: dict[str, Any], path: Path | str = "<gguf>"):
    """Build a `tokenizers.Tokenizer` and the matching tokenizer_config.json dict from GGUF metadata."""
    from tokenizers import AddedToken, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise InvalidInput(
            f"{path}: GGUF tokenizer model {kind!r} is not supported (byte-level BPE, 'gpt2', and SentencePiece BPE, "
            "'llama', are); convert the tokenizer from the original Hugging Face repository instead."
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    ids = {key: int(meta[f"tokenizer.ggml.{key}_token_id"]) for key in ("bos", "eos", "unknown", "padding")
           if 0 <= int(meta.get(f"tokenizer.ggml.{key}_token_id", -1)) < len(tokens)}
    names = {key: tokens[index] for key, index in ids.items()}
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta, tokens, path)
    else:
        tokenizer = _sentencepiece_bpe(meta, tokens, types, unk=names.get("unknown"))
    # Control tokens (<|im_start|>, <s>) must match whole and count as special; user-defined ones match whole.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, k in zip(tokens, types) if k in (_UNKNOWN, _CONTROL)])
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])

    bos, eos = names.get("bos"), names.get("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    steps = [processors.ByteLevel(trim_offsets=False)] if kind == "gpt2" else []
    if add_bos or add_eos:
        # BOS/EOS in the post-processor too, so HF's tokenizer adds them; lit-qlora's Tokenizer never doubles BOS.
        def sequence(name: str, type_id: int) -> str:
            return " ".join([f"{bos}:{type_id}"] * add_bos + [f"${name}:{type_id}"] + [f"{eos}:{type_id}"] * add_eos)

        specials = list(dict.fromkeys([(bos, ids["bos"])] * add_bos + [(eos, ids["eos"])] * add_eos))
        steps.append(processors.TemplateProcessing(
            single=sequence("A", 0), pair=f"{sequence('A', 0)} {sequence('B', 1)}", special_tokens=specials))
    if steps:
        tokenizer.post_processor = steps[0] if len(steps) == 1 else processors.Sequence(steps)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": names.get("unknown"),
        "pad_token": names.get("padding"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 2048)),
    }
    if kind == "llama":
        # Text after a special token gets its own "▁" prefix, as in llama.cpp and Llama 2's tokenizer.json. Not
        # "LlamaTokenizer": transformers 5 rebuilds that one's pipeline (non-legacy) instead of using tokenizer.json.
        config["legacy"] = True
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer, {k: v for k, v in config.items() if v is not None}


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str], path: Path | str):
    """GPT-2 style BPE over bytes (Llama 3, Qwen, SmolLM): the merges are in the file, the split regex is named."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRE))
    if pre in _SPLITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _DIGIT_SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        if pre not in _GPT2_PRE:
            warnings.warn(f"{path}: unknown GGUF pre-tokenizer {pre!r}; using GPT-2's split, tokens may differ.",
                          stacklevel=2)
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], types: list[int], unk: str | None):
    """SentencePiece BPE (Llama 2, TinyLlama, Mistral, Gemma) in the form of Llama 2's published tokenizer.json:
    spaces become "▁" and the text gets a leading "▁" (unless the GGUF says add_space_prefix false, as Gemma's
    does); characters missing from the vocabulary fall back to byte tokens (<0xE2>)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = sentencepiece_merges(tokens, scores, types)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    replace_spaces = normalizers.Replace(" ", "▁")
    tokenizer.normalizer = (normalizers.Sequence([normalizers.Prepend("▁"), replace_spaces]) if space_prefix
                            else replace_spaces)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if space_prefix else steps)
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The BPE merge list a SentencePiece vocabulary implies (GGUF stores none).

    SentencePiece BPE repeatedly joins the adjacent pair whose concatenation is the best-scored normal piece. So
    every split of a normal piece into two normal pieces is a merge, ranked by the joined piece's score (higher
    first; equal scores by vocabulary order, then by where the piece is cut)."""
    normal = {piece: i for i, (piece, kind) in enumerate(zip(tokens, types)) if kind == _NORMAL}
    ranked = sorted(
        (-scores[i], i, cut)
        for piece, i in normal.items() for cut in range(1, len(piece))
        if piece[:cut] in normal and piece[cut:] in normal
    )
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]


# -- from a checkpoint's tokenizer.json (export) ----------------------------------------------------------------
def tokenizer_metadata(checkpoint_dir: Path) -> dict[str, Any]:
    """The GGUF tokenizer fields of the checkpoint's tokenizer.json (byte-level or SentencePiece BPE), checked before
    writing."""
    from lit_qlora.checkpoint.tokenizer import Tokenizer

    tok = Tokenizer(checkpoint_dir)
    data = json.loads((Path(checkpoint_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    model = data.get("model", {})
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return _sentencepiece_fields(data, tok, checkpoint_dir)
    if model.get("type") != "BPE":
        raise GGUFExportError(
            f"{checkpoint_dir}/tokenizer.json is a {model.get('type')} tokenizer; export_gguf writes byte-level BPE "
            "(Llama 3, Qwen, SmolLM2) and SentencePiece BPE (Llama 2, TinyLlama, Mistral) tokenizers. Use llama.cpp's "
            "convert_hf_to_gguf.py on out_dir/final/merged for this model.")
    pre = _pre_tokenizer_name(data.get("pre_tokenizer") or {}, _SPLITS, _DIGIT_SPLIT_PRE)
    vocab, added, tokens, types = _vocabulary(data)
    for text, index in vocab.items():
        if text not in added:
            types[index] = _NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    fields = {"model": "gpt2", "pre": pre, "tokens": tokens, "types": types, "merges": merges,
              "bos": tok.bos_id, "eos": tok.eos_id, "add_bos": tok.add_bos, "chat_template": tok.chat_template,
              "eos_ids": tok.eos_ids, "pad": _pad_id(checkpoint_dir, tok)}
    return fields


def _vocabulary(data: dict[str, Any]) -> tuple[dict[str, int], dict[str, Any], list[str], list[int]]:
    """tokenizer.json's vocabulary with its added tokens: (piece -> id, added tokens by content, the pieces by id, their
    types so far). Added tokens are typed control (special) or user-defined; ids no entry names (padding rows) get
    an inert user-defined placeholder; the callers type the model's own pieces."""
    vocab = dict(data["model"]["vocab"])
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    for text, entry in added.items():
        vocab[text] = entry["id"]
    size = max(vocab.values()) + 1
    tokens, types = [f"[PAD{i}]" for i in range(size)], [_USER_DEFINED] * size
    for text, index in vocab.items():
        tokens[index] = text
        if text in added:
            types[index] = _CONTROL if added[text].get("special") else _USER_DEFINED
    return vocab, added, tokens, types


def _sentencepiece_fields(data: dict[str, Any], tok, checkpoint_dir: Path) -> dict[str, Any]:
    """A SentencePiece BPE vocabulary (byte fallback, "▁" for spaces) as llama.cpp's `llama` tokenizer: pieces,
    scores and types. GGUF keeps no merges here: llama.cpp merges the adjacent pair whose joined piece scores
    highest, so each piece's score is minus the rank of the first merge that makes it (sentencepiece_merges derives
    the same merges back); byte pieces (<0x0A>) are type 6, the unknown piece 2, special added tokens control (3)."""
    import re

    model = data["model"]
    vocab, added, tokens, types = _vocabulary(data)
    scores = [0.0] * len(tokens)
    rank: dict[str, int] = {}
    for i, merge in enumerate(model.get("merges", [])):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(left + right, i)
    unk = model.get("unk_token")
    for text, index in vocab.items():
        if text in added:
            continue
        if text == unk:
            types[index] = 2
        elif re.fullmatch(r"<0x[0-9A-F]{2}>", text):
            types[index] = 6
        else:
            types[index] = _NORMAL
            scores[index] = -float(rank.get(text, len(rank) + index))
    return {"model": "llama", "pre": "default", "tokens": tokens, "types": types, "scores": scores, "merges": [],
            "bos": tok.bos_id, "eos": tok.eos_id, "unk": vocab.get(unk) if unk else None, "add_bos": tok.add_bos,
            "chat_template": tok.chat_template, "eos_ids": tok.eos_ids, "pad": _pad_id(checkpoint_dir, tok),
            "add_space_prefix": _space_prefix(data)}


def _space_prefix(data: dict[str, Any]) -> bool:
    """Whether the text gets a leading "▁" (SentencePiece's add_dummy_prefix): a Prepend normalizer (Llama 2's
    tokenizer.json, tokenizer_from_gguf's) or a Metaspace pre-tokenizer that prepends."""
    def steps(part: Any) -> list[dict[str, Any]]:
        if not part:
            return []
        return [s for p in part.get("normalizers", part.get("pretokenizers", [part])) for s in steps(p)] \
            if part.get("type") == "Sequence" else [part]

    for step in steps(data.get("normalizer")) + steps(data.get("pre_tokenizer")):
        if step.get("type") == "Prepend":
            return True
        if step.get("type") == "Metaspace":
            return step.get("prepend_scheme", "always") != "never"
    return False


def _pre_tokenizer_name(pre: dict[str, Any], splits: dict[str, str], digit_split: tuple[str, ...]) -> str:
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return digit_split[0]  # "smollm": digits one by one, then GPT-2's regex
    if kinds[:1] == ["Split"]:
        regex = (steps[0].get("pattern") or {}).get("Regex")
        for name in ("llama-bpe", "qwen2"):
            if regex == splits[name]:
                return name
    raise GGUFExportError(
        f"the tokenizer's pre-tokenizer ({', '.join(map(str, kinds))}) is not one export_gguf can name for llama.cpp "
        "(GPT-2, SmolLM2/StarCoder digits, Llama 3 and Qwen2 splits are). Use llama.cpp's convert_hf_to_gguf.py.")


def _pad_id(checkpoint_dir: Path, tok) -> Optional[int]:
    config = json.loads((Path(checkpoint_dir) / "tokenizer_config.json").read_text()) \
        if (Path(checkpoint_dir) / "tokenizer_config.json").is_file() else {}
    pad = config.get("pad_token")
    pad = pad.get("content") if isinstance(pad, dict) else pad
    return tok.token_to_id(pad) if pad else None
