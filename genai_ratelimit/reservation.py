"""Reservations: reserve an estimated cost, reconcile it with what the request really cost.

`limiter.reserve(user_id, windows, cost=..., token_windows=..., tokens=...)` decides a
request against its request windows and its token windows in ONE script execution, all or
nothing (lua/sliding_window.lua), and returns a Reservation. `limiter.reconcile(reservation,
actual)` then sets the logged entry's cost to `actual` in every window where it still is
(lua/reconcile.lua): lower refunds, higher charges, 0 removes it; the same call twice
changes nothing. This module holds what the blocking and the asyncio limiter share: the
Reservation type and the arguments of the reconcile call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Reservation", "WindowState"]

Resource = Literal["requests", "tokens"]


@dataclass(frozen=True, slots=True)
class WindowState:
    """One window of a reservation, as the decision left it."""

    limit: int
    window_seconds: int
    resource: Resource
    # Units left in the window after this decision (the request's own cost taken when it
    # was allowed, not taken when it was refused); None for a window the decision never
    # reached (after the window that refused it).
    remaining: int | None


@dataclass(frozen=True, slots=True)
class Reservation:
    """The answer of `reserve`: the decision, and what `reconcile` needs to find its entry.

    allowed, remaining, retry_after_s, window_seconds: as check_windows answers them, over
    every window; `resource` says whether the deciding window counts requests or tokens.
    """

    allowed: bool
    remaining: int
    retry_after_s: int
    window_seconds: int
    resource: Resource
    # The same wait in milliseconds, not rounded up to a second (0 when allowed): for
    # clients that can sleep precisely (a `retry-after-ms` header).
    retry_after_ms: int
    user_id: str
    cost: int
    tokens: int | None
    windows: tuple[WindowState, ...]
    # The logged entry: its UUID4 member and its time (unix ms). The member is "" when
    # nothing was logged (refused, or RATE_LIMIT_DISABLED): reconcile then sends nothing.
    member: str
    timestamp_ms: int

    def remaining_of(self, resource: Resource) -> int | None:
        """The fewest units left over the windows of one resource the decision reached,
        or None when it has none."""
        left = [w.remaining for w in self.windows
                if w.resource == resource and w.remaining is not None]
        return min(left) if left else None

    @property
    def remaining_requests(self) -> int | None:
        return self.remaining_of("requests")

    @property
    def remaining_tokens(self) -> int | None:
        return self.remaining_of("tokens")


def windows_of(reservation: Reservation, resource: Resource) -> list[tuple[int, int]]:
    return [(w.limit, w.window_seconds) for w in reservation.windows if w.resource == resource]


def make_reservation(raw: tuple[Any, ...], user_id: str, cost: int,
                     tokens: int | None) -> Reservation:
    """A Reservation from the C extension's reserve tuple (see Limiter._reserve)."""
    (allowed, remaining, retry, window_seconds, is_tokens, member, timestamp_ms, report,
     retry_ms) = raw
    return Reservation(
        allowed=allowed, remaining=remaining, retry_after_s=retry, retry_after_ms=retry_ms,
        window_seconds=window_seconds,
        resource="tokens" if is_tokens else "requests", user_id=user_id, cost=cost,
        tokens=tokens,
        windows=tuple(WindowState(limit, seconds, "tokens" if token else "requests", left)
                      for limit, seconds, token, left in report),
        member=member, timestamp_ms=timestamp_ms)


def reserve_arguments(cost: int, token_windows: Sequence[tuple[int, int]],
                      tokens: int | None) -> dict[str, Any]:
    """The keyword arguments of the C reserve call (validated there)."""
    arguments: dict[str, Any] = {"cost": cost, "token_windows": token_windows}
    if tokens is not None:
        arguments["tokens"] = tokens
    return arguments


def reconcile_arguments(reservation: Reservation,
                        actual: int) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The arguments (positional, keyword) of the C reconcile call, or None when there is nothing to
    reconcile (nothing was logged). The estimate being corrected is the tokens when the
    reservation has token windows, else the cost of its request windows."""
    if not isinstance(reservation, Reservation):
        raise TypeError(f"reconcile needs a Reservation made by reserve, not "
                        f"{type(reservation).__name__}")
    if isinstance(actual, bool) or not isinstance(actual, int):
        raise TypeError(f"actual must be an int, not {type(actual).__name__}")
    if actual < 0:
        raise ValueError(f"actual must be >= 0, got {actual}")
    if not reservation.member:
        return None
    tokens = any(w.resource == "tokens" for w in reservation.windows)
    windows = windows_of(reservation, "tokens" if tokens else "requests")
    return ((reservation.user_id, windows, reservation.member, reservation.timestamp_ms, actual),
            {"tokens": tokens})
