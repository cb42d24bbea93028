"""Redis Sentinel: redis+sentinel:// on a real master + replica + 3 sentinels
(tests/redis_cluster.py), on both limiters: the master the sentinels name, a SENTINEL
FAILOVER and a SIGKILLed master followed with exact counts, a replica the sentinels name
refused by ROLE; and the faults of docs/failover.md measured: a planned failover under load
(admissions lost, read back from Redis), a frozen first sentinel, a lying first sentinel.
Bounded waits on conditions only."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from fake_redis import parse_command
from fault_load import Load, allowed_per_user
from genai_ratelimit import RateLimiterError, RateLimiterUnavailable
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


# How long the sentinels may take to agree on a new master: down-after (1 s) and an election,
# and when the first election's votes split under load, a second one after 2 x the
# failover-timeout (10 s): seen in CI at > 15 s with two suites on two cores.
NEW_MASTER_SECONDS = 45
# How long the limiter may take to send checks to the master the sentinels named.
RESUME_SECONDS = 20


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
    wait_until(lambda: sentinels.master_port() != old.port, NEW_MASTER_SECONDS,
               "the sentinels' new master")
    # The limiter's share is bounded from the moment the sentinels name the new master: the
    # election before it may take up to NEW_MASTER_SECONDS on a loaded machine (a bound from
    # `started` left a limiter 1 s after a 19 s election: a CI failure, "checks never
    # resumed" 21.5 s after the kill, with the limiter never at fault).
    named = time.monotonic()
    first = None
    while first is None:
        assert time.monotonic() - named < RESUME_SECONDS, (
            f"checks never resumed: {time.monotonic() - named:.1f} s after the sentinels named "
            f"the new master, {named - started:.1f} s after the failover")
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
    `then` (the master), with config epoch `epoch`. A real socket; the data nodes are real
    servers."""

    def __init__(self, first: int, then: int, epoch: int = 0) -> None:
        self.answers = [first]
        self.then = then
        self.epoch = epoch
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
                        if args[1].upper() == b"MASTER":  # a flat map, as Redis answers
                            words = [b"name", args[2], b"ip", b"127.0.0.1", b"port",
                                     str(port).encode(), b"flags", b"master",
                                     b"config-epoch", str(self.epoch).encode()]
                        else:
                            words = [b"127.0.0.1", str(port).encode()]
                        conn.sendall(b"*%d\r\n" % len(words) + b"".join(
                            b"$%d\r\n%s\r\n" % (len(w), w) for w in words))
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


def test_a_replica_the_sentinels_name_is_refused_by_role(make_limiter: LimiterFactory,
                                                         sentinels: RedisSentinelSet) -> None:
    """A stale sentinel names the replica: ROLE refuses it before any decision is sent
    there (no READONLY, nothing written); the next call follows the master it names."""
    master = sentinels.node_at(sentinels.master_port())
    replica = next(n for n in sentinels.data_nodes if n is not master)
    stale = StaleSentinel(first=replica.port, then=master.port)
    try:
        before = readonly_errors(replica)
        limiter = make_limiter(f"redis+sentinel://127.0.0.1:{stale.port}/{sentinels.NAME}")
        with pytest.raises(RateLimiterUnavailable, match="ROLE as a replica"):
            limiter.check("user_readonly", LIMIT, 60)
        assert limiter.check("user_readonly", LIMIT, 60) == (True, LIMIT - 1, 0)
        assert readonly_errors(replica) == before  # never sent there
        assert zcard(replica, "ratelimit:user_readonly:60") in (0, 1)  # replicated, if at all
        assert zcard(master, "ratelimit:user_readonly:60") == 1
    finally:
        stale.close()


# ------------------------------------------------------------------- faults, measured

