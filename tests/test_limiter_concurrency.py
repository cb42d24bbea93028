"""Exactness under concurrency: callers lined up by a barrier, in threads sharing one limiter
and in processes each with its own (fork and spawn), never let an 11th request through a
limit of 10. Then the window really slides: once it has passed, another 10 are allowed."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
import uuid
from collections import Counter

import pytest

import fake_redis
from helpers_core import (
    RendezvousServer,
    connections_received,
    logged,
    logged_entries,
    process_worker,
    run_lined_up,
    server_ms,
    wait_until_server_ms,
)

# Threads lined up on one blocking limiter, and processes: the blocking limiter's contract.
# The async limiter's concurrency is coroutines on one loop: test_async_concurrency.py.
pytestmark = pytest.mark.limiter_kinds(
    "sync", reason=("callers in threads and processes of the blocking limiter; the async "
                    "limiter's concurrency (coroutines on one loop) is in "
                    "test_async_concurrency.py"))

LIMIT = 10
CALLERS = 20


def fresh_user(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex}"


def assert_exactly_limit_allowed(results: list[tuple[bool, int, int]], limit: int = LIMIT) -> None:
    allowed = [r for r in results if r[0]]
    rejected = [r for r in results if not r[0]]
    assert len(allowed) == limit, results
    assert len(rejected) == len(results) - limit, results
    # Each allowed request saw a different count: the remaining values are limit-1 .. 0.
    assert sorted(r[1] for r in allowed) == list(range(limit))
    assert all(r[1] == 0 and r[2] >= 1 for r in rejected), rejected


def lined_up_checks(limiter, user: str, window_seconds: int, count: int = CALLERS):
    return run_lined_up(count, lambda _: limiter.check(user, LIMIT, window_seconds))


# ------------------------------------------------------------------------ threads

def test_twenty_threads_on_one_user_get_exactly_ten_allowed_every_time(limiter, redis_client):
    for _ in range(40):
        user = fresh_user("threads")
        assert_exactly_limit_allowed(lined_up_checks(limiter, user, 60))
        assert logged_entries(redis_client, f"ratelimit:{user}:60") == LIMIT


def test_twenty_threads_with_their_own_limiters_get_exactly_ten_allowed(redis_url, redis_client):
    from genai_ratelimit import RateLimiter

    limiters = [RateLimiter(redis_url) for _ in range(CALLERS)]
    try:
        for _ in range(20):
            user = fresh_user("own-limiters")
            results = run_lined_up(CALLERS, lambda i, user=user: limiters[i].check(user, LIMIT, 60))
            assert_exactly_limit_allowed(results)
            assert logged_entries(redis_client, f"ratelimit:{user}:60") == LIMIT
    finally:
        for rl in limiters:
            rl.close()


def test_eight_threads_times_500_checks_on_a_shared_user_allow_exactly_the_limit(
        limiter, redis_client, user_id):
    limit, per_thread = 1000, 500

    def hammer(_: int) -> list[tuple[bool, int, int]]:
        return [limiter.check(user_id, limit, 60) for _ in range(per_thread)]

    results = [r for thread_results in run_lined_up(8, hammer, timeout=120) for r in thread_results]
    assert len(results) == 8 * per_thread
    assert_exactly_limit_allowed(results, limit=min(limit, 8 * per_thread))
    assert logged_entries(redis_client, f"ratelimit:{user_id}:60") == limit


def test_eight_threads_times_500_checks_on_their_own_users_are_each_exact(limiter, redis_client):
    limit, per_thread = 300, 500
    users = [fresh_user(f"thread{i}") for i in range(8)]

    def hammer(i: int) -> list[tuple[bool, int, int]]:
        return [limiter.check(users[i], limit, 60) for _ in range(per_thread)]

    for user, results in zip(users, run_lined_up(8, hammer, timeout=120), strict=True):
        # One caller per user: the answers come in order.
        assert [r[:2] for r in results[:limit]] == [(True, limit - 1 - n) for n in range(limit)]
        assert [r[2] for r in results[:limit]] == [0] * limit
        assert all(r[0] is False and r[1] == 0 and r[2] >= 1 for r in results[limit:])
        assert logged_entries(redis_client, f"ratelimit:{user}:60") == limit


def test_concurrent_threads_are_served_on_separate_connections_at_once():
    from genai_ratelimit import RateLimiter

    decision = fake_redis.decision(1, 9, 0, 1)  # allowed, 9 remaining, no retry, window 1
    with RendezvousServer(decision, parallel=2) as server:
        with RateLimiter(server.url, connect_timeout=1, socket_timeout=5) as limiter:
            results = run_lined_up(2, lambda i: limiter.check(f"user-{i}", 10, 60))
        assert results == [(True, 9, 0), (True, 9, 0)]
        assert server.met, "the two checks never waited on the server at the same time"
        assert server.accepted == 2


def test_max_connections_bounds_the_connections_a_limiter_opens(redis_url, redis_client):
    from genai_ratelimit import RateLimiter

    user = fresh_user("bounded")
    with RateLimiter(redis_url, max_connections=2) as limiter:
        before = connections_received(redis_client)
        results = run_lined_up(8, lambda _: [limiter.check(user, 10**6, 60) for _ in range(100)])
        opened = connections_received(redis_client) - before
    flat = [r for per_thread in results for r in per_thread]
    assert sorted(r[1] for r in flat) == list(range(10**6 - 800, 10**6))
    assert 1 <= opened <= 2


def test_a_check_waiting_on_the_network_lets_other_threads_run(private_redis):
    from genai_ratelimit import RateLimiter, RateLimiterUnavailable

    with RateLimiter(private_redis.url, connect_timeout=1, socket_timeout=1) as limiter:
        assert limiter.check("user-1", 10, 60)[0] is True
        outcome: list[object] = []
        started = threading.Event()

        def blocked_check() -> None:
            started.set()
            began = time.monotonic()
            try:
                limiter.check("user-1", 10, 60)
                outcome.append("answered")
            except RateLimiterUnavailable:
                outcome.append(time.monotonic() - began)

        private_redis.pause()
        try:
            thread = threading.Thread(target=blocked_check)
            thread.start()
            started.wait(5)
            longest_gap, last = 0.0, time.monotonic()
            while thread.is_alive():  # this loop needs the GIL between every two readings
                now = time.monotonic()
                longest_gap, last = max(longest_gap, now - last), now
                time.sleep(0.001)
            thread.join()
        finally:
            private_redis.resume()
    assert len(outcome) == 1 and isinstance(outcome[0], float) and outcome[0] >= 0.9, outcome
    assert longest_gap < 0.3, f"the main thread was held for {longest_gap:.3f} s"


# ---------------------------------------------------------------------- processes

def run_processes(context_name: str, url: str, rounds: int) -> list[list[tuple[bool, int, int]]]:
    """CALLERS processes of the given start method, each with its own RateLimiter, make one
    check per round on that round's fresh user, lined up by a barrier. Returns per round
    the results of all processes."""
    ctx = multiprocessing.get_context(context_name)
    users = [fresh_user(f"{context_name}-round{r}") for r in range(rounds)]
    barrier = ctx.Barrier(CALLERS)
    results = ctx.Queue()
    processes = [ctx.Process(target=process_worker,
                             args=(url, users, LIMIT, 60, barrier, results, i))
                 for i in range(CALLERS)]
    for p in processes:
        p.start()
    by_round: list[list[tuple[bool, int, int]]] = [[] for _ in range(rounds)]
    try:
        for _ in range(CALLERS * rounds):
            worker, round_index, result = results.get(timeout=120)
            if round_index < 0:
                raise AssertionError(f"process {worker} failed: {result}")
            by_round[round_index].append(tuple(result))
    except queue.Empty:
        raise AssertionError("the worker processes stopped reporting") from None
    finally:
        for p in processes:
            p.join(30)
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert [p.exitcode for p in processes] == [0] * CALLERS
    return by_round


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_twenty_processes_on_one_user_get_exactly_ten_allowed_every_time(
        start_method, redis_url, redis_client):
    rounds = 25
    by_round = run_processes(start_method, redis_url, rounds)
    for results in by_round:
        assert len(results) == CALLERS
        assert_exactly_limit_allowed(results)
    per_key = Counter(logged_entries(redis_client, key) for key in redis_client.keys("ratelimit:*"))
    assert per_key == {LIMIT: rounds}


# ---------------------------------------------------------- the window slides on

def newest_score(redis_client, key: str) -> int:
    """The newest entry's time, in either storage."""
    return max(at for at, _ in logged(redis_client, key))


