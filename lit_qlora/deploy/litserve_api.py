"""What `litqlora serve`'s API server runs inside LitServe: the OpenAI spec's responses with real usage, the model and
adapter routes, OpenAI error objects for every error and the bearer-token check; and what the worker
(lit_qlora.deploy.worker) shares with it: the request model, the notices folder, the refusals. A module of its own,
imported only when serving (it imports litserve).

The worker's outputs are `{"content": piece}` for each piece of a reply, then one `{"finish_reason": ...,
"usage": {...}}`; only `ChatSpec` reads them, so that protocol is the two modules' own."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
import uuid
from collections import deque
from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import BackgroundTasks, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from litserve.specs.openai import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                   ChatCompletionResponseChoice, ChatCompletionStreamingChoice, ChatMessage,
                                   ChoiceDelta, OpenAISpec, UsageInfo, shortuuid)
from litserve.utils import LitAPIStatus, ResponseBufferItem
from pydantic import BaseModel, PrivateAttr
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.base import BaseHTTPMiddleware



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

class LoadLoRARequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    lora_name: str


class AdapterRequest(BaseModel):
    """Load (`path` given) or drop the adapter `name`: what the two adapter routes send the worker through the
    request queue (the worker's ChatAPI.command answers it)."""

    name: str
    path: Optional[str] = None


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

    def __init__(self, model_name: str, notices: Optional[Notices] = None, adapters: Sequence[str] = ()) -> None:
        super().__init__()
        self.model_name, self.notices, self.adapters = model_name, notices, list(adapters)
        self.created = dict.fromkeys([model_name, *adapters], int(time.time()))

    def names(self) -> list[str]:
        """The served model ids: the model as loaded, then each adapter (this API server's record of them)."""
        return [self.model_name, *self.adapters]

    def pre_setup(self, lit_api: Any) -> None:
        # The endpoints alone: OpenAISpec would also require a generator `predict`, which ChatAPI does not have (its
        # worker answers through lit_qlora.deploy.batching's loop, `admit` and `step`).
        self.add_endpoint(self.api_path, self.chat_completion, ["POST"])
        self.add_endpoint(self.api_path, self.options_chat_completions, ["OPTIONS"])
        self.add_endpoint("/v1/load_lora_adapter", self.load_lora_adapter, ["POST"])
        self.add_endpoint("/v1/unload_lora_adapter", self.unload_lora_adapter, ["POST"])

    def answering(self, request: ChatRequest) -> str:
        """The `model` a reply names: the adapter asked for, else the model as loaded."""
        return request.model if request.model in self.adapters else self.model_name

    async def load_lora_adapter(self, body: LoadLoRARequest) -> PlainTextResponse:
        """vLLM's runtime adapter loading: the worker puts `lora_path`'s adapter on the base as `lora_name`."""
        await self._tell_worker(AdapterRequest(name=body.lora_name, path=body.lora_path))
        self.adapters.append(body.lora_name)
        self.created[body.lora_name] = int(time.time())
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, body: UnloadLoRARequest) -> PlainTextResponse:
        await self._tell_worker(AdapterRequest(name=body.lora_name))
        if body.lora_name in self.adapters:
            self.adapters.remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def _tell_worker(self, command: "AdapterRequest") -> None:
        """Send the worker an adapter command through the request queue (the one way into its process) and wait for
        its answer: an error there is raised here, with its status."""
        if self.notices is not None and self.notices.shutting():
            raise shutdown_refusal()
        uid, queue, event = uuid.uuid4(), deque(), asyncio.Event()
        self.response_buffer[uid] = ResponseBufferItem(response_queue=queue, event=event)
        self.request_queue.put((self.response_queue_id, uid, time.monotonic(), command))
        async for _ in self._outputs(self.data_streamer(queue, event, send_status=True)):
            pass

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
        return ChatCompletionResponse(model=self.answering(request), choices=choices, usage=usage.info())

    async def streaming_completion(self, request: ChatRequest, pipes: list[AsyncIterator]) -> AsyncIterator[str]:
        ident, created, usage = f"chatcmpl-{shortuuid()}", int(time.time()), Usage()

        def event(choices: list, usage_info: Optional[UsageInfo] = None) -> str:
            chunk = ChatCompletionChunk(id=ident, created=created, model=self.answering(request), choices=choices,
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


def add_model_routes(app: Any, spec: "ChatSpec") -> None:
    """`GET /v1/models` lists the served models (the model as loaded, then each adapter by name); `GET
    /v1/models/{model}` is one of them, or a 404 error object."""

    def card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": spec.created[name], "owned_by": "lit-qlora"}

    def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(name) for name in spec.names()]}

    def model(model_id: str) -> Any:
        if model_id not in spec.names():
            served = ", ".join(f"'{n}'" for n in spec.names())
            raise refusal(404, f"The model '{model_id}' does not exist: this server serves {served}.", "model",
                          "model_not_found")
        return card(model_id)

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
