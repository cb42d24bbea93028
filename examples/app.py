"""A small GenAI-style service protected by genai-ratelimit.

- API-key auth (a middleware) maps `Authorization: Bearer <key>` to a user id and a tier on
  `request.state`; no key means anonymous (limited by client address, free tier).
- `POST /v1/chat/completions` streams a fake completion (server-sent events, like OpenAI's
  API) or, with "stream": false, answers one JSON object. Protected by
  `Depends(rate_limit)`, a `TokenRateLimit`: each request reserves one request and its token
  estimate (max_tokens, else 1,000, plus the prompt's characters / 4) in one call, and is
  reconciled with the usage it reports: the JSON body's `usage`, the stream's final usage
  chunk (when the client asks `stream_options={"include_usage": true}`, as OpenAI does), or
  else `record_usage` called by the stream itself. The fake model writes `max_tokens` tokens
  when asked for them (a verbose model), else one short sentence; `pace_ms` slows it down
  (a pause between chunks, for the demo's long streams).
- Concurrency: at most 3 requests of a free user in flight at once (20 pro, 100 enterprise):
  a fourth gets 429 with `X-RateLimit-Window: concurrent` until one of them ends.
- `GET /healthz` is not limited, nor is `GET /metrics`: the limiter's counters (decisions,
  refusals by window, Redis latency, fail-opens) for Prometheus to scrape.

Run it (Redis from $REDIS_URL, else redis://localhost:6379/0):

    uvicorn app:app --app-dir examples --no-proxy-headers

or `make serve`, which also starts a throwaway redis-server. See examples/README.md.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field

from genai_ratelimit import AsyncRateLimiter
from genai_ratelimit.fastapi import RateLimitHeadersMiddleware, TokenRateLimit, record_usage
from genai_ratelimit.metrics import PrometheusCollector

# Demo keys. A real service looks keys up in its database.
API_KEYS: dict[str, tuple[str, str]] = {
    "sk-demo-free": ("user_free", "free"),
    "sk-demo-pro": ("user_pro", "pro"),
    "sk-demo-enterprise": ("user_enterprise", "enterprise"),
    "sk-demo-streamer": ("user_streamer", "free"),
}

# The limiter connects to $REDIS_URL. EXAMPLE_KEY_PREFIX gives `make demo` a fresh namespace
# on every run; a service keeps the default "ratelimit". Tier budgets: TIER_LIMITS, or the
# file named by $GENAI_RATELIMIT_TIERS (checked here, at start-up); token budgets:
# TIER_TOKEN_LIMITS, or that file's tokens_per_minute / tokens_per_day.
# max_in_flight: concurrent requests per user, per tier (a tiers file's max_in_flight wins);
# a slot is held until the response's last byte (or the client's disconnect), and a slot
# whose worker died frees itself after lease_seconds (default 300).
rate_limit = TokenRateLimit(
    limiter=AsyncRateLimiter(key_prefix=os.environ.get("EXAMPLE_KEY_PREFIX", "ratelimit")),
    max_in_flight={"free": 3, "pro": 20, "enterprise": 100},
)

# The limiter's counters, read at each scrape (nothing is added to a request's path).
metrics_registry = CollectorRegistry()
metrics_registry.register(PrometheusCollector({"chat": rate_limit.limiter}))

app = FastAPI(title="genai-ratelimit example")
# Puts X-RateLimit-* and OpenAI's x-ratelimit-* on every response, the streamed ones
# included, writes the OpenAI-style 429 body, and reconciles from the responses' usage.
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


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model: str = "demo-1"
    messages: list[ChatMessage]
    stream: bool = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream_options: StreamOptions | None = None
    pace_ms: int = Field(0, ge=0, le=5_000)  # the fake model's pause between chunks


def _fake_completion(request: ChatCompletionRequest) -> list[str]:
    """The answer's tokens (one word is one token here)."""
    asked = request.max_completion_tokens or request.max_tokens
    if asked:
        return ["token"] * asked
    last = request.messages[-1].content if request.messages else ""
    return f"You said {len(last)} characters. Here is a thoughtful, entirely fake answer.".split(" ")


def _usage(request: ChatCompletionRequest, words: list[str]) -> dict[str, int]:
    prompt_tokens = math.ceil(sum(len(message.content) for message in request.messages) / 4)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(words),
            "total_tokens": prompt_tokens + len(words)}


async def _stream_chunks(request: Request, body: ChatCompletionRequest, completion_id: str,
                         words: list[str]) -> AsyncIterator[str]:
    def chunk(choices: list[dict[str, object]], **extra: object) -> str:
        data = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body.model, "choices": choices, **extra}
        return f"data: {json.dumps(data)}\n\n"

    per_chunk = max(1, math.ceil(len(words) / 64))  # a long answer: several tokens a chunk
    for start in range(0, len(words), per_chunk):
        text = " ".join(words[start:start + per_chunk])
        yield chunk([{"index": 0, "delta": {"content": text if start == 0 else " " + text},
                      "finish_reason": None}])
        await asyncio.sleep(body.pace_ms / 1000)  # a real model yields between tokens
    yield chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}])
    usage = _usage(body, words)
    if body.stream_options is not None and body.stream_options.include_usage:
        # OpenAI's final usage chunk: the middleware reconciles the reservation from it.
        yield chunk([], usage=usage)
    else:
        # The client did not ask for it: the service reports the usage itself.
        await record_usage(request, usage["total_tokens"])
    yield "data: [DONE]\n\n"


@app.post("/v1/chat/completions", dependencies=[Depends(rate_limit)])
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    words = _fake_completion(body)
    if body.stream:
        return StreamingResponse(_stream_chunks(request, body, completion_id, words),
                                 media_type="text/event-stream")
    return JSONResponse({  # its usage is read by the middleware, which reconciles
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": " ".join(words)}}],
        "usage": _usage(body, words),
    })


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@app.get("/metrics")
async def metrics() -> Response:
    """Prometheus's text format: genai_ratelimit_decisions_total{limiter,outcome}, ..."""
    return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)