def test_after_a_two_second_window_passes_ten_more_are_allowed(limiter, redis_client, user_id):
    key = f"ratelimit:{user_id}:2"
    assert_exactly_limit_allowed(lined_up_checks(limiter, user_id, 2))
    rejected = limiter.check(user_id, LIMIT, 2)
    assert rejected[:2] == (False, 0) and 1 <= rejected[2] <= 2

    # Every entry leaves the window once the server's clock is a full window past the newest.
    wait_until_server_ms(redis_client, newest_score(redis_client, key) + 2_000, timeout=10)
    assert_exactly_limit_allowed(lined_up_checks(limiter, user_id, 2))
    assert logged_entries(redis_client, key) == LIMIT


def test_after_the_honest_retry_time_one_more_request_is_allowed(limiter, redis_client, user_id):
    for _ in range(LIMIT):
        assert limiter.check(user_id, LIMIT, 2)[0] is True
    allowed, _, retry_after_s = limiter.check(user_id, LIMIT, 2)
    asked_at = server_ms(redis_client)
    assert allowed is False
    wait_until_server_ms(redis_client, asked_at + retry_after_s * 1000, timeout=10)
    assert limiter.check(user_id, LIMIT, 2)[0] is True


@pytest.mark.slow
def test_sixty_one_seconds_after_filling_a_minute_ten_more_are_allowed(limiter, redis_client, user_id):
    key = f"ratelimit:{user_id}:60"
    assert_exactly_limit_allowed(lined_up_checks(limiter, user_id, 60))
    assert limiter.check(user_id, LIMIT, 60)[:2] == (False, 0)
    filled_at = newest_score(redis_client, key)

    time.sleep(61)

    assert server_ms(redis_client) >= filled_at + 61_000
    assert_exactly_limit_allowed(lined_up_checks(limiter, user_id, 60))
    assert limiter.check(user_id, LIMIT, 60)[:2] == (False, 0)
