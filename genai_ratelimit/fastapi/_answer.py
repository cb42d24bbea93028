"""The answer room: a plan's outcome (`_plan.Outcome`) as status, headers and body.

One function, `answer`, over every verdict: the contract's X-RateLimit-* and, beside them,
the error format's family (OpenAI's or Anthropic's x-ratelimit-* headers and error bodies),
the IETF RateLimit fields, and shadow mode (a verdict renamed X-RateLimit-Shadow-*, never
enforced). Allowed headers reach every response type through the ASGI scope, where
RateLimitHeadersMiddleware finds them; a refusal is kept in the request's ledger, where the
middleware writes it whatever the app's exception handlers make of the exception.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, NoReturn

from fastapi import HTTPException, Request, Response

from ..periods import BudgetPeriod
from ..prices import PriceTable
from ..reservation import Resource
from ._ietf_headers import Policy, ServiceLimit, ietf_headers
from ._ledger import _TOKENS_KEY, _TokenLedger
from ._openai_headers import (
    UNAVAILABLE_MESSAGE,
    ResourceHeaders,
    error_body,
    family_headers,
    format_duration,
    retry_headers,
    rfc3339,
    too_large_error_body,
)
from ._plan import Abandoned, Allowed, Facts, Outcome, Refused, Windows, window_name

if TYPE_CHECKING:
    from ._dependency import RateLimit

logger = logging.getLogger("genai_ratelimit")


_SCOPE_KEY = "genai_ratelimit.decision"
# The allowed decisions already taken for this request, by (key space, key identity, windows):
# a second dependency that would count the same request in the same keys reuses the decision.
_COUNTED_KEY = "genai_ratelimit.counted"
# The ids of the shared decisions shadow mode already counted as would-refuse for this request.
_SHADOWED_KEY = "genai_ratelimit.shadowed"


class _AllowedDecision:
    """The tightest allowed decision of this request (several RateLimit dependencies on one
    route keep the one with the fewest remaining; ties: the shorter window). Lives in the ASGI
    scope; the middleware puts it there before the app runs, so shallow scope copies share it."""

    __slots__ = ("limit", "remaining", "window_seconds", "extra", "shadow", "middleware")

    def __init__(self, middleware: bool = False) -> None:
        # Made by RateLimitHeadersMiddleware, which writes the headers onto the response
        # itself: the dependency then leaves FastAPI's sub-response alone.
        self.middleware = middleware
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

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        """headers(), as the ASGI message carries them (latin-1 bytes), for the middleware.
        The names and the limit's and window's values come from small caches."""
        raw = [(_header_name(name), value.encode("latin-1"))
               for name, value in (*self.extra, *self.shadow)] if self.extra or self.shadow else []
        if self.remaining < 0:
            return raw
        return [(b"x-ratelimit-limit", _number_bytes(self.limit)),
                (b"x-ratelimit-remaining", str(self.remaining).encode()),
                (b"x-ratelimit-window", _window_bytes(self.window_seconds)), *raw]


@functools.lru_cache(maxsize=256)
def _header_name(name: str) -> bytes:
    """A header name in latin-1 (names come from a small set: this package's)."""
    return name.encode("latin-1")


@functools.lru_cache(maxsize=1024)
def _number_bytes(number: int) -> bytes:
    """A limit as header bytes (limits come from the configuration: a small set)."""
    return str(number).encode()


@functools.lru_cache(maxsize=256)
def _window_bytes(window_seconds: int) -> bytes:
    return window_name(window_seconds).encode("latin-1")


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
    if not decision.middleware:
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
    if not decision.middleware:
        for name, value in decision.headers():
            response.headers[name] = value


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
        if decision_record.middleware:
            return
    for name, value in extra:
        response.headers[name] = value


def answer(dependency: RateLimit, request: Request, response: Response, facts: Facts,
           outcome: Outcome) -> None:
    """Applies a plan's outcome: holds its lease, remembers its decision for the route's other
    dependencies, then each verdict in order (a refusal raises, unless in shadow mode)."""
    if outcome.hold is not None:
        dependency._hold(request, facts.identity, outcome.hold)
    for slot in outcome.slots:  # an upstream's in-flight slot, released with the others
        dependency._hold(request, None, slot)
    if outcome.remember is not None:
        dependency._remember(request, facts.identity, facts.windows, outcome.remember)
    for verdict in outcome.verdicts:
        if isinstance(verdict, Allowed):
            _allowed(dependency, request, response, facts, verdict)
        elif isinstance(verdict, Refused):
            _refused(dependency, request, response, facts, verdict)
        elif isinstance(verdict, Abandoned):
            if verdict.admitted is not None:  # settled as the request ends, like a failed route's
                if verdict.admitted.reservation is not None:
                    dependency._keep(request, facts.tier, verdict.admitted.reservation)
                if verdict.admitted.spend is not None:
                    dependency._keep_spend(request, facts.tier, verdict.admitted.spend)
            abandoned(dependency, request)
        else:
            dependency._unavailable(request, facts.identity, verdict.error)


def abandoned(dependency: RateLimit, request: Request) -> NoReturn:
    """The client left while its request waited in a queue: counted queue_abandoned, and
    answered 499 (nginx's "client closed request"; nobody reads it: the status is for the
    access log and the middleware), without running the route. The slots it held are
    released as the request ends (RateLimitHeadersMiddleware)."""
    dependency._count(request, "queue_abandoned")
    refuse(request, 499, "Client closed request", {}, {"detail": "Client closed request"})


def _allowed(dependency: RateLimit, request: Request, response: Response, facts: Facts,
             verdict: Allowed) -> None:
    if verdict.reservation is not None:
        dependency._keep(request, facts.tier, verdict.reservation)
    if verdict.spend is not None:
        dependency._keep_spend(request, facts.tier, verdict.spend)
    dependency._count(request, verdict.outcome)
    requests = None
    for state in verdict.states:
        if state.resource == "requests":
            requests = state
            break
    if dependency.mode == "shadow":  # an observer: its verdict in X-RateLimit-Shadow-* only
        shadow = [] if requests is None or requests.remaining is None else \
            allowed_headers(requests.limit, requests.remaining, requests.window_seconds)
        _record_shadow(request, response, shadow_headers(shadow, "allow"))
        return
    if verdict.record and requests is not None and requests.remaining is not None:
        _record_allowed(request, response, requests.limit, requests.remaining, requests.window_seconds)
    # A window is back to its full limit one window length from now (this request is its
    # newest entry): the reset of the provider families' headers.
    error_format = dependency.error_format
    extra = [] if error_format == "plain" else family_headers(error_format, verdict.now_ms, *[
        ResourceHeaders(s.resource, s.limit, s.remaining, s.window_seconds * 1000)
        for s in verdict.states])
    if dependency._partition_keys is not None:
        extra += ietf_fields(dependency, facts, [
            (s.resource, s.window_seconds, s.remaining or 0, s.window_seconds) for s in verdict.states])
    if verdict.spend is not None and verdict.spend.hold.periods:
        held = verdict.spend
        tightest = min(held.hold.periods, key=lambda p: (p.remaining, p.period_end_ms))
        extra += spend_headers(held.table, tightest)
    _record_extra(request, response, extra)


def _refused(dependency: RateLimit, request: Request, response: Response, facts: Facts,
             verdict: Refused) -> None:
    dependency._count(request, verdict.outcome, verdict.window_seconds, verdict.resource, verdict.scope)
    error_format = dependency.error_format
    if verdict.spend is not None:
        _refused_spend(dependency, request, response, facts, verdict)
        return
    if verdict.message is None:  # an estimate no wait can make fit
        limit = int(verdict.contract[0][1])
        assert verdict.window_seconds is not None
        body = too_large_error_body(error_format, "tokens", verdict.window_seconds, limit,
                                    verdict.requested)
        message = detail = body["detail"]
    else:
        message, detail = verdict.message, "Rate limit exceeded"
        resource: Resource = "tokens" if verdict.resource == "tokens" else "requests"
        body = error_body(error_format, 429, detail, message, resource)
    refusal = list(verdict.contract)
    if verdict.family is not None:
        refusal += family_headers(error_format, verdict.now_ms, *verdict.family)
    if verdict.ietf is not None:
        refusal += ietf_fields(dependency, facts, verdict.ietf)
    if dependency.mode == "shadow":
        dependency._would_refuse(request, response, facts.identity, verdict.once, message, refusal)
        return
    retry = [("x-should-retry", "false")] if verdict.retry is None else \
        retry_headers(*verdict.retry, dependency.max_client_wait_seconds)
    refuse(request, 429, detail, {**dict(retry), **dict(refusal)}, body)


def spend_headers(table: PriceTable, period: BudgetPeriod) -> list[tuple[str, str]]:
    """The money family of one budget: x-ratelimit-{limit,remaining}-spend in the currency's
    unit (a decimal string), x-ratelimit-reset-spend (RFC 3339: the period's end),
    x-ratelimit-spend-budget (level/name) and x-ratelimit-spend-currency."""
    budget = period.budget
    return [("x-ratelimit-limit-spend", _money(table, budget.limit)),
            ("x-ratelimit-remaining-spend", _money(table, period.remaining)),
            ("x-ratelimit-reset-spend", rfc3339(period.period_end_ms)),
            ("x-ratelimit-spend-budget", f"{budget.level or 'key'}/{budget.name}"),
            ("x-ratelimit-spend-currency", table.currency)]


def _money(table: PriceTable, amount: int) -> str:
    """An amount of money units in the currency's unit, as plain decimal text ("0.45")."""
    return format(table.to_currency(amount), "f")


_SPEND_CODES = {"permanent": "spend_too_large", "until_reset": "insufficient_quota",
                "in_flight": "rate_limit_exceeded"}


def _refused_spend(dependency: RateLimit, request: Request, response: Response, facts: Facts,
                   verdict: Refused) -> None:
    """The 429 of a refusal by a money budget: permanent (x-should-retry: false, no
    Retry-After), until_reset (Retry-After at the period's end: x-should-retry false when
    that is beyond max_client_wait_seconds), in_flight (a short Retry-After the SDKs
    retry)."""
    assert verdict.spend is not None
    hold, spend = verdict.spend
    period, reason = hold.refused_by, hold.reason
    assert period is not None and reason is not None
    table, budget = spend.table, period.budget
    level = budget.level or "key"
    unit = table.currency
    what = (f"the {level} budget {budget.name} ({_money(table, budget.limit)} {unit} per "
            f"{budget.period})")
    asked = f"{_money(table, period.amount)} {unit}"
    wait_ms = max(0, period.period_end_ms - hold.now_ms)
    if reason == "permanent":
        message = (f"Request too large for {what}: its worst case for model {spend.model} "
                   f"costs {asked}, more than the whole budget. It can never be allowed: "
                   f"reduce the prompt or max_tokens.")
        retry: list[tuple[str, str]] = [("x-should-retry", "false")]
    elif reason == "until_reset":
        message = (f"Spend budget exhausted: {what} has {_money(table, period.remaining)} "
                   f"{unit} left, less than this request's worst case of {asked}. It resets "
                   f"at {rfc3339(period.period_end_ms)}, in {format_duration(wait_ms)}.")
        retry = retry_headers(-(-wait_ms // 1000), wait_ms, dependency.max_client_wait_seconds)
    else:
        seconds = 1.0 if dependency.in_flight_retry_after is None else dependency.in_flight_retry_after
        wait_ms = max(0, min(round(seconds * 1000), 60_000))
        message = (f"Spend budget held by requests in flight: {what} has no room for this "
                   f"request's worst case of {asked} until requests in flight settle. Please "
                   f"try again in {format_duration(wait_ms)}.")
        retry = retry_headers(-(-wait_ms // 1000), wait_ms, dependency.max_client_wait_seconds)
    detail = "Spend budget exceeded"
    body = error_body(dependency.error_format, 429, detail, message, "requests")
    if isinstance(body.get("error"), dict) and dependency.error_format == "openai":
        body["error"].update(type="spend", code=_SPEND_CODES[reason])
    body["budget"] = {"level": level, "name": budget.name, "reason": reason,
                      "currency": unit, "limit": _money(table, budget.limit),
                      "remaining": _money(table, period.remaining), "requested": _money(table, period.amount),
                      "reset_at": rfc3339(period.period_end_ms), "model": spend.model}
    refusal = [("X-RateLimit-Limit", str(budget.limit)), ("X-RateLimit-Remaining", "0"),
               ("X-RateLimit-Window", budget.period), ("X-RateLimit-Scope", level),
               ("X-RateLimit-Resource", "spend")]
    if dependency.mode == "shadow":  # X-RateLimit-Shadow-* of the contract's only: no money
        dependency._would_refuse(request, response, facts.identity, None, message, refusal)
        return
    refuse(request, 429, detail, {**dict(retry), **dict(refusal), **dict(spend_headers(table, period))},
           body)


def unavailable(request: Request, error_format: Any) -> NoReturn:
    """The 503 of a limiter that could not decide (on_unavailable="deny")."""
    refuse(request, 503, "Rate limiter unavailable", {"Retry-After": "1", "x-should-retry": "true"},
           error_body(error_format, 503, "Rate limiter unavailable", UNAVAILABLE_MESSAGE))


def ietf_fields(dependency: RateLimit, facts: Facts,
                limits: Any) -> list[tuple[str, str]]:
    """RateLimit-Policy (every window of the budget) and RateLimit (`limits`: (resource,
    window_seconds, remaining, seconds until more)) when headers="ietf"/"both", else []."""
    keys = dependency._partition_keys
    if keys is None:
        return []
    service = [ServiceLimit(_policy_name(resource, seconds), remaining, reset)
               for resource, seconds, remaining, reset in limits]
    return ietf_headers(_ietf_policies(facts.windows, facts.token_windows), service,
                        keys.of(facts.identity))


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
