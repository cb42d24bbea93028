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

- anonymous: the client address, "ip:<host>" (key ratelimit:ip:203.0.113.7:60);
- a user id (request.state.user_id, or what `identify` returns) is its own key
  (ratelimit:user_8421:60), unless it begins with one of the reserved prefixes "ip:", "user:"
  or "ns:": then it is stored as "user:<id>" (ratelimit:user:ip:203.0.113.7:60), so no user id
  can land in an anonymous bucket or in a namespace. An `identify` that wants the anonymous
  bucket returns `Anonymous(host)` (or what `default_identify` returns for an anonymous request);
- a namespace puts a budget's keys apart: "ns:<namespace>:<identity>"
  (ratelimit:ns:images:user_8421:60). The default budget (TIER_LIMITS, or the file named by
  $GENAI_RATELIMIT_TIERS) has none, so its keys are the contract's. A RateLimit with a budget
  of its own gets its own namespace, "budget-<digest of the budget>", unless `namespace=` names
  one; dependencies that name the same namespace share one budget, on any route.
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

Shadow mode: `RateLimit(..., mode="shadow")` (and TokenRateLimit) decides and counts as usual
but never refuses; what it would have refused runs with the 429's headers (not its retry
instructions) and X-RateLimit-Shadow: would-refuse, is counted in `shadow_count` and logged.
IETF headers: `headers="ietf"` adds RateLimit-Policy and RateLimit (draft-ietf-httpapi-
ratelimit-headers-10, see genai_ratelimit._ietf_headers) beside the contract's X-RateLimit-*.

Requires the `fastapi` extra: pip install genai-ratelimit[fastapi].
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

try:
    import anyio
    from fastapi import HTTPException, Request, Response
    from starlette.concurrency import run_in_threadpool
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as exc:  # the core package works without FastAPI; this module does not
    raise ImportError("genai_ratelimit.fastapi needs FastAPI: pip install 'genai-ratelimit[fastapi]'"
                      f" ({exc})") from exc

from . import RateLimiterError
from ._ietf_headers import HEADER_MODES, HeaderMode, PartitionKeys, Policy, ServiceLimit, ietf_headers
from ._openai_headers import (
    ERROR_FORMATS,
    UNAVAILABLE_MESSAGE,
    ErrorFormat,
    ResourceHeaders,
    error_body,
    family_headers,
    format_duration,
    refusal_message,
    retry_headers,
    too_large_error_body,
)
from ._tiers_config import (
    SCOPE_BUDGET_KEYS,
    TIER_BUDGET_KEYS,
    TierConfigError,
    max_in_flight_of_tiers,
    scope_sections_from_env,
    tier_limits_from_env,
    tier_max_in_flight_from_env,
    tier_token_limits_from_env,
    validate_scope_budget,
    validate_tier_limits,
    validate_token_limits,
)
from ._usage import UsageScanner, estimate_openai_tokens, requested_model
from .aio import AsyncRateLimiter
from .lease import DEFAULT_LEASE_SECONDS, Lease
from .limiter import RateLimiter
from .reservation import Reservation, Resource, WindowState
from .reservation import Scope as BudgetScope
from .tiers import DEFAULT_MAX_TOKENS, DEFAULT_TIER, TIER_LIMITS, TIER_TOKEN_LIMITS

__all__ = [
    "Anonymous",
    "RateLimit",
    "RateLimitHeadersMiddleware",
    "TokenRateLimit",
    "Upstream",
    "record_usage",
    "in_flight_lease",
    "estimate_openai_tokens",
    "rate_limit",
    "Identify",
    "default_identify",
    "key_identity",
    "window_name",
]

logger = logging.getLogger("genai_ratelimit")

Windows = tuple[tuple[int, int], ...]
Decision = tuple[bool, int, int, int]
Identify = Callable[[Request], "tuple[str, str | None]"]
OnUnavailable = Literal["deny", "allow"]
Mode = Literal["enforce", "shadow"]


class SyncWindowLimiter(Protocol):
    def check_windows(self, user_id: str, windows: Sequence[tuple[int, int]]) -> Decision: ...


class AsyncWindowLimiter(Protocol):
    def check_windows(self, user_id: str, windows: Sequence[tuple[int, int]]) -> Awaitable[Decision]: ...


# 0 is no window length: it stands for the in-flight cap (max_in_flight) in the headers.
CONCURRENT = 0
_WINDOW_NAMES = {CONCURRENT: "concurrent", 60: "minute", 86_400: "day"}


def window_name(window_seconds: int) -> str:
    """The X-RateLimit-Window value: "minute", "day", else e.g. "3600s"."""
    return _WINDOW_NAMES.get(window_seconds, f"{window_seconds}s")


class Anonymous(str):
    """The identity of an anonymous client: `Anonymous("203.0.113.7") == "ip:203.0.113.7"`.
    Only an Anonymous identity reaches the anonymous key space; a plain str that reads
    "ip:..." is a user id and is kept apart from it (see key_identity)."""

    __slots__ = ()

    def __new__(cls, host: str) -> Anonymous:
        return super().__new__(cls, f"ip:{host}")


# A user id beginning with one of these is stored as "user:<id>": they mark the anonymous
# key space ("ip:"), escaped user ids ("user:") and namespaces ("ns:").
_RESERVED_PREFIXES = ("ip:", "user:", "ns:")
_NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def key_identity(user_id: str, namespace: str | None = None) -> str:
    """What goes between the key prefix and the window in a Redis key:
    "ip:<host>" for an Anonymous identity; the user id itself, or "user:<id>" when it begins
    with "ip:", "user:" or "ns:"; and "ns:<namespace>:" in front of either when a namespace
    applies. Distinct (identity, namespace) pairs never give the same string."""
    if isinstance(user_id, Anonymous):
        identity = str(user_id)
    elif user_id.startswith(_RESERVED_PREFIXES):
        identity = f"user:{user_id}"
    else:
        identity = user_id
    return identity if namespace is None else f"ns:{namespace}:{identity}"


def default_identify(request: Request) -> tuple[str, str | None]:
    """The contract's identity rule: request.state.user_id (set by the app's auth), else the
    client address, Anonymous(host) == "ip:<host>"; tier from request.state.tier. Never query
    parameters or client headers. (Behind a reverse proxy, request.client is what the ASGI
    server reports: configure its trusted proxies, e.g. uvicorn --forwarded-allow-ips.)"""
    user_id = getattr(request.state, "user_id", None)
    if user_id is None or user_id == "":
        client = request.client
        user_id = Anonymous(client.host if client is not None and client.host else "unknown")
    return user_id, getattr(request.state, "tier", None)


def _budget_namespace(tier_limits: Mapping[str, Mapping[str, Any]]) -> str:
    """The default namespace of a budget other than the default one: stable across processes
    and restarts (the same budget gives the same name), different for different budgets."""
    canonical = json.dumps(tier_limits, sort_keys=True, separators=(",", ":"))
    return "budget-" + hashlib.sha256(canonical.encode()).hexdigest()[:12]


def _is_default_budget(tier_limits: Mapping[str, Mapping[str, int]]) -> bool:
    """Whether these are the budgets `rate_limit` uses: TIER_LIMITS, or the tiers file."""
    if tier_limits == validate_tier_limits(TIER_LIMITS):
        return True
    try:
        from_env = tier_limits_from_env()
    except TierConfigError:
        return False
    return from_env is not None and tier_limits == validate_tier_limits(from_env)


# --- getting the headers onto every response ----------------------------------------------

_SCOPE_KEY = "genai_ratelimit.decision"
# The allowed decisions already taken for this request, by (key space, key identity, windows):
# a second dependency that would count the same request in the same keys reuses the decision.
_COUNTED_KEY = "genai_ratelimit.counted"
# The ids of the shared decisions shadow mode already counted as would-refuse for this request.
_SHADOWED_KEY = "genai_ratelimit.shadowed"
# This package's own check_windows: RateLimit may ask their detailed twin instead (_decide).
_STOCK_CHECK_WINDOWS = (RateLimiter.check_windows, AsyncRateLimiter.check_windows)


class _AllowedDecision:
    """The tightest allowed decision of this request (several RateLimit dependencies on one
    route keep the one with the fewest remaining; ties: the shorter window). Lives in the ASGI
    scope; the middleware puts it there before the app runs, so shallow scope copies share it."""

    __slots__ = ("limit", "remaining", "window_seconds", "extra")

    def __init__(self) -> None:
        self.limit = 0
        self.remaining = -1  # -1: nothing recorded yet
        self.window_seconds = 0
        # OpenAI's x-ratelimit-*-requests/-tokens of an allowed TokenRateLimit decision.
        self.extra: list[tuple[str, str]] = []

    def offer(self, limit: int, remaining: int, window_seconds: int) -> None:
        if self.remaining < 0 or (remaining, window_seconds) < (self.remaining, self.window_seconds):
            self.limit, self.remaining, self.window_seconds = limit, remaining, window_seconds

    def headers(self) -> list[tuple[str, str]]:
        if self.remaining < 0:
            return list(self.extra)
        return [
            ("x-ratelimit-limit", str(self.limit)),
            ("x-ratelimit-remaining", str(self.remaining)),
            ("x-ratelimit-window", window_name(self.window_seconds)),
            *self.extra,
        ]


