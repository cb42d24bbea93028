"""Faults of a Redis in production that the first fault matrix missed (issue 16): a full
Redis, an evicting Redis, deadlines that stretch (a busy pool, a NOSCRIPT reload, a resolver
that does not answer) and a replay that lands on a connection that breaks too. Real servers
throughout: redis-server with maxmemory and each policy, a paused or slow fake, a silent DNS
server in a mount namespace of a child process, a proxy that breaks connections one by one."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from fake_redis import ScriptedRedis, decision
from genai_ratelimit import (
    AsyncRateLimiter,
    RateLimiter,
    RateLimiterTimeout,
    RateLimiterUnavailable,
)
from helpers_async import UNDER_ASAN, LimiterFactory, run_async
from helpers_core import (
    SORTED_SET_SHAPE,
    SignalDriver,
    SlowReader,
    assert_a_raising_handler_interrupts_a_blocked_check,
    logged_entries,
)
from redis_server import RedisServer

T = 1.0  # socket_timeout of the deadline tests
MARGIN = 0.45  # what a loaded 2-core machine may add to a deadline


@pytest.fixture
def servers() -> Iterator[Callable[..., RedisServer]]:
    """start(*redis_args): a private redis-server with those arguments, stopped after."""
    started: list[RedisServer] = []

    def start(*args: str) -> RedisServer:
        server = RedisServer(*args)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def entries(client: redis.Redis, key: str) -> list[tuple[bytes, float]]:
    return client.zrange(key, 0, -1, withscores=True)  # type: ignore[no-any-return]


# ------------------------------------------------------------------ a full Redis

def fill_until_out_of_memory(client: redis.Redis) -> None:
    """Writes 64 KiB values until Redis answers OOM (bounded: 4,000 writes)."""
    for i in range(4000):
        try:
            client.set(f"ballast:{i}", b"x" * 65536)
        except redis.exceptions.OutOfMemoryError:
            return
    pytest.fail("Redis never reported OOM: is maxmemory set?")


def test_a_full_redis_refuses_the_check_and_writes_nothing(servers, make_limiter: LimiterFactory):
    """noeviction + maxmemory reached: the check raises, saying Redis is out of memory, and
    the key is left exactly as it was, although the script's trim had an entry to remove
    (before the probe, the trim's write let the ZADD through: every check was admitted)."""
    server = servers("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")
    client = redis.Redis.from_url(server.url)
    user = f"full-{uuid.uuid4().hex[:8]}"
    key = f"ratelimit:{user}:60"
    now_ms = int(time.time() * 1000)
    client.zadd(key, {"expired-entry": now_ms - 120_000, "live-entry": now_ms - 1_000})
    fill_until_out_of_memory(client)
    before = entries(client, key)
    limiter = make_limiter(server.url, connect_timeout=2, socket_timeout=2)
    for _ in range(3):
        with pytest.raises(RateLimiterUnavailable, match="out of memory"):
            limiter.check(user, 10, 60)
    assert entries(client, key) == before
    client.close()


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_a_full_redis_refuses_a_check_over_a_weighted_window_and_writes_nothing(
        servers, make_limiter: LimiterFactory):
    """A weighted window is trimmed before the decision (its weights go with the entries
    leaving): the OOM probe runs before that trim, so a full Redis refuses the check and the
    set and its weights are left exactly as they were."""
    server = servers("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")
    client = redis.Redis.from_url(server.url)
    user = f"full-w-{uuid.uuid4().hex[:8]}"
    key = f"ratelimit:{user}:60"
    now_ms = int(time.time() * 1000)
    client.zadd(key, {"expired-entry": now_ms - 120_000, "live-entry": now_ms - 1_000})
    client.hset(f"{key}:w", mapping={"expired-entry": 3, "": 2})
    fill_until_out_of_memory(client)
    before = (entries(client, key), client.hgetall(f"{key}:w"))
    limiter = make_limiter(server.url, connect_timeout=2, socket_timeout=2)
    with pytest.raises(RateLimiterUnavailable, match="out of memory"):
        limiter.check(user, 10, 60)
    assert (entries(client, key), client.hgetall(f"{key}:w")) == before
    client.close()


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_a_full_redis_answers_a_refusal_which_logs_nothing(servers, make_limiter: LimiterFactory):
    """Over plain windows the check's first write is the entry's ZADD, which Redis refuses
    under OOM: a refusal, which adds nothing, is answered, and the window is unchanged."""
    server = servers("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")
    client = redis.Redis.from_url(server.url)
    user = f"full-r-{uuid.uuid4().hex[:8]}"
    key = f"ratelimit:{user}:60"
    now_ms = int(time.time() * 1000)
    client.zadd(key, {f"live-{i}": now_ms - 1_000 + i for i in range(3)})
    fill_until_out_of_memory(client)
    before = entries(client, key)
    limiter = make_limiter(server.url, connect_timeout=2, socket_timeout=2)
    allowed, remaining, retry_after_s = limiter.check(user, 3, 60)
    assert (allowed, remaining) == (False, 0) and 58 <= retry_after_s <= 60
    assert entries(client, key) == before
    with pytest.raises(RateLimiterUnavailable, match="out of memory"):
        limiter.check(user, 4, 60)  # room for one more: the ZADD is refused
    assert entries(client, key) == before
    client.close()


def test_after_memory_is_freed_the_same_limiter_counts_again(servers, make_limiter: LimiterFactory):
    server = servers("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")
    client = redis.Redis.from_url(server.url)
    fill_until_out_of_memory(client)
    limiter = make_limiter(server.url, connect_timeout=2, socket_timeout=2)
    with pytest.raises(RateLimiterUnavailable, match="out of memory"):
        limiter.check("freed", 10, 60)
    client.flushall()
    assert limiter.check("freed", 10, 60) == (True, 9, 0)
    client.close()


# --------------------------------------------------------------- an evicting Redis

def eviction_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "genai_ratelimit" and "may evict" in r.getMessage()]


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
def test_a_redis_that_may_evict_the_keys_is_named_in_one_warning(
        servers, make_limiter: LimiterFactory, caplog: pytest.LogCaptureFixture, policy: str):
    server = servers("--maxmemory", "64mb", "--maxmemory-policy", policy)
    caplog.set_level(logging.WARNING, logger="genai_ratelimit")
    limiter = make_limiter(server.url)
    for i in range(5):
        assert limiter.check(f"evict-{i}", 10, 60)[0] is True
    warnings = eviction_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert policy in warnings[0] and "noeviction" in warnings[0]


