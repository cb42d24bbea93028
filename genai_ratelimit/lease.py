"""In-flight leases: at most `limit` concurrent holders per user (lua/lease.lua).

`limiter.acquire(user_id, limit, lease_seconds)` takes one of the user's `limit` slots in ONE
script execution (atomic on Redis: trim the expired leases, count, admit while the count is
below the limit) and returns a Lease; `limiter.release(lease)` gives the slot back (ZREM:
idempotent, a second release finds nothing); `limiter.renew(lease)` extends a lease still
held to lease_seconds from now (a long stream), and answers False for a lease that expired
or was released, whose slot may have gone to someone else. A lease that is never released
(its process killed, its connection lost) expires after lease_seconds: no slot leaks for
longer than that.

This module holds what the blocking and the asyncio limiter share: the Lease types (frozen,
like Reservation, with helpers bound to the limiter that made them) and the validation of
the calls made with a lease."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from . import _native
from .shares import ShareRefusal, Shares, lease_refusal, lease_spec

__all__ = ["Lease", "AsyncLease", "DEFAULT_LEASE_SECONDS"]

# The default lease: long enough for a long completion stream; a stream that may run longer
# renews its lease (Lease.renew) before it expires.
DEFAULT_LEASE_SECONDS = 300
# The wait a refused acquire announces before any lease of the user was released: the lease
# library's own constant (lua/lib/lease.lua, HINT_NO_HISTORY_MS), read from the script the
# extension embeds, so that it is written once.
_HINT = re.search(r"local HINT_NO_HISTORY_MS = (\d+)", _native.LEASE_SOURCE)
assert _HINT is not None, "lua/lib/lease.lua defines HINT_NO_HISTORY_MS"
HINT_WITHOUT_HISTORY_MS = int(_HINT.group(1))


@dataclass(frozen=True, slots=True)
class Lease:
    """The answer of `acquire`.

    allowed        True when a slot was granted (then release it when done).
    held           the user's leases held after this decision (this one included when allowed).
    remaining      the slots still free: limit - held (0 when refused).
    retry_after_s / retry_after_ms
                   when refused: when a slot is likely to free, from the hold times of this
                   user's released leases (a decayed length-weighted mean, kept in Redis
                   beside the leases) less how long the oldest held one has run: at least a
                   quarter of that mean and 1 s, at most 60 s and retry_bound_ms; 5 s before
                   any lease was released. 0 when allowed.
    retry_bound_ms when refused: the wait until the soonest held lease expires, an UPPER
                   bound (a slot is free by then at the latest). 0 when allowed.
    lease_id       the lease's UUID4 ("" when refused, or when RATE_LIMIT_DISABLED granted
                   it without Redis: then release and renew send nothing).
    expires_at_ms  when the lease expires unless renewed (unix ms, on the deciding clock).
    share_refusal  acquire(..., shares=...): the reserved-share rule that refused it (a
                   ShareRefusal naming the rule and the class), None otherwise.
    share_class    the class it was asked for (acquire's share_class), None without one.
    queue_outcome  acquire(..., max_wait=...): how the wait in the cap's queue ended:
                   "queued_then_allowed", "queue_timeout" (refused: the deadline came first;
                   retry_after_* the last refusal's), "queue_full" (refused at once: a
                   bound), or "" (decided at once, queue or no queue).
    waited_ms      how long it waited in the queue (0 when decided at once).

    `with limiter.acquire(...) as lease:` releases it on leaving the block.
    """

    allowed: bool
    held: int
    remaining: int
    retry_after_s: int
    retry_after_ms: int
    lease_id: str
    expires_at_ms: int
    user_id: str
    limit: int
    lease_seconds: int
    retry_bound_ms: int = 0
    share_refusal: ShareRefusal | None = None
    share_class: str | None = None
    queue_outcome: str = ""
    waited_ms: int = 0
    # The limiter that made it, for the bound helpers; not part of the value.
    limiter: Any = field(default=None, repr=False, compare=False)

    def release(self) -> bool:
        """limiter.release(self)."""
        return bool(self.limiter.release(self))

    def renew(self, lease_seconds: int | None = None) -> bool:
        """limiter.renew(self, lease_seconds)."""
        return bool(self.limiter.renew(self, lease_seconds))

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.lease_id:
            self.limiter.release(self)


@dataclass(frozen=True, slots=True)
class AsyncLease(Lease):
    """A Lease of an AsyncRateLimiter: its helpers are coroutines, and
    `async with await limiter.acquire(...) as lease:` releases it on leaving the block."""

    async def release(self) -> bool:  # type: ignore[override]
        """await limiter.release(self)."""
        return bool(await self.limiter.release(self))

    async def renew(self, lease_seconds: int | None = None) -> bool:  # type: ignore[override]
        """await limiter.renew(self, lease_seconds)."""
        return bool(await self.limiter.renew(self, lease_seconds))

    def __enter__(self) -> Lease:
        raise TypeError("an AsyncLease is released with `async with`, not `with`")

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.lease_id:
            await self.limiter.release(self)


def make_lease(cls: type[Lease], raw: tuple[Any, ...], user_id: str, limit: int,
               lease_seconds: int, limiter: Any, shares: Shares | None = None,
               share_class: str | None = None) -> Lease:
    """A Lease from the C extension's acquire tuple (see Limiter._acquire; reserve's slot
    tuple has no 9th element, the share rule)."""
    allowed, held, retry_s, retry_ms, lease_id, expires_at_ms, _now_ms, bound_ms = raw[:8]
    rule = raw[8] if len(raw) > 8 else 0
    refusal = None if shares is None else lease_refusal(user_id, shares, rule, share_class)
    return cls(allowed=allowed, held=held, remaining=max(0, limit - held) if allowed else 0,
               retry_after_s=retry_s, retry_after_ms=retry_ms, lease_id=lease_id,
               expires_at_ms=expires_at_ms, user_id=user_id, limit=limit,
               lease_seconds=lease_seconds, retry_bound_ms=bound_ms, share_refusal=refusal,
               share_class=share_class, limiter=limiter)


def acquire_shares(limit: int, shares: Shares | None, share_class: str | None) -> str | None:
    """acquire's shares= and share_class= checked (before any I/O) and turned into the
    script's spec: None without shares."""
    if shares is None:
        if share_class is not None:
            raise ValueError("share_class needs shares= (the cap's reserved shares)")
        return None
    if not isinstance(shares, Shares):
        raise TypeError(f"shares must be a Shares, not {type(shares).__name__}")
    if share_class is not None and not isinstance(share_class, str):
        raise TypeError(f"share_class must be a str, not {type(share_class).__name__}")
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int, not {type(limit).__name__}")
    return lease_spec(shares, max(limit, 1), share_class)


def lease_maker(cls: type[Lease], user_id: str, in_flight: tuple[int, int] | None,
                limiter: Any) -> Any:
    """reserve(..., in_flight=(limit, lease_seconds)): the maker of its Lease from the C
    slot tuple (read once the C layer validated in_flight), or None without in_flight."""
    if in_flight is None:
        return None
    return lambda raw: make_lease(cls, raw, user_id, in_flight[0], in_flight[1], limiter)


def lease_arguments(lease: Lease, lease_seconds: int | None = None) -> tuple[Any, ...] | None:
    """The C release / renew arguments of a lease: (user_id, lease_id[, lease_seconds]), or
    None when it holds nothing in Redis (refused, or granted by the kill switch)."""
    if not isinstance(lease, Lease):
        raise TypeError(f"expected a Lease made by acquire, not {type(lease).__name__}")
    if not lease.lease_id:
        return None
    if lease_seconds is None:
        return (lease.user_id, lease.lease_id, lease.lease_seconds)
    return (lease.user_id, lease.lease_id, lease_seconds)
