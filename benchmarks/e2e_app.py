"""The end-to-end benchmark's app: examples/app.py exactly as shipped, plus extra routes that
reuse its handler function behind the same middlewares:

- `POST /bench/unlimited/v1/chat/completions`: the handler without `Depends(rate_limit)`, so
  "limited vs unlimited" differs by the rate limiter and nothing else;
- `POST /bench/noop-sync-dependency/v1/chat/completions`: the handler behind a plain-`def`
  dependency that does nothing, i.e. what FastAPI's threadpool hop costs by itself (the app's
  sync `RateLimiter` dependency pays it on every request);
- `POST /bench/async/v1/chat/completions` (when genai_ratelimit.AsyncRateLimiter exists): the
  handler behind a `RateLimit` on an `AsyncRateLimiter` (same tiers, same identity rule), to
  show what the async dependency costs next to the app's own choice of limiter.

    uvicorn e2e_app:app --app-dir benchmarks

(run.py starts it with REDIS_URL, EXAMPLE_KEY_PREFIX and GENAI_RATELIMIT_TIERS set.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from fastapi import Depends, Request, Response  # noqa: E402

import genai_ratelimit  # noqa: E402
from app import app, chat_completions  # noqa: E402
from genai_ratelimit.fastapi import RateLimit  # noqa: E402

UNLIMITED_PATH = "/bench/unlimited/v1/chat/completions"
NOOP_SYNC_PATH = "/bench/noop-sync-dependency/v1/chat/completions"
ASYNC_PATH = "/bench/async/v1/chat/completions"

app.add_api_route(UNLIMITED_PATH, chat_completions, methods=["POST"])


def noop_sync_dependency(request: Request, response: Response) -> None:
    """Same signature as RateLimit.__call__, no work: FastAPI runs it in its threadpool."""


app.add_api_route(NOOP_SYNC_PATH, chat_completions, methods=["POST"],
                  dependencies=[Depends(noop_sync_dependency)])

if hasattr(genai_ratelimit, "AsyncRateLimiter"):
    _async_limit = RateLimit(limiter=genai_ratelimit.AsyncRateLimiter(
        key_prefix=os.environ.get("EXAMPLE_KEY_PREFIX", "ratelimit") + ":async"))
    app.add_api_route(ASYNC_PATH, chat_completions, methods=["POST"],
                      dependencies=[Depends(_async_limit)])
