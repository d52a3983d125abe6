"""`litqlora serve`'s inference worker loop: continuous batching inside LitServe.

LitServe's own streaming loop answers one request at a time, and its continuous-batching loop spins its event loop
while idle (a core of a 2-core machine). This loop is plain: while nothing is in flight it waits on the request queue;
otherwise it takes every request already queued (up to `max_rows` in flight, the rest wait their turn), joins each
to the running batch (ChatAPI.admit: its prompt prefilled, or a refusal sent back as its error), and runs one decode
step for the whole batch (ChatAPI.step), sending each reply's new piece, and its end, to the API server. A request
therefore joins at the next token, a finished or disconnected one leaves at once, and the `n` choices of a request
(queued together) decode as rows of one batch. Once the server is shutting down (Notices), every reply in flight ends
with an error event at the next step, and every request still queued is refused.
"""

from __future__ import annotations

import logging
from queue import Empty, Queue
from typing import Any

from fastapi import HTTPException
from litserve.loops.base import _SENTINEL_VALUE, LitLoop
from litserve.utils import LitAPIStatus, LoopResponseType, PickleableHTTPException

from lit_qlora.deploy.litserve_api import AdapterRequest, shutdown_refusal

log = logging.getLogger("lit_qlora.serve")

IDLE_WAIT_S = 0.5
"""How long an idle worker waits on the queue at a time (it has nothing else to do; the wait ends when one comes)."""

STREAMING = LoopResponseType.STREAMING


class BatchingLoop(LitLoop):
    """The worker's loop over a ChatAPI (module doc); at most `max_rows` replies decode together."""

    def __init__(self, max_rows: int) -> None:
        super().__init__()
        self.max_rows = max_rows
        self.queue_ids: dict[Any, int] = {}  # each reply in flight: the API server's response queue it goes to

    def __call__(self, lit_api: Any, device: str, worker_id: int, request_queue: Queue, transport: Any,
                 workers_setup_status: dict, callback_runner: Any, *args: Any, **kwargs: Any) -> None:
        self.run(lit_api, device, worker_id, request_queue, transport, workers_setup_status, callback_runner)

    def run(self, lit_api: Any, device: str, worker_id: int, request_queue: Queue, transport: Any,
            workers_setup_status: dict, callback_runner: Any) -> None:
        while True:
            if not self.admit(lit_api, request_queue, transport):
                return
            if self.queue_ids and lit_api.shutting():
                self.end_all(lit_api, transport, shutdown_refusal())
            if self.queue_ids:
                self.step(lit_api, transport)

    def end_all(self, lit_api: Any, transport: Any, error: HTTPException) -> None:
        """End every reply in flight with `error` (an error event after the pieces sent so far)."""
        for uid in lit_api.abandon():
            self.send(transport, self.queue_ids.pop(uid), uid, PickleableHTTPException.from_exception(error),
                      LitAPIStatus.ERROR)

    def admit(self, lit_api: Any, request_queue: Queue, transport: Any) -> bool:
        """Join what is queued to the batch, waiting for a request only when none is in flight; False: the server
        asked the loop to stop."""
        while len(self.queue_ids) < self.max_rows:
            try:
                item = request_queue.get_nowait() if self.queue_ids else request_queue.get(timeout=IDLE_WAIT_S)
            except Empty:
                return True
            if item == _SENTINEL_VALUE:
                return False
            queue_id, uid, _, request = item
            if isinstance(request, AdapterRequest):  # an adapter loaded or dropped while serving: answered at once
                done, answer = self.attempt(transport, queue_id, uid, "the worker failed while changing its adapters",
                                            lit_api.command, request)
                if done:
                    self.send(transport, queue_id, uid, lit_api.format_encoded_response(answer), LitAPIStatus.OK)
                    self.send(transport, queue_id, uid, "", LitAPIStatus.FINISH_STREAMING)
                continue
            done, _ = self.attempt(transport, queue_id, uid, "the model failed while reading a request",
                                   lit_api.admit, uid, lit_api.decode_request(request))
            if done:
                self.queue_ids[uid] = queue_id
        return True

    def attempt(self, transport: Any, queue_id: int, uid: Any, failure: str, call: Any, *args: Any) -> tuple[bool, Any]:
        """(True, `call(*args)`), or (False, None) with its error sent as `uid`'s reply: a refusal (a client's error:
        its messages, its context, its model) with its status; anything else logged as `failure`, with its traceback."""
        try:
            return True, call(*args)
        except HTTPException as e:
            self.send(transport, queue_id, uid, PickleableHTTPException.from_exception(e), LitAPIStatus.ERROR)
        except Exception as e:
            log.exception(failure)
            self.put_error_response(transport, queue_id, uid, e, STREAMING)
        return False, None

    def step(self, lit_api: Any, transport: Any) -> None:
        try:
            outputs = lit_api.step()
        except Exception as e:
            log.exception("the model failed while decoding; the replies in flight end with an error")
            for uid in lit_api.abandon():
                self.put_error_response(transport, self.queue_ids.pop(uid), uid, e, STREAMING)
            return
        for uid, item in outputs:
            queue_id = self.queue_ids[uid]
            if item is not None:
                self.send(transport, queue_id, uid, lit_api.format_encoded_response(item), LitAPIStatus.OK)
            if item is None or "finish_reason" in item:
                self.send(transport, queue_id, uid, "", LitAPIStatus.FINISH_STREAMING)
                del self.queue_ids[uid]

    def send(self, transport: Any, queue_id: int, uid: Any, data: Any, status: LitAPIStatus) -> None:
        self.put_response(transport, queue_id, uid, data, status, STREAMING)