@pytest.mark.parametrize("args", [("--maxmemory", "64mb", "--maxmemory-policy", "noeviction"),
                                  ("--maxmemory-policy", "allkeys-lru")],  # no maxmemory: no eviction
                         ids=["noeviction", "no-maxmemory"])
def test_a_redis_that_never_evicts_gets_no_warning(
        servers, make_limiter: LimiterFactory, caplog: pytest.LogCaptureFixture, args: tuple[str, ...]):
    server = servers(*args)
    caplog.set_level(logging.WARNING, logger="genai_ratelimit")
    limiter = make_limiter(server.url)
    assert limiter.check("no-evict", 10, 60)[0] is True
    assert eviction_warnings(caplog) == []


# ------------------------------------------------------------------------ deadlines

def slow(delay: float, reply: bytes) -> Callable[[list[bytes]], bytes]:
    """An answer that comes `delay` seconds after the command (the server thread waits)."""
    def answer(_: list[bytes]) -> bytes:
        time.sleep(delay)
        return reply
    return answer


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_a_noscript_reload_draws_on_the_calls_deadline(make_limiter: LimiterFactory):
    """NOSCRIPT after 0.6 T, then the reload's answer after 0.6 T more: 1.2 T in all, so the
    check times out at T instead of getting a second T for the reload."""
    queue = [0.6 * T, 0.6 * T]
    replies = [b"-NOSCRIPT No matching script. Please use EVAL.\r\n", decision(1, 9, 0)]

    def answer(args: list[bytes]) -> bytes:
        name = args[0].upper()
        if name == b"EVALSHA":
            time.sleep(queue.pop(0) if queue else 0)
            return replies.pop(0) if replies else decision(1, 9, 0)
        if name == b"SCRIPT":
            return b"$40\r\n%s\r\n" % _sha()
        return b"-ERR not here\r\n"

    with ScriptedRedis(answer) as server:
        limiter = make_limiter(server.url(), connect_timeout=T, socket_timeout=T)
        started = time.monotonic()
        with pytest.raises(RateLimiterTimeout):
            limiter.check("reload", 10, 60)
        elapsed = time.monotonic() - started
    assert elapsed < T + MARGIN, f"the check took {elapsed:.2f} s for a socket_timeout of {T} s"


