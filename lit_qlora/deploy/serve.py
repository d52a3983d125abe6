"""`litqlora serve`: an OpenAI-compatible server for a model or a fine-tune, built on LitServe (Lightning's server)
and its OpenAI spec.

* `POST /v1/chat/completions`, streamed (server-sent events) or not, through the checkpoint's chat template;
  `temperature`, `top_p`, `max_tokens`/`max_completion_tokens`, `n` and `seed` are honoured; `usage` counts the
  prompt's token ids as fed to the model and the tokens generated (streamed: in a last chunk when
  `stream_options: {"include_usage": true}` asks, as OpenAI does); `finish_reason` is "length" for a cut reply;
* `GET /v1/models` lists the model as loaded and each `--adapters` fine-tune by name, `GET /v1/models/{model}` is one
  (404 for another name); a request's `model` picks the adapter it decodes with (lit_qlora.lora.bank: one base in
  memory, rows of one batch with different adapters); `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
  (vLLM's) change them while serving;
* 127.0.0.1 unless `--host` says otherwise; `--api_key` (or LIT_QLORA_API_KEY) makes every /v1 route require
  `Authorization: Bearer KEY`, what the OpenAI clients send (401 otherwise);
* every error is an OpenAI error object, `{"error": {"message", "type", "param", "code"}}`: 400 for a value no reply
  can honour (and a conversation past the context), 401, 404, 422 for a body that does not match the schema, 500;
  the server goes on;
* one worker decodes up to `--max_batch_size` replies together (continuous batching, lit_qlora.deploy.batching): a
  request joins the running batch at the next token, each reply answers as it would alone, a finished one leaves at
  once, and a streamed request whose client goes away stops generating at its next token; a request's `n` choices are
  rows of one batch; a prompt that starts as a recent one did prefills only the rest;
* SIGINT or SIGTERM: no new request is taken, each reply in flight ends with a `server_shutdown` error event, and the
  server is gone within 3 s, with one line.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lit_qlora.base import switches
from lit_qlora.base.errors import InvalidInput
from lit_qlora.deploy.choice import ModelChoice

# litserve, torch and the model are imported inside the functions: the CLI imports this module to build --help.


@dataclass(kw_only=True)
class ServeSpec(ModelChoice):
    """`litqlora serve`'s options: the model (ModelChoice; a chat model, or a fine-tune of one) and the server."""

    host: str = "127.0.0.1"
    """Interface to listen on; 127.0.0.1 (this machine only) by default, 0.0.0.0 for every interface."""
    port: int = 8000
    """TCP port."""
    api_key: Optional[str] = None
    """Require `Authorization: Bearer API_KEY` on /v1 routes (default: LIT_QLORA_API_KEY, else none)."""
    max_new_tokens: int = 512
    """A reply's length when the request gives no max_tokens, and the most it may ask for."""
    model_name: Optional[str] = None
    """The model id /v1/models lists (default: the adapter's or checkpoint's directory name)."""
    max_batch_size: int = 16
    """Replies decoded together (continuous batching: a request joins at the next token); more wait their turn."""
    adapters: Optional[list[str]] = None
    """Fine-tunes served by name on the one base, as vLLM's --lora-modules: '[support=out/a, legal=out/b]' (each
    DIR a fine-tune's out_dir or its final/, trained on --checkpoint_dir with one quantize). A request's `model` picks
    one (a name that is neither one nor the base's is a 404), rows of one batch may use different ones; /v1/models
    lists them, /v1/load_lora_adapter and /v1/unload_lora_adapter add and drop them while serving."""

    @property
    def served_name(self) -> str:
        """The id /v1/models lists for the model as loaded (the base, or the base + --adapter_dir)."""
        return self.model_name or Path(self.adapter_dir or self.checkpoint_dir).name

    def adapter_dirs(self) -> dict[str, Path]:
        """--adapters as {name: DIR}."""
        parsed: dict[str, Path] = {}
        for item in self.adapters or ():
            name, sep, folder = (part.strip() for part in str(item).partition("="))
            if not sep or not name or not folder:
                raise InvalidInput(f"--adapters {item!r}: give each adapter as NAME=DIR, e.g. "
                                   "--adapters '[support=out/support, legal=out/legal]'.")
            if name in parsed:
                raise InvalidInput(f"--adapters names {name!r} twice: give each adapter a name of its own.")
            parsed[name] = Path(folder)
        return parsed

    def check(self, tokenizer: bool = True) -> None:
        """ModelChoice's checks, and every --adapters entry: its files, its name, and that it trained on the base
        served (one quantize, and for NF4 the codes of one dtype)."""
        from lit_qlora.checkpoint.adapter import read_adapter_config

        super().check(tokenizer)
        if self.adapters and self.adapter_dir is not None:
            raise InvalidInput(f"--adapter_dir {self.adapter_dir} with --adapters: the adapters by name go on the "
                               "base alone (each trained on it, not on another adapter). Serve that fine-tune by name "
                               f"too: --adapters '[{Path(self.adapter_dir).name}={self.adapter_dir}, ...]'.")
        quantize, first = self.run_quantize, None
        for name, folder in self.adapter_dirs().items():
            if name == self.served_name:
                raise InvalidInput(f"--adapters {name}={folder}: {name!r} is the served model's own id (the base's); "
                                   "name the adapter otherwise, or give the base another --model_name.")
            config = read_adapter_config(folder, "--adapters")
            theirs = config.get("quantize", "none")
            if theirs != quantize:
                raise InvalidInput(f"--adapters {name}={folder} trained on a {theirs} base, but the base served is "
                                   f"{quantize}: serve adapters trained with one --quantize together (or several "
                                   "servers), or pass --quantize to choose the base.")
            codes = config.get("base_dtype", "bfloat16")
            first = first or (name, codes)
            if quantize == "nf4" and codes != first[1]:
                raise InvalidInput(f"--adapters {name}={folder} trained on NF4 codes quantized from {codes} weights, "
                                   f"{first[0]} on codes from {first[1]}: one base cannot be both. Serve them from "
                                   "two servers.")

    @property
    def run_quantize(self) -> str:
        if self.quantize is None and self.adapters:
            from lit_qlora.checkpoint.adapter import read_adapter_config

            return read_adapter_config(next(iter(self.adapter_dirs().values())), "--adapters").get("quantize", "none")
        return super().run_quantize

    def load(self) -> Any:
        """The model; with --adapters, the base as they trained on it (their NF4 codes)."""
        if not self.adapters:
            return super().load()
        from lit_qlora.checkpoint.loading import load_model

        return load_model(self.checkpoint_dir, self.quantize, self.run_precision, device=self.run_device,
                          base_of=next(iter(self.adapter_dirs().values())))

    def describe(self) -> str:
        names = ", ".join(self.adapter_dirs())
        return super().describe() + (f" with adapters {names}" if names else "")


