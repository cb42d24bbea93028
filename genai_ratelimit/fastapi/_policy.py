"""I/O-free pieces of the decision: window names, the tightest window, IETF policies."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from fastapi import Request

from .._ietf_headers import Policy
from ..reservation import Scope as BudgetScope
from ..reservation import WindowState

logger = logging.getLogger("genai_ratelimit")


Windows = tuple[tuple[int, int], ...]
Decision = tuple[bool, int, int, int]
Identify = Callable[[Request], "tuple[str, str | None]"]


class SyncWindowLimiter(Protocol):
    def check_windows(self, user_id: str, windows: Sequence[tuple[int, int]]) -> Decision: ...


class AsyncWindowLimiter(Protocol):
    def check_windows(self, user_id: str, windows: Sequence[tuple[int, int]]) -> Awaitable[Decision]: ...


# 0 is no window length: it stands for the in-flight cap (max_in_flight) in the headers.
CONCURRENT = 0
_WINDOW_NAMES = {CONCURRENT: "concurrent", 1: "second", 60: "minute", 3_600: "hour", 86_400: "day"}


def window_name(window_seconds: int) -> str:
    """The X-RateLimit-Window value: "second", "minute", "hour", "day", else e.g. "600s"."""
    return _WINDOW_NAMES.get(window_seconds, f"{window_seconds}s")



def _scope_kind(scope: BudgetScope) -> str:
    """X-RateLimit-Scope of a refusal by this scope: upstream, route or model."""
    return "upstream" if scope.shared else scope.name.split(":", 1)[0]


# --- the dependency ------------------------------------------------------------------------


def _now_ms() -> int:
    return int(time.time() * 1000)


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



def _tightest(states: Sequence[WindowState], resource: str) -> WindowState | None:
    """The user's own window of `resource` with the fewest units remaining (ties: the
    shorter), among those the decision reached (scopes' windows left out)."""
    reached = [w for w in states
               if w.resource == resource and w.remaining is not None and w.scope is None]
    return min(reached, key=lambda w: (w.remaining, w.window_seconds)) if reached else None



def in_flight_wait(retry_after: float, lease_expiry_ms: int) -> tuple[int, int]:
    """(retry-after-ms, Retry-After in whole seconds, rounded up) of a concurrency 429: the
    dependency's in_flight_retry_after (a slot frees when a request in flight ends, usually
    within seconds), never later than the soonest lease's expiry, which frees a slot at the
    latest. Both are at most 60 s, the longest wait the openai and anthropic SDKs act on."""
    retry_ms = max(0, min(round(retry_after * 1000), lease_expiry_ms, 60_000))
    return retry_ms, -(-retry_ms // 1000)