def _sha() -> bytes:
    from genai_ratelimit import SCRIPT_SHA1

    return SCRIPT_SHA1.encode()


def test_waiting_for_a_busy_pool_and_the_round_trip_share_one_deadline():
    """max_connections=1 and the only connection busy with a check that the server answers
    after 0.9 T: a second check waits for it, and its own round trip would take 0.9 T more.
    Its whole call is bounded by T: it times out instead of answering at about 1.8 T."""
    def answer(args: list[bytes]) -> bytes:
        if args[0].upper() == b"EVALSHA":
            if b"ratelimit:warm:60" not in args:
                time.sleep(0.9 * T)
            return decision(1, 9, 0)
        return b"-ERR not here\r\n"

    with ScriptedRedis(answer) as server:
        with RateLimiter(server.url(), connect_timeout=T, socket_timeout=T,
                         max_connections=1) as limiter:
            assert limiter.check("warm", 10, 60) == (True, 9, 0)  # the one connection
            first = threading.Thread(target=limiter.check, args=("first", 10, 60))
            first.start()
            deadline = time.monotonic() + 5  # until the first check holds the connection
            while not any(b"ratelimit:first:60" in r for r in server.requests):
                assert time.monotonic() < deadline, "the first check never reached the server"
                time.sleep(0.005)
            started = time.monotonic()
            with pytest.raises(RateLimiterTimeout):
                limiter.check("second", 10, 60)
            elapsed = time.monotonic() - started
            first.join(5)
    assert elapsed < T + MARGIN, f"the second check took {elapsed:.2f} s for T = {T} s"


CHILD_RESOLVE = r"""
import sys, time
from genai_ratelimit import RateLimiter, RateLimiterUnavailable
limiter = RateLimiter("redis://redis.unanswered.example:6379/0", connect_timeout=0.5,
                      socket_timeout=0.5)
started = time.monotonic()
try:
    limiter.check("dns", 10, 60)
    print("answered")
except RateLimiterUnavailable as exc:
    print(f"{type(exc).__name__} {time.monotonic() - started:.2f} {exc}")
"""


