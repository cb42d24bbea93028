"""RateLimiter: the blocking limiter. A thin layer over the C extension: the URL and options
are turned into C configuration once; every check is one C call that validates, builds the
keys and the UUID4 member, runs the script on Redis with the GIL released and decodes the
reply. `check` and `check_windows` are the C methods themselves, with no Python frame between."""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypedDict

from . import _native
from ._url import DEFAULT_URL, RedisOptions, parse_redis_url
from ._wake import WakeSubscriber
from .lease import (
    DEFAULT_LEASE_SECONDS,
    Lease,
    acquire_shares,
    lease_arguments,
    lease_maker,
    make_lease,
)
from .metrics import (
    count_queue_wait,
    count_reconcile,
    count_reservation,
    queue_waits,
    report_crossings,
)
from .periods import (
    DEFAULT_HOLD_SECONDS,
    Budget,
    BudgetCrossing,
    BudgetHold,
    BudgetSettlement,
    hold_plan,
    settle_plan,
)
from .provider_limits import DEFAULT_MAX_CLOSE_SECONDS, ProviderLimits, observe_plan
from .reservation import (
    Plan,
    Reservation,
    Scope,
    _scope_list,
    advance,
    reconcile_plan,
    reserve_arguments,
    reserve_plan,
)
from .shares import Shares
from .wait_queue import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_QUEUE_PER_TENANT,
    check_queue_shares,
    queued_acquire_plan,
    queued_reserve_plan,
    wake_channel,
)

__all__ = ["RateLimiter", "limiter_options"]

logger = logging.getLogger("genai_ratelimit")

Clock = Literal["server", "client"]
Storage = Literal["zset", "compact"]


class NativeOptions(TypedDict):
    """The keyword arguments of the C limiter (`_native.Limiter`), as limiter_options makes them."""

    host: str | None
    port: int
    unix_path: str | None
    db: int
    username: str | None
    password: str | None
    connect_timeout: float
    socket_timeout: float
    key_prefix: str
    client_clock: bool
    max_connections: int
    tls: bool
    ssl_verify: bool
    ssl_ca_certs: str | None
    ssl_certfile: str | None
    ssl_keyfile: str | None
    metrics: bool
    cluster_nodes: tuple[tuple[str, int], ...] | None
    sentinel_master: str | None
    storage: str
    min_replicas: int
    replica_timeout_ms: int


def limiter_options(
    url: str | None,
    key_prefix: str,
    connect_timeout: float,
    socket_timeout: float,
    clock: str,
    max_connections: int,
    metrics: bool = True,
    storage: str | None = None,
    min_replicas: int | None = None,
    replica_timeout_ms: int | None = None,
) -> tuple[RedisOptions, NativeOptions]:
    """Merges the URL and the constructor's arguments (an argument may not contradict the
    URL) and has the extension validate every option (_native.check_options: the one copy
    of the rules, the C limiter's own). Returns the parsed URL and the keyword arguments of
    the C limiter. Shared by the sync and async limiters."""
    if url is None:
        url = os.environ.get("REDIS_URL") or DEFAULT_URL
    options = parse_redis_url(url)
    replication = {}
    for name, given, in_url, default in (
            ("min_replicas", min_replicas, options.min_replicas, 0),
            ("replica_timeout_ms", replica_timeout_ms, options.replica_timeout_ms, 100)):
        if given is not None and in_url is not None and given != in_url:
            raise ValueError(f"{name}={given!r} contradicts the URL's {name}={in_url}")
        replication[name] = given if given is not None else in_url if in_url is not None else default
    _native.check_options(key_prefix, clock, connect_timeout, socket_timeout, max_connections,
                          storage, replication["min_replicas"], replication["replica_timeout_ms"],
                          hash_tag=options.mode == "cluster")
    if storage is not None and options.storage not in (None, storage):
        raise ValueError(f"storage={storage!r} contradicts the URL's storage={options.storage}")
    native = NativeOptions(
        host=options.host,
        port=options.port,
        unix_path=options.unix_path,
        db=options.db,
        username=options.username,
        password=options.password,
        connect_timeout=float(connect_timeout),
        socket_timeout=float(socket_timeout),
        key_prefix=key_prefix,
        client_clock=clock == "client",
        max_connections=max_connections,
        tls=options.tls,
        ssl_verify=options.tls_trust() is not None,
        ssl_ca_certs=options.ssl_ca_certs if options.tls_trust() not in (None, "system") else None,
        ssl_certfile=options.ssl_certfile,
        ssl_keyfile=options.ssl_keyfile,
        metrics=bool(metrics),
        cluster_nodes=options.nodes if options.mode != "single" else None,
        sentinel_master=options.master_name,
        storage=storage or options.storage or "zset",
        min_replicas=replication["min_replicas"],
        replica_timeout_ms=replication["replica_timeout_ms"],
    )
    return options, native