def build_server(choice: ModelChoice, api_key: Optional[str] = None, max_new_tokens: int = 512,
                 model_name: Optional[str] = None, max_batch_size: int = 16, notices: Any = None,
                 adapters: Optional[dict[str, Path]] = None):
    import litserve as ls

    from lit_qlora.deploy.batching import BatchingLoop
    from lit_qlora.deploy.litserve_api import BearerToken, ChatSpec, add_model_routes, install_error_handlers
    from lit_qlora.deploy.worker import ChatAPI

    name = model_name or Path(choice.adapter_dir or choice.checkpoint_dir).name
    notices = notices or new_notices()
    adapters = adapters or {}
    chat_spec = ChatSpec(name, notices, list(adapters))
    api = ChatAPI(choice, max_new_tokens, notices, adapters, name, spec=chat_spec, loop=BatchingLoop(max_batch_size))
    middlewares = [(BearerToken, {"api_key": api_key})] if api_key else None
    server = ls.LitServer(api, accelerator=choice.run_device.type, devices=1, workers_per_device=1, timeout=600,
                          middlewares=middlewares)
    add_model_routes(server.app, chat_spec)
    install_error_handlers(server.app)
    return server


def new_notices() -> Any:
    """The folder the server's processes post disconnects and the shutdown in (litserve_api.Notices), removed at exit."""
    from lit_qlora.deploy.litserve_api import Notices

    folder = tempfile.mkdtemp(prefix="litqlora-serve-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return Notices(folder)


def serve_command(spec: Optional[ServeSpec] = None, **settings: Any) -> None:
    """Serve a model over the OpenAI API (/v1/chat/completions, streamed or not; /v1/models), with LitServe.

    Takes a ServeSpec, or its fields as keywords (`serve_command(adapter_dir=..., port=8001)`).
    """
    spec = ServeSpec.of(spec, settings)
    # Checked here, where a bad path is a one-line error: in LitServe's worker it is a traceback and a failed start.
    spec.check()
    tokenizer = spec.tokenizer()
    if not tokenizer.has_chat_template and tokenizer.prompt_format is None:
        raise InvalidInput(f"{spec.checkpoint_dir} has no chat template (tokenizer_config.json chat_template) and no "
                           "fine-tune's prompt style was given (--adapter_dir): serve answers chat messages through "
                           "one of them. Serve a chat model or a fine-tune of it, or use `litqlora generate` for this "
                           "one.")
    if spec.max_batch_size < 1:
        raise InvalidInput(f"--max_batch_size {spec.max_batch_size}: at least 1 reply must decode at a time.")
    notices = new_notices()
    server = build_server(spec, spec.api_key or switches.text("LIT_QLORA_API_KEY"), spec.max_new_tokens,
                          spec.model_name, spec.max_batch_size, notices, spec.adapter_dirs())
    print(f"Serving {spec.describe()} on http://{spec.host}:{spec.port}/v1", flush=True)
    # SIGINT and SIGTERM, sent to this process or its group, with or without a terminal, stop it as Ctrl-C does
    # (`_stop`). Installed explicitly because a process started in the background of a script inherits SIGINT
    # ignored, and Python then keeps ignoring it; the forked processes (the API server) inherit these handlers.
    main_pid, received = os.getpid(), []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, frame: _stop(main_pid, signum, received, notices))
    # While the API server lets its last replies end, LitServe's worker monitor in this process may ask the manager
    # process, gone with the same signal, whether to stop, and log its broken pipe as a crash: not one once stopping.
    logging.getLogger("litserve.server").addFilter(
        lambda record: not (received and record.getMessage().startswith("Monitoring worker crashed")))
    try:
        # uvicorn's own lines (startup, each request, shutdown) at warning: the lines above and below say it
        server.run(host=spec.host, port=spec.port, generate_client_file=False, num_api_servers=1, log_level="warning")
    except KeyboardInterrupt:
        pass
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
    print(f"Stopped serving ({signal.Signals(received[0]).name if received else 'the server exited'}).", flush=True)


SHUTDOWN_GRACE_S = 2.0
"""How long the API server waits, once shutting down, for its replies in flight to end (each gets its worker's
error event at the worker's next step) before it exits anyway."""


def _stop(main_pid: int, signum: int, received: list, notices: Any) -> None:
    """The main process posts the shutdown (the worker ends every reply in flight with an error event and refuses
    what is queued) and shuts LitServe down, which stops the API server, then the worker. The API server (forked: it
    inherits this handler, from the group's signal or LitServe's SIGTERM) stops taking requests and exits once its
    replies in flight have ended, within SHUTDOWN_GRACE_S; no process prints a traceback."""
    if os.getpid() != main_pid:
        if not received:
            received.append(signum)
            threading.Thread(target=_exit_when_replies_end, daemon=True).start()
        return
    if not received:  # the first: shut down (a second, while shutting down, is not a reason for a traceback)
        received.append(signum)
        notices.shut()
        logging.getLogger("litserve").setLevel(logging.WARNING)  # its shutdown steps: the one line after says it
        raise KeyboardInterrupt


def _exit_when_replies_end() -> None:
    from lit_qlora.deploy.litserve_api import wait_for_open_replies

    wait_for_open_replies(SHUTDOWN_GRACE_S)
    os._exit(0)
