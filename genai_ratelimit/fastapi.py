"""FastAPI integration: a dependency that decides each request in one `check_windows` call
(minute, then day) and answers 429 with the headers clients expect.

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

Failing open: with on_unavailable="allow", `RateLimit.fail_open_count` counts the requests let
through because Redis could not decide; export it to your metrics and alert when it grows.

Requires the `fastapi` extra: pip install genai-ratelimit[fastapi].
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import re
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

try:
    from fastapi import HTTPException, Request, Response
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as exc:  # the core package works without FastAPI; this module does not
    raise ImportError("genai_ratelimit.fastapi needs FastAPI: pip install 'genai-ratelimit[fastapi]'"
                      f" ({exc})") from exc

from . import RateLimiterError
from ._tiers_config import TIER_BUDGET_KEYS, TierConfigError, tier_limits_from_env, validate_tier_limits
from .aio import AsyncRateLimiter
from .tiers import DEFAULT_TIER, TIER_LIMITS

__all__ = [
    "Anonymous",
    "RateLimit",
    "RateLimitHeadersMiddleware",
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


class SyncWindowLimiter(Protocol):
    def check_windows(self, user_id: str, windows: Sequence[tuple[int, int]]) -> Decision: ...


class AsyncWindowLimiter(Protocol):
    def check_windows(self, user_id: str, windows: Sequence[tuple[int, int]]) -> Awaitable[Decision]: ...


_WINDOW_NAMES = {60: "minute", 86_400: "day"}


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


def _budget_namespace(tier_limits: Mapping[str, Mapping[str, int]]) -> str:
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


class _AllowedDecision:
    """The tightest allowed decision of this request (several RateLimit dependencies on one
    route keep the one with the fewest remaining; ties: the shorter window). Lives in the ASGI
    scope; the middleware puts it there before the app runs, so shallow scope copies share it."""

    __slots__ = ("limit", "remaining", "window_seconds")

    def __init__(self) -> None:
        self.limit = 0
        self.remaining = -1  # -1: nothing recorded yet
        self.window_seconds = 0

    def offer(self, limit: int, remaining: int, window_seconds: int) -> None:
        if self.remaining < 0 or (remaining, window_seconds) < (self.remaining, self.window_seconds):
            self.limit, self.remaining, self.window_seconds = limit, remaining, window_seconds

    def headers(self) -> list[tuple[str, str]]:
        if self.remaining < 0:
            return []
        return [
            ("x-ratelimit-limit", str(self.limit)),
            ("x-ratelimit-remaining", str(self.remaining)),
            ("x-ratelimit-window", window_name(self.window_seconds)),
        ]


class RateLimitHeadersMiddleware:
    """Pure ASGI middleware: adds the X-RateLimit-* headers of an allowed request to whatever
    response the route produced (StreamingResponse and JSONResponse included). A header the
    response already has (a 429's own, or one the route set) is left as it is.

        app.add_middleware(RateLimitHeadersMiddleware)
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        decision = _AllowedDecision()
        scope[_SCOPE_KEY] = decision

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = decision.headers()
                if extra:
                    headers = list(message.get("headers", ()))
                    present = {bytes(name).lower() for name, _ in headers}
                    headers += [(name.encode("latin-1"), value.encode("latin-1"))
                                for name, value in extra if name.encode("latin-1") not in present]
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


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

    An async limiter (the default) gives an instance of a subclass whose __call__ is async,
    awaited on the event loop; a blocking limiter gives an instance whose __call__ is a plain
    def (FastAPI's threadpool).
    """

    def __new__(cls, limiter: SyncWindowLimiter | AsyncWindowLimiter | None = None,
                *args: Any, **kwargs: Any) -> RateLimit:
        if cls is RateLimit and (limiter is None or _is_async_limiter(limiter)):
            cls = _AsyncRateLimit
        return super().__new__(cls)

    def __init__(
        self,
        limiter: SyncWindowLimiter | AsyncWindowLimiter | None = None,
        tier_limits: Mapping[str, Mapping[str, int]] | None = None,
        identify: Identify | None = None,
        on_unavailable: OnUnavailable = "deny",
        namespace: str | None = None,
    ) -> None:
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
        if tier_limits is None:
            tier_limits = tier_limits_from_env() or TIER_LIMITS
        self.tier_limits: dict[str, dict[str, int]] = validate_tier_limits(tier_limits)
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

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(limiter={self._limiter!r}, tiers={sorted(self.tier_limits)}, "
                f"on_unavailable={self.on_unavailable!r}, namespace={self.namespace!r})")

    def _subject(self, request: Request) -> tuple[str, Windows]:
        """Who is asking and under which budget: (key identity, windows); see key_identity."""
        user_id, tier = self.identify(request)
        if isinstance(user_id, int) and not isinstance(user_id, bool):
            user_id = str(user_id)
        if not isinstance(user_id, str) or not user_id:
            raise TypeError(f"the rate-limit identity must be a non-empty str, got {user_id!r}")
        windows = self._windows.get(tier) if isinstance(tier, str) else None
        return key_identity(user_id, self.namespace), windows or self._windows[DEFAULT_TIER]

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

    def _apply(self, request: Request, response: Response, windows: Windows, decision: Decision) -> None:
        """Raises the 429, or records the allowed decision's headers."""
        allowed, remaining, retry_after_s, window_seconds = decision
        limit = next((lim for lim, seconds in windows if seconds == window_seconds), windows[0][0])
        if not allowed:
            raise HTTPException(
                status_code=429,
                detail="Rate limit exceeded",
                headers={
                    "Retry-After": str(retry_after_s),
                    "X-RateLimit-Limit": str(limit),
                    "X-RateLimit-Remaining": "0",
                    "X-RateLimit-Window": window_name(window_seconds),
                },
            )
        _record_allowed(request, response, limit, remaining, window_seconds)

    def _unavailable(self, user_id: str, exc: RateLimiterError) -> None:
        """Redis could not decide: 503 (deny) or a logged pass (allow)."""
        if self.on_unavailable == "allow":
            with self._fail_open_lock:
                self._fail_open_count += 1
                count = self._fail_open_count
            logger.warning("rate limiter unavailable, letting %r through (on_unavailable='allow', "
                           "fail-open #%d): %s", user_id, count, exc)
            return
        logger.warning("rate limiter unavailable, answering 503 to %r: %s", user_id, exc)
        raise HTTPException(status_code=503, detail="Rate limiter unavailable",
                            headers={"Retry-After": "1"})

    def __call__(self, request: Request, response: Response) -> Any:
        # A plain def: FastAPI runs it in its threadpool, where the blocking C call belongs.
        user_id, windows = self._subject(request)
        decision = self._already_counted(request, user_id, windows)
        if decision is None:
            try:
                decision = self.limiter.check_windows(user_id, windows)
            except RateLimiterError as exc:
                self._unavailable(user_id, exc)
                return
            self._remember(request, user_id, windows, decision)
        self._apply(request, response, windows, decision)


class _AsyncRateLimit(RateLimit):
    """RateLimit over an async limiter: awaited on the event loop, no worker thread."""

    async def __call__(self, request: Request, response: Response) -> None:
        user_id, windows = self._subject(request)
        decision = self._already_counted(request, user_id, windows)
        if decision is None:
            try:
                decision = await self.limiter.check_windows(user_id, windows)
            except RateLimiterError as exc:
                self._unavailable(user_id, exc)
                return
            self._remember(request, user_id, windows, decision)
        self._apply(request, response, windows, decision)


rate_limit: RateLimit = RateLimit()
"""The ready dependency: an async default limiter ($REDIS_URL, made on the first request),
TIER_LIMITS or $GENAI_RATELIMIT_TIERS, default identity, 503 when Redis is unavailable."""
