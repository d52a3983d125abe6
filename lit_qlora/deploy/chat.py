"""`litqlora chat`: a multi-turn conversation in the terminal with a base model or a fine-tune.

Each turn renders the whole conversation through the checkpoint's chat template, as training rendered it, and the
model computes only what is new: the KV cache holds the tokens of the turns before (the prompt's longest prefix
already in the cache is kept, the rest is computed), so a long conversation does not get slower turn by turn.
Replies stream as they are generated. `/reset` starts over; `/exit`, `/quit`, Ctrl-D or Ctrl-C at the prompt ends;
`/help` lists these.

Ctrl-C while a reply is being generated stops that reply and returns to the prompt. What was already shown stays
in the conversation as the assistant's turn (the model sees it in the next turn, as a chat app keeps a stopped
reply); a reply stopped before it showed anything leaves no turn, as if the question had not been asked. The KV
cache needs no repair: it is only trusted up to the tokens recorded as fed, and the next turn rewrites the rest.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from lit_qlora.base.errors import InvalidInput
from lit_qlora.deploy.choice import ModelChoice

# torch and the model are imported inside the functions: the CLI imports this module to build --help.

COMMANDS = ("/reset starts a new conversation, /exit or /quit (or Ctrl-D, or Ctrl-C at the prompt) ends it, Ctrl-C "
            "stops a reply, /help shows this")


class ChatSession:
    """One conversation: its messages, and the model's KV cache of the tokens computed so far."""

    def __init__(self, model, tokenizer, system: Optional[str] = None, seed: int = 1234) -> None:
        import torch

        if not tokenizer.has_chat_template:
            raise InvalidInput(f"{tokenizer.checkpoint_dir} has no chat template (tokenizer_config.json "
                               "chat_template): chat needs one to know how turns are written. Use `litqlora generate` "
                               "for single prompts with this model.")
        self.model, self.tokenizer, self.system = model, tokenizer, system
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.max_len = model.config.max_seq_length
        self.fed: list[int] = []  # the tokens whose keys and values are in the cache, in order
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.fed = []
        self.model.set_kv_cache(batch_size=1, max_len=self.max_len, device=self.device)
        self.step = None  # the C decode step over this cache (model/decode_step.py), made at the first token
        self.step_tried = False

    def close(self) -> None:
        self.model.clear_kv_cache()

    def _forward(self, ids: list[int]):
        """Logits of the last of `ids`, fed after the cached tokens."""
        import torch

        start = len(self.fed)
        pos = torch.arange(start, start + len(ids), device=self.device)
        with torch.inference_mode():  # here, not around the generator: a mode entered there leaks at every yield
            if len(ids) == 1 and not self.step_tried:
                from lit_qlora.model import decode_step

                self.step_tried, dtype = True, self.model.model.embed_tokens.weight.dtype
                if self.device.type == "cpu" and decode_step.applies(self.model, dtype):
                    self.step = decode_step.DecodeStep(self.model, dtype)
            if len(ids) == 1 and self.step is not None:
                logits = self.step(ids[0], start)
            else:
                logits = self.model(torch.tensor([ids], device=self.device), input_pos=pos)[0, -1]
        self.fed += ids
        return logits

    def reply(self, text: str, max_new_tokens: int = 256, temperature: float = 0.0, top_k: Optional[int] = None,
              top_p: Optional[float] = None) -> Iterator[str]:
        """Stream the reply to the user's `text` as decoded text pieces; the turn is kept in the conversation, also
        when the reply is stopped (Ctrl-C, or the generator closed) after showing something: as far as it went."""
        from lit_qlora.model.sampling import decoded_pieces, sample

        tok = self.tokenizer
        messages = self.messages + [{"role": "user", "content": text}]
        prompt = tok.encode_chat(messages)
        if len(prompt) + max_new_tokens > self.max_len:
            raise InvalidInput(f"the conversation is {len(prompt)} tokens, and with {max_new_tokens} more it passes "
                               f"the model's context of {self.max_len}: /reset starts a new one.")
        keep = 0
        while keep < min(len(self.fed), len(prompt) - 1) and self.fed[keep] == prompt[keep]:
            keep += 1
        self.fed = self.fed[:keep]  # positions from here on are written again (later ones are masked by causality)

        def tokens() -> Iterator[int]:
            logits = self._forward(prompt[keep:])
            for _ in range(max_new_tokens):
                token = sample(logits, temperature, top_k, self.generator, top_p)
                if token in tok.eos_ids:
                    return
                yield token
                logits = self._forward([token])

        pieces, finished = [], False
        try:
            for piece in decoded_pieces(tok, tokens()):
                pieces.append(piece)
                yield piece
            finished = True
        finally:  # also on KeyboardInterrupt inside the model, or GeneratorExit when the caller stops reading
            said = "".join(pieces).strip()
            if finished or said:
                self.messages = messages + [{"role": "assistant", "content": said}]


