"""A reply lost to a broken connection is replayed once, and never counts a request twice.

A TCP proxy on loopback sits between the limiter and a real redis-server. On its first
connection it forwards the request, lets Redis run the script (so the request IS logged),
then swallows the reply and drops the connection: the client cannot know whether its
request counted. The limiter replays once on a fresh connection with the script's replay
marker and the same member, and the script answers "already counted". Without the marker
the replay would be judged as a new request against a window that already holds it: with
limit 1 it would be rejected although the request was allowed and logged.

The limiter tests run for every limiter kind (tests/conftest.py).
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from typing import Any

import pytest
import redis

from fake_redis import read_commands
from genai_ratelimit import SCRIPT_SHA1, RateLimiterUnavailable, _native
from helpers_async import LimiterFactory
from helpers_core import logged, logged_entries, window_script


def reply_end(buf: bytes | bytearray, pos: int = 0) -> int | None:
    """Where the RESP2 reply starting at pos ends, or None when it is not complete yet."""
    line_end = buf.find(b"\r\n", pos)
    if line_end < 0:
        return None
    kind, head = buf[pos:pos + 1], buf[pos + 1:line_end]
    if kind in (b"+", b"-", b":"):
        return line_end + 2
    if kind == b"$":
        length = int(head)
        end = line_end + 2 + max(length, 0) + (2 if length >= 0 else 0)
        return end if len(buf) >= end else None
    if kind == b"*":
        cursor: int | None = line_end + 2
        for _ in range(max(int(head), 0)):
            cursor = reply_end(buf, cursor)  # type: ignore[arg-type]
            if cursor is None:
                return None
        return cursor
    raise ValueError(f"not a RESP2 reply: {bytes(buf[pos:pos + 20])!r}")


class ReplyDroppingProxy:
    """Forwards loopback TCP to Redis; the first `drop` connections lose their first
    script reply (EVALSHA's), after Redis ran the script."""

    def __init__(self, target_port: int, drop: int = 1) -> None:
        self.target_port = target_port
        self.drop = drop
        self.connections = 0
        self.dropped_replies: list[bytes] = []
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._accept_loop, daemon=True)
        self.thread.start()

    def _accept_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                continue
            self.connections += 1
            lose_reply = self.connections <= self.drop
            threading.Thread(target=self._serve, args=(client, lose_reply), daemon=True).start()

    def _serve(self, client: socket.socket, lose_reply: bool) -> None:
        """Forwards one request at a time and its one reply; on a connection that loses a
        reply, the script's (EVALSHA's) reply is swallowed and the connection dropped, once
        Redis has run it. The replies before it (the handshake's INFO) pass: a client that
        wrote them in one go still hears of them, however TCP split the bytes."""
        upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
        client.settimeout(0.2)
        pending = bytearray()
        try:
            for args, raw, _ in read_commands(client, self.stopping.is_set):
                upstream.sendall(raw)
                while (end := reply_end(pending)) is None:
                    data = upstream.recv(65536)
                    if not data:
                        return
                    pending += data
                reply = bytes(pending[:end])
                del pending[:end]
                if lose_reply and args[0].upper() == b"EVALSHA":
                    # Redis ran the script; the client never hears of it.
                    self.dropped_replies.append(reply)
                    return
                client.sendall(reply)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()

    def close(self) -> None:
        self.stopping.set()
        self.listener.close()
        self.thread.join(5)


@pytest.fixture
def redis_port(redis_url: str) -> int:
    port = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs.get("port")
    if not isinstance(port, int):
        pytest.fail(f"this test needs a TCP Redis URL, got {redis_url!r}")
    return port


def _check_once(make_limiter: LimiterFactory, url: str, user: str, limit: int) -> tuple[bool, int, int]:
    """One check by a fresh limiter of the kind under test, closed right after."""
    with make_limiter(url) as limiter:
        return limiter.check(user, limit, 60)  # type: ignore[no-any-return]


def test_lost_reply_is_replayed_and_counted_once(make_limiter: LimiterFactory, redis_client: redis.Redis,
                                                 redis_port: int, user_id: str, storage: str) -> None:
    redis_client.script_load(window_script(storage)[1])
    proxy = ReplyDroppingProxy(redis_port, drop=1)
    try:
        result = _check_once(make_limiter, f"redis://127.0.0.1:{proxy.port}/0", user_id, 1)
    finally:
        proxy.close()
    key = f"ratelimit:{user_id}:60"
    # The first attempt really ran on the server and logged the request ...
    assert len(proxy.dropped_replies) == 1
    assert proxy.dropped_replies[0].startswith(b"*8\r\n:1\r\n" if storage == "compact"
                                               else b"*7\r\n:1\r\n")
    # ... and the replay answered "allowed" without logging it a second time.
    assert result == (True, 0, 0)
    assert logged_entries(redis_client, key) == 1