def test_a_planned_failover_under_load_loses_at_most_two_admissions_per_user(
        make_limiter: LimiterFactory, sentinels: RedisSentinelSet) -> None:
    """SENTINEL FAILOVER while 8 callers check 20 users as fast as they can: every
    admission the limiter answered must be on the new master afterwards (an admission
    written to the old master after the promotion is lost, a free extra request). The
    truth is read back from Redis: ZCARD of each user's log on the final master."""
    users = [f"user_planned_{i}" for i in range(20)]
    old = sentinels.node_at(sentinels.master_port())
    with Load(make_limiter, sentinels.url, users, limit=1_000_000, window=3600) as load:
        load.wait_for(400)
        started = time.monotonic()
        sentinels.fail_over()
        wait_until(lambda: sentinels.master_port() != old.port, NEW_MASTER_SECONDS,
                   "the sentinels' new master")
        switched = time.monotonic()
        count = len(load.records)
        load.wait_for(count + 400)
    new = sentinels.node_at(sentinels.master_port())
    allowed = allowed_per_user(load.records)
    lost = {u: allowed.get(u, 0) - zcard(new, f"ratelimit:{u}:3600") for u in users}
    errors = [r for r in load.records if isinstance(r[2], Exception)]
    rate = len(load.records) / (load.records[-1][1] - load.records[0][0]) / len(users)
    print(f"\nplanned failover: switch seen {switched - started:.2f} s after SENTINEL FAILOVER; "
          f"{len(load.records)} checks ({rate:.0f} per user per s), {len(errors)} errors; "
          f"admissions lost per user: max {max(lost.values())}, total {sum(lost.values())}")
    assert max(lost.values()) <= 2, (lost, {n.port: zcard(n, f"ratelimit:{users[0]}:3600")
                                            for n in sentinels.data_nodes}, new.port)


class FrozenSentinel:
    """A listening socket that never accepts and never answers: the kernel completes the
    TCP handshake (the backlog), so a client connects and then waits for a reply forever,
    as with a sentinel process that hangs."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.listener.getsockname()[1]

    def close(self) -> None:
        self.listener.close()


def test_a_frozen_first_sentinel_does_not_stop_the_checks(
        make_limiter: LimiterFactory, sentinels: RedisSentinelSet) -> None:
    frozen = FrozenSentinel()
    try:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in sentinels.sentinels)
        url = f"redis+sentinel://127.0.0.1:{frozen.port},{hosts}/{sentinels.NAME}/0"
        limiter = make_limiter(url, socket_timeout=1.0)
        started = time.monotonic()
        slowest = 0.0
        for i in range(30):
            begun = time.monotonic()
            assert limiter.check("user_frozen", 100, 3600) == (True, 100 - 1 - i, 0)
            slowest = max(slowest, time.monotonic() - begun)
        took = time.monotonic() - started
        print(f"\nfrozen first sentinel: 30 checks in {took:.2f} s, slowest {slowest:.3f} s")
        assert slowest < 1.0  # never a whole socket_timeout on the frozen one
        master = sentinels.node_at(sentinels.master_port())
        assert zcard(master, "ratelimit:user_frozen:3600") == 30
    finally:
        frozen.close()


def test_a_lying_first_sentinel_is_outvoted(make_limiter: LimiterFactory,
                                            sentinels: RedisSentinelSet) -> None:
    """The first sentinel names a node that is still writable (a stale old master: here
    the replica, detached for the test) with an old config epoch: the sentinels' agreed
    master gets every admission, the stale node none."""
    master = sentinels.node_at(sentinels.master_port())
    stale_node = next(n for n in sentinels.data_nodes if n is not master)
    epoch = int(dict(zip(*[iter(redis_cli("-p", str(sentinels.sentinels[0].port), "sentinel",
                                          "master", sentinels.NAME).split())] * 2,
                         strict=False))["config-epoch"])
    liar = StaleSentinel(first=stale_node.port, then=stale_node.port, epoch=max(epoch - 1, 0))
    redis_cli("-p", str(stale_node.port), "replicaof", "no", "one")  # writable, like an old master
    # Detached, it keeps what it held: the fixture's FLUSHALL on the master may not have
    # reached it yet (the previous kind's 50 entries were seen there): empty it itself.
    redis_cli("-p", str(stale_node.port), "flushall")
    try:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in sentinels.sentinels)
        limiter = make_limiter(f"redis+sentinel://127.0.0.1:{liar.port},{hosts}/{sentinels.NAME}/0")
        for i in range(50):
            assert limiter.check("user_lied_to", 100, 3600) == (True, 100 - 1 - i, 0)
        assert zcard(stale_node, "ratelimit:user_lied_to:3600") == 0
        assert zcard(master, "ratelimit:user_lied_to:3600") == 50
    finally:
        liar.close()
        redis_cli("-p", str(stale_node.port), "replicaof", "127.0.0.1", str(master.port))
