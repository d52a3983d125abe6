"""The prompt styles' registry: each style's name and, where it has one, the chat template (Jinja, as transformers
and llama.cpp read them) that a merged or GGUF export of a fine-tune trained in it carries, so other runtimes format
prompts as training did. `--data.prompt_style`'s choices and help, the exports and the estimate read it; each style's
rows are rendered by its class in lit_qlora.data.prompts (PROMPT_STYLES: a test keeps the two in step, and that each
template renders what its class renders). Adding a style: an entry here and its class there.

Light at import (no torch): the CLI reads `PromptStyleName` for `--help`.
"""

from __future__ import annotations

from typing import Literal, Optional

ALPACA_HEADER = ("Below is an instruction that describes a task. "
                 "Write a response that appropriately completes the request.\n\n")
ALPACA_HEADER_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                            "context. Write a response that appropriately completes the request.\n\n")

STYLES: dict[str, Optional[str]] = {
    "alpaca": (
        "{%- set system = messages | selectattr('role', 'equalto', 'system') | map(attribute='content') | list -%}"
        "{{- system | join('\n\n') + '\n\n' if system else '" + ALPACA_HEADER.replace("\n", "\\n") + "' -}}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'user' -%}{{- '### Instruction:\n' + m['content'] + '\n\n' -}}"
        "{%- elif m['role'] == 'assistant' -%}{{- '### Response:\n' + m['content'] + eos_token + '\n\n' -}}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '### Response:\n' -}}{%- endif -%}"),
    "chatml": (
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"),
    "llama3": (
        "{{- bos_token -}}{%- for m in messages -%}"
        "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"),
    "chat_template": None,  # the checkpoint's own template is exported
}
"""Every prompt style by name -> its chat template for the exports."""

STYLE_TEMPLATES = {name: template for name, template in STYLES.items() if template is not None}

PromptStyleName = Literal[("auto", *STYLES)]  # type: ignore[valid-type]
"""What --data.prompt_style accepts: auto, or a style of STYLES."""
