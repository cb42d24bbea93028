"""Exports the limiters' counters (`limiter.metrics()`, kept in C: nothing is added to a
check's path) to Prometheus and to OpenTelemetry.

    from prometheus_client import REGISTRY
    from genai_ratelimit.metrics import PrometheusCollector
    REGISTRY.register(PrometheusCollector({"api": limiter}))

    from genai_ratelimit.metrics import instrument_otel
    instrument_otel({"api": limiter})          # the global MeterProvider's meter

What is exported: FAMILIES below, the one list both exporters read, so a Prometheus label
and an OpenTelemetry attribute are the same name with the same values. Every family has the
label `limiter` (the name given to each limiter); every other label takes its values from a
fixed set or from the first 32 distinct rejecting windows of a limiter (later ones are
counted as window_seconds="other"): no user id, no scope name, so the number of series is
bounded whatever the traffic. No label is ever empty.

Two levels: the limiter's counters (`limiter.metrics()`, in C) count what Redis decides; the
FastAPI dependencies count each request they decide in exactly one outcome of
genai_ratelimit_requests_total (OUTCOMES; labels tier, scope, mode, window_seconds,
resource, from the dependency's configuration), the requests running now in
genai_ratelimit_in_flight_requests and their tokens by tier in
genai_ratelimit_request_tokens_total (`request_outcomes(limiter)`; exported with the
limiter's counters, under its name). docs/operations-dashboard.md has the outcome table.

Several processes (uvicorn --workers N, gunicorn): `PrometheusCollector(..., directory=DIR)`
in every worker. Each worker writes its counters to DIR (a file per process, every
`interval` seconds and at exit) and a scrape of any worker sums every file: the totals of
all workers, those that died included (see docs/operations.md, "Several workers").

Needs the `prometheus` extra (prometheus_client) or the `otel` extra (opentelemetry-api).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict

if TYPE_CHECKING:  # typing.NotRequired is 3.11's; nothing needs it at run time
    from typing_extensions import NotRequired

__all__ = [
    "LimiterMetrics",
    "RequestOutcomes",
    "OUTCOMES",
    "request_outcomes",
    "BudgetThresholdCounts",
    "budget_thresholds",
    "QueueWaits",
    "queue_waits",
    "QUEUE_WAIT_BUCKETS",
    "LatencyHistogram",
    "Family",
    "FAMILIES",
    "LATENCY_BUCKETS",
    "PrometheusCollector",
    "instrument_otel",
    "samples",
    "merge_snapshots",
]

NAMESPACE = "genai_ratelimit"
_logger = logging.getLogger("genai_ratelimit")

# The upper bounds (seconds) of the latency histogram's finite buckets (csrc/py_metrics.c).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# The upper bounds (seconds) of the wait-queue histogram's finite buckets: a wait is at most
# wait_queue.MAX_WAIT_SECONDS (300 s).
QUEUE_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                      60.0, 120.0, 300.0)
# The `op` of a round trip: a limiter method's name, "ping", or "command" (SCAN, CLUSTER ...).
OPS = ("check", "check_windows", "check_windows_detailed", "reserve", "reconcile", "peek",
       "reset", "acquire", "release", "renew", "ping", "command")


def _decrement_once(lock: threading.Lock, counts: dict[str, int], key: str) -> Callable[[], None]:
    """A leave(): counts[key] taken down by one under `lock`, the first time it is called
    only (again: a no-op)."""
    done = False

    def leave() -> None:
        nonlocal done
        with lock:
            if not done:
                done = True
                counts[key] -= 1
    return leave

class LatencyHistogram(TypedDict):
    """The round trips of one op: each bucket's own count (not cumulative)."""

    buckets: tuple[tuple[float | None, int], ...]  # (upper bound s | None for the rest, count)
    sum_s: float
    count: int


class LimiterMetrics(TypedDict):
    """A limiter's counters (`limiter.metrics()`), each exact and monotonic since the limiter
    was made (counted in C; the blocking limiter's threads count with atomic adds)."""

    enabled: bool  # False when built with metrics=False: then every count stays 0
    allowed: int  # decisions allowed (check, check_windows, reserve)
    rejected: int  # decisions rejected, all windows
    # Rejections by the window that refused: (window_seconds | None, resource, scope, count),
    # resource "requests" | "tokens", scope "user" | "route" | "model" | "upstream" | "other";
    # window_seconds None: beyond the first 32 distinct windows.
    rejections: tuple[tuple[int | None, str, str, int], ...]
    rejected_by_window: dict[str, int]  # "60", "86400", "60:tokens" (every scope), "other"
    unavailable: int  # decisions that raised (Redis unreachable, timed out, garbage)
    fail_open: int  # requests the FastAPI layer let through with Redis unavailable
    shadow: int  # rejections the FastAPI layer let through in shadow mode
    reserved_tokens: int  # token estimates of admitted reservations (reserve)
    charged_tokens: int  # tokens reconcile set as used (each reconcile that found its entry)
    refunded_tokens: int  # estimate - used, when reconcile lowered the estimate
    leases_acquired: int  # acquire took a slot
    leases_refused: int  # acquire found every slot held
    leases_released: int  # release gave back a slot still held
    releases_not_held: int  # release of a lease that had expired or was released already
    replays: int  # decisions sent again after a broken connection
    connection_errors: int  # connections that could not open or broke mid-call
    latency_by_op: dict[str, LatencyHistogram]  # every op of OPS
    # The script round trips (every op but ping and command) together:
    latency_buckets: tuple[tuple[float | None, int], ...]  # (upper bound s | None, count)
    latency_sum_s: float  # the sum of the round trips counted in the buckets
    latency_count: int  # script round trips (decisions, peeks, resets, reconciles, leases)
    # The FastAPI layer's requests (not in limiter.metrics(): added by the exporters, see
    # RequestOutcomes): (outcome, tier, scope, mode, window_seconds, resource, count) ...
    requests: NotRequired[tuple[tuple[str, str, str, str, str, str, int], ...]]
    # ... and the requests in flight now, by tier: (tier, count).
    in_flight_requests: NotRequired[tuple[tuple[str, int], ...]]
    # ... and the tokens of its TokenRateLimit requests: (tier, mode, state, count), state
    # reserved | charged | refunded.
    request_tokens: NotRequired[tuple[tuple[str, str, str, int], ...]]
    # Soft limits crossed (hold_budgets / settle_budgets, see BudgetThresholdCounts):
    # (budget, level, threshold, count).
    budget_thresholds: NotRequired[tuple[tuple[str, str, str, int], ...]]
    # ... and the money of its TokenRateLimit(prices=...) requests, in the price table's
    # money units: (tier, level, mode, currency, state, amount), state held | released |
    # settled (see RequestOutcomes.add_spend) ...
    spend: NotRequired[tuple[tuple[str, str, str, str, str, int], ...]]
    # ... and the budgets held by their use after the hold: (tier, level, band, count).
    spend_budget_use: NotRequired[tuple[tuple[str, str, str, int], ...]]
    # The wait queues of shared caps (reserve(max_wait=...), see QueueWaits): the requests
    # of this process waiting now, by upstream: (upstream, count) ...
    queue_waiting: NotRequired[tuple[tuple[str, int], ...]]
    # ... and the waits over, by upstream and outcome: (upstream, outcome, histogram).
    queue_wait: NotRequired[tuple[tuple[str, str, LatencyHistogram], ...]]