def test_replay_marker_without_a_logged_member_decides_normally(redis_client: redis.Redis,
                                                               user_id: str) -> None:
    """When the first attempt never reached the script, the replay is an ordinary decision."""
    redis_client.script_load(_native.SCRIPT_SOURCE)
    key = f"ratelimit:{user_id}:60"
    reply = redis_client.evalsha(SCRIPT_SHA1, 3, key, f"{key}:w", f"{key}:t",
                                 "11111111-1111-4111-8111-111111111111", "", 60000, 2, 1, "1")
    assert reply == [1, 1, 0, 1, reply[4], [1], 0]
    assert logged_entries(redis_client, key) == 1
    # The same member replayed again is recognised and not logged twice.
    reply = redis_client.evalsha(SCRIPT_SHA1, 3, key, f"{key}:w", f"{key}:t",
                                 "11111111-1111-4111-8111-111111111111", "", 60000, 2, 1, "1")
    assert reply == [1, 1, 0, 1, reply[4], [1], 0]
    assert logged_entries(redis_client, key) == 1


def test_second_lost_reply_raises_unavailable(make_limiter: LimiterFactory, redis_client: redis.Redis,
                                              redis_port: int, user_id: str, storage: str) -> None:
    """Only one replay: when the replay's reply is lost too, the caller hears of it."""
    redis_client.script_load(window_script(storage)[1])
    proxy = ReplyDroppingProxy(redis_port, drop=2)
    try:
        with pytest.raises(RateLimiterUnavailable):
            _check_once(make_limiter, f"redis://127.0.0.1:{proxy.port}/0", user_id, 5)
    finally:
        proxy.close()
    assert len(proxy.dropped_replies) == 2
    # Both attempts reached the script, yet the request is logged once.
    assert logged_entries(redis_client, f"ratelimit:{user_id}:60") == 1


def test_a_replayed_reserve_names_its_first_entry_so_reconcile_finds_it(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis, redis_port: int,
        user_id: str, storage: str) -> None:
    """The replay answers with the time (and tie) the first attempt logged, not its own: the
    Reservation names the entry that is in Redis (before, its time was the replay's, and
    reconcile found nothing)."""
    redis_client.script_load(window_script(storage)[1])
    proxy = ReplyDroppingProxy(redis_port, drop=1)
    try:
        with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as limiter:
            r = limiter.reserve(user_id, token_windows=[(1000, 60)], tokens=100)
    finally:
        proxy.close()
    assert len(proxy.dropped_replies) == 1 and r.allowed
    [(at, cost)] = logged(redis_client, f"ratelimit:{user_id}:60:tokens")
    assert (r.timestamp_ms, cost) == (at, 100)
    with make_limiter(redis_url) as limiter:
        assert limiter.reconcile(r, 40) == 1
    assert logged(redis_client, f"ratelimit:{user_id}:60:tokens") == [(at, 40)]


# ----------------------------------------- what a replayed release and reconcile answer
# They are idempotent by themselves, so a replay after a lost reply does no harm; but it
# answers what it finds, and the first attempt already did the work: a replayed release
# answers False, a replayed reconcile(r, 0) answers 0 (README: "Answers of a replay").


def test_a_replayed_release_answers_false_and_the_slot_is_free(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis, redis_port: int,
        user_id: str) -> None:
    with make_limiter(redis_url) as direct:
        lease = direct.acquire(user_id, 1, 300)  # loads the lease script: no NOSCRIPT below
    assert lease.allowed
    proxy = ReplyDroppingProxy(redis_port, drop=1)
    try:
        with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as limiter:
            answer = limiter.release(lease)
    finally:
        proxy.close()
    assert len(proxy.dropped_replies) == 1, "premise: the first attempt's reply was lost"
    assert proxy.dropped_replies[0].startswith(b"*6\r\n:1\r\n"), "the first attempt released it"
    assert answer is False
    assert redis_client.exists(f"ratelimit:{user_id}:leases") == 0