@dataclass(kw_only=True)
class ChatCommandSpec(ModelChoice):
    """`litqlora chat`'s options: the model (ModelChoice; a chat model, or a fine-tune of one) and the sampling."""

    system: Optional[str] = None
    """A system message that opens every conversation."""
    temperature: float = 0.7
    """0 is greedy (the same reply every time); higher is more varied."""
    top_p: Optional[float] = 0.9
    """Sample from the most likely tokens that make up this much probability (nucleus sampling)."""
    top_k: Optional[int] = None
    """Sample among the k most likely tokens only."""
    max_new_tokens: int = 256
    """Longest reply, in tokens."""
    seed: int = 1234
    """Seed of the sampler (a conversation repeats with the same inputs)."""


def chat_command(spec: Optional[ChatCommandSpec] = None, **settings: Any) -> None:
    """Chat with a model in the terminal, several turns, replies streamed (/reset starts over, /exit ends, Ctrl-C
    stops a reply and, at the prompt, ends).

    Takes a ChatCommandSpec, or its fields as keywords (`chat_command(adapter_dir=...)`).
    """
    from lit_qlora.base.threads import govern_threads

    spec = ChatCommandSpec.of(spec, settings)
    # Ctrl-C stops a reply (and, at the prompt, leaves) even where the chat was started with SIGINT ignored, as a
    # script's background job or a parent that ignores it passes it on: Python would keep ignoring it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    spec.check()
    model = spec.load()
    govern_threads(model)  # a chat shares the CPU with other processes (lit_qlora.base.threads)
    # the conversation in the prompt format the adapter trained with (lit_qlora.data.inference)
    session = ChatSession(model, spec.tokenizer(), spec.system, spec.seed)
    interactive = sys.stdin.isatty()
    print(f"Chatting with {spec.describe()}: {COMMANDS}.", flush=True)
    try:
        while True:
            try:
                if interactive:
                    print("> ", end="", flush=True)
                line = sys.stdin.readline()
            except KeyboardInterrupt:  # Ctrl-C at the prompt leaves, as /exit does (exit status 0)
                print(flush=True)
                break
            if not line:
                break
            text = line.strip()
            if text in ("/quit", "/exit"):
                break
            if text == "/help":
                print(f"({COMMANDS})", flush=True)
                continue
            if text == "/reset":
                session.reset()
                print("(new conversation)", flush=True)
                continue
            if text:
                answer(session, text, spec.max_new_tokens, spec.temperature, spec.top_k, spec.top_p)
    finally:
        session.close()


def answer(session: ChatSession, text: str, max_new_tokens: int, temperature: float, top_k: Optional[int],
           top_p: Optional[float]) -> None:
    """Print the reply to `text` as it streams; Ctrl-C stops it (what was shown stays in the conversation)."""
    reply = session.reply(text, max_new_tokens, temperature, top_k, top_p)
    try:
        for piece in reply:
            print(piece, end="", flush=True)
        print(flush=True)
    except ValueError as e:
        print(f"({e})", flush=True)
    except KeyboardInterrupt:
        reply.close()  # when Ctrl-C came while printing, the reply's generator records the turn now
        print("\n(stopped)", flush=True)