@dataclass(frozen=True)
class Family:
    """One exported metric. Prometheus: `genai_ratelimit_<name>` (+ `_total` for a
    counter); OpenTelemetry: `genai_ratelimit.<name with dots>`, with `unit`."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    labels: tuple[str, ...]  # besides `limiter`
    help: str
    unit: str  # OpenTelemetry's unit (UCUM); Prometheus's is in the name
    otel_name: str


def _family(name: str, kind: Literal["counter", "gauge", "histogram"], labels: tuple[str, ...],
            help: str, unit: str, otel_name: str) -> Family:
    return Family(name, kind, labels, help, unit, f"{NAMESPACE}.{otel_name}")


DECISIONS = _family("decisions", "counter", ("outcome",),
                    "Rate-limit decisions (check, check_windows, reserve) by outcome: allowed, "
                    "rejected, unavailable (Redis could not decide).", "{decision}", "decisions")
REJECTIONS = _family("rejections", "counter", ("window_seconds", "resource", "scope"),
                     "Rejected decisions by the window that refused: its length (or other), "
                     "resource (requests, tokens) and scope (user, route, model, upstream, "
                     "other).", "{decision}", "rejections")
RESERVED_TOKENS = _family("reserved_tokens", "counter", (),
                          "Token estimates of the reservations admitted.", "{token}",
                          "tokens.reserved")
CHARGED_TOKENS = _family("charged_tokens", "counter", (),
                         "Tokens reconcile set as used.", "{token}", "tokens.charged")
REFUNDED_TOKENS = _family("refunded_tokens", "counter", (),
                          "Tokens given back by reconcile (estimate minus used).", "{token}",
                          "tokens.refunded")
LEASE_ACQUISITIONS = _family("lease_acquisitions", "counter", ("outcome",),
                             "In-flight lease acquisitions by outcome: acquired, refused.",
                             "{lease}", "lease.acquisitions")
LEASE_RELEASES = _family("lease_releases", "counter", ("outcome",),
                         "Lease releases by outcome: released (the slot was held), not_held "
                         "(it had expired or was released already).", "{lease}",
                         "lease.releases")
FAIL_OPEN = _family("fail_open_requests", "counter", (),
                    "Requests the FastAPI layer let through while Redis could not decide "
                    "(on_unavailable='allow').", "{request}", "fail_open.requests")
SHADOW = _family("shadow_would_refuse_requests", "counter", (),
                 "Requests a shadow-mode dependency let through that its budget refused.",
                 "{request}", "shadow.would_refuse.requests")
REPLAYS = _family("replays", "counter", (), "Decisions sent again after a broken connection.",
                  "{decision}", "replays")
CONNECTION_ERRORS = _family("connection_errors", "counter", (),
                            "Redis connections that failed to open or broke.", "{connection}",
                            "connection_errors")
LATENCY = _family("redis_latency_seconds", "histogram", ("op",),
                  "Round trips to Redis by op (a limiter method, ping, or command).", "s",
                  "redis.latency")

REQUESTS = _family("requests", "counter",
                   ("outcome", "tier", "scope", "mode", "window_seconds", "resource"),
                   "Requests decided by a FastAPI dependency, each in exactly one outcome: "
                   "allowed, rejected, too_large, concurrency_rejected, shadow_would_refuse, "
                   "unavailable_denied, fail_open, queued_then_allowed, queue_timeout, "
                   "queue_full, queue_abandoned.", "{request}", "requests")
REQUEST_TOKENS = _family("request_tokens", "counter", ("tier", "mode", "state"),
                         "Tokens of the requests a TokenRateLimit allowed, by tier: reserved "
                         "(the estimates), charged (the usage reconciled), refunded (estimate "
                         "minus usage).", "{token}", "requests.tokens")
IN_FLIGHT = _family("in_flight_requests", "gauge", ("tier",),
                    "Requests a FastAPI dependency let run whose response is not over yet "
                    "(needs RateLimitHeadersMiddleware).", "{request}", "requests.in_flight")

BUDGET_THRESHOLDS = _family("budget_thresholds_crossed", "counter",
                            ("budget", "level", "threshold"),
                            "Soft limits of calendar budgets crossed (each once per period "
                            "across every replica), by budget name, level and threshold "
                            "(percent of the limit).", "{crossing}", "budget.thresholds.crossed")

SPEND = _family("spend_units", "counter", ("tier", "level", "mode", "currency", "state"),
                "Money of the requests a TokenRateLimit(prices=...) allowed, in the price "
                "table's money units (micro-units of the currency by default), by tier and "
                "budget level: held (the worst cases held at admission), released (the holds "
                "settled, whole), settled (the costs charged). held - released: held now.",
                "{unit}", "spend")
SPEND_BUDGET_USE = _family("spend_budget_use", "counter", ("tier", "level", "band"),
                           "Budgets held at admission by their use after the hold (spent + "
                           "held, a fraction of the limit), in bands: band is the band's upper "
                           "bound (0.5, 0.8, 0.9, 0.95, 1).", "{budget}", "spend.budget_use")
# The upper bounds of SPEND_BUDGET_USE's bands.
SPEND_USE_BANDS = ("0.5", "0.8", "0.9", "0.95", "1")
_SPEND_USE_PERCENTS = (50, 80, 90, 95, 100)
_SPEND_STATES = ("held", "released", "settled")

QUEUE_WAITING = _family("queue_waiting_requests", "gauge", ("upstream",),
                        "Requests of this process waiting now in a shared cap's wait queue "
                        "(reserve(max_wait=...)), by upstream (the shared scope's name). Per "
                        "process: the sum over every replica is the queue's depth.",
                        "{request}", "queue.waiting")
QUEUE_WAIT = _family("queue_wait_seconds", "histogram", ("upstream", "outcome"),
                     "Seconds requests waited in a shared cap's wait queue, by upstream and "
                     "outcome: queued_then_allowed (admitted after the wait), queue_timeout "
                     "(refused: its deadline came first).", "s", "queue.wait")

FAMILIES: tuple[Family, ...] = (DECISIONS, REJECTIONS, RESERVED_TOKENS, CHARGED_TOKENS,
                                REFUNDED_TOKENS, LEASE_ACQUISITIONS, LEASE_RELEASES, FAIL_OPEN,
                                SHADOW, REPLAYS, CONNECTION_ERRORS, LATENCY, REQUESTS, IN_FLIGHT,
                                REQUEST_TOKENS, BUDGET_THRESHOLDS, SPEND, SPEND_BUDGET_USE,
                                QUEUE_WAITING, QUEUE_WAIT)

# The outcomes of a request in the FastAPI layer (REQUESTS), each one HTTP answer:
OUTCOMES = (
    "allowed",              # the route ran (its own status): every window had room
    "rejected",             # 429: a window refused (user, route, model or upstream scope)
    "too_large",            # 429, x-should-retry: false: the token estimate exceeds a limit
    "concurrency_rejected",  # 429, X-RateLimit-Window: concurrent: every in-flight slot held
    "shadow_would_refuse",  # the route ran: mode="shadow" and the budget would have refused
    "unavailable_denied",   # 503: Redis could not decide, on_unavailable="deny"
    "fail_open",            # the route ran: Redis could not decide, on_unavailable="allow"
    "queued_then_allowed",  # the route ran after waiting in an upstream's queue (max_wait)
    "queue_timeout",        # 429: it waited in an upstream's queue; its deadline came first
    "queue_full",           # 429 at once: the upstream's queue (or the tenant's share) is full
    "queue_abandoned",      # 499, the route never ran: the client left while it waited
)
_OUTCOME_SET = frozenset(OUTCOMES)
# The bound on a RequestOutcomes' series: label sets beyond it count as one "other" set.
MAX_REQUEST_SERIES = 1000


class RequestOutcomes:
    """The FastAPI layer's counts for one limiter (every dependency on that limiter counts
    here, see `request_outcomes`): requests by outcome and labels, and requests in flight by
    tier. Thread-safe (the threadpool and the event loop count together). Label values come
    from the dependency's configuration (tiers, windows, scope kinds), never from a request:
    the number of series is bounded by the configuration (and by MAX_REQUEST_SERIES)."""

    __slots__ = ("_lock", "_counts", "_in_flight", "_tokens", "_spend", "_use", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, str, str, str, str], int] = {}
        self._in_flight: dict[str, int] = {}
        self._tokens: dict[tuple[str, str, str], int] = {}
        self._spend: dict[tuple[str, str, str, str, str], int] = {}
        self._use: dict[tuple[str, str, str], int] = {}

    def add_spend(self, state: str, *, tier: str, level: str, mode: str, currency: str,
                  amount: int) -> None:
        """Counts `amount` money units (the price table's) of a TokenRateLimit request of
        `tier` at budget `level` ("key", or a SpendLevel's): state "held" (its worst case,
        at admission), "released" (that hold, when it is settled) or "settled" (the cost
        charged). held - released is what requests hold now (or left held: their usage
        never came); released - settled what the settles gave back."""
        if state not in _SPEND_STATES:
            raise ValueError(f"state must be held, released or settled, got {state!r}")
        if isinstance(amount, bool) or not isinstance(amount, int) or amount < 0:
            raise ValueError(f"amount must be an int >= 0, got {amount!r}")
        key = (tier, level, mode, currency, state)
        if not all(isinstance(value, str) and value for value in key):
            raise ValueError(f"every label must be a non-empty str, got {key!r}")
        with self._lock:
            if key not in self._spend and len(self._spend) >= MAX_REQUEST_SERIES:
                key = ("other", "other", mode, currency, state)
            self._spend[key] = self._spend.get(key, 0) + amount

    def add_budget_use(self, *, tier: str, level: str, limit: int, remaining: int) -> None:
        """Counts one budget held at admission in the band of its use after the hold:
        (limit - remaining) / limit, exact (integers: no float decides the band)."""
        used = limit - remaining
        band = next((b for b, percent in zip(SPEND_USE_BANDS, _SPEND_USE_PERCENTS, strict=True)
                     if used * 100 <= limit * percent), SPEND_USE_BANDS[-1])
        key = (tier, level, band)
        with self._lock:
            if key not in self._use and len(self._use) >= MAX_REQUEST_SERIES:
                key = ("other", "other", band)
            self._use[key] = self._use.get(key, 0) + 1

    def spend(self) -> tuple[tuple[str, str, str, str, str, int], ...]:
        """(tier, level, mode, currency, state, amount), sorted."""
        with self._lock:
            return tuple(sorted((*key, n) for key, n in self._spend.items()))

    def budget_use(self) -> tuple[tuple[str, str, str, int], ...]:
        """(tier, level, band, budgets), sorted."""
        with self._lock:
            return tuple(sorted((*key, n) for key, n in self._use.items()))

    def spent(self, state: str = "settled", **labels: str) -> int:
        """The money units counted in `state` with these labels (tier, level, mode,
        currency), e.g. request_outcomes(limiter).spent("held", level="org")."""
        names = ("tier", "level", "mode", "currency")
        unknown = set(labels) - set(names)
        if unknown:
            raise ValueError(f"unknown labels {sorted(unknown)}: use {names}")
        with self._lock:
            return sum(n for key, n in self._spend.items() if key[4] == state
                       and all(key[names.index(k)] == v for k, v in labels.items()))

    def _bump_known(self, series: dict[Any, int], key: tuple[Any, ...], n: int) -> bool:
        """Adds n to a series counted before (its labels were checked when it was first
        counted) and answers True; False for a new series or an unhashable label (the caller
        checks and counts it)."""
        with self._lock:
            try:
                known = series.get(key)
            except TypeError:
                return False
            if known is None:
                return False
            series[key] = known + n
            return True

    def add_tokens(self, state: str, *, tier: str, mode: str, count: int) -> None:
        """Counts `count` tokens of a TokenRateLimit request of `tier`: state "reserved",
        "charged" or "refunded"."""
        if type(count) is int and count >= 0 and self._bump_known(  # noqa: E721 - bool is not a count
                self._tokens, (tier, mode, state), count):
            return
        if state not in ("reserved", "charged", "refunded"):
            raise ValueError(f"state must be reserved, charged or refunded, got {state!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        with self._lock:
            key = (tier, mode, state)
            if key not in self._tokens and len(self._tokens) >= MAX_REQUEST_SERIES:
                key = ("other", mode, state)
            self._tokens[key] = self._tokens.get(key, 0) + count

    def tokens(self) -> tuple[tuple[str, str, str, int], ...]:
        """(tier, mode, state, tokens), sorted."""
        with self._lock:
            return tuple(sorted((*key, n) for key, n in self._tokens.items()))

    def add(self, outcome: str, *, tier: str, scope: str, mode: str, window_seconds: str,
            resource: str) -> None:
        """Counts one request in `outcome` (one of OUTCOMES) with these labels (non-empty)."""
        labels = (outcome, tier, scope, mode, window_seconds, resource)
        if self._bump_known(self._counts, labels, 1):
            return
        if outcome not in _OUTCOME_SET:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        if not all(isinstance(value, str) and value for value in labels):
            raise ValueError(f"every label must be a non-empty str, got {labels!r}")
        with self._lock:
            if labels not in self._counts and len(self._counts) >= MAX_REQUEST_SERIES:
                labels = (outcome, "other", "other", mode, "other", "other")
            self._counts[labels] = self._counts.get(labels, 0) + 1

    def _add_running(self, outcome: str, tier: str, scope: str, mode: str, window_seconds: str,
                    resource: str) -> Callable[[], None]:
        """add(outcome, ...) and enter(tier) for a request that runs (the FastAPI layer's),
        under one hold of the lock when the series was counted before. Returns enter's
        leave()."""
        labels = (outcome, tier, scope, mode, window_seconds, resource)
        with self._lock:
            try:
                count = self._counts.get(labels)
            except TypeError:  # an unhashable label: refused by add()
                count = None
            if count is not None:
                self._counts[labels] = count + 1
                self._in_flight[tier] = self._in_flight.get(tier, 0) + 1
                return self._leaver(tier)
        self.add(outcome, tier=tier, scope=scope, mode=mode, window_seconds=window_seconds,
                 resource=resource)
        return self.enter(tier)

    def _leaver(self, tier: str) -> Callable[[], None]:
        """The leave() of one request of `tier` counted in flight: once only."""
        return _decrement_once(self._lock, self._in_flight, tier)

    def enter(self, tier: str) -> Callable[[], None]:
        """One more request of `tier` in flight; call the answer (once) when it is over."""
        with self._lock:
            self._in_flight[tier] = self._in_flight.get(tier, 0) + 1
        return self._leaver(tier)

    def snapshot(self) -> tuple[tuple[tuple[str, str, str, str, str, str, int], ...],
                                tuple[tuple[str, int], ...]]:
        """(requests: (outcome, tier, scope, mode, window_seconds, resource, count) sorted,
        in flight: (tier, count) sorted)."""
        with self._lock:
            return (tuple(sorted((*labels, n) for labels, n in self._counts.items())),
                    tuple(sorted(self._in_flight.items())))

    def total(self, **labels: str) -> int:
        """The requests counted with these labels (all of them: no labels). Example:
        request_outcomes(limiter).total(outcome="rejected", mode="enforce")."""
        names = REQUESTS.labels
        unknown = set(labels) - set(names)
        if unknown:
            raise ValueError(f"unknown labels {sorted(unknown)}: use {names}")
        with self._lock:
            return sum(n for values, n in self._counts.items()
                       if all(values[names.index(k)] == v for k, v in labels.items()))

    def in_flight(self, tier: str | None = None) -> int:
        """The requests in flight now (of `tier`, or all)."""
        with self._lock:
            return sum(n for t, n in self._in_flight.items() if tier is None or t == tier)


# The RequestOutcomes of each limiter, kept beside it (weakly: it goes with the limiter).
_OUTCOMES: weakref.WeakKeyDictionary[Any, RequestOutcomes] = weakref.WeakKeyDictionary()
_OUTCOMES_BY_ID: dict[int, RequestOutcomes] = {}  # limiters that take no weak reference
_OUTCOMES_LOCK = threading.Lock()


def request_outcomes(limiter: Any) -> RequestOutcomes:
    """The FastAPI layer's counts of requests decided with `limiter` (made on first use).
    The exporters (PrometheusCollector, instrument_otel) export them beside the limiter's
    own counters, as genai_ratelimit_requests_total and genai_ratelimit_in_flight_requests.

        from genai_ratelimit.metrics import request_outcomes
        request_outcomes(limiter).total(outcome="allowed")
    """
    with _OUTCOMES_LOCK:
        try:
            found = _OUTCOMES.get(limiter)
            if found is None:
                found = _OUTCOMES[limiter] = RequestOutcomes()
            return found
        except TypeError:  # no weak reference to it
            return _OUTCOMES_BY_ID.setdefault(id(limiter), RequestOutcomes())


class BudgetThresholdCounts:
    """The soft limits a limiter's hold_budgets / settle_budgets crossed (each crossing is
    counted by the one process whose call crossed it: once in all, across replicas), by
    (budget name, level, threshold). Thread-safe. Labels come from the budgets'
    configuration, never from an owner: beyond MAX_REQUEST_SERIES series, budget and level
    count as "other"."""

    __slots__ = ("_lock", "_counts", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, str], int] = {}

    def add(self, budget: str, level: str | None, threshold: int) -> None:
        """Counts one crossing (level None: "none")."""
        labels = (budget, level or "none", str(threshold))
        with self._lock:
            if labels not in self._counts and len(self._counts) >= MAX_REQUEST_SERIES:
                labels = ("other", "other", labels[2])
            self._counts[labels] = self._counts.get(labels, 0) + 1

    def snapshot(self) -> tuple[tuple[str, str, str, int], ...]:
        """(budget, level, threshold, count), sorted."""
        with self._lock:
            return tuple(sorted((*labels, n) for labels, n in self._counts.items()))

    def total(self, budget: str | None = None, level: str | None = None,
              threshold: int | None = None) -> int:
        """The crossings counted with these labels (all of them: no labels)."""
        with self._lock:
            return sum(n for (b, lv, t), n in self._counts.items()
                       if (budget is None or b == budget) and (level is None or lv == level)
                       and (threshold is None or t == str(threshold)))


_THRESHOLDS: weakref.WeakKeyDictionary[Any, BudgetThresholdCounts] = weakref.WeakKeyDictionary()


def budget_thresholds(limiter: Any) -> BudgetThresholdCounts:
    """The soft limits crossed by `limiter`'s budget calls (made on first use), exported
    with its counters as genai_ratelimit_budget_thresholds_crossed_total.

        from genai_ratelimit.metrics import budget_thresholds
        budget_thresholds(limiter).total(budget="monthly_usd", threshold=80)
    """
    with _OUTCOMES_LOCK:
        found = _THRESHOLDS.get(limiter)
        if found is None:
            found = _THRESHOLDS[limiter] = BudgetThresholdCounts()
        return found

# The outcomes of a wait in a queue that QUEUE_WAIT observes (queue_full never waited).
QUEUE_WAIT_OUTCOMES = ("queued_then_allowed", "queue_timeout")
# The distinct upstreams a QueueWaits labels; later ones count as upstream="other".
MAX_QUEUE_UPSTREAMS = 32


class QueueWaits:
    """The wait queues of one limiter's shared caps, as this process sees them (see
    `queue_waits`): the requests waiting now (a ticket taken, not yet admitted or given up)
    and the seconds each wait lasted, by upstream (the shared scope's name: configuration,
    e.g. "openai/gpt-4o"; beyond MAX_QUEUE_UPSTREAMS names, "other") and outcome.
    Thread-safe. Counted by RateLimiter and AsyncRateLimiter around reserve(max_wait=...).

    The depth is per process, not read from Redis: the exporters do no I/O at a scrape.
    Summed over every replica (Prometheus: sum without (instance)), it is the queue's live
    tickets; `genai-ratelimit top` and `inspect --upstream` read the queue itself."""

    __slots__ = ("_lock", "_waiting", "_waits", "_names", "_listeners", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, int] = {}
        self._waits: dict[tuple[str, str], list[Any]] = {}  # [bucket counts, sum, count]
        self._names: set[str] = set()
        self._listeners: dict[object, Callable[[str, str, float], None]] = {}

    def _label(self, upstream: str) -> str:
        if upstream not in self._names:
            if len(self._names) >= MAX_QUEUE_UPSTREAMS:
                return "other"
            self._names.add(upstream)
        return upstream

    def enter(self, upstream: str) -> Callable[[], None]:
        """One more request waiting in `upstream`'s queue; call the answer (once, again a
        no-op) when it stops waiting."""
        with self._lock:
            label = self._label(upstream)
            self._waiting[label] = self._waiting.get(label, 0) + 1
        return _decrement_once(self._lock, self._waiting, label)

    def observe(self, upstream: str, outcome: str, seconds: float) -> None:
        """One wait over: `seconds` in `upstream`'s queue, ended in `outcome`
        (QUEUE_WAIT_OUTCOMES)."""
        if outcome not in QUEUE_WAIT_OUTCOMES:
            raise ValueError(f"outcome must be one of {QUEUE_WAIT_OUTCOMES}, got {outcome!r}")
        seconds = max(0.0, float(seconds))
        with self._lock:
            key = (self._label(upstream), outcome)
            found = self._waits.get(key)
            if found is None:
                found = self._waits[key] = [[0] * (len(QUEUE_WAIT_BUCKETS) + 1), 0.0, 0]
            index = next((i for i, bound in enumerate(QUEUE_WAIT_BUCKETS) if seconds <= bound),
                         len(QUEUE_WAIT_BUCKETS))
            found[0][index] += 1
            found[1] += seconds
            found[2] += 1
            listeners = tuple(self._listeners.values())
        for listener in listeners:
            listener(key[0], outcome, seconds)

    def add_listener(self, listener: Callable[[str, str, float], None],
                     key: object = None) -> None:
        """listener(upstream, outcome, seconds) is called after each observe (instrument_otel
        records the waits into its histogram so). A listener added with the `key` of an
        earlier one replaces it."""
        with self._lock:
            self._listeners[listener if key is None else key] = listener

    def waiting(self, upstream: str | None = None) -> int:
        """The requests of this process waiting now (in `upstream`'s queue, or in any)."""
        with self._lock:
            return sum(n for u, n in self._waiting.items() if upstream is None or u == upstream)

    def waits(self, upstream: str | None = None, outcome: str | None = None) -> int:
        """The waits over (of `upstream`, ending in `outcome`; all: no arguments)."""
        with self._lock:
            return sum(found[2] for (u, o), found in self._waits.items()
                       if (upstream is None or u == upstream) and (outcome is None or o == outcome))

    def snapshot(self) -> tuple[tuple[tuple[str, int], ...],
                                tuple[tuple[str, str, LatencyHistogram], ...]]:
        """(waiting: (upstream, count) sorted, waits: (upstream, outcome, histogram) sorted)."""
        bounds: tuple[float | None, ...] = (*QUEUE_WAIT_BUCKETS, None)
        with self._lock:
            waiting = tuple(sorted(self._waiting.items()))
            waits = tuple((upstream, outcome,
                           LatencyHistogram(buckets=tuple(zip(bounds, counts, strict=True)),
                                            sum_s=total, count=count))
                          for (upstream, outcome), (counts, total, count)
                          in sorted(self._waits.items()))
        return waiting, waits


_QUEUE_WAITS: weakref.WeakKeyDictionary[Any, QueueWaits] = weakref.WeakKeyDictionary()
_QUEUE_WAITS_BY_ID: dict[int, QueueWaits] = {}  # limiters that take no weak reference


def queue_waits(limiter: Any) -> QueueWaits:
    """The wait queues of `limiter`'s shared caps as this process sees them (made on first
    use), exported with its counters as genai_ratelimit_queue_waiting_requests and
    genai_ratelimit_queue_wait_seconds.

        from genai_ratelimit.metrics import queue_waits
        queue_waits(limiter).waits(upstream="openai/gpt-4o", outcome="queue_timeout")
    """
    with _OUTCOMES_LOCK:
        try:
            found = _QUEUE_WAITS.get(limiter)
            if found is None:
                found = _QUEUE_WAITS[limiter] = QueueWaits()
            return found
        except TypeError:  # no weak reference to it
            return _QUEUE_WAITS_BY_ID.setdefault(id(limiter), QueueWaits())


def count_queue_wait(limiter: Any, scopes: Any, reservation: Any) -> None:
    """Observes a reserve(max_wait=...)'s wait in the queue of each shared scope it waited
    in (queued_then_allowed, queue_timeout; nothing when it was decided at once or its
    queue was full)."""
    outcome = getattr(reservation, "queue_outcome", "")
    if outcome not in QUEUE_WAIT_OUTCOMES:
        return
    waits = queue_waits(limiter)
    for scope in scopes:
        if getattr(scope, "shared", False):
            waits.observe(scope.name, outcome, reservation.waited_ms / 1000)


def exported(limiter: _Measured) -> LimiterMetrics:
    """limiter.metrics(), the FastAPI layer's counts of requests (request_outcomes) and the
    soft limits crossed (budget_thresholds)."""
    snapshot = limiter.metrics()
    outcomes = request_outcomes(limiter)
    snapshot["requests"], snapshot["in_flight_requests"] = outcomes.snapshot()
    snapshot["request_tokens"] = outcomes.tokens()
    snapshot["spend"] = outcomes.spend()
    snapshot["spend_budget_use"] = outcomes.budget_use()
    try:
        snapshot["budget_thresholds"] = budget_thresholds(limiter).snapshot()
    except TypeError:  # no weak reference to it: nothing crossed through it
        snapshot["budget_thresholds"] = ()
    snapshot["queue_waiting"], snapshot["queue_wait"] = queue_waits(limiter).snapshot()
    return snapshot

# A sample: (family, label values in the family's order, value). A histogram's value is
# its LatencyHistogram.
Sample = tuple[Family, tuple[str, ...], Any]


def samples(snapshot: LimiterMetrics) -> Iterator[Sample]:
    """Every sample of one limiter's metrics() snapshot: the one reading of a snapshot that
    both exporters share. A histogram of an op never used is left out."""
    for outcome in ("allowed", "rejected", "unavailable"):
        yield DECISIONS, (outcome,), snapshot[outcome]
    for seconds, resource, scope, count in sorted(snapshot["rejections"],
                                                  key=lambda r: (r[0] is None, r[0] or 0, r[1:])):
        yield REJECTIONS, ("other" if seconds is None else str(seconds), resource, scope), count
    yield RESERVED_TOKENS, (), snapshot["reserved_tokens"]
    yield CHARGED_TOKENS, (), snapshot["charged_tokens"]
    yield REFUNDED_TOKENS, (), snapshot["refunded_tokens"]
    yield LEASE_ACQUISITIONS, ("acquired",), snapshot["leases_acquired"]
    yield LEASE_ACQUISITIONS, ("refused",), snapshot["leases_refused"]
    yield LEASE_RELEASES, ("released",), snapshot["leases_released"]
    yield LEASE_RELEASES, ("not_held",), snapshot["releases_not_held"]
    yield FAIL_OPEN, (), snapshot["fail_open"]
    yield SHADOW, (), snapshot["shadow"]
    yield REPLAYS, (), snapshot["replays"]
    yield CONNECTION_ERRORS, (), snapshot["connection_errors"]
    for op in OPS:
        histogram = snapshot["latency_by_op"].get(op)
        if histogram is not None and histogram["count"] > 0:
            yield LATENCY, (op,), histogram
    for *labels, count in snapshot.get("requests", ()):
        yield REQUESTS, tuple(labels), count
    for tier, count in snapshot.get("in_flight_requests", ()):
        yield IN_FLIGHT, (tier,), count
    for tier, mode, state, count in snapshot.get("request_tokens", ()):
        yield REQUEST_TOKENS, (tier, mode, state), count
    for budget, level, threshold, count in snapshot.get("budget_thresholds", ()):
        yield BUDGET_THRESHOLDS, (budget, level, threshold), count
    for *labels, amount in snapshot.get("spend", ()):
        yield SPEND, tuple(labels), amount
    for *labels, count in snapshot.get("spend_budget_use", ()):
        yield SPEND_BUDGET_USE, tuple(labels), count
    for upstream, count in snapshot.get("queue_waiting", ()):
        yield QUEUE_WAITING, (upstream,), count
    for upstream, outcome, histogram in snapshot.get("queue_wait", ()):
        yield QUEUE_WAIT, (upstream, outcome), histogram


def report_crossings(limiter: Any, crossings: Sequence[Any]) -> None:
    """Counts each soft limit crossed (periods.BudgetCrossing) in budget_thresholds(limiter)
    and logs it on the `genai_ratelimit` logger (WARNING). The app's callback is the
    limiter's business (limiter.py, aio.py)."""
    if not crossings:
        return
    counts = budget_thresholds(limiter)
    for c in crossings:
        counts.add(c.budget.name, c.budget.level, c.threshold)
        start = datetime.fromtimestamp(c.period_start_ms / 1000, c.budget.zone)
        _logger.warning("budget %r of %r (level %s) reached %d%% of its limit %d in the %s "
                        "starting %s (by a %s, hold %s)", c.budget.name, c.budget.owner,
                        c.budget.level or "none", c.threshold, c.budget.limit, c.budget.period,
                        start.isoformat(), c.by, c.hold_id)


def count_reservation(record: Callable[[str, int], None], reservation: Any) -> None:
    """Counts an admitted reservation's token estimate (reserve; nothing when refused, when
    the kill switch answered, or without token windows)."""
    if reservation.allowed and reservation.tokens and (reservation.member
                                                       or reservation.shared_entries):
        record("reserved_tokens", reservation.tokens)


def count_reconcile(record: Callable[[str, int], None], reservation: Any, actual: int,
                    found: int) -> None:
    """Counts a reconcile that found its entry: `actual` tokens charged, and the estimate's
    excess refunded (token reservations only)."""
    if found and reservation.tokens is not None:
        record("charged_tokens", actual)
        if reservation.tokens > actual:
            record("refunded_tokens", reservation.tokens - actual)


class _Measured(Protocol):
    def metrics(self) -> LimiterMetrics: ...


def _named(limiters: Mapping[str, _Measured] | _Measured) -> dict[str, _Measured]:
    """{name: limiter}; a lone limiter is named "default"."""
    if isinstance(limiters, Mapping):
        named = dict(limiters)
    else:
        named = {"default": limiters}
    for name, limiter in named.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"a limiter's name must be a non-empty str, got {name!r}")
        if not callable(getattr(limiter, "metrics", None)):
            raise TypeError(f"limiter {name!r} has no metrics(): pass a RateLimiter or an "
                            f"AsyncRateLimiter, not {type(limiter).__name__}")
    return named