# The token reservations of this request and whether its usage was reported.
_TOKENS_KEY = "genai_ratelimit.tokens"


class _TokenLedger:
    """The token reservations of one request (one per TokenRateLimit that allowed it), kept
    in the ASGI scope until the usage is known. `reported` makes the reconcile happen once:
    by record_usage, or by the middleware from the response, whichever comes first."""

    __slots__ = ("entries", "decided", "reported", "refusal_body", "middleware")

    def __init__(self, middleware: bool) -> None:
        self.entries: list[tuple[Any, bool, Reservation]] = []  # (limiter, is async, reservation)
        self.decided = False  # a TokenRateLimit ran for this request
        self.reported = False
        self.refusal_body: dict[str, Any] | None = None  # the OpenAI-style body of our 429
        self.middleware = middleware  # False: made by a dependency, nothing reads the response

    async def reconcile(self, actual: int) -> int:
        """Reconciles every reservation with `actual` tokens. Returns the number of windows
        whose entry was found. A limiter that cannot answer is logged, not raised: the
        reservation then stays as reserved."""
        found = 0
        for limiter, is_async, reservation in self.entries:
            try:
                if is_async:
                    found += await limiter.reconcile(reservation, actual)
                else:
                    found += await run_in_threadpool(limiter.reconcile, reservation, actual)
            except RateLimiterError as exc:
                logger.warning("could not reconcile the token reservation of %r with %d tokens "
                               "(it stays at %s): %s", reservation.user_id, actual,
                               reservation.tokens, exc)
        return found


# The in-flight leases of this request (RateLimit's max_in_flight).
_LEASES_KEY = "genai_ratelimit.leases"


class _LeaseLedger:
    """The in-flight leases of one request, kept in the ASGI scope by the middleware, which
    releases them once the response is over: before its last body message is passed on
    (so a client that has read the whole response finds its slot free again), or when the
    app returns or raises without one (the client disconnected, the route failed, the task
    was cancelled). Each lease is released once; a worker killed before that leaves its
    leases to expire after lease_seconds."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        # (key of the limiter's key space and identity, limiter, is async, lease)
        self.entries: list[tuple[tuple[object, ...], Any, bool, Lease]] = []

    def holds(self, key: tuple[object, ...]) -> bool:
        return any(entry[0] == key for entry in self.entries)

    async def release_all(self) -> None:
        """Releases every lease, shielded from cancellation (a cancelled request must still
        give its slots back). A limiter that cannot answer is logged, not raised: that lease
        then expires on its own."""
        entries, self.entries = self.entries, []
        if not entries:
            return
        with anyio.CancelScope(shield=True):
            for _, limiter, is_async, lease in entries:
                try:
                    if is_async:
                        await limiter.release(lease)
                    else:
                        await run_in_threadpool(limiter.release, lease)
                except RateLimiterError as exc:
                    logger.warning("could not release the in-flight lease of %r (it expires on its "
                                   "own within %d s): %s", lease.user_id, lease.lease_seconds, exc)


class RateLimitHeadersMiddleware:
    """Pure ASGI middleware: adds the X-RateLimit-* headers of an allowed request to whatever
    response the route produced (StreamingResponse and JSONResponse included). A header the
    response already has (a 429's own, or one the route set) is left as it is.

        app.add_middleware(RateLimitHeadersMiddleware)

    For a TokenRateLimit it also adds OpenAI's x-ratelimit-*-requests/-tokens headers, gives
    its 429 the OpenAI-style body (the contract's `detail` plus an `error` object), and
    reconciles the token reservation with the usage the response reports: a JSON body's
    `usage.total_tokens`, or a server-sent event stream's last `data:` chunk carrying `usage`.
    Each chunk is forwarded as it comes (a stream is scanned, never held back); the
    reconcile runs before the response's last body message (or the stream's `data: [DONE]`
    chunk) is passed on, so a client that has read the whole response sees the corrected
    budget. Unless the route already called
    record_usage: each request is reconciled at most once. No usage found: the reservation
    stays as it was (never a silent refund).

    It also releases the in-flight leases of RateLimit's max_in_flight: once the response's
    last body message is due (before it is passed on), or when the app ends without one (a
    client that disconnected mid-stream, an exception, a cancelled task). max_in_flight
    needs this middleware.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        decision = _AllowedDecision()
        scope[_SCOPE_KEY] = decision
        ledger = _TokenLedger(middleware=True)
        scope[_TOKENS_KEY] = ledger
        leases = _LeaseLedger()
        scope[_LEASES_KEY] = leases
        scanner: UsageScanner | None = None
        replaced_body = False  # a TokenRateLimit 429 whose body this middleware wrote

        async def send_with_headers(message: Message) -> None:
            nonlocal scanner, replaced_body
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                extra = decision.headers()
                if extra:
                    present = {bytes(name).lower() for name, _ in headers}
                    headers += [(name.encode("latin-1"), value.encode("latin-1"))
                                for name, value in extra if name.encode("latin-1") not in present]
                    message = {**message, "headers": headers}
                if ledger.refusal_body is not None and message["status"] in (429, 503):
                    body = json.dumps(ledger.refusal_body).encode()
                    headers = [(name, value) for name, value in headers
                               if bytes(name).lower() not in (b"content-length", b"content-type")]
                    headers += [(b"content-length", str(len(body)).encode()),
                                (b"content-type", b"application/json")]
                    await send({**message, "headers": headers})
                    await leases.release_all()
                    await send({"type": "http.response.body", "body": body, "more_body": False})
                    replaced_body = True
                    return
                if ledger.entries and not ledger.reported:
                    found = {bytes(name).lower(): bytes(value).decode("latin-1") for name, value in headers}
                    scanner = UsageScanner.for_response(found.get(b"content-type", ""),
                                                        found.get(b"content-encoding", ""))
            elif message["type"] == "http.response.body":
                if replaced_body:
                    return  # the 429 body FastAPI wrote, replaced by ours
                if scanner is not None:
                    scanner.feed(message.get("body", b""))
                    if scanner.done or not message.get("more_body", False):
                        # The end of the body, or of the stream's events ("data: [DONE]",
                        # where OpenAI's clients stop reading): reconcile before passing it on.
                        total, scanner = scanner.total_tokens(), None
                        if total is not None and not ledger.reported:
                            ledger.reported = True
                            await ledger.reconcile(total)
                if not message.get("more_body", False):
                    await leases.release_all()  # the response is complete: its slots are free
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            # No last body message went out (disconnected, failed, cancelled): release now.
            await leases.release_all()


_warned_no_middleware = False


def _record_allowed(request: Request, response: Response, limit: int, remaining: int,
                    window_seconds: int) -> None:
    global _warned_no_middleware
    decision = request.scope.get(_SCOPE_KEY)
    if not isinstance(decision, _AllowedDecision):
        decision = _AllowedDecision()  # no middleware: only the sub-response carries it
        request.scope[_SCOPE_KEY] = decision
        if not _warned_no_middleware:
            _warned_no_middleware = True
            logger.warning(
                "RateLimitHeadersMiddleware is not installed: X-RateLimit-* headers reach only "
                "responses FastAPI builds from a route's return value, not a Response the route "
                "returns itself (StreamingResponse, JSONResponse). Add "
                "app.add_middleware(genai_ratelimit.fastapi.RateLimitHeadersMiddleware).")
    decision.offer(limit, remaining, window_seconds)
    for name, value in decision.headers():
        response.headers[name] = value


# --- scopes: upstream caps, route and model budgets ----------------------------------------


def _scope_of(name: str, budget: Mapping[str, int], shared: bool, tokens: bool
              ) -> BudgetScope | None:
    """The Scope of a budget (SCOPE_BUDGET_KEYS); its token windows only when `tokens` (a
    RateLimit charges no tokens). None when nothing of it applies."""
    windows = [(budget[key], seconds) for key, (seconds, is_tokens) in SCOPE_BUDGET_KEYS.items()
               if key in budget and not is_tokens]
    token_windows = [(budget[key], seconds)
                     for key, (seconds, is_tokens) in SCOPE_BUDGET_KEYS.items()
                     if key in budget and is_tokens and tokens]
    if not windows and not token_windows:
        return None
    return BudgetScope(name, windows=windows, token_windows=token_windows, shared=shared)


@dataclass(frozen=True)
class Upstream:
    """An upstream provider's caps (e.g. provider + model), shared by every user: all users
    together stay below them. Decided in the same script as each user's own budget, so a
    request the cap refuses costs the user nothing, and one the user's budget refuses costs
    the cap nothing. Keys: {prefix}:{name}:{window}[:tokens]:shared.

    models: the request `model`s this upstream serves; empty: every request of the
    dependency. The token caps count in TokenRateLimit only."""

    name: str
    per_minute: int | None = None
    per_day: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"an Upstream's name must be a non-empty str, got {self.name!r}")
        validate_scope_budget(self.budget(), "Upstream", repr(self.name))
        if isinstance(self.models, str) or not all(isinstance(m, str) and m for m in self.models):
            raise TypeError("models must be a sequence of model names (non-empty str)")
        object.__setattr__(self, "models", tuple(self.models))
        BudgetScope(self.name, windows=[(1, 60)])  # the name's own checks (length, UTF-8)

    def budget(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in SCOPE_BUDGET_KEYS
                if getattr(self, key) is not None}

    def scope(self, tokens: bool = True) -> BudgetScope | None:
        """Its Scope (shared); the token caps only when `tokens`. None when none applies."""
        return _scope_of(self.name, self.budget(), True, tokens)


