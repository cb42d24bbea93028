"""The wait queue of shared caps (docs/wait-queue.md): `reserve(..., max_wait=...)` waits
for a shared scope's windows instead of being refused, in a queue kept in Redis and shared by
every replica (lua/lib/queue.lua, lua/wait_queue.lua).

The plan (`queued_reserve_plan`) is I/O-free, like reservation.py's: it yields the calls
("reserve", "wait_queue", "clock", "sleep") that the blocking and the asyncio limiter run
(time.sleep / asyncio.sleep for "sleep", time.monotonic for "clock"), so the waiting logic
exists once. The rule (who may pass whom, when a ticket's turn comes, what expires) is in
Lua."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import uuid
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from .reservation import (
    Plan,
    Scope,
    _scope_list,
    _with,
    check_scope_class,
    make_reservation,
    reserve_arguments,
    reserve_plan,
)

__all__ = ["DEFAULT_MAX_QUEUE", "DEFAULT_MAX_QUEUE_PER_TENANT", "MAX_WAIT_SECONDS",
           "QUEUE_MIN_UNRESERVED_WEIGHT", "TICKET_LIVE_MS", "UNRESERVED_CLASS",
           "WAKE_BACKSTOP_SECONDS", "queue_bound", "queue_class", "queue_milliseconds",
           "queued_acquire_plan", "tenant_key", "wake_channel"]

# The longest a request may wait (csrc/native.h RL_MAX_QUEUE_WAIT_MS): a queue that holds a
# request for hours behind a provider's long reset helps nobody.
MAX_WAIT_SECONDS = 300.0
# The queue's bounds, per shared scope: live tickets in all, and of one tenant.
DEFAULT_MAX_QUEUE = 1000
DEFAULT_MAX_QUEUE_PER_TENANT = 100
_MAX_QUEUE_LENGTH = 100_000  # csrc/native.h RL_MAX_QUEUE_LENGTH
# An in-flight cap's ticket lives this long unless its waiter renews it (it does at every
# backstop wake): a killed waiter's ticket leaves the head of the queue within seconds, not
# at its deadline.
TICKET_LIVE_MS = 3000
# The longest an in-flight cap's waiter sleeps between two looks at the cap: a wake-up
# PUBLISHed by a release is at-most-once (a lost message, a subscriber reconnecting), so a
# waiter asks again after this at the latest. A lost wake only delays, never hangs.
WAKE_BACKSTOP_SECONDS = 1.0
# The weight (basis points) of a ticket whose class has no reserved share, when the reserved
# shares take the whole cap (queue_class): 1 %; the index of that class (csrc/native.h
# RL_MAX_QUEUE_CLASS: the reserved ones are 0 to 63).
QUEUE_MIN_UNRESERVED_WEIGHT = 100
UNRESERVED_CLASS = 64


def queue_milliseconds(max_wait: object) -> int:
    """max_wait (seconds, an int or float > 0 and <= MAX_WAIT_SECONDS) in whole ms (at least
    1); TypeError or ValueError before any I/O otherwise (0, negative, NaN, inf, a day)."""
    if isinstance(max_wait, bool) or not isinstance(max_wait, (int, float)):
        raise TypeError(f"max_wait must be a number of seconds, not {type(max_wait).__name__}")
    if not (math.isfinite(max_wait) and 0 < max_wait <= MAX_WAIT_SECONDS):
        raise ValueError(f"max_wait must be > 0 and <= {MAX_WAIT_SECONDS:g} seconds, "
                         f"got {max_wait!r}")
    return max(1, math.ceil(max_wait * 1000))


def queue_bound(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    if not 1 <= value <= _MAX_QUEUE_LENGTH:
        raise ValueError(f"{what} must be 1 to {_MAX_QUEUE_LENGTH}, got {value}")
    return value


def queue_class(scope: Scope, scope_class: str | None) -> tuple[int, int]:
    """The (weight, class index) of a request's ticket in `scope`'s queue (lua/lib/queue.lua's
    queue_round; docs/wait-queue.md, "Classes weighted by their shares"): (0, 0) when the
    scope reserves no shares (every ticket steps one round: the rounds of a queue without
    classes). Else a class the scope reserves a share for weighs it in basis points (1 to
    10000: rounded to the nearest, at least 1), its index its place in the scope's sorted
    reserved shares; every other request (a class the scope reserves nothing for, no class)
    is of the one class UNRESERVED_CLASS, weighing the share left unreserved (100 % minus
    the reserved ones), at least QUEUE_MIN_UNRESERVED_WEIGHT when those take it all. Its
    tickets step floor(72072000 / weight) rounds: under a backlog, the classes are served
    in proportion to their weights."""
    reserved = scope.reserved
    if not reserved:
        return 0, 0
    for index, (name, share) in enumerate(reserved):
        if name == scope_class:
            return max(1, round(share * 100)), index
    unreserved = round((100 - sum((share for _, share in reserved), Fraction(0))) * 100)
    return max(QUEUE_MIN_UNRESERVED_WEIGHT, unreserved), UNRESERVED_CLASS


def tenant_key(tenant: object) -> str:
    """The tenant as the queue stores it: a digest (32 hex digits), so any str of any length
    is a tenant and none can forge another's member text."""
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str, not {type(tenant).__name__}")
    return hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def queued_reserve_plan(user_id: str, windows: Any, cost: int, token_windows: Any,
                        tokens: int | None, scopes: object, max_wait: object,
                        tenant: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
                        max_queue_per_tenant: int = DEFAULT_MAX_QUEUE_PER_TENANT,
                        two_step: bool = False, in_flight: tuple[int, int] | None = None,
                        lease: Any = None, scope_class: str | None = None) -> Plan:
    """reserve with max_wait: decided as reserve_plan's one script; when its shared scopes'
    windows or their queues refuse it, a ticket is taken in the queue of each shared scope
    and the request sleeps until the time the refusal names (when enough entries leave the
    windows for the tickets ahead of it and itself), then asks again with its ticket, until
    it is admitted or its deadline would pass. The Reservation says how it ended
    (queue_outcome): "queued_then_allowed", "queue_timeout" (the refusal it would have got,
    its honest wait), "queue_full" (refused at once: a bound), or "" (decided at once). A
    ticket is removed when the request is admitted, gives up, or fails (cancelled: best
    effort; otherwise it expires at its deadline)."""
    wait_ms = queue_milliseconds(max_wait)
    chosen = _scope_list(scopes)
    shared = [s for s in chosen if s.shared]
    if not shared:
        raise ValueError("max_wait needs a shared scope (Scope(shared=True)): the queue is "
                         "the shared cap's")
    check_scope_class(scope_class, shared)
    if two_step or in_flight is not None:
        # Not yet: on a Redis Cluster the shared scopes are decided in steps of their own,
        # and an in-flight slot frees on a release the queue does not hear. Decided at once.
        return (yield from reserve_plan(user_id, windows, cost, token_windows, tokens, chosen,
                                        two_step, in_flight, lease, scope_class))
    tenant_text = tenant_key(user_id if tenant is None else tenant)
    bounds = (queue_bound(max_queue, "max_queue"),
              queue_bound(max_queue_per_tenant, "max_queue_per_tenant"))
    arguments = reserve_arguments(cost, token_windows, tokens, chosen, None, scope_class)
    start: float = yield ("clock", (), {})
    raw = yield ("reserve", (user_id, windows), arguments)
    reservation = make_reservation(raw, user_id, cost, tokens, chosen, None, scope_class)
    if reservation.allowed or reservation.scope is None or not reservation.scope.shared:
        return reservation  # admitted, or refused by the user's own budget: no queue helps
    deadline = start + wait_ms / 1000
    ticket = str(uuid.uuid4())
    taken: list[str] = []
    try:
        for scope in shared:
            weight = queue_class(scope, scope_class)  # no shares: the 3 numbers of before
            numbers = (wait_ms, *bounds, *weight) if weight[0] else (wait_ms, *bounds)
            rank = yield ("wait_queue", (scope.name, ticket, tenant_text, numbers), {})
            if rank < 0:
                yield from _leave(taken, ticket, tenant_text, bounds)
                return _with(reservation, queue_outcome="queue_full")
            taken.append(scope.name)
        arguments = dict(arguments, ticket=ticket)
        while True:
            now: float = yield ("clock", (), {})
            pause = reservation.retry_after_ms / 1000
            if now + pause > deadline:  # it would wait past its deadline: the refusal it has
                yield from _leave(taken, ticket, tenant_text, bounds)
                return _with(reservation, queue_outcome="queue_timeout",
                             waited_ms=round((now - start) * 1000))
            yield ("sleep", (pause,), {})
            raw = yield ("reserve", (user_id, windows), arguments)
            reservation = make_reservation(raw, user_id, cost, tokens, chosen, None, scope_class)
            if not reservation.allowed and (reservation.scope is None
                                            or not reservation.scope.shared):
                yield from _leave(taken, ticket, tenant_text, bounds)  # the user's own budget
                return reservation
            if reservation.allowed:  # the script removed the ticket
                now = yield ("clock", (), {})
                return _with(reservation, queue_outcome="queued_then_allowed",
                             waited_ms=round((now - start) * 1000))
    except BaseException:
        yield from _leave(taken, ticket, tenant_text, bounds)
        raise