def _cumulative(histogram: LatencyHistogram) -> list[tuple[str, float]]:
    """The buckets as Prometheus's cumulative (le, count) pairs, "+Inf" last."""
    out: list[tuple[str, float]] = []
    total = 0
    for bound, count in histogram["buckets"]:
        total += count
        out.append(("+Inf" if bound is None else repr(bound), total))
    return out


# ------------------------------------------------------------------ several processes

def merge_snapshots(snapshots: Sequence[LimiterMetrics]) -> LimiterMetrics:
    """The sum of several metrics() snapshots (of one limiter in several processes): every
    counter added, rejections by their labels, histograms bucket by bucket."""
    merged: dict[str, Any] = {"enabled": any(s["enabled"] for s in snapshots)}
    rejections: dict[tuple[int | None, str, str], int] = {}
    by_window: dict[str, int] = {}
    ops: dict[str, LatencyHistogram] = {}

    def add_histogram(total: LatencyHistogram | None, more: LatencyHistogram) -> LatencyHistogram:
        if total is None:
            return {"buckets": tuple((b, n) for b, n in more["buckets"]), "sum_s": more["sum_s"],
                    "count": more["count"]}
        return {"buckets": tuple((b, n + m) for (b, n), (_, m) in
                                 zip(total["buckets"], more["buckets"], strict=True)),
                "sum_s": total["sum_s"] + more["sum_s"], "count": total["count"] + more["count"]}

    scripts: LatencyHistogram | None = None
    requests: dict[tuple[str, ...], int] = {}
    in_flight: dict[str, int] = {}
    tokens: dict[tuple[str, ...], int] = {}
    thresholds: dict[tuple[str, ...], int] = {}
    spend: dict[tuple[str, ...], int] = {}
    use: dict[tuple[str, ...], int] = {}
    waiting: dict[str, int] = {}
    waits: dict[tuple[str, str], LatencyHistogram] = {}
    for s in snapshots:
        for upstream, count in s.get("queue_waiting", ()):
            waiting[upstream] = waiting.get(upstream, 0) + count
        for upstream, outcome, histogram in s.get("queue_wait", ()):
            waits[(upstream, outcome)] = add_histogram(waits.get((upstream, outcome)), histogram)
        for *labels, count in s.get("spend", ()):
            spend[tuple(labels)] = spend.get(tuple(labels), 0) + count
        for *labels, count in s.get("spend_budget_use", ()):
            use[tuple(labels)] = use.get(tuple(labels), 0) + count
        for *labels, count in s.get("request_tokens", ()):
            tokens[tuple(labels)] = tokens.get(tuple(labels), 0) + count
        for *labels, count in s.get("budget_thresholds", ()):
            thresholds[tuple(labels)] = thresholds.get(tuple(labels), 0) + count
        for *labels, count in s.get("requests", ()):
            requests[tuple(labels)] = requests.get(tuple(labels), 0) + count
        for tier, count in s.get("in_flight_requests", ()):
            in_flight[tier] = in_flight.get(tier, 0) + count
        for key, value in s.items():
            if isinstance(value, int) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
        for seconds, resource, scope, count in s["rejections"]:
            rejections[(seconds, resource, scope)] = rejections.get((seconds, resource, scope), 0) + count
        for window, count in s["rejected_by_window"].items():
            by_window[window] = by_window.get(window, 0) + count
        for op, histogram in s["latency_by_op"].items():
            ops[op] = add_histogram(ops.get(op), histogram)
        scripts = add_histogram(scripts, {"buckets": s["latency_buckets"],
                                          "sum_s": s["latency_sum_s"], "count": s["latency_count"]})
    merged["rejections"] = tuple((w, r, sc, n) for (w, r, sc), n in rejections.items())
    merged["rejected_by_window"] = by_window
    merged["latency_by_op"] = ops
    merged["requests"] = tuple(sorted((*labels, n) for labels, n in requests.items()))
    merged["in_flight_requests"] = tuple(sorted(in_flight.items()))
    merged["request_tokens"] = tuple(sorted((*labels, n) for labels, n in tokens.items()))
    merged["budget_thresholds"] = tuple(sorted((*labels, n) for labels, n in thresholds.items()))
    merged["spend"] = tuple(sorted((*labels, n) for labels, n in spend.items()))
    merged["spend_budget_use"] = tuple(sorted((*labels, n) for labels, n in use.items()))
    merged["queue_waiting"] = tuple(sorted(waiting.items()))
    merged["queue_wait"] = tuple((*labels, h) for labels, h in sorted(waits.items()))
    if scripts is not None:
        merged["latency_buckets"], merged["latency_sum_s"] = scripts["buckets"], scripts["sum_s"]
    return merged  # type: ignore[return-value]


