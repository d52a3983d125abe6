"""What `litqlora serve` runs inside LitServe: the chat LitAPI and the bearer-token check. A module of its own, imported
only when serving (it imports litserve), whose classes LitServe can pickle into its worker process by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional

import litserve as ls
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import JSONResponse


class ChatAPI(ls.LitAPI):
    """OpenAI chat completions through the checkpoint's chat template; the model loads in the worker (`setup`)."""

    def __init__(self, checkpoint_dir: Path, adapter_dir: Optional[Path], quantize: Optional[str], precision: str,
                 max_new_tokens: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint_dir, self.adapter_dir, self.quantize = checkpoint_dir, adapter_dir, quantize
        self.precision, self.max_new_tokens = precision, max_new_tokens

    def setup(self, device: str) -> None:
        from lit_qlora.checkpoint.loading import load_model
        from lit_qlora.checkpoint.tokenizer import Tokenizer

        self.model = load_model(self.checkpoint_dir, self.quantize, self.precision, self.adapter_dir)
        self.tokenizer = Tokenizer(self.checkpoint_dir)
        if not self.tokenizer.has_chat_template:
            raise ValueError(f"{self.checkpoint_dir} has no chat template: serve answers chat messages through it.")

    def predict(self, request: Any, context: Any = None) -> Iterator[str]:
        from lit_qlora.model.sampling import decoded_pieces, generate

        tok = self.tokenizer
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
                     "".join(part.text for part in m.content if getattr(part, "text", None))}
                    for m in request.messages]
        ids = tok.encode_chat(messages)
        limit = min(request.max_completion_tokens or request.max_tokens or self.max_new_tokens, self.max_new_tokens)
        limit = max(1, min(limit, self.model.config.max_seq_length - len(ids) - 1))
        temperature = 0.7 if request.temperature is None else request.temperature
        top_p = request.top_p if request.top_p is not None and request.top_p < 1 else None
        yield from decoded_pieces(tok, generate(self.model, ids, limit, temperature, None, tok.eos_ids, top_p=top_p))

    def encode_response(self, output: Iterator[str], context: Any = None) -> Iterator[dict[str, str]]:
        for piece in output:
            yield {"role": "assistant", "content": piece}


class BearerToken(BaseHTTPMiddleware):
    """/v1 routes need `Authorization: Bearer <api_key>`, the header the OpenAI clients send (else 401)."""

    def __init__(self, app: Any, api_key: str) -> None:
        super().__init__(app)
        self.api_key = api_key

    async def dispatch(self, request: Any, call_next: Any) -> Any:
        if request.url.path.startswith("/v1") and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return JSONResponse({"error": {"message": "Invalid or missing API key: send Authorization: Bearer KEY with "
                                           "the key the server was started with (--api_key).",
                                           "type": "invalid_request_error", "code": "invalid_api_key"}},
                                status_code=401)
        return await call_next(request)
