"""What `litqlora serve` runs inside LitServe: the chat LitAPI (the worker), the OpenAI spec's responses with real
usage (the API server), OpenAI error objects for every error and the bearer-token check. A module of its own,
imported only when serving (it imports litserve), whose classes LitServe can pickle into its worker process by name.

The worker's `encode_response` yields `{"content": piece}` for each piece of a reply, then one
`{"finish_reason": ..., "usage": {...}}`; only `ChatSpec` reads them, so that protocol is this module's own.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import time
from typing import Any, AsyncIterator, Optional

import litserve as ls
from fastapi import BackgroundTasks, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from litserve.specs.openai import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                   ChatCompletionResponseChoice, ChatCompletionStreamingChoice, ChatMessage,
                                   ChoiceDelta, OpenAISpec, UsageInfo, shortuuid)
from litserve.utils import LitAPIStatus
from pydantic import BaseModel, PrivateAttr
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.base import BaseHTTPMiddleware

from lit_qlora.base.errors import InvalidInput
from lit_qlora.deploy.choice import ModelChoice


# ---- OpenAI error objects ----------------------------------------------------------------------------------------

def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`, what the OpenAI API answers (and its SDKs read) on errors."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def refusal(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> HTTPException:
    """An HTTPException the error handlers turn into an OpenAI error object. It pickles (LitServe sends a worker's
    HTTPException to the API server as its status and detail), so the worker raises these too."""
    return HTTPException(status, {"message": message, "param": param, "code": code})


def install_error_handlers(app: Any) -> None:
    """Every error response of `app` becomes an OpenAI error object: HTTP errors (ours, LitServe's, an unknown route
    404, a wrong method 405), a body that does not match the request schema (FastAPI's 422), anything unexpected."""

    async def http_error(request: Any, exc: StarletteHTTPException) -> JSONResponse:
        detail, status = exc.detail, exc.status_code
        if isinstance(detail, dict):
            return error_response(status, str(detail.get("message")), detail.get("param"), detail.get("code"))
        if status == 404 and detail == "Not Found":
            return error_response(404, f"No route {request.method} {request.url.path}: this server answers POST "
                                  "/v1/chat/completions, GET /v1/models and GET /v1/models/{model}.", None, "not_found")
        if status == 405:
            return error_response(405, f"{request.method} is not allowed on {request.url.path}.", None,
                                  "method_not_allowed")
        return error_response(status, str(detail), None, "internal_error" if status >= 500 else None)

    async def invalid_body(request: Any, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0]
        param = None if first["type"] == "json_invalid" else _param_path(first["loc"])
        message = f"Invalid '{param}': {first['msg']}." if param else f"Invalid request body: {first['msg']}."
        if len(errors) > 1:
            message += f" ({len(errors) - 1} more problem{'s' if len(errors) > 2 else ''} in the body.)"
        return error_response(422, message, param, first["type"])

    async def unexpected(request: Any, exc: Exception) -> JSONResponse:
        return error_response(500, "The server failed while answering; its log has the traceback.", None,
                              "internal_error")

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(Exception, unexpected)


def _param_path(loc: tuple) -> Optional[str]:
    """A pydantic location as OpenAI names parameters: ("body", "messages", 0, "content") -> messages[0].content."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path or None


# ---- requests ----------------------------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(ChatCompletionRequest):
    """LitServe's request model with what OpenAI's API adds that we honour: `stream_options` and `seed`."""

    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = None
    _choice: int = PrivateAttr(default=0)
    """Which of the request's n choices this copy answers: LitServe queues one copy per choice (`model_copy`, n set
    to 1), which would otherwise draw the same tokens from the same seed."""
    _copies: int = PrivateAttr(default=0)
    _stream: str = PrivateAttr(default="")
    """The streamed request's id (every choice's copy has it), under which the API server posts a disconnect."""

    def model_copy(self, *args: Any, **kwargs: Any) -> "ChatRequest":
        copy = super().model_copy(*args, **kwargs)
        copy._choice, self._copies = self._copies, self._copies + 1
        copy._stream = self._stream
        return copy


class Notices:
    """What the server's processes tell each other through a folder both see (LitServe's worker is a spawned process
    with no channel back from the API server but the requests themselves): that a streamed request's client went
    away (an empty file named by the request's id: its worker stops generating it at the next token), and that the
    server is shutting down (the main process posts it on SIGINT or SIGTERM: the worker ends every reply in flight
    with an error, and refuses the rest)."""

    SHUTDOWN = ".shutdown"

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def post(self, stream: str) -> None:
        if stream:
            self._touch(stream)

    def gone(self, stream: str) -> bool:
        return bool(stream) and os.path.exists(os.path.join(self.folder, stream))

    def shut(self) -> None:
        self._touch(self.SHUTDOWN)

    def shutting(self) -> bool:
        return os.path.exists(os.path.join(self.folder, self.SHUTDOWN))

    def _touch(self, name: str) -> None:
        with open(os.path.join(self.folder, name), "w"):
            pass


def shutdown_refusal() -> HTTPException:
    """What a request in flight, or one that arrives, gets once the server is shutting down."""
    return refusal(503, "The server is shutting down: this reply ends here (send the request again once it is back).",
                   None, "server_shutdown")


def choice_seed(seed: int, choice: int) -> int:
    """The sampling seed of choice `choice` of a request with `seed`: the seed itself for the first (so n = 1 draws as
    it always did), a hash of both for the others (distinct draws, the same on every repeat of the request)."""
    if choice == 0:
        return seed % 2**63
    return int.from_bytes(hashlib.sha256(f"{seed}:{choice}".encode()).digest()[:8], "little") >> 1


def check_request(request: ChatRequest) -> None:
    """Values the schema lets through but no reply can honour: a 400 naming the parameter, as OpenAI answers."""
    bounds = {"max_tokens": (1, None), "max_completion_tokens": (1, None), "n": (1, 128), "temperature": (0, 2),
              "top_p": (0, 1)}
    for name, (low, high) in bounds.items():
        value = getattr(request, name)
        if value is not None and value < low:
            raise refusal(400, f"Invalid '{name}': {value} is below the minimum value {low}.", name, "below_min_value")
        if value is not None and high is not None and value > high:
            raise refusal(400, f"Invalid '{name}': {value} is above the maximum value {high}.", name, "above_max_value")
    if request.stream_options is not None and not request.stream:
        raise refusal(400, "'stream_options' is only allowed with 'stream': true.", "stream_options", "invalid_value")
    if not request.messages:
        raise refusal(400, "'messages' is empty: send at least one message.", "messages", "empty_array")
    for i, message in enumerate(request.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            if getattr(part, "text", None) is None:
                raise refusal(400, f"'{part.type}' content is not supported: this model reads text only.",
                              f"messages[{i}].content[{j}]", "unsupported_content")


def chat_messages(request: ChatRequest) -> list[dict[str, str]]:
    """The request's messages as the chat template takes them (text parts joined; no content is empty text)."""
    def text(content: Any) -> str:
        return content if isinstance(content, str) else "".join(part.text for part in content or ())

    return [{"role": m.role, "content": text(m.content)} for m in request.messages]


# ---- the worker --------------------------------------------------------------------------------------------------

class ChatAPI(ls.LitAPI):
    """OpenAI chat completions through the checkpoint's chat template; the model loads in the worker (`setup`)."""

    def __init__(self, choice: ModelChoice, max_new_tokens: int, notices: Optional[Notices] = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.choice, self.max_new_tokens, self.notices = choice, max_new_tokens, notices

    def setup(self, device: str) -> None:
        import signal

        from lit_qlora.base.threads import govern_threads

        # This is LitServe's inference worker (spawned: `litqlora serve`'s handlers are not inherited). Ctrl-C in a
        # terminal reaches the whole group: the main process stops the server and then this worker, so the worker
        # itself lets SIGINT pass instead of dying mid-reply with a KeyboardInterrupt traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.model = self.choice.load()  # on the choice's device (LitServe's `device` follows it: build_server)
        govern_threads(self.model)  # the server shares the CPU with other processes (lit_qlora.base.threads)
        # the prompt format the adapter trained with (lit_qlora.data.inference): the ids training saw
        self.tokenizer = self.choice.tokenizer()
        if not self.tokenizer.has_chat_template and self.tokenizer.prompt_format is None:
            raise InvalidInput(f"{self.choice.checkpoint_dir} has no chat template: serve answers chat messages "
                               "through it.")
        from lit_qlora.model.batch_decode import DecodeBatch

        self.batch, self.replies = DecodeBatch(self.model), {}

    def prompt_ids(self, request: ChatRequest) -> list[int]:
        """The token ids the model is fed for `request`: its messages through the chat template (400 when the
        template refuses them or they leave no room in the context for a reply)."""
        from jinja2.exceptions import TemplateError

        from lit_qlora.data.errors import DataError

        try:
            ids = self.tokenizer.encode_chat(chat_messages(request))
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
        (its messages, its context) raises before it joins."""
        from lit_qlora.model.batch_decode import Row
        from lit_qlora.model.sampling import Pieces

        if self.shutting():
            raise shutdown_refusal()
        ids = self.prompt_ids(request)
        asked = request.max_completion_tokens or request.max_tokens or self.max_new_tokens
        limit = min(asked, self.max_new_tokens, self.model.config.max_seq_length - len(ids))
        seed = secrets.randbits(63) if request.seed is None else choice_seed(request.seed, request._choice)
        self.batch.add(Row(uid, ids, limit, temperature=0.7 if request.temperature is None else request.temperature,
                           top_p=request.top_p if request.top_p is not None and request.top_p < 1 else None,
                           stop_ids=frozenset(self.tokenizer.eos_ids), seed=seed))
        self.replies[uid] = Reply(request._stream, len(ids), Pieces(self.tokenizer))

    def step(self) -> list[tuple[Any, Optional[dict[str, Any]]]]:
        """One token for every reply in the batch: (uid, `{"content": piece}`) for a reply's text as it grows, then
        (uid, `{"finish_reason", "usage"}`) when it ends, and (uid, None) for one whose client went away (it stops
        here). The pieces' protocol is ChatSpec's."""
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
        """Every reply in flight, ended (the batch emptied): after a failure of the model mid-step."""
        uids = list(self.replies)
        self.replies.clear()
        self.batch.release()
        return uids


class Reply:
    """A reply in the running batch, as the worker keeps it: its stream's id (a disconnect is posted under it), its
    prompt's length, its text so far and how many tokens it has."""

    def __init__(self, stream: str, prompt_tokens: int, pieces: Any) -> None:
        self.stream, self.prompt_tokens, self.pieces, self.generated = stream, prompt_tokens, pieces, 0


# ---- the API server's side ---------------------------------------------------------------------------------------

class Usage:
    """Token counts of one request: its prompt once (OpenAI counts it once for n choices), every choice's reply."""

    def __init__(self) -> None:
        self.prompt_tokens = self.completion_tokens = 0

    def add(self, counts: dict[str, int], first_choice: bool) -> None:
        if first_choice:
            self.prompt_tokens = counts["prompt_tokens"]
        self.completion_tokens += counts["completion_tokens"]

    def info(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                         total_tokens=self.prompt_tokens + self.completion_tokens)


class ChatSpec(OpenAISpec):
    """LitServe's OpenAI spec, answering with the served model's name, real `usage` (non-streamed, and streamed in a
    last chunk when `stream_options.include_usage` asks), `finish_reason` "length" for a reply cut short, one id per
    completion, and an error status for a request refused before its reply starts, streamed or not."""

    def __init__(self, model_name: str, notices: Optional[Notices] = None) -> None:
        super().__init__()
        self.model_name, self.notices = model_name, notices

    def pre_setup(self, lit_api: Any) -> None:
        # The endpoints alone: OpenAISpec would also require a generator `predict`, which ChatAPI does not have (its
        # worker answers through lit_qlora.deploy.batching's loop, `admit` and `step`).
        self.add_endpoint(self.api_path, self.chat_completion, ["POST"])
        self.add_endpoint(self.api_path, self.options_chat_completions, ["OPTIONS"])

    open_replies = 0
    """Replies this API server process is sending now (one spec per process): a shutdown waits for them to end."""

    async def chat_completion(self, request: ChatRequest, background_tasks: BackgroundTasks) -> Any:
        check_request(request)
        if self.notices is not None and self.notices.shutting():
            raise shutdown_refusal()
        if request.stream:
            request._stream = shortuuid()
        ChatSpec.open_replies += 1
        streaming = False
        try:
            response = await super().chat_completion(request, background_tasks)
            if isinstance(response, StreamingResponse):
                # The stream's first event waits for the reply's first piece: a refusal before it (the context, the
                # chat template) raises here and gets its status instead of a 200 stream carrying an error.
                body = response.body_iterator
                first = await body.__anext__()
                response.body_iterator, streaming = _counted(first, body), True
            return response
        finally:
            if not streaming:  # (a stream is counted until its last event: _counted)
                ChatSpec.open_replies -= 1

    async def _outputs(self, pipe: AsyncIterator) -> AsyncIterator[dict[str, Any]]:
        quiet_litserve_error_line()
        async for data, status in pipe:
            if status == LitAPIStatus.ERROR:
                if isinstance(data, HTTPException):
                    detail = data.detail if isinstance(data.detail, dict) else {"message": data.detail}
                    if detail.get("code") == "server_shutdown":  # (the one line the shutdown prints says it)
                        raise data
                    log.warning("refused a request (%s%s): %s", data.status_code,
                                f" {detail['code']}" if detail.get("code") else "", detail.get("message"))
                    raise data
                log.error("the model failed while answering a request: the inference worker's traceback is above")
                raise refusal(500, "The model failed while answering; the server's log has the traceback.", None,
                              "internal_error")
            yield json.loads(data)

    async def non_streaming_completion(self, request: ChatRequest, pipes: list[AsyncIterator]) -> ChatCompletionResponse:
        choices, usage = [], Usage()
        for i, pipe in enumerate(pipes):
            pieces, finish = [], None
            async for item in self._outputs(pipe):
                if "content" in item:
                    pieces.append(item["content"])
                else:
                    finish = item["finish_reason"]
                    usage.add(item["usage"], first_choice=i == 0)
            message = ChatMessage(role="assistant", content="".join(pieces))
            choices.append(ChatCompletionResponseChoice(index=i, message=message, finish_reason=finish))
        return ChatCompletionResponse(model=self.model_name, choices=choices, usage=usage.info())

    async def streaming_completion(self, request: ChatRequest, pipes: list[AsyncIterator]) -> AsyncIterator[str]:
        ident, created, usage = f"chatcmpl-{shortuuid()}", int(time.time()), Usage()

        def event(choices: list, usage_info: Optional[UsageInfo] = None) -> str:
            chunk = ChatCompletionChunk(id=ident, created=created, model=self.model_name, choices=choices,
                                        usage=usage_info)
            return f"data: {chunk.model_dump_json(by_alias=True)}\n\n"

        started = False
        try:
            for i, pipe in enumerate(pipes):  # the n choices decode together; their events go out in turn
                role = "assistant"
                async for item in self._outputs(pipe):
                    if "content" in item:
                        delta, finish = ChoiceDelta(role=role, content=item["content"]), None
                        role = None
                    else:
                        delta, finish = ChoiceDelta(), item["finish_reason"]
                        usage.add(item["usage"], first_choice=i == 0)
                    yield event([ChatCompletionStreamingChoice(index=i, delta=delta, finish_reason=finish)])
                    started = True
            if request.stream_options is not None and request.stream_options.include_usage:
                yield event([], usage.info())
            yield "data: [DONE]\n\n"
        except (GeneratorExit, asyncio.CancelledError):  # the client went away mid-reply: its worker stops
            if self.notices is not None:
                self.notices.post(request._stream)
            raise
        except HTTPException as e:
            if not started:
                raise
            detail = e.detail if isinstance(e.detail, dict) else {"message": str(e.detail)}
            body = error_body(e.status_code, str(detail.get("message")), detail.get("param"), detail.get("code"))
            yield f"data: {json.dumps(body)}\n\n"


log = logging.getLogger("lit_qlora.serve")
"""The server's own lines: a refused request (a client error, one line) and a failed one (after its traceback)."""


class _NotOurs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Error occurred while streaming outputs from the inference worker")


def quiet_litserve_error_line() -> None:
    """LitServe's API server logs one ERROR line, 'Please check the above traceback', for every error a worker sends
    back, a client's 400 included (the worker logs no traceback for an HTTPException): ours say which it was."""
    logger = logging.getLogger("litserve.server")
    if not any(isinstance(f, _NotOurs) for f in logger.filters):
        logger.addFilter(_NotOurs())


async def _counted(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events, `first` first, counted among ChatSpec.open_replies until the last is sent."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        ChatSpec.open_replies -= 1


def wait_for_open_replies(timeout: float) -> None:
    """Until this API server process sends no reply, or `timeout` s (a shutdown: each reply in flight gets its
    worker's error event first), then a moment for the last bytes to leave."""
    deadline = time.monotonic() + timeout
    while ChatSpec.open_replies > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)


def add_model_routes(app: Any, name: str) -> None:
    """`GET /v1/models` lists the one served model; `GET /v1/models/{model}` is it, or a 404 error object."""
    created = int(time.time())
    card = {"id": name, "object": "model", "created": created, "owned_by": "lit-qlora"}

    def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    def model(model_id: str) -> Any:
        if model_id != name:
            raise refusal(404, f"The model '{model_id}' does not exist: this server serves '{name}'.", "model",
                          "model_not_found")
        return card

    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])


class BearerToken(BaseHTTPMiddleware):
    """/v1 routes need `Authorization: Bearer <api_key>`, the header the OpenAI clients send (else 401)."""

    def __init__(self, app: Any, api_key: str) -> None:
        super().__init__(app)
        self.api_key = api_key

    async def dispatch(self, request: Any, call_next: Any) -> Any:
        if request.url.path.startswith("/v1") and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return error_response(401, "Invalid or missing API key: send Authorization: Bearer KEY with the key the "
                                  "server was started with (--api_key).", None, "invalid_api_key")
        return await call_next(request)
