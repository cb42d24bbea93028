"""FastAPI integration: a dependency that decides each request in one script execution
(minute, then day) and answers 429 with the headers and body clients expect (the OpenAI or
Anthropic SDKs' shapes, or the contract's plain one: `error_format`).

    from fastapi import Depends, FastAPI
    from genai_ratelimit.fastapi import RateLimitHeadersMiddleware, rate_limit

    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)   # headers on every response type

    @app.post("/v1/chat/completions", dependencies=[Depends(rate_limit)])
    async def chat(): ...

How the X-RateLimit-* headers reach an allowed response: the dependency records its decision
in the ASGI scope and also sets the headers on FastAPI's injected `Response`. FastAPI copies
those onto the responses it builds from a route's return value, but not onto a `Response` the
route returns itself (JSONResponse, StreamingResponse, ...). `RateLimitHeadersMiddleware`, a
pure ASGI middleware, closes that gap: it adds the recorded headers to the
`http.response.start` message of every response, without buffering a streamed body. Without
it, a warning is logged once per process.

Async by default: `rate_limit` and `RateLimit()` without a limiter use an `AsyncRateLimiter`
(from $REDIS_URL, made on the first request), so the dependency is an `async def` awaited on
the event loop, with no worker thread. Any async limiter (one whose `check_windows` is a
coroutine function, or that says `is_async = True`) gives the same. A blocking `RateLimiter`
passed explicitly gives a plain `def`, which FastAPI runs in its threadpool, so the event
loop never waits on Redis either way.

Identities and namespaces, so that no two budgets ever share a Redis key:

- anonymous: the client's network, "ip:<host>" (key ratelimit:ip:203.0.113.7:60), an IPv6
  client per /64 ("ip:2001:db8:1:2::/64"; genai_ratelimit.proxies.client_network);
- a user id (request.state.user_id, or what `identify` returns) is its own key
  (ratelimit:user_8421:60), unless it begins with one of the reserved prefixes "ip:", "user:"
  or "ns:": then it is stored as "user:<id>" (ratelimit:user:ip:203.0.113.7:60), so no user id
  can land in an anonymous bucket or in a namespace. An `identify` that wants the anonymous
  bucket returns `Anonymous(host)` (or what `default_identify` returns for an anonymous request);
- a namespace puts a budget's keys apart: "ns:<namespace>:<identity>"
  (ratelimit:ns:images:user_8421:60). The default budget (TIER_LIMITS, or the file named by
  $GENAI_RATELIMIT_TIERS) has none, so its keys are the contract's; a RateLimit with a budget
  of its own has none either unless `namespace=` names one (a budget's keys never depend on
  its numbers; two budgets on the same keys are refused at start-up, see _startup);
  dependencies that name the same namespace share one budget, on any route.
- On one route, dependencies that decide the same identity in the same namespace with the same
  budget (and the same Redis and key prefix) count the request once and share the decision.

Token budgets: `TokenRateLimit` (a companion of RateLimit; RateLimit itself is unchanged)
reserves one request and a token estimate in one `reserve` call before the route runs, and
reconciles the reservation with the usage the response reports (read by
RateLimitHeadersMiddleware as it passes) or that the route reports with
`await record_usage(request, tokens)`, once per request. Its responses also carry OpenAI's
x-ratelimit-*-requests/-tokens headers, and its 429s OpenAI's error body (_openai_headers).

Failing open: with on_unavailable="allow", `RateLimit.fail_open_count` counts the requests let
through because Redis could not decide; export it to your metrics and alert when it grows.

Shadow mode: `RateLimit(..., mode="shadow")` (and TokenRateLimit) decides and counts in
"shadow:" keys of its own but never refuses; its verdict goes out only as
X-RateLimit-Shadow-* headers (X-RateLimit-Shadow: would-refuse when it would have refused),
`shadow_count`, the limiter's metrics and a throttled log line.
IETF headers: `headers="ietf"` adds RateLimit-Policy and RateLimit (draft-ietf-httpapi-
ratelimit-headers-10, see genai_ratelimit.fastapi._ietf_headers) beside the contract's X-RateLimit-*.

The package's rooms: _plan (THE decision, I/O-free: a request's facts in, the limiter calls
it needs out, an outcome back; shared by RateLimit and TokenRateLimit), _answer (an outcome as
status, headers and body: every header family, shadow verdicts), _openai_headers and
_ietf_headers (the header families and bodies), _dependency and _tokens (each dependency's
facts, and the sync and asyncio drivers that run the plan's calls), _options (the shared
keywords), _clients (who a request is: networks, trusted proxies, its key identity;
genai_ratelimit.proxies is its public face), _usage (the token estimate, the usage of a JSON
body or an SSE stream), _middleware, _ledger (leases and token reservations of a request),
_scopes (upstream caps, route and model budgets), _startup (the start-up checks and
rate_limit_lifespan).

Requires the `fastapi` extra: pip install genai-ratelimit[fastapi].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

try:
    import fastapi as _fastapi  # noqa: F401  (the extra's presence, checked once here)
except ImportError as exc:  # the core package works without FastAPI; this package does not
    raise ImportError("genai_ratelimit.fastapi needs FastAPI: pip install 'genai-ratelimit[fastapi]'"
                      f" ({exc})") from exc

from ._clients import Anonymous, Identify, default_identify, key_identity
from ._dependency import RateLimit
from ._ledger import in_flight_lease, record_usage
from ._middleware import RateLimitHeadersMiddleware
from ._plan import window_name
from ._proxy import forward_to_upstream
from ._scopes import Upstream
from ._spend import SpendLevel
from ._startup import RateLimitConfigError, check_app, rate_limit_lifespan
from ._tokens import TokenRateLimit
from ._usage import estimate_openai_tokens

__all__ = [
    "Anonymous",
    "RateLimit",
    "RateLimitHeadersMiddleware",
    "TokenRateLimit",
    "SpendLevel",
    "Upstream",
    "record_usage",
    "in_flight_lease",
    "estimate_openai_tokens",
    "rate_limit",
    "Identify",
    "default_identify",
    "key_identity",
    "window_name",
    "rate_limit_lifespan",
    "check_app",
    "RateLimitConfigError",
    "forward_to_upstream",
]

if TYPE_CHECKING:
    rate_limit: RateLimit
    """The ready dependency: an async default limiter ($REDIS_URL, made on the first request),
    TIER_LIMITS or $GENAI_RATELIMIT_TIERS, default identity, 503 when Redis is unavailable."""

_ready: dict[str, RateLimit] = {}


def __getattr__(name: str) -> Any:
    """`rate_limit` is built on first use: importing this package reads no configuration
    ($GENAI_RATELIMIT_TIERS is read when `rate_limit` is first named)."""
    if name == "rate_limit":
        if name not in _ready:
            _ready[name] = RateLimit()
        return _ready[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
