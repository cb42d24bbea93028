"""What a test of an app that uses the limiter needs: a throwaway redis-server, limiters on it,
and a clock the test moves. The pytest plugin (genai_ratelimit.pytest_plugin) hands these out
as fixtures; they work without pytest too (unittest, a script).

    from genai_ratelimit.testing import ManualClock, ThrowawayRedis

    with ThrowawayRedis() as redis, ManualClock() as clock:
        limiter = RateLimiter(redis.url, clock="client")
        limiter.check("user_1", limit=1, window_seconds=60)     # allowed
        limiter.check("user_1", limit=1, window_seconds=60)     # refused, retry after 60 s
        clock.advance(60)
        limiter.check("user_1", limit=1, window_seconds=60)     # allowed again

The clock: a limiter made with `clock="client"` decides at the time the caller gives Redis,
which it reads from the C extension; while a ManualClock runs, that time is the clock's, in
every thread of the process, for sync and async limiters alike. A limiter on the server's
clock (the default, `clock="server"`) reads Redis' TIME and is not moved."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from . import _native
from .aio import AsyncRateLimiter
from .limiter import RateLimiter

__all__ = ["ManualClock", "ThrowawayRedis", "LimiterFactory", "RedisNotFound"]

# The ManualClock that runs now (one per process: the C extension holds one client clock).
_running: ManualClock | None = None


class ManualClock:
    """The time, in unix milliseconds, at which every `clock="client"` limiter of this process
    decides while the clock runs (between start() and stop(), or in a `with` block). It starts
    at `now_ms`, by default the current time, and moves only when the test moves it."""

    def __init__(self, now_ms: int | None = None) -> None:
        self._now_ms = _checked_ms(now_ms if now_ms is not None else int(time.time() * 1000))

    @property
    def now_ms(self) -> int:
        """The clock's time in unix milliseconds."""
        return self._now_ms

    @property
    def running(self) -> bool:
        """Whether the limiters read this clock now."""
        return _running is self

    def set(self, now_ms: int) -> None:
        """Sets the time (unix milliseconds); it may go back, as a skewed clock does."""
        self._now_ms = _checked_ms(now_ms)
        if self.running:
            _native._set_client_clock(self._now_ms)

    def advance(self, seconds: float) -> int:
        """Moves the time forward by `seconds` (to the millisecond). Returns the new now_ms."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError(f"seconds must be a number, not {type(seconds).__name__}")
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0 (set() moves the clock back), got {seconds!r}")
        self.set(self._now_ms + round(seconds * 1000))
        return self._now_ms

    def start(self) -> ManualClock:
        """From now on, `clock="client"` limiters decide at this clock's time. Raises
        RuntimeError when another ManualClock runs: there is one client clock per process."""
        global _running
        if _running is not None and _running is not self:
            raise RuntimeError("another ManualClock is running: stop it first (one client clock "
                               "per process)")
        _native._set_client_clock(self._now_ms)
        _running = self
        return self

    def stop(self) -> None:
        """Gives the limiters the system clock back. Harmless when not running."""
        global _running
        if _running is self:
            _native._set_client_clock(None)
            _running = None

    def __enter__(self) -> ManualClock:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ManualClock(now_ms={self._now_ms}, running={self.running})"


def _checked_ms(now_ms: int) -> int:
    if isinstance(now_ms, bool) or not isinstance(now_ms, int):
        raise TypeError(f"now_ms must be an int (unix milliseconds), not {type(now_ms).__name__}")
    if not 1 <= now_ms <= _native.MAX_UNIX_MS:
        raise ValueError(f"now_ms must be between 1 and {_native.MAX_UNIX_MS}, got {now_ms}")
    return now_ms


class RedisNotFound(RuntimeError):
    """No redis-server binary to start."""


# A unix socket's path has room for about 100 bytes (104 on macOS, 108 on Linux).
_MAX_SOCKET_PATH = 100


class ThrowawayRedis:
    """A redis-server process of its own, listening on a unix socket in a fresh temporary
    directory only (no TCP port: nothing to race for, nothing on the network), with no
    persistence. start() waits until it answers; stop() ends it by its pid and removes the
    directory. `binary` defaults to `redis-server` on PATH; RedisNotFound when there is none."""

    def __init__(self, binary: str | None = None, *, start_timeout: float = 10.0) -> None:
        found = shutil.which(binary or "redis-server")
        if found is None:
            raise RedisNotFound(f"{binary or 'redis-server'} is not on PATH: install Redis "
                                "(apt-get install redis-server, brew install redis) or set REDIS_URL")
        self.binary = found
        self.start_timeout = start_timeout
        self.directory: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._process.pid if self._process is not None else None

    @property
    def unix_path(self) -> str:
        if self.directory is None:
            raise RuntimeError("the server is not started")
        return str(self.directory / "redis.sock")

    @property
    def url(self) -> str:
        """The URL of its database 0, for RateLimiter / AsyncRateLimiter (and redis-py)."""
        return f"unix://{self.unix_path}?db=0"

    def start(self) -> ThrowawayRedis:
        """Starts the server and waits (start_timeout at most) until it answers PING."""
        if self._process is not None:
            return self
        base = None if len(tempfile.gettempdir()) < _MAX_SOCKET_PATH - 40 else "/tmp"
        self.directory = Path(tempfile.mkdtemp(prefix="genai-ratelimit-", dir=base))
        log = self.directory / "redis.log"
        try:
            self._process = subprocess.Popen(
                [self.binary, "--port", "0", "--unixsocket", self.unix_path, "--unixsocketperm",
                 "700", "--save", "", "--appendonly", "no", "--dir", str(self.directory),
                 "--logfile", str(log)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except BaseException:
            self.stop()  # removes the directory made for it
            raise
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline and self._process.poll() is None:
            try:
                if self._command(b"PING") == b"+PONG":
                    return self
            except OSError:
                pass
            time.sleep(0.02)  # polling until it answers, bounded by the deadline
        text = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer within {self.start_timeout} s: {text}")

    def flushdb(self) -> None:
        """Empties database 0 (FLUSHDB): what the pytest plugin does before each test."""
        reply = self._command(b"FLUSHDB")
        if reply != b"+OK":
            raise RuntimeError(f"FLUSHDB answered {reply!r}")

    def _command(self, name: bytes) -> bytes:
        """Sends one argument-less command over the socket; returns the reply's first line."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(2.0)
            connection.connect(self.unix_path)
            connection.sendall(b"*1\r\n$%d\r\n%s\r\n" % (len(name), name))
            reply = b""
            while not reply.endswith(b"\r\n"):
                chunk = connection.recv(256)
                if not chunk:
                    break
                reply += chunk
        return reply.split(b"\r\n", 1)[0]

    def stop(self) -> None:
        """Ends the server (SIGTERM to its pid, SIGKILL after 10 s) and removes its directory."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(10)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> ThrowawayRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ThrowawayRedis(url={self.url if self.directory else None!r}, pid={self.pid})"


class LimiterFactory:
    """Makes limiters on one Redis with a test's defaults, and closes them all in close().

    rate_limiter(**options) and async_rate_limiter(**options) take the limiters' own keyword
    arguments; the defaults are `url` (this factory's), `key_prefix` (this factory's) and
    `clock="client"`, so that a running ManualClock moves their time."""

    def __init__(self, url: str, *, key_prefix: str = "ratelimit") -> None:
        self.url = url
        self.key_prefix = key_prefix
        self._limiters: list[RateLimiter] = []
        self._async_limiters: list[AsyncRateLimiter] = []

    @classmethod
    def with_fresh_prefix(cls, url: str) -> LimiterFactory:
        """A factory whose limiters use a key prefix no other factory uses: their keys cannot
        meet another test's on a shared Redis that nobody flushes."""
        return cls(url, key_prefix=f"ratelimit-test-{uuid.uuid4().hex[:12]}")

    def _options(self, options: dict[str, Any]) -> dict[str, Any]:
        return {"key_prefix": self.key_prefix, "clock": "client", **options}

    def rate_limiter(self, url: str | None = None, **options: Any) -> RateLimiter:
        """A RateLimiter (blocking) on `url`, else this factory's Redis."""
        limiter = RateLimiter(url or self.url, **self._options(options))
        self._limiters.append(limiter)
        return limiter

    def async_rate_limiter(self, url: str | None = None, **options: Any) -> AsyncRateLimiter:
        """An AsyncRateLimiter on `url`, else this factory's Redis."""
        limiter = AsyncRateLimiter(url or self.url, **self._options(options))
        self._async_limiters.append(limiter)
        return limiter

    def close(self) -> None:
        """Closes every limiter it made (an async one on a loop of its own: the loops the test
        ran it on have closed their connections as they shut down)."""
        limiters, self._limiters = self._limiters, []
        async_limiters, self._async_limiters = self._async_limiters, []
        try:
            for limiter in limiters:
                limiter.close()
        finally:  # one that fails to close leaves none of the others open
            left = [limiter for limiter in async_limiters if not limiter.closed]
            if left:
                asyncio.run(_close_all(left))


async def _close_all(limiters: list[AsyncRateLimiter]) -> None:
    for limiter in limiters:
        await limiter.aclose()
