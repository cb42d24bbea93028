"""A gateway you can copy: rate-limited forwarding to an OpenAI-compatible or Anthropic API.

POST /v1/chat/completions, /v1/responses and /v1/messages are forwarded to the upstream with
httpx, streamed or not (`forward_to_upstream`): the upstream's status, headers and body come
back untouched but for the limiter's own headers. Each request is admitted by a
`TokenRateLimit` (requests and tokens per tier, and requests in flight) before it reaches the
upstream, and is charged the usage the upstream reports (RateLimitHeadersMiddleware reads it
as the response passes; a streamed chat completion is made to carry it). A client that goes
away mid-stream closes the upstream connection and frees its in-flight slot.

Identity: the client's API key (`Authorization: Bearer ...` or `x-api-key`), which is passed
on to the upstream as it is. The limiter counts it as `key-<16 hex of its SHA-256>` (the key
itself is never written to Redis); `python app.py sk-...` prints that id. A request without
a key is answered 401 here and never counted.

Configuration, read at start-up (a missing or malformed value stops it, naming the variable):
    GATEWAY_UPSTREAM_URL            the upstream's base URL, e.g. https://api.openai.com
                                    (the request's path, /v1/..., is appended to it)
    GATEWAY_ANTHROPIC_UPSTREAM_URL  /v1/messages goes there instead (default: the one above),
                                    e.g. https://api.anthropic.com
    GATEWAY_KEY_TIERS               a JSON file {"key-<16 hex>": "pro", ...}; other keys: free
    GATEWAY_UPSTREAM_TIMEOUT        seconds to wait for the upstream's next bytes (default 600)
    GENAI_RATELIMIT_TIERS           the tiers file: budgets per tier (tiers.toml here)
    REDIS_URL                       the limiter's Redis (default redis://localhost:6379/0)

Run (docs/getting-started.md, "Your own gateway"):
    uvicorn app:app --app-dir examples/gateway --workers 2 --no-proxy-headers
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import Depends, FastAPI, HTTPException, Request, Response

from genai_ratelimit import AsyncRateLimiter
from genai_ratelimit.fastapi import RateLimitHeadersMiddleware, TokenRateLimit, forward_to_upstream


def key_id(api_key: str) -> str:
    """The identity an API key is counted under: never the key itself."""
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


if __name__ == "__main__":  # python app.py KEY...: the ids to put in GATEWAY_KEY_TIERS
    print("\n".join(key_id(key) for key in sys.argv[1:]))
    raise SystemExit(0)


def _environment(name: str, default: str | None = None, what: str = "") -> str:
    value = os.environ.get(name, "").strip() or default
    if value is None:
        raise SystemExit(f"gateway: {name} is not set ({what})")
    return value


def _key_tiers(path: str | None) -> dict[str, str]:
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as file:
            tiers = json.load(file)
    except (OSError, ValueError) as error:
        raise SystemExit(f"gateway: GATEWAY_KEY_TIERS={path}: {error}") from None
    if not isinstance(tiers, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in tiers.items()):
        raise SystemExit(f'gateway: GATEWAY_KEY_TIERS={path}: expected {{"key-<16 hex>": "<tier>", ...}}')
    return tiers


UPSTREAM_URL = _environment("GATEWAY_UPSTREAM_URL", what="the upstream's base URL, e.g. https://api.openai.com")
ANTHROPIC_UPSTREAM_URL = _environment("GATEWAY_ANTHROPIC_UPSTREAM_URL", UPSTREAM_URL)
KEY_TIERS = _key_tiers(os.environ.get("GATEWAY_KEY_TIERS") or None)
try:
    TIMEOUT = httpx.Timeout(float(_environment("GATEWAY_UPSTREAM_TIMEOUT", "600")), connect=10.0)
except ValueError as error:
    raise SystemExit(f"gateway: GATEWAY_UPSTREAM_TIMEOUT: {error}") from None

# One connection pool per upstream, per worker; a stream holds its connection while it runs.
LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
openai_upstream = httpx.AsyncClient(base_url=UPSTREAM_URL, timeout=TIMEOUT, limits=LIMITS)
anthropic_upstream = httpx.AsyncClient(base_url=ANTHROPIC_UPSTREAM_URL, timeout=TIMEOUT, limits=LIMITS)

# The budgets: the tiers file ($GENAI_RATELIMIT_TIERS, checked here: a malformed one stops the
# start-up). Both dependencies count in the same keys (one budget per key, whatever the API);
# each answers its 429s in its clients' SDK's shape.
limiter = AsyncRateLimiter()
openai_budget = TokenRateLimit(limiter)
anthropic_budget = TokenRateLimit(limiter, error_format="anthropic")


async def authenticate(request: Request) -> None:
    """Who is asking, for the limiter: request.state.user_id and request.state.tier. (async:
    it does no I/O, so it runs on the event loop, not in FastAPI's threadpool.)"""
    authorization = request.headers.get("authorization", "")
    scheme, _, bearer = authorization.partition(" ")
    api_key = request.headers.get("x-api-key") or (bearer.strip() if scheme.lower() == "bearer" else "")
    if not api_key:
        raise HTTPException(401, "an API key is required (Authorization: Bearer ... or x-api-key)")
    request.state.user_id = key_id(api_key)
    request.state.tier = KEY_TIERS.get(request.state.user_id, "free")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    await openai_upstream.aclose()
    await anthropic_upstream.aclose()
    await limiter.aclose()


app = FastAPI(title="genai-ratelimit gateway", lifespan=lifespan)
# Reconciles each request from the usage its response carries, writes the X-RateLimit-*
# headers and the 429s, frees the in-flight slots; checks the budgets at start-up.
app.add_middleware(RateLimitHeadersMiddleware)


@app.post("/v1/chat/completions", dependencies=[Depends(authenticate), Depends(openai_budget)])
async def chat_completions(request: Request) -> Response:
    return await forward_to_upstream(request, openai_upstream)


@app.post("/v1/responses", dependencies=[Depends(authenticate), Depends(openai_budget)])
async def responses(request: Request) -> Response:
    return await forward_to_upstream(request, openai_upstream)


@app.post("/v1/messages", dependencies=[Depends(authenticate), Depends(anthropic_budget)])
async def messages(request: Request) -> Response:
    return await forward_to_upstream(request, anthropic_upstream)


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}