def _from_json(snapshot: dict[str, Any]) -> LimiterMetrics:
    """A snapshot read back from JSON: its lists as the tuples metrics() gives."""
    snapshot["rejections"] = tuple(tuple(r) for r in snapshot["rejections"])
    snapshot["latency_buckets"] = tuple(tuple(b) for b in snapshot["latency_buckets"])
    for histogram in snapshot["latency_by_op"].values():
        histogram["buckets"] = tuple(tuple(b) for b in histogram["buckets"])
    snapshot["requests"] = tuple(tuple(r) for r in snapshot.get("requests", ()))
    snapshot["in_flight_requests"] = tuple(tuple(r) for r in snapshot.get("in_flight_requests", ()))
    snapshot["request_tokens"] = tuple(tuple(r) for r in snapshot.get("request_tokens", ()))
    snapshot["budget_thresholds"] = tuple(tuple(r) for r in snapshot.get("budget_thresholds", ()))
    snapshot["spend"] = tuple(tuple(r) for r in snapshot.get("spend", ()))
    snapshot["spend_budget_use"] = tuple(tuple(r) for r in snapshot.get("spend_budget_use", ()))
    snapshot["queue_waiting"] = tuple(tuple(r) for r in snapshot.get("queue_waiting", ()))
    for _, _, histogram in snapshot.get("queue_wait", ()):
        histogram["buckets"] = tuple(tuple(b) for b in histogram["buckets"])
    snapshot["queue_wait"] = tuple(tuple(r) for r in snapshot.get("queue_wait", ()))
    return snapshot  # type: ignore[return-value]