def test_a_resolver_that_never_answers_is_bounded_by_the_connect_timeout(tmp_path):
    """The child's resolv.conf (bind-mounted in a mount namespace of its own) names a DNS
    server on loopback that reads queries and never answers: getaddrinfo alone would wait
    timeout x attempts (8 s). The check gives up within connect_timeout (0.5 s)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("this test needs root and unshare (util-linux) for a private resolv.conf")
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.77", 53))  # reads nothing, answers nothing
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.77\noptions timeout:4 attempts:2\n")
    child = tmp_path / "child.py"
    child.write_text(CHILD_RESOLVE)
    script = f"mount --bind {resolv} /etc/resolv.conf && exec {sys.executable} {child}"
    try:
        done = subprocess.run(["unshare", "--mount", "--fork", "sh", "-c", script], cwd=tmp_path,
                              capture_output=True, text=True, timeout=30)
    finally:
        silent.close()
    assert done.returncode == 0, done.stderr[-2000:]
    kind, elapsed, message = done.stdout.strip().split(" ", 2)
    assert kind == "RateLimiterTimeout" and "resolving" in message, done.stdout
    assert float(elapsed) < 0.5 + MARGIN, f"resolving took {elapsed} s for connect_timeout 0.5 s"


# -------------------------------------------------------- replays on a fresh connection

class BreakingProxy:
    """A proxy to a real redis-server that holds every reply while `holding`, then breaks
    the held connections one at a time: break_next() closes the oldest one still open and
    waits until the client either sends more requests on one of the others or opens a new
    connection; then the next. Connections opened after break_next() was first called are
    relayed straight through. Bounded: daemon threads, 5 s waits."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.holding = True
        self.held: list[dict[str, Any]] = []
        self.relayed: list[dict[str, Any]] = []  # every connection's sockets, closed by close()
        self.lock = threading.Condition()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(32)
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.opened_after_break = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            with self.lock:
                state = {"client": client, "upstream": upstream, "requests": 0,
                         "held": self.holding}
                self.relayed.append(state)
                if self.holding:
                    self.held.append(state)
                else:
                    self.opened_after_break += 1
                self.lock.notify_all()
            threading.Thread(target=self._up, args=(state,), daemon=True).start()
            threading.Thread(target=self._down, args=(state,), daemon=True).start()

    def _up(self, state: dict[str, Any]) -> None:
        client, upstream = state["client"], state["upstream"]
        try:
            while not self.stop.is_set():
                data = client.recv(65536)
                if not data:
                    return
                upstream.sendall(data)
                with self.lock:
                    state["requests"] += data.count(b"EVALSHA")
                    self.lock.notify_all()
        except OSError:
            return

    def _down(self, state: dict[str, Any]) -> None:
        client, upstream = state["client"], state["upstream"]
        try:
            while not self.stop.is_set():
                data = upstream.recv(65536)
                if not data:
                    return
                if not state["held"]:
                    client.sendall(data)  # a held connection's replies are swallowed
        except OSError:
            return

    def wait_for_held(self, count: int, requests: int) -> None:
        with self.lock:
            assert self.lock.wait_for(
                lambda: len(self.held) >= count and sum(s["requests"] for s in self.held) >= requests,
                timeout=5), f"held {len(self.held)} connections"

    def break_all_one_by_one(self) -> None:
        with self.lock:
            self.holding = False
            victims = list(self.held)
        for victim in victims:
            with self.lock:
                others = [s for s in victims if s is not victim and not s.get("closed")]
                sent_before = {id(s): s["requests"] for s in others}
                opened_before = self.opened_after_break
            victim["closed"] = True
            for name in ("client", "upstream"):
                try:  # shutdown: a FIN now, and the relay threads blocked in recv() wake up
                    victim[name].shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                victim[name].close()

            def reacted(others: list[dict[str, Any]] = others, sent_before: dict[int, int] = sent_before,
                        opened_before: int = opened_before) -> bool:
                return (self.opened_after_break > opened_before
                        or any(s["requests"] > sent_before[id(s)] for s in others))

            with self.lock:  # the client's reaction: a new connection, or more on an old one
                self.lock.wait_for(reacted, timeout=5)

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        with self.lock:
            # The relayed connections too: left to the garbage collector, their sockets warn
            # (ResourceWarning) in whichever later test it runs.
            for state in self.relayed:
                for name in ("client", "upstream"):
                    try:
                        state[name].close()
                    except OSError:
                        pass


@pytest.mark.limiter_kinds("asyncio", "uvloop",
                           reason="two connections with replies pending at once: the async "
                                  "pipeline; the blocking limiter has one call per connection")
def test_checks_of_a_broken_connection_are_replayed_on_a_fresh_one(
        redis_url: str, redis_client: redis.Redis, loop_factory):
    """300 checks in flight on 2 connections, every reply held; then the connections break
    one after the other, the second once the client reacted to the first. Replayed on a
    fresh connection, every check is answered and counted once. Replayed on the sibling
    that broke next (as before), the replays failed: a request is replayed only once."""
    port = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["port"]
    redis_client.script_load(_script_source())  # no NOSCRIPT round trip through the proxy
    proxy = BreakingProxy(port)
    user = f"replay-{uuid.uuid4().hex[:8]}"

    async def main() -> list[Any]:
        async with AsyncRateLimiter(f"redis://127.0.0.1:{proxy.port}/0", max_connections=2,
                                    connect_timeout=5, socket_timeout=5) as limiter:
            loop = asyncio.get_running_loop()
            # 150 on the first connection; with those pending, the next 150 open a second.
            tasks = [asyncio.ensure_future(limiter.check(user, 10**6, 60)) for _ in range(150)]
            await loop.run_in_executor(None, proxy.wait_for_held, 1, 150)
            tasks += [asyncio.ensure_future(limiter.check(user, 10**6, 60)) for _ in range(150)]
            await loop.run_in_executor(None, proxy.wait_for_held, 2, 300)
            await asyncio.get_running_loop().run_in_executor(None, proxy.break_all_one_by_one)
            return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        results = run_async(main(), loop_factory)
    finally:
        proxy.close()
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, f"{len(failures)} of 300 checks failed, e.g. {failures[0]!r}"
    assert all(r[0] is True for r in results)
    assert logged_entries(redis_client, f"ratelimit:{user}:60") == 300