UpstreamOf = Callable[[Request], "Upstream | None | Awaitable[Upstream | None]"]


class _Scopes:
    """What a dependency decides besides the user's tier budget: a route budget, per-model
    budgets (from the request's JSON `model`) and upstream caps (fixed, by model, or from a
    callable). Built at start-up; `of(request)` gives one request's Scopes."""

    def __init__(self, upstream: Upstream | Sequence[Upstream] | UpstreamOf | None,
                 route_limits: Mapping[str, int] | None,
                 model_limits: Mapping[str, Mapping[str, int]] | None,
                 from_file: bool, tokens: bool) -> None:
        self.tokens = tokens
        self.upstreams: tuple[Upstream, ...] = ()
        self.upstream_of: UpstreamOf | None = None
        if isinstance(upstream, Upstream):
            self.upstreams = (upstream,)
        elif callable(upstream):
            self.upstream_of = upstream
        elif upstream is not None:
            if isinstance(upstream, (str, bytes)) or not isinstance(upstream, Sequence) or \
                    not all(isinstance(u, Upstream) for u in upstream):
                raise TypeError("upstream must be an Upstream, a sequence of Upstream or a "
                                f"callable taking the request, not {type(upstream).__name__}")
            self.upstreams = tuple(upstream)
        self.route_budget = (None if route_limits is None else
                             validate_scope_budget(route_limits, "route_limits", "the route"))
        self.model_budgets = {
            str(model): validate_scope_budget(budget, "model_limits", f"model {model!r}")
            for model, budget in (model_limits or {}).items()}
        if from_file and upstream is None and model_limits is None:
            sections = scope_sections_from_env()
            if sections is not None:
                models, upstreams = sections
                self.model_budgets = models
                self.upstreams = tuple(
                    Upstream(name, **budget, models=served)
                    for name, (budget, served) in upstreams.items())
        names = [u.name for u in self.upstreams]
        if len(set(names)) != len(names):
            raise ValueError(f"two upstreams share a name: {sorted(names)}")
        if not tokens:
            for what, budget in (("route_limits", self.route_budget),
                                 *((f"model_limits[{m!r}]", b) for m, b in (model_limits or {}).items())):
                if budget and any(SCOPE_BUDGET_KEYS[key][1] for key in budget):
                    raise ValueError(f"{what}: token budgets need TokenRateLimit (a RateLimit "
                                     "charges no tokens)")
        self.reads_model = bool(self.model_budgets) or any(u.models for u in self.upstreams)

    def __bool__(self) -> bool:
        return bool(self.upstreams or self.upstream_of or self.route_budget or self.model_budgets)

    @staticmethod
    def route_of(request: Request) -> str:
        """The route's path template (/items/{id}): never the request's own path, which the
        client chooses (one budget, and one key, per path it invents). "*" when FastAPI
        matched no route (a dependency always runs on one)."""
        path = getattr(request.scope.get("route"), "path", None)
        return path if isinstance(path, str) and path else "*"

    async def of(self, request: Request) -> tuple[BudgetScope, ...]:
        found: list[BudgetScope | None] = []
        if self.route_budget:
            found.append(_scope_of(f"route:{self.route_of(request)}", self.route_budget, False,
                                   self.tokens))
        model = requested_model(await request.body()) if self.reads_model else None
        if model is not None and model in self.model_budgets:
            found.append(_scope_of(f"model:{model}", self.model_budgets[model], False,
                                   self.tokens))
        upstreams = [u for u in self.upstreams if not u.models or model in u.models]
        if self.upstream_of is not None:
            chosen = self.upstream_of(request)
            if inspect.isawaitable(chosen):
                chosen = await chosen
            if chosen is not None and not isinstance(chosen, Upstream):
                raise TypeError(f"upstream(request) must return an Upstream or None, "
                                f"not {type(chosen).__name__}")
            if chosen is not None:
                upstreams.append(chosen)
        found += [u.scope(self.tokens) for u in upstreams]
        return tuple(scope for scope in found if scope is not None)


def _scope_kind(scope: BudgetScope) -> str:
    """X-RateLimit-Scope of a refusal by this scope: upstream, route or model."""
    return "upstream" if scope.shared else scope.name.split(":", 1)[0]


# --- the dependency ------------------------------------------------------------------------


def _is_async_limiter(limiter: object) -> bool:
    flag = getattr(limiter, "is_async", None)
    if isinstance(flag, bool):
        return flag
    return inspect.iscoroutinefunction(getattr(limiter, "check_windows", None))


