"""A checkpoint's tokenizer: `tokenizer.json` (Hugging Face `tokenizers`) plus the chat template of
`tokenizer_config.json`, rendered with jinja2 the way transformers renders it."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from lit_qlora.base.errors import InvalidInput, MissingFile
from lit_qlora.model.config import require_checkpoint_dir

# Chat templates end a turn with one of these; generation should stop there even when the checkpoint's
# `eos_token` is another token (Llama 3 Instruct: eos <|end_of_text|>, turns end with <|eot_id|>).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: Any) -> Optional[str]:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts ({"content": ...})."""
    return value.get("content") if isinstance(value, dict) else value


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def require_tokenizer(checkpoint_dir: Path) -> Path:
    """The checkpoint's tokenizer.json, or a MissingFile error saying where a usable one comes from."""
    require_checkpoint_dir(checkpoint_dir)
    path = Path(checkpoint_dir) / "tokenizer.json"
    if not path.is_file():
        raise MissingFile(
            f"{checkpoint_dir} has no tokenizer.json; lit-qlora reads tokenizers in the Hugging Face tokenizers format "
            "(download the checkpoint's tokenizer files, or convert a GGUF with `litqlora convert_gguf`)."
        )
    return path


class Tokenizer:
    def __init__(self, checkpoint_dir: str | Path) -> None:
        from tokenizers import Tokenizer as Backend

        self.checkpoint_dir = Path(checkpoint_dir)
        path = require_tokenizer(self.checkpoint_dir)
        self.backend = Backend.from_file(str(path))
        config = _read_json(self.checkpoint_dir / "tokenizer_config.json")
        generation = _read_json(self.checkpoint_dir / "generation_config.json")
        model = _read_json(self.checkpoint_dir / "config.json")

        def special(name: str) -> tuple[Optional[str], Optional[int]]:
            text = _token_text(config.get(f"{name}_token"))
            index = self.backend.token_to_id(text) if text else None
            if index is None:  # fall back to the ids the model files give
                ids = _ids(generation.get(f"{name}_token_id")) or _ids(model.get(f"{name}_token_id"))
                index = ids[0] if ids else None
                text = self.backend.id_to_token(index) if index is not None else None
            return text, index

        self.bos_token, self.bos_id = special("bos")
        self.eos_token, self.eos_id = special("eos")
        # Does tokenizer.json's post-processor already add BOS (Llama 3)? Then encode() must not add it again.
        probe = self.backend.encode("", add_special_tokens=True).ids
        processor_adds_bos = self.bos_id is not None and probe[:1] == [self.bos_id]
        add_bos = config.get("add_bos_token")
        self.add_bos = processor_adds_bos if add_bos is None else bool(add_bos)

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        jinja_file = self.checkpoint_dir / "chat_template.jinja"  # where recent transformers versions save it
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        self.chat_template: Optional[str] = template

        eos_ids = [self.eos_id] if self.eos_id is not None else []
        eos_ids += _ids(generation.get("eos_token_id")) + _ids(model.get("eos_token_id"))
        for text in END_OF_TURN_TOKENS:
            index = self.backend.token_to_id(text)
            if index is not None and template and text in template:
                eos_ids.append(index)
        self.eos_ids: list[int] = list(dict.fromkeys(eos_ids))
        self.prompt_format: Optional[Callable[[list[dict[str, Any]]], list[int]]] = None
        """Set to a fine-tune's prompt format (lit_qlora.data.inference): encode_chat and encode_prompt use it."""

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.backend.token_to_id(token)

    def encode(self, text: str, bos: Optional[bool] = None, eos: bool = False) -> list[int]:
        """Token ids of `text`. `bos=None` follows the checkpoint (`add_bos_token`); a BOS already at the start
        (e.g. written by a chat template) is never doubled."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if bos is None else bos) and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        if eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of `messages` through the chat template, ending where the assistant's reply starts (the
        template writes any BOS itself), or through a fine-tune's prompt format where one is set."""
        if self.prompt_format is not None:
            return self.prompt_format(messages)
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=True), bos=False)

    def encode_prompt(self, prompt: str) -> list[int]:
        """A user's prompt as a model should answer it: one user turn through the chat template when the checkpoint
        has one (or a fine-tune's prompt format, where one is set), else the text itself."""
        if self.has_chat_template or self.prompt_format is not None:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self.encode(prompt)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        if hasattr(ids, "tolist"):  # a tensor or numpy array
            ids = ids.tolist()
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` ([{"role": "user", "content": ...}, ...]) as transformers'
        `apply_chat_template(..., tokenize=False)` does."""
        if not self.chat_template:
            raise InvalidInput(f"The tokenizer in {self.checkpoint_dir} has no chat template.")
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        return _compile(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes (<, >, &) and sorts keys; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(template: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # The settings transformers uses, so templates written for it render identically: sandboxed (templates come
    # from downloaded files), block tags strip their own line, `{% break %}`/`{% continue %}` allowed.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
