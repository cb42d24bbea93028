"""AsyncRateLimiter: the asyncio limiter. Same arguments, results, errors, kill switch,
script and keys as RateLimiter; only the I/O differs.

The C extension validates each check and formats its EVALSHA (Codec), and runs each
connection's protocol (Pipeline: the same engine as the blocking limiter's, csrc/proto.c:
the handshake and how its replies are judged, NOSCRIPT reload, reply classification, the
replay rule, the idle-connection check), resolving the futures in order. This module only
moves bytes: an asyncio.Protocol per connection, driven by the running loop, so a check
never blocks the loop and never needs a worker thread. Checks issued by many coroutines in
the same loop iteration share a connection and go out in one write (auto-pipelining).

Connections belong to the loop that opened them: a limiter used from several loops (e.g. a
test client that runs each request on a fresh loop) keeps one small set per loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import ssl
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any

from . import _native
from ._native import (
    RateLimiterAuthError,
    RateLimiterError,
    RateLimiterTimeout,
    RateLimiterUnavailable,
    WindowDecision,
)
from ._url import RedisOptions, ssl_context
from ._wake import AsyncWakeSubscriber
from .lease import (
    DEFAULT_LEASE_SECONDS,
    AsyncLease,
    Lease,
    acquire_shares,
    lease_arguments,
    lease_maker,
    make_lease,
)
from .limiter import PING_IDENTITY, Clock, Storage, limiter_options
from .metrics import (
    LimiterMetrics,
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

__all__ = ["AsyncRateLimiter"]

logger = logging.getLogger("genai_ratelimit")

# A connection takes new checks until this many replies are due on every open connection;
# only then is another one opened (up to max_connections).
_PIPELINE_DEPTH_BEFORE_NEW_CONNECTION = 128
# pick(): a connection that a WAIT blocks counts as busier than any pipeline depth.
_BLOCKED = 1 << 40

class _Sent:
    """The reply of a request whose caller must not lose it to a cancellation (acquire,
    reserve, reconcile): `future` gets it once the request is queued, None before. When the
    caller is cancelled, the future is left to complete (_reply shields it) and the limiter
    reads it, to give back what the script took for a caller that is gone (_leave,
    _abandon)."""

    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: asyncio.Future[Any] | None = None


class _Abandoned(Exception):
    """Thrown into the plan of a cancelled reserve in place of a step it will not send: the
    plan refunds the steps it took, as for a step that failed."""


def _connection_status(exc: BaseException) -> int:
    """The rl_status (_native.STATUS_*) of a connection this module could not open or use
    (_LoopPool.get, _open): what the router hears of it. A timeout is a timeout, a refused
    password a refused password, a closed limiter closed; anything else, the node could not
    be reached."""
    if isinstance(exc, RateLimiterTimeout):
        return _native.STATUS_TIMEOUT
    if isinstance(exc, RateLimiterAuthError):
        return _native.STATUS_AUTH
    if isinstance(exc, RateLimiterUnavailable):
        return _native.STATUS_CONNECT
    return _native.STATUS_CLOSED


def _replay_failure(request: Any, exc: Exception) -> Exception:
    """What the caller of a replay that found no connection hears: exc, handed to its
    call's route first (when routed), or the router's own error when it says more."""
    route = request.route
    if route is None or not isinstance(exc, RateLimiterError):
        return exc
    try:
        route.failed(_connection_status(exc), exc)
    except RateLimiterError as own:
        return own
    return exc


def _ignore_result(future: asyncio.Future[Any]) -> None:
    """For a command nobody waits for (ASKING): a refusal shows in the next reply."""
    if not future.cancelled():
        future.exception()


class _Connection(asyncio.Protocol):
    """One Redis connection on one event loop: writes batched once per loop iteration,
    replies decoded by the C Pipeline, a timer for the oldest reply due."""

    def __init__(self, pool: _LoopPool, timeout: float) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.timeout = timeout
        self.pipeline = _native.Pipeline(timeout, codec=pool.limiter._codec)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._flush_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        # min_replicas (see admit): the WAIT the admissions written since the last WAIT
        # share, queued at the next flush; and whether a WAIT is out, blocking the
        # connection until it answers (then nothing more waits behind it than it must).
        self._next_wait: asyncio.Future[Any] | None = None
        self.waiting = False
        # While a WAIT blocks the connection, the server is silent by design: no reply is
        # overdue before this time.monotonic() (see _on_timer).
        self._quiet_until = 0.0
        self._fd = -1  # polled while idle (usable()); -1: not polled
        self._info_due = True  # until INFO memory's answer was looked at
        # The handshake's bytes when they hold AUTH's password (Pipeline.take gives those as
        # a bytearray): zeroed once the transport is done with them (_wipe_secret).
        self._secret: bytearray | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and transport.get_extra_info("sslcontext") is None:
            # Not for TLS, where a readable socket may hold a session ticket the loop has
            # yet to read.
            self._fd = sock.fileno()

    def usable(self) -> bool:
        """False when the connection closed, or when bytes nobody asked for (a stray reply,
        or the EOF of a server that went away) wait on it while nothing is pending: then it
        is dropped, before a check could take those bytes for its answer. The engine's
        idle check (one poll(), only for an idle connection), as the blocking pool does."""
        if self.closed:
            return False
        if self.pipeline.pending or not self.pipeline.idle_is_stale(self._fd):
            return True
        self.abort(RateLimiterUnavailable("Redis sent bytes on an idle connection"),
                   _native.STATUS_PROTOCOL)
        return False

    def data_received(self, data: bytes) -> None:
        try:
            wrote = self.pipeline.feed(data)
        except Exception as exc:  # garbage from the server: this connection is done
            self.abort(exc if isinstance(exc, RateLimiterError)
                       else RateLimiterUnavailable(f"cannot decode Redis's reply: {exc}"),
                       _native.STATUS_PROTOCOL)
            return
        if wrote:
            self._schedule_flush()
        if self._info_due and (warning := self.pipeline.eviction_warning) is not None:
            self._info_due = False
            # INFO went out last, in the handshake's write: the server read all of it.
            self._wipe_secret()
            self.pool.limiter._warn_once(warning)

    def _wipe_secret(self) -> None:
        """Zeroes the handshake's bytes, which hold AUTH's password, once no one reads them
        any more: the server answered the last command they carried, or the connection is
        gone. Not sooner: a transport may still hold them (a memoryview of the unsent rest)."""
        if self._secret is not None:
            self._secret[:] = bytes(len(self._secret))
            self._secret = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._wipe_secret()
        if self.closed:  # we closed it ourselves and failed its checks already
            return
        self.pool.limiter._codec._record_outcome("connection_error")
        reason = f": {exc}" if exc else ""
        error = RateLimiterUnavailable(f"connection to Redis lost{reason}")
        # The server may or may not have run the pending decisions. The engine's replay rule
        # (the blocking limiter's too) sends each once more, marked, on another connection:
        # the script answers "already counted" for a request its first attempt logged.
        # Everything else fails with `error`.
        replays = [] if self.pool.limiter._closed else self.pipeline.take_replays(error)
        self._close(error, _native.STATUS_IO)
        if replays:
            self.pool.replay(replays)

    # -- sending
    def submit(self, request: Any) -> asyncio.Future[Any]:
        """Queues a Request; the future gets its result."""
        if self.closed:
            raise RateLimiterUnavailable("connection to Redis lost")
        future = self.loop.create_future()
        idle = self.pipeline.pending == 0
        self.pipeline.push(future, request)
        if idle and not self._flush_scheduled:
            # Nothing in flight: send now (lowest latency). Checks issued while this one
            # is out are batched below, one write per loop iteration.
            self._flush()
        else:
            self._schedule_flush()
        if self._timer is None:
            self._timer = self.loop.call_later(self.timeout, self._on_timer)
        return future

    def admit(self, request: Any) -> tuple[asyncio.Future[Any], asyncio.Future[Any]]:
        """min_replicas: queues an admission; returns its future and the future of the WAIT
        that covers it (join_wait)."""
        future = self.submit(request)
        return future, self.join_wait()

    def join_wait(self) -> asyncio.Future[Any]:
        """The future of the next WAIT of this connection, which covers every write queued
        on it before that WAIT goes out. WAIT blocks the connection until the replicas
        acknowledge or its timeout passes, and covers all the connection's earlier writes:
        so the admissions of one loop iteration share one WAIT, queued behind the last of
        them (none waits for another's), and while a WAIT is out the admissions queued
        meanwhile (they run on the server as soon as it answers) get the one WAIT sent
        when it answers, never a WAIT each. Shared: await it through asyncio.shield."""
        if self.closed:
            raise RateLimiterUnavailable("connection to Redis lost")
        wait = self._next_wait
        if wait is None:
            wait = self._next_wait = self.loop.create_future()
            wait.add_done_callback(_ignore_result)  # a refusal never looks at it
            if not self.waiting:
                self._schedule_flush()
        return wait

    def _send_wait(self) -> None:
        """Queues the WAIT the admissions since the last one share (join_wait)."""
        wait, self._next_wait = self._next_wait, None
        assert wait is not None
        limiter = self.pool.limiter
        self.pipeline.push_wait(wait, limiter._min_replicas, limiter._replica_timeout_ms)
        self.waiting = True
        self._quiet_until = max(self._quiet_until, time.monotonic()
                                + limiter._replica_timeout_ms / 1000 + self.timeout)
        wait.add_done_callback(self._wait_answered)
        self._arm_timer()

    def _wait_answered(self, wait: asyncio.Future[Any]) -> None:
        self.waiting = False
        if self.closed:
            return
        # What queued behind the WAIT waited for it: its socket_timeout starts now.
        self._quiet_until = max(self._quiet_until, time.monotonic() + self.timeout)
        if self._next_wait is not None:
            self._schedule_flush()

    def submit_question(self, read: Any) -> asyncio.Future[Any]:
        """Queues a router's question (Pipeline.push_question): its reply goes to the
        RouteRead in C; the future gets None once the read took it."""
        if self.closed:
            raise RateLimiterUnavailable("connection to Redis lost")
        future = self.loop.create_future()
        self.pipeline.push_question(future, read)
        self._schedule_flush()
        self._arm_timer()
        return future

    def submit_command(self, words: tuple[str | bytes, ...]) -> asyncio.Future[Any]:
        """Queues any Redis command; the future gets its reply (Pipeline.push_command)."""
        if self.closed:
            raise RateLimiterUnavailable("connection to Redis lost")
        future = self.loop.create_future()
        self.pipeline.push_command(future, *words)
        self._schedule_flush()
        self._arm_timer()
        return future

    def _arm_timer(self) -> None:
        if self._timer is None:
            self._timer = self.loop.call_later(self.timeout, self._on_timer)

    def resubmit(self, future: asyncio.Future[Any], request: Any, extend: float) -> None:
        """Sends a request again with the future its caller already awaits, within its first
        deadline extended by `extend` (the seconds spent opening this connection)."""
        if self.closed:
            raise RateLimiterUnavailable("connection to Redis lost")
        self.pipeline.push(future, request, extend)
        self._schedule_flush()
        self._arm_timer()

    async def handshake(self, options: RedisOptions) -> None:
        """AUTH / SELECT / PING as the engine queues and judges them (the blocking path
        runs the same steps): a refused password is RateLimiterAuthError, a lost
        connection RateLimiterUnavailable, and connect_timeout bounds it (in _open)."""
        future = self.loop.create_future()
        wait = self.pipeline.handshake(future, username=options.username,
                                       password=options.password, db=options.db, ping=options.tls)
        self._flush()  # INFO memory goes out too, never waited for
        if wait:
            await future

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._next_wait is not None and not self.waiting and not self.closed:
            self._send_wait()
        data = self.pipeline.take()
        if data is not None and not self.closed and self.transport is not None:
            self.transport.write(data)
        if type(data) is bytearray:  # the handshake's AUTH, with the password
            self._secret = data
            if self.closed or self.transport is None:
                self._wipe_secret()

    # -- deadlines: replies come in order, so the oldest pending one expires first
    def _on_timer(self) -> None:
        self._timer = None
        deadline = self.pipeline.oldest_deadline()
        if deadline is None or self.closed:
            return
        left = max(deadline, self._quiet_until) - time.monotonic()
        if left <= 0:
            self.abort(RateLimiterTimeout(
                f"Redis did not answer within {self.timeout:g} s (socket_timeout)"),
                _native.STATUS_TIMEOUT)
        else:
            self._timer = self.loop.call_later(left, self._on_timer)

    # -- closing
    def abort(self, exc: Exception, status: int) -> None:
        """Fails every pending check with exc, whose rl_status is status (_native.STATUS_*),
        and drops the connection (it may be out of step)."""
        if not self.closed:
            self.pool.limiter._codec._record_outcome("connection_error")
        transport = self.transport
        self._close(exc, status)
        if transport is not None:
            transport.abort()

    def close(self, exc: Exception) -> None:
        transport = self.transport
        self._close(exc, _native.STATUS_CLOSED)
        if transport is None:
            return
        if transport.get_extra_info("sslcontext") is not None:
            # TLS: close() would begin the close_notify exchange and keep the socket until
            # the server answers, which may be after the application's loop has ended (the
            # socket then left to the garbage collector). Nothing is pending any more.
            transport.abort()
        else:
            transport.close()

    def _close(self, exc: Exception, status: int) -> None:
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        wait, self._next_wait = self._next_wait, None
        if wait is not None:  # never sent: no reply will resolve it
            self.pipeline.fail_wait(wait, exc, status)
        self.pipeline.fail_all(exc, status)
        self.pool.discard(self)


class _LoopPool:
    """The connections of one limiter on one event loop."""

    def __init__(self, limiter: AsyncRateLimiter, loop: asyncio.AbstractEventLoop,
                 options: RedisOptions | None = None) -> None:
        self.limiter = limiter
        self.loop = loop
        self.options = options or limiter._options  # where this pool connects
        # Cluster, Sentinel: this loop's pool of each node (the router's index), and of
        # each sentinel (its negative index - 1).
        self.nodes: dict[int, _LoopPool] = {}
        self.connections: list[_Connection] = []
        self.opening: asyncio.Future[_Connection] | None = None
        self.replaying: set[asyncio.Task[None]] = set()
        self._lifetime: AsyncGenerator[None, None] | None = None

    def pick(self) -> _Connection | None:
        """The least busy open connection, unless every one is deep enough that another
        connection is worth opening. None means: call open(). min_replicas: a connection
        that a WAIT blocks is the busiest of all; rather than queue behind it, a call waits
        for another connection, opened for it when there is room."""
        best: _Connection | None = None
        least = 0
        for conn in list(self.connections):
            load = conn.pipeline.pending + (_BLOCKED if conn.waiting else 0)
            if best is None or load < least:
                if conn.usable():  # may drop it from self.connections
                    best, least = conn, load
        if best is None:
            return None
        room = len(self.connections) < self.limiter.max_connections
        if best.waiting:
            return None if room or self.opening is not None else best
        if (best.pipeline.pending < _PIPELINE_DEPTH_BEFORE_NEW_CONNECTION
                or not room or self.opening is not None):
            return best
        return None

    async def get(self) -> _Connection:
        conn = self.pick()
        if conn is not None:
            return conn
        if self._lifetime is None:
            # Started here, on the pool's loop: asyncio.run(), asyncio.Runner and uvloop.run()
            # close async generators before they close the loop, which runs its finally.
            self._lifetime = self._watch_loop()
            await self._lifetime.asend(None)
        if self.opening is None:
            self.opening = self.loop.create_task(self._open())
            self.opening.add_done_callback(self._opened)
        # shield: a cancelled caller must not cancel the connect that others wait for
        return await asyncio.shield(self.opening)

    async def _watch_loop(self) -> AsyncGenerator[None, None]:
        """Closes this loop's connections when the loop shuts down, so a limiter used from
        many short-lived loops (asyncio.run per call, a test client) holds no socket of a
        loop that is gone."""
        try:
            yield
        finally:
            self.close_all(RateLimiterError("the event loop of this connection shut down"))
            self.limiter._forget(self)
            await asyncio.sleep(0)  # let the transports finish closing on this loop

    def _opened(self, task: asyncio.Future[_Connection]) -> None:
        self.opening = None
        if not task.cancelled():
            task.exception()  # mark retrieved: every waiter got it already

    def node(self, index: int, sentinel: bool = False) -> _LoopPool:
        """Cluster or Sentinel: the pool of the router's node (or sentinel) index on this
        loop, made when first used. A sentinel's has no credentials (the URL's are the data
        nodes')."""
        key = -index - 1 if sentinel else index
        pool = self.nodes.get(key)
        if pool is None:
            router = self.limiter._router
            assert router is not None
            address = router.sentinel(index) if sentinel else router.address(index)
            options = dataclasses.replace(self.options, host=address[0], port=address[1],
                                          mode="single", nodes=())
            if sentinel:
                options = dataclasses.replace(options, username=None, password=None, db=0)
            pool = self.nodes[key] = _LoopPool(self.limiter, self.loop, options)
        return pool

    async def _open(self) -> _Connection:
        limiter = self.limiter
        options = self.options
        conn = _Connection(self, limiter._socket_timeout)
        where = options.describe()
        try:
            await asyncio.wait_for(self._connect(conn, options), limiter._connect_timeout)
        except asyncio.TimeoutError:
            conn.abort(RateLimiterTimeout("connect timed out"), _native.STATUS_TIMEOUT)
            raise RateLimiterTimeout(
                f"timed out connecting to Redis at {where} "
                f"(connect_timeout {limiter._connect_timeout:g} s)") from None
        except RateLimiterError:
            conn.abort(RateLimiterUnavailable("handshake failed"), _native.STATUS_CONNECT)
            raise
        except ssl.SSLError as exc:
            conn.abort(RateLimiterUnavailable("TLS handshake failed"), _native.STATUS_CONNECT)
            raise RateLimiterUnavailable(
                f"TLS handshake with Redis at {where} failed: {exc.reason or exc}") from None
        except OSError as exc:
            conn.abort(RateLimiterUnavailable("connect failed"), _native.STATUS_CONNECT)
            raise RateLimiterUnavailable(
                f"cannot connect to Redis at {where}: {exc.strerror or exc}") from None
        except BaseException:  # cancelled (e.g. the loop shuts down mid-connect): no leak
            conn.abort(RateLimiterUnavailable("connect cancelled"), _native.STATUS_CONNECT)
            raise
        if limiter._closed:
            conn.close(RateLimiterError("the rate limiter is closed"))
            raise RateLimiterError("the rate limiter is closed")
        if conn.closed:  # the server hung up right after the handshake (e.g. TLS auth)
            raise RateLimiterUnavailable(f"Redis at {where} closed the connection after connecting")
        self.connections.append(conn)
        return conn

    async def _connect(self, conn: _Connection, options: RedisOptions) -> None:
        if options.unix_path is not None:
            await self.loop.create_unix_connection(lambda: conn, options.unix_path)
        else:
            assert options.host is not None  # a TCP URL always has one (_url.py)
            await self.loop.create_connection(
                lambda: conn, options.host, options.port, ssl=self.limiter._ssl,
                server_hostname=options.host if self.limiter._ssl is not None else None)
        await conn.handshake(options)

    def replay(self, pairs: list[tuple[asyncio.Future[Any], Any]]) -> None:
        """Replays checks whose connection broke, on a fresh or another open connection."""
        task = self.loop.create_task(self._replay(pairs))
        self.replaying.add(task)  # the loop keeps only a weak reference to tasks
        task.add_done_callback(self.replaying.discard)

    async def _replay(self, pairs: list[tuple[asyncio.Future[Any], Any]]) -> None:
        # On a connection of its own, as the blocking limiter does: an open sibling may have
        # broken in the same event (a restart), with replies still due on it.
        started = self.loop.time()
        try:
            conn = await self._open()
            extend = self.loop.time() - started
            for future, request in pairs:
                if not future.done():
                    conn.resubmit(future, request, extend)
        except Exception as exc:  # no connection to be had: the callers hear why
            for future, request in pairs:
                if not future.done():
                    self.limiter._codec._record_outcome("unavailable")
                    future.set_exception(_replay_failure(request, exc))

    def discard(self, conn: _Connection) -> None:
        try:
            self.connections.remove(conn)
        except ValueError:
            pass

    def close_all(self, exc: Exception) -> None:
        for conn in list(self.connections):
            conn.close(exc)
        self.connections.clear()
        for pool in list(self.nodes.values()):
            pool.close_all(exc)


class AsyncRateLimiter:
    """Exact sliding-window rate limiter on Redis for asyncio.

    >>> limiter = AsyncRateLimiter("redis://localhost:6379/0")
    >>> allowed, remaining, retry_after_s = await limiter.check("user_8421", 10, 60)

    Concurrent checks share connections and are pipelined. `await limiter.aclose()` (or
    `async with`) closes it; a call after that raises RateLimiterError and sends nothing.
    `min_replicas` / `replica_timeout_ms`: RateLimiter's (an admission no replica
    acknowledged raises RateLimiterUnavailable).
    """

    #: Called with each soft limit a hold or a settle crossed (a periods.BudgetCrossing),
    #: once per period across every replica: a plain callable, or an async one (awaited
    #: before the call returns: hand a webhook to a task or a queue). An exception it
    #: raises is logged and the call's answer is returned all the same.
    on_budget_threshold: Callable[[BudgetCrossing], object] | None = None

    def __init__(
        self,
        url: str | None = None,
        *,
        key_prefix: str = "ratelimit",
        connect_timeout: float = 1.0,
        socket_timeout: float = 1.0,
        clock: Clock = "server",
        max_connections: int = 4,
        metrics: bool = True,
        storage: Storage | None = None,
        min_replicas: int | None = None,
        replica_timeout_ms: int | None = None,
    ) -> None:
        options, native = limiter_options(url, key_prefix, connect_timeout, socket_timeout,
                                          clock, max_connections, metrics, storage,
                                          min_replicas, replica_timeout_ms)
        self._min_replicas = native["min_replicas"]
        self._replica_timeout_ms = native["replica_timeout_ms"]
        # The tasks that give back what a cancelled call took (_leave), until they end.
        self._leftovers: set[asyncio.Task[None]] = set()
        self._ssl = ssl_context(options) if options.tls else None
        self._options = options
        self._clock = clock
        cluster = options.mode == "cluster"
        self._codec = _native.Codec(key_prefix, client_clock=clock == "client",
                                    metrics=native["metrics"], hash_tag=cluster,
                                    storage=native["storage"])
        self._storage = native["storage"]
        # Cluster and Sentinel: the router of csrc/router.c (the blocking limiter's rules).
        self._router = (_native.Router(options.nodes, options.tls, options.master_name,
                                       float(native["socket_timeout"]))
                        if options.mode != "single" else None)
        # A shared scope's keys hash to the scope's slot, the user's to the user's.
        self._two_step_scopes = cluster
        self._connect_timeout = float(native["connect_timeout"])
        self._socket_timeout = float(native["socket_timeout"])
        self.max_connections = max_connections
        self.key_prefix = key_prefix
        self._closed = False
        self._eviction_warned = False
        # The loop of the last call and its pool: most programs have one loop.
        self._last_loop: asyncio.AbstractEventLoop | None = None
        self._last_pool: _LoopPool | None = None
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopPool] = (
            weakref.WeakKeyDictionary())
        # The in-flight wait queue's subscriber connection of each loop (_wake.py), made
        # when the loop's first waiter needs it.
        self._wakes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop,
                                               AsyncWakeSubscriber] = weakref.WeakKeyDictionary()

    @property
    def url(self) -> str:
        """Where this limiter connects, without credentials."""
        return self._options.describe()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def storage(self) -> str:
        """RateLimiter.storage: "zset" or "compact"."""
        return self._storage

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self._options.describe()!r}, "
                f"key_prefix={self.key_prefix!r}, clock={self._clock!r}, "
                f"storage={self._storage!r})")

    def _warn_once(self, warning: str) -> None:
        """Logs the engine's eviction warning, once per limiter ("" means no hazard)."""
        if warning and not self._eviction_warned:
            self._eviction_warned = True
            logger.warning("%s", warning)

    def _forget(self, pool: _LoopPool) -> None:
        """Drops a pool whose loop shut down."""
        if self._pools.get(pool.loop) is pool:
            del self._pools[pool.loop]
        if self._last_pool is pool:
            self._last_loop = self._last_pool = None

    def _pool(self) -> _LoopPool:
        loop = asyncio.get_running_loop()
        if loop is self._last_loop:
            return self._last_pool  # type: ignore[return-value]
        pool = self._pools.get(loop)
        if pool is None:
            pool = self._pools[loop] = _LoopPool(self, loop)
        self._last_loop, self._last_pool = loop, pool
        return pool

    async def _run(self, request: Any, decision: bool = False, admission: bool = False,
                   sent: _Sent | None = None) -> Any:
        """Sends one Request of the codec and waits for its answer. decision: a check,
        counted as unavailable in the metrics when no connection can be had. admission: a
        decision that logs the request when it allows (min_replicas waits for it). sent:
        for a call whose reply must outlive its caller (see _Sent)."""
        if self._router is not None:
            return await self._run_cluster(request, decision, admission, sent)
        pool = self._pool()
        conn = pool.pick()
        if conn is None:
            conn = await self._connection(pool, decision)
        if admission and self._min_replicas:
            future, wait = conn.admit(request)
            return await self._confirmed(conn, request, await self._reply(future, sent), wait)
        if sent is None:  # _reply's common case, inline: no coroutine frame of its own
            return await conn.submit(request)
        return await self._reply(conn.submit(request), sent)

    @staticmethod
    async def _reply(future: asyncio.Future[Any], sent: _Sent | None) -> Any:
        """The request's result. With `sent`, a cancelled caller leaves the future running
        (its reply is still read, by sent's owner) instead of cancelling it."""
        if sent is None:
            return await future
        sent.future = future
        return await asyncio.shield(future)

    async def _confirmed(self, conn: _Connection, request: Any, result: Any,
                         wait: asyncio.Future[Any]) -> Any:
        """An allowing admission fewer replicas than asked acknowledged in time raises
        RateLimiterUnavailable: it is no admission (the engine's rule, csrc/proto.c
        rl_proto_push_wait, the blocking limiter's too). A refusal waits for nothing."""
        try:
            allowed = bool(result[0])
        except (TypeError, IndexError, KeyError):
            allowed = bool(getattr(result, "allowed", False))
        if not allowed:
            return result
        if request.reloaded:  # NOSCRIPT: the decision ran again behind the WAIT, uncovered
            wait = conn.join_wait()
        await self._replicated(wait)
        return result

    @staticmethod
    async def _replicated(wait: asyncio.Future[Any]) -> None:
        """The WAIT's outcome as the engine judged it (Pipeline.push_wait: fewer replicas
        than min_replicas, or a connection that broke, raise "not replicated"). The WAIT is
        shared (_Connection.join_wait): a cancelled caller must not cancel it."""
        await asyncio.shield(wait)

    async def _run_cluster(self, request: Any, decision: bool = False,
                           admission: bool = False, sent: _Sent | None = None) -> Any:
        """Sends a Request where the router says (csrc/router.c: the blocking limiter's
        rules, the same code): the node that serves its slot, or the master the sentinels
        agree on; after each failed try the router says what next (MOVED, ASK, a pause and a
        read of the map, give up) within the call's deadline. A decision whose connection
        broke was resent once on that node by the replay rule and stays in its replay form,
        so no retry counts it twice. Each node has its own connections on this loop: a batch
        of checks goes out per node."""
        router = self._router
        assert router is not None
        root = self._pool()
        route = router.route(request.slot, time.monotonic() + self._socket_timeout)
        # Every failure of the request on a connection goes to the route in C (Pipeline:
        # the engine's status, or the one this module names for a connection it drops).
        request.route = route
        error: BaseException | None = None
        while True:
            action, value, asking = route.next()
            if action == _native.ROUTE_SEND:
                pool = root.node(value)
                wait = None
                try:
                    conn = pool.pick() or await self._connection(pool, decision)
                    if asking:
                        conn.submit_command(("ASKING",)).add_done_callback(_ignore_result)
                    if admission and self._min_replicas:
                        future, wait = conn.admit(request)
                    else:
                        future = conn.submit(request)
                except RateLimiterError as exc:  # no connection to send it on
                    if not self._try_elsewhere(route, _connection_status(exc), exc):
                        raise
                    error = exc
                    continue
                try:
                    result = await self._reply(future, sent)
                except RateLimiterError as exc:
                    if not route.go_on:  # the router had it (Request.route) and gave up
                        raise
                    error = exc
                    continue
                if wait is None:
                    return result
                # min_replicas: the admission ran here; never sent elsewhere from now on.
                return await self._confirmed(conn, request, result, wait)
            if action == _native.ROUTE_READ:
                await self._read_map(root, value, route)
            elif action == _native.ROUTE_WAIT:
                await asyncio.sleep(value)
            else:  # ROUTE_FAIL: the last try's own error
                assert error is not None
                raise error

    @staticmethod
    def _try_elsewhere(route: Any, status: int, exc: RateLimiterError) -> bool:
        """Route.failed(status, exc), with the router's own error (when it says more)
        raised without exc chained to it."""
        try:
            return bool(route.failed(status, exc))
        except RateLimiterError as own:
            raise own from None

    async def _ask_one(self, pool: _LoopPool, read: Any, until: float) -> None:
        """Asks one node the read's question, by its share of the read's deadline (the
        router's): a frozen node costs a fraction of the call. The reply, or whatever cuts
        it off, goes to the read (from the Pipeline, or here when the question never
        reached one). Its connection is dropped on a timeout."""
        share = max(0.0, until - time.monotonic())
        conn: _Connection | None = None
        asked = False

        async def ask() -> None:
            nonlocal conn, asked
            conn = pool.pick() or await pool.get()
            future = conn.submit_question(read)
            asked = True
            await future

        try:
            await asyncio.wait_for(ask(), share)
        except asyncio.TimeoutError:
            error = RateLimiterTimeout(f"{pool.options.describe()} did not answer within "
                                       f"{share:.3f} s")
            if asked:
                assert conn is not None
                conn.abort(error, _native.STATUS_TIMEOUT)  # the read hears of it there
            else:
                if conn is not None:
                    conn.abort(error, _native.STATUS_TIMEOUT)
                read.failed(_native.STATUS_TIMEOUT, error)
        except RateLimiterError as exc:  # no connection to ask on
            if not asked:
                read.failed(_connection_status(exc), exc)

    async def _read_map(self, root: _LoopPool, deadline: float, route: Any = None) -> Any:
        """One read of the slot map or of the sentinels: asks what the router asks, whom it
        asks, and hands every answer back (the router parses it). Returns the RouteRead
        (its error() says why a read failed). After a Sentinel switch, this loop's idle
        connections to the old master are closed."""
        router = self._router
        assert router is not None
        read = router.read(deadline, route)
        try:
            question = read.question()
            while question is not None:
                sentinel, index, until = question
                await self._ask_one(root.node(index, sentinel), read, until)
                question = read.question()
        finally:
            replaced = read.end()
        stale = root.nodes.get(replaced) if replaced >= 0 else None
        if stale is not None:  # no new call goes to the old master
            for conn in list(stale.connections):
                if conn.pipeline.pending == 0:
                    conn.close(RateLimiterUnavailable("the sentinels named a new master"))
        return read

    async def _masters(self) -> list[tuple[str, int]] | None:
        """The masters now, read afresh (a cluster's map, or the master the sentinels agree
        on); None for a single node. For the command line."""
        router = self._router
        if router is None:
            return None
        read = await self._read_map(self._pool(), time.monotonic() + self._socket_timeout)
        error = read.error()
        if error is not None:
            raise error
        return [router.address(node) for node in router.masters()]

    def _destination(self, slot: int) -> tuple[str, int] | None:
        """Where a decision of this hash slot goes (after _masters()), or None."""
        node = self._router.destination(slot) if self._router is not None else -1
        return self._router.address(node) if self._router is not None and node >= 0 else None

    async def _connection(self, pool: _LoopPool, decision: bool) -> _Connection:
        """A new or the least busy connection of pool; counts a decision that cannot
        have one as unavailable."""
        try:
            return await pool.get()
        except RateLimiterError:
            if decision:
                self._codec._record_outcome("unavailable")
            raise

    async def check(self, user_id: str, limit: int, window_seconds: int, *,
                    cost: int = 1) -> tuple[bool, int, int]:
        """Decides one request of user_id: (allowed, remaining, retry_after_s)."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        request = self._codec.check(user_id, limit, window_seconds, cost=cost)
        if type(request) is tuple:  # the kill switch answered
            return request
        if self._router is not None:
            return await self._run_cluster(request, True, True)  # type: ignore[no-any-return]
        if self._min_replicas:
            return await self._run(request, True, True)  # type: ignore[no-any-return]
        # _run's body, inline: the hottest call is spared a coroutine frame.
        pool = self._pool()
        conn = pool.pick()
        if conn is None:
            conn = await self._connection(pool, True)
        return await conn.submit(request)  # type: ignore[no-any-return]

    async def check_windows(self, user_id: str, windows: Any, *,
                            cost: int = 1) -> tuple[bool, int, int, int]:
        """Decides one request against every (limit, window_seconds) pair, shortest first:
        (allowed, remaining, retry_after_s, window_seconds)."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        request = self._codec.check_windows(user_id, windows, cost=cost)
        if type(request) is tuple:
            return request
        return await self._run(request, True, True)  # type: ignore[no-any-return]

    async def check_windows_detailed(self, user_id: str, windows: Any, *, cost: int = 1,
                                     gcra: tuple[int, int, int] | None = None) -> WindowDecision:
        """check_windows, answered as a WindowDecision: the same 4-tuple, with the exact wait
        (retry_after_ms) and the decision's time (timestamp_ms) as attributes. gcra=(rate,
        period_seconds, burst): a GCRA bucket decided with the windows, all or nothing
        (docs/gcra.md)."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        request = self._codec.check_windows_detailed(user_id, windows, cost=cost, gcra=gcra)
        if type(request) is WindowDecision:  # the kill switch answered
            return request
        return await self._run(request, True, True)  # type: ignore[no-any-return]

    # RateLimiter._two_step_scopes: shared scopes decided in steps of their own.
    _two_step_scopes = False

    async def reserve(self, user_id: str, windows: Sequence[tuple[int, int]] = (), *,
                      cost: int = 1, token_windows: Sequence[tuple[int, int]] = (),
                      tokens: int | None = None, scopes: Sequence[Scope] = (),
                      in_flight: tuple[int, int] | None = None,
                      scope_class: str | None = None, max_wait: float | None = None,
                      tenant: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
                      max_queue_per_tenant: int = DEFAULT_MAX_QUEUE_PER_TENANT) -> Reservation:
        """RateLimiter.reserve, awaited (its lease is an AsyncLease). A caller cancelled
        while it waits in a queue (max_wait) leaves it: its ticket is removed."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        if max_wait is not None:
            queued: Reservation = await self._drive(queued_reserve_plan(
                user_id, windows, cost, token_windows, tokens, scopes, max_wait, tenant,
                max_queue, max_queue_per_tenant, self._two_step_scopes, in_flight,
                None, scope_class), reserving=True)
            count_reservation(self._codec._record_outcome, queued)
            count_queue_wait(self, scopes, queued)
            return queued
        reservation: Reservation = await self._drive(reserve_plan(
            user_id, windows, cost, token_windows, tokens, scopes, self._two_step_scopes,
            in_flight, lease_maker(AsyncLease, user_id, in_flight, self), scope_class),
            reserving=True)
        count_reservation(self._codec._record_outcome, reservation)
        return reservation

    async def reconcile(self, reservation: Reservation, actual: int, *,
                        release: bool = False) -> int:
        """RateLimiter.reconcile, awaited."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        found: int = await self._drive(reconcile_plan(reservation, actual, release))
        count_reconcile(self._codec._record_outcome, reservation, actual, found)
        return found

    async def hold_budgets(self, budgets: Budget | Sequence[Budget],
                           amount: int | Sequence[int], *,
                           hold_seconds: int = DEFAULT_HOLD_SECONDS) -> BudgetHold:
        """RateLimiter.hold_budgets, awaited. A caller cancelled while the hold is on its
        way leaves nothing held: once the reply is in, a hold it made is given back."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        plan = hold_plan(budgets, amount, hold_seconds, grouped=self._two_step_scopes)
        call, result = advance(plan)
        chosen = (budgets,) if isinstance(budgets, Budget) else tuple(budgets)  # checked by now
        # A cluster holds several owners in steps (periods.hold_plan): a cancelled caller
        # leaves the plan to finish in the background, giving back every step it held.
        steps = self._two_step_scopes and len({b.owner for b in chosen}) > 1
        while call is not None:
            name, positional, keywords = call
            request = (self._codec.hold_budgets(*positional, **keywords) if name == "hold_budgets"
                       else self._codec.settle_budgets(*positional, **keywords))
            if type(request) is tuple:  # the kill switch answered
                call, result = advance(plan, request)
                continue
            sent = _Sent()
            try:
                answer = await self._run(request, name == "hold_budgets",
                                         name == "hold_budgets", sent)
            except asyncio.CancelledError:
                if steps:
                    self._leave(self._abandon_hold(plan, call, sent))
                elif sent.future is not None:
                    self._leave(self._release_held(positional[1], sent, chosen))
                raise
            except Exception as exc:  # noqa: BLE001 - handed to the plan: it gives back its steps
                call, result = advance(plan, error=exc)
            else:
                call, result = advance(plan, answer)
        hold: BudgetHold = result
        try:
            await self._report_crossings(hold.crossed)
        except asyncio.CancelledError:  # in an async on_budget_threshold: nothing stays held
            if hold.allowed and hold.hold_id:
                self._leave(self._give_back_hold(hold))
            raise
        return hold

    async def _abandon_hold(self, plan: Plan, call: Any, sent: _Sent) -> None:
        """Finishes the plan of a cancelled hold over several owners on a cluster: the reply
        of the call that was out is handed to the plan, no further owner is held (the plan
        gives back the steps it held, as when a step fails), the give-backs are sent, and a
        hold that completed is settled to 0 (nobody will settle it)."""
        future = sent.future
        result: Any = None
        fed: BaseException | None = None  # the last error handed to the plan
        try:
            while call is not None:
                try:
                    if future is not None:  # the reply of the call that was out
                        answer = await future
                    elif call[0] == "hold_budgets":  # no new step for nobody
                        raise _Abandoned()
                    elif self._closed:
                        raise RateLimiterError("the rate limiter is closed")
                    else:
                        answer = await self._run(self._codec.settle_budgets(*call[1]))
                except Exception as exc:  # noqa: BLE001 - handed to the plan
                    fed = exc
                    call, result = advance(plan, error=exc)
                else:
                    call, result = advance(plan, answer)
                future = None
            hold: BudgetHold = result
            await self._report_crossings(hold.crossed)  # recorded in Redis: told by no one else
            if hold.allowed and hold.hold_id and not self._closed:
                await self.settle_budgets(hold, 0)
        except Exception as exc:  # noqa: BLE001 - logged: the holds expire with their keys
            if exc is fed:  # the plan gave up on that error, having given back its steps
                return
            logger.warning("could not give back the hold of a cancelled hold_budgets (it is "
                           "held until its key expires): %s", exc)

    async def _give_back_hold(self, hold: BudgetHold) -> None:
        """Settles a hold to 0 for a caller cancelled after it was made."""
        try:
            if not self._closed:
                await self.settle_budgets(hold, 0)
        except Exception as exc:  # noqa: BLE001 - logged: the hold expires with its key
            logger.warning("could not give back the hold of a cancelled hold_budgets (it is "
                           "held until its key expires): %s", exc)

    async def _report_crossings(self, crossings: tuple[BudgetCrossing, ...]) -> None:
        """The metric, the log record and the app's callback (awaited when it is async)."""
        report_crossings(self, crossings)
        callback = self.on_budget_threshold
        if callback is None:
            return
        for crossing in crossings:
            try:
                answer = callback(crossing)
                if inspect.isawaitable(answer):
                    await answer
            except Exception:  # noqa: BLE001 - the admission stands; the app's bug is logged
                logger.exception("on_budget_threshold raised for budget %r of %r at %d%%",
                                 crossing.budget.name, crossing.budget.owner, crossing.threshold)

    async def _release_held(self, rows: tuple[Any, ...], sent: _Sent,
                            budgets: tuple[Budget, ...]) -> None:
        """For a hold whose caller was cancelled: once its reply is in, reports the soft
        limits it crossed (recorded in Redis: told by no one else) and gives back what it
        held (nobody will settle it)."""
        try:
            raw = await sent.future  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - no answer: a hold it made expires with its key
            return
        allowed, _, kind, _, hold_id, periods = raw
        if not (allowed and hold_id and kind >= 0):
            return
        settle = tuple((row[0], row[1], period[1], 0, row[2], row[8])
                       for row, period in zip(rows, periods, strict=True))
        try:
            if not self._closed:
                await self._run(self._codec.settle_budgets(rows[0][0], settle, hold_id))
        except Exception as exc:  # noqa: BLE001 - logged: the hold expires with its key
            logger.warning("could not give back the hold of a cancelled hold_budgets (it is "
                           "held until its key expires): %s", exc)
        await self._report_crossings(tuple(
            BudgetCrossing(b, t, start, end, "hold", hold_id)
            for b, (_, start, end, before, after) in zip(budgets, periods, strict=True)
            for t in b.thresholds if before < t <= after))

    async def settle_budgets(self, hold: BudgetHold,
                             actual: int | Sequence[int]) -> BudgetSettlement:
        """RateLimiter.settle_budgets, awaited."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        plan = settle_plan(hold, actual)
        call, result = advance(plan)
        while call is not None:
            _, positional, keywords = call
            answer = await self._run(self._codec.settle_budgets(*positional, **keywords))
            call, result = advance(plan, answer)
        settled: BudgetSettlement = result
        await self._report_crossings(settled.crossed)
        return settled

    async def observe_upstream(self, name: str, status: int,
                               headers: Mapping[str, str]
                               | Iterable[tuple[str | bytes, str | bytes]],
                               *, max_close_seconds: float = DEFAULT_MAX_CLOSE_SECONDS
                               ) -> ProviderLimits:
        """RateLimiter.observe_upstream, awaited."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        plan = observe_plan(name, status, headers, max_close_seconds)
        call, result = advance(plan)
        if call is not None:
            request = self._codec.observe_upstream(*call[1])
            answer = request if type(request) is int else await self._run(request)
            call, result = advance(plan, answer)
        return result  # type: ignore[no-any-return]

    async def _drive(self, plan: Plan, reserving: bool = False) -> Any:
        """Runs a plan's C calls (reservation.py) on this loop's pipeline. When the caller is
        cancelled, the plan is finished on its own (_abandon): nothing it took outlives it.
        reserving: a reserve's plan. A ticket it takes in a wait queue counts this request as
        waiting there (queue_waits) until the plan ends or the caller is cancelled."""
        leaves: list[Callable[[], None]] = []
        call, result = advance(plan)
        try:
            while call is not None:
                sent = _Sent()
                try:
                    answer = await self._call(call, sent)
                except asyncio.CancelledError:
                    self._leave(self._abandon(plan, call, sent, reserving))
                    raise
                except BaseException as exc:  # noqa: BLE001 - handed to the plan, which re-raises
                    call, result = advance(plan, error=exc)
                else:
                    if (call[0] == "wait_queue" and call[1][3][0] > 0
                            and isinstance(answer, int) and answer >= 0):
                        leaves.append(queue_waits(self).enter(call[1][0]))
                    call, result = advance(plan, answer)
        finally:
            for leave in leaves:
                leave()
        return result

    async def _call(self, call: Any, sent: _Sent | None = None) -> Any:
        """One C call of a plan, awaited: its answer."""
        name, positional, keywords = call
        if name == "validate":  # a codec without hash tags: steps may span slots
            return _native.Codec(self.key_prefix, metrics=False).reserve(*positional, **keywords)
        if self._closed:  # a plan finished after aclose (_abandon) opens nothing
            raise RateLimiterError("the rate limiter is closed")
        if name == "release":
            return await self._run(self._codec.release(*positional), sent=sent)
        if name == "clock":
            return time.monotonic()
        if name == "sleep":
            await asyncio.sleep(*positional)
            return None
        if name == "wait_queue":
            return await self._run(self._codec.wait_queue(*positional, **keywords), sent=sent)
        if name == "reserve":  # a decision (the metrics count it), a reconcile is not
            request = self._codec.reserve(*positional, **keywords)
            return (request if type(request) is tuple
                    else await self._run(request, True, True, sent))
        # never answered by the kill switch: Redis holds what it corrects
        return await self._run(self._codec.reconcile(*positional, **keywords), sent=sent)

    def _leave(self, work: Coroutine[Any, Any, None]) -> None:
        """Runs `work` in a task of its own: what a cancelled call leaves to finish. aclose
        waits for it (bounded)."""
        task = asyncio.get_running_loop().create_task(work)
        self._leftovers.add(task)
        task.add_done_callback(self._leftovers.discard)

    async def _release_granted(self, user_id: str, sent: _Sent) -> None:
        """For an acquire whose caller was cancelled: once its reply is in, releases the
        lease it granted (nobody holds it)."""
        if sent.future is None:
            return  # never queued: nothing was taken
        try:
            raw = await sent.future
        except Exception:  # noqa: BLE001 - no answer: a lease it took expires by itself
            return
        if not (raw[0] and raw[4]):
            return
        try:
            if not self._closed:
                await self._run(self._codec.release(user_id, raw[4]))
        except Exception as exc:  # noqa: BLE001 - logged: the lease expires by itself
            logger.warning("could not release the lease of a cancelled acquire for %r (it "
                           "expires after its lease_seconds): %s", user_id, exc)

    async def _abandon(self, plan: Plan, call: Any, sent: _Sent, reserving: bool) -> None:
        """Finishes the plan of a cancelled reserve or reconcile: the reply of the call that
        was out is read and handed to the plan. A reserve sends no further step (the plan
        refunds the steps it took, as when a step fails) and what its finished reservation
        holds is given back (_give_back); a reconcile sends the rest of its calls."""
        future = sent.future
        result: Any = None
        fed: BaseException | None = None  # the last error handed to the plan
        try:
            while call is not None:
                try:
                    if future is not None:  # the reply of the call that was out
                        answer = await future
                    elif reserving and call[0] in ("reserve", "sleep"):  # nobody waits
                        raise _Abandoned()
                    else:
                        answer = await self._call(call)
                except Exception as exc:  # noqa: BLE001 - handed to the plan
                    fed = exc
                    call, result = advance(plan, error=exc)
                else:
                    call, result = advance(plan, answer)
                future = None
            if reserving:
                await self._give_back(result)
        except Exception as exc:  # noqa: BLE001 - logged: entries leave their windows, leases expire
            if exc is fed:  # the plan gave up on that error, having refunded what it took
                return
            logger.warning("could not give back what a cancelled %s took: %s",
                           "reserve" if reserving else "reconcile", exc)

    async def _give_back(self, reservation: Reservation) -> None:
        """What an allowed reservation that nobody received holds for its request: the
        token estimate (reconciled to 0: the request never ran) and the in-flight slot. The
        request itself stays counted, as a cancelled check's does."""
        if not reservation.allowed:
            return
        if any(window.resource == "tokens" for window in reservation.windows):
            await self._drive(reconcile_plan(reservation, 0, release=True))
        elif reservation.lease is not None and reservation.lease.lease_id:
            await self._run(self._codec.release(reservation.user_id, reservation.lease.lease_id))

    async def peek(self, user_id: str, windows: Sequence[tuple[int, int]] = (), *,
                   cost: int = 1, token_windows: Sequence[tuple[int, int]] = (),
                   tokens: int | None = None,
                   scopes: Sequence[Scope] = ()) -> tuple[bool, int, int, int]:
        """RateLimiter.peek, awaited: what a check would answer now; writes nothing."""
        raw = await self._peek(user_id, windows, **reserve_arguments(
            cost, token_windows, tokens, _scope_list(scopes), decides=False))
        return raw[:4]  # type: ignore[no-any-return]

    async def _peek(self, user_id: str, windows: Sequence[tuple[int, int]] = (),
                    **arguments: Any) -> Any:
        """RateLimiter._peek, awaited, with its keyword arguments (scopes in their native
        form): the full answer, every window's use included."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        request = self._codec.peek(user_id, windows, **arguments)
        return request if type(request) is tuple else await self._run(request)

    # check_rate: GCRA (docs/gcra.md), RateLimiter.check_rate's semantics and errors.
    async def check_rate(self, user_id: str, rate: int, period_seconds: int, burst: int, *,
                         cost: int = 1) -> tuple[bool, int, int]:
        """RateLimiter.check_rate, awaited: (allowed, remaining, retry_after_s)."""
        raw = await self._check_rate(user_id, rate, period_seconds, burst, cost=cost)
        return raw[:3]

    async def _check_rate(self, user_id: str, rate: int, period_seconds: int, burst: int, *,
                          cost: int = 1) -> tuple[bool, int, int, int, int]:
        """RateLimiter._check_rate, awaited: (allowed, remaining, retry_after_s,
        retry_after_ms, now_ms)."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        request = self._codec.check_rate(user_id, rate, period_seconds, burst, cost=cost)
        if type(request) is tuple:  # the kill switch answered
            return request
        return await self._run(request, True, True)  # type: ignore[no-any-return]

    async def ping(self) -> float:
        """RateLimiter.ping, awaited: one read-only round trip; the seconds it took."""
        started = time.perf_counter()
        await self._peek(PING_IDENTITY, ((1, 1),))
        return time.perf_counter() - started

    async def reset(self, user_id: str, windows: Sequence[tuple[int, int]] | None = None, *,
                    token_windows: Sequence[tuple[int, int]] | None = None) -> int:
        """RateLimiter.reset, awaited: the number of entries removed."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        scan = windows is None and token_windows is None
        removed, cursor = 0, None
        while True:
            request = (self._codec.reset(user_id, cursor=cursor) if scan
                       else self._codec.reset(user_id, windows, token_windows=token_windows))
            more: int
            more, cursor = await self._run(request)
            removed += more
            if cursor == "0":
                return removed

    def metrics(self) -> LimiterMetrics:
        """The limiter's counters (RateLimiter.metrics)."""
        return self._codec.metrics()

    def _record_outcome(self, kind: str, count: int = 1) -> None:
        """Counts what only the caller knows (RateLimiter._record_outcome's kinds)."""
        self._codec._record_outcome(kind, count)

    async def _command(self, *words: str | bytes) -> Any:
        """Sends one Redis command (at most 8 words) on the limiter's connections; its
        reply as bytes, int, None or a list. For the command line (SCAN)."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        pool = self._pool()
        conn = pool.pick() or await pool.get()
        return await conn.submit_command(words)

    async def acquire(self, user_id: str, limit: int,
                      lease_seconds: int = DEFAULT_LEASE_SECONDS, *,
                      shares: Shares | None = None, share_class: str | None = None,
                      max_wait: float | None = None, tenant: str | None = None,
                      max_queue: int = DEFAULT_MAX_QUEUE,
                      max_queue_per_tenant: int = DEFAULT_MAX_QUEUE_PER_TENANT) -> AsyncLease:
        """RateLimiter.acquire, awaited: an AsyncLease (`async with` releases it). A caller
        cancelled while it waits in the cap's queue (max_wait) leaves it: its ticket is
        removed (and a lease granted as it was cancelled released)."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        spec = acquire_shares(limit, shares, share_class)
        if max_wait is not None:
            check_queue_shares(spec)
            return await self._queued_acquire(queued_acquire_plan(
                user_id, limit, lease_seconds, max_wait, tenant, max_queue,
                max_queue_per_tenant,
                lambda raw: make_lease(AsyncLease, raw, user_id, limit, lease_seconds, self)),
                user_id)
        if spec is None:
            request = self._codec.acquire(user_id, limit, lease_seconds)
        else:
            request = self._codec.acquire(user_id, limit, lease_seconds, spec)
        if type(request) is tuple:  # the kill switch answered
            raw = request
        else:
            sent = _Sent()
            try:
                raw = await self._run(request, admission=True, sent=sent)
            except asyncio.CancelledError:
                # The script may have granted a lease nobody holds: released when it did.
                if sent.future is not None:
                    self._leave(self._release_granted(user_id, sent))
                raise
        return make_lease(AsyncLease, raw, user_id, limit, lease_seconds, self,  # type: ignore[return-value]
                          shares, share_class)

    async def _queued_acquire(self, plan: Plan, user_id: str) -> AsyncLease:
        """Runs wait_queue.queued_acquire_plan on this loop. When the caller is cancelled,
        the plan is finished on its own (_abandon_acquire): its ticket removed, a lease
        granted by the call that was out released."""
        call, result = advance(plan)
        while call is not None:
            sent = _Sent()
            try:
                answer = await self._queue_call(call, sent)
            except asyncio.CancelledError:
                self._leave(self._abandon_acquire(plan, call, sent, user_id))
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the plan, which re-raises
                call, result = advance(plan, error=exc)
            else:
                call, result = advance(plan, answer)
        return result  # type: ignore[no-any-return]

    async def _queue_call(self, call: Any, sent: _Sent | None = None) -> Any:
        """One call of queued_acquire_plan, awaited: its answer."""
        name, positional, keywords = call
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        if name == "acquire":
            request = self._codec.acquire(*positional, **keywords)
            if type(request) is tuple:  # the kill switch answered
                return request
            return await self._run(request, admission=True, sent=sent)
        if name == "wait_queue":
            return await self._run(self._codec.wait_queue(*positional, **keywords), sent=sent)
        if name == "clock":
            return time.monotonic()
        subscriber = self._wake_subscriber()
        if name == "subscribe":
            channel = wake_channel(self.key_prefix,
                                   _native.key_owner(positional[0], self._two_step_scopes))
            return await subscriber.subscribe(channel, positional[1])
        if name == "wake":
            return await subscriber.wake(*positional)
        subscriber.unsubscribe(*positional)  # "unsubscribe"
        return None

    def _wake_subscriber(self) -> AsyncWakeSubscriber:
        """This loop's subscriber of the in-flight wait queue's wake-ups."""
        loop = asyncio.get_running_loop()
        subscriber = self._wakes.get(loop)
        if subscriber is None:
            subscriber = self._wakes[loop] = AsyncWakeSubscriber(
                self._options, self._connect_timeout, self._ssl)
        return subscriber

    async def _abandon_acquire(self, plan: Plan, call: Any, sent: _Sent, user_id: str) -> None:
        """Finishes the plan of a cancelled queued acquire: a lease the call that was out
        granted is released; the plan, told it was abandoned, removes its ticket and its
        waiter (it sends no further acquire and sleeps no more)."""
        if call[0] == "acquire":
            await self._release_granted(user_id, sent)
        try:
            call, _ = advance(plan, error=_Abandoned())
            while call is not None:
                try:
                    if call[0] in ("acquire", "subscribe", "wake"):  # nobody waits for it
                        raise _Abandoned()
                    answer = await self._queue_call(call)
                except Exception as exc:  # noqa: BLE001 - handed to the plan
                    call, _ = advance(plan, error=exc)
                else:
                    call, _ = advance(plan, answer)
        except Exception:  # noqa: BLE001 - the plan re-raised: it has left; a ticket lapses
            return

    async def release(self, lease: Lease) -> bool:
        """RateLimiter.release, awaited."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        arguments = lease_arguments(lease)
        if arguments is None:
            return False
        return await self._run(self._codec.release(*arguments[:2]))  # type: ignore[no-any-return]

    async def renew(self, lease: Lease, lease_seconds: int | None = None) -> bool:
        """RateLimiter.renew, awaited."""
        if self._closed:
            raise RateLimiterError("the rate limiter is closed")
        arguments = lease_arguments(lease, lease_seconds)
        if arguments is None:
            return lease.allowed
        raw = await self._run(self._codec.renew(*arguments))
        return bool(raw[0])

    async def aclose(self) -> None:
        """Closes every connection; pending checks fail. A second call does nothing."""
        if self._closed:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        # What cancelled calls left to give back (_leave), on this loop: finished first,
        # bounded by a reply's time and the give-back's own.
        leftovers = [task for task in self._leftovers if task.get_loop() is running]
        if leftovers:
            await asyncio.wait(leftovers, timeout=2 * self._socket_timeout
                               + self._replica_timeout_ms / 1000)
            if self._closed:  # closed meanwhile
                return
        self._closed = True
        exc = RateLimiterError("the rate limiter is closed")
        for loop, pool in list(self._pools.items()):
            if loop is running:
                pool.close_all(exc)
            elif not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(pool.close_all, exc)
                except RuntimeError:  # the loop closed meanwhile
                    pass
        self._pools.clear()
        self._last_loop = self._last_pool = None
        for loop, subscriber in list(self._wakes.items()):
            if loop is running:
                subscriber.close()
            elif not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(subscriber.close)
                except RuntimeError:  # the loop closed meanwhile
                    pass
        self._wakes.clear()

    async def __aenter__(self) -> AsyncRateLimiter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
