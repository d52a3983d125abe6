"""Prompt styles: how a validated row becomes text segments, each marked trained (assistant replies and their
stop token) or masked (everything else).

Rows come in two shapes (validated by `lit_qlora.data.sft`):
- instruction rows `{"instruction": str, "input": str, "output": str}`, seen by chat styles as one user turn
  (instruction, then a blank line and the input when there is one) and one assistant turn;
- chat rows `{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}`.

Every assistant turn gives exactly one trained segment: its content followed by the style's stop token (EOS for
alpaca, <|im_end|> for chatml, <|eot_id|> for llama3, the template's own end-of-turn for chat_template), so the
model learns to stop. Segments are tokenized one by one, the way a prompt is tokenized alone at inference time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Union

from lit_qlora.data.errors import DataError
from lit_qlora.checkpoint.tokenizer import END_OF_TURN_TOKENS, _compile
from lit_qlora.data.templates import ALPACA_HEADER, ALPACA_HEADER_WITH_INPUT, STYLES

Row = dict[str, Any]


@dataclass(frozen=True)
class Segment:
    text: str
    train: bool  # True: the loss is taken on these tokens; False: they are context only (labels -100)


def row_messages(row: Row) -> list[dict[str, str]]:
    """A row as chat messages (an instruction row becomes one user turn and one assistant turn)."""
    if "messages" in row:
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": row.get("output", "")}]


def prompt_text(row: Row) -> Optional[str]:
    """What the user wrote as a row's prompt, for reports to show instead of the template around it: the instruction
    (and input), the last user turn before the first reply (a preference pair: before its answers), an explicit
    prompt; None for plain text, whose prompt is just its first tokens."""
    if "text" in row:
        return None
    if isinstance(row.get("prompt_text", row.get("prompt")), str):  # prompt/completion rows, raw-text pairs
        return row.get("prompt_text", row.get("prompt"))
    if "prompt" in row:  # a pair's (or a GRPO row's) prompt: every turn before the answers
        messages = row["prompt"]
    else:  # a training row: its sample prompt stops at the first reply
        messages = row_messages(row)
        messages = messages[:next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))]
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else None


def _tidy(segments: list[Segment]) -> list[Segment]:
    """Drop empty masked pieces, merge neighbours with the same flag, drop masked text after the last reply."""
    out: list[Segment] = []
    for s in segments:
        if not s.text and not s.train:
            continue
        if out and out[-1].train == s.train and not s.train:
            out[-1] = Segment(out[-1].text + s.text, False)
        else:
            out.append(s)
    while out and not out[-1].train:
        out.pop()
    return out


def raw_segments(row: Row, tokenizer: Any) -> Optional[list[Segment]]:
    """The rows no prompt template wraps (None for the others): `text` (continued pre-training: every token trains)
    and `prompt`/`completion` (the completion trains), each ending with the tokenizer's EOS so the model learns
    where a document or completion ends."""
    stop = getattr(tokenizer, "eos_token", None) or ""
    if "text" in row:
        return [Segment(row["text"] + stop, True)]
    if "prompt" in row:
        return [Segment(row["prompt"], False), Segment(row["completion"] + stop, True)]
    return None


class PromptStyle:
    name = ""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, row: Row) -> list[Segment]:
        """Segments of a validated row, ending with the last assistant reply (trained) and its stop token."""
        return raw_segments(row, self.tokenizer) or _tidy(self.render_messages(row_messages(row)))

    def render_messages(self, messages: list[dict[str, str]]) -> list[Segment]:
        raise NotImplementedError

    def generation_prompt(self, row: Union[str, Row]) -> str:
        """The text to feed the fine-tuned model at inference: an instruction (str), an instruction row without
        `output`, or `{"messages": [...]}` ending with a user turn."""
        row = {"instruction": row} if isinstance(row, str) else dict(row)
        if "messages" in row:
            row["messages"] = [*row["messages"], {"role": "assistant", "content": ""}]
        else:
            row["output"] = ""
        segments = self.render(row)
        return "".join(s.text for s in segments[: max(i for i, s in enumerate(segments) if s.train)])

    def _require_token(self, token: str) -> str:
        if self.tokenizer.token_to_id(token) is None:
            raise DataError(
                f"Prompt style {self.name!r} ends every reply with {token}, but the tokenizer in "
                f"{self.tokenizer.checkpoint_dir} has no such token, so the model could never learn to stop. Pick the "
                "style the checkpoint was trained with (--data.prompt_style chat_template uses its own template), or "
                "alpaca, which ends replies with the tokenizer's EOS."
            )
        return token


class Alpaca(PromptStyle):
    """The Stanford Alpaca prompt; a system message replaces its opening line, each user turn is an instruction."""

    name = "alpaca"
    HEADER, HEADER_WITH_INPUT = ALPACA_HEADER, ALPACA_HEADER_WITH_INPUT

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        if not tokenizer.eos_token:
            raise DataError(
                f"Prompt style 'alpaca' ends replies with the tokenizer's EOS token, and the tokenizer in "
                f"{tokenizer.checkpoint_dir} defines none (tokenizer_config.json `eos_token`). Add it, or use "
                "--data.prompt_style chat_template."
            )
        self.stop = tokenizer.eos_token

    def render(self, row: Row) -> list[Segment]:
        if "messages" in row or "text" in row or "prompt" in row:
            return super().render(row)
        if row.get("input"):
            prompt = (f"{self.HEADER_WITH_INPUT}### Instruction:\n{row['instruction']}\n\n"
                      f"### Input:\n{row['input']}\n\n### Response:\n")
        else:
            prompt = f"{self.HEADER}### Instruction:\n{row['instruction']}\n\n### Response:\n"
        return _tidy([Segment(prompt, False), Segment(row["output"] + self.stop, True)])

    def render_messages(self, messages: list[dict[str, str]]) -> list[Segment]:
        system = [m["content"] for m in messages if m["role"] == "system"]
        segments = [Segment("\n\n".join(system) + "\n\n" if system else self.HEADER, False)]
        for m in messages:
            if m["role"] == "user":
                segments.append(Segment(f"### Instruction:\n{m['content']}\n\n", False))
            elif m["role"] == "assistant":
                segments += [Segment("### Response:\n", False), Segment(m["content"] + self.stop, True),
                             Segment("\n\n", False)]
        return segments


class ChatML(PromptStyle):
    """`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message (SmolLM2, Qwen2, ...), no default system prompt."""

    name = "chatml"

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.stop = self._require_token("<|im_end|>")

    def render_messages(self, messages: list[dict[str, str]]) -> list[Segment]:
        segments = []
        for m in messages:
            if m["role"] == "assistant":
                segments += [Segment("<|im_start|>assistant\n", False), Segment(m["content"] + self.stop, True),
                             Segment("\n", False)]
            else:
                segments.append(Segment(f"<|im_start|>{m['role']}\n{m['content']}{self.stop}\n", False))
        return segments


class Llama3(PromptStyle):
    """Llama 3 headers; contents are trimmed as Meta's template does; BOS comes from the tokenizer's BOS rule."""

    name = "llama3"

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.stop = self._require_token("<|eot_id|>")
        self._require_token("<|start_header_id|>")
        self._require_token("<|end_header_id|>")

    def render_messages(self, messages: list[dict[str, str]]) -> list[Segment]:
        segments = []
        for m in messages:
            header = f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"
            if m["role"] == "assistant":
                segments += [Segment(header, False), Segment(m["content"].strip() + self.stop, True)]
            else:
                segments.append(Segment(header + m["content"].strip() + self.stop, False))
        return segments


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    # Tokenizer.apply_chat_template compiles the template on every call (~2 ms); rendering alone takes ~10 us,
    # and this style renders each conversation twice per assistant turn. Same environment, compiled once.
    return _compile(template)


class ChatTemplate(PromptStyle):
    """The checkpoint's own chat template. Assistant spans are found by rendering prefixes: for each assistant turn
    i, render(messages[:i], add_generation_prompt=True) is the masked context and what render(messages[:i+1])
    adds after it is the reply, trained up to and including the first end-of-turn token after its content (text
    after that, e.g. a newline, is masked). Templates that rewrite earlier turns later on (not prefix-stable) are
    refused, because their training text could not match what they render at inference."""

    name = "chat_template"

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        if not tokenizer.has_chat_template:
            raise DataError(
                f"--data.prompt_style chat_template renders rows with the checkpoint's chat template, but "
                f"{tokenizer.checkpoint_dir} has none (no `chat_template` in tokenizer_config.json and no "
                "chat_template.jinja). Use --data.prompt_style alpaca, chatml or llama3 instead."
            )
        self.stops = [s for s in dict.fromkeys([tokenizer.eos_token, *END_OF_TURN_TOKENS]) if s]

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        tok = self.tokenizer
        try:
            return _compiled(tok.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=tok.bos_token or "", eos_token=tok.eos_token or "",
            )
        except Exception as e:  # jinja TemplateError, or a template's raise_exception()
            roles = "/".join(m["role"] for m in messages)
            raise DataError(
                f"The chat template of {tok.checkpoint_dir} refused a conversation with roles {roles}: {e}. Make the "
                "rows follow the roles and order this template accepts, or use --data.prompt_style alpaca or chatml."
            ) from e

    def _reply_end(self, part: str, content: str) -> int:
        """Where the trained text of one rendered assistant turn ends: after the stop token following its content."""
        start = part.rfind(content) if content else 0
        if start < 0 and content.strip():
            content = content.strip()
            start = part.rfind(content)
        if start < 0:  # the template rewrote the content: train on the whole turn
            return len(part)
        end = start + len(content)
        found = [j + len(s) for s in self.stops if (j := part.find(s, end)) >= 0 and not part[end:j].strip()]
        return min(found) if found else len(part)

    def render_messages(self, messages: list[dict[str, str]]) -> list[Segment]:
        segments: list[Segment] = []
        done = ""  # everything rendered so far: messages[:i] of the previous assistant turn, closed
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        for i, m in enumerate(messages[: last + 1]):
            if m["role"] != "assistant":
                continue
            context = self._render(messages[:i], add_generation_prompt=True)
            full = self._render(messages[: i + 1], add_generation_prompt=False)
            if not context.startswith(done) or not full.startswith(context):
                raise DataError(
                    f"The chat template of {self.tokenizer.checkpoint_dir} is not prefix-stable: rendering a "
                    f"conversation up to message {i + 1} changes the text it rendered for the earlier messages (or "
                    "the generation prompt is not where the reply begins), so assistant turns cannot be located for "
                    "loss masking. Use --data.prompt_style chatml, llama3 or alpaca, or train on single-turn rows."
                )
            part = full[len(context):]
            cut = self._reply_end(part, m["content"])
            segments += [Segment(context[len(done):], False), Segment(part[:cut], True), Segment(part[cut:], False)]
            done = full
        return segments

    def generation_prompt(self, row: Union[str, Row]) -> str:
        row = {"instruction": row} if isinstance(row, str) else row
        messages = row_messages(row) if "messages" in row else row_messages({**row, "output": ""})[:1]
        return self._render(messages, add_generation_prompt=True)


PROMPT_STYLES: dict[str, type[PromptStyle]] = {s.name: s for s in (Alpaca, ChatML, Llama3, ChatTemplate)}
"""Each style of lit_qlora.data.templates.STYLES (the registry `--data.prompt_style` and the exports read), by the
class that renders rows in it."""


def resolve_prompt_style(name: str, tokenizer: Any) -> tuple[str, str]:
    """(the style, why): `auto` is the checkpoint's chat template where it has one (train as it will be served:
    generate, chat, serve and the exported model's template speak it), else alpaca (a base model)."""
    if name != "auto":
        return name, "given with --data.prompt_style"
    if tokenizer.has_chat_template:
        return "chat_template", "auto: the checkpoint's own chat template, as generate, chat and serve use it"
    return "alpaca", "auto: the checkpoint has no chat template"


def get_prompt_style(name: str, tokenizer: Any) -> PromptStyle:
    name = resolve_prompt_style(name, tokenizer)[0]
    if name not in PROMPT_STYLES:
        raise DataError(f"Unknown prompt style {name!r}; choose one of auto, {', '.join(STYLES)}.")
    return PROMPT_STYLES[name](tokenizer)
