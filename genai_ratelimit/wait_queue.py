"""The wait queue of shared caps (docs/wait-queue.md): `reserve(..., max_wait=...)` waits
for a shared scope's windows instead of being refused, in a queue kept in Redis and shared by
every replica (lua/lib/queue.lua, lua/wait_queue.lua).

The plan (`queued_reserve_plan`) is I/O-free, like reservation.py's: it yields the calls
("reserve", "wait_queue", "clock", "sleep") that the blocking and the asyncio limiter run
(time.sleep / asyncio.sleep for "sleep", time.monotonic for "clock"), so the waiting logic
exists once. The rule (who may pass whom, when a ticket's turn comes, what expires) is in
Lua."""

from __future__ import annotations

import hashlib
import math
import uuid
from typing import Any

from .reservation import (
    Plan,
    _scope_list,
    _with,
    check_scope_class,
    make_reservation,
    reserve_arguments,
    reserve_plan,
)

__all__ = ["DEFAULT_MAX_QUEUE", "DEFAULT_MAX_QUEUE_PER_TENANT", "MAX_WAIT_SECONDS",
           "queue_bound", "queue_milliseconds", "tenant_key"]

# The longest a request may wait (csrc/native.h RL_MAX_QUEUE_WAIT_MS): a queue that holds a
# request for hours behind a provider's long reset helps nobody.
MAX_WAIT_SECONDS = 300.0
# The queue's bounds, per shared scope: live tickets in all, and of one tenant.
DEFAULT_MAX_QUEUE = 1000
DEFAULT_MAX_QUEUE_PER_TENANT = 100
_MAX_QUEUE_LENGTH = 100_000  # csrc/native.h RL_MAX_QUEUE_LENGTH


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
            rank = yield ("wait_queue", (scope.name, ticket, tenant_text, (wait_ms, *bounds)), {})
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

