"""min_replicas: an admission counts only once that many replicas acknowledged it (WAIT on
the connection that wrote it). A real master and a real replica (redis-server
--replicaof); the replica frozen with SIGSTOP to make the acknowledgement miss."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis

from genai_ratelimit import RateLimiterUnavailable
from genai_ratelimit._url import parse_redis_url
from helpers_async import LimiterFactory, run_async
from redis_cluster import redis_cli
from redis_server import RedisServer

pytestmark = pytest.mark.limiter_kinds(
    "sync", "asyncio", reason="uvloop drives the same asyncio code")


SERVER_HZ = 100


class Pair:
    def __init__(self) -> None:
        # hz 100: a blocked WAIT's timeout is noticed within 10 ms (SERVER_HZ), not 100.
        self.master = RedisServer("--repl-diskless-sync-delay", "0", "--hz", str(SERVER_HZ))
        self.replica = RedisServer("--repl-diskless-sync-delay", "0")

    def start(self) -> None:
        self.master.start()
        self.replica.extra_args += ["--replicaof", "127.0.0.1", str(self.master.port)]
        self.replica.start()
        deadline = time.monotonic() + 20
        while "master_link_status:up" not in redis_cli("-p", str(self.replica.port), "info",
                                                      "replication"):
            assert time.monotonic() < deadline, "the replica never synced"
            time.sleep(0.02)  # polling a condition, bounded

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.master.port}/0"

    def close(self) -> None:
        self.replica.close()
        self.master.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    servers = Pair()
    try:
        servers.start()
        yield servers
    finally:
        servers.close()


@pytest.fixture
def replicated(pair: Pair) -> Pair:
    redis_cli("-p", str(pair.master.port), "config", "set", "min-replicas-to-write", "0")
    redis_cli("-p", str(pair.master.port), "flushall")
    return pair


def offset(server: RedisServer, field: str) -> int:
    """A replication offset from INFO replication (master_repl_offset, slave_repl_offset):
    storage-agnostic evidence of what the replica holds."""
    for line in redis_cli("-p", str(server.port), "info", "replication").splitlines():
        if line.startswith(field + ":"):
            return int(line.split(":")[1])
    raise AssertionError(f"no {field} in INFO replication")


def keys(server: RedisServer) -> int:
    return int(redis_cli("-p", str(server.port), "dbsize").strip())


def test_an_admission_is_on_the_replica_when_it_is_answered(make_limiter: LimiterFactory,
                                                           replicated: Pair) -> None:
    limiter = make_limiter(replicated.url, min_replicas=1, replica_timeout_ms=1000)
    for i in range(5):
        assert limiter.check("user_acked", 5, 3600) == (True, 4 - i, 0)
        # Answered: the replica holds everything the master wrote up to the answer.
        assert offset(replicated.replica, "slave_repl_offset") >= offset(
            replicated.master, "master_repl_offset")
    assert limiter.check("user_acked", 5, 3600)[0] is False  # a refusal waits for nothing


def test_an_admission_no_replica_acknowledged_is_not_an_admission(
        make_limiter: LimiterFactory, replicated: Pair) -> None:
    limiter = make_limiter(replicated.url, min_replicas=1, replica_timeout_ms=200)
    assert limiter.check("user_unacked", 5, 3600)[0]
    process = replicated.replica.process
    assert process is not None
    process.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(RateLimiterUnavailable, match="not replicated: 0 of the 1 replicas"):
            limiter.check("user_unacked", 5, 3600)
        took = time.monotonic() - started
        assert 0.15 <= took < 1.0  # replica_timeout_ms, not socket_timeout
    finally:
        process.send_signal(signal.SIGCONT)
    # Counted on the master (a refusal that costs the user, never an extra admission).
    assert limiter.check("user_unacked", 5, 3600) == (True, 2, 0)


def test_an_admission_sent_again_after_noscript_waits_for_its_own_replication(
        make_limiter: LimiterFactory, replicated: Pair) -> None:
    """The WAIT goes out in the same write as the admission. When the master lost its
    scripts (SCRIPT FLUSH: a restart, a failover), the engine loads the script and sends the
    admission again, behind that WAIT, which then covers nothing of it: the limiter must
    wait again. A fresh connection (no write of its own yet: its first WAIT is answered at
    once) meets a frozen replica that wakes 0.3 s later: an answer before that would be an
    admission no replica holds."""
    redis_cli("-p", str(replicated.master.port), "script", "flush")
    process = replicated.replica.process
    assert process is not None
    process.send_signal(signal.SIGSTOP)
    woken = threading.Event()

    def wake() -> None:
        process.send_signal(signal.SIGCONT)
        woken.set()

    timer = threading.Timer(0.3, wake)
    timer.start()
    try:
        limiter = make_limiter(replicated.url, min_replicas=1, replica_timeout_ms=5000)
        assert limiter.check("user_reload", 5, 3600) == (True, 4, 0)
        assert woken.is_set(), "answered before the replica could hold the admission"
        assert offset(replicated.replica, "slave_repl_offset") >= offset(
            replicated.master, "master_repl_offset")
    finally:
        timer.cancel()
        process.send_signal(signal.SIGCONT)


def test_more_replicas_than_there_are_is_never_an_admission(make_limiter: LimiterFactory,
                                                           replicated: Pair) -> None:
    limiter = make_limiter(replicated.url, min_replicas=2, replica_timeout_ms=50)
    with pytest.raises(RateLimiterUnavailable, match="1 of the 2 replicas"):
        limiter.check("user_two", 5, 3600)


def test_a_master_that_answers_noreplicas_is_unavailable(make_limiter: LimiterFactory,
                                                        replicated: Pair) -> None:
    redis_cli("-p", str(replicated.master.port), "config", "set", "min-replicas-to-write", "2")
    limiter = make_limiter(replicated.url)
    with pytest.raises(RateLimiterUnavailable, match="NOREPLICAS"):
        limiter.check("user_noreplicas", 5, 3600)
    assert keys(replicated.master) == 0


def test_min_replicas_is_checked(make_limiter: LimiterFactory, replicated: Pair) -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        make_limiter(replicated.url, min_replicas=-1)
    with pytest.raises(ValueError, match="replica_timeout_ms"):
        make_limiter(replicated.url, min_replicas=1, replica_timeout_ms=0)
    with pytest.raises(ValueError, match="contradicts the URL's min_replicas=1"):
        make_limiter(replicated.url + "?min_replicas=1", min_replicas=2)
    with pytest.raises(ValueError, match="min_replicas must be a non-negative integer"):
        make_limiter(replicated.url + "?min_replicas=x")
    with pytest.raises(ValueError, match="replica_timeout_ms must be a positive integer"):
        make_limiter(replicated.url + "?min_replicas=1&replica_timeout_ms=0")


def test_the_url_asks_for_replicated_admissions(make_limiter: LimiterFactory,
                                               replicated: Pair) -> None:
    limiter = make_limiter(replicated.url + "?min_replicas=2&replica_timeout_ms=50")
    with pytest.raises(RateLimiterUnavailable, match="1 of the 2 replicas .* within 50 ms"):
        limiter.check("user_url", 5, 3600)
    sentinel_style = parse_redis_url(
        "redis+sentinel://127.0.0.1:26379/mymaster/0?min_replicas=1&replica_timeout_ms=20")
    assert (sentinel_style.min_replicas, sentinel_style.replica_timeout_ms) == (1, 20)


@pytest.mark.limiter_kinds("sync", reason="runs a page's example in a fresh interpreter")
def test_the_docs_min_replicas_example_runs(replicated: Pair, tmp_path: Path) -> None:
    """docs/failover.md "Replicated admissions": its example, pointed at this master (which
    has a replica), runs as written and admits."""
    from helpers_docs import DOCS, python_blocks

    blocks = python_blocks("## Replicated admissions: `min_replicas`", DOCS / "failover.md")
    assert len(blocks) == 1
    example_url = "redis://10.0.0.5:6379/0"
    assert example_url in blocks[0]
    script = tmp_path / "example.py"
    script.write_text(blocks[0].replace(example_url, replicated.url) + "\nassert allowed\n",
                      encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert keys(replicated.replica) >= 1


CONCURRENT = 30
REPLICA_TIMEOUT_MS = 300
# Redis notices a blocked WAIT's timeout on its next timer event: up to 1/hz late.
WAIT_TIMER_LAG = 1 / SERVER_HZ
# What a loaded 2-core test machine adds to one answer beyond its round trip (the event
# loop's and the scheduler's turns): well under the replica timeout, so an admission that
# queued behind another's WAIT (twice the timeout or more) cannot pass.
SCHEDULING_SLACK = 0.2


@pytest.mark.limiter_kinds("sync", "asyncio",
                           reason="uvloop drives the same asyncio code; sync: one thread each")
def test_concurrent_admissions_each_hear_not_replicated_within_the_replica_timeout(
        make_limiter: LimiterFactory, limiter_kind: str, replicated: Pair) -> None:
    """30 admissions at once meet a frozen replica: each answers "not replicated" within
    replica_timeout_ms plus one round trip, none waits for another's WAIT, none times out
    (the asyncio limiter shares one WAIT among the admissions it writes together)."""
    limiter = make_limiter.native(replicated.url, min_replicas=1,
                                  replica_timeout_ms=REPLICA_TIMEOUT_MS, socket_timeout=1.0)
    process = replicated.replica.process
    assert process is not None

    def outcome(call: Callable[[], Any]) -> tuple[float, BaseException | None]:
        started = time.monotonic()
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - judged below
            return time.monotonic() - started, exc
        return time.monotonic() - started, None

    def warm_up(attempt: Callable[[], Any]) -> None:
        """Connected, and the replica acknowledging (right after its sync, it may take a
        moment longer than REPLICA_TIMEOUT_MS): polled until it does, bounded."""
        deadline = time.monotonic() + 10
        while True:
            try:
                attempt()
                return
            except RateLimiterUnavailable:
                assert time.monotonic() < deadline, "the replica never acknowledged"

    if limiter_kind == "sync":
        warm_up(lambda: limiter.check("user_warm", 1000, 3600))
        started = time.monotonic()
        limiter.ping()
        round_trip = time.monotonic() - started
        process.send_signal(signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(CONCURRENT) as pool:
                outcomes = list(pool.map(lambda i: outcome(
                    lambda: limiter.check(f"user_{i}", 5, 3600)), range(CONCURRENT)))
        finally:
            process.send_signal(signal.SIGCONT)
    else:
        async def timed(i: int) -> tuple[float, BaseException | None]:
            started = time.monotonic()
            try:
                await limiter.check(f"user_{i}", 5, 3600)
            except BaseException as exc:  # noqa: BLE001 - judged below
                return time.monotonic() - started, exc
            return time.monotonic() - started, None

        async def main() -> tuple[float, list[tuple[float, BaseException | None]]]:
            deadline = time.monotonic() + 10
            while True:  # warm_up, awaited
                try:
                    await limiter.check("user_warm", 1000, 3600)
                    break
                except RateLimiterUnavailable:
                    assert time.monotonic() < deadline, "the replica never acknowledged"
            round_trip = await limiter.ping()
            process.send_signal(signal.SIGSTOP)
            try:
                return round_trip, list(await asyncio.gather(*(timed(i)
                                                               for i in range(CONCURRENT))))
            finally:
                process.send_signal(signal.SIGCONT)

        round_trip, outcomes = run_async(main(), make_limiter.loop_factory)
    bound = REPLICA_TIMEOUT_MS / 1000 + WAIT_TIMER_LAG + round_trip + SCHEDULING_SLACK
    errors = [exc for _, exc in outcomes]
    assert all(isinstance(exc, RateLimiterUnavailable) and
               "not replicated: 0 of the 1 replicas" in str(exc) for exc in errors), errors
    slowest = max(took for took, _ in outcomes)
    assert slowest <= bound, (f"the slowest admission answered after {slowest:.3f} s "
                              f"(bound {bound:.3f} s: {REPLICA_TIMEOUT_MS} ms + Redis's timer "
                              f"{WAIT_TIMER_LAG} s + one round trip of {round_trip * 1000:.1f} ms"
                              f" + {SCHEDULING_SLACK} s)")


@pytest.mark.limiter_kinds("asyncio", reason="how the asyncio limiter spreads admissions over "
                                             "its connections; uvloop drives the same code")
def test_admissions_that_arrive_while_a_wait_blocks_the_connection_do_not_queue_behind_it(
        make_limiter: LimiterFactory, replicated: Pair) -> None:
    """WAIT blocks its connection: admissions made while one is out go on another
    connection (opened for them, up to max_connections), each answered within
    replica_timeout_ms plus a connect and a round trip, not after the WAIT ahead of them."""
    limiter = make_limiter.native(replicated.url, min_replicas=1,
                                  replica_timeout_ms=REPLICA_TIMEOUT_MS, socket_timeout=2.0)
    process = replicated.replica.process
    assert process is not None
    master = redis.Redis(port=replicated.master.port)

    async def timed(user: str) -> tuple[float, BaseException | None]:
        started = time.monotonic()
        try:
            await limiter.check(user, 5, 3600)
        except BaseException as exc:  # noqa: BLE001 - judged below
            return time.monotonic() - started, exc
        return time.monotonic() - started, None

    async def main() -> tuple[float, list[tuple[float, BaseException | None]]]:
        deadline = time.monotonic() + 10
        while True:  # connected, and the replica acknowledging (see the test above)
            try:
                await limiter.check("user_warm", 1000, 3600)
                break
            except RateLimiterUnavailable:
                assert time.monotonic() < deadline, "the replica never acknowledged"
        round_trip = await limiter.ping()
        process.send_signal(signal.SIGSTOP)
        try:
            first = asyncio.gather(*(timed(f"user_first_{i}") for i in range(10)))
            while int(master.info("clients")["blocked_clients"]) < 1:  # its WAIT is out
                assert time.monotonic() < deadline, "the first wave's WAIT never blocked"
                await asyncio.sleep(0.002)  # polling a condition, bounded
            second = await asyncio.gather(*(timed(f"user_second_{i}") for i in range(10)))
            await first
            return round_trip, second
        finally:
            process.send_signal(signal.SIGCONT)

    try:
        round_trip, second = run_async(main(), make_limiter.loop_factory)
    finally:
        master.close()
    errors = [exc for _, exc in second]
    assert all(isinstance(exc, RateLimiterUnavailable) and
               "not replicated: 0 of the 1 replicas" in str(exc) for exc in errors), errors
    # A new connection: its connect and handshake, then the admission and its WAIT.
    bound = REPLICA_TIMEOUT_MS / 1000 + WAIT_TIMER_LAG + 3 * round_trip + SCHEDULING_SLACK
    slowest = max(took for took, _ in second)
    assert slowest <= bound, f"the slowest answered after {slowest:.3f} s (bound {bound:.3f} s)"


def test_a_replica_timeout_longer_than_socket_timeout_answers_not_replicated(
        make_limiter: LimiterFactory, replicated: Pair) -> None:
    """WAIT's own time comes on top of socket_timeout (the blocking limiter's rule): a
    frozen replica is "not replicated" after replica_timeout_ms, never a timeout."""
    limiter = make_limiter(replicated.url, min_replicas=1, replica_timeout_ms=800,
                           socket_timeout=0.4)
    deadline = time.monotonic() + 10
    while True:  # connected, and the replica acknowledging
        try:
            limiter.check("user_warm", 1000, 3600)
            break
        except RateLimiterUnavailable:
            assert time.monotonic() < deadline, "the replica never acknowledged"
    process = replicated.replica.process
    assert process is not None
    process.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(RateLimiterUnavailable, match="not replicated: 0 of the 1"):
            limiter.check("user_slow_wait", 5, 3600)
        assert time.monotonic() - started >= 0.8
    finally:
        process.send_signal(signal.SIGCONT)
