"""Per-request ledgers kept in the ASGI scope: token reservations and in-flight leases."""

from __future__ import annotations

import functools
import logging
from typing import Any

import anyio
from fastapi import Request
from starlette.concurrency import run_in_threadpool

from .. import RateLimiterError
from ..lease import Lease
from ..prices import TokenUsage
from ..reservation import Reservation
from ._spend import SpendHeld, held_levels

logger = logging.getLogger("genai_ratelimit")


_TOKENS_KEY = "genai_ratelimit.tokens"
# Whether the missing-middleware warning of a TokenRateLimit was logged (once per process).
_warned_no_token_middleware = False


class _TokenLedger:
    """The token reservations of one request (one per TokenRateLimit that allowed it), kept
    in the ASGI scope until the usage is known. `reported` makes the reconcile happen once:
    by record_usage, or by the middleware from the response, whichever comes first."""

    __slots__ = ("entries", "decided", "reported", "refusal", "middleware", "charge_streamed",
                 "prompt_tokens", "tiers", "spend")

    def __init__(self, middleware: bool) -> None:
        self.entries: list[tuple[Any, bool, Reservation]] = []  # (limiter, is async, reservation)
        self.decided = False  # a TokenRateLimit ran for this request
        self.reported = False
        # The refusal of this request (status, headers, body), written by the middleware.
        self.refusal: tuple[int, dict[str, str], dict[str, Any]] | None = None
        self.middleware = middleware  # False: made by a dependency, nothing reads the response
        # aborted_stream="streamed": a stream that ends without its usage is charged what it
        # streamed, plus the prompt's estimate (UsageScanner.streamed_tokens).
        self.charge_streamed = False
        self.prompt_tokens = 0
        # id(reservation) -> (its RequestOutcomes, tier, mode): the tokens by tier.
        self.tiers: dict[int, tuple[Any, str, str]] = {}
        # (limiter, is async, SpendHeld, (its RequestOutcomes, tier, mode)): the money held
        # (TokenRateLimit(prices=...)) and where its settle is counted.
        self.spend: list[tuple[Any, bool, SpendHeld, tuple[Any, str, str]]] = []

    async def reconcile(self, actual: int, leases: _LeaseLedger | None = None,
                        usage: TokenUsage | None = None) -> int:
        """Reconciles every reservation with `actual` tokens. Returns the number of windows
        whose entry was found. A limiter that cannot answer is logged, not raised: the
        reservation then stays as reserved. With `leases` (the middleware, once the response
        is over): a reservation that took its in-flight slot in the same script gives it back
        in the reconcile's script too (reconcile(..., release=True), one round trip)."""
        found = 0
        for limiter, is_async, reservation in self.entries:
            release = leases is not None and reservation.lease is not None and \
                leases.take(reservation.lease)
            try:
                if is_async:
                    one = await limiter.reconcile(reservation, actual, release=release) \
                        if release else await limiter.reconcile(reservation, actual)
                else:
                    one = await run_in_threadpool(
                        functools.partial(limiter.reconcile, reservation, actual, release=True)
                        if release else functools.partial(limiter.reconcile, reservation, actual))
                found += one
                counted = self.tiers.get(id(reservation))
                if one and counted is not None and reservation.tokens is not None:
                    tally, tier, mode = counted  # as the limiter counts: charged, refunded
                    tally.add_tokens("charged", tier=tier, mode=mode, count=actual)
                    if reservation.tokens > actual:
                        tally.add_tokens("refunded", tier=tier, mode=mode,
                                         count=reservation.tokens - actual)
            except RateLimiterError as exc:
                logger.warning("could not reconcile the token reservation of %r with %d tokens "
                               "(it stays at %s): %s", reservation.user_id, actual,
                               reservation.tokens, exc)
        await self.settle(usage)
        return found

    async def settle(self, usage: TokenUsage | None) -> None:
        """Settles every money hold: to the request's exact cost by kind of token when the
        usage says its kinds (prices.cost), else to the amount held (a usage that gives only
        a total is charged the worst case: never less than it may have cost). Each hold
        once; a limiter that cannot answer is logged: the hold then stays until its key
        expires."""
        holds, self.spend = self.spend, []
        for limiter, is_async, held, (tally, tier, mode) in holds:
            actual = held.amount if usage is None else held.table.cost(held.model, usage)
            try:
                if is_async:
                    found = await limiter.settle_budgets(held.hold, actual)
                else:
                    found = await run_in_threadpool(limiter.settle_budgets, held.hold, actual)
            except RateLimiterError as exc:
                logger.warning("could not settle the spend hold %s at %d (it stays held): %s",
                               held.hold.hold_id, actual, exc)
                continue
            if found:  # as the limiter settled it (0: expired, or settled already)
                currency = held.table.currency
                for level in held_levels(held):
                    tally.add_spend("released", tier=tier, level=level, mode=mode,
                                    currency=currency, amount=held.amount)
                    tally.add_spend("settled", tier=tier, level=level, mode=mode,
                                    currency=currency, amount=actual)


# {id(RequestOutcomes): leave()}: this request counted in flight (set by the middleware,
# which calls every leave() when the response is over).
_IN_FLIGHT_KEY = "genai_ratelimit.in_flight"

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
        return self.lease_of(key) is not None

    def take(self, lease: Lease) -> bool:
        """Removes `lease` from the ledger (its release is the caller's now): True when held."""
        kept = [entry for entry in self.entries if entry[3] is not lease]
        taken = len(kept) != len(self.entries)
        self.entries = kept
        return taken

    def lease_of(self, key: tuple[object, ...]) -> Lease | None:
        """The lease this request holds in the lease key `key`, if any."""
        return next((entry[3] for entry in self.entries if entry[0] == key), None)

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


async def record_usage(request: Request, tokens: int, *, usage: object = None) -> int:
    """Reports what this request really spent: reconciles its TokenRateLimit reservation(s)
    with `tokens` (lower refunds, higher charges, 0 removes the tokens entry), now, before
    returning; then the response's own usage is not read. Call it at most once per request
    (from the route, or from inside its streaming generator before the stream ends).
    `usage`: the provider's usage object (a mapping) or a prices.TokenUsage, for a
    TokenRateLimit with prices: its money hold settles to the exact cost by kind; without it
    the hold settles at the worst case held.

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
    by_kind = usage if isinstance(usage, TokenUsage) or usage is None else TokenUsage.from_usage(usage)
    ledger.reported = True
    return await ledger.reconcile(tokens, usage=by_kind)


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


