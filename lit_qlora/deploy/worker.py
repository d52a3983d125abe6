"""`litqlora serve`'s inference worker: the chat LitAPI, loaded in LitServe's worker process (`setup`), which the
batching loop (lit_qlora.deploy.batching) drives: `admit` joins a request to the running batch, `step` decodes a
token for every reply in it, `command` loads or drops an adapter by name (lit_qlora.lora.bank).

Each step's outputs are `{"content": piece}` for a reply's text as it grows, then one `{"finish_reason", "usage"}`;
only ChatSpec (lit_qlora.deploy.litserve_api) reads them.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Optional

import litserve as ls

from lit_qlora.base.errors import InvalidInput, UserError
from lit_qlora.deploy.choice import ModelChoice
from lit_qlora.deploy.litserve_api import (AdapterRequest, ChatRequest, Notices, chat_messages, choice_seed,
                                           refusal, shutdown_refusal)


class Reply:
    """A reply in the running batch, as the worker keeps it: its stream's id (a disconnect is posted under it), its
    prompt's length, its text so far and how many tokens it has."""

    def __init__(self, stream: str, prompt_tokens: int, pieces: Any) -> None:
        self.stream, self.prompt_tokens, self.pieces, self.generated = stream, prompt_tokens, pieces, 0


class ChatAPI(ls.LitAPI):
    """OpenAI chat completions through the checkpoint's chat template (or a fine-tune's trained prompt style), for
    the model as loaded (`served_name`) and for each adapter by name."""

    def __init__(self, choice: ModelChoice, max_new_tokens: int, notices: Optional[Notices] = None,
                 adapters: Optional[dict[str, Path]] = None, served_name: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.choice, self.max_new_tokens, self.notices = choice, max_new_tokens, notices
        self.adapter_dirs, self.served_name = dict(adapters or {}), served_name

    def setup(self, device: str) -> None:
        import signal

        from lit_qlora.base.threads import govern_threads
        from lit_qlora.model.batch_decode import DecodeBatch

        # This is LitServe's inference worker (spawned: `litqlora serve`'s handlers are not inherited). Ctrl-C in a
        # terminal reaches the whole group: the main process posts the shutdown (this worker ends its replies) and
        # stops the server, so the worker itself lets SIGINT pass instead of dying mid-reply.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.model = self.choice.load()  # on the choice's device (LitServe's `device` follows it: build_server)
        govern_threads(self.model)  # the server shares the CPU with other processes (lit_qlora.base.threads)
        # the prompt format the adapter trained with (lit_qlora.data.inference): the ids training saw
        self.tokenizer = self.choice.tokenizer()
        if not self.tokenizer.has_chat_template and self.tokenizer.prompt_format is None:
            raise InvalidInput(f"{self.choice.checkpoint_dir} has no chat template: serve answers chat messages "
                               "through it.")
        self.bank, self.tokenizers = None, {}
        for name, folder in self.adapter_dirs.items():
            self.load_adapter(name, folder, "--adapters")
        self.batch, self.replies = DecodeBatch(self.model, self.select_adapters), {}

    # ---- adapters by name ----------------------------------------------------------------------------------------

    def load_adapter(self, name: str, folder: Path, flag: str) -> None:
        """Put the fine-tune in `folder` on the base as `name` (its factors in the bank, its prompt format kept)."""
        from lit_qlora.base.precision import PRECISION_DTYPES
        from lit_qlora.checkpoint.adapter import read_adapter_factors
        from lit_qlora.data.inference import trained_tokenizer
        from lit_qlora.lora.bank import AdapterBank

        config, factors, scale = read_adapter_factors(Path(folder), flag)
        quantize = self.choice.run_quantize
        if config.get("quantize", "none") != quantize:
            raise InvalidInput(f"{flag} {name}={folder} trained on a {config.get('quantize', 'none')} base; this "
                               f"server's base is {quantize}.")
        dtype, device = PRECISION_DTYPES[self.choice.run_precision], self.choice.run_device
        factors = {m: (a.to(device, dtype), b.to(device, dtype)) for m, (a, b) in factors.items()}
        tokenizer = trained_tokenizer(Path(self.choice.checkpoint_dir), Path(folder))
        if self.bank is None:
            self.bank = AdapterBank(self.model)
        try:
            self.bank.add(name, factors, scale)
        except InvalidInput as e:
            raise InvalidInput(f"{flag} {name}={folder}: {e}; was it trained on {self.choice.checkpoint_dir}?") from None
        self.tokenizers[name] = tokenizer

    def select_adapters(self, rows: list) -> None:
        if self.bank is not None:
            self.bank.select([row.adapter for row in rows])

    def command(self, command: AdapterRequest) -> dict[str, Any]:
        """Load or drop an adapter while serving (rows decoding with a dropped one finish with it)."""
        if command.path is None:
            if self.bank is None or command.name not in self.bank.names:
                raise refusal(404, f"No adapter named '{command.name}' is loaded.", "lora_name", "model_not_found")
            slot = self.bank.names[command.name]
            self.bank.remove(command.name, in_use=[row.adapter for row in self.batch.rows])
            self.batch.prefixes.forget(slot)  # its prompts' keys and values were computed with it
            del self.tokenizers[command.name]
            return {"unloaded": command.name}
        if command.name == self.served_name or (self.bank is not None and command.name in self.bank.names):
            raise refusal(400, f"The model name '{command.name}' is taken: unload it first, or choose another.",
                          "lora_name", "invalid_value")
        try:
            self.load_adapter(command.name, Path(command.path), "lora_path")
        except UserError as e:
            raise refusal(400, str(e), "lora_path", "invalid_value") from None
        return {"loaded": command.name}

    def route(self, model: Optional[str]) -> tuple[int, Any]:
        """The slot and tokenizer a request for `model` decodes with: an adapter by name; else the model as loaded,
        whatever the name when no adapter is served (one model: clients send any), else only by its own name."""
        if self.bank is not None and model in self.bank.names:
            return self.bank.names[model], self.tokenizers[model]
        if self.bank is not None and model != self.served_name:
            served = ", ".join(f"'{n}'" for n in [self.served_name, *self.bank.names])
            raise refusal(404, f"The model '{model}' does not exist: this server serves {served}.", "model",
                          "model_not_found")
        return 0, self.tokenizer

    # ---- replies -------------------------------------------------------------------------------------------------

    def prompt_ids(self, request: ChatRequest, tokenizer: Any) -> list[int]:
        """The token ids the model is fed for `request`: its messages through the chat template (400 when the
        template refuses them or they leave no room in the context for a reply)."""
        from jinja2.exceptions import TemplateError

        from lit_qlora.data.errors import DataError

        try:
            ids = tokenizer.encode_chat(chat_messages(request))
        except (TemplateError, DataError) as e:  # (DataError: the trained prompt style refused them)
            raise refusal(400, f"The model's chat template refused these messages: {e}", "messages",
                          "invalid_messages") from None
        context = self.model.config.max_seq_length
        if len(ids) >= context:
            raise refusal(400, f"The messages are {len(ids)} tokens through the chat template; the model's context is "
                          f"{context} tokens, and a reply needs at least one more.", "messages",
                          "context_length_exceeded")
        return ids

    def admit(self, uid: Any, request: ChatRequest) -> None:
        """Join `request` to the running batch (its prompt prefilled now): its pieces come out of `step`. A refusal
        (its model, its messages, its context, a shutdown) raises before it joins."""
        from lit_qlora.model.batch_decode import Row
        from lit_qlora.model.sampling import Pieces

        if self.shutting():
            raise shutdown_refusal()
        slot, tokenizer = self.route(request.model)
        ids = self.prompt_ids(request, tokenizer)
        asked = request.max_completion_tokens or request.max_tokens or self.max_new_tokens
        limit = min(asked, self.max_new_tokens, self.model.config.max_seq_length - len(ids))
        seed = secrets.randbits(63) if request.seed is None else choice_seed(request.seed, request._choice)
        self.batch.add(Row(uid, ids, limit, temperature=0.7 if request.temperature is None else request.temperature,
                           top_p=request.top_p if request.top_p is not None and request.top_p < 1 else None,
                           stop_ids=frozenset(tokenizer.eos_ids), seed=seed, adapter=slot))
        self.replies[uid] = Reply(request._stream, len(ids), Pieces(tokenizer))

    def step(self) -> list[tuple[Any, Optional[dict[str, Any]]]]:
        """One token for every reply in the batch: (uid, `{"content": piece}`) for a reply's text as it grows, then
        (uid, `{"finish_reason", "usage"}`) when it ends, and (uid, None) for one whose client went away (it stops
        here)."""
        out: list[tuple[Any, Optional[dict[str, Any]]]] = []
        for uid, reply in list(self.replies.items()):
            if self.notices is not None and self.notices.gone(reply.stream):
                self.batch.drop(uid)
                del self.replies[uid]
                out.append((uid, None))
        for t in self.batch.step() if self.replies else ():
            reply = self.replies[t.key]
            pieces = [reply.pieces.push(t.token)] if t.token is not None else []
            reply.generated += t.token is not None
            if t.finish:
                pieces.append(reply.pieces.flush())
            out += [(t.key, {"content": piece}) for piece in pieces if piece]
            if t.finish:
                del self.replies[t.key]
                out.append((t.key, {"finish_reason": t.finish, "usage": {"prompt_tokens": reply.prompt_tokens,
                                                                          "completion_tokens": reply.generated}}))
        return out

    def shutting(self) -> bool:
        return self.notices is not None and self.notices.shutting()

    def abandon(self) -> list[Any]:
        """Every reply in flight, ended (the batch emptied): after a failure of the model mid-step, or a shutdown."""
        uids = list(self.replies)
        self.replies.clear()
        self.batch.release()
        return uids