class RateLimit:
    """A FastAPI dependency: `Depends(RateLimit(...))`, or the ready `rate_limit`.

    limiter        a RateLimiter or an AsyncRateLimiter; None: an AsyncRateLimiter() created on
                   the first request (it reads $REDIS_URL, else redis://localhost:6379/0).
    tier_limits    {"free": {"per_minute": 5, "per_day": 100}, ...}; None: the file named by
                   $GENAI_RATELIMIT_TIERS when set, else TIER_LIMITS. Checked here, at start-up.
    identify       identify(request) -> (user_id, tier), replacing default_identify.
    on_unavailable "deny": HTTP 503 + Retry-After: 1 when Redis cannot decide; "allow": let the
                   request through, log a warning and count it in fail_open_count.
    namespace      the name of the budget's key space (1-64 of A-Z a-z 0-9 _ . -): keys become
                   {prefix}:ns:{namespace}:{identity}:{window}, and every RateLimit naming it
                   draws on one budget. None: no namespace for the default budget (TIER_LIMITS
                   or the tiers file: the contract's keys), "budget-<digest>" for any other.

    Keyword-only (see genai_ratelimit._openai_headers for the shapes):

    error_format   "openai" (default): 429/503 bodies carry OpenAI's `error` object beside the
                   contract's `detail`, responses OpenAI's x-ratelimit-*-requests headers;
                   "anthropic": Anthropic's {"type": "error", "error": {...}} and its
                   anthropic-ratelimit-* headers; "plain": the contract's body and headers only.
                   The bodies need RateLimitHeadersMiddleware (without it: {"detail": ...}).
    max_client_wait_seconds
                   a 429 whose wait is longer says x-should-retry: false (the SDKs then give
                   up at once instead of sleeping); true otherwise. Default 300.
    unavailable_log_interval
                   at most one warning per this many seconds while Redis is unavailable, with
                   the count of requests it covers. Default 60.
    log_user_ids   False: that warning (and the shadow one) names no user.
    mode           "enforce" (default): refuse what the budget refuses. "shadow": decide and
                   count exactly as usual, but never refuse: a request the budget would
                   refuse runs, its response carries the 429's headers except the retry
                   instructions (Retry-After, retry-after-ms, x-should-retry) plus
                   X-RateLimit-Shadow: would-refuse, it is counted in shadow_count and a
                   warning says so (at most one per shadow_log_interval seconds, default 60).
    headers        "contract" (default): the contract's X-RateLimit-* (and the error
                   format's family). "ietf" or "both" (the same): those, plus the IETF
                   draft's RateLimit-Policy and RateLimit fields (genai_ratelimit._ietf_headers).
    partition_key_secret
                   the secret of the IETF fields' partition keys (pk), an HMAC of the
                   identity: None reads $GENAI_RATELIMIT_PARTITION_KEY_SECRET, else a random
                   secret of this process (keys then differ between workers).
    upstream       an Upstream (a provider's caps, shared by every user), a list of them (each
                   for the request `model`s it lists, or every request), or a callable
                   upstream(request) -> Upstream | None (sync or async).
    route_limits   {"per_minute": 2, "per_day": 50}: each user's own budget on the routes of
                   this instance, beside the tier's (keys: scope=route:<path template>).
    model_limits   {"gpt-4o": {"per_minute": 20}}: each user's budget per request `model` (read
                   from the JSON body). TokenRateLimit also takes tokens_per_minute/_day keys.
                   With any of the three (or the tiers file's [models]/[upstreams]) the
                   decision is one `reserve` over the tier's windows and the request's scopes,
                   and the dependency is an async def; see docs/scopes.md, "In FastAPI", for
                   the 429s (X-RateLimit-Scope).
    max_in_flight  {tier: n}: at most n requests of one identity in flight at once, for the
                   tiers whose budget (tier_limits, or the tiers file) gives no
                   "max_in_flight" of its own; a tier with neither has no concurrency limit
                   (and costs no extra round trip). Needs RateLimitHeadersMiddleware.
    lease_seconds  how long an in-flight slot stays taken when its release never comes (a
                   worker killed mid-request): default 300 (DEFAULT_LEASE_SECONDS). A request
                   that may run longer renews its lease: in_flight_lease(request).renew()
                   (awaited with an AsyncRateLimiter).

    In-flight slots (max_in_flight): before the windows are decided, the request takes one
    of its identity's slots (`acquire`, one script execution); the middleware gives it back
    when the response's last byte is due, or when the client disconnected or the route
    failed. Refused: 429 with X-RateLimit-Window: concurrent, X-RateLimit-Limit: the cap,
    and Retry-After: the time until the soonest slot's lease expires, an upper bound (a
    request that finishes frees its slot sooner). A request refused for concurrency is
    not counted in the windows. In shadow mode a request beyond the cap runs without a slot and
    is counted, logged and marked as would-refuse like a window refusal.

    The decision is one `check_windows` call; the WindowDecision it answers carries the
    exact wait (retry_after_ms) that retry-after-ms reports.

    An async limiter (the default) gives an instance of a subclass whose __call__ is async,
    awaited on the event loop; a blocking limiter gives an instance whose __call__ is a plain
    def (FastAPI's threadpool).
    """

    def __new__(cls, limiter: SyncWindowLimiter | AsyncWindowLimiter | None = None,
                *args: Any, **kwargs: Any) -> RateLimit:
        # Scopes may read the body (a model's budget): an async def, the blocking limiter's
        # calls then in the threadpool.
        scoped = any(kwargs.get(key) is not None
                     for key in ("upstream", "route_limits", "model_limits"))
        if not scoped and (args[:1] or [kwargs.get("tier_limits")])[0] is None:
            try:
                sections = scope_sections_from_env()
            except TierConfigError:
                sections = None  # __init__ says what is wrong
            scoped = sections is not None and any(sections)
        if cls is RateLimit and (limiter is None or _is_async_limiter(limiter) or scoped):
            cls = _AsyncRateLimit
        return super().__new__(cls)

    def __init__(
        self,
        limiter: SyncWindowLimiter | AsyncWindowLimiter | None = None,
        tier_limits: Mapping[str, Mapping[str, int]] | None = None,
        identify: Identify | None = None,
        on_unavailable: OnUnavailable = "deny",
        namespace: str | None = None,
        *,
        error_format: ErrorFormat = "openai",
        max_client_wait_seconds: float = 300.0,
        unavailable_log_interval: float = 60.0,
        log_user_ids: bool = True,
        mode: Mode = "enforce",
        shadow_log_interval: float = 60.0,
        headers: HeaderMode = "contract",
        partition_key_secret: str | bytes | None = None,
        max_in_flight: Mapping[str, int] | None = None,
        lease_seconds: int = DEFAULT_LEASE_SECONDS,
        upstream: Upstream | Sequence[Upstream] | UpstreamOf | None = None,
        route_limits: Mapping[str, int] | None = None,
        model_limits: Mapping[str, Mapping[str, int]] | None = None,
    ) -> None:
        if mode not in ("enforce", "shadow"):
            raise ValueError(f"mode must be 'enforce' or 'shadow', got {mode!r}")
        if headers not in HEADER_MODES:
            raise ValueError(f"headers must be 'contract', 'ietf' or 'both', got {headers!r}")
        if error_format not in ERROR_FORMATS:
            raise ValueError(f"error_format must be 'openai', 'anthropic' or 'plain', got {error_format!r}")
        for name, number in (("max_client_wait_seconds", max_client_wait_seconds),
                             ("unavailable_log_interval", unavailable_log_interval),
                             ("shadow_log_interval", shadow_log_interval)):
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise TypeError(f"{name} must be a number of seconds, not {type(number).__name__}")
            if not number >= 0:
                raise ValueError(f"{name} must be >= 0, got {number!r}")
        if not isinstance(log_user_ids, bool):
            raise TypeError(f"log_user_ids must be a bool, not {type(log_user_ids).__name__}")
        self.error_format: ErrorFormat = error_format
        self.max_client_wait_seconds = float(max_client_wait_seconds)
        self.unavailable_log_interval = float(unavailable_log_interval)
        self.log_user_ids = log_user_ids
        self._unavailable_log = _LogThrottle(self.unavailable_log_interval)
        self.mode: Mode = mode
        self.headers: HeaderMode = headers
        self._shadow_log = _LogThrottle(float(shadow_log_interval))
        self._shadow_count = 0
        self._partition_keys: PartitionKeys | None = None
        if headers != "contract":
            self._partition_keys = PartitionKeys(partition_key_secret)
            if self._partition_keys.per_process:
                logger.warning(
                    "RateLimit(headers=%r) has no partition_key_secret (nor $%s): the IETF "
                    "RateLimit fields' partition keys come from a random secret of this process, "
                    "so they differ between workers and restarts", headers,
                    "GENAI_RATELIMIT_PARTITION_KEY_SECRET")
        if namespace is not None:
            if not isinstance(namespace, str):
                raise TypeError(f"namespace must be a str or None, not {type(namespace).__name__}")
            if not _NAMESPACE_PATTERN.fullmatch(namespace):
                raise ValueError("namespace must be 1 to 64 of the characters A-Z a-z 0-9 _ . -, "
                                 f"got {namespace!r}")
        if on_unavailable not in ("deny", "allow"):
            raise ValueError(f"on_unavailable must be 'deny' or 'allow', got {on_unavailable!r}")
        if identify is not None and not callable(identify):
            raise TypeError(f"identify must be a callable taking the request, not {type(identify).__name__}")
        if limiter is not None and not callable(getattr(limiter, "check_windows", None)):
            raise TypeError(
                f"limiter must be a RateLimiter or AsyncRateLimiter, not {type(limiter).__name__}")
        from_file = tier_limits is None
        if isinstance(lease_seconds, bool) or not isinstance(lease_seconds, int):
            raise TypeError(f"lease_seconds must be an int, not {type(lease_seconds).__name__}")
        if lease_seconds < 1:
            raise ValueError(f"lease_seconds must be >= 1, got {lease_seconds}")
        self.lease_seconds = lease_seconds
        if tier_limits is None:
            tiers_in_flight = tier_max_in_flight_from_env() or {}
            tier_limits = tier_limits_from_env() or TIER_LIMITS
        else:
            tiers_in_flight = max_in_flight_of_tiers(tier_limits)
        self.tier_limits: dict[str, dict[str, int]] = validate_tier_limits(tier_limits)
        self._scopes = _Scopes(upstream, route_limits, model_limits, from_file,
                               tokens=isinstance(self, TokenRateLimit))
        self._limiter_is_async = limiter is None or _is_async_limiter(limiter)
        if max_in_flight is not None and not isinstance(max_in_flight, Mapping):
            raise TypeError(f"max_in_flight must be a mapping of tier to int, not "
                            f"{type(max_in_flight).__name__}")
        defaults: dict[str, int] = {}
        for tier, cap in (max_in_flight or {}).items():
            if isinstance(cap, bool) or not isinstance(cap, int):
                raise TypeError(f"max_in_flight[{tier!r}] must be an int, not {type(cap).__name__}")
            if cap < 1:
                raise ValueError(f"max_in_flight[{tier!r}] must be >= 1, got {cap}")
            if tier in self.tier_limits:  # a tier the budget does not know never applies
                defaults[tier] = cap
        # Per tier, the most requests of one identity in flight at once (absent: no cap).
        self.max_in_flight: dict[str, int] = {**defaults, **tiers_in_flight}
        if self.max_in_flight and limiter is not None and not (
                callable(getattr(limiter, "acquire", None)) and callable(getattr(limiter, "release", None))):
            raise TypeError(f"max_in_flight needs a limiter with acquire() and release() "
                            f"(RateLimiter, AsyncRateLimiter), not {type(limiter).__name__}")
        # Per tier, the (limit, window_seconds) pairs of one check_windows call, shortest first.
        self._windows: dict[str, Windows] = {
            tier: tuple((budget[key], seconds) for key, seconds in TIER_BUDGET_KEYS.items())
            for tier, budget in self.tier_limits.items()
        }
        if namespace is None and not _is_default_budget(self.tier_limits):
            namespace = _budget_namespace(self.tier_limits)
        self.namespace: str | None = namespace
        self.identify: Identify = identify or default_identify
        self.on_unavailable: OnUnavailable = on_unavailable
        self._limiter = limiter
        self._limiter_lock = threading.Lock()
        self._fail_open_count = 0
        self._fail_open_lock = threading.Lock()  # the threadpool may fail open in parallel

    @property
    def limiter(self) -> Any:
        """The limiter; the default one, an AsyncRateLimiter, is created on first use."""
        if self._limiter is None:
            with self._limiter_lock:
                if self._limiter is None:
                    self._limiter = AsyncRateLimiter()
        return self._limiter

    @property
    def fail_open_count(self) -> int:
        """How many requests on_unavailable="allow" let through because the limiter could not
        decide (Redis unreachable, timed out, answering garbage). Always 0 with "deny". For
        alerting: each one is a request that was never counted against any budget."""
        return self._fail_open_count

    @property
    def shadow_count(self) -> int:
        """How many requests mode="shadow" let through that the budget would have refused
        (each request once). Always 0 with mode="enforce"."""
        return self._shadow_count

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(limiter={self._limiter!r}, tiers={sorted(self.tier_limits)}, "
                f"on_unavailable={self.on_unavailable!r}, namespace={self.namespace!r})")

    def _identity_and_tier(self, request: Request) -> tuple[str, str]:
        """(key identity, the tier whose budget applies: DEFAULT_TIER for none or unknown)."""
        user_id, tier = self.identify(request)
        if isinstance(user_id, int) and not isinstance(user_id, bool):
            user_id = str(user_id)
        if not isinstance(user_id, str) or not user_id:
            raise TypeError(f"the rate-limit identity must be a non-empty str, got {user_id!r}")
        budget_tier = tier if isinstance(tier, str) and tier in self._windows else DEFAULT_TIER
        return key_identity(user_id, self.namespace), budget_tier

    def _counted_key(self, identity: str, windows: Windows) -> tuple[object, ...]:
        """Which keys a check of `identity` would count in: the limiter's Redis and key prefix
        (the limiter object itself when it does not say), the identity and the budget."""
        limiter = self.limiter
        url, prefix = getattr(limiter, "url", None), getattr(limiter, "key_prefix", None)
        space: tuple[object, ...] = (url, prefix) if isinstance(url, str) and isinstance(prefix, str) \
            else (id(limiter),)
        return (*space, identity, windows)

    def _already_counted(self, request: Request, identity: str, windows: Windows) -> Decision | None:
        counted = request.scope.get(_COUNTED_KEY)
        return counted.get(self._counted_key(identity, windows)) if isinstance(counted, dict) else None

    def _remember(self, request: Request, identity: str, windows: Windows, decision: Decision) -> None:
        request.scope.setdefault(_COUNTED_KEY, {})[self._counted_key(identity, windows)] = decision

    def _apply(self, request: Request, response: Response, windows: Windows, decision: Decision,
               retry_after_ms: int, now_ms: int, *, identity: str) -> None:
        """Raises the 429 (in shadow mode: records it as would-refuse), or records the allowed
        decision's headers."""
        allowed, remaining, retry_after_s, window_seconds = decision
        limit = next((lim for lim, seconds in windows if seconds == window_seconds), windows[0][0])
        if not allowed:
            refusal = [
                ("X-RateLimit-Limit", str(limit)),
                ("X-RateLimit-Remaining", "0"),
                ("X-RateLimit-Window", window_name(window_seconds)),
                *family_headers(self.error_format, now_ms,
                                ResourceHeaders("requests", limit, 0, retry_after_ms)),
                *self._ietf_fields(identity, windows, (), [("requests", window_seconds, 0, retry_after_s)]),
            ]
            message = refusal_message("requests", window_seconds, limit, 1, retry_after_ms)
            if self.mode == "shadow":
                self._would_refuse(request, response, identity, id(decision), limit, window_seconds,
                                   message, refusal)
                return
            _set_refusal_body(request, error_body(self.error_format, 429, "Rate limit exceeded",
                                                  message, "requests"))
            headers = {
                **dict(retry_headers(retry_after_s, retry_after_ms, self.max_client_wait_seconds)),
                **dict(refusal),
            }
            raise HTTPException(status_code=429, detail="Rate limit exceeded", headers=headers)
        _record_allowed(request, response, limit, remaining, window_seconds)
        # The tightest window is back to its full limit one window length from now (this
        # request is its newest entry): the reset of the provider families' headers.
        extra = family_headers(self.error_format, now_ms,
                               ResourceHeaders("requests", limit, remaining, window_seconds * 1000))
        extra += self._ietf_fields(identity, windows, (), [("requests", window_seconds, remaining,
                                                            window_seconds)])
        _record_extra(request, response, extra)

    def _in_flight_slot(self, request: Request, identity: str,
                        tier: str) -> tuple[int, tuple[object, ...], _LeaseLedger] | None:
        """(cap, ledger key, ledger) when this request must take an in-flight slot: its tier
        has a cap and no dependency of this request took one for this identity yet."""
        cap = self.max_in_flight.get(tier)
        if cap is None:
            return None
        leases = request.scope.get(_LEASES_KEY)
        if not isinstance(leases, _LeaseLedger):
            raise RuntimeError(
                "max_in_flight needs RateLimitHeadersMiddleware, which gives the slot back when "
                "the response is over: add "
                "app.add_middleware(genai_ratelimit.fastapi.RateLimitHeadersMiddleware)")
        key = self._counted_key(identity, ((cap, 0),))
        return None if leases.holds(key) else (cap, key, leases)

    def _hold(self, request: Request, response: Response, identity: str,
              slot: tuple[int, tuple[object, ...], _LeaseLedger], limiter: Any, is_async: bool,
              lease: Lease) -> None:
        """Keeps an allowed lease for the middleware to release, or raises the 429 (in shadow
        mode: records it as would-refuse and lets the request run without a slot)."""
        cap, key, leases = slot
        if lease.allowed:
            leases.entries.append((key, limiter, is_async, lease))
            return
        retry_ms = lease.retry_after_ms
        message = (f"Too many concurrent requests: Limit {cap} in flight. A slot frees when one "
                   f"of them ends; please try again within {format_duration(retry_ms)}.")
        refusal = [("X-RateLimit-Limit", str(cap)), ("X-RateLimit-Remaining", "0"),
                   ("X-RateLimit-Window", window_name(CONCURRENT))]
        if self.mode == "shadow":
            self._would_refuse(request, response, identity, None, cap, CONCURRENT, message, refusal)
            return
        _set_refusal_body(request, error_body(self.error_format, 429, "Rate limit exceeded",
                                              message, "requests"))
        headers = {
            **dict(retry_headers(lease.retry_after_s, retry_ms, self.max_client_wait_seconds)),
            **dict(refusal),
        }
        raise HTTPException(status_code=429, detail="Rate limit exceeded", headers=headers)

    def _take_slot(self, request: Request, response: Response, identity: str, tier: str) -> bool:
        """Blocking: takes an in-flight slot when the tier has a cap. False when Redis could
        not decide and on_unavailable let the request through (nothing more to decide)."""
        slot = self._in_flight_slot(request, identity, tier)
        if slot is None:
            return True
        limiter = self.limiter
        try:
            lease = limiter.acquire(identity, slot[0], self.lease_seconds)
        except RateLimiterError as exc:
            self._unavailable(request, identity, exc)
            return False
        self._hold(request, response, identity, slot, limiter, False, lease)
        return True

    async def _take_slot_async(self, request: Request, response: Response, identity: str,
                               tier: str, is_async: bool) -> bool:
        """_take_slot for an async dependency (a blocking limiter runs in the threadpool)."""
        slot = self._in_flight_slot(request, identity, tier)
        if slot is None:
            return True
        limiter = self.limiter
        try:
            if is_async:
                lease = await limiter.acquire(identity, slot[0], self.lease_seconds)
            else:
                lease = await run_in_threadpool(limiter.acquire, identity, slot[0], self.lease_seconds)
        except RateLimiterError as exc:
            self._unavailable(request, identity, exc)
            return False
        self._hold(request, response, identity, slot, limiter, is_async, lease)
        return True

    def _ietf_fields(self, identity: str, windows: Windows, token_windows: Windows,
                     limits: Sequence[tuple[Resource, int, int, int]]) -> list[tuple[str, str]]:
        """RateLimit-Policy (every window of the budget) and RateLimit (`limits`: (resource,
        window_seconds, remaining, seconds until more)) when headers="ietf"/"both", else []."""
        if self._partition_keys is None:
            return []
        service = [ServiceLimit(_policy_name(resource, seconds), remaining, reset)
                   for resource, seconds, remaining, reset in limits]
        return ietf_headers(_ietf_policies(windows, token_windows), service,
                            self._partition_keys.of(identity))

    def _would_refuse(self, request: Request, response: Response, identity: str, once: Hashable | None,
                      limit: int, window_seconds: int, message: str,
                      refusal: list[tuple[str, str]]) -> None:
        """Shadow mode: the refusal the budget would have answered, let through. The response
        carries its headers (not Retry-After and its kin: nothing was refused, a client must
        not wait) plus X-RateLimit-Shadow: would-refuse. The request is counted and logged,
        once per `once` when given: a decision that two dependencies of one route share (see
        _remember) is one request; None: always."""
        shadowed = request.scope.setdefault(_SHADOWED_KEY, set())
        if once is None or once not in shadowed:
            shadowed.add(once)
            with self._shadow_log.lock:
                self._shadow_count += 1
            record_outcome = getattr(self.limiter, "_record_outcome", None)
            if callable(record_outcome):
                record_outcome("shadow")
            count = self._shadow_log.due()
            if count is not None:
                latest = f", the latest for {identity!r}" if self.log_user_ids else ""
                logger.warning("shadow mode: %d request(s) the budget would have refused were let "
                               "through since the last report%s; the 429 would have said: %s "
                               "(next report in %gs at the earliest)", count, latest, message,
                               self._shadow_log.interval)
        trio = {"x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-window"}
        extra = [(name.lower(), value) for name, value in refusal if name.lower() not in trio]
        if any(name.lower() == "x-ratelimit-remaining" for name, _ in refusal):
            _record_allowed(request, response, limit, 0, window_seconds)
        else:  # a request no wait could fit: its 429 says no Remaining
            extra = [(name.lower(), value) for name, value in refusal]
        _record_extra(request, response, [*extra, ("x-ratelimit-shadow", "would-refuse")])

    def _unavailable(self, request: Request, user_id: str, exc: RateLimiterError) -> None:
        """Redis could not decide: 503 (deny) or a logged pass (allow)."""
        if self.on_unavailable == "allow":
            with self._fail_open_lock:
                self._fail_open_count += 1
                count = self._fail_open_count
            record = getattr(self.limiter, "_record_outcome", None)
            if record is not None:  # the limiter's metrics count it too
                record("fail_open")
            self._log_unavailable(f"let through (on_unavailable='allow', fail-open #{count} in all)",
                                  user_id, exc)
            return
        self._log_unavailable("answered 503", user_id, exc)
        _set_refusal_body(request, error_body(self.error_format, 503, "Rate limiter unavailable",
                                              UNAVAILABLE_MESSAGE))
        raise HTTPException(status_code=503, detail="Rate limiter unavailable",
                            headers={"Retry-After": "1", "x-should-retry": "true"})

    def _log_unavailable(self, action: str, user_id: str, exc: RateLimiterError) -> None:
        """One warning per unavailable_log_interval at most, counting the requests it covers
        (an outage must not flood the log with one line per request)."""
        count = self._unavailable_log.due()
        if count is None:
            return
        latest = f", the latest for {user_id!r}" if self.log_user_ids else ""
        logger.warning("rate limiter unavailable: %d request(s) %s since the last report%s "
                       "(next report in %gs at the earliest): %s",
                       count, action, latest, self.unavailable_log_interval, exc)

    @staticmethod
    def _exact(decision: Decision) -> tuple[int, int]:
        """The exact wait in ms and the decision's time: a WindowDecision carries both; any
        other limiter's 4-tuple gets its rounded wait and this process's clock."""
        return (getattr(decision, "retry_after_ms", decision[2] * 1000),
                getattr(decision, "timestamp_ms", 0) or _now_ms())

    async def _limiter_call(self, bound: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """bound(...), a limiter's method: awaited, or in the threadpool for a blocking limiter."""
        if self._limiter_is_async:
            return await bound(*args, **kwargs)
        return await run_in_threadpool(lambda: bound(*args, **kwargs))

    def _refuse_scope(self, request: Request, response: Response, identity: str,
                      reservation: Reservation, requested: int) -> None:
        """The 429 of a refusal by a scope (detail "Rate limit exceeded", as every 429). An
        upstream's (shared) message says that the service, not the user, is at capacity; a
        route's or a model's names that budget. Either carries X-RateLimit-Scope (upstream |
        route | model) and, in X-RateLimit-Limit/-Window, the refusing window of that scope;
        the provider families' x-ratelimit-* headers and the IETF fields, which describe the
        user's own budget, are left out. In shadow mode: recorded as would-refuse."""
        scope = reservation.scope
        assert scope is not None
        resource, window_seconds = reservation.resource, reservation.window_seconds
        limit = next(w.limit for w in reservation.windows if w.scope == scope
                     and w.resource == resource and w.window_seconds == window_seconds)
        retry_ms = reservation.retry_after_ms
        kind = _scope_kind(scope)
        # The contract's detail for every 429; the message says whose budget it was.
        detail = "Rate limit exceeded"
        if scope.shared:
            message = (f"The service is at capacity: its upstream {scope.name} allows {limit} "
                       f"{resource} per {window_name(window_seconds)} for all users together. "
                       f"This is not your own rate limit. Please try again in "
                       f"{format_duration(retry_ms)}.")
        else:
            message = (f"{refusal_message(resource, window_seconds, limit, requested, retry_ms)} "
                       f"(the budget of {kind} {scope.name.split(':', 1)[-1]})")
        refusal = [
            ("X-RateLimit-Limit", str(limit)),
            ("X-RateLimit-Remaining", "0"),
            ("X-RateLimit-Window", window_name(window_seconds)),
            ("X-RateLimit-Scope", kind),
            ("X-RateLimit-Resource", resource),
        ]
        if self.mode == "shadow":
            self._would_refuse(request, response, identity, None, limit, window_seconds, message,
                               refusal)
            return
        _set_refusal_body(request, error_body(self.error_format, 429, detail, message, resource))
        headers = {
            **dict(retry_headers(reservation.retry_after_s, retry_ms, self.max_client_wait_seconds)),
            **dict(refusal),
        }
        raise HTTPException(status_code=429, detail=detail, headers=headers)

    async def _decide_with_scopes(self, request: Request, response: Response, user_id: str,
                                  windows: Windows) -> None:
        """RateLimit with scopes: one reserve over the tier's windows and the request's
        scopes (one check_windows when none applies to this request)."""
        scopes = await self._scopes.of(request)
        counted = self._already_counted(request, user_id, windows)
        if not scopes:
            decision = counted
            if decision is None:
                try:
                    decision = await self._limiter_call(self._decide(), user_id, windows)
                except RateLimiterError as exc:
                    self._unavailable(request, user_id, exc)
                    return
                self._remember(request, user_id, windows, decision)
            self._apply(request, response, windows, decision, *self._exact(decision),
                        identity=user_id)
            return
        try:
            reservation: Reservation = await self._limiter_call(
                self.limiter.reserve, user_id, () if counted is not None else windows,
                scopes=scopes)
        except RateLimiterError as exc:
            self._unavailable(request, user_id, exc)
            return
        if not reservation.allowed and reservation.scope is not None:
            self._refuse_scope(request, response, user_id, reservation, 1)
            return  # shadow mode: the route runs, nothing was logged
        if counted is not None:
            decision, exact = counted, self._exact(counted)
        elif not reservation.allowed:
            decision = (False, 0, reservation.retry_after_s, reservation.window_seconds)
            exact = (reservation.retry_after_ms, reservation.timestamp_ms or _now_ms())
        else:
            state = _tightest(reservation.windows, "requests")
            assert state is not None and state.remaining is not None
            decision = (True, state.remaining, 0, state.window_seconds)
            exact = (0, reservation.timestamp_ms or _now_ms())
            self._remember(request, user_id, windows, decision)
        self._apply(request, response, windows, decision, *exact, identity=user_id)

    def _decide(self) -> Any:
        """The call that decides: check_windows, as the contract says. When it is this package's
        own (not overridden by a subclass or replaced on the instance), its detailed twin, which
        sends the same command and answers the same tuple with the exact wait as attributes."""
        limiter = self.limiter
        if getattr(type(limiter), "check_windows", None) in _STOCK_CHECK_WINDOWS and \
                "check_windows" not in getattr(limiter, "__dict__", ()):
            return limiter.check_windows_detailed
        return limiter.check_windows

    def __call__(self, request: Request, response: Response) -> Any:
        # A plain def: FastAPI runs it in its threadpool, where the blocking C call belongs.
        user_id, tier = self._identity_and_tier(request)
        windows = self._windows[tier]
        if not self._take_slot(request, response, user_id, tier):
            return
        decision = self._already_counted(request, user_id, windows)
        if decision is None:
            try:
                decision = self._decide()(user_id, windows)
            except RateLimiterError as exc:
                self._unavailable(request, user_id, exc)
                return
            self._remember(request, user_id, windows, decision)
        self._apply(request, response, windows, decision, *self._exact(decision), identity=user_id)


class _AsyncRateLimit(RateLimit):
    """RateLimit over an async limiter: awaited on the event loop, no worker thread."""

    async def __call__(self, request: Request, response: Response) -> None:
        user_id, tier = self._identity_and_tier(request)
        windows = self._windows[tier]
        if not await self._take_slot_async(request, response, user_id, tier,
                                           self._limiter_is_async):
            return
        if self._scopes:
            await self._decide_with_scopes(request, response, user_id, windows)
            return
        decision = self._already_counted(request, user_id, windows)
        if decision is None:
            try:
                decision = await self._decide()(user_id, windows)
            except RateLimiterError as exc:
                self._unavailable(request, user_id, exc)
                return
            self._remember(request, user_id, windows, decision)
        self._apply(request, response, windows, decision, *self._exact(decision), identity=user_id)


def _now_ms() -> int:
    return int(time.time() * 1000)


@functools.lru_cache(maxsize=256)
def _policy_name(resource: str, window_seconds: int) -> str:
    """The IETF policy name of a window: "requests-minute", "tokens-day", "requests-3600s"."""
    return f"{resource}-{window_name(window_seconds)}"


@functools.lru_cache(maxsize=256)  # one entry per tier's budget: built once
def _ietf_policies(windows: Windows, token_windows: Windows) -> tuple[Policy, ...]:
    """The IETF quota policies of a budget: its request windows, then its token windows."""
    return (*(Policy(_policy_name("requests", seconds), limit, seconds, None) for limit, seconds in windows),
            *(Policy(_policy_name("tokens", seconds), limit, seconds, "tokens")
              for limit, seconds in token_windows))


class _LogThrottle:
    """At most one log line per `interval` seconds: `due()` counts one event and answers the
    number of events the line should cover, or None when it is not time yet."""

    __slots__ = ("interval", "lock", "_pending", "_logged_at")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.lock = threading.Lock()  # the threadpool may log in parallel
        self._pending = 0  # events since the last line
        self._logged_at: float | None = None  # time.monotonic() of that line

    def due(self) -> int | None:
        with self.lock:
            self._pending += 1
            now = time.monotonic()
            if self._logged_at is not None and now - self._logged_at < self.interval:
                return None
            count, self._pending, self._logged_at = self._pending, 0, now
            return count


def _set_refusal_body(request: Request, body: dict[str, Any]) -> None:
    """Gives this request's 429/503 the body of the chosen error format. The middleware
    writes it (an HTTPException's own body is {"detail": ...}); without the middleware the
    response keeps that plain body."""
    ledger = request.scope.get(_TOKENS_KEY)
    if isinstance(ledger, _TokenLedger):
        ledger.refusal_body = body


def _record_extra(request: Request, response: Response, extra: list[tuple[str, str]]) -> None:
    """The provider family's headers of an allowed decision, on every response type."""
    decision_record = request.scope.get(_SCOPE_KEY)
    if isinstance(decision_record, _AllowedDecision):
        decision_record.extra = extra
    for name, value in extra:
        response.headers[name] = value


# --- token budgets: reserve before the route, reconcile after the response -----------------

Estimate = Callable[[Request], "int | Awaitable[int]"]
_warned_no_token_middleware = False


def _tightest(states: Sequence[WindowState], resource: str) -> WindowState | None:
    """The user's own window of `resource` with the fewest units remaining (ties: the
    shorter), among those the decision reached (scopes' windows left out)."""
    reached = [w for w in states
               if w.resource == resource and w.remaining is not None and w.scope is None]
    return min(reached, key=lambda w: (w.remaining, w.window_seconds)) if reached else None


class TokenRateLimit(RateLimit):
    """A FastAPI dependency that limits requests AND tokens: before the route runs it
    estimates what the request may spend, and reserves one request plus that many tokens in
    ONE `reserve` call (all or nothing: a request refused on tokens spends no request budget,
    and the other way round). After the response, the reservation is reconciled with the
    usage really spent: lower refunds, higher charges.

        from genai_ratelimit.fastapi import RateLimitHeadersMiddleware, TokenRateLimit, record_usage

        app.add_middleware(RateLimitHeadersMiddleware)   # needed: reconcile, headers, 429 body
        token_limit = TokenRateLimit()

        @app.post("/v1/chat/completions", dependencies=[Depends(token_limit)])
        async def chat(request: Request): ...

    The usage comes from, whichever is first (each request is reconciled once):
    - `await record_usage(request, tokens)`, called by the route (a streaming generator too);
    - the response, read by RateLimitHeadersMiddleware as it passes: an OpenAI-shaped JSON
      body's `usage.total_tokens`, or the last `data:` chunk of a server-sent event stream
      that carries `usage` (OpenAI's final chunk with stream_options={"include_usage": true}).
    A request whose usage is never reported keeps its reservation: never a silent refund.

    Arguments (and RateLimit's: limiter, tier_limits, identify, on_unavailable, namespace, and
    its keywords: mode="shadow" lets a refused reservation through without reserving anything,
    headers="ietf" adds the token windows as policies of unit "tokens"):

    token_limits        {"free": {"per_minute": 10_000, "per_day": 100_000}, ...}; None: the
                        tokens_per_minute/tokens_per_day of the file named by
                        $GENAI_RATELIMIT_TIERS when set, else TIER_TOKEN_LIMITS. A tier without
                        a token budget gets the free tier's.
    estimate            estimate(request) -> int >= 1 (or an awaitable of it), replacing the
                        default estimate: for an OpenAI chat request its max_completion_tokens
                        / max_tokens (else the tier's default_max_tokens), times n, plus the
                        prompt's characters / 4 (estimate_openai_tokens). Reading the body here
                        (await request.body() / .json()) leaves it readable by the route.
    default_max_tokens  the completion tokens assumed when a request names no maximum: an int
                        for every tier or {tier: int} (others: DEFAULT_MAX_TOKENS, 1,000).

    An estimate above the tier's token limit can never be allowed: 429 with a body saying so
    (the limit and the tokens requested), without Retry-After and with x-should-retry: false.

    Responses carry the contract's X-RateLimit-* (for the request windows; on a 429 for the
    window that refused, with X-RateLimit-Resource: requests|tokens) and OpenAI's
    x-ratelimit-limit|remaining|reset-requests|tokens (see genai_ratelimit._openai_headers
    for what reset means on a sliding log), and retry-after-ms beside Retry-After on a 429.

    Keys: the request windows are RateLimit's keys; the token windows are
    {prefix}:{identity}:{window}:tokens. Default budgets (both) count in no namespace, so a
    `rate_limit` and a TokenRateLimit on the same user share the request budget; a
    TokenRateLimit with a budget of its own (request or token) gets a namespace from both.
    The dependency is always an async def; with a blocking RateLimiter the reserve and the
    reconcile run in FastAPI's threadpool.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> TokenRateLimit:
        return object.__new__(cls)

    def __init__(
        self,
        limiter: SyncWindowLimiter | AsyncWindowLimiter | None = None,
        tier_limits: Mapping[str, Mapping[str, int]] | None = None,
        identify: Identify | None = None,
        on_unavailable: OnUnavailable = "deny",
        namespace: str | None = None,
        *,
        token_limits: Mapping[str, Mapping[str, int]] | None = None,
        estimate: Estimate | None = None,
        default_max_tokens: int | Mapping[str, int] = DEFAULT_MAX_TOKENS,
        error_format: ErrorFormat = "openai",
        max_client_wait_seconds: float = 300.0,
        unavailable_log_interval: float = 60.0,
        log_user_ids: bool = True,
        mode: Mode = "enforce",
        shadow_log_interval: float = 60.0,
        headers: HeaderMode = "contract",
        partition_key_secret: str | bytes | None = None,
        max_in_flight: Mapping[str, int] | None = None,
        lease_seconds: int = DEFAULT_LEASE_SECONDS,
        upstream: Upstream | Sequence[Upstream] | UpstreamOf | None = None,
        route_limits: Mapping[str, int] | None = None,
        model_limits: Mapping[str, Mapping[str, int]] | None = None,
    ) -> None:
        if limiter is not None and not callable(getattr(limiter, "reserve", None)):
            raise TypeError(f"limiter must be a RateLimiter or AsyncRateLimiter with reserve(), "
                            f"not {type(limiter).__name__}")
        if estimate is not None and not callable(estimate):
            raise TypeError(f"estimate must be a callable taking the request, not {type(estimate).__name__}")
        self.default_max_tokens: dict[str, int] = {}
        fallback = DEFAULT_MAX_TOKENS
        if isinstance(default_max_tokens, Mapping):
            for tier, value in default_max_tokens.items():
                self.default_max_tokens[str(tier)] = self._positive("default_max_tokens", value)
        else:
            fallback = self._positive("default_max_tokens", default_max_tokens)
        self._default_max_fallback = fallback
        super().__init__(limiter, tier_limits, identify, on_unavailable, namespace,
                         error_format=error_format, max_client_wait_seconds=max_client_wait_seconds,
                         unavailable_log_interval=unavailable_log_interval, log_user_ids=log_user_ids,
                         mode=mode, shadow_log_interval=shadow_log_interval, headers=headers,
                         partition_key_secret=partition_key_secret, max_in_flight=max_in_flight,
                         lease_seconds=lease_seconds,
                         upstream=upstream, route_limits=route_limits, model_limits=model_limits)
        default_tokens = token_limits is None
        if token_limits is None:
            token_limits = tier_token_limits_from_env() or TIER_TOKEN_LIMITS
        self.token_limits: dict[str, dict[str, int]] = validate_token_limits(token_limits)
        self._token_windows: dict[str, Windows] = {
            tier: tuple((budget[key], seconds) for key, seconds in TIER_BUDGET_KEYS.items())
            for tier, budget in self.token_limits.items()
        }
        if namespace is None and (self.namespace is not None or not default_tokens):
            self.namespace = _budget_namespace({"requests": self.tier_limits, "tokens": self.token_limits})
        self.estimate: Estimate | None = estimate
        self._is_async = limiter is None or _is_async_limiter(limiter)

    @staticmethod
    def _positive(name: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
        return value

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(limiter={self._limiter!r}, tiers={sorted(self.tier_limits)}, "
                f"on_unavailable={self.on_unavailable!r}, namespace={self.namespace!r})")

    def token_windows_of(self, tier: str) -> Windows:
        """The (limit, window_seconds) token windows of a tier (the free tier's when it has none)."""
        return self._token_windows.get(tier) or self._token_windows[DEFAULT_TIER]

    async def estimate_tokens(self, request: Request, tier: str) -> int:
        """The tokens this request is reserved for: `estimate(request)`, else the default."""
        if self.estimate is not None:
            value = self.estimate(request)
            if inspect.isawaitable(value):
                value = await value
            return self._positive("the token estimate", value)
        default = self.default_max_tokens.get(tier, self._default_max_fallback)
        return estimate_openai_tokens(await request.body(), default)

    async def __call__(self, request: Request, response: Response) -> None:
        identity, tier = self._identity_and_tier(request)
        windows, token_windows = self._windows[tier], self.token_windows_of(tier)
        _ledger_of(request).decided = True
        tokens = await self.estimate_tokens(request, tier)
        scopes = await self._scopes.of(request) if self._scopes else ()
        if self._refuse_if_too_large(request, response, identity, windows, token_windows, tokens,
                                     scopes):
            return  # shadow mode: the route runs, nothing was reserved
        if not await self._take_slot_async(request, response, identity, tier, self._is_async):
            return
        counted = self._already_counted(request, identity, windows)
        # Requests already counted by another dependency of this route: reserve tokens only.
        request_windows: Windows = () if counted is not None else windows
        limiter = self.limiter
        arguments: dict[str, Any] = {"cost": 1, "token_windows": token_windows, "tokens": tokens}
        if scopes:
            arguments["scopes"] = scopes
        try:
            reservation: Reservation = await self._limiter_call(
                limiter.reserve, identity, request_windows, **arguments)
        except RateLimiterError as exc:
            self._unavailable(request, identity, exc)
            return
        if not reservation.allowed:
            if reservation.scope is not None:
                self._refuse_scope(request, response, identity, reservation,
                                   tokens if reservation.resource == "tokens" else 1)
            else:
                self._refuse(request, response, identity, windows, token_windows, reservation,
                             tokens)
            return  # shadow mode: the route runs, nothing was reserved
        ledger = _ledger_of(request)
        ledger.entries.append((limiter, self._is_async, reservation))
        requests_state = _tightest(reservation.windows, "requests")
        if counted is None and requests_state is not None and requests_state.remaining is not None:
            decision = (True, requests_state.remaining, 0, requests_state.window_seconds)
            self._remember(request, identity, windows, decision)
            _record_allowed(request, response, requests_state.limit, requests_state.remaining,
                            requests_state.window_seconds)
        elif counted is not None:
            _, remaining, _, window_seconds = counted
            limit = next(lim for lim, seconds in windows if seconds == window_seconds)
            requests_state = WindowState(limit, window_seconds, "requests", remaining)
        tokens_state = _tightest(reservation.windows, "tokens")
        states = [state for state in (requests_state, tokens_state) if state is not None]
        extra = family_headers(self.error_format, reservation.timestamp_ms or _now_ms(), *(
            ResourceHeaders(state.resource, state.limit, state.remaining, state.window_seconds * 1000)
            for state in states))
        extra += self._ietf_fields(identity, windows, token_windows, [
            (state.resource, state.window_seconds, state.remaining or 0, state.window_seconds)
            for state in states])
        _record_extra(request, response, extra)

    def _refuse_if_too_large(self, request: Request, response: Response, identity: str,
                             windows: Windows, token_windows: Windows, tokens: int,
                             scopes: Sequence[BudgetScope] = ()) -> bool:
        """The 429 of an estimate no wait can make fit (above a token window's limit, its
        scopes' included). Returns True when shadow mode let it through instead, False when
        the estimate fits."""
        limit, window_seconds = min([*token_windows, *(w for s in scopes for w in s.token_windows)])
        if tokens <= limit:
            return False
        refusal = [
            ("X-RateLimit-Limit", str(limit)),
            ("X-RateLimit-Window", window_name(window_seconds)),
            ("X-RateLimit-Resource", "tokens"),
            *family_headers(self.error_format, _now_ms(),
                            ResourceHeaders("requests", windows[0][0], None, None),
                            ResourceHeaders("tokens", limit, None, None)),
            *self._ietf_fields(identity, windows, token_windows, ()),
        ]
        body = too_large_error_body(self.error_format, "tokens", window_seconds, limit, tokens)
        if self.mode == "shadow":
            self._would_refuse(request, response, identity, None, limit, window_seconds,
                               body["detail"], refusal)
            return True
        _ledger_of(request).refusal_body = body
        headers = {**dict(refusal[:3]), "x-should-retry": "false", **dict(refusal[3:])}
        raise HTTPException(status_code=429, detail=body["detail"], headers=headers)

    def _refuse(self, request: Request, response: Response, identity: str, windows: Windows,
                token_windows: Windows, reservation: Reservation, tokens: int) -> None:
        """The 429 of a reservation refused by one of its windows: retry later (in shadow
        mode: records it as would-refuse and returns)."""
        resource, window_seconds = reservation.resource, reservation.window_seconds
        budget = token_windows if resource == "tokens" else windows
        limit = next(lim for lim, seconds in budget if seconds == window_seconds)
        retry_ms = reservation.retry_after_ms
        states = []
        resources: tuple[tuple[Resource, Windows], ...] = (("requests", windows), ("tokens", token_windows))
        for name, resource_windows in resources:
            if name == resource:
                states.append(ResourceHeaders(name, limit, 0, retry_ms))
                continue
            state = _tightest(reservation.windows, name)
            states.append(ResourceHeaders(name, state.limit, state.remaining, retry_ms) if state is not None
                          else ResourceHeaders(name, resource_windows[0][0], None, retry_ms))
        refusal = [
            ("X-RateLimit-Limit", str(limit)),
            ("X-RateLimit-Remaining", "0"),
            ("X-RateLimit-Window", window_name(window_seconds)),
            ("X-RateLimit-Resource", resource),
            *family_headers(self.error_format, reservation.timestamp_ms or _now_ms(), *states),
            *self._ietf_fields(identity, windows, token_windows,
                               [(resource, window_seconds, 0, reservation.retry_after_s)]),
        ]
        message = refusal_message(resource, window_seconds, limit,
                                  tokens if resource == "tokens" else 1, retry_ms)
        if self.mode == "shadow":
            self._would_refuse(request, response, identity, None, limit, window_seconds,
                               message, refusal)
            return
        _ledger_of(request).refusal_body = error_body(self.error_format, 429, "Rate limit exceeded",
                                                      message, resource)
        headers = {
            **dict(retry_headers(reservation.retry_after_s, retry_ms, self.max_client_wait_seconds)),
            **dict(refusal),
        }
        raise HTTPException(status_code=429, detail="Rate limit exceeded", headers=headers)


def _ledger_of(request: Request) -> _TokenLedger:
    """This request's token ledger: the middleware's, else one made here (then nothing reads
    the response: only record_usage reconciles, and a warning says so once)."""
    global _warned_no_token_middleware
    ledger = request.scope.get(_TOKENS_KEY)
    if isinstance(ledger, _TokenLedger):
        return ledger
    ledger = _TokenLedger(middleware=False)
    request.scope[_TOKENS_KEY] = ledger
    if not _warned_no_token_middleware:
        _warned_no_token_middleware = True
        logger.warning(
            "RateLimitHeadersMiddleware is not installed: TokenRateLimit reservations are "
            "reconciled only by record_usage(request, tokens), not from the responses' usage, "
            "and its 429 bodies lack the OpenAI-style error object. Add "
            "app.add_middleware(genai_ratelimit.fastapi.RateLimitHeadersMiddleware).")
    return ledger


async def record_usage(request: Request, tokens: int) -> int:
    """Reports what this request really spent: reconciles its TokenRateLimit reservation(s)
    with `tokens` (lower refunds, higher charges, 0 removes the tokens entry), now, before
    returning; then the response's own usage is not read. Call it at most once per request
    (from the route, or from inside its streaming generator before the stream ends).

    Returns the number of token windows whose entry was found (0 when nothing was reserved:
    the kill switch, a fail-open, or the entry has left its windows). Raises RuntimeError when
    no TokenRateLimit decided this request, or its usage was already recorded."""
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise TypeError(f"tokens must be an int, not {type(tokens).__name__}")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    ledger = request.scope.get(_TOKENS_KEY)
    if not isinstance(ledger, _TokenLedger) or not ledger.decided:
        raise RuntimeError("record_usage: no TokenRateLimit decided this request "
                           "(add Depends(TokenRateLimit(...)) to the route)")
    if ledger.reported:
        raise RuntimeError("record_usage: the usage of this request was already recorded "
                           "(each request is reconciled once)")
    ledger.reported = True
    return await ledger.reconcile(tokens)


def in_flight_lease(request: Request) -> Lease | None:
    """The in-flight lease this request holds (max_in_flight), or None when its tier has no
    cap (or Redis could not decide and on_unavailable let it through). A stream that may run
    longer than lease_seconds renews it: `await in_flight_lease(request).renew()` with an
    AsyncRateLimiter (an AsyncLease), `.renew()` with a RateLimiter. The middleware still
    releases it when the response is over."""
    leases = request.scope.get(_LEASES_KEY)
    if not isinstance(leases, _LeaseLedger) or not leases.entries:
        return None
    return leases.entries[0][3]


rate_limit: RateLimit = RateLimit()
"""The ready dependency: an async default limiter ($REDIS_URL, made on the first request),
TIER_LIMITS or $GENAI_RATELIMIT_TIERS, default identity, 503 when Redis is unavailable."""