# The identity ping() peeks at: nothing counts under it (a read-only script writes nothing).
PING_IDENTITY = "genai-ratelimit-ping"


class RateLimiter(_native.Limiter):
    """Exact sliding-window rate limiter on Redis: sorted sets (storage="zset", the default)
    or one string per window (storage="compact": the same decisions in a tenth of the memory).

    >>> limiter = RateLimiter("redis://localhost:6379/0")
    >>> allowed, remaining, retry_after_s = limiter.check("user_8421", limit=10, window_seconds=60)

    Safe to share across threads (a small pool of connections) and across fork() (a child
    never reuses its parent's socket). Raises RateLimiterUnavailable when Redis cannot answer
    within the timeouts; the next call reconnects by itself.

    `min_replicas=1` (or `?min_replicas=1` in the URL) makes an admission count only once a
    replica acknowledged it (WAIT, `replica_timeout_ms`): otherwise RateLimiterUnavailable.

    >>> limiter = RateLimiter("redis://10.0.0.5:6379/0", min_replicas=1, replica_timeout_ms=100)
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        key_prefix: str = "ratelimit",
        connect_timeout: float = 1.0,
        socket_timeout: float = 1.0,
        clock: Clock = "server",
        max_connections: int = 32,
        metrics: bool = True,
        storage: Storage | None = None,
        min_replicas: int | None = None,
        replica_timeout_ms: int | None = None,
    ) -> None:
        options, native = limiter_options(url, key_prefix, connect_timeout, socket_timeout,
                                          clock, max_connections, metrics, storage,
                                          min_replicas, replica_timeout_ms)
        super().__init__(**native)
        self._options = options
        self._storage = native["storage"]
        # A shared scope's keys hash to the scope's slot, the user's to the user's.
        self._two_step_scopes = options.mode == "cluster"
        self._clock = clock
        self._connect_timeout_s = float(native["connect_timeout"])
        self._wake: WakeSubscriber | None = None

    @property
    def url(self) -> str:
        """Where this limiter connects, without credentials."""
        options = getattr(self, "_options", None)
        return options.describe() if options is not None else "(not configured)"

    @property
    def storage(self) -> str:
        """Where the windows are kept: "zset" (sorted sets) or "compact" (one string each)."""
        return getattr(self, "_storage", "zset")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.url!r}, "
                f"key_prefix={self.key_prefix!r}, clock={getattr(self, '_clock', None)!r}, "
                f"storage={self.storage!r})")

    # Decide shared scopes in steps of their own (see reservation.reserve_plan): for keys
    # that cannot meet in one script (Redis Cluster slots). Off: one script decides all.
    _two_step_scopes = False

    #: Called with each soft limit a hold or a settle crossed (a periods.BudgetCrossing),
    #: once per period across every replica, in the thread that made the call, after the
    #: metric and the log record. Keep it quick (hand a webhook to a queue): an exception
    #: it raises is logged and the call's answer is returned all the same.
    on_budget_threshold: Callable[[BudgetCrossing], object] | None = None

    def _report_crossings(self, crossings: tuple[BudgetCrossing, ...]) -> None:
        """The metric, the log record and the app's callback of each crossing."""
        report_crossings(self, crossings)
        callback = self.on_budget_threshold
        if callback is None:
            return
        for crossing in crossings:
            try:
                callback(crossing)
            except Exception:  # noqa: BLE001 - the admission stands; the app's bug is logged
                logger.exception("on_budget_threshold raised for budget %r of %r at %d%%",
                                 crossing.budget.name, crossing.budget.owner, crossing.threshold)

    def reserve(self, user_id: str, windows: Sequence[tuple[int, int]] = (), *, cost: int = 1,
                token_windows: Sequence[tuple[int, int]] = (),
                tokens: int | None = None, scopes: Sequence[Scope] = (),
                in_flight: tuple[int, int] | None = None,
                scope_class: str | None = None, max_wait: float | None = None,
                tenant: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
                max_queue_per_tenant: int = DEFAULT_MAX_QUEUE_PER_TENANT) -> Reservation:
        """Decides one request against its request `windows` (each charged `cost`) and its
        `token_windows` (each charged `tokens`, the estimate), and the windows of `scopes`
        (a route's or model's budget of this user, an upstream's caps shared by all), in one
        script execution, all or nothing, and logs it on allow. `reconcile` corrects the
        estimate later. `in_flight=(limit, lease_seconds)` takes one of the user's `limit`
        concurrent slots in the same script execution (acquire's), all or nothing: the
        Reservation's `lease`. `scope_class`: the request's class in the reserved shares of
        a shared scope (Scope reserved/ceilings; a refusal names its rule in
        `share_refusal`). `max_wait` (seconds, > 0, at most 300): a request the shared
        scopes' windows refuse waits in their queue, shared by every replica, fair across
        `tenant`s (default: the user), until they admit it or its deadline would pass
        (docs/wait-queue.md; the Reservation's queue_outcome says how it ended)."""
        if max_wait is not None:
            queued: Reservation = self._drive(queued_reserve_plan(
                user_id, windows, cost, token_windows, tokens, scopes, max_wait, tenant,
                max_queue, max_queue_per_tenant, self._two_step_scopes, in_flight,
                None, scope_class))
            count_reservation(self._record_outcome, queued)
            count_queue_wait(self, scopes, queued)
            return queued
        reservation: Reservation = self._drive(reserve_plan(
            user_id, windows, cost, token_windows, tokens, scopes, self._two_step_scopes,
            in_flight, lease_maker(Lease, user_id, in_flight, self), scope_class))
        count_reservation(self._record_outcome, reservation)
        return reservation

    def reconcile(self, reservation: Reservation, actual: int, *, release: bool = False) -> int:
        """Sets the reserved entry's cost (its tokens, when it has token windows) to
        `actual` in every window where it still is, its scopes' included: lower refunds,
        higher charges, 0 removes it. Idempotent. `release=True` also gives back the
        in-flight slot of reserve(..., in_flight=...), in the same script execution.
        Returns the number of windows whose entry was found (0 once it has left them all,
        or when nothing was logged)."""
        found: int = self._drive(reconcile_plan(reservation, actual, release))
        count_reconcile(self._record_outcome, reservation, actual, found)
        return found

    def hold_budgets(self, budgets: Budget | Sequence[Budget], amount: int | Sequence[int], *,
                     hold_seconds: int = DEFAULT_HOLD_SECONDS) -> BudgetHold:
        """Holds `amount` (one int for every budget, or one per budget) in each calendar
        budget (docs/spend-budgets.md), in one script execution, all or nothing: when any
        budget's spent + held + amount would pass its limit, nothing is held anywhere and
        the BudgetHold names the budget that refused and why. On a Redis Cluster, budgets
        of several owners are held owner by owner, the earlier holds given back exactly
        when a later owner refuses: the same answer, one round trip per owner
        (docs/spend-budgets.md, "On a Redis Cluster"). Each budget's period is the
        one holding the script's now (the server's clock, unless clock="client"). A hold's
        key lives until its period's end plus `hold_seconds` (the longest hold). Soft limits
        it crossed are in `.crossed`, counted, logged and given to on_budget_threshold."""
        hold: BudgetHold = self._drive(hold_plan(budgets, amount, hold_seconds,
                                                   grouped=self._two_step_scopes))
        self._report_crossings(hold.crossed)
        return hold

    def settle_budgets(self, hold: BudgetHold, actual: int | Sequence[int]) -> BudgetSettlement:
        """Settles a hold: each budget's amount held becomes `actual` (an int for every
        budget, or one per budget) spent, in the period that admitted it, even after that
        period ended; 0 gives the hold back unused, more than held is charged (never
        refused). Idempotent. Returns the number of budgets whose hold was found (0 once
        settled or expired, or when nothing was held: then nothing is sent), an int whose
        `.crossed` holds the soft limits the settle crossed (a usage above its hold)."""
        settled: BudgetSettlement = self._drive(settle_plan(hold, actual))
        self._report_crossings(settled.crossed)
        return settled

    def _drive(self, plan: Plan) -> Any:
        """Runs a plan's C calls (reservation.py, periods.py), blocking. A ticket it takes in
        a wait queue counts this request as waiting there (queue_waits) until the plan ends."""
        leaves: list[Callable[[], None]] = []
        try:
            return self._drive_counted(plan, leaves)
        finally:
            for leave in leaves:
                leave()

    def _drive_counted(self, plan: Plan, leaves: list[Callable[[], None]]) -> Any:
        call, result = advance(plan)
        while call is not None:
            name, positional, keywords = call
            try:
                if name == "hold_budgets":
                    answer: object = self._hold_budgets(*positional, **keywords)
                elif name == "settle_budgets":
                    answer = self._settle_budgets(*positional, **keywords)
                elif name == "validate":
                    answer = _native.Codec(self.key_prefix).reserve(*positional, **keywords)
                elif name == "release":
                    answer = self._release(*positional)
                elif name == "observe_upstream":
                    answer = self._observe_upstream(*positional)
                elif name == "wait_queue":
                    answer = self._wait_queue(*positional, **keywords)
                    if positional[3][0] > 0 and isinstance(answer, int) and answer >= 0:
                        leaves.append(queue_waits(self).enter(positional[0]))
                elif name == "acquire":
                    answer = self._acquire(*positional, **keywords)
                elif name == "subscribe":
                    answer = self._wake_subscriber().subscribe(
                        wake_channel(self.key_prefix,
                                     _native.key_owner(positional[0], self._two_step_scopes)),
                        positional[1])
                elif name == "wake":
                    answer = self._wake_subscriber().wake(*positional)
                elif name == "unsubscribe":
                    self._wake_subscriber().unsubscribe(*positional)
                    answer = None
                elif name == "clock":
                    answer = time.monotonic()
                elif name == "sleep":
                    time.sleep(*positional)
                    answer = None
                else:
                    method = self._reserve if name == "reserve" else self._reconcile
                    answer = method(*positional, **keywords)
            except BaseException as exc:  # noqa: BLE001 - handed to the plan, which re-raises
                call, result = advance(plan, error=exc)
            else:
                call, result = advance(plan, answer)
        return result

    def peek(self, user_id: str, windows: Sequence[tuple[int, int]] = (), *, cost: int = 1,
             token_windows: Sequence[tuple[int, int]] = (),
             tokens: int | None = None,
             scopes: Sequence[Scope] = ()) -> tuple[bool, int, int, int]:
        """What `check_windows(user_id, windows, cost=cost)` (or `reserve` with the same
        arguments, scopes included) would answer now: (allowed, remaining, retry_after_s,
        window_seconds). Writes nothing: one read-only script execution on the server's
        clock."""
        return self._peek(user_id, windows,
                          **reserve_arguments(cost, token_windows, tokens, _scope_list(scopes),
                                             decides=False))[:4]

    def observe_upstream(self, name: str, status: int,
                         headers: Mapping[str, str] | Iterable[tuple[str | bytes, str | bytes]],
                         *, max_close_seconds: float = DEFAULT_MAX_CLOSE_SECONDS
                         ) -> ProviderLimits:
        """Hands the gateway one response of the upstream behind the shared scope `name`
        (an `Upstream`'s name): its provider's remaining requests and tokens until their
        reset, and on a 429/529 its retry-after, are recorded in one script execution where
        every replica's admissions through that cap count against them
        (docs/upstreams.md). Garbage in the headers is ignored; a reset or closure further
        away than `max_close_seconds` is read as that bound. Returns what was read, with
        `closed_until_ms`; sends nothing when the response said nothing usable, but for a
        2xx (the provider's answer: it ends a cold start, Scope.probe)."""
        limits: ProviderLimits = self._drive(observe_plan(name, status, headers,
                                                          max_close_seconds))
        return limits

    def check_rate(self, user_id: str, rate: int, period_seconds: int, burst: int, *,
                   cost: int = 1) -> tuple[bool, int, int]:
        """Decides one request of user_id with GCRA (docs/gcra.md): `rate` requests per
        `period_seconds`, spaced evenly, with up to `burst` at once; the request weighs
        `cost` (1 <= cost <= burst). One script execution on one key,
        `{key_prefix}:{user_id}:{period_seconds}:gcra`. Returns (allowed, remaining,
        retry_after_s): remaining is how many more requests of cost 1 would be allowed now
        (after this one, when allowed); retry_after_s, on a refusal, the wait until this
        same request would be allowed, rounded up to whole seconds (>= 1), and 0 on allow.
        A refusal writes nothing."""
        return self._check_rate(user_id, rate, period_seconds, burst, cost=cost)[:3]

    def ping(self) -> float:
        """One read-only round trip to Redis: a peek of a one-second window of an identity no
        request uses (PING_IDENTITY), through the same connection pool as every decision.
        Returns the seconds it took; raises what a decision would raise when Redis cannot
        answer (RateLimiterUnavailable, RateLimiterTimeout, ...). For start-up checks and
        health probes: `limiter.ping()`. With RATE_LIMIT_DISABLED set, nothing is sent."""
        started = time.perf_counter()
        self._peek(PING_IDENTITY, ((1, 1),))
        return time.perf_counter() - started

    def reset(self, user_id: str, windows: Sequence[tuple[int, int]] | None = None, *,
              token_windows: Sequence[tuple[int, int]] | None = None) -> int:
        """Forgets user_id's entries in `windows` (and `token_windows`), given as the
        (limit, window_seconds) pairs of check_windows: one script execution. With neither,
        every window of the user, and its GCRA buckets (docs/gcra.md), found by SCAN (see
        docs/operations.md: not atomic). Returns the number of entries removed."""
        if windows is not None or token_windows is not None:
            return self._reset(user_id, windows,
                               token_windows=token_windows)[0]
        removed, cursor = self._reset(user_id)
        while cursor != "0":
            more, cursor = self._reset(user_id, cursor=cursor)
            removed += more
        return removed

    def acquire(self, user_id: str, limit: int, lease_seconds: int = DEFAULT_LEASE_SECONDS,
                *, shares: Shares | None = None, share_class: str | None = None,
                max_wait: float | None = None, tenant: str | None = None,
                max_queue: int = DEFAULT_MAX_QUEUE,
                max_queue_per_tenant: int = DEFAULT_MAX_QUEUE_PER_TENANT) -> Lease:
        """Takes one of user_id's `limit` concurrent slots for lease_seconds, in one script
        execution: a Lease, allowed or not. Release it when done (`release`, or `with`);
        one never released expires after lease_seconds. `shares`: the cap's reserved
        shares and ceilings per class, decided in the same script, work-conserving
        (docs/upstreams.md, "Reserved shares"); `share_class` the request's class (None: a
        class with no share); a refusal by a share rule names it in `.share_refusal`.
        `max_wait` (seconds, > 0, at most 300): a refused acquire waits in the cap's queue,
        shared by every replica and fair across `tenant`s (default: user_id), until a release
        makes its turn come or its deadline passes (docs/wait-queue.md; the Lease's
        queue_outcome says how it ended). Not with `shares` yet (ValueError)."""
        spec = acquire_shares(limit, shares, share_class)
        if max_wait is None:
            raw = (self._acquire(user_id, limit, lease_seconds) if spec is None
                   else self._acquire(user_id, limit, lease_seconds, spec))
            return make_lease(Lease, raw, user_id, limit, lease_seconds, self, shares,
                              share_class)
        check_queue_shares(spec)
        lease: Lease = self._drive(queued_acquire_plan(
            user_id, limit, lease_seconds, max_wait, tenant, max_queue, max_queue_per_tenant,
            lambda raw: make_lease(Lease, raw, user_id, limit, lease_seconds, self)))
        return lease

    def _wake_subscriber(self) -> WakeSubscriber:
        """The subscriber connection of the in-flight wait queue's wake-ups, made when the
        first waiter needs it."""
        subscriber: WakeSubscriber | None = getattr(self, "_wake", None)
        if subscriber is None:
            subscriber = self._wake = WakeSubscriber(self._options, self._connect_timeout_s)
            # a limiter dropped without close() does not leave its subscriber's socket open
            weakref.finalize(self, subscriber.close)
        return subscriber

    def close(self) -> None:
        """Closes every connection (the wait queue's subscriber too)."""
        subscriber: WakeSubscriber | None = getattr(self, "_wake", None)
        if subscriber is not None:
            subscriber.close()
        super().close()

    def release(self, lease: Lease) -> bool:
        """Gives the lease's slot back. Idempotent. Returns whether it was still held
        (False once released, expired, or when nothing was held)."""
        arguments = lease_arguments(lease)
        return False if arguments is None else self._release(*arguments[:2])

    def renew(self, lease: Lease, lease_seconds: int | None = None) -> bool:
        """Extends a lease still held to lease_seconds (default: its own) from now. False
        when it expired or was released: its slot may be someone else's by now."""
        arguments = lease_arguments(lease, lease_seconds)
        return lease.allowed if arguments is None else self._renew(*arguments)[0]

    def __enter__(self) -> RateLimiter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
