"""The wait queue of in-flight caps (docs/wait-queue.md, "In-flight caps"): acquire(...,
max_wait=...) waits for a lease in a queue beside the leases key (lua/lease.lua,
lua/lib/queue.lua), woken by the release's PUBLISH (genai_ratelimit/_wake.py), on every
limiter kind. The tests wait for conditions read from Redis (a ticket taken, a queue
empty), never for a guessed time; where a wake-up is the point, the backstop is made longer
than the test, so only the release's message can wake the waiter."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from genai_ratelimit import wait_queue
from genai_ratelimit.wait_queue import MAX_WAIT_SECONDS, tenant_key
from helpers_async import LimiterFactory

CAP = "llm/provider-slots"
LEASES = f"ratelimit:{CAP}:leases"
QUEUE = f"ratelimit:{CAP}:leases:queue"
QUEUE_HASH = f"ratelimit:{CAP}:leases:queue:h"

pytestmark = pytest.mark.storages("zset", reason="leases are sorted sets in both storages")


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Returns once condition() holds (read from Redis), fails after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "the condition never held"
        time.sleep(0.002)


def queued(client: redis.Redis) -> int:
    return int(client.zcard(QUEUE))


def take_ticket(redis_url: str, tenant: str, live_ms: int = 60_000,
                bounds: tuple[int, int] = (1000, 100)) -> str:
    """A ticket taken and never waited for (as a waiter that was killed would leave)."""
    from genai_ratelimit import RateLimiter

    ticket = str(uuid.uuid4())
    with RateLimiter(redis_url) as raw:
        assert raw._wait_queue(CAP, ticket, tenant_key(tenant), (live_ms, *bounds),
                               leases=True) >= 0
    return ticket


class Waiters:
    """Concurrent acquire calls of the limiter kind under test, each a Future."""

    def __init__(self, factory: LimiterFactory, url: str) -> None:
        self.factory, self.url = factory, url
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=16)
        self.loop: asyncio.AbstractEventLoop | None = None
        if factory.loop_factory is not None:
            self.loop = factory.loop_factory()
            self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self.thread.start()
            self.limiter = factory.native(url)
        self.local = threading.local()

    def _blocking(self) -> Any:
        if not hasattr(self.local, "limiter"):
            self.local.limiter = self.factory(self.url)
        return self.local.limiter

    def start(self, limit: int, **keywords: Any) -> concurrent.futures.Future[Any]:
        if self.loop is None:
            return self.pool.submit(lambda: self._blocking().acquire(CAP, limit, 60, **keywords))
        return asyncio.run_coroutine_threadsafe(
            self.limiter.acquire(CAP, limit, 60, **keywords), self.loop)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.loop is not None:
            asyncio.run_coroutine_threadsafe(self.limiter.aclose(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture
def waiters(make_limiter: LimiterFactory, redis_url: str,
            redis_client: redis.Redis) -> Iterator[Waiters]:
    crowd = Waiters(make_limiter, redis_url)
    try:
        yield crowd
    finally:
        crowd.close()


@pytest.fixture
def long_backstop(monkeypatch: pytest.MonkeyPatch) -> None:
    """No backstop wake within a test (and tickets that outlive it): only a release's
    message can wake a waiter."""
    monkeypatch.setattr(wait_queue, "WAKE_BACKSTOP_SECONDS", 60.0)
    monkeypatch.setattr(wait_queue, "TICKET_LIVE_MS", 120_000)


def test_a_release_wakes_the_waiter_long_before_its_backstop(
        limiter: Any, waiters: Waiters, redis_client: redis.Redis, long_backstop: None) -> None:
    held = limiter.acquire(CAP, 1, 60)
    assert held.allowed
    waiting = waiters.start(1, max_wait=30)
    wait_for(lambda: queued(redis_client) == 1)
    time.sleep(0.05)  # the waiter subscribes after its ticket: give it the time to sleep
    released_at = time.monotonic()
    assert limiter.release(held)
    lease = waiting.result(timeout=10)
    woken_after = time.monotonic() - released_at
    assert lease.allowed and lease.queue_outcome == "queued_then_allowed"
    assert lease.waited_ms >= 50
    assert woken_after < 2.0  # the backstop is 60 s: the release's message woke it
    assert queued(redis_client) == 0 and not redis_client.exists(QUEUE_HASH)
    assert limiter.release(lease)
    assert not redis_client.exists(LEASES)


def test_a_reconcile_that_releases_the_slot_wakes_the_waiter(
        limiter: Any, waiters: Waiters, redis_client: redis.Redis, long_backstop: None) -> None:
    reservation = limiter.reserve(CAP, [(1000, 60)], in_flight=(1, 60))
    assert reservation.allowed and reservation.lease.allowed
    waiting = waiters.start(1, max_wait=30)
    wait_for(lambda: queued(redis_client) == 1)
    time.sleep(0.05)  # the waiter subscribes after its ticket: give it the time to sleep
    released_at = time.monotonic()
    assert limiter.reconcile(reservation, 0, release=True) == 1
    lease = waiting.result(timeout=10)
    assert lease.allowed and lease.queue_outcome == "queued_then_allowed"
    assert time.monotonic() - released_at < 2.0  # the backstop is 60 s
    assert queued(redis_client) == 0


def test_waiters_are_admitted_one_per_release_in_order(
        limiter: Any, waiters: Waiters, redis_client: redis.Redis, long_backstop: None) -> None:
    held = [limiter.acquire(CAP, 2, 60) for _ in range(2)]
    first = waiters.start(2, max_wait=30, tenant="a")
    wait_for(lambda: queued(redis_client) == 1)
    second = waiters.start(2, max_wait=30, tenant="b")
    wait_for(lambda: queued(redis_client) == 2)
    time.sleep(0.05)
    assert limiter.release(held[0])
    assert first.result(timeout=10).allowed
    assert not second.done()
    assert queued(redis_client) == 1
    assert limiter.release(held[1])
    assert second.result(timeout=10).allowed
    assert queued(redis_client) == 0


@pytest.mark.limiter_kinds("sync", reason="the C acquire with a ticket, the Redis rule alone")
def test_no_barging_a_request_without_a_ticket_counts_after_every_live_one(
        limiter: Any, redis_url: str, redis_client: redis.Redis) -> None:
    held = [limiter.acquire(CAP, 2, 60) for _ in range(2)]
    ticket = take_ticket(redis_url, "early")
    assert limiter.release(held[0])  # a slot is free, but a ticket waits for it
    barging = limiter.acquire(CAP, 2, 60)
    assert not barging.allowed and barging.held == 1 and barging.retry_after_ms == 1000
    raw = limiter._acquire(CAP, 2, 60, ticket=ticket)
    assert raw[0] and raw[4] == ticket  # at its turn: the lease has the ticket's id
    assert queued(redis_client) == 0 and not redis_client.exists(QUEUE_HASH)


@pytest.mark.limiter_kinds("sync", reason="the C acquire with a ticket, the Redis rule alone")
def test_fair_rounds_a_tenant_with_one_ticket_goes_second_behind_a_tenant_with_many(
        limiter: Any, redis_url: str, redis_client: redis.Redis) -> None:
    held = limiter.acquire(CAP, 1, 60)
    many = [take_ticket(redis_url, "big") for _ in range(5)]
    single = take_ticket(redis_url, "small")
    order = [member.decode().split("|")[2] for member in redis_client.zrange(QUEUE, 0, -1)]
    assert order == [many[0], single, *many[1:]]
    assert limiter.release(held)
    assert not limiter._acquire(CAP, 1, 60, ticket=single)[0]  # one turn behind
    granted = limiter._acquire(CAP, 1, 60, ticket=many[0])
    assert granted[0]
    assert limiter._release(CAP, granted[4])
    assert limiter._acquire(CAP, 1, 60, ticket=single)[0]  # its turn: the second


def test_past_the_deadline_a_queue_timeout_with_the_caps_honest_wait(
        limiter: Any, redis_client: redis.Redis) -> None:
    assert limiter.acquire(CAP, 1, 60).allowed
    started = time.monotonic()
    late = limiter.acquire(CAP, 1, 60, max_wait=0.3)
    assert not late.allowed and late.queue_outcome == "queue_timeout"
    assert 300 <= late.waited_ms < 2000 and time.monotonic() - started < 2
    # the lease's own hint (no hold history yet: 5 s), not the deadline's
    assert late.retry_after_ms == 5000 and late.retry_after_s == 5
    assert queued(redis_client) == 0 and not redis_client.exists(QUEUE_HASH)


def test_queue_bounds_refuse_at_once(limiter: Any, redis_url: str,
                                     redis_client: redis.Redis) -> None:
    assert limiter.acquire(CAP, 1, 60).allowed
    take_ticket(redis_url, "t1")
    started = time.monotonic()
    full = limiter.acquire(CAP, 1, 60, max_wait=10, max_queue=1)
    assert not full.allowed and full.queue_outcome == "queue_full"
    mine = limiter.acquire(CAP, 1, 60, max_wait=10, tenant="t1", max_queue_per_tenant=1)
    assert not mine.allowed and mine.queue_outcome == "queue_full"
    assert time.monotonic() - started < 1
    assert queued(redis_client) == 1


def test_an_acquire_without_max_wait_is_decided_at_once(limiter: Any,
                                                         redis_client: redis.Redis) -> None:
    assert limiter.acquire(CAP, 1, 60).allowed
    refused = limiter.acquire(CAP, 1, 60)
    assert not refused.allowed and refused.queue_outcome == "" and refused.waited_ms == 0
    assert queued(redis_client) == 0


@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="cancellation of an awaiting task")
def test_a_cancelled_waiter_leaves_no_ticket(
        limiter: Any, waiters: Waiters, redis_client: redis.Redis) -> None:
    held = limiter.acquire(CAP, 1, 60)
    waiting = waiters.start(1, max_wait=30)
    wait_for(lambda: queued(redis_client) == 1)
    waiting.cancel()
    wait_for(lambda: queued(redis_client) == 0 and not redis_client.exists(QUEUE_HASH))
    assert limiter.release(held)
    assert not redis_client.exists(LEASES)


@pytest.mark.parametrize("max_wait", [0, -1, 0.0, float("nan"), float("inf"), 86400,
                                      MAX_WAIT_SECONDS + 0.001, True, "1"])
def test_bad_max_wait_is_refused_before_any_io(unreachable_limiter: Any, max_wait: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="max_wait"):
        unreachable_limiter.acquire(CAP, 1, 60, max_wait=max_wait)


def test_bad_bounds_and_tenant_are_refused_before_any_io(unreachable_limiter: Any) -> None:
    with pytest.raises(ValueError, match="max_queue"):
        unreachable_limiter.acquire(CAP, 1, 60, max_wait=1, max_queue=0)
    with pytest.raises(ValueError, match="max_queue_per_tenant"):
        unreachable_limiter.acquire(CAP, 1, 60, max_wait=1, max_queue_per_tenant=100_001)
    with pytest.raises(TypeError, match="tenant"):
        unreachable_limiter.acquire(CAP, 1, 60, max_wait=1, tenant=3)


@pytest.mark.limiter_kinds("sync", reason="a waiter in a process of its own, killed with SIGKILL")
def test_a_killed_waiters_ticket_lapses_within_seconds_not_at_its_deadline(
        limiter: Any, redis_url: str, redis_client: redis.Redis, tmp_path: Any) -> None:
    import os
    import signal
    import subprocess
    import sys

    held = limiter.acquire(CAP, 1, 60)
    code = ("import sys\nfrom genai_ratelimit import RateLimiter\n"
            f"RateLimiter(sys.argv[1]).acquire({CAP!r}, 1, 60, max_wait=300)\n")
    victim = subprocess.Popen([sys.executable, "-c", code, redis_url], cwd=tmp_path)
    try:
        wait_for(lambda: queued(redis_client) == 1)
        os.kill(victim.pid, signal.SIGKILL)
    finally:
        victim.wait(10)
    killed_at = time.monotonic()
    assert limiter.release(held)
    survivor = limiter.acquire(CAP, 1, 60, max_wait=30)
    assert survivor.allowed and survivor.queue_outcome == "queued_then_allowed"
    # held back by the dead ticket until it lapsed (TICKET_LIVE_MS), plus one backstop
    assert time.monotonic() - killed_at < (wait_queue.TICKET_LIVE_MS / 1000
                                           + wait_queue.WAKE_BACKSTOP_SECONDS + 1)
    assert queued(redis_client) == 0 and not redis_client.exists(QUEUE_HASH)


@pytest.mark.limiter_kinds("sync", reason="the scripts' messages, read by a redis-py subscriber")
def test_releases_and_admissions_publish_the_tickets_whose_turn_came(
        limiter: Any, redis_url: str, redis_client: redis.Redis) -> None:
    held = [limiter.acquire(CAP, 2, 60) for _ in range(2)]
    first, second = take_ticket(redis_url, "a"), take_ticket(redis_url, "b")
    listener = redis_client.pubsub()
    listener.subscribe(QUEUE)
    try:
        assert listener.get_message(timeout=5)["type"] == "subscribe"

        def message() -> str:
            got = listener.get_message(timeout=5)
            assert got is not None and got["type"] == "message"
            return str(got["data"].decode())

        assert limiter.release(held[0])
        assert message() == first  # one slot freed: the head
        assert limiter.release(held[1])
        assert message() == first  # the head again: its waiter has not come yet
        assert limiter._acquire(CAP, 2, 60, ticket=first)[0]
        assert message() == second  # a slot still free: the next turn came too
        assert limiter._acquire(CAP, 2, 60, ticket=second)[0]
        assert listener.get_message(timeout=0.2) is None  # the queue is empty: no message
    finally:
        listener.close()


# --------------------------------------------------------------------------- the plan, I/O-free

WAITER = object()  # the driver's waiter handle, opaque to the plan


def slot(allowed: bool, retry_ms: int = 5000) -> tuple[Any, ...]:
    """A C acquire tuple: (allowed, held, retry_s, retry_ms, lease_id, expires, now, bound)."""
    return ((True, 1, 0, 0, "lease", 61_000, 1000, 0) if allowed
            else (False, 1, -(-retry_ms // 1000), retry_ms, "", 0, 1000, retry_ms))


def run_plan(answers: list[Any], max_wait: float = 5) -> tuple[list[tuple[Any, ...]], Any]:
    from genai_ratelimit.lease import Lease, make_lease
    from genai_ratelimit.reservation import advance
    from genai_ratelimit.wait_queue import queued_acquire_plan

    plan = queued_acquire_plan(CAP, 1, 60, max_wait, "acme", 1000, 100,
                               lambda raw: make_lease(Lease, raw, CAP, 1, 60, None))
    calls: list[tuple[Any, ...]] = []
    call, result = advance(plan)
    for answer in answers:
        assert call is not None, "the plan ended early"
        calls.append(call)
        call, result = advance(plan, answer)
    assert call is None, f"the plan wanted more: {call}"
    return calls, result


def test_the_plan_of_an_acquire_admitted_at_once_takes_no_ticket() -> None:
    calls, lease = run_plan([100.0, slot(True)])
    assert [c[0] for c in calls] == ["clock", "acquire"] and calls[1][2] == {}
    assert lease.allowed and lease.queue_outcome == ""


def test_the_plan_subscribes_before_it_relies_on_a_wake_and_asks_with_its_ticket() -> None:
    calls, lease = run_plan([100.0, slot(False), 0, WAITER, 100.0, slot(False), 100.01, True,
                             100.02, slot(True), 100.03, None])
    assert [c[0] for c in calls] == ["clock", "acquire", "wait_queue", "subscribe", "clock",
                                     "acquire", "clock", "wake", "clock", "acquire", "clock",
                                     "unsubscribe"]
    name, ticket, tenant, numbers = calls[2][1]
    assert (name, tenant, numbers) == (CAP, tenant_key("acme"), (3000, 1000, 100))
    assert calls[2][2] == {"leases": True}
    assert calls[3][1] == (CAP, ticket)  # subscribed before the retry with the ticket
    assert calls[5][2] == {"ticket": ticket} and calls[9][2] == {"ticket": ticket}
    assert calls[7][1] == (WAITER, wait_queue.WAKE_BACKSTOP_SECONDS)
    assert calls[11][1] == (WAITER,)
    assert lease.allowed and lease.queue_outcome == "queued_then_allowed"
    assert lease.waited_ms == 30


def test_the_plan_renews_its_ticket_after_a_backstop_wake() -> None:
    calls, lease = run_plan([100.0, slot(False), 0, WAITER, 100.0, slot(False), 100.0, False,
                             101.0, 0, slot(True), 101.0, None])
    assert [c[0] for c in calls] == ["clock", "acquire", "wait_queue", "subscribe", "clock",
                                     "acquire", "clock", "wake", "clock", "wait_queue",
                                     "acquire", "clock", "unsubscribe"]
    assert calls[9][1][3][0] == wait_queue.TICKET_LIVE_MS  # renewed, not left
    assert lease.allowed


def test_the_plan_at_its_deadline_leaves_with_the_last_refusals_wait() -> None:
    calls, lease = run_plan([100.0, slot(False), 0, WAITER, 100.0, slot(False, 2000), 100.6, 1,
                             None], max_wait=0.5)
    assert [c[0] for c in calls][-3:] == ["clock", "wait_queue", "unsubscribe"]
    assert calls[-2][1][3][0] == 0  # the ticket left
    assert not lease.allowed and lease.queue_outcome == "queue_timeout"
    assert lease.retry_after_ms == 2000 and lease.waited_ms == 600


def test_the_plan_of_a_full_queue_refuses_at_once() -> None:
    for full in (-1, -2):
        calls, lease = run_plan([100.0, slot(False), full])
        assert [c[0] for c in calls] == ["clock", "acquire", "wait_queue"]
        assert not lease.allowed and lease.queue_outcome == "queue_full"


def test_the_plan_leaves_its_ticket_and_its_waiter_when_it_is_cancelled() -> None:
    from genai_ratelimit.lease import Lease, make_lease
    from genai_ratelimit.reservation import advance
    from genai_ratelimit.wait_queue import queued_acquire_plan

    plan = queued_acquire_plan(CAP, 1, 60, 5, None, 1000, 100,
                               lambda raw: make_lease(Lease, raw, CAP, 1, 60, None))
    call, _ = advance(plan)
    for answer in (100.0, slot(False), 0, WAITER, 100.0, slot(False), 100.0):
        call, _ = advance(plan, answer)
    assert call is not None and call[0] == "wake"
    call, _ = advance(plan, error=asyncio.CancelledError())
    assert call is not None and call[0] == "wait_queue" and call[1][3][0] == 0
    call, _ = advance(plan, 1)
    assert call is not None and call[0] == "unsubscribe"
    with pytest.raises(asyncio.CancelledError):
        advance(plan, None)