def test_a_replayed_reconcile_to_zero_answers_zero_and_the_entry_is_gone(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis, redis_port: int,
        user_id: str) -> None:
    with make_limiter(redis_url) as direct:
        r = direct.reserve(user_id, [(5, 60)], cost=3)
        direct.reconcile(r, 3)  # loads the reconcile script: no NOSCRIPT below
    proxy = ReplyDroppingProxy(redis_port, drop=1)
    try:
        with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as limiter:
            answer = limiter.reconcile(r, 0)
    finally:
        proxy.close()
    assert len(proxy.dropped_replies) == 1, "premise: the first attempt's reply was lost"
    assert proxy.dropped_replies[0] == b":1\r\n", "the first attempt found and removed the entry"
    assert answer == 0
    assert logged_entries(redis_client, f"ratelimit:{user_id}:60") == 0


# --------------------------------------------------------- the replay marker's window
# The script's replay marker looks for the member in the longest window, where it lives
# longest.


def evalsha(client: redis.Redis, sha: str, keys: list[str], member: str, now_ms: int,
            windows: list[tuple[int, int]], replay: bool = False) -> list[int]:
    """Runs the script as the limiter does: KEYS shortest window first, then their weights
    and their running totals;
    ARGV member, the request time, (window_ms, limit, cost 1) per window, and the optional
    replay marker."""
    argv: list[Any] = [member, now_ms]
    for seconds, limit in windows:
        argv += [seconds * 1000, limit, 1]
    if replay:
        argv.append("1")
    weights = [f"{key}:w" for key in keys]
    totals = [f"{key}:t" for key in keys]
    return client.evalsha(sha, 3 * len(keys), *keys, *weights, *totals, *argv)  # type: ignore[no-any-return]


def test_replay_finds_its_member_in_the_longest_window_after_the_shortest_expired_it(
        redis_client: redis.Redis, user_id: str) -> None:
    from genai_ratelimit import _native

    sha = redis_client.script_load(_native.SCRIPT_SOURCE)
    windows = [(1, 5), (3600, 1)]
    keys = [f"ratelimit:{user_id}:1", f"ratelimit:{user_id}:3600"]
    first, other = str(uuid.uuid4()), str(uuid.uuid4())
    t0 = int(time.time() * 1000)

    assert evalsha(redis_client, sha, keys, first, t0, windows)[0] == 1
    # Rejected by the hour window; on its way it trimmed `first` out of the 1 s window.
    assert evalsha(redis_client, sha, keys, other, t0 + 1200, windows)[0] == 0
    assert redis_client.zscore(keys[0], first) is None
    state = [redis_client.zrange(key, 0, -1, withscores=True) for key in keys]

    reply = evalsha(redis_client, sha, keys, first, t0 + 1300, windows, replay=True)

    assert reply[0] == 1, (
        f"the replay of a request the hour window still counts was answered {reply}: the "
        "script looked for it in the shortest window only")
    assert [redis_client.zrange(key, 0, -1, withscores=True) for key in keys] == state


@pytest.mark.storages("zset", reason="budgets keep no window log: the storage does not apply")
def test_a_replayed_budget_hold_and_settle_count_once(make_limiter: LimiterFactory,
                                                      redis_client: redis.Redis,
                                                      redis_port: int) -> None:
    """A hold whose reply was lost is replayed with the same hold id: it answers allowed and
    holds nothing more; a settle whose reply was lost is replayed and charges once."""
    from genai_ratelimit import Budget

    redis_client.script_load(_native.BUDGET_HOLD_SOURCE)
    redis_client.script_load(_native.BUDGET_SETTLE_SOURCE)
    budget = Budget("org", "daily", 100, "day", "Europe/Paris")
    proxy = ReplyDroppingProxy(redis_port, drop=1)
    try:
        with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as limiter:
            hold = limiter.hold_budgets(budget, 60)
    finally:
        proxy.close()
    assert len(proxy.dropped_replies) == 1 and proxy.dropped_replies[0].startswith(b"*7\r\n:1\r\n")
    assert hold.allowed and hold.periods[0].remaining == 40
    key = f"ratelimit:org:{hold.periods[0].period_start_ms}:budget=daily"
    assert int(redis_client.hget(key, "held")) == 60
    proxy = ReplyDroppingProxy(redis_port, drop=1)
    try:
        with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as limiter:
            assert limiter.settle_budgets(hold, 45) == 0  # the replay: already settled
    finally:
        proxy.close()
    assert proxy.dropped_replies == [b":1\r\n"]
    assert (int(redis_client.hget(key, "spent")), int(redis_client.hget(key, "held"))) == (45, 0)
