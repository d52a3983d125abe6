"""What inference feeds a fine-tuned model: its conversation in the prompt format its adapter trained with, token for
token as training tokenized it.

A fine-tune records its prompt style in adapter_config.json (`prompt_style`). `generate`, `chat`, `serve` and the
validation sample format prompts through `trained_tokenizer`, whose `encode_chat` / `encode_prompt` then give the
ids a training sample of the same conversation holds before its reply (`prompt_ids`: the same segments, tokenized
one by one as `lit_qlora.data.sft.tokenize_segments` does). The merged and GGUF exports carry the style as a chat
template (`exported_chat_template`) for runtimes that format prompts themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from lit_qlora.data.prompts import PromptStyle, get_prompt_style
from lit_qlora.data.templates import STYLE_TEMPLATES
from lit_qlora.data.sft import tokenize_segments
from lit_qlora.checkpoint.tokenizer import Tokenizer


def prompt_ids(style: PromptStyle, messages: list[dict[str, str]]) -> list[int]:
    """The ids fed to the model for `messages` (ending with a user turn): what a training sample of `messages` and
    a reply holds before that reply."""
    segments = style.render({"messages": [*messages, {"role": "assistant", "content": ""}]})
    last = max(i for i, segment in enumerate(segments) if segment.train)
    return tokenize_segments(segments[:last], style.tokenizer).input_ids.tolist()


def use_prompt_style(tokenizer: Tokenizer, style: str) -> Tokenizer:
    """`tokenizer`, whose encode_chat / encode_prompt now format conversations in `style` (a name, or auto)."""
    prompt_style = get_prompt_style(style, tokenizer)
    tokenizer.prompt_format = lambda messages: prompt_ids(prompt_style, messages)
    return tokenizer


def trained_style(adapter_dir: Optional[Path]) -> Optional[str]:
    """The prompt style an adapter trained with (adapter_config.json's `prompt_style`), None where it says none (no
    adapter, or one written before styles were recorded: the checkpoint's chat template then, as before)."""
    from lit_qlora.checkpoint.adapter import read_adapter_config

    return None if adapter_dir is None else read_adapter_config(Path(adapter_dir)).get("prompt_style")


def trained_tokenizer(checkpoint_dir: Path, adapter_dir: Optional[Path] = None) -> Tokenizer:
    """The checkpoint's tokenizer, formatting prompts as `adapter_dir`'s fine-tune trained (where it records it)."""
    tokenizer = Tokenizer(checkpoint_dir)
    style = trained_style(adapter_dir)
    return use_prompt_style(tokenizer, style) if style else tokenizer


def exported_chat_template(style: Optional[str]) -> Optional[str]:
    """The chat template an export of a fine-tune trained in `style` carries instead of the checkpoint's: the
    style's own (STYLE_TEMPLATES), or None: the checkpoint's (the chat_template style, or no style recorded)."""
    return STYLE_TEMPLATES.get(style or "")


def trained_chat_template(adapter_dir: Optional[Path]) -> Optional[str]:
    """exported_chat_template of the style `adapter_dir`'s fine-tune trained with."""
    return exported_chat_template(trained_style(adapter_dir))
