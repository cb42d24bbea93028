"""Helpers for the AsyncRateLimiter tests: running coroutines on a chosen event loop (the
default asyncio loop, and uvloop when it is installed), a blocking adapter that lets the
sync suite's tests run unchanged against an AsyncRateLimiter, and a loop-lag probe.

pytest-asyncio is not used: each test drives its own loop with LoopRunner or run_async."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest

T = TypeVar("T")
LoopFactory = Callable[[], asyncio.AbstractEventLoop]

REQUIRE_UVLOOP_VARIABLE = "GENAI_RATELIMIT_REQUIRE_UVLOOP"


def _uvloop_factory() -> LoopFactory | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


def loop_factory_params() -> list[Any]:
    """The event loops every async test runs on: asyncio's own, and uvloop when it can be
    imported. Without uvloop the uvloop case is left out, unless
    GENAI_RATELIMIT_REQUIRE_UVLOOP=1 asks for it: then it is kept and fails, saying why."""
    params = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    factory = _uvloop_factory()
    if factory is not None:
        params.append(pytest.param(factory, id="uvloop"))
    elif os.environ.get(REQUIRE_UVLOOP_VARIABLE) == "1":
        params.append(pytest.param(None, id="uvloop"))
    return params


def checked_loop_factory(factory: LoopFactory | None) -> LoopFactory:
    """The factory of a loop_factory parameter; fails the test when it is the uvloop case
    that GENAI_RATELIMIT_REQUIRE_UVLOOP=1 demanded but that cannot be imported."""
    if factory is None:
        pytest.fail(f"{REQUIRE_UVLOOP_VARIABLE}=1 but uvloop cannot be imported: "
                    "pip install uvloop (or unset the variable to leave the uvloop cases out)")
    return factory


@pytest.fixture(params=loop_factory_params())
def loop_factory(request: pytest.FixtureRequest) -> LoopFactory:
    """The event loop factory of this test case (import this fixture into a test module)."""
    return checked_loop_factory(request.param)


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
            # suite) its close() never returns. That leak has tests of its own
            # (test_async_lifecycle.py); here it must not hang the whole suite.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                loop.close()

    def __enter__(self) -> "LoopRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_async(coroutine: Coroutine[Any, Any, T], loop_factory: LoopFactory | None = None) -> T:
    """asyncio.run on a loop made by loop_factory."""
    with LoopRunner(loop_factory) as runner:
        return runner.run(coroutine)


class BlockingAsyncLimiter:
    """An AsyncRateLimiter behind the blocking limiter's interface: check(), check_windows(),
    close(), `with`. Each call runs the coroutine to completion on one loop this adapter
    keeps open for its lifetime, so the connections are reused between calls exactly as in
    a long-running service. It lets the sync suite's tests (which only call these methods)
    prove the same behaviour of the async limiter without a copy of each test.

    The constructor takes RateLimiter's arguments, so a test module can put this class in
    place of genai_ratelimit.RateLimiter for tests that build their own limiter."""

    loop_factory: LoopFactory | None = None  # set per test by the modules that use it

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from genai_ratelimit import AsyncRateLimiter

        self.inner = AsyncRateLimiter(*args, **kwargs)  # validation errors surface here
        self._runner = LoopRunner(type(self).loop_factory)
        self._lock = threading.Lock()  # one loop: one caller at a time

    def _run(self, awaitable: Awaitable[T]) -> T:
        with self._lock:
            if self._runner.loop.is_closed():  # a call after close(): on a loop of its own
                return run_async(awaitable, type(self).loop_factory)  # type: ignore[arg-type]
            return self._runner.run(awaitable)

    def check(self, *args: Any, **kwargs: Any) -> tuple[bool, int, int]:
        return self._run(self.inner.check(*args, **kwargs))

    def check_windows(self, *args: Any, **kwargs: Any) -> tuple[bool, int, int, int]:
        return self._run(self.inner.check_windows(*args, **kwargs))

    def close(self) -> None:
        with self._lock:
            if not self._runner.loop.is_closed():
                self._runner.run(self.inner.aclose())
                self._runner.close()

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def key_prefix(self) -> str:
        return self.inner.key_prefix

    def __repr__(self) -> str:
        return repr(self.inner)

    def __enter__(self) -> "BlockingAsyncLimiter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LoopLagProbe:
    """A task that wakes up every `period` seconds and records how late each wake-up was:
    the event loop's lag. A check that blocked the loop for 100 ms shows as ~100 ms here.

        async with LoopLagProbe() as probe:
            await limiter.check(...)
        assert probe.max_lag < 0.05, probe.report()

    The garbage collector is paused while the probe runs (after one collection): late in a
    long test session a full collection alone takes tens of milliseconds, and that is the
    interpreter's pause, not the limiter's. Its pauses are still recorded, in case.
    """

    def __init__(self, period: float = 0.002) -> None:
        self.period = period
        self.max_lag = 0.0
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
        return (f"the loop stalled for {self.max_lag * 1000:.1f} ms (longest garbage collection "
                f"meanwhile: {self.longest_gc_pause * 1000:.1f} ms, {self.wakeups} wake-ups)")

    async def _tick(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.period)
            lag = time.monotonic() - before - self.period
            self.max_lag = max(self.max_lag, lag)
            self.wakeups += 1

    async def __aenter__(self) -> "LoopLagProbe":
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


class BatchRecordingServer:
    """A loopback server that stands in for Redis to observe how commands arrive: it reads
    until `expected` EVALSHA commands have come in, counting the reads (recv calls) and
    connections that took, then answers each with `reply`. Used to prove auto-pipelining:
    checks issued together arrive together."""

    def __init__(self, reply: bytes, expected: int) -> None:
        import socket

        self.reply = reply
        self.expected = expected
        self.reads = 0
        self.connections = 0
        self.received = 0
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(16)
        self.server.settimeout(0.1)
        self.port = self.server.getsockname()[1]
        self._stop = threading.Event()
        self._sockets: list[Any] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _serve(self) -> None:
        import socket

        while not self._stop.is_set():
            try:
                conn, _ = self.server.accept()
            except (socket.timeout, OSError):
                continue
            with self._lock:
                self.connections += 1
                self._sockets.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: Any) -> None:
        import socket

        conn.settimeout(0.1)
        pending = 0
        while not self._stop.is_set():
            try:
                data = conn.recv(1 << 20)
            except socket.timeout:
                continue
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self.reads += 1
                commands = data.count(b"EVALSHA")
                self.received += commands
                pending += commands
                done = self.received >= self.expected
            if done:  # everything is in: answer what this connection was sent
                try:
                    conn.sendall(self.reply * pending)
                except OSError:
                    return
                pending = 0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in self._sockets:
            conn.close()
        self.server.close()

    def __enter__(self) -> "BatchRecordingServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