def _call_if_alive(ref: weakref.ref[_Directory], method: str) -> None:
    directory = ref()
    if directory is not None:
        getattr(directory, method)()


def _write_every(ref: weakref.ref[_Directory], stopped: threading.Event) -> None:
    """The writer thread: the directory's file every interval until stopped (or the
    collector is gone). It holds the collector only while it writes."""
    while True:
        directory = ref()
        if directory is None:
            return
        interval = directory.interval
        del directory
        if stopped.wait(interval):
            return
        directory = ref()
        if directory is None:
            return
        try:
            directory.write()
        except OSError:
            pass  # a full or vanished directory: the next tick or scrape tries again
        del directory


class _Directory:
    """The counters of this process's limiters in DIR/genai-ratelimit-<pid>.json, rewritten
    every `interval` seconds by a daemon thread, at each scrape and at exit (atomically:
    written aside, then renamed); and the sum of every process's file."""

    PREFIX = "genai-ratelimit-"

    def __init__(self, directory: str | os.PathLike[str], interval: float,
                 limiters: dict[str, _Measured]) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        self.path = Path(directory)
        if not self.path.is_dir():
            raise ValueError(f"the metrics directory {str(self.path)!r} does not exist: create it "
                             "(empty) before the workers start")
        self.interval = float(interval)
        self.limiters = limiters
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self._start()
        # At exit and in a forked child (a new pid: a file and a writer of its own), for as
        # long as the collector lives: held weakly, so a dropped collector is not kept.
        ref = weakref.ref(self)
        atexit.register(_call_if_alive, ref, "final_write")
        os.register_at_fork(after_in_child=lambda: _call_if_alive(ref, "_start"))

    def _start(self) -> None:
        """Starts the writer of this process; it stops with close() or the process."""
        self.stopped = threading.Event()
        thread = threading.Thread(target=_write_every, args=(weakref.ref(self), self.stopped),
                                  name="genai-ratelimit-metrics", daemon=True)
        thread.start()

    def close(self) -> None:
        """Stops the writer after one last write."""
        self.stopped.set()
        self.final_write()

    def final_write(self) -> None:
        try:
            self.write()
        except OSError:
            pass  # the directory is gone: nothing to keep the counts in

    def file(self) -> Path:
        return self.path / f"{self.PREFIX}{os.getpid()}.json"

    def write(self) -> None:
        snapshots = {name: exported(limiter) for name, limiter in self.limiters.items()}
        data = json.dumps({"version": 1, "pid": os.getpid(), "limiters": snapshots})
        target = self.file()
        aside = target.with_suffix(f".{threading.get_ident()}.tmp")
        with self.lock:
            aside.write_text(data, encoding="utf-8")
            os.replace(aside, target)

    def totals(self) -> dict[str, LimiterMetrics]:
        """Every process's counters, summed per limiter name; this process's fresh."""
        self.write()
        found: dict[str, list[LimiterMetrics]] = {}
        for path in sorted(self.path.glob(f"{self.PREFIX}*.json")):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # removed meanwhile, or not ours
            if not isinstance(data, dict) or data.get("version") != 1:
                continue
            for name, snapshot in data["limiters"].items():
                found.setdefault(name, []).append(_from_json(snapshot))
        return {name: merge_snapshots(snapshots) for name, snapshots in found.items()}


