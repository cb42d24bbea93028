"""AsyncRateLimiter under real faults, driven on a running event loop: a closed port and an
unanswered connect within connect_timeout, a paused server within socket_timeout, a busy
server (DEBUG SLEEP), SCRIPT FLUSH under pipelining, a restarted and a killed server. In
every case the event loop stays responsive: a loop-lag probe runs beside the check.

(The same faults through the blocking interface run for every limiter kind in
test_limiter_faults.py.)"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from helpers_async import LoopFactory, LoopLagProbe, LoopRunner, max_loop_lag, run_async
from helpers_core import (
    FullBacklogListener,
    closed_port_url,
    connections_received,
    logged_entries,
    measured_commands,
)
from redis_server import RedisServer

# The coroutine API on each event loop: loop_factory is the kind's (tests/conftest.py).
pytestmark = pytest.mark.limiter_kinds(
    "asyncio", "uvloop",
    reason=("the event loop's responsiveness while a fault is met; the same faults through "
            "the blocking interface run for every kind in test_limiter_faults.py"))

MARGIN = 0.5     # seconds of slack on top of a configured timeout


def fresh_user(tag: str = "user") -> str:
    return f"{tag}-{uuid.uuid4().hex}"


def async_limiter(url: str, timeout: float = 0.5, **kwargs: object):
    from genai_ratelimit import AsyncRateLimiter

    return AsyncRateLimiter(url, connect_timeout=timeout, socket_timeout=timeout, **kwargs)


async def timed_failure(awaitable) -> tuple[BaseException, float]:
    """Awaits one check that must fail with a RateLimiterError: (exception, seconds)."""
    from genai_ratelimit import RateLimiterError

    started = time.monotonic()
    with pytest.raises(RateLimiterError) as info:
        await awaitable
    return info.value, time.monotonic() - started


@pytest.fixture
def debug_redis() -> Iterator[RedisServer]:
    """A private redis-server that accepts DEBUG SLEEP (off by default since Redis 7)."""
    with RedisServer("--enable-debug-command", "yes") as server:
        yield server


# ------------------------------------------------------------- unreachable server

# One closed port and one check: test_limiter_faults.py's
# test_closed_port_raises_unavailable_within_the_connect_timeout, for every kind (the loop's
# lag measured for the async ones).

def test_concurrent_checks_on_a_closed_port_all_fail_fast(loop_factory: LoopFactory) -> None:
    from genai_ratelimit import RateLimiterUnavailable

    async def main() -> None:
        async with async_limiter(closed_port_url()) as limiter:
            started = time.monotonic()
            outcomes = await asyncio.gather(*(limiter.check(f"user-{i}", 10, 60) for i in range(100)),
                                            return_exceptions=True)
            elapsed = time.monotonic() - started
        assert all(isinstance(o, RateLimiterUnavailable) for o in outcomes), outcomes[:3]
        assert elapsed < 0.5 + MARGIN

    run_async(main(), loop_factory)


def test_unanswered_connect_raises_unavailable_within_the_connect_timeout_without_stalling_the_loop(
        loop_factory: LoopFactory) -> None:
    from genai_ratelimit import RateLimiterUnavailable

    async def main() -> None:
        with FullBacklogListener() as listener:
            async with async_limiter(listener.url, timeout=0.3) as limiter, LoopLagProbe() as probe:
                error, elapsed = await timed_failure(limiter.check("user-1", 10, 60))
        assert isinstance(error, RateLimiterUnavailable)
        assert "connect" in str(error)
        assert 0.2 <= elapsed < 0.3 + MARGIN
        assert probe.max_lag < max_loop_lag(0.3) and probe.wakeups > 10, probe.report()

    run_async(main(), loop_factory)


# ---------------------------------------------------------- paused and busy server

def test_paused_server_raises_timeout_within_the_socket_timeout_and_the_loop_stays_responsive(
        private_redis: RedisServer, loop_factory: LoopFactory) -> None:
    from genai_ratelimit import RateLimiterTimeout

    async def main() -> None:
        async with async_limiter(private_redis.url) as limiter:
            assert await limiter.check("user-1", 10, 60) == (True, 9, 0)
            private_redis.pause()
            try:
                async with LoopLagProbe() as probe:
                    error, elapsed = await timed_failure(limiter.check("user-1", 10, 60))
            finally:
                private_redis.resume()
        assert isinstance(error, RateLimiterTimeout)
        assert "socket_timeout" in str(error)
        assert 0.45 <= elapsed < 0.5 + MARGIN  # it waited for the reply, then gave up in time
        assert probe.max_lag < max_loop_lag(0.5) and probe.wakeups > 20, probe.report()

    run_async(main(), loop_factory)


def test_many_checks_waiting_on_a_paused_server_time_out_together(
        private_redis: RedisServer, loop_factory: LoopFactory) -> None:
    from genai_ratelimit import RateLimiterTimeout

    async def main() -> None:
        async with async_limiter(private_redis.url) as limiter:
            await limiter.check("warm-up", 10, 60)
            private_redis.pause()
            try:
                started = time.monotonic()
                outcomes = await asyncio.gather(*(limiter.check(f"user-{i}", 10, 60) for i in range(200)),
                                                return_exceptions=True)
                elapsed = time.monotonic() - started
            finally:
                private_redis.resume()
        assert all(isinstance(o, RateLimiterTimeout) for o in outcomes), outcomes[:3]
        assert elapsed < 0.5 + MARGIN  # one timeout for the lot, not one after another

    run_async(main(), loop_factory)


def test_after_a_timeout_the_next_check_is_a_fresh_in_step_answer_on_a_new_connection(
        private_redis: RedisServer, loop_factory: LoopFactory) -> None:
    from genai_ratelimit import RateLimiterTimeout

    inspector = redis.Redis(port=private_redis.port)

    async def main() -> None:
        async with async_limiter(private_redis.url) as limiter:
            assert await limiter.check("user-1", 100, 60) == (True, 99, 0)
            private_redis.pause()
            try:
                error, _ = await timed_failure(limiter.check("user-1", 100, 60))
                assert isinstance(error, RateLimiterTimeout)
            finally:
                private_redis.resume()
            connections_before = connections_received(inspector)
            # The late reply to the timed-out check must not be taken for this one's.
            assert await limiter.check("user-2", 100, 60) == (True, 99, 0)
            assert await limiter.check("user-2", 100, 60) == (True, 98, 0)
            # A connection that timed out mid-reply is never reused: a new one was opened.
            assert connections_received(inspector) == connections_before + 1

    try:
        run_async(main(), loop_factory)
    finally:
        inspector.close()


def test_a_check_waiting_on_a_busy_server_does_not_block_the_loop(
        debug_redis: RedisServer, loop_factory: LoopFactory) -> None:
    """Another client keeps the single-threaded server busy (DEBUG SLEEP 1) while a check
    waits: the loop keeps running. Whether the check really waited on the sleeping server is
    not assumed: it is read off the clocks afterwards (the check's answer came after the
    sleep's, and the check was sent at least 0.5 s before the sleep ended); a round where
    the check got in first, or too late, is played again, at most five times."""
    other_client = redis.Redis(port=debug_redis.port)

    async def one_round() -> tuple[tuple[bool, int, int], float, float, float, LoopLagProbe]:
        user = fresh_user()
        slept: list[float] = []

        def sleep_on_the_server() -> None:
            other_client.execute_command("DEBUG", "SLEEP", "1")
            slept.append(time.monotonic())

        async with async_limiter(debug_redis.url, timeout=3.0) as limiter:
            assert await limiter.check(user, 10, 60) == (True, 9, 0)
            sleeper = threading.Thread(target=sleep_on_the_server)
            sleeper.start()
            try:
                await asyncio.sleep(0.05)  # a head start for DEBUG SLEEP, checked below
                async with LoopLagProbe() as probe:
                    started = time.monotonic()
                    result = await limiter.check(user, 10, 60)
                    finished = time.monotonic()
            finally:
                await asyncio.to_thread(sleeper.join, 10)
        return result, started, finished, slept[0], probe

    try:
        for _ in range(5):
            result, started, finished, slept_until, probe = run_async(one_round(), loop_factory)
            assert result == (True, 8, 0)
            if finished >= slept_until - 0.1 and slept_until - started >= 0.5:
                break  # answered after the sleep, sent 0.5 s before its end: it waited
        else:
            pytest.fail("in five rounds the check never waited 0.5 s on the sleeping server")
    finally:
        other_client.close()
    assert probe.max_lag < max_loop_lag(1.0) and probe.wakeups > 50, probe.report()  # ...and the loop ran


# --------------------------------------------------------------------- recovery

def test_script_flush_under_pipelining_is_recovered_and_stays_exact(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory) -> None:
    from genai_ratelimit import SCRIPT_SHA1

    user = fresh_user()

    async def main() -> None:
        async with async_limiter(redis_url, timeout=2.0) as limiter:
            await limiter.check(fresh_user("warm-up"), 10, 60)
            redis_client.script_flush()
            with measured_commands(redis_client) as delta:
                results = await asyncio.gather(*(limiter.check(user, 10, 60) for _ in range(50)))
        assert sum(r[0] for r in results) == 10
        assert sorted(r[1] for r in results if r[0]) == list(range(10))
        assert delta.get("script|load", 0) >= 1
        assert redis_client.script_exists(SCRIPT_SHA1) == [True]
        assert logged_entries(redis_client, f"ratelimit:{user}:60") == 10

    run_async(main(), loop_factory)


def test_restart_while_the_loop_runs_is_recovered_transparently(
        private_redis: RedisServer, loop_factory: LoopFactory) -> None:
    # As in a service: the loop keeps running while Redis restarts, so the limiter sees its
    # idle connection close and the first check afterwards dials anew.
    async def main() -> None:
        async with async_limiter(private_redis.url) as limiter:
            assert await limiter.check("user-1", 10, 60) == (True, 9, 0)
            await asyncio.to_thread(private_redis.restart)  # same port, empty data and scripts
            assert await limiter.check("user-1", 10, 60) == (True, 9, 0)
            assert await limiter.check("user-1", 10, 60) == (True, 8, 0)

    run_async(main(), loop_factory)


def test_restart_while_the_loop_is_stopped_is_recovered_transparently(
        private_redis: RedisServer, loop_factory: LoopFactory) -> None:
    # The loop does not run while Redis restarts (blocked, or between two run_until_complete
    # calls), so the idle connection's close is still unread when the next check comes: the
    # limiter must notice before it writes the check there, as the blocking limiter does.
    with LoopRunner(loop_factory) as runner:
        limiter = async_limiter(private_redis.url)
        try:
            assert runner.run(limiter.check("user-1", 10, 60)) == (True, 9, 0)
            private_redis.restart()
            assert runner.run(limiter.check("user-1", 10, 60)) == (True, 9, 0)
        finally:
            runner.run(limiter.aclose())


def test_server_killed_during_a_check_fails_it_at_once_then_works_after_restart(
        private_redis: RedisServer, loop_factory: LoopFactory) -> None:
    from genai_ratelimit import RateLimiterUnavailable

    async def main() -> None:
        async with async_limiter(private_redis.url, timeout=5.0) as limiter:
            assert await limiter.check("user-1", 10, 60) == (True, 9, 0)
            private_redis.pause()  # the check below is sent and waits for its reply
            pending = asyncio.ensure_future(limiter.check("user-1", 10, 60))
            await asyncio.sleep(0.05)
            started = time.monotonic()
            private_redis.kill()
            error, _ = await timed_failure(pending)
            # The lost connection is noticed when it closes, not at the 5 s socket_timeout.
            assert isinstance(error, RateLimiterUnavailable)
            assert time.monotonic() - started < 1.0
            await asyncio.to_thread(private_redis.start, private_redis.port)
            assert await limiter.check("user-1", 10, 60) == (True, 9, 0)

    run_async(main(), loop_factory)



# The probe takes the loop's waits for a CPU off its lateness (helpers_async.LoopLagProbe):
# a loop that code blocks must still show its whole stall, whatever blocks it.

def test_the_lag_probe_sees_a_loop_blocked_in_a_syscall(loop_factory: LoopFactory) -> None:
    async def main() -> LoopLagProbe:
        async with LoopLagProbe() as probe:
            await asyncio.sleep(0.01)
            time.sleep(0.2)  # the loop's thread sleeps in the kernel: a blocked loop
            await asyncio.sleep(0.01)
        return probe

    probe = run_async(main(), loop_factory)
    assert probe.max_lag >= 0.19, probe.report()


def test_the_lag_probe_sees_a_loop_blocked_on_a_lock_another_thread_holds(
        loop_factory: LoopFactory) -> None:
    lock = threading.Lock()
    held = threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            time.sleep(0.2)

    async def main() -> LoopLagProbe:
        async with LoopLagProbe() as probe:
            holder = threading.Thread(target=hold)
            holder.start()
            held.wait()
            with lock:  # waits for the other thread, without the GIL: a blocked loop
                pass
            await asyncio.sleep(0.01)
            holder.join()
        return probe

    probe = run_async(main(), loop_factory)
    assert probe.max_lag >= 0.15, probe.report()


def test_the_lag_probe_sees_a_loop_that_computes(loop_factory: LoopFactory) -> None:
    async def main() -> LoopLagProbe:
        async with LoopLagProbe() as probe:
            await asyncio.sleep(0.01)
            started = time.thread_time()
            while time.thread_time() - started < 0.1:  # 100 ms of this thread's own CPU
                pass
            await asyncio.sleep(0.01)
        return probe

    probe = run_async(main(), loop_factory)
    assert probe.max_lag >= 0.095, probe.report()
