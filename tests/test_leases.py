"""In-flight leases (lua/lease.lua): acquire / release / renew, exact under concurrency, one
script execution each, leases that expire when never released, idempotent release, a renew
that never revives a lost lease, and a lost reply that never takes two slots. Every test runs
for every limiter kind (tests/conftest.py) against a real redis-server; the holders are read
back from Redis."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import redis

from genai_ratelimit import AsyncLease, AsyncRateLimiter, Lease, RateLimiter, _native
from helpers_async import LimiterFactory, LoopFactory, run_async
from helpers_core import commandstats, server_ms, wait_until_server_ms
from test_idempotent_retry import ReplyDroppingProxy, redis_port  # noqa: F401 (a fixture)
from test_production_acl import acl_url, admin  # noqa: F401 (fixtures)
from test_production_faults import servers  # noqa: F401 (a fixture)


def leases_key(user: str) -> str:
    return f"ratelimit:{user}:leases"


def holders(client: redis.Redis, user: str) -> dict[str, float]:
    return {member.decode(): score for member, score in
            client.zrange(leases_key(user), 0, -1, withscores=True)}


def test_acquire_admits_up_to_the_limit_then_refuses(limiter: Any, redis_client: redis.Redis,
                                                     user_id: str) -> None:
    before = server_ms(redis_client)
    leases = [limiter.acquire(user_id, 3, 60) for _ in range(3)]
    assert all(isinstance(lease, Lease) and lease.allowed for lease in leases)
    assert [(lease.held, lease.remaining, lease.retry_after_s) for lease in leases] == [
        (1, 2, 0), (2, 1, 0), (3, 0, 0)]
    stored = holders(redis_client, user_id)
    assert set(stored) == {lease.lease_id for lease in leases}
    for lease in leases:
        uuid.UUID(lease.lease_id, version=4)
        assert stored[lease.lease_id] == lease.expires_at_ms
        assert before + 60_000 <= lease.expires_at_ms <= server_ms(redis_client) + 60_000
    refused = limiter.acquire(user_id, 3, 60)
    assert (refused.allowed, refused.held, refused.remaining, refused.lease_id) == (False, 3, 0, "")
    assert len(holders(redis_client, user_id)) == 3  # a refusal writes nothing
    # The upper bound: until the soonest lease expires; the hint (no history yet: 5 s) below it.
    assert leases[0].expires_at_ms - server_ms(redis_client) <= refused.retry_bound_ms
    assert refused.retry_bound_ms <= leases[0].expires_at_ms - before
    assert (refused.retry_after_ms, refused.retry_after_s) == (5000, 5)


def test_release_frees_the_slot_and_is_idempotent(limiter: Any, redis_client: redis.Redis,
                                                  user_id: str) -> None:
    first = limiter.acquire(user_id, 1, 60)
    assert not limiter.acquire(user_id, 1, 60).allowed
    assert limiter.release(first) is True
    assert limiter.release(first) is False  # released already: nothing more to free
    assert holders(redis_client, user_id) == {}
    second = limiter.acquire(user_id, 1, 60)
    assert second.allowed and second.lease_id != first.lease_id
    assert limiter.release(first) is False  # the old lease never frees the new holder's slot
    assert set(holders(redis_client, user_id)) == {second.lease_id}


def test_release_of_a_refused_lease_sends_nothing(unreachable_limiter: Any) -> None:
    refused = Lease(allowed=False, held=1, remaining=0, retry_after_s=1, retry_after_ms=1000,
                    lease_id="", expires_at_ms=0, user_id="u", limit=1, lease_seconds=5)
    assert unreachable_limiter.release(refused) is False
    assert unreachable_limiter.renew(refused) is False


def test_an_unreleased_lease_expires_after_lease_seconds(limiter: Any, redis_client: redis.Redis,
                                                         user_id: str) -> None:
    lease = limiter.acquire(user_id, 1, 1)
    assert not limiter.acquire(user_id, 1, 1).allowed
    assert 1 <= redis_client.pttl(leases_key(user_id)) <= 1000  # the key goes with its last lease
    wait_until_server_ms(redis_client, lease.expires_at_ms + 1, timeout=5)
    again = limiter.acquire(user_id, 1, 1)
    assert again.allowed and again.held == 1
    assert set(holders(redis_client, user_id)) == {again.lease_id}  # the expired one was trimmed


def test_renew_extends_a_held_lease(limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    lease = limiter.acquire(user_id, 2, 1)
    assert limiter.renew(lease, 30) is True
    assert holders(redis_client, user_id)[lease.lease_id] >= lease.expires_at_ms + 29_000
    assert redis_client.pttl(leases_key(user_id)) > 29_000
    wait_until_server_ms(redis_client, lease.expires_at_ms + 1, timeout=5)
    assert lease.lease_id in holders(redis_client, user_id)  # past its first expiry, still held
    assert limiter.renew(lease) is True  # its own lease_seconds again


def test_renew_never_revives_an_expired_or_released_lease(limiter: Any, redis_client: redis.Redis,
                                                          user_id: str) -> None:
    lease = limiter.acquire(user_id, 1, 1)
    wait_until_server_ms(redis_client, lease.expires_at_ms + 1, timeout=5)
    taker = limiter.acquire(user_id, 1, 60)  # the slot went to someone else
    assert taker.allowed
    assert limiter.renew(lease) is False
    assert set(holders(redis_client, user_id)) == {taker.lease_id}
    assert limiter.release(taker) is True
    assert limiter.renew(taker) is False  # released: not renewed either
    assert holders(redis_client, user_id) == {}


def test_each_user_has_its_own_slots(limiter: Any, user_id: str) -> None:
    assert limiter.acquire(user_id, 1, 60).allowed
    assert limiter.acquire(user_id + ":other", 1, 60).allowed
    assert not limiter.acquire(user_id, 1, 60).allowed


def test_a_smaller_limit_refuses_while_more_are_held(limiter: Any, user_id: str) -> None:
    for _ in range(3):
        assert limiter.acquire(user_id, 3, 60).allowed
    refused = limiter.acquire(user_id, 2, 60)
    assert (refused.allowed, refused.held, refused.remaining) == (False, 3, 0)


@pytest.mark.parametrize(("args", "error", "message"), [
    (("", 1, 5), ValueError, "user_id must not be empty"),
    ((1, 1, 5), TypeError, "user_id must be a str"),
    (("u", 0, 5), ValueError, "limit must be >= 1"),
    (("u", True, 5), TypeError, "limit must be an int"),
    (("u", 1, 0), ValueError, "lease_seconds must be >= 1"),
    (("u", 1, 1.5), TypeError, "lease_seconds must be an int"),
])
def test_bad_acquire_arguments_raise_before_any_io(unreachable_limiter: Any, args: tuple[Any, ...],
                                                   error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        unreachable_limiter.acquire(*args)


def test_release_needs_a_lease(unreachable_limiter: Any) -> None:
    with pytest.raises(TypeError, match="expected a Lease made by acquire"):
        unreachable_limiter.release(("u", "id"))
    forged = Lease(allowed=True, held=1, remaining=0, retry_after_s=0, retry_after_ms=0,
                   lease_id="not-a-uuid", expires_at_ms=1, user_id="u", limit=1, lease_seconds=5)
    with pytest.raises(ValueError, match="lease_id must be a lease's 36-character UUID"):
        unreachable_limiter.release(forged)
    valid = Lease(allowed=True, held=1, remaining=0, retry_after_s=0, retry_after_ms=0,
                  lease_id=str(uuid.uuid4()), expires_at_ms=1, user_id="u", limit=1, lease_seconds=5)
    with pytest.raises(ValueError, match="lease_seconds must be >= 1"):
        unreachable_limiter.renew(valid, 0)


def test_the_kill_switch_grants_every_lease_and_sends_nothing(
        unreachable_limiter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "1")
    lease = unreachable_limiter.acquire("u", 1, 5)
    assert (lease.allowed, lease.held, lease.remaining, lease.lease_id) == (True, 0, 1, "")
    assert unreachable_limiter.acquire("u", 1, 5).allowed
    assert unreachable_limiter.release(lease) is False
    assert unreachable_limiter.renew(lease) is True


def test_concurrent_acquires_admit_exactly_the_limit(make_limiter: LimiterFactory, redis_url: str,
                                                     redis_client: redis.Redis, user_id: str) -> None:
    """40 threads, each with a limiter of its own, race for 7 slots: exactly 7 win."""
    results: list[bool] = []
    lock = threading.Lock()
    start = threading.Barrier(40)

    def contender() -> None:
        with make_limiter(redis_url) as own:
            start.wait(10)
            allowed = own.acquire(user_id, 7, 60).allowed
        with lock:
            results.append(allowed)

    threads = [threading.Thread(target=contender) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 40
    assert results.count(True) == 7
    assert redis_client.zcard(leases_key(user_id)) == 7


def test_an_acquire_whose_reply_was_lost_takes_one_slot(
        make_limiter: LimiterFactory, redis_client: redis.Redis, redis_port: int,  # noqa: F811
        user_id: str) -> None:
    """The reply is lost after Redis admitted the lease: the replay (the same lease id) is
    answered "admitted" again, and only one slot is taken."""
    redis_client.script_load(_native.LEASE_SOURCE)
    proxy = ReplyDroppingProxy(redis_port, drop=1)
    try:
        with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as limiter:
            lease = limiter.acquire(user_id, 2, 60)
    finally:
        proxy.close()
    assert len(proxy.dropped_replies) == 1
    assert proxy.dropped_replies[0].startswith(b"*6\r\n:1\r\n:1\r\n")
    assert (lease.allowed, lease.held) == (True, 1)
    assert set(holders(redis_client, user_id)) == {lease.lease_id}


def test_a_release_whose_reply_was_lost_is_replayed_harmlessly(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        redis_port: int, user_id: str) -> None:  # noqa: F811
    with make_limiter(redis_url) as limiter:
        lease = limiter.acquire(user_id, 2, 60)
        other = limiter.acquire(user_id, 2, 60)
    proxy = ReplyDroppingProxy(redis_port, drop=1)
    try:
        with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as limiter:
            # The first attempt released it; the replay finds it gone (False), nothing else moves.
            assert limiter.release(lease) is False
    finally:
        proxy.close()
    assert len(proxy.dropped_replies) == 1
    assert set(holders(redis_client, user_id)) == {other.lease_id}


def test_the_script_comes_back_after_script_flush(limiter: Any, redis_client: redis.Redis,
                                                  user_id: str) -> None:
    lease = limiter.acquire(user_id, 1, 60)
    redis_client.script_flush()
    assert limiter.release(lease) is True
    assert limiter.acquire(user_id, 1, 60).allowed


def test_the_client_clock_decides_when_asked(make_limiter: LimiterFactory, redis_url: str,
                                             redis_client: redis.Redis, user_id: str) -> None:
    with make_limiter(redis_url, clock="client") as limiter:
        lease = limiter.acquire(user_id, 1, 60)
    assert abs(lease.expires_at_ms - (time.time() * 1000 + 60_000)) < 5_000
    assert holders(redis_client, user_id)[lease.lease_id] == lease.expires_at_ms


# --- the Lease helpers, per limiter type ------------------------------------------------------

@pytest.mark.limiter_kinds("sync", reason="the blocking Lease's `with`; the async one's is below")
def test_a_sync_lease_releases_itself_on_leaving_with(redis_url: str, redis_client: redis.Redis,
                                                      user_id: str) -> None:
    with RateLimiter(redis_url) as limiter:
        with limiter.acquire(user_id, 1, 60) as lease:
            assert lease.allowed and not limiter.acquire(user_id, 1, 60).allowed
            assert lease.renew() is True
        assert holders(redis_client, user_id) == {}
        with pytest.raises(RuntimeError):
            with limiter.acquire(user_id, 1, 60):
                raise RuntimeError("the route failed")
        assert holders(redis_client, user_id) == {}
        lease = limiter.acquire(user_id, 1, 60)
        assert lease.release() is True and lease.release() is False


@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="AsyncLease's coroutine helpers")
def test_an_async_lease_releases_itself_on_leaving_async_with(
        loop_factory: LoopFactory, redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    async def scenario() -> None:
        async with AsyncRateLimiter(redis_url) as limiter:
            async with await limiter.acquire(user_id, 1, 60) as lease:
                assert isinstance(lease, AsyncLease) and lease.allowed
                assert not (await limiter.acquire(user_id, 1, 60)).allowed
                assert await lease.renew() is True
            assert holders(redis_client, user_id) == {}
            lease = await limiter.acquire(user_id, 1, 60)
            with pytest.raises(TypeError, match="async with"):
                with lease:
                    pass
            assert await lease.release() is True and await lease.release() is False
            # Many coroutines of one loop race for 3 slots over pipelined connections.
            won = await asyncio.gather(*(limiter.acquire(user_id, 3, 60) for _ in range(30)))
            assert sum(lease.allowed for lease in won) == 3

    run_async(scenario(), loop_factory)


# --- a server that answers the lease script with nonsense -------------------------------------

@pytest.mark.parametrize("reply", [
    b"*5\r\n:1\r\n:1\r\n:0\r\n:5\r\n:1\r\n",                # too short (the old shape)
    b"*6\r\n:2\r\n:1\r\n:0\r\n:5\r\n:1\r\n:0\r\n",         # ok is not 0/1
    b"*6\r\n:1\r\n:0\r\n:0\r\n:5\r\n:1\r\n:0\r\n",         # admitted, yet nobody holds a slot
    b"*6\r\n:1\r\n:1\r\n:0\r\n:1\r\n:1\r\n:0\r\n",         # admitted, expiring at once
    b"*6\r\n:0\r\n:3\r\n:0\r\n:0\r\n:1\r\n:1000\r\n",      # refused, no wait
    b"*6\r\n:0\r\n:3\r\n:2000\r\n:0\r\n:1\r\n:1000\r\n",   # a hint past the bound
    b"*6\r\n:1\r\n:1\r\n:0\r\n:5\r\n:1\r\n:1000\r\n",      # admitted, with a bound
    b"*6\r\n:1\r\n:1\r\n:0\r\n$2\r\n99\r\n:1\r\n:0\r\n",  # a string where an int goes
], ids=["short", "ok-2", "held-0", "expired", "no-wait", "hint-past-bound",
        "admitted-bound", "string"])
def test_a_nonsense_lease_reply_raises_unavailable(make_limiter: LimiterFactory,
                                                    reply: bytes) -> None:
    from fake_redis import FakeRedis, Reply
    from genai_ratelimit import RateLimiterUnavailable

    fake = FakeRedis(Reply(reply))
    try:
        limiter = make_limiter(fake.url, connect_timeout=1.0, socket_timeout=1.0)
        with pytest.raises(RateLimiterUnavailable, match="script"):
            limiter.acquire("u", 3, 60)
        limiter.close()
    finally:
        fake.close()


# --- a caller cancelled while its acquire is on the server -------------------------------------

async def poll(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Waits (bounded) until condition() holds, letting the loop run in between."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.005)  # polling a condition, bounded


async def cancel_while_paused(redis_client: redis.Redis, call: Coroutine[Any, Any, Any],
                              until_ran: bool = True) -> None:
    """Runs `call` (one script execution that writes) with Redis's writes paused, cancels it
    once its script waits on the server for the pause to end (blocked_clients), then ends
    the pause and (until_ran) waits until the script ran (INFO commandstats). No guessed sleep: CLIENT
    PAUSE holds the script on the server as long as the test needs."""
    redis_client.config_resetstat()
    redis_client.execute_command("CLIENT", "PAUSE", "10000", "WRITE")
    try:
        task = asyncio.ensure_future(call)
        await poll(lambda: int(redis_client.info("clients")["blocked_clients"]) >= 1,
                   "the script waits on the paused server")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        redis_client.execute_command("CLIENT", "UNPAUSE")
    if until_ran:
        await poll(lambda: commandstats(redis_client).get("evalsha", 0) >= 1, "the script ran")


@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="asyncio cancellation")
def test_a_cancelled_acquire_leaves_no_lease(make_limiter: LimiterFactory, redis_url: str,
                                             redis_client: redis.Redis, user_id: str) -> None:
    """Cancelled after its script reached Redis: the script still grants the lease, and the
    limiter releases it once the reply comes (nobody holds it), not lease_seconds later."""
    async def scenario() -> None:
        limiter = make_limiter.native(redis_url)
        await limiter.release(await limiter.acquire(f"warm-{user_id}", 1, 300))  # script loaded
        await cancel_while_paused(redis_client, limiter.acquire(user_id, 1, 300))
        await poll(lambda: holders(redis_client, user_id) == {},
                   "the cancelled acquire's lease is released")
        lease = await limiter.acquire(user_id, 1, 300)
        assert (lease.allowed, lease.held, lease.retry_after_s) == (True, 1, 0)
        await lease.release()

    run_async(scenario(), make_limiter.loop_factory)


@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="asyncio cancellation")
def test_a_lease_of_a_cancelled_acquire_is_released_before_aclose_returns(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        user_id: str) -> None:
    """A service that shuts down right after a cancelled acquire: aclose() lets the release
    go out first."""
    async def scenario() -> None:
        limiter = make_limiter.native(redis_url)
        await limiter.release(await limiter.acquire(f"warm-{user_id}", 1, 300))
        await cancel_while_paused(redis_client, limiter.acquire(user_id, 1, 300),
                                  until_ran=False)
        await limiter.aclose()
        assert holders(redis_client, user_id) == {}

    run_async(scenario(), make_limiter.loop_factory)
# --- the refusal's hint: when a slot is likely to free (lib/lease.lua) -----------------------
#
# The stats hash beside the leases ({prefix}:{user}:leases:stats) keeps each held lease's start
# and decayed means of the hold times released leases had and of their squares (hold_ms,
# hold_sq, over `holds`): the expected hold of a request found in flight is hold_sq / hold_ms.
# The tests set the history and the starts in Redis (a way to control time without waiting):
# the hint is the expected hold less how long the oldest held request has run, at least a
# quarter of it and 1 s, at most 60 s and the soonest lease's expiry; 5 s with no history.

def stats_key(user: str) -> str:
    return f"ratelimit:{user}:leases:stats"


def set_history(client: redis.Redis, user: str, hold_ms: int, holds: int = 4) -> None:
    """A history of holds that all lasted hold_ms."""
    client.hset(stats_key(user), mapping={"hold_ms": hold_ms, "hold_sq": hold_ms ** 2,
                                          "holds": holds})


def decayed(holds: list[float]) -> tuple[float, float]:
    """lib/lease.lua's decayed means of `holds` and of their squares (weights 1/n, then 1/4)."""
    mean = square = 0.0
    for n, hold in enumerate(holds, 1):
        weight = 1 / min(n, 4)
        mean += (hold - mean) * weight
        square += (hold * hold - square) * weight
    return mean, square


