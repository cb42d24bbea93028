"""The decision of one dependency for one request, as an I/O-free plan.

`plan(facts, policy)` is a generator: it yields each limiter call it needs (a `Call`: the
method's name and its arguments), is sent each call's answer (or has the limiter's
RateLimiterError thrown into it), and returns an `Outcome`: the in-flight lease to hold, the
decision to remember for the route's other dependencies, and its verdicts in order — `Allowed`,
`Refused` (one value for every kind of 429: windows, tokens, scopes, concurrency, too large,
money budgets) or
`Unavailable`. In enforce mode a refusal is the last verdict; in shadow mode the plan goes on
(a request beyond its in-flight cap is still decided by its windows).

RateLimit and TokenRateLimit differ in their `Facts` (a token estimate or none), not in this
code; the drivers (`run`, `run_async`) only move the calls to the limiter, with or without
`await`, and `_answer` turns the outcome into status, headers and body. Nothing here reads a
request, a clock other than `Policy.clock`, or Redis.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from .. import RateLimiterError
from ..lease import HINT_WITHOUT_HISTORY_MS, Lease
from ..periods import BudgetHold
from ..reservation import Reservation, Resource, WindowState
from ..reservation import Scope as BudgetScope
from ..shares import Shares, classes_of
from ._openai_headers import ResourceHeaders, format_duration, refusal_message
from ._spend import SpendFacts, SpendHeld

Windows = tuple[tuple[int, int], ...]
Decision = tuple[bool, int, int, int]

# 0 is no window length: it stands for the in-flight cap (max_in_flight) in the headers.
CONCURRENT = 0
_WINDOW_NAMES = {CONCURRENT: "concurrent", 1: "second", 60: "minute", 3_600: "hour", 86_400: "day"}


class SyncWindowLimiter(Protocol):
    def check_windows(self, user_id: str, windows: Sequence[tuple[int, int]]) -> Decision: ...


class AsyncWindowLimiter(Protocol):
    def check_windows(self, user_id: str, windows: Sequence[tuple[int, int]]) -> Awaitable[Decision]: ...


def window_name(window_seconds: int) -> str:
    """The X-RateLimit-Window value: "second", "minute", "hour", "day", else e.g. "600s"."""
    return _WINDOW_NAMES.get(window_seconds, f"{window_seconds}s")


def scope_kind(scope: BudgetScope) -> str:
    """X-RateLimit-Scope of a refusal by this scope: upstream, route or model."""
    return "upstream" if scope.shared else scope.name.split(":", 1)[0]


def now_ms() -> int:
    return int(time.time() * 1000)


def tightest(states: Sequence[WindowState], resource: str) -> WindowState | None:
    """The user's own window of `resource` with the fewest units remaining (ties: the
    shorter), among those the decision reached (scopes' windows left out)."""
    best: WindowState | None = None
    for w in states:  # the first of the least (remaining, window_seconds), as min() picks
        if w.resource == resource and w.remaining is not None and w.scope is None and (
                best is None or (w.remaining, w.window_seconds) < (best.remaining, best.window_seconds)):
            best = w
    return best


def in_flight_wait(retry_after: float, lease_expiry_ms: int) -> tuple[int, int]:
    """(retry-after-ms, Retry-After in whole seconds, rounded up) of a concurrency 429: the
    dependency's in_flight_retry_after (a slot frees when a request in flight ends, usually
    within seconds), never later than the soonest lease's expiry, which frees a slot at the
    latest. Both are at most 60 s, the longest wait the openai and anthropic SDKs act on."""
    retry_ms = max(0, min(round(retry_after * 1000), lease_expiry_ms, 60_000))
    return retry_ms, -(-retry_ms // 1000)


# --- what goes in ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Policy:
    """What a dependency decides with, the same for each of its requests."""

    shadow: bool = False
    lease_seconds: float = 300
    # A fixed Retry-After (s) for the concurrency 429 instead of the limiter's hint.
    in_flight_retry_after: float | None = None
    # The in-flight slot rides on the token reserve's own script execution.
    fused: bool = False
    # The method that decides request windows: check_windows or its detailed twin.
    decide: str = "check_windows"
    clock: Callable[[], int] = now_ms


class UpstreamSlot(NamedTuple):
    """An upstream's in-flight cap (Upstream(in_flight=...)), as a request takes one of its
    slots: acquire(name, limit, lease_seconds, shares=shares, share_class=the request's tier
    when the shares name it). wait: (max_wait, max_queue, max_queue_per_tenant) when a
    request the cap refuses waits in its queue (acquire(max_wait=...), the tenant the
    request's key), None: refused at once."""

    name: str
    limit: int
    lease_seconds: int
    shares: Shares | None
    wait: tuple[float, int, int] | None = None


@dataclass(slots=True)
class Facts:
    """What is known of one request before the limiter is asked."""

    identity: str
    tier: str
    windows: Windows
    # A TokenRateLimit's: the token windows and the estimate (None: a request budget).
    token_windows: Windows = ()
    tokens: int | None = None
    scopes: tuple[BudgetScope, ...] = ()
    # The decision of another dependency of this route on the same keys and budget.
    counted: Decision | None = None
    # The in-flight cap of the tier (None: none), and the lease another dependency of this
    # request already holds on the same key (the cap is then checked against it, not taken).
    cap: int | None = None
    held: Lease | None = None
    # The tier's minute budget as GCRA, (per_minute, 60, burst) (the tier's `burst`): decided
    # with the other windows in one check_windows_detailed(gcra=...) call; None: a log.
    gcra: tuple[int, int, int] | None = None
    # A TokenRateLimit with prices: the money budgets to hold once the tokens are reserved.
    spend: SpendFacts | None = None
    # How a request its upstreams' caps refuse may wait in their queue: the Upstream's
    # (max_wait, max_queue, max_queue_per_tenant); None: refused at once. The wait is the
    # reserve call's own plan (genai_ratelimit/wait_queue.py); its tenant is the identity.
    wait: tuple[float, int, int] | None = None
    # The in-flight caps of the request's upstreams: one slot of each is taken, after the
    # tier's own slot and before the windows, and held until the response is over.
    slots: tuple[UpstreamSlot, ...] = ()


class Call(NamedTuple):
    """One limiter call: limiter.<method>(*args, **kwargs)."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


# --- what comes out -------------------------------------------------------------------------


@dataclass(slots=True)
class Allowed:
    """The request runs. `states`: its tightest own windows (requests, then tokens);
    `record`: whether the requests state is this route's contract trio (not when another
    dependency's decision already gave it); `reservation`: a token reservation to reconcile."""

    states: tuple[WindowState, ...]
    now_ms: int
    record: bool = True
    reservation: Reservation | None = None
    # The money held for this request (a TokenRateLimit with prices), settled with its usage.
    spend: SpendHeld | None = None
    # "queued_then_allowed" when it waited in an upstream's queue first
    outcome: str = "allowed"


@dataclass(slots=True)
class Refused:
    """A 429. `contract`: its X-RateLimit-* headers; `retry`: (Retry-After s, retry-after-ms),
    None when no wait can help (x-should-retry: false); `family`: the provider family's
    states (None: left out, e.g. a scope's or a concurrency 429); `ietf`: the IETF RateLimit
    field's (resource, window, remaining, reset) (None: no IETF fields); `message`: what the
    body says (None for a too-large estimate: its body says it). `outcome`, `resource`,
    `window_seconds` and `scope` are what the metrics count it as; `once`: the decision
    shadow mode counts once per request when two dependencies share it (None: always)."""

    contract: tuple[tuple[str, str], ...]
    retry: tuple[int, int] | None
    message: str | None
    outcome: str
    resource: str
    window_seconds: int | None
    scope: str = "user"
    family: tuple[ResourceHeaders, ...] | None = None
    ietf: tuple[tuple[Resource, int, int, int], ...] | None = None
    now_ms: int = 0
    once: int | None = None
    requested: int = 1
    # A refusal by a money budget: the hold's answer (the body and headers are the answer
    # room's, from it) and its SpendFacts.
    spend: tuple[BudgetHold, SpendFacts] | None = None


@dataclass(slots=True)
class Unavailable:
    """Redis could not decide."""

    error: RateLimiterError


@dataclass(slots=True)
class Abandoned:
    """The client disconnected while the request waited in an upstream's queue: its waiting
    call was cancelled (which removed its ticket), the route does not run (outcome
    queue_abandoned). `admitted`: the admission that came anyway (a wait in a thread, which
    cannot be cancelled, or an answer with the disconnect): what it holds is kept to be
    settled as the request ends, as for a route that ended without a response."""

    admitted: Allowed | None = None


Verdict = Allowed | Refused | Unavailable | Abandoned


class ClientGone(Exception):
    """Thrown into the plan by run_async in place of a waiting call's answer (a call with
    max_wait) when the client disconnected while it waited; the call was cancelled."""


@dataclass(slots=True)
class Outcome:
    hold: Lease | None = None
    # The slots taken of upstreams' in-flight caps (released when the response is over).
    slots: list[Lease] = field(default_factory=list)
    remember: Decision | None = None
    verdicts: list[Verdict] = field(default_factory=list)


Plan = Generator[Call, Any, Outcome]


# --- the plan -------------------------------------------------------------------------------


def plan(facts: Facts, policy: Policy) -> Plan:
    """The calls one request needs and what they mean (see the module's docstring)."""
    out = Outcome()
    if facts.tokens is not None:
        too_large = _too_large(facts, policy)
        if too_large is not None:  # shadow mode too: the route runs, nothing is reserved
            out.verdicts.append(too_large)
            return out
    in_flight = None
    if facts.cap is not None:
        if facts.held is not None:
            if facts.held.held > facts.cap:  # the limiter was not asked: no hint of its own
                out.verdicts.append(_concurrency(facts.cap, HINT_WITHOUT_HISTORY_MS,
                                                 max(0, facts.held.expires_at_ms - policy.clock()),
                                                 policy))
                if not policy.shadow:
                    return out
        elif policy.fused and _fusable(facts.scopes):
            in_flight = (facts.cap, policy.lease_seconds)
        else:
            try:
                lease = yield Call("acquire", (facts.identity, facts.cap, policy.lease_seconds), {})
            except RateLimiterError as exc:
                out.verdicts.append(Unavailable(exc))
                return out
            if not _take(lease, facts.cap, out, policy):
                return out
    for slot in facts.slots:
        keywords: dict[str, Any] = {}
        if slot.shares is not None:
            keywords["shares"] = slot.shares
            if facts.tier in classes_of(slot.shares):
                keywords["share_class"] = facts.tier
        if slot.wait is not None and not policy.shadow:
            keywords.update(max_wait=slot.wait[0], tenant=facts.identity,
                            max_queue=slot.wait[1], max_queue_per_tenant=slot.wait[2])
        try:
            lease = yield Call("acquire", (slot.name, slot.limit, slot.lease_seconds), keywords)
        except RateLimiterError as exc:
            out.verdicts.append(Unavailable(exc))
            return out
        except ClientGone:
            out.verdicts.append(Abandoned())
            return out
        if lease.allowed:
            out.slots.append(lease)
            continue
        out.verdicts.append(_upstream_busy(slot, lease, policy))
        if not policy.shadow:
            return out
    windows = () if facts.counted is not None else facts.windows
    if facts.tokens is None and not facts.scopes:
        decision = facts.counted
        if decision is None:
            try:
                decision = yield (Call(policy.decide, (facts.identity, facts.windows), {})
                                  if facts.gcra is None else _gcra_call(facts))
            except RateLimiterError as exc:
                out.verdicts.append(Unavailable(exc))
                return out
            out.remember = decision
        out.verdicts.append(_queued(_window_verdict(facts, policy, decision,
                                                    *_exact(decision, policy)), None, out.slots))
        return out
    arguments: dict[str, Any] = {"scopes": facts.scopes} if facts.scopes else {}
    klass = share_class(facts)
    if klass is not None:
        arguments["scope_class"] = klass
    if facts.tokens is not None:
        arguments.update(cost=1, token_windows=facts.token_windows, tokens=facts.tokens)
    if in_flight is not None:
        arguments["in_flight"] = in_flight
    elif facts.wait is not None and not policy.shadow:
        arguments.update(max_wait=facts.wait[0], max_queue=facts.wait[1],
                         max_queue_per_tenant=facts.wait[2])
    try:
        reservation: Reservation = yield Call("reserve", (facts.identity, windows), arguments)
    except RateLimiterError as exc:
        out.verdicts.append(Unavailable(exc))
        return out
    except ClientGone:
        out.verdicts.append(Abandoned())
        return out
    if in_flight is not None and reservation.lease is not None and not _take(
            reservation.lease, in_flight[0], out, policy):
        return out
    if not reservation.allowed and reservation.scope is not None:
        out.verdicts.append(_scope_refusal(facts, reservation))
        return out
    if facts.tokens is not None:
        verdict = _queued(_token_verdict(facts, policy, reservation, out), reservation,
                          out.slots)
        if facts.spend is not None and isinstance(verdict, Allowed):
            verdict = yield from _hold_money(facts, reservation, verdict, out)
        out.verdicts.append(verdict)
        return out
    stamp = reservation.timestamp_ms or policy.clock()
    if facts.counted is not None:
        decision, exact = facts.counted, _exact(facts.counted, policy)
    elif not reservation.allowed:
        # This dependency's own refusal, shared with no other: counted as its own in shadow.
        decision = (False, 0, reservation.retry_after_s, reservation.window_seconds)
        out.verdicts.append(_window_verdict(facts, policy, decision, reservation.retry_after_ms,
                                            stamp, shared=False))
        return out
    else:
        state = tightest(reservation.windows, "requests")
        assert state is not None and state.remaining is not None
        decision = out.remember = (True, state.remaining, 0, state.window_seconds)
        exact = (0, stamp)
    out.verdicts.append(_queued(_window_verdict(facts, policy, decision, *exact), reservation,
                                out.slots))
    return out


def _queued(verdict: Verdict, reservation: Reservation | None, slots: list[Lease]) -> Verdict:
    """An admission after a wait in an upstream's queue (its windows', or its in-flight
    cap's: one of `slots`) counts as queued_then_allowed."""
    if isinstance(verdict, Allowed) and (
            (reservation is not None and reservation.queue_outcome == "queued_then_allowed")
            or any(lease.queue_outcome == "queued_then_allowed" for lease in slots)):
        verdict.outcome = "queued_then_allowed"
    return verdict


def abandon(outcome: Outcome) -> Outcome:
    """The client left while the request waited in a queue, but the wait ended in an
    admission (a blocking limiter's wait in a thread, which cannot be cancelled; or an
    admission that came with the disconnect): the route does not run for nobody, the
    admission becomes Abandoned. Its slots are held as before (released as the request
    ends: at once). A request that did not wait, or was refused, stays as it was."""
    waited = any(lease.queue_outcome == "queued_then_allowed" for lease in outcome.slots)
    for index, verdict in enumerate(outcome.verdicts):
        if isinstance(verdict, Allowed) and (waited or verdict.outcome == "queued_then_allowed"):
            outcome.verdicts[index:] = [Abandoned(verdict)]
            break
    return outcome


def run(steps: Plan, limiter: Any) -> Outcome:
    """The blocking driver: each call on the limiter, in this thread."""
    step = _advance(steps, None, None)
    while isinstance(step, Call):
        try:
            answer, error = getattr(limiter, step.method)(*step.args, **step.kwargs), None
        except RateLimiterError as exc:
            answer, error = None, exc
        step = _advance(steps, answer, error)
    return step


async def run_async(steps: Plan, limiter: Any,
                    offload: Callable[..., Awaitable[Any]] | None = None,
                    gone: Callable[[], Awaitable[None]] | None = None) -> Outcome:
    """The asyncio driver: each call awaited, or, for a blocking limiter, `offload(fn)`
    (the threadpool). `gone()`: an awaitable that ends when the client disconnects; a call
    that may wait in a queue (max_wait) races it and, when it ends first, is cancelled (its
    cancellation removes its ticket) and ClientGone is thrown into the plan. Not with
    `offload`: a thread cannot be cancelled."""
    step = _advance(steps, None, None)
    while isinstance(step, Call):
        method = getattr(limiter, step.method)
        error: Exception | None = None
        try:
            if offload is not None:
                answer = await offload(functools.partial(method, *step.args, **step.kwargs))
            elif gone is not None and "max_wait" in step.kwargs:
                answer = await _unless_gone(method(*step.args, **step.kwargs), gone)
            else:
                answer = await method(*step.args, **step.kwargs)
        except (RateLimiterError, ClientGone) as exc:
            answer, error = None, exc
        step = _advance(steps, answer, error)
    return step


async def _unless_gone(call: Awaitable[Any], gone: Callable[[], Awaitable[None]]) -> Any:
    """The call's answer, unless `gone()` ends first: then the call is cancelled (and waited
    for: its cancellation removes its ticket, releases a lease granted meanwhile) and
    ClientGone raised. An answer that comes with the disconnect is kept (the plan goes on)."""
    waiting = asyncio.ensure_future(call)
    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((waiting, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not waiting.done():
            waiting.cancel()
        await asyncio.wait((waiting, watcher))
    if waiting.cancelled():
        raise ClientGone
    return waiting.result()


def _advance(steps: Plan, answer: Any, error: Exception | None) -> Call | Outcome:
    """The plan's next call, given the last one's answer or error; its outcome when done."""
    try:
        return steps.throw(error) if error is not None else steps.send(answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


# --- the rooms of the plan ------------------------------------------------------------------


def _exact(decision: Decision, policy: Policy) -> tuple[int, int]:
    """The exact wait in ms and the decision's time: a WindowDecision carries both; any
    other limiter's 4-tuple gets its rounded wait and the policy's clock."""
    return (getattr(decision, "retry_after_ms", decision[2] * 1000),
            getattr(decision, "timestamp_ms", 0) or policy.clock())


def _gcra_call(facts: Facts) -> Call:
    """The decision of a tier with a burst: its minute budget as a GCRA bucket (the window of
    the bucket's period left out of the logged ones), decided with them all or nothing; a
    refusal by the bucket answers that window's length, so the headers name it."""
    assert facts.gcra is not None
    windows = tuple(w for w in facts.windows if w[1] != facts.gcra[1])
    return Call("check_windows_detailed", (facts.identity, windows), {"gcra": facts.gcra})


def _take(lease: Lease, cap: int, out: Outcome, policy: Policy) -> bool:
    """A granted lease is held; a refused one is the concurrency 429. False: stop here."""
    if lease.allowed:
        out.hold = lease
        return True
    # The soonest lease's expiry is only a bound (a request that ends frees its slot
    # sooner): announce the limiter's hint, from how long this cap's requests are held.
    # A Lease without a bound of its own (retry_bound_ms 0) tells it in retry_after_ms.
    out.verdicts.append(_concurrency(cap, lease.retry_after_ms,
                                     lease.retry_bound_ms or lease.retry_after_ms, policy))
    return policy.shadow


def _fusable(scopes: tuple[BudgetScope, ...]) -> bool:
    """Whether the tier's in-flight slot may ride on the reserve's script with these scopes:
    not with a shared cap's reserved shares or cold-start probe (reserve refuses in_flight
    with them: reservation.reserve_arguments), whose slot is then taken apart, as without a
    fused limiter."""
    return not any(scope.has_shares or scope.probe for scope in scopes)


def _concurrency(cap: int, hint_ms: int, expiry_ms: int, policy: Policy) -> Refused:
    """The concurrency 429. `hint_ms`: the limiter's guess of when a slot frees; `expiry_ms`:
    the soonest held lease's expiry, which frees a slot at the latest."""
    retry_after = hint_ms / 1000 if policy.in_flight_retry_after is None else policy.in_flight_retry_after
    retry_ms, retry_s = in_flight_wait(retry_after, expiry_ms)
    message = (f"Too many concurrent requests: Limit {cap} in flight. A slot frees when one "
               f"of them ends; please try again in {format_duration(retry_ms)} (a slot is "
               f"free again within {format_duration(expiry_ms)} at the latest).")
    return Refused((("X-RateLimit-Limit", str(cap)), ("X-RateLimit-Remaining", "0"),
                    ("X-RateLimit-Window", window_name(CONCURRENT))),
                   (retry_s, retry_ms), message, "concurrency_rejected", "in_flight", None)


def _upstream_busy(slot: UpstreamSlot, lease: Lease, policy: Policy) -> Refused:
    """The 429 of an upstream's in-flight cap: every slot held (by all users together), or
    a share rule kept the free one for another class (X-RateLimit-Share names it). Counted
    as the lease's queue outcome (queue_timeout, queue_full) when it waited in the cap's
    queue, else concurrency_rejected."""
    retry_ms, retry_s = in_flight_wait(lease.retry_after_ms / 1000,
                                       lease.retry_bound_ms or lease.retry_after_ms)
    share = lease.share_refusal
    rule: tuple[tuple[str, str], ...] = ()
    if share is not None:
        rule = (("X-RateLimit-Share", f"{share.rule}; class={share.share_class}"),)
        message = (f"The service is at capacity for your class: {share.describe()} "
                   f"(upstream {slot.name}, {slot.limit} requests in flight for all users "
                   f"together). Please try again in {format_duration(retry_ms)}.")
    else:
        message = (f"The service is at capacity: its upstream {slot.name} allows {slot.limit} "
                   f"requests in flight for all users together. This is not your own rate "
                   f"limit. Please try again in {format_duration(retry_ms)}.")
    return Refused((("X-RateLimit-Limit", str(slot.limit)), ("X-RateLimit-Remaining", "0"),
                    ("X-RateLimit-Window", window_name(CONCURRENT)),
                    ("X-RateLimit-Scope", "upstream"), ("X-RateLimit-Resource", "in_flight"))
                   + rule, (retry_s, retry_ms), message,
                   lease.queue_outcome or "concurrency_rejected", "in_flight", None, "upstream",
                   now_ms=policy.clock())


def _too_large(facts: Facts, policy: Policy) -> Refused | None:
    """The 429 of an estimate no wait can make fit (above a token window's limit, its scopes'
    included); None when it fits."""
    assert facts.tokens is not None
    limit, window_seconds = min([*facts.token_windows,
                                 *(w for s in facts.scopes for w in s.token_windows)])
    if facts.tokens <= limit:
        return None
    # The scope of the window that cannot fit it: the user's own, else a scope's.
    kind = "user" if (limit, window_seconds) in facts.token_windows else next(
        scope_kind(s) for s in facts.scopes if (limit, window_seconds) in s.token_windows)
    return Refused((("X-RateLimit-Limit", str(limit)), ("X-RateLimit-Window", window_name(window_seconds)),
                    ("X-RateLimit-Resource", "tokens")),
                   None, None, "too_large", "tokens", window_seconds, kind,
                   family=(ResourceHeaders("requests", facts.windows[0][0], None, None),
                           ResourceHeaders("tokens", limit, None, None)),
                   ietf=(), now_ms=policy.clock(), requested=facts.tokens)


def _window_verdict(facts: Facts, policy: Policy, decision: Decision, retry_ms: int,
                    stamp: int, *, shared: bool = True) -> Verdict:
    """A request-window decision (check_windows' 4-tuple) as a verdict. `shared`: the decision
    lives on in the request (remembered for, or taken from, the route's other dependencies),
    so its id names it for shadow mode's count-once; a decision of this dependency alone is
    gone after the plan and its id may be reused: counted every time (once=None)."""
    allowed, remaining, retry_s, window_seconds = decision
    limit = facts.windows[0][0]  # the window that decided, else the first
    for window_limit, seconds in facts.windows:
        if seconds == window_seconds:
            limit = window_limit
            break
    if allowed:
        return Allowed((WindowState(limit, window_seconds, "requests", remaining),), stamp)
    return Refused((("X-RateLimit-Limit", str(limit)), ("X-RateLimit-Remaining", "0"),
                    ("X-RateLimit-Window", window_name(window_seconds))),
                   (retry_s, retry_ms), refusal_message("requests", window_seconds, limit, 1, retry_ms),
                   "rejected", "requests", window_seconds,
                   family=(ResourceHeaders("requests", limit, 0, retry_ms),),
                   ietf=(("requests", window_seconds, 0, retry_s),), now_ms=stamp,
                   once=id(decision) if shared else None)


def share_class(facts: Facts) -> str | None:
    """The request's class in an upstream's reserved shares: its tier, when the upstream
    names it (a tier it does not name has no share of its own: None)."""
    for scope in facts.scopes:
        if scope.has_shares and facts.tier in classes_of(scope):
            return facts.tier
    return None


def _scope_refusal(facts: Facts, reservation: Reservation) -> Refused:
    """The 429 of a refusal by a scope. An upstream's (shared) message says that the
    service, not the user, is at capacity; a route's or a model's names that budget. The
    provider families' headers and the IETF fields describe the user's own budget: left out."""
    scope = reservation.scope
    assert scope is not None
    resource, window_seconds = reservation.resource, reservation.window_seconds
    limit = next(w.limit for w in reservation.windows if w.scope == scope
                 and w.resource == resource and w.window_seconds == window_seconds)
    retry_ms = reservation.retry_after_ms
    kind = scope_kind(scope)
    share = reservation.share_refusal
    rule: tuple[tuple[str, str], ...] = ()
    if share is not None:
        rule = (("X-RateLimit-Share", f"{share.rule}; class={share.share_class}"),)
        message = (f"The service is at capacity for your class: {share.describe()} "
                   f"(upstream {scope.name}, {limit} {resource} per "
                   f"{window_name(window_seconds)} for all users together). Please try again "
                   f"in {format_duration(retry_ms)}.")
    elif scope.shared:
        message = (f"The service is at capacity: its upstream {scope.name} allows {limit} "
                   f"{resource} per {window_name(window_seconds)} for all users together. "
                   f"This is not your own rate limit. Please try again in "
                   f"{format_duration(retry_ms)}.")
    else:
        requested = facts.tokens if resource == "tokens" and facts.tokens is not None else 1
        message = (f"{refusal_message(resource, window_seconds, limit, requested, retry_ms)} "
                   f"(the budget of {kind} {scope.name.split(':', 1)[-1]})")
    return Refused((("X-RateLimit-Limit", str(limit)), ("X-RateLimit-Remaining", "0"),
                    ("X-RateLimit-Window", window_name(window_seconds)),
                    ("X-RateLimit-Scope", kind), ("X-RateLimit-Resource", resource)) + rule,
                   (reservation.retry_after_s, retry_ms), message,
                   reservation.queue_outcome or "rejected", resource, window_seconds, kind)


def _token_verdict(facts: Facts, policy: Policy, reservation: Reservation, out: Outcome) -> Verdict:
    """A token reservation by the user's own windows as a verdict."""
    assert facts.tokens is not None
    stamp = reservation.timestamp_ms or policy.clock()
    if not reservation.allowed:
        resource, window_seconds = reservation.resource, reservation.window_seconds
        budget = facts.token_windows if resource == "tokens" else facts.windows
        limit = next(lim for lim, seconds in budget if seconds == window_seconds)
        retry_ms = reservation.retry_after_ms
        family: list[ResourceHeaders] = []
        own: Windows
        name: Resource
        for name, own in (("requests", facts.windows), ("tokens", facts.token_windows)):
            if name == resource:
                family.append(ResourceHeaders(name, limit, 0, retry_ms))
                continue
            state = tightest(reservation.windows, name)
            family.append(ResourceHeaders(name, state.limit, state.remaining, retry_ms) if state is not None
                          else ResourceHeaders(name, own[0][0], None, retry_ms))
        requested = facts.tokens if resource == "tokens" else 1
        return Refused((("X-RateLimit-Limit", str(limit)), ("X-RateLimit-Remaining", "0"),
                        ("X-RateLimit-Window", window_name(window_seconds)),
                        ("X-RateLimit-Resource", resource)),
                       (reservation.retry_after_s, retry_ms),
                       refusal_message(resource, window_seconds, limit, requested, retry_ms),
                       "rejected", resource, window_seconds, family=tuple(family),
                       ietf=((resource, window_seconds, 0, reservation.retry_after_s),), now_ms=stamp)
    requests_state = tightest(reservation.windows, "requests")
    record = False
    if facts.counted is not None:
        _, remaining, _, window_seconds = facts.counted
        limit = next(lim for lim, seconds in facts.windows if seconds == window_seconds)
        requests_state = WindowState(limit, window_seconds, "requests", remaining)
    elif requests_state is not None and requests_state.remaining is not None:
        out.remember = (True, requests_state.remaining, 0, requests_state.window_seconds)
        record = True
    states = tuple(state for state in (requests_state, tightest(reservation.windows, "tokens"))
                   if state is not None)
    return Allowed(states, stamp, record, reservation)


def _hold_money(facts: Facts, reservation: Reservation, verdict: Allowed,
                out: Outcome) -> Generator[Call, Any, Verdict]:
    """The money step, once the token reservation is allowed: hold the request's worst case
    in every budget of its levels (one call, all or nothing). The hold and the reserve are two
    round trips; a refusal by a budget (or a limiter that cannot answer) gives the
    reservation back exactly before answering: its token estimate and request entry
    reconciled to 0 and its in-flight slot released, as a two-step scope refusal refunds its
    earlier steps."""
    spend = facts.spend
    assert spend is not None
    try:
        hold: BudgetHold = yield Call("hold_budgets", (spend.budgets, spend.amount),
                                      {"hold_seconds": spend.hold_seconds})
    except RateLimiterError as exc:
        yield from _give_back(reservation, out)
        return Unavailable(exc)
    if hold.allowed:
        verdict.spend = SpendHeld(hold, spend.model, spend.table, spend.amount)
        return verdict
    yield from _give_back(reservation, out)
    period = hold.refused_by
    assert period is not None
    return Refused((), None, "", "rejected", "spend", None,
                   period.budget.level or "key", now_ms=hold.now_ms, spend=(hold, spend))


def _give_back(reservation: Reservation, out: Outcome) -> Generator[Call, Any, None]:
    """Undoes an allowed token reservation: the tokens (and a fused in-flight slot, in the
    same script) reconciled to 0, then the request entry; a slot taken apart is released.
    Best effort, as the two-step refund: what a failed call leaves leaves its window."""
    calls: list[Call] = []
    if reservation.member or reservation.shared_entries:
        lease = reservation.lease
        release = lease is not None and bool(lease.lease_id)
        calls.append(Call("reconcile", (reservation, 0), {"release": True} if release else {}))
        requests = dataclasses.replace(reservation, lease=None, tokens=None, windows=tuple(
            w for w in reservation.windows if w.resource == "requests"))
        calls.append(Call("reconcile", (requests, 0), {}))
    out.remember = None  # the request is not counted: another dependency must not reuse it
    if out.hold is not None:
        if out.hold is not reservation.lease:  # a slot taken apart (a fused one: above)
            calls.append(Call("release", (out.hold,), {}))
        out.hold = None
    for call in calls:
        try:
            yield call
        except RateLimiterError:
            pass
