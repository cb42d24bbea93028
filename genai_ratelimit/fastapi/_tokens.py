"""TokenRateLimit: reserve requests and tokens before the route, reconcile after."""

from __future__ import annotations

import inspect
import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, NoReturn

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from typing_extensions import Unpack

from .._tiers_config import (
    TIER_BUDGET_KEYS,
    tier_spend_limits_from_env,
    tier_token_limits_from_env,
    validate_token_limits,
)
from ..periods import DEFAULT_HOLD_SECONDS
from ..prices import PriceTable, UnpricedModel
from ..reservation import Reservation
from ..tiers import DEFAULT_MAX_TOKENS, DEFAULT_TIER, TIER_TOKEN_LIMITS
from ._answer import refuse
from ._clients import Identify
from ._dependency import _AsyncRateLimit
from ._ledger import _ledger_of
from ._openai_headers import ErrorFormat
from ._options import OnUnavailable, SharedOptions
from ._plan import AsyncWindowLimiter, Facts, SyncWindowLimiter, Windows
from ._scopes import note_upstreams
from ._spend import (
    Amount,
    LimitOf,
    SpendConfig,
    SpendFacts,
    SpendHeld,
    SpendLevel,
    held_levels,
)
from ._usage import (
    MAX_REQUEST_JSON_BYTES,
    InvalidTokenCount,
    estimate_openai_tokens,
    json_object,
    prompt_tokens,
    requested_completion_tokens,
    requested_model,
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


def unpriced(request: Request, error_format: Any, model: str | None) -> NoReturn:
    """The 400 of a request whose model the price table does not price (never free)."""
    shown = "no model" if model is None else f"model {model[:256]!r}"
    message = (f"The request names {shown}, which this service's price table does not price: "
               f"it cannot be admitted against a spend budget.")
    body = invalid_request_body(error_format, message, "model")
    if isinstance(body.get("error"), dict) and error_format == "openai":
        body["error"]["code"] = "model_not_priced"
    refuse(request, 400, message, {"x-should-retry": "false"}, body)




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



class TokenRateLimit(_AsyncRateLimit):
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
    x-ratelimit-limit|remaining|reset-requests|tokens (see genai_ratelimit.fastapi._openai_headers
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
        tier_limits: Mapping[str, Mapping[str, float]] | None = None,
        identify: Identify | None = None,
        on_unavailable: OnUnavailable = "deny",
        namespace: str | None = None,
        *,
        token_limits: Mapping[str, Mapping[str, int]] | None = None,
        estimate: Estimate | None = None,
        default_max_tokens: int | Mapping[str, int] = DEFAULT_MAX_TOKENS,
        aborted_stream: AbortedStream = "estimate",
        prices: PriceTable | None = None,
        spend_limits: Mapping[str, Mapping[str, Amount]] | None = None,
        spend_levels: Sequence[SpendLevel] = (),
        spend_limit_of: LimitOf | None = None,
        spend_tz: str = "UTC",
        spend_hold_seconds: int = DEFAULT_HOLD_SECONDS,
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
        if prices is None and (spend_limits or spend_levels or spend_limit_of is not None):
            raise ValueError("spend_limits, spend_levels and spend_limit_of need prices= "
                             "(a genai_ratelimit.PriceTable)")
        if spend_limits is None and prices is not None:
            spend_limits = tier_spend_limits_from_env()  # type: ignore[assignment]
        self.spend: SpendConfig | None = None if prices is None else SpendConfig(
            prices, spend_limits, spend_levels, spend_limit_of, spend_tz, spend_hold_seconds)

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

    def key_budgets(self) -> list[tuple[tuple[object, ...], object]]:
        return [*super().key_budgets(),
                ((*self._space(), self.mode, self.namespace, "tokens"),
                 tuple(sorted(self._token_windows.items())))]

    def token_windows_of(self, tier: str) -> Windows:
        """The (limit, window_seconds) token windows of a tier (the free tier's when it has none)."""
        return self._token_windows.get(tier) or self._token_windows[DEFAULT_TIER]

    async def estimate_tokens(self, request: Request, tier: str) -> int:
        """The tokens this request is reserved for: `estimate(request)`, else the default."""
        return (await self._estimate(request, tier))[0]

    async def _estimate(self, request: Request, tier: str) -> tuple[int, Mapping[str, Any] | None]:
        """(estimate_tokens, the JSON object of the body when the default estimate decoded
        one: the scopes read its `model` there instead of decoding the body again)."""
        if self.estimate is not None:
            value = self.estimate(request)
            if inspect.isawaitable(value):
                value = await value
            return self._positive("the token estimate", value), None
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
        return tokens, document if isinstance(document, Mapping) else None

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

    async def _facts_async(self, request: Request) -> Facts | None:
        """RateLimit's facts, plus the token windows, the estimate (which may read the body)
        and the request's scopes."""
        facts = self._facts(request)
        if facts is None:
            return None
        tier = facts.tier
        _ledger_of(request).decided = True
        if type(self).estimate_tokens is TokenRateLimit.estimate_tokens:
            tokens, document = await self._estimate(request, tier)
        else:  # a subclass's own estimate
            tokens, document = await self.estimate_tokens(request, tier), None
        scopes, slots = await self._scopes.with_slots(request, document) if self._scopes \
            else ((), ())
        if scopes:
            note_upstreams(request, self.limiter, self._limiter_is_async,
                           self._scopes.upstreams_in(scopes))
        spend = None if self.spend is None else await self._spend_facts(request, facts, document)
        return Facts(facts.identity, tier, facts.windows, self.token_windows_of(tier), tokens,
                     scopes, facts.counted, facts.cap, facts.held, spend=spend,
                     wait=(self._scopes.wait_in(scopes, self.tier_max_wait.get(tier))
                           if scopes else None),
                     slots=self._checked_slots(request, slots, tier))

    async def _spend_facts(self, request: Request, facts: Facts,
                           document: Mapping[str, Any] | None) -> SpendFacts | None:
        """The money budgets of this request and its worst case: its model's price of the
        prompt's estimate (at the dearest input price) plus the output it may ask for
        (max_completion_tokens / max_tokens / max_output_tokens, times n, else the tier's
        default_max_tokens). A model the table does not price is a 400 naming it before
        anything is reserved (a shadow budget holds nothing for it instead)."""
        config = self.spend
        assert config is not None
        if document is None:
            document = json_object(await request.body())
        model = requested_model(document)
        default = self.default_max_tokens.get(facts.tier, self._default_max_fallback)
        try:
            output = requested_completion_tokens(document, default)
        except InvalidTokenCount:  # a custom estimate's request: its own rules
            output = default
        shadow = self.mode == "shadow"
        try:
            amount = config.table.worst_case(model or "", prompt_tokens(document), output)
        except UnpricedModel:
            if shadow:
                return None
            unpriced(request, self.error_format, model)
        if amount == 0:
            return None  # a free model's request holds nothing
        user_id = facts.identity[len("shadow:"):] if shadow else facts.identity
        budgets = await config.budgets(request, facts.identity, user_id, facts.tier, shadow)
        if not budgets:
            return None
        return SpendFacts(budgets, amount, config.hold_seconds, model or "", config.table)

    def _keep_spend(self, request: Request, tier: str, held: SpendHeld) -> None:
        """An allowed money hold, kept in the request's ledger for the settle, and counted
        (request_outcomes: the money held by tier and level, the budgets' use). Counted
        here, not in the limiter: the tier is this layer's, and a hold_budgets call of the
        app's own holds money of its own units."""
        tally = self._of_limiter()[2]
        currency = held.table.currency
        for level in held_levels(held):
            tally.add_spend("held", tier=tier, level=level, mode=self.mode, currency=currency,
                            amount=held.amount)
        for period in held.hold.periods:
            tally.add_budget_use(tier=tier, level=period.budget.level or "key",
                                 limit=period.budget.limit, remaining=period.remaining)
        _ledger_of(request).spend.append((self.limiter, self._limiter_is_async, held,
                                          (tally, tier, self.mode)))


    def _fuses(self, limiter: Any) -> bool:
        """An enforced cap on a limiter whose `reserve` takes in_flight= (this package's): the
        slot is taken in the reserve's own script execution (one round trip; all or nothing)
        and given back with the reconcile's. A shadow cap never fuses: it takes its slot
        apart, in its own keys."""
        if self.mode != "enforce":
            return False
        try:
            return "in_flight" in inspect.signature(limiter.reserve).parameters
        except (TypeError, ValueError):
            return False

    def _keep(self, request: Request, tier: str, reservation: Reservation) -> None:
        """An allowed reservation, kept in the request's ledger for the reconcile."""
        ledger = _ledger_of(request)
        ledger.entries.append((self.limiter, self._limiter_is_async, reservation))
        ledger.charge_streamed = ledger.charge_streamed or self.aborted_stream == "streamed"
        if reservation.tokens and (reservation.member or reservation.shared_entries):
            tally = self._of_limiter()[2]  # as the limiter counts reserved tokens
            tally.add_tokens("reserved", tier=tier, mode=self.mode, count=reservation.tokens)
            ledger.tiers[id(reservation)] = (tally, tier, self.mode)