def _leave(names: list[str], ticket: str, tenant: str, bounds: tuple[int, int]) -> Plan:
    """The ticket removed from each queue it is in (best effort: it expires otherwise)."""
    for name in names:
        try:
            yield ("wait_queue", (name, ticket, tenant, (0, *bounds)), {})
        except Exception:  # noqa: BLE001 - the ticket expires at its deadline
            pass
    names.clear()



def wake_channel(key_prefix: str, owner: str) -> str:
    """The pub/sub channel an in-flight cap's releases wake its waiters on: the name of the
    cap's queue key, "{prefix}:{name}:leases:queue" (`owner`: the name as keys carry it,
    _native.key_owner's: a hash tag on a Cluster)."""
    return f"{key_prefix}:{owner}:leases:queue"


def check_queue_shares(spec: str | None) -> None:
    """acquire(max_wait=...) with shares=: not yet. A ticket at the head that its class's
    ceiling refuses would hold back the tickets behind it (no barging), whose classes the
    rule would admit (the window caps' queue weighs the classes by their shares:
    queue_class; the in-flight cap's does not yet)."""
    if spec is not None:
        raise ValueError("acquire(max_wait=...) does not go with shares= yet: the wait "
                         "queue's turns are per tenant, not by the classes' shares")


def queued_acquire_plan(user_id: str, limit: int, lease_seconds: int, max_wait: object,
                        tenant: str | None, max_queue: int, max_queue_per_tenant: int,
                        make: Callable[[Any], Any]) -> Plan:
    """acquire with max_wait: one acquire; when the cap refuses it, a ticket is taken in the
    cap's queue ("{name}:leases:queue", lib/queue.lua), the waiter subscribes to the cap's
    wake channel (and has the confirmation), asks once more with its ticket (a release
    between the take and the subscription is not missed), then sleeps until a release names
    its ticket (lua/lease.lua PUBLISHes the tickets whose turn came), WAKE_BACKSTOP_SECONDS
    pass, or its deadline; and asks again, renewing its ticket (TICKET_LIVE_MS) at least
    once a second, until it is admitted or its deadline passes. The Lease says how it ended
    (queue_outcome, waited_ms). Calls: "acquire", "wait_queue", "clock", "subscribe" (->
    the driver's waiter, once subscribed), "wake" (waiter, seconds -> whether notified),
    "unsubscribe" (waiter)."""
    wait_ms = queue_milliseconds(max_wait)
    tenant_text = tenant_key(user_id if tenant is None else tenant)
    bounds = (queue_bound(max_queue, "max_queue"),
              queue_bound(max_queue_per_tenant, "max_queue_per_tenant"))
    start: float = yield ("clock", (), {})
    lease = make((yield ("acquire", (user_id, limit, lease_seconds), {})))
    if lease.allowed:
        return lease
    deadline = start + wait_ms / 1000
    ticket = str(uuid.uuid4())
    live = (TICKET_LIVE_MS, *bounds)
    rank = yield ("wait_queue", (user_id, ticket, tenant_text, live), {"leases": True})
    if rank < 0:
        return dataclasses.replace(lease, queue_outcome="queue_full")
    waiter: Any = None
    try:
        waiter = yield ("subscribe", (user_id, ticket), {})
        renewed = yield ("clock", (), {})
        while True:
            lease = make((yield ("acquire", (user_id, limit, lease_seconds), {"ticket": ticket})))
            now: float = yield ("clock", (), {})
            if lease.allowed:  # the script removed the ticket
                return dataclasses.replace(lease, queue_outcome="queued_then_allowed",
                                           waited_ms=round((now - start) * 1000))
            if now >= deadline:
                yield from _leave_leases(user_id, ticket, tenant_text, bounds)
                return dataclasses.replace(lease, queue_outcome="queue_timeout",
                                           waited_ms=round((now - start) * 1000))
            yield ("wake", (waiter, min(WAKE_BACKSTOP_SECONDS, deadline - now)), {})
            now = yield ("clock", (), {})
            if now - renewed >= WAKE_BACKSTOP_SECONDS / 2:  # the ticket kept alive
                rank = yield ("wait_queue", (user_id, ticket, tenant_text, live), {"leases": True})
                renewed = now
                if rank < 0:  # it had lapsed, and the queue filled meanwhile
                    return dataclasses.replace(lease, queue_outcome="queue_full",
                                               waited_ms=round((now - start) * 1000))
    except BaseException:
        yield from _leave_leases(user_id, ticket, tenant_text, bounds)
        raise
    finally:
        if waiter is not None:
            try:
                yield ("unsubscribe", (waiter,), {})
            except Exception:  # noqa: BLE001 - the subscriber forgets it with its channel
                pass


def _leave_leases(name: str, ticket: str, tenant: str, bounds: tuple[int, int]) -> Plan:
    """The ticket removed from the in-flight cap's queue (best effort: it lapses within
    TICKET_LIVE_MS otherwise)."""
    try:
        yield ("wait_queue", (name, ticket, tenant, (0, *bounds)), {"leases": True})
    except Exception:  # noqa: BLE001 - the ticket lapses by itself
        pass