# --------------------------------------------------------------------------- Prometheus

class PrometheusCollector:
    """A prometheus_client collector of one or more limiters (a mapping name -> limiter,
    or one limiter, named "default"). Register it once: REGISTRY.register(collector).

    directory: several processes (uvicorn --workers, gunicorn) export together: each writes
    its counters there every `interval` seconds (and at exit), and every scrape sums the
    files of all of them. The directory must exist and be emptied when the service starts
    (its files are the totals since then, dead workers' included)."""

    def __init__(self, limiters: Mapping[str, _Measured] | _Measured, *,
                 namespace: str = NAMESPACE, directory: str | os.PathLike[str] | None = None,
                 interval: float = 1.0) -> None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError as exc:
            raise ImportError("PrometheusCollector needs prometheus_client: "
                              "pip install 'genai-ratelimit[prometheus]'") from exc
        self._limiters = _named(limiters)
        self._namespace = namespace
        self._directory = None if directory is None else _Directory(directory, interval,
                                                                    self._limiters)

    def close(self) -> None:
        """With a directory: writes this process's counters a last time and stops its
        writer (it stops with the process too). Otherwise nothing."""
        if self._directory is not None:
            self._directory.close()

    def describe(self) -> list[Any]:
        """Nothing up front: the families are made from the counters at each scrape."""
        return []

    def snapshots(self) -> dict[str, LimiterMetrics]:
        """{name: counters}: this process's, or every process's sum with a directory."""
        if self._directory is not None:
            return self._directory.totals()
        return {name: exported(limiter) for name, limiter in self._limiters.items()}

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        made: dict[str, Any] = {}
        for family in FAMILIES:
            name = f"{self._namespace}_{family.name}"
            labels = ["limiter", *family.labels]
            kind = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
                    "histogram": HistogramMetricFamily}[family.kind]
            made[family.name] = kind(name, family.help, labels=labels)
        for limiter_name, snapshot in self.snapshots().items():
            for family, values, value in samples(snapshot):
                metric = made[family.name]
                if family.kind == "histogram":
                    metric.add_metric([limiter_name, *values], _cumulative(value), value["sum_s"])
                else:
                    metric.add_metric([limiter_name, *values], value)
        return list(made.values())


