"""A small GenAI-style service protected by genai-ratelimit.

- API-key auth (a middleware) maps `Authorization: Bearer <key>` to a user id and a tier on
  `request.state`; no key means anonymous (limited by client address, free tier).
- `POST /v1/chat/completions` streams a fake completion (server-sent events, like OpenAI's
  API) or, with "stream": false, answers one JSON object. Protected by `Depends(rate_limit)`.
- `GET /healthz` is not limited.

Run it (Redis from $REDIS_URL, else redis://localhost:6379/0):

    uvicorn app:app --app-dir examples --no-proxy-headers

or `make serve`, which also starts a throwaway redis-server. See examples/README.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from genai_ratelimit import AsyncRateLimiter
from genai_ratelimit.fastapi import RateLimit, RateLimitHeadersMiddleware

# Demo keys. A real service looks keys up in its database.
API_KEYS: dict[str, tuple[str, str]] = {
    "sk-demo-free": ("user_free", "free"),
    "sk-demo-pro": ("user_pro", "pro"),
    "sk-demo-enterprise": ("user_enterprise", "enterprise"),
}

# The limiter connects to $REDIS_URL. EXAMPLE_KEY_PREFIX gives `make demo` a fresh namespace
# on every run; a service keeps the default "ratelimit". Tier budgets: TIER_LIMITS, or the
# file named by $GENAI_RATELIMIT_TIERS (checked here, at start-up).
rate_limit = RateLimit(
    limiter=AsyncRateLimiter(key_prefix=os.environ.get("EXAMPLE_KEY_PREFIX", "ratelimit")),
)

app = FastAPI(title="genai-ratelimit example")
# Puts X-RateLimit-* on every allowed response, the streamed ones included.
app.add_middleware(RateLimitHeadersMiddleware)


@app.middleware("http")
async def api_key_auth(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """Identity for the limiter: request.state.user_id and request.state.tier."""
    authorization = request.headers.get("authorization")
    if authorization is not None:
        scheme, _, key = authorization.partition(" ")
        identity = API_KEYS.get(key.strip()) if scheme.lower() == "bearer" else None
        if identity is None:
            return JSONResponse({"detail": "Invalid API key"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        request.state.user_id, request.state.tier = identity
    return await call_next(request)


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatCompletionRequest(BaseModel):
    model: str = "demo-1"
    messages: list[ChatMessage]
    stream: bool = True


def _fake_completion(request: ChatCompletionRequest) -> list[str]:
    last = request.messages[-1].content if request.messages else ""
    return f"You said {len(last)} characters. Here is a thoughtful, entirely fake answer.".split(" ")


async def _stream_chunks(completion_id: str, model: str, words: list[str]) -> AsyncIterator[str]:
    for index, word in enumerate(words):
        chunk = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [{"index": 0, "delta": {"content": word if index == 0 else " " + word}}],
        }
        yield f"data: {json.dumps(chunk)}\n\n"
        await asyncio.sleep(0)  # a real model yields between tokens
    yield "data: [DONE]\n\n"


@app.post("/v1/chat/completions", dependencies=[Depends(rate_limit)])
async def chat_completions(body: ChatCompletionRequest) -> Response:
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    words = _fake_completion(body)
    if body.stream:
        return StreamingResponse(_stream_chunks(completion_id, body.model, words),
                                 media_type="text/event-stream")
    return JSONResponse({
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": " ".join(words)}}],
    })


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}