def started(client: redis.Redis, user: str, lease: Lease, ago_ms: int) -> int:
    """Makes `lease` look started `ago_ms` before the server's now; returns that start."""
    start = server_ms(client) - ago_ms
    client.hset(stats_key(user), lease.lease_id, start)
    return start


def test_a_refusal_with_no_history_hints_five_seconds_and_tells_the_bound(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    held = limiter.acquire(user_id, 1, 60)
    refused = limiter.acquire(user_id, 1, 60)
    assert not refused.allowed
    assert (refused.retry_after_ms, refused.retry_after_s) == (5000, 5)
    # The bound (the soonest lease's expiry) is told apart: a slot is free by then at the latest.
    assert held.expires_at_ms - server_ms(redis_client) <= refused.retry_bound_ms <= 60_000


def test_a_refusal_hints_the_average_hold_less_the_oldest_requests_run(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    leases = [limiter.acquire(user_id, 2, 60) for _ in range(2)]
    set_history(redis_client, user_id, 10_000)
    started(redis_client, user_id, leases[0], 1_000)
    start = started(redis_client, user_id, leases[1], 4_000)  # the oldest: 4 s into 10 s
    refused = limiter.acquire(user_id, 2, 60)
    ran = server_ms(redis_client) - start  # at least 4 s when the script ran, at most this
    assert 10_000 - ran <= refused.retry_after_ms <= 6_000, (refused, ran)
    assert refused.retry_after_s == -(-refused.retry_after_ms // 1000)


@pytest.mark.parametrize(("hold_ms", "ran_ms", "hint_ms"), [
    (10_000, 9_500, 2_500),    # overdue: a quarter of the average, not 0.5 s
    (10_000, 30_000, 2_500),   # long overdue: the same
    (2_000, 1_900, 1_000),     # never below 1 s
    (200_000, 0, 60_000),      # never above 60 s, the longest wait both SDKs act on
], ids=["overdue", "long-overdue", "floor", "ceiling"])
def test_the_hint_is_clamped(limiter: Any, redis_client: redis.Redis, user_id: str,
                             hold_ms: int, ran_ms: int, hint_ms: int) -> None:
    lease = limiter.acquire(user_id, 1, 300)
    set_history(redis_client, user_id, hold_ms)
    started(redis_client, user_id, lease, ran_ms)
    assert limiter.acquire(user_id, 1, 300).retry_after_ms == hint_ms


def test_the_hint_is_never_past_the_soonest_expiry(limiter: Any, redis_client: redis.Redis,
                                                   user_id: str) -> None:
    lease = limiter.acquire(user_id, 1, 2)  # expires within 2 s: a slot is free by then
    set_history(redis_client, user_id, 30_000)
    started(redis_client, user_id, lease, 0)
    refused = limiter.acquire(user_id, 1, 2)
    assert refused.retry_after_ms == refused.retry_bound_ms
    assert 1 <= refused.retry_after_ms <= 2_000


def test_a_release_feeds_its_hold_into_the_decayed_means(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    ran: list[float] = []
    longest: list[float] = []
    for ran_ms in (3_000, 5_000, 8_000, 2_000, 10_000):
        lease = limiter.acquire(user_id, 1, 60)
        start = started(redis_client, user_id, lease, ran_ms)
        assert limiter.release(lease) is True
        ran.append(ran_ms)
        longest.append(server_ms(redis_client) - start)  # the release came before this
        stats = redis_client.hgetall(stats_key(user_id))
        assert lease.lease_id.encode() not in stats  # a released lease's start goes with it
        # Each hold is its start to its release: at least ran_ms, at most what the clock
        # read after the release says.
        (low_mean, low_square), (high_mean, high_square) = decayed(ran), decayed(longest)
        # (± 1: the script's float rounding of the means, not time)
        assert low_mean - 1 <= float(stats[b"hold_ms"]) <= high_mean + 1, (stats, ran, longest)
        assert low_square - 1 <= float(stats[b"hold_sq"]) <= high_square + 1, (stats, ran, longest)
        assert stats[b"holds"] == str(min(len(ran), 4)).encode()
    assert 3_599_000 <= redis_client.pttl(stats_key(user_id)) <= 3_600_000  # an hour idle
    assert limiter.release(lease) is False  # released already: no hold added
    assert redis_client.hget(stats_key(user_id), "hold_ms") == stats[b"hold_ms"]
    # (3,000² + ...)-weighted: the expected hold is above the plain mean (5,875 ms).
    expected = float(stats[b"hold_sq"]) / float(stats[b"hold_ms"])
    assert 7_500 <= expected <= 7_800, expected


def test_slots_given_back_at_once_barely_move_the_expected_hold(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    """A request refused by a window after it took its slot gives it back within
    milliseconds: eight of those after a 12 s stream leave the hint near 12 s (a plain mean
    would fall to a few hundred ms, and the hint to 1 s)."""
    lease = limiter.acquire(user_id, 1, 60)
    first = started(redis_client, user_id, lease, 12_000)
    assert limiter.release(lease) is True
    longest = server_ms(redis_client) - first  # the 12 s hold, as the release measured it
    for _ in range(8):
        assert limiter.release(limiter.acquire(user_id, 1, 60)) is True
    stats = redis_client.hgetall(stats_key(user_id))
    assert float(stats[b"hold_ms"]) < 1_000  # the plain mean
    held = limiter.acquire(user_id, 1, 60)
    start = started(redis_client, user_id, held, 0)
    refused = limiter.acquire(user_id, 1, 60)
    ran = server_ms(redis_client) - start
    assert 11_000 - ran <= refused.retry_after_ms <= longest, (refused, stats)


def test_the_stats_outlive_the_latest_lease_by_an_hour(limiter: Any, redis_client: redis.Redis,
                                                      user_id: str) -> None:
    lease = limiter.acquire(user_id, 2, 300)
    assert 300_000 + 3_599_000 <= redis_client.pttl(stats_key(user_id)) <= 3_900_000
    assert limiter.renew(lease, 600) is True
    assert 600_000 + 3_599_000 <= redis_client.pttl(stats_key(user_id)) <= 4_200_000


def test_an_expired_lease_leaves_no_start_behind(limiter: Any, redis_client: redis.Redis,
                                                 user_id: str) -> None:
    lease = limiter.acquire(user_id, 2, 60)
    assert lease.lease_id.encode() in redis_client.hgetall(stats_key(user_id))
    # Its holder never came back: make it expired, as if lease_seconds had passed.
    redis_client.zadd(leases_key(user_id), {lease.lease_id: server_ms(redis_client) - 1})
    other = limiter.acquire(user_id, 2, 60)
    fields = redis_client.hgetall(stats_key(user_id))
    assert set(fields) == {other.lease_id.encode()}  # no hold recorded: it never ended
    assert limiter.release(lease) is False


def test_reserve_in_flight_refuses_with_the_same_hint(limiter: Any, redis_client: redis.Redis,
                                                      user_id: str) -> None:
    first = limiter.reserve(user_id, [(100, 60)], in_flight=(1, 60))
    assert first.allowed and first.lease is not None
    set_history(redis_client, user_id, 10_000)
    start = started(redis_client, user_id, first.lease, 3_000)
    refused = limiter.reserve(user_id, [(100, 60)], in_flight=(1, 60))
    ran = server_ms(redis_client) - start
    assert not refused.allowed and refused.lease is not None and not refused.lease.allowed
    assert 10_000 - ran <= refused.retry_after_ms <= 7_000, (refused, ran)
    assert refused.lease.retry_after_ms == refused.retry_after_ms
    assert refused.retry_after_s == refused.lease.retry_after_s == 7
    assert first.lease.expires_at_ms - server_ms(redis_client) <= refused.lease.retry_bound_ms <= 60_000


def test_reconcile_with_release_feeds_the_average(limiter: Any, redis_client: redis.Redis,
                                                  user_id: str) -> None:
    reservation = limiter.reserve(user_id, [(100, 60)], token_windows=[(10_000, 60)],
                                  tokens=100, in_flight=(1, 60))
    assert reservation.allowed and reservation.lease is not None
    start = started(redis_client, user_id, reservation.lease, 7_000)
    limiter.reconcile(reservation, 80, release=True)
    longest = server_ms(redis_client) - start  # the release came before this
    stats = redis_client.hgetall(stats_key(user_id))
    assert 7_000 <= float(stats[b"hold_ms"]) <= longest and stats[b"holds"] == b"1"
    assert 7_000 ** 2 <= float(stats[b"hold_sq"]) <= longest ** 2
    assert reservation.lease.lease_id.encode() not in stats


def test_the_documented_acl_user_runs_the_hint(acl_url: Any, admin: redis.Redis,  # noqa: F811
                                               make_limiter: LimiterFactory, user_id: str) -> None:
    """The stats key and the commands the hint needs are within docs/security.md's ACL."""
    limiter = make_limiter(acl_url())
    first = limiter.acquire(user_id, 1, 60)
    admin.select(1)
    start = server_ms(admin) - 2_000
    admin.hset(stats_key(user_id), first.lease_id, start)
    assert limiter.release(first) is True  # a hold of 2 s (and what the calls took): history
    held = limiter.reserve(user_id, [(100, 60)], in_flight=(1, 60))
    assert held.allowed and held.lease is not None
    refused = limiter.acquire(user_id, 1, 60)
    longest_hold = server_ms(admin) - start
    assert not refused.allowed and 1_000 <= refused.retry_after_ms <= longest_hold
    limiter.reconcile(held, 1, release=True)
    assert set(admin.hkeys(stats_key(user_id))) == {b"hold_ms", b"hold_sq", b"holds"}


def test_a_full_redis_still_takes_a_release_and_its_hold(servers: Any,  # noqa: F811
                                                         make_limiter: LimiterFactory,
                                                         user_id: str) -> None:
    """noeviction + maxmemory reached: a release only frees memory, so it must work then too,
    its hold going into the history (its writes come after the ZREM that freed memory); an
    acquire is refused before any write."""
    from genai_ratelimit import RateLimiterUnavailable

    server = servers("--maxmemory-policy", "noeviction")
    client = redis.Redis.from_url(server.url)
    limiter = make_limiter(server.url, connect_timeout=2, socket_timeout=2)
    leases = [limiter.acquire(user_id, 2, 60) for _ in range(2)]
    client.hset(stats_key(user_id), leases[0].lease_id, server_ms(client) - 3_000)
    client.config_set("maxmemory", "1")  # far below what is used: full, whatever is written
    with pytest.raises(RateLimiterUnavailable, match="out of memory"):
        limiter.acquire(user_id, 3, 60)
    assert limiter.release(leases[0]) is True
    stats = client.hgetall(stats_key(user_id))
    assert 3_000 <= float(stats[b"hold_ms"]) <= 3_500 and leases[0].lease_id.encode() not in stats
    assert set(holders(client, user_id)) == {leases[1].lease_id}
    client.close()


@pytest.mark.parametrize("holding", [5, 63, 64, 70])
def test_many_holders_are_counted_expired_and_bounded_alike(
        limiter: Any, redis_client: redis.Redis, user_id: str, holding: int) -> None:
    """Up to 63 leases are read at once with their expiries (one ZRANGE); from 64 on, the
    set is asked instead: the same answers either way."""
    key = leases_key(user_id)
    now = server_ms(redis_client)
    held = {f"00000000-0000-4000-8000-{n:012d}": now + 60_000 + n for n in range(holding)}
    redis_client.zadd(key, {**held, "00000000-0000-4000-8000-ffffffffffff": now - 5})  # expired
    redis_client.hset(f"{key}:stats", "00000000-0000-4000-8000-ffffffffffff", now - 9_000)
    refused = limiter.acquire(user_id, holding, 60)
    assert (refused.allowed, refused.held) == (False, holding)
    assert now + 60_000 - server_ms(redis_client) <= refused.retry_bound_ms <= 60_000
    assert set(holders(redis_client, user_id)) == set(held)  # the expired one dropped
    assert not redis_client.hexists(f"{key}:stats", "00000000-0000-4000-8000-ffffffffffff")
    granted = limiter.acquire(user_id, holding + 1, 120)
    assert (granted.allowed, granted.held) == (True, holding + 1)
    assert 60_000 < redis_client.pttl(key) <= 120_000  # lives as long as its latest lease
    assert limiter.release(granted) is True
    assert redis_client.pttl(key) <= 60_000 + holding + 1
    assert len(holders(redis_client, user_id)) == holding