# ------------------------------------------------------------------------ OpenTelemetry

# The limiter methods timed (and traced) by instrument_otel: the op label is the name.
_TIMED = ("check", "check_windows", "check_windows_detailed", "reserve", "reconcile", "peek",
          "reset", "acquire", "release", "renew", "ping")


def instrument_otel(limiters: Mapping[str, _Measured] | _Measured, *, meter: Any = None,
                    tracer: Any = None, spans: bool = False) -> list[Any]:
    """Reports the limiters to OpenTelemetry (needs opentelemetry-api, the `otel` extra):

    - every counter of FAMILIES as an observable counter on `meter` (default: the global
      MeterProvider's meter "genai_ratelimit"), read at each collection, with the same
      attributes as the Prometheus labels;
    - the latency as a Histogram (`genai_ratelimit.redis.latency`, seconds, explicit bucket
      boundaries LATENCY_BUCKETS, attributes limiter and op): each call of a limiter's
      methods (check ... renew, ping) is timed around its Redis round trips;
    - with spans=True (or a tracer), a CLIENT span around each of those calls, named
      "genai_ratelimit <op>" (default tracer: the global TracerProvider's "genai_ratelimit").

    The calls are timed by wrapping the methods of each limiter object (instance attributes;
    the class is untouched, a limiter not instrumented pays nothing). Instrumenting a limiter
    again replaces its wrappers. Returns the instruments."""
    try:
        from opentelemetry import metrics as otel_metrics
        from opentelemetry.metrics import Observation
    except ImportError as exc:
        raise ImportError("instrument_otel needs opentelemetry-api: "
                          "pip install 'genai-ratelimit[otel]'") from exc
    named = _named(limiters)
    if meter is None:
        meter = otel_metrics.get_meter(NAMESPACE)
    if tracer is None and spans:
        from opentelemetry import trace

        tracer = trace.get_tracer(NAMESPACE)

    def observe(family: Family) -> Callable[[Any], Iterable[Any]]:
        def callback(options: Any) -> Iterable[Any]:
            for name, limiter in named.items():
                for sample_family, values, value in samples(exported(limiter)):
                    if sample_family is family:
                        yield Observation(value, {"limiter": name,
                                                  **dict(zip(family.labels, values, strict=True))})
        return callback

    instruments = [meter.create_observable_counter(family.otel_name, callbacks=[observe(family)],
                                                   unit=family.unit, description=family.help)
                   for family in FAMILIES if family.kind == "counter"]
    instruments += [meter.create_observable_up_down_counter(
        family.otel_name, callbacks=[observe(family)], unit=family.unit, description=family.help)
        for family in FAMILIES if family.kind == "gauge"]
    try:
        histogram = meter.create_histogram(
            LATENCY.otel_name, unit=LATENCY.unit, description=LATENCY.help,
            explicit_bucket_boundaries_advisory=list(LATENCY_BUCKETS))
    except TypeError:  # opentelemetry-api before 1.23: no advisory; the SDK's View sets them
        histogram = meter.create_histogram(LATENCY.otel_name, unit=LATENCY.unit,
                                           description=LATENCY.help)
    instruments.append(histogram)
    try:
        waited = meter.create_histogram(
            QUEUE_WAIT.otel_name, unit=QUEUE_WAIT.unit, description=QUEUE_WAIT.help,
            explicit_bucket_boundaries_advisory=list(QUEUE_WAIT_BUCKETS))
    except TypeError:  # opentelemetry-api before 1.23, as above
        waited = meter.create_histogram(QUEUE_WAIT.otel_name, unit=QUEUE_WAIT.unit,
                                        description=QUEUE_WAIT.help)
    instruments.append(waited)
    for name, limiter in named.items():
        queue_waits(limiter).add_listener(
            lambda upstream, outcome, seconds, name=name: waited.record(  # type: ignore[misc]
                seconds, {"limiter": name, "upstream": upstream, "outcome": outcome}),
            key=("instrument_otel", name))  # instrumenting again replaces it
        for op in _TIMED:
            method = getattr(type(limiter), op, None)
            if method is not None:
                setattr(limiter, op, _timed(limiter, method, op, histogram, tracer,
                                            {"limiter": name, "op": op}))
    return instruments


def _timed(limiter: Any, method: Callable[..., Any], op: str, histogram: Any, tracer: Any,
           attributes: dict[str, str]) -> Callable[..., Any]:
    """The bound method, timed into histogram (and traced when tracer is given)."""
    import inspect

    bound = method.__get__(limiter, type(limiter))
    span_name = f"{NAMESPACE} {op}"
    span_attributes = {"db.system": "redis", "genai_ratelimit.limiter": attributes["limiter"],
                       "genai_ratelimit.op": op}

    def span() -> Any:
        from opentelemetry.trace import SpanKind

        return tracer.start_as_current_span(span_name, kind=SpanKind.CLIENT,
                                            attributes=span_attributes)

    if inspect.iscoroutinefunction(method):
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                if tracer is None:
                    return await bound(*args, **kwargs)
                with span():
                    return await bound(*args, **kwargs)
            finally:
                histogram.record(time.perf_counter() - started, attributes)
        return timed_async

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            if tracer is None:
                return bound(*args, **kwargs)
            with span():
                return bound(*args, **kwargs)
        finally:
            histogram.record(time.perf_counter() - started, attributes)
    return timed
