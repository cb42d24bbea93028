"""AsyncRateLimiter under concurrency on one event loop: exact counts with 200 coroutines on
one user, auto-pipelining (checks issued together go out together, on a few connections),
no worker threads, a responsive loop under a burst, and cancellation of in-flight checks
at random points that never leaves a connection out of step."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import uuid

import pytest
import redis

import fake_redis
from genai_ratelimit import AsyncRateLimiter
from helpers_async import (
    LAG_UNDER_ASAN,
    MAX_LOOP_LAG,
    UNDER_ASAN,
    BatchRecordingServer,
    LoopFactory,
    LoopLagProbe,
    run_async,
)
from helpers_core import connections_received, logged_entries
from test_limiter_concurrency import assert_exactly_limit_allowed

# The coroutine API on each event loop: loop_factory is the kind's (tests/conftest.py).
pytestmark = pytest.mark.limiter_kinds(
    "asyncio", "uvloop",
    reason=("coroutines of one AsyncRateLimiter on one running loop; the blocking limiter's "
            "threads are in test_limiter_concurrency.py"))

LIMIT = 10
DECISION = fake_redis.decision(1, 9, 0, 1)  # allowed, 9 remaining, no retry, first window


async def replies_drained(limiter: AsyncRateLimiter, timeout: float = 5.0) -> None:
    """Waits (bounded) until no connection of the limiter on this loop has a reply due."""
    pool = limiter._pool()
    deadline = asyncio.get_running_loop().time() + timeout
    while any(conn.pipeline.pending for conn in pool.connections):
        assert asyncio.get_running_loop().time() < deadline, "replies still due after 5 s"
        await asyncio.sleep(0.001)


def fresh_user(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex}"


def async_limiter(url: str, **kwargs: object):
    from genai_ratelimit import AsyncRateLimiter

    kwargs.setdefault("connect_timeout", 2.0)
    kwargs.setdefault("socket_timeout", 5.0)
    return AsyncRateLimiter(url, **kwargs)


# ------------------------------------------------------------------- exact counts

def test_two_hundred_coroutines_on_one_user_get_exactly_ten_allowed_every_time(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    async def main() -> None:
        async with async_limiter(redis_url) as limiter:
            for _ in range(20):
                user = fresh_user("coroutines")
                results = await asyncio.gather(*(limiter.check(user, LIMIT, 60) for _ in range(200)))
                assert_exactly_limit_allowed(results)
                assert logged_entries(redis_client, f"ratelimit:{user}:60") == LIMIT

    run_async(main(), loop_factory)


def test_two_hundred_coroutines_on_check_windows_get_exactly_the_tighter_budget(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    async def main() -> None:
        async with async_limiter(redis_url) as limiter:
            for _ in range(5):
                user = fresh_user("windows")
                results = await asyncio.gather(
                    *(limiter.check_windows(user, [(LIMIT, 60), (100, 86400)]) for _ in range(200)))
                assert_exactly_limit_allowed([r[:3] for r in results])
                assert {r[3] for r in results} == {60}
                assert logged_entries(redis_client, f"ratelimit:{user}:60") == LIMIT
                assert logged_entries(redis_client, f"ratelimit:{user}:86400") == LIMIT

    run_async(main(), loop_factory)


def test_one_coroutine_per_user_gets_each_users_answers_in_order(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    users = [fresh_user(f"own{i}") for i in range(50)]

    async def one_user(limiter, user: str) -> list[tuple[bool, int, int]]:
        return [await limiter.check(user, 20, 60) for _ in range(25)]

    async def main() -> list[list[tuple[bool, int, int]]]:
        async with async_limiter(redis_url) as limiter:
            return await asyncio.gather(*(one_user(limiter, user) for user in users))

    for user, results in zip(users, run_async(main(), loop_factory), strict=True):
        assert results[:20] == [(True, 19 - n, 0) for n in range(20)]
        assert all(r[:2] == (False, 0) and r[2] >= 1 for r in results[20:])
        assert logged_entries(redis_client, f"ratelimit:{user}:60") == 20


# ------------------------------------------------------------ auto-pipelining

def test_checks_issued_together_reach_the_server_together_on_one_connection(
        loop_factory: LoopFactory) -> None:
    with BatchRecordingServer(DECISION, expected=100) as server:
        async def main() -> list[tuple[bool, int, int]]:
            async with async_limiter(server.url, max_connections=1) as limiter:
                return await asyncio.gather(*(limiter.check(f"user-{i}", 10, 60) for i in range(100)))

        results = run_async(main(), loop_factory)
        assert results == [(True, 9, 0)] * 100
        assert server.connections == 1
        # 100 commands written in one go arrive in one read, or a few when TCP splits them;
        # one write per check would take about a hundred.
        assert server.reads <= 3, f"100 checks took {server.reads} reads on the server"


def test_a_burst_of_a_thousand_checks_uses_at_most_max_connections(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    user = fresh_user("burst")

    async def main() -> None:
        async with async_limiter(redis_url, max_connections=3) as limiter:
            before = connections_received(redis_client)
            for _ in range(3):
                results = await asyncio.gather(*(limiter.check(user, 100_000, 60) for _ in range(1000)))
                assert all(r[0] for r in results)
            opened = connections_received(redis_client) - before
        assert 1 <= opened <= 3
        assert logged_entries(redis_client, f"ratelimit:{user}:60") == 3000

    run_async(main(), loop_factory)


def test_checks_use_no_worker_thread(redis_url: str, redis_client: redis.Redis,
                                     loop_factory: LoopFactory) -> None:
    threads_before = set(threading.enumerate())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(_ExecutorThatFails())
        async with async_limiter(redis_url) as limiter:
            results = await asyncio.gather(*(limiter.check(fresh_user("t"), 10, 60) for _ in range(200)))
            assert results == [(True, 9, 0)] * 200
            assert set(threading.enumerate()) == threads_before

    run_async(main(), loop_factory)


class _ExecutorThatFails(concurrent.futures.ThreadPoolExecutor):
    """A default executor that fails the test if anything is handed to it (run_in_executor,
    to_thread, getaddrinfo of a host name: the limiter's URL here is an IP address)."""

    def submit(self, *args: object, **kwargs: object) -> concurrent.futures.Future:  # type: ignore[override]
        raise AssertionError(f"the limiter used a worker thread: {args!r}")


@pytest.mark.skipif(UNDER_ASAN, reason=LAG_UNDER_ASAN)
def test_the_loop_stays_responsive_under_a_burst_of_checks(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    user = fresh_user("lag")

    async def main() -> None:
        async with async_limiter(redis_url) as limiter:
            await limiter.check(fresh_user("warm-up"), 10, 60)
            async with LoopLagProbe() as probe:
                for _ in range(10):
                    await asyncio.gather(*(limiter.check(user, 100_000, 60) for _ in range(200)))
        assert probe.max_lag < MAX_LOOP_LAG, probe.report()

    run_async(main(), loop_factory)


# ------------------------------------------------------------------ cancellation

async def cancel_after(task: asyncio.Task, iterations: int) -> None:
    """Cancels task after the loop went round `iterations` times."""
    for _ in range(iterations):
        await asyncio.sleep(0)
    task.cancel()


# Loop iterations before a cancel: -1 cancels the task before it ever runs (nothing is
# sent); then while the check is queued, written, waiting for its reply, and after it may
# already have its answer.
CANCEL_POINTS = [-1, -1, 0, 1, 1, 2, 3, 4, 5, 6, 8, 10, 13, 16, 21, 34, 55, 89]


def start_and_cancel_half(limiter, user: str, limit: int, count: int,
                          rng: random.Random) -> tuple[list[asyncio.Task], list[asyncio.Future]]:
    tasks = [asyncio.ensure_future(limiter.check(user, limit, 60)) for _ in range(count)]
    cancellers = []
    for i in rng.sample(range(count), count // 2):
        point = rng.choice(CANCEL_POINTS)
        if point < 0:
            tasks[i].cancel()
        else:
            cancellers.append(asyncio.ensure_future(cancel_after(tasks[i], point)))
    return tasks, cancellers


def split_outcomes(outcomes: list[object]) -> tuple[list[tuple[bool, int, int]], int]:
    completed = [o for o in outcomes if isinstance(o, tuple)]
    cancelled = [o for o in outcomes if isinstance(o, asyncio.CancelledError)]
    others = [o for o in outcomes if not isinstance(o, (tuple, asyncio.CancelledError))]
    assert not others, f"a check failed instead of answering or being cancelled: {others[:3]!r}"
    return completed, len(cancelled)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_cancelling_half_of_500_checks_leaves_the_rest_correct_and_the_connection_in_step(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory, seed: int) -> None:
    huge, count = 1_000_000, 500
    user, after = fresh_user("cancel"), fresh_user("after-cancel")

    async def main() -> None:
        rng = random.Random(seed)
        async with async_limiter(redis_url) as limiter:
            await limiter.check(fresh_user("warm-up"), 10, 60)
            tasks, cancellers = start_and_cancel_half(limiter, user, huge, count, rng)
            await asyncio.gather(*cancellers)
            completed, cancelled = split_outcomes(await asyncio.gather(*tasks, return_exceptions=True))
            assert cancelled >= 1 and len(completed) >= count // 2
            assert len(completed) + cancelled == count

            # Every completed check was allowed, and each saw a different count.
            assert all(r[0] is True and r[2] == 0 for r in completed)
            counts = [huge - r[1] for r in completed]
            assert len(set(counts)) == len(counts)
            # A cancelled check's command may still be on the wire (the tail of a pipeline):
            # count only once every connection has read the reply of everything it sent.
            await replies_drained(limiter)
            counted = logged_entries(redis_client, f"ratelimit:{user}:60")
            # The server counted every check whose command reached it: every completed one,
            # some cancelled ones, never more than were started.
            assert len(completed) <= counted <= count
            assert max(counts) <= counted

            # The same connections, still in step: the next answers are exactly right.
            connections = connections_received(redis_client)
            assert await limiter.check(user, huge, 60) == (True, huge - counted - 1, 0)
            results = await asyncio.gather(*(limiter.check(after, LIMIT, 60) for _ in range(50)))
            assert_exactly_limit_allowed(results)
            assert [await limiter.check(f"{after}-seq", 3, 60) for _ in range(4)][:3] == [
                (True, 2, 0), (True, 1, 0), (True, 0, 0)]
            assert connections_received(redis_client) == connections

    run_async(main(), loop_factory)


def test_cancelling_half_of_500_checks_on_a_small_limit_never_allows_more_than_the_limit(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    user = fresh_user("cancel-small")

    async def main() -> None:
        async with async_limiter(redis_url) as limiter:
            await limiter.check(fresh_user("warm-up"), 10, 60)
            tasks, cancellers = start_and_cancel_half(limiter, user, LIMIT, 500, random.Random(7))
            await asyncio.gather(*cancellers)
            completed, _ = split_outcomes(await asyncio.gather(*tasks, return_exceptions=True))
            allowed = [r for r in completed if r[0]]
            rejected = [r for r in completed if not r[0]]
            # Some allowed checks may have been cancelled after the server counted them, so
            # fewer than LIMIT may come back as allowed, but never more, and never twice the
            # same count.
            assert len(allowed) <= LIMIT
            assert len({r[1] for r in allowed}) == len(allowed)
            assert all(0 <= r[1] < LIMIT for r in allowed)
            assert all(r[1] == 0 and r[2] >= 1 for r in rejected)
            assert logged_entries(redis_client, f"ratelimit:{user}:60") == LIMIT
            assert (await limiter.check(user, LIMIT, 60))[:2] == (False, 0)

    run_async(main(), loop_factory)


def test_a_check_cancelled_while_connecting_does_not_cancel_the_connect_others_wait_for(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    user = fresh_user("connect")

    async def main() -> None:
        async with async_limiter(redis_url) as limiter:
            before = connections_received(redis_client)
            first = asyncio.ensure_future(limiter.check(user, LIMIT, 60))
            second = asyncio.ensure_future(limiter.check(user, LIMIT, 60))
            await asyncio.sleep(0)  # both are now waiting for the first connection
            first.cancel()
            assert await second == (True, LIMIT - 1, 0)
            with pytest.raises(asyncio.CancelledError):
                await first
            assert await limiter.check(user, LIMIT, 60) == (True, LIMIT - 2, 0)
            assert connections_received(redis_client) == before + 1
        assert logged_entries(redis_client, f"ratelimit:{user}:60") == 2

    run_async(main(), loop_factory)


def test_checks_abandoned_by_wait_for_timeouts_leave_the_connection_in_step(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    user, after = fresh_user("wait-for"), fresh_user("after-wait-for")

    async def main() -> None:
        async with async_limiter(redis_url) as limiter:
            await limiter.check(fresh_user("warm-up"), 10, 60)
            outcomes = await asyncio.gather(
                *(asyncio.wait_for(limiter.check(user, 1_000, 60), timeout=0.0005 * (i % 4))
                  for i in range(400)),
                return_exceptions=True)
            connections = connections_received(redis_client)
            timed_out = [o for o in outcomes if isinstance(o, asyncio.TimeoutError)]
            answered = [o for o in outcomes if isinstance(o, tuple)]
            others = [o for o in outcomes if not isinstance(o, tuple)]
            assert len(timed_out) + len(answered) == 400, others[:3]
            assert timed_out, "no check was abandoned: the test proves nothing"
            assert all(r[0] for r in answered)
            counted = logged_entries(redis_client, f"ratelimit:{user}:60")
            assert len(answered) <= counted <= 400
            assert await limiter.check(after, 2, 60) == (True, 1, 0)
            assert await limiter.check(after, 2, 60) == (True, 0, 0)
            assert connections_received(redis_client) == connections

    run_async(main(), loop_factory)
