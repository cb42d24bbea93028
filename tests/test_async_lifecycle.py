"""AsyncRateLimiter's life: the API's shape, aclose() and `async with`, calls after closing,
and use from several event loops (successive asyncio.run calls, threads with loops of their
own), on asyncio's loop and on uvloop."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import redis

from helpers_async import (
    LoopFactory,
    LoopRunner,
    close_and_collect,
    connected_clients,
    run_async,
    wait_for_connected_clients,
)
from helpers_core import connections_received, logged_entries
from test_limiter_concurrency import assert_exactly_limit_allowed

# The coroutine API on each event loop: loop_factory is the kind's (tests/conftest.py).
pytestmark = pytest.mark.limiter_kinds(
    "asyncio", "uvloop",
    reason="aclose(), `async with` and use from several loops are AsyncRateLimiter's own API")


def fresh_user(tag: str = "user") -> str:
    return f"{tag}-{uuid.uuid4().hex}"


def async_limiter(url: str, **kwargs: object):
    from genai_ratelimit import AsyncRateLimiter

    kwargs.setdefault("connect_timeout", 2.0)
    kwargs.setdefault("socket_timeout", 5.0)
    return AsyncRateLimiter(url, **kwargs)


# ------------------------------------------------------------------------ shape

def test_check_and_check_windows_are_coroutine_functions() -> None:
    from genai_ratelimit import AsyncRateLimiter

    assert inspect.iscoroutinefunction(AsyncRateLimiter.check)
    assert inspect.iscoroutinefunction(AsyncRateLimiter.check_windows)
    assert inspect.iscoroutinefunction(AsyncRateLimiter.aclose)


def test_async_limiter_takes_the_same_constructor_arguments_as_the_blocking_one() -> None:
    from genai_ratelimit import AsyncRateLimiter, RateLimiter

    sync_parameters = inspect.signature(RateLimiter.__init__).parameters
    async_parameters = inspect.signature(AsyncRateLimiter.__init__).parameters
    assert list(sync_parameters) == list(async_parameters)
    assert all(sync_parameters[name].kind == async_parameters[name].kind for name in sync_parameters)


def test_constructing_an_async_limiter_needs_no_event_loop_and_dials_nothing(
        redis_url: str, redis_client: redis.Redis) -> None:
    before = connections_received(redis_client)
    limiter = async_limiter(redis_url)  # no running loop here
    assert not limiter.closed
    assert connections_received(redis_client) == before
    run_async(limiter.aclose())


def test_checks_run_on_the_requested_event_loop(redis_url: str, redis_client: redis.Redis,
                                                loop_factory: LoopFactory) -> None:
    probe_loop = loop_factory()
    expected_kind = type(probe_loop)
    probe_loop.close()

    async def main() -> type:
        async with async_limiter(redis_url) as limiter:
            assert await limiter.check(fresh_user(), 10, 60) == (True, 9, 0)
        return type(asyncio.get_running_loop())

    loop_kind = run_async(main(), loop_factory)
    assert loop_kind is expected_kind


def test_uvloop_is_installed_with_the_test_extra() -> None:
    # uvloop is in the `test` extra: a missing uvloop must fail here rather than silently
    # shrink the loop matrix (the uvloop cases are left out when it cannot be imported).
    import uvloop  # noqa: F401


# ------------------------------------------------------------------------ closing

# A check after close (used or never used) raises "closed" and sends nothing:
# test_limiter_faults.py's test_check_after_close_raises_an_error_saying_closed_and_sends_nothing,
# for every kind (aclose() through the blocking adapter's close()).


def test_aclose_twice_is_harmless(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    async def main() -> None:
        limiter = async_limiter(redis_url)
        await limiter.check(fresh_user(), 10, 60)
        await limiter.aclose()
        await limiter.aclose()
        assert limiter.closed

    run_async(main(), loop_factory)


def test_async_with_closes_the_limiter_and_its_connections(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    from genai_ratelimit import RateLimiterError

    clients_before = connected_clients(redis_client)

    async def main() -> None:
        async with async_limiter(redis_url) as limiter:
            await asyncio.gather(*(limiter.check(fresh_user(), 10, 60) for _ in range(300)))
            assert connected_clients(redis_client) > clients_before
        assert limiter.closed
        with pytest.raises(RateLimiterError, match="(?i)closed"):
            await limiter.check("user-1", 10, 60)

    run_async(main(), loop_factory)
    assert wait_for_connected_clients(redis_client, clients_before) == clients_before, \
        "the limiter's connections stayed open after aclose()"


def test_aclose_fails_the_checks_still_waiting_instead_of_leaving_them_hanging(
        private_redis, loop_factory: LoopFactory) -> None:
    from genai_ratelimit import RateLimiterError

    async def main() -> None:
        limiter = async_limiter(private_redis.url)
        await limiter.check("warm-up", 10, 60)
        private_redis.pause()
        try:
            pending = [asyncio.ensure_future(limiter.check(f"user-{i}", 10, 60)) for i in range(20)]
            await asyncio.sleep(0.05)  # sent, waiting for replies that will not come
            started = time.monotonic()
            await limiter.aclose()
            outcomes = await asyncio.gather(*pending, return_exceptions=True)
            assert time.monotonic() - started < 1.0  # not the 5 s socket_timeout
        finally:
            private_redis.resume()
        assert all(isinstance(o, RateLimiterError) and "closed" in str(o) for o in outcomes), outcomes[:3]

    run_async(main(), loop_factory)


def test_aclose_on_one_loop_closes_the_connections_of_another_running_loop(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    clients_before = connected_clients(redis_client)
    limiter = async_limiter(redis_url)
    other = LoopRunner(loop_factory)
    thread = threading.Thread(target=other.loop.run_forever, daemon=True)
    thread.start()
    try:
        answer = asyncio.run_coroutine_threadsafe(limiter.check(fresh_user(), 10, 60), other.loop)
        assert answer.result(10) == (True, 9, 0)
        assert wait_for_connected_clients(redis_client, clients_before) > clients_before
        run_async(limiter.aclose(), loop_factory)  # from this thread's own loop
        assert wait_for_connected_clients(redis_client, clients_before) == clients_before, \
            "aclose() left the other loop's connection open"
    finally:
        other.loop.call_soon_threadsafe(other.loop.stop)
        thread.join(10)
        other.close()


# ------------------------------------------------------------ several event loops

def test_the_same_limiter_keeps_working_under_successive_asyncio_runs(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    limiter = async_limiter(redis_url)
    user = fresh_user("runs")
    try:
        for n in range(5):
            assert run_async(limiter.check(user, 10, 60), loop_factory) == (True, 9 - n, 0)
            assert run_async(limiter.check_windows(user, [(10, 60), (100, 86400)]),
                             loop_factory) == (True, 8 - n, 0, 60)
            # The same check twice per run: the pools of other loops are not confused.
            redis_client.zrem(f"ratelimit:{user}:60", *[m for m, _ in redis_client.zrange(
                f"ratelimit:{user}:60", 0, 0, withscores=True)])
    finally:
        close_and_collect(limiter, loop_factory)


def test_two_threads_with_their_own_loops_share_one_limiter_exactly(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    limiter = async_limiter(redis_url)
    limit, per_thread = 150, 100
    barrier = threading.Barrier(2)
    results: list[list[tuple[bool, int, int]]] = [[], []]
    errors: list[BaseException] = []

    async def burst(user: str) -> list[tuple[bool, int, int]]:
        await limiter.check(fresh_user("warm-up"), 10, 60)  # connect before lining up
        await asyncio.to_thread(barrier.wait, 10)
        return await asyncio.gather(*(limiter.check(user, limit, 60) for _ in range(per_thread)))

    def worker(index: int, user: str) -> None:
        try:
            results[index] = run_async(burst(user), loop_factory)
        except BaseException as exc:
            errors.append(exc)

    try:
        for _ in range(5):
            user = fresh_user("threads")
            threads = [threading.Thread(target=worker, args=(i, user)) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert not errors, errors
            assert_exactly_limit_allowed(results[0] + results[1], limit=limit)
            assert logged_entries(redis_client, f"ratelimit:{user}:60") == limit
    finally:
        close_and_collect(limiter, loop_factory)


def test_a_limiter_used_from_many_successive_loops_keeps_a_bounded_number_of_connections(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    # Like a module-level limiter under a test client that runs each request on a fresh
    # loop: the connections of a loop that is gone must not pile up on the server (issue 5:
    # "a small, bounded number of connections per limiter, never one per request").
    limiter = async_limiter(redis_url, max_connections=2)
    user = fresh_user("loops")
    clients_before = connected_clients(redis_client)
    try:
        for n in range(30):
            assert run_async(limiter.check(user, 100, 60), loop_factory) == (True, 99 - n, 0)
        held = wait_for_connected_clients(redis_client, clients_before + 2, timeout=2.0)
        assert held - clients_before <= 2, (
            f"after 30 successive event loops the limiter holds {held - clients_before} "
            "connections to Redis: those of closed loops are never closed")
    finally:
        close_and_collect(limiter, loop_factory)


CLOSED_LOOPS_PROBE = textwrap.dedent("""
    import asyncio, gc, sys
    from genai_ratelimit import AsyncRateLimiter

    url, kind = sys.argv[1], sys.argv[2]
    if kind == "uvloop":
        import uvloop
        run = uvloop.run
    else:
        run = asyncio.run
    limiter = AsyncRateLimiter(url)
    print(run(limiter.check("probe-user", 10, 60)), flush=True)
    print(run(limiter.check("probe-user", 10, 60)), flush=True)
    run(limiter.aclose())
    gc.collect()
    print("done", flush=True)
""")


def test_a_limiter_used_on_two_loops_then_closed_leaves_no_socket_behind(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory, tmp_path) -> None:
    # The contract's module-level limiter: used under asyncio.run twice (a fresh loop each
    # time), then aclose()d. Run with warnings as errors in a fresh interpreter: an unclosed
    # socket shows as a ResourceWarning (asyncio), and uvloop, warning while it closes its
    # loop, never returns.
    kind = "asyncio" if loop_factory is asyncio.new_event_loop else "uvloop"
    try:
        completed = subprocess.run(
            [sys.executable, "-X", "dev", "-W", "error", "-c", CLOSED_LOOPS_PROBE, redis_url, kind],
            cwd=tmp_path, capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the probe hung for 15 s ({kind}); it printed {exc.stdout!r} {exc.stderr!r}")
    assert completed.stdout.split("\n")[:3] == ["(True, 9, 0)", "(True, 8, 0)", "done"], completed.stderr
    assert completed.returncode == 0, completed.stderr
    assert "ResourceWarning" not in completed.stderr, completed.stderr
