"""TokenRateLimit: reserve requests and tokens before the route, reconcile after."""

from __future__ import annotations

import inspect
import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, NoReturn

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from typing_extensions import Unpack

from .. import RateLimiterError
from .._openai_headers import (
    ErrorFormat,
    ResourceHeaders,
    error_body,
    family_headers,
    refusal_message,
    retry_headers,
    too_large_error_body,
)
from .._tiers_config import (
    TIER_BUDGET_KEYS,
    tier_token_limits_from_env,
    validate_token_limits,
)
from .._usage import (
    MAX_REQUEST_JSON_BYTES,
    InvalidTokenCount,
    estimate_openai_tokens,
    prompt_tokens,
)
from ..metrics import request_outcomes
from ..reservation import Reservation, Resource, WindowState
from ..reservation import Scope as BudgetScope
from ..tiers import DEFAULT_MAX_TOKENS, DEFAULT_TIER, TIER_TOKEN_LIMITS
from ._dependency import RateLimit, _is_async_limiter
from ._ledger import _ledger_of
from ._options import OnUnavailable, SharedOptions
from ._policy import (
    AsyncWindowLimiter,
    Identify,
    SyncWindowLimiter,
    Windows,
    _now_ms,
    _scope_kind,
    _tightest,
    window_name,
)
from ._responses import (
    _record_allowed,
    _record_extra,
    _record_shadow,
    allowed_headers,
    refuse,
    shadow_headers,
)

logger = logging.getLogger("genai_ratelimit")


Estimate = Callable[[Request], "int | Awaitable[int]"]
AbortedStream = Literal["estimate", "streamed"]

# Bodies that are not JSON by their nature (file and audio uploads, forms): the default
# estimate does not read them (the tier's default maximum), and does not refuse them.
_FORM_MEDIA_TYPES = frozenset(("multipart/form-data", "application/x-www-form-urlencoded"))
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def invalid_request_body(error_format: ErrorFormat, message: str, param: str | None = None,
                         detail: object = None) -> dict[str, Any]:
    """The body of a 4xx for a request the upstream would refuse as malformed, in the
    route's error format: OpenAI's `error` object (type invalid_request_error, `param` the
    field), Anthropic's {"type": "error", "error": {"type": "invalid_request_error"}}; every
    format keeps `detail` (the message, or FastAPI's list of validation errors)."""
    body: dict[str, Any] = {"detail": message if detail is None else detail}
    if error_format == "openai":
        body["error"] = {"message": message, "type": "invalid_request_error", "param": param,
                         "code": None}
    elif error_format == "anthropic":
        body["type"] = "error"
        body["error"] = {"type": "invalid_request_error", "message": message}
    return body


