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
    # The upper bound: until the soonest lease expires.
    assert leases[0].expires_at_ms - server_ms(redis_client) <= refused.retry_after_ms
    assert refused.retry_after_ms <= leases[0].expires_at_ms - before
    assert refused.retry_after_s == -(-refused.retry_after_ms // 1000)


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
    assert proxy.dropped_replies[0].startswith(b"*5\r\n:1\r\n:1\r\n")
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
    b"*4\r\n:1\r\n:1\r\n:0\r\n:5\r\n",                      # too short
    b"*5\r\n:2\r\n:1\r\n:0\r\n:5\r\n:1\r\n",                # ok is not 0/1
    b"*5\r\n:1\r\n:0\r\n:0\r\n:5\r\n:1\r\n",                # admitted, yet nobody holds a slot
    b"*5\r\n:1\r\n:1\r\n:0\r\n:1\r\n:1\r\n",                # admitted, expiring at once
    b"*5\r\n:0\r\n:1\r\n:1000\r\n:0\r\n:1\r\n",             # refused below the limit
    b"*5\r\n:0\r\n:3\r\n:0\r\n:0\r\n:1\r\n",                # refused, no wait
    b"*5\r\n:1\r\n:1\r\n:0\r\n$2\r\n99\r\n:1\r\n",          # a string where an int goes
], ids=["short", "ok-2", "held-0", "expired", "refused-below", "no-wait", "string"])
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