def _script_source() -> str:
    from genai_ratelimit import _native

    return _native.SCRIPT_SOURCE


# ---------------------------------------------- deadlines across signals and slow writes
# A blocking call stays within socket_timeout across signals (EINTR) and a slow write, and a
# signal handler that raises interrupts the call with its exception (PEP 475).


@pytest.fixture
def sigalrm() -> Iterator[None]:
    """Restores SIGALRM's handler after the test (the driver thread is stopped first)."""
    previous = signal.getsignal(signal.SIGALRM)
    try:
        yield
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_signals_during_a_blocked_check_do_not_extend_the_socket_timeout(
        private_redis: RedisServer, sigalrm: None) -> None:
    calls = [0]

    def count(signum: int, frame: Any) -> None:
        calls[0] += 1

    signal.signal(signal.SIGALRM, count)
    with RateLimiter(private_redis.url, connect_timeout=0.5, socket_timeout=0.5) as limiter:
        assert limiter.check("signals-user", 10, 60) == (True, 9, 0)  # pooled, script loaded
        driver = SignalDriver(signal.SIGALRM, interval=0.05, count=60)
        private_redis.pause()
        try:
            driver.start()
            started = time.monotonic()
            try:
                with pytest.raises(RateLimiterTimeout):
                    limiter.check("signals-user", 10, 60)
            finally:
                elapsed = time.monotonic() - started
                driver.stop()
        finally:
            private_redis.resume()
    assert driver.saw_blocked and driver.sent_at, "no signal reached the blocked check"
    assert elapsed < 2.5, (
        f"with a signal every 50 ms the check took {elapsed:.2f} s for a socket_timeout of "
        f"0.5 s ({len(driver.sent_at)} signals sent): every EINTR restarted the full timeout")


def test_signal_handler_exception_interrupts_a_blocked_check(
        private_redis: RedisServer, sigalrm: None) -> None:
    with RateLimiter(private_redis.url, connect_timeout=1.0, socket_timeout=1.0) as limiter:
        assert_a_raising_handler_interrupts_a_blocked_check(
            limiter, private_redis.pause, private_redis.resume)


@pytest.mark.skipif(UNDER_ASAN, reason=(
    "the premise is a write phase between half the timeout and the timeout, timed on the "
    "release build; under ASan the instrumented copies of the 12 MiB command and a loaded "
    "machine stretch it past the timeout (3.3 s measured), so the premise cannot be set up; "
    "the timeout itself is checked there by the other slow-server tests"))
def test_slow_write_and_read_together_stay_within_the_socket_timeout() -> None:
    timeout = 2.0
    # A command far larger than the socket buffers can park (the client's send buffer grows
    # up to tcp_wmem's maximum), so the send blocks until the server reads.
    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        send_buffer_max = int(f.read().split()[2])
    user = "u" * max(12 * 1024 * 1024, 3 * send_buffer_max)
    with SlowReader(hold=1.3) as server:
        with RateLimiter(server.url, connect_timeout=timeout, socket_timeout=timeout) as limiter:
            started = time.monotonic()
            with pytest.raises(RateLimiterTimeout):
                limiter.check(user, 10, 60)
            elapsed = time.monotonic() - started
        assert server.command_read_at is not None, (
            f"the server read only {server.bytes_read} bytes: the write did not complete")
        write_phase = server.command_read_at - started
    assert timeout * 0.5 <= write_phase < timeout, (
        f"premise: the write phase should take well over half the timeout, took {write_phase:.2f} s")
    assert elapsed < timeout * 1.4, (
        f"the check took {elapsed:.2f} s for a socket_timeout of {timeout} s (writing took "
        f"{write_phase:.2f} s of it): the read got a full timeout of its own")
