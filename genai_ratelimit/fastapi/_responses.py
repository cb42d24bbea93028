"""The headers of an allowed decision and the bodies of refusals, on every response type."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from fastapi import HTTPException, Request, Response

from ..aio import AsyncRateLimiter
from ..limiter import RateLimiter
from ._ledger import _TOKENS_KEY, _TokenLedger
from ._policy import window_name

logger = logging.getLogger("genai_ratelimit")


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

    __slots__ = ("limit", "remaining", "window_seconds", "extra", "shadow")

    def __init__(self) -> None:
        self.limit = 0
        self.remaining = -1  # -1: nothing recorded yet
        self.window_seconds = 0
        # OpenAI's x-ratelimit-*-requests/-tokens of an allowed TokenRateLimit decision.
        self.extra: list[tuple[str, str]] = []
        # A shadow dependency's verdict: X-RateLimit-Shadow-* only, beside the enforced ones.
        self.shadow: list[tuple[str, str]] = []

    def offer(self, limit: int, remaining: int, window_seconds: int) -> None:
        if self.remaining < 0 or (remaining, window_seconds) < (self.remaining, self.window_seconds):
            self.limit, self.remaining, self.window_seconds = limit, remaining, window_seconds

    def headers(self) -> list[tuple[str, str]]:
        if self.remaining < 0:
            return [*self.extra, *self.shadow]
        return [*allowed_headers(self.limit, self.remaining, self.window_seconds, lower=True),
                *self.extra, *self.shadow]


def allowed_headers(limit: int, remaining: int, window_seconds: int, *, lower: bool = False
                    ) -> list[tuple[str, str]]:
    """The contract's trio of an allowed decision."""
    names = ("x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-window") if lower else \
        ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Window")
    return list(zip(names, (str(limit), str(remaining), window_name(window_seconds)), strict=True))


def shadow_headers(headers: list[tuple[str, str]], verdict: str) -> list[tuple[str, str]]:
    """A shadow verdict's headers: its X-RateLimit-* renamed X-RateLimit-Shadow-* (provider
    families, IETF fields and retry instructions left out: they describe what is enforced),
    plus X-RateLimit-Shadow: would-refuse when it would have refused."""
    renamed = [("x-ratelimit-shadow-" + name[len("x-ratelimit-"):].lower(), value)
               for name, value in headers if name.lower().startswith("x-ratelimit-")
               and not name.lower().startswith(("x-ratelimit-shadow", "x-ratelimit-limit-",
                                                "x-ratelimit-remaining-", "x-ratelimit-reset-"))]
    return [*renamed, *([("x-ratelimit-shadow", verdict)] if verdict == "would-refuse" else [])]


def _record_shadow(request: Request, response: Response, headers: list[tuple[str, str]]) -> None:
    """A shadow dependency's verdict, on every response type; never an enforced header."""
    decision = request.scope.get(_SCOPE_KEY)
    if not isinstance(decision, _AllowedDecision):
        decision = _AllowedDecision()
        request.scope[_SCOPE_KEY] = decision
    refusing = ("x-ratelimit-shadow", "would-refuse")
    if refusing in decision.shadow and refusing not in headers:
        return  # a would-refuse verdict of this request stands (e.g. its in-flight cap)
    decision.shadow = headers
    for name, value in headers:
        response.headers[name] = value



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


class RateLimitRefusal(HTTPException):
    """The 429 (or 503) of a rate-limit dependency: an HTTPException that carries the
    response the middleware writes (status, headers, `body`), whatever exception handlers
    the app registered."""

    def __init__(self, status_code: int, detail: str, headers: dict[str, str],
                 body: dict[str, Any]) -> None:
        super().__init__(status_code=status_code, detail=detail, headers=headers)
        self.body = body


def refuse(request: Request, status: int, detail: str, headers: dict[str, str],
           body: dict[str, Any]) -> NoReturn:
    """Every refusal of the FastAPI layer passes here (the one place that records a
    refusal): the response is kept in the request's ledger, where RateLimitHeadersMiddleware
    finds it and writes it itself, status, headers and body (in the error format's shape),
    whatever the app's exception handlers made of the exception. Without the middleware,
    FastAPI's handler answers {"detail": ...} with the same status and headers."""
    ledger = request.scope.get(_TOKENS_KEY)
    if isinstance(ledger, _TokenLedger):
        ledger.refusal = (status, headers, body)
    raise RateLimitRefusal(status, detail, headers, body)


def _record_extra(request: Request, response: Response, extra: list[tuple[str, str]]) -> None:
    """The provider family's headers of an allowed decision, on every response type."""
    decision_record = request.scope.get(_SCOPE_KEY)
    if isinstance(decision_record, _AllowedDecision):
        decision_record.extra = extra
    for name, value in extra:
        response.headers[name] = value


# --- token budgets: reserve before the route, reconcile after the response -----------------