def _json_safe(value: object) -> object:
    """value itself when any JSON encoder writes it back (and it is short), else its
    repr, at most 40 characters (inf, nan, a nested document)."""
    if value is None or isinstance(value, (bool, int, str)) or (
            isinstance(value, float) and math.isfinite(value)):
        shown = repr(value)
        if len(shown) <= 40:
            return value
    else:
        shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _json_error(error: ValueError) -> str:
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at line {error.lineno} column {error.colno}"
    if isinstance(error, UnicodeDecodeError):
        return "it is not UTF-8 text"
    text = str(error)
    return text if len(text) <= 80 else text[:77] + "..."



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
    - the response, read by RateLimitHeadersMiddleware as it passes (docs/tokens-and-identity.md):
      OpenAI chat completions (`usage.total_tokens`, or a stream's last chunk carrying usage),
      OpenAI Responses (`usage`, or a stream's response.completed), Anthropic Messages
      (input + output + cache tokens, or a stream's message_start + message_delta).
    A request whose usage is never reported keeps its reservation: never a silent refund,
    unless aborted_stream="streamed" (below).

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
                        A maximum the upstream would refuse (max_tokens=1.5, "lots", true) is
                        the route's 422, and a body that is not a JSON object (not JSON, [1, 2],
                        empty under a JSON content-type) its 400, before anything is reserved,
                        in the route's error_format (a form upload, or a request without a
                        body, is not read: the default maximum).
    aborted_stream      what a server-sent event stream that ends without its usage costs
                        (a client that disconnected, an upstream that broke off):
                        "estimate" (default) keeps the reservation; "streamed" charges the
                        prompt (the input the stream reported, else the estimate's) plus the
                        text the stream delivered (its characters / 4, at least a token per
                        chunk that carried text).

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

    _charges_tokens = True

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
        aborted_stream: AbortedStream = "estimate",
        **options: Unpack[SharedOptions],
    ) -> None:
        if aborted_stream not in ("estimate", "streamed"):
            raise ValueError(f"aborted_stream must be 'estimate' or 'streamed', got {aborted_stream!r}")
        self.aborted_stream: AbortedStream = aborted_stream
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
        super().__init__(limiter, tier_limits, identify, on_unavailable, namespace, **options)
        if token_limits is None:
            token_limits = tier_token_limits_from_env() or TIER_TOKEN_LIMITS
        self.token_limits: dict[str, dict[str, int]] = validate_token_limits(token_limits)
        self._token_windows: dict[str, Windows] = {
            tier: tuple((budget[key], seconds) for key, seconds in TIER_BUDGET_KEYS.items()
                        if key in budget)
            for tier, budget in self.token_limits.items()
        }
        self.estimate: Estimate | None = estimate
        # Whether the in-flight slot rides on the reserve (decided on first use: the limiter).
        self._fused: bool | None = None
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

    @staticmethod
    def _fuses(limiter: Any) -> bool:
        """Whether `limiter.reserve` takes in_flight= (this package's limiters do)."""
        try:
            return "in_flight" in inspect.signature(limiter.reserve).parameters
        except (TypeError, ValueError):
            return False

    def key_budgets(self) -> list[tuple[tuple[object, ...], object]]:
        return [*super().key_budgets(),
                ((*self._space(), self.mode, self.namespace, "tokens"),
                 tuple(sorted(self._token_windows.items())))]

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
        body = await request.body()
        document = self._request_document(request, body)
        try:
            tokens = estimate_openai_tokens(document, default)
        except InvalidTokenCount as invalid:  # the upstream would refuse it too
            error = {"type": "int_parsing", "loc": ("body", invalid.field), "msg": str(invalid),
                     "input": _json_safe(invalid.value)}
            # The middleware writes it in the route's format (FastAPI's 422 without it).
            _ledger_of(request).refusal = (422, {}, invalid_request_body(
                self.error_format, str(invalid), invalid.field, [error]))
            raise RequestValidationError([error]) from None
        if self.aborted_stream == "streamed":
            ledger = _ledger_of(request)
            ledger.prompt_tokens = max(ledger.prompt_tokens, prompt_tokens(document))
        return tokens

    def _request_document(self, request: Request, body: bytes) -> Mapping[str, Any] | bytes:
        """The body the default estimate reads: a JSON object (decoded here, once); the bytes
        themselves when they are a form upload or too large to decode (the estimate counts
        every byte then), or when there is no body and none is announced (no JSON
        content-type). Any other body the upstream would refuse, and the route's `await
        request.json()` would fail on, is refused here: 400 naming the problem, in the
        route's error format, before anything is reserved."""
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type in _FORM_MEDIA_TYPES or len(body) > MAX_REQUEST_JSON_BYTES:
            return body
        if not body:
            if media_type != "application/json" and not media_type.endswith("+json"):
                return body  # no body at all: the default maximum, as for any request
            self._bad_body(request, "The request body is empty; expected a JSON object.")
        try:
            document = json.loads(body)
        except RecursionError:
            self._bad_body(request, "The request body is nested too deeply to decode.")
        except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, too many digits
            self._bad_body(request, f"The request body is not valid JSON ({_json_error(error)}); "
                                    "expected a JSON object.")
        if not isinstance(document, dict):
            kind = _JSON_KINDS.get(type(document), "not an object")
            self._bad_body(request, f"The request body must be a JSON object, got {kind}.")
        return document

    def _bad_body(self, request: Request, message: str) -> NoReturn:
        refuse(request, 400, message, {}, invalid_request_body(self.error_format, message))

    async def __call__(self, request: Request, response: Response) -> None:
        found = self._identity_and_tier(request)
        if found is None:
            return
        identity, tier = found
        windows, token_windows = self._windows[tier], self.token_windows_of(tier)
        _ledger_of(request).decided = True
        tokens = await self.estimate_tokens(request, tier)
        scopes = await self._scopes.of(request) if self._scopes else ()
        if self._refuse_if_too_large(request, response, identity, windows, token_windows, tokens,
                                     scopes):
            return  # shadow mode: the route runs, nothing was reserved
        limiter = self.limiter
        # An enforced cap on a limiter that can: the slot is taken in the reserve's own script
        # execution (one round trip; all or nothing) and given back with the reconcile's. A
        # shadow cap never fuses: it takes its slot apart, in its own keys.
        slot = None
        if self._fused is None:
            self._fused = self.mode == "enforce" and self._fuses(limiter)
        if self._fused:
            slot = self._in_flight_slot(request, response, identity, tier)
        elif not await self._take_slot_async(request, response, identity, tier, self._is_async):
            return
        counted = self._already_counted(request, identity, windows)
        # Requests already counted by another dependency of this route: reserve tokens only.
        request_windows: Windows = () if counted is not None else windows
        arguments: dict[str, Any] = {"cost": 1, "token_windows": token_windows, "tokens": tokens}
        if scopes:
            arguments["scopes"] = scopes
        if slot is not None:
            arguments["in_flight"] = (slot[0], self.lease_seconds)
        try:
            reservation: Reservation = await self._limiter_call(
                limiter.reserve, identity, request_windows, **arguments)
        except RateLimiterError as exc:
            self._unavailable(request, identity, exc)
            return
        if slot is not None and reservation.lease is not None:
            # Granted: held for the middleware (reconcile-and-release); refused: the 429.
            self._hold(request, response, identity, slot, limiter, self._is_async, reservation.lease)
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
        ledger.charge_streamed = ledger.charge_streamed or self.aborted_stream == "streamed"
        if reservation.tokens and (reservation.member or reservation.shared_entries):
            tally = request_outcomes(limiter)  # as the limiter counts reserved tokens
            tally.add_tokens("reserved", tier=tier, mode=self.mode, count=reservation.tokens)
            ledger.tiers[id(reservation)] = (tally, tier, self.mode)
        requests_state = _tightest(reservation.windows, "requests")
        if counted is None and requests_state is not None and requests_state.remaining is not None:
            decision = (True, requests_state.remaining, 0, requests_state.window_seconds)
            self._remember(request, identity, windows, decision)
            if self.mode != "shadow":
                _record_allowed(request, response, requests_state.limit, requests_state.remaining,
                                requests_state.window_seconds)
        elif counted is not None:
            _, remaining, _, window_seconds = counted
            limit = next(lim for lim, seconds in windows if seconds == window_seconds)
            requests_state = WindowState(limit, window_seconds, "requests", remaining)
        self._count(request, "allowed")
        tokens_state = _tightest(reservation.windows, "tokens")
        states = [state for state in (requests_state, tokens_state) if state is not None]
        if self.mode == "shadow":  # an observer: its verdict in X-RateLimit-Shadow-* only
            shadow = [("X-RateLimit-Shadow-Tokens-Remaining", str(tokens_state.remaining))
                      ] if tokens_state is not None and tokens_state.remaining is not None else []
            if requests_state is not None and requests_state.remaining is not None:
                shadow = allowed_headers(requests_state.limit, requests_state.remaining,
                                         requests_state.window_seconds) + shadow
            _record_shadow(request, response, shadow_headers(shadow, "allow"))
            return
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
        # The scope of the window that cannot fit it: the user's own, else a scope's.
        kind = "user" if (limit, window_seconds) in token_windows else next(
            _scope_kind(s) for s in scopes if (limit, window_seconds) in s.token_windows)
        self._count(request, "too_large", window_seconds, "tokens", kind)
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
        headers = {**dict(refusal[:3]), "x-should-retry": "false", **dict(refusal[3:])}
        refuse(request, 429, body["detail"], headers, body)

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
        self._count(request, "rejected", window_seconds, resource, "user")
        if self.mode == "shadow":
            self._would_refuse(request, response, identity, None, limit, window_seconds,
                               message, refusal)
            return
        headers = {
            **dict(retry_headers(reservation.retry_after_s, retry_ms, self.max_client_wait_seconds)),
            **dict(refusal),
        }
        refuse(request, 429, "Rate limit exceeded", headers,
               error_body(self.error_format, 429, "Rate limit exceeded", message, resource))

