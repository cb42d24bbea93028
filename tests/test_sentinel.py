"""Redis Sentinel: redis+sentinel:// on a real master + replica + 3 sentinels
(tests/redis_cluster.py), on both limiters: the master the sentinels name, a SENTINEL
FAILOVER and a SIGKILLed master followed with exact counts, and a replica that answers
READONLY refused by asking the sentinels again. Bounded waits on conditions only."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from fake_redis import parse_command
from genai_ratelimit import RateLimiterError
from helpers_async import LimiterFactory
from redis_cluster import RedisSentinelSet, redis_cli
from redis_server import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.limiter_kinds(
    "sync", "asyncio", reason="uvloop drives the same asyncio code; each failover costs seconds")]

LIMIT = 5


@pytest.fixture(scope="module")
def sentinel_set() -> Iterator[RedisSentinelSet]:
    with RedisSentinelSet() as sentinels:
        yield sentinels


@pytest.fixture
def sentinels(sentinel_set: RedisSentinelSet) -> RedisSentinelSet:
    for node in sentinel_set.data_nodes:
        if node.process is None:  # killed by a test: back, as a replica of the new master
            node.extra_args = ["--repl-diskless-sync-delay", "0", "--replicaof", "127.0.0.1",
                               str(sentinel_set.master_port())]
            node.start(port=node.port)
    master_port = sentinel_set.master_port()
    for node in sentinel_set.data_nodes:
        # A demoted master: the sentinels convert it at their next INFO (up to 10 s); the
        # test does the same at once.
        if node.port != master_port and "role:master" in redis_cli(
                "-p", str(node.port), "info", "replication"):
            redis_cli("-p", str(node.port), "replicaof", "127.0.0.1", str(master_port))
    sentinel_set.wait_ready()
    redis_cli("-p", str(sentinel_set.master_port()), "flushall")
    return sentinel_set


def wait_until(condition: Any, timeout: float, what: str) -> float:
    """Polls condition until true; returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)  # polling a condition, bounded
    return time.monotonic() - started


def zcard(node: RedisServer, key: str) -> int:
    return int(redis_cli("-p", str(node.port), "zcard", key).strip())


def use_then_fail_over(limiter: Any, sentinels: RedisSentinelSet, user: str,
                       fail_over: Any) -> tuple[float, int]:
    """3 allowed checks, replicated; then fail_over(); then checks until one is answered
    (bounded). Returns (seconds until answered, allowed after the failover in total)."""
    old = sentinels.node_at(sentinels.master_port())
    for _ in range(3):
        assert limiter.check(user, LIMIT, 60)[0]
    replica = next(n for n in sentinels.data_nodes if n is not old)
    wait_until(lambda: zcard(replica, f"ratelimit:{user}:60") == 3, 5, "replication")
    started = time.monotonic()
    fail_over(old)
    wait_until(lambda: sentinels.master_port() != old.port, 15, "the sentinels' new master")
    first = None
    while first is None:
        assert time.monotonic() - started < 20, "checks never resumed"
        try:
            first = limiter.check(user, LIMIT, 60)
        except RateLimiterError:
            time.sleep(0.02)  # the failover is under way; bounded above
    resumed = time.monotonic() - started
    allowed = int(first[0])
    while limiter.check(user, LIMIT, 60)[0]:
        allowed += 1
        assert allowed <= LIMIT
    return resumed, allowed


def test_checks_go_to_the_master_the_sentinels_name(make_limiter: LimiterFactory,
                                                    sentinels: RedisSentinelSet) -> None:
    limiter = make_limiter(sentinels.url)
    assert limiter.check("user_8421", LIMIT, 60) == (True, LIMIT - 1, 0)
    master = sentinels.node_at(sentinels.master_port())
    assert zcard(master, "ratelimit:user_8421:60") == 1  # the single-node key shape
    assert "s3cret" not in repr(make_limiter(sentinels.url.replace("//", "//:s3cret@")))


def test_sentinel_failover_moves_the_checks_to_the_new_master(
        make_limiter: LimiterFactory, sentinels: RedisSentinelSet) -> None:
    limiter = make_limiter(sentinels.url)

    resumed, allowed = use_then_fail_over(limiter, sentinels, "user_failover",
                                          lambda old: sentinels.fail_over())
    assert allowed == LIMIT - 3  # exact: nothing lost, nothing counted twice
    print(f"\nSENTINEL FAILOVER: checks resumed after {resumed:.2f} s")


def test_a_killed_master_is_replaced_with_exact_counts(
        make_limiter: LimiterFactory, sentinels: RedisSentinelSet) -> None:
    limiter = make_limiter(sentinels.url)
    resumed, allowed = use_then_fail_over(limiter, sentinels, "user_killed",
                                          lambda old: old.kill())
    assert allowed == LIMIT - 3
    print(f"\nkilled master: checks resumed after {resumed:.2f} s")


class StaleSentinel:
    """A sentinel on loopback whose view is stale: it names `first` (a replica) once, then
    `then` (the master). A real socket; the data nodes are real servers."""

    def __init__(self, first: int, then: int) -> None:
        self.answers = [first]
        self.then = then
        self.asked = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        deadline = time.monotonic() + 30
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._talk, args=(conn, deadline), daemon=True).start()

    def _talk(self, conn: socket.socket, deadline: float) -> None:
        buf = b""
        conn.settimeout(0.2)
        with conn:
            while not self.stop.is_set() and time.monotonic() < deadline:
                try:
                    data = conn.recv(4096)
                except OSError:
                    continue
                if not data:
                    return
                buf += data
                while (parsed := parse_command(buf)) is not None:
                    args, used = parsed
                    buf = buf[used:]
                    if args[0].upper() == b"SENTINEL":
                        port = self.answers.pop(0) if self.answers else self.then
                        self.asked += 1
                        text = str(port).encode()
                        conn.sendall(b"*2\r\n$9\r\n127.0.0.1\r\n$%d\r\n%s\r\n" % (len(text), text))
                    else:  # INFO memory of the handshake
                        conn.sendall(b"$0\r\n\r\n")

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        self.thread.join(5)


def readonly_errors(node: RedisServer) -> int:
    for line in redis_cli("-p", str(node.port), "info", "errorstats").splitlines():
        if line.startswith("errorstat_READONLY:"):
            return int(line.split("count=")[1].strip())
    return 0


def test_a_replica_that_answers_readonly_is_refused(make_limiter: LimiterFactory,
                                                   sentinels: RedisSentinelSet) -> None:
    master = sentinels.node_at(sentinels.master_port())
    replica = next(n for n in sentinels.data_nodes if n is not master)
    stale = StaleSentinel(first=replica.port, then=master.port)
    try:
        before = readonly_errors(replica)
        limiter = make_limiter(f"redis+sentinel://127.0.0.1:{stale.port}/{sentinels.NAME}")
        assert limiter.check("user_readonly", LIMIT, 60) == (True, LIMIT - 1, 0)
        assert readonly_errors(replica) == before + 1  # refused there, nothing written
        assert stale.asked == 2
        assert zcard(master, "ratelimit:user_readonly:60") == 1
    finally:
        stale.close()
