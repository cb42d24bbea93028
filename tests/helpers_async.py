"""Helpers for the limiter tests of every kind: the kinds themselves (the blocking
RateLimiter, and AsyncRateLimiter on asyncio's loop and on uvloop), running coroutines on a
chosen event loop, a blocking adapter that drives an AsyncRateLimiter through the blocking
interface, the factory behind the `make_limiter` fixture (tests/conftest.py), and a
loop-lag probe.

pytest-asyncio is not used: each test drives its own loop with LoopRunner or run_async."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import pytest

from helpers_core import INFO_REFUSED, INFO_REQUEST, LoopbackServer

T = TypeVar("T")
LoopFactory = Callable[[], asyncio.AbstractEventLoop]

REQUIRE_UVLOOP_VARIABLE = "GENAI_RATELIMIT_REQUIRE_UVLOOP"

# The kinds of limiter a test can run against: the blocking RateLimiter, and AsyncRateLimiter
# on asyncio's own loop and on uvloop's.
LIMITER_KINDS = ("sync", "asyncio", "uvloop")
ASYNC_KINDS = ("asyncio", "uvloop")


def _uvloop_factory() -> LoopFactory | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


def limiter_kind_params(kinds: Iterable[str] = LIMITER_KINDS) -> list[Any]:
    """pytest parameters for the given kinds. uvloop comes with the test extra; where it
    cannot be imported the uvloop case is left out, unless GENAI_RATELIMIT_REQUIRE_UVLOOP=1
    asks for it: then it is kept and fails, saying why (loop_factory_of)."""
    params = []
    for kind in kinds:
        if kind not in LIMITER_KINDS:
            raise ValueError(f"unknown limiter kind {kind!r}: one of {', '.join(LIMITER_KINDS)}")
        if (kind == "uvloop" and _uvloop_factory() is None
                and os.environ.get(REQUIRE_UVLOOP_VARIABLE) != "1"):
            continue
        params.append(pytest.param(kind, id=kind))
    return params


def loop_factory_of(kind: str) -> LoopFactory | None:
    """The event loop factory of a limiter kind; None for the blocking limiter. Fails the
    test when it is the uvloop case that GENAI_RATELIMIT_REQUIRE_UVLOOP=1 demanded but that
    cannot be imported."""
    if kind == "sync":
        return None
    if kind == "asyncio":
        return asyncio.new_event_loop
    if kind != "uvloop":
        raise ValueError(f"unknown limiter kind {kind!r}")
    factory = _uvloop_factory()
    if factory is None:
        pytest.fail(f"{REQUIRE_UVLOOP_VARIABLE}=1 but uvloop cannot be imported: "
                    "pip install uvloop (or unset the variable to leave the uvloop cases out)")
    return factory


class LoopRunner:
    """One event loop of a given kind, kept open across run() calls (like asyncio.Runner,
    which Python 3.10 lacks). close() cancels what is left, as asyncio.run does."""

    def __init__(self, loop_factory: LoopFactory | None = None) -> None:
        self.loop = (loop_factory or asyncio.new_event_loop)()

    def run(self, awaitable: Awaitable[T]) -> T:
        return self.loop.run_until_complete(awaitable)

    def close(self) -> None:
        loop = self.loop
        if loop.is_closed():
            return
        try:
            pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            # A limiter used on this loop and not closed still holds a socket here. uvloop
            # warns about it while closing, and with warnings turned into errors (as in this
            # suite) its close() never returns; asyncio's loop leaves the transport to the
            # garbage collector, whose "unclosed transport" warning would land in whichever
            # later test it collects in. That leak has tests of its own
            # (test_async_lifecycle.py); here both are closed now, warnings ignored for
            # this loop's own transports only, so no ignore is needed anywhere else.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                abort_leftover_transports(loop)
                loop.close()

    def __enter__(self) -> LoopRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def abort_leftover_transports(loop: asyncio.AbstractEventLoop) -> None:
    """Aborts the transports an asyncio selector loop still serves (its private `_transports`
    map, fd -> transport) and lets it run their connection_lost, so that their sockets are
    closed before the loop is. uvloop closes its own in close()."""
    transports = getattr(loop, "_transports", None)
    if not transports or loop.is_running():
        return
    leftover = [t for t in list(transports.values()) if t is not None and not t.is_closing()]
    for transport in leftover:
        transport.abort()
    if leftover:
        loop.run_until_complete(asyncio.sleep(0))


def run_async(coroutine: Coroutine[Any, Any, T], loop_factory: LoopFactory | None = None) -> T:
    """asyncio.run on a loop made by loop_factory."""
    with LoopRunner(loop_factory) as runner:
        return runner.run(coroutine)


class BlockingAsyncLimiter:
    """An AsyncRateLimiter behind the blocking limiter's interface: check(), check_windows(),
    reserve(), reconcile(), acquire(), release(), renew(), peek(), hold_budgets(),
    settle_budgets(), reset(), metrics(), close(),
    `with`, url, key_prefix, closed, repr(). Each call runs the coroutine to completion on one
    loop (made by `loop_factory`) that this adapter keeps for its lifetime, so connections are
    reused between calls exactly as in a long-running service. After each call the loop turns
    once more, so that a transport the call aborted finishes closing its socket, as it would on
    a loop that keeps running. It lets the contract tests (which only call these methods) prove
    the same behaviour of the async limiter without a copy of each test.

    The arguments after the loop factory are RateLimiter's. Calls from several threads are
    served one at a time: there is one loop."""

    def __init__(self, loop_factory: LoopFactory, *args: Any, **kwargs: Any) -> None:
        from genai_ratelimit import AsyncRateLimiter

        self.inner = AsyncRateLimiter(*args, **kwargs)  # validation errors surface here
        self.loop_factory = loop_factory
        self._runner = LoopRunner(loop_factory)
        self._lock = threading.Lock()  # one loop: one caller at a time

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop the calls run on (closed once the adapter is)."""
        return self._runner.loop

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs a coroutine to completion on this adapter's loop; after close(), on a loop
        of its own (where the closed limiter says so)."""
        with self._lock:
            if self._runner.loop.is_closed():
                return run_async(coroutine, self.loop_factory)
            try:
                return self._runner.run(coroutine)
            finally:
                self._runner.run(asyncio.sleep(0))  # aborted transports close their sockets

    def check(self, *args: Any, **kwargs: Any) -> tuple[bool, int, int]:
        return self.run(self.inner.check(*args, **kwargs))

    def check_windows(self, *args: Any, **kwargs: Any) -> tuple[bool, int, int, int]:
        return self.run(self.inner.check_windows(*args, **kwargs))

    def check_windows_detailed(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.inner.check_windows_detailed(*args, **kwargs))

    def reserve(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.inner.reserve(*args, **kwargs))

    def reconcile(self, *args: Any, **kwargs: Any) -> int:
        return self.run(self.inner.reconcile(*args, **kwargs))

    def acquire(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.inner.acquire(*args, **kwargs))

    def release(self, *args: Any, **kwargs: Any) -> bool:
        return self.run(self.inner.release(*args, **kwargs))

    def renew(self, *args: Any, **kwargs: Any) -> bool:
        return self.run(self.inner.renew(*args, **kwargs))

    def peek(self, *args: Any, **kwargs: Any) -> tuple[bool, int, int, int]:
        return self.run(self.inner.peek(*args, **kwargs))

    def hold_budgets(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.inner.hold_budgets(*args, **kwargs))

    def settle_budgets(self, *args: Any, **kwargs: Any) -> int:
        return self.run(self.inner.settle_budgets(*args, **kwargs))

    def observe_upstream(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.inner.observe_upstream(*args, **kwargs))

    def _peek(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.inner._peek(*args, **kwargs))

    def reset(self, *args: Any, **kwargs: Any) -> int:
        return self.run(self.inner.reset(*args, **kwargs))

    def metrics(self) -> Any:
        return self.inner.metrics()

    def _record_outcome(self, kind: str, *count: int) -> None:
        self.inner._record_outcome(kind, *count)

    def close(self) -> None:
        with self._lock:
            if self._runner.loop.is_closed():
                return
            try:
                self._runner.run(self.inner.aclose())
                for _ in range(3):  # connection_lost callbacks, then the sockets' close
                    self._runner.run(asyncio.sleep(0))
            finally:
                self._runner.close()

    @property
    def on_budget_threshold(self) -> Any:
        return self.inner.on_budget_threshold

    @on_budget_threshold.setter
    def on_budget_threshold(self, callback: Any) -> None:
        self.inner.on_budget_threshold = callback

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def key_prefix(self) -> str:
        return self.inner.key_prefix

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def __repr__(self) -> str:
        return repr(self.inner)

    def __enter__(self) -> BlockingAsyncLimiter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LimiterFactory:
    """What the `make_limiter` fixture (tests/conftest.py) gives a test: limiters of one
    kind, "sync", "asyncio" or "uvloop", and one storage, "zset" or "compact" (passed as
    storage= unless the test gives one), made from RateLimiter's arguments.

    make_limiter(url, **options) has the blocking interface: a RateLimiter, or a
    BlockingAsyncLimiter over an AsyncRateLimiter on a loop of the kind. This is what the
    contract tests use, so one test body proves a behaviour of every kind.

    make_limiter.native(url, **options) is the object itself: a RateLimiter, or an
    AsyncRateLimiter bound to no loop yet, for the tests that need the real async object
    (FastAPI's async dependency, async-only behaviour); loop_factory makes loops of the kind
    to use it on. track(limiter) adopts an AsyncRateLimiter made elsewhere (RateLimit()).

    close() (the fixture's teardown) closes everything it made or adopted."""

    def __init__(self, kind: str, storage: str = "zset") -> None:
        self.kind = kind
        self.storage = storage
        self.loop_factory = loop_factory_of(kind)  # None for the blocking limiter
        self.async_limiters: list[Any] = []  # native AsyncRateLimiters, made or adopted
        self._blocking: list[Any] = []

    @property
    def is_async(self) -> bool:
        return self.loop_factory is not None

    def _with_storage(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.storage != "zset":
            kwargs.setdefault("storage", self.storage)
        return kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs = self._with_storage(kwargs)
        if self.loop_factory is None:
            from genai_ratelimit import RateLimiter

            limiter: Any = RateLimiter(*args, **kwargs)
        else:
            limiter = BlockingAsyncLimiter(self.loop_factory, *args, **kwargs)
        self._blocking.append(limiter)
        return limiter

    def native(self, *args: Any, **kwargs: Any) -> Any:
        if self.loop_factory is None:
            return self(*args, **kwargs)
        from genai_ratelimit import AsyncRateLimiter

        return self.track(AsyncRateLimiter(*args, **self._with_storage(kwargs)))

    def track(self, limiter: Any) -> Any:
        """Closes `limiter`, an AsyncRateLimiter made elsewhere, at the end of the test."""
        self.async_limiters.append(limiter)
        return limiter

    def close(self) -> None:
        for limiter in reversed(self._blocking):
            limiter.close()
        for limiter in self.async_limiters:
            # Used on loops that are gone by now (a TestClient's): see close_and_collect.
            close_and_collect(limiter, self.loop_factory)

    def __repr__(self) -> str:
        return f"<LimiterFactory {self.kind} {self.storage}>"


# Under make test-asan the ASan runtime is preloaded (Makefile: ASAN_ENV).
UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")
# The longest the event loop may stall while checks wait on Redis (LoopLagProbe.max_lag).
MAX_LOOP_LAG = 0.05
LAG_UNDER_ASAN = ("under ASan the loop's stalls measure the sanitized build's speed (every "
                  "allocation, Python's too, goes through ASan's allocator), not a call that "
                  "blocks it: 57 to 181 ms were seen on a loaded 2-core machine; make test "
                  "asserts the 50 ms bound")


def max_loop_lag(blocking_stall: float) -> float:
    """The bound on LoopLagProbe.max_lag in a test where a call that blocked the loop would
    stall it for `blocking_stall` seconds (the timeout it waits out): MAX_LOOP_LAG, and under
    ASan half of blocking_stall (see LAG_UNDER_ASAN), which still tells a blocked loop."""
    return max(MAX_LOOP_LAG, blocking_stall / 2) if UNDER_ASAN else MAX_LOOP_LAG


def runqueue_wait_reader() -> Callable[[], float]:
    """A function that answers how long (seconds) the calling thread has waited, runnable,
    for a CPU so far: the second field of Linux's /proc/self/task/<tid>/schedstat. Where the
    kernel does not say, it answers 0.0 (every lateness then counts as a stall)."""
    try:
        fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
    except OSError:
        return lambda: 0.0

    def waited() -> float:
        try:
            return int(os.pread(fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    weakref.finalize(waited, os.close, fd)
    return waited


class LoopLagProbe:
    """A task that wakes up every `period` seconds and records how late each wake-up was:
    the event loop's lag. A check that blocked the loop for 100 ms shows as ~100 ms here.

        async with LoopLagProbe() as probe:
            await limiter.check(...)
        assert probe.max_lag < 0.05, probe.report()

    The garbage collector is paused while the probe runs (after one collection): late in a
    long test session a full collection alone takes tens of milliseconds, and that is the
    interpreter's pause, not the limiter's. Its pauses are still recorded, in case.

    Time the loop's thread spent runnable but not running (waiting for a CPU: the machine is
    busy, e.g. two test suites on two cores) is not the loop's stall either: the kernel
    counts it per thread (/proc/self/task/<tid>/schedstat, its second field), and it is taken
    off each wake-up's lateness. A loop blocked by code (a blocking syscall, a held lock, the
    GIL, a busy loop) is sleeping or running, never waiting for a CPU, so its stall counts
    whole. `max_raw_lag` keeps the lateness as measured, for the report.
    """

    def __init__(self, period: float = 0.002) -> None:
        self.period = period
        self.max_lag = 0.0
        self.max_raw_lag = 0.0
        self.wakeups = 0
        self.longest_gc_pause = 0.0  # the garbage collector's pauses, to tell them apart
        self._gc_started = 0.0
        self._gc_was_enabled = True
        self._task: asyncio.Task[None] | None = None

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.monotonic()
        else:
            self.longest_gc_pause = max(self.longest_gc_pause, time.monotonic() - self._gc_started)

    def report(self) -> str:
        return (f"the loop stalled for {self.max_lag * 1000:.1f} ms (late by "
                f"{self.max_raw_lag * 1000:.1f} ms at most, waits for a CPU included; longest "
                f"garbage collection meanwhile: {self.longest_gc_pause * 1000:.1f} ms, "
                f"{self.wakeups} wake-ups)")

    async def _tick(self) -> None:
        waited = runqueue_wait_reader()
        while True:
            before = time.monotonic()
            queued = waited()
            await asyncio.sleep(self.period)
            raw = time.monotonic() - before - self.period
            lag = raw - (waited() - queued)
            self.max_raw_lag = max(self.max_raw_lag, raw)
            self.max_lag = max(self.max_lag, lag)
            self.wakeups += 1

    async def __aenter__(self) -> LoopLagProbe:
        gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.get_running_loop().create_task(self._tick())
        await asyncio.sleep(0)  # let the probe take its first reading
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        gc.callbacks.remove(self._on_gc)
        if self._gc_was_enabled:
            gc.enable()
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


def close_and_collect(limiter: Any, loop_factory: LoopFactory | None = None) -> None:
    """Test clean-up for a limiter used from loops that are closed by now: aclose() it, then
    collect what it held. aclose() cannot close a connection whose loop is gone; its socket
    is then closed by the garbage collector, which warns (ResourceWarning). That leak has a
    test of its own (test_async_lifecycle.py); here the warning is kept out of whichever
    later test the collector happens to run in."""
    run_async(limiter.aclose(), loop_factory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def connected_clients(client: Any) -> int:
    """How many client connections the server holds (the inspection client's included)."""
    return int(client.info("clients")["connected_clients"])


def wait_for_connected_clients(client: Any, at_most: int, timeout: float = 5.0) -> int:
    """Polls until the server holds at most `at_most` client connections (it notices a closed
    socket in its own time); returns the last count, which may still be higher at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        count = connected_clients(client)
        if count <= at_most or time.monotonic() >= deadline:
            return count
        time.sleep(0.01)  # polling the server's own count, with a deadline


class BatchRecordingServer(LoopbackServer):
    """A loopback server that stands in for Redis to observe how commands arrive: it reads
    until `expected` EVALSHA commands have come in, counting the reads (recv calls) and
    connections that took, then answers each with `reply`. Used to prove auto-pipelining:
    checks issued together arrive together."""

    def __init__(self, reply: bytes, expected: int) -> None:
        self.reply = reply
        self.expected = expected
        self.reads = 0
        self.connections = 0
        self.received = 0
        self._lock = threading.Lock()
        super().__init__(backlog=16)

    def _accepted(self, conn: socket.socket) -> None:
        with self._lock:
            self.connections += 1
            super()._accepted(conn)

    def _answer(self, conn: socket.socket) -> None:
        pending = infos = 0
        for data in self._reads(conn, 1 << 20):
            with self._lock:
                self.reads += 1
                commands = data.count(b"EVALSHA")
                infos += data.count(INFO_REQUEST)  # sent once, at connect, before any check
                self.received += commands
                pending += commands
                done = self.received >= self.expected
            if done:  # everything is in: answer what this connection was sent
                try:
                    conn.sendall(INFO_REFUSED * infos + self.reply * pending)
                except OSError:
                    return
                pending = infos = 0
