"""The wait queue of shared caps (docs/wait-queue.md): reserve(..., max_wait=...) waits for
a shared scope's windows in a queue kept in Redis (lua/lib/queue.lua, lua/wait_queue.lua),
on every limiter kind and both storages. Waiters run concurrently (threads with a limiter
each for the blocking kind, tasks on one AsyncRateLimiter for the async kinds); the tests
wait for conditions read from Redis (a ticket taken, a queue empty), never for a guessed
time, and check order and times from the reservations (their entries' times are the
server's)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis

from genai_ratelimit import Scope
from genai_ratelimit.wait_queue import MAX_WAIT_SECONDS, queue_milliseconds, tenant_key
from helpers_async import LimiterFactory

UPSTREAM = "llm/provider"
QUEUE = f"ratelimit:{UPSTREAM}:queue"
QUEUE_HASH = f"ratelimit:{UPSTREAM}:queue:h"
OWN = [(1000, 60)]  # the user's own window: never the one that refuses here


def cap(limit: int, seconds: int = 1) -> Scope:
    return Scope(UPSTREAM, windows=[(limit, seconds)], shared=True)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Returns once condition() holds (read from Redis), fails after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "the condition never held"
        time.sleep(0.002)


class Waiters:
    """Concurrent reserve calls of the limiter kind under test, each a Future."""

    def __init__(self, factory: LimiterFactory, url: str) -> None:
        self.factory, self.url = factory, url
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=128)
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

    def start(self, user: str, scope: Scope, **keywords: Any) -> concurrent.futures.Future[Any]:
        if self.loop is None:
            return self.pool.submit(lambda: self._blocking().reserve(user, OWN, scopes=[scope],
                                                                     **keywords))
        return asyncio.run_coroutine_threadsafe(
            self.limiter.reserve(user, OWN, scopes=[scope], **keywords), self.loop)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.loop is not None:
            asyncio.run_coroutine_threadsafe(self.limiter.aclose(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture
def waiters(make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis):
    crowd = Waiters(make_limiter, redis_url)
    try:
        yield crowd
    finally:
        crowd.close()


def fill(limiter: Any, scope: Scope, count: int) -> list[int]:
    """`count` admissions through the cap; their entries' times (unix ms)."""
    times = []
    for _ in range(count):
        reservation = limiter.reserve("filler", OWN, scopes=[scope])
        assert reservation.allowed
        times.append(reservation.timestamp_ms)
    return times


def queued(client: redis.Redis) -> int:
    return int(client.zcard(QUEUE))


def take_ticket(redis_url: str, tenant: str, wait_ms: int, bounds: tuple[int, int] = (1000, 100),
                ) -> str:
    """A ticket taken and never waited for: a waiter killed before it could leave."""
    from genai_ratelimit import RateLimiter

    ticket = str(uuid.uuid4())
    with RateLimiter(redis_url) as raw:
        assert raw._wait_queue(UPSTREAM, ticket, tenant_key(tenant), (wait_ms, *bounds)) >= 0
    return ticket


def test_a_refused_request_is_admitted_right_after_the_oldest_entry_leaves(
        limiter: Any, redis_client: redis.Redis) -> None:
    scope = cap(2)
    first, _ = fill(limiter, scope, 2)
    reservation = limiter.reserve("u", OWN, scopes=[scope], max_wait=5)
    assert reservation.allowed and reservation.queue_outcome == "queued_then_allowed"
    # not before the oldest entry left its 1 s window, and at once after it (a wake, not a poll)
    assert first + 1000 <= reservation.timestamp_ms <= first + 1000 + 250
    assert 0 < reservation.waited_ms <= 1000 + 250
    assert queued(redis_client) == 0 and not redis_client.exists(QUEUE_HASH)
    # a request that is admitted at once did not wait
    assert limiter.reserve("u", OWN, scopes=[cap(10)], max_wait=5).queue_outcome == ""


def test_past_the_deadline_the_refusal_it_would_have_got_and_no_ticket_left(
        limiter: Any, redis_client: redis.Redis) -> None:
    scope = cap(1, 2)
    fill(limiter, scope, 1)
    plain = limiter.reserve("u", OWN, scopes=[scope])
    started = time.monotonic()
    reservation = limiter.reserve("u", OWN, scopes=[scope], max_wait=0.5)
    assert not reservation.allowed and reservation.queue_outcome == "queue_timeout"
    # the honest wait: what the cap says (about 2 s), not the deadline's
    assert plain.retry_after_ms - 100 <= reservation.retry_after_ms <= plain.retry_after_ms
    assert reservation.retry_after_s == math.ceil(reservation.retry_after_ms / 1000)
    # it knew it could not be admitted before its deadline: it did not sit out the wait
    assert time.monotonic() - started < 0.5
    assert queued(redis_client) == 0 and not redis_client.exists(QUEUE_HASH)
    assert not reservation.member  # nothing was charged anywhere
    assert redis_client.zcard(f"ratelimit:{UPSTREAM}:2:shared") in (0, 1)


def test_one_tenant_with_many_waiting_does_not_starve_another(
        limiter: Any, waiters: Waiters, redis_client: redis.Redis) -> None:
    scope = cap(2)
    fill(limiter, scope, 2)
    many = [waiters.start("a", scope, max_wait=30) for _ in range(6)]
    wait_for(lambda: queued(redis_client) == 6)
    one = waiters.start("b", scope, max_wait=30)
    wait_for(lambda: queued(redis_client) == 7)
    # B's one ticket is served in the first round, right after A's first
    members = [m.decode() for m in redis_client.zrange(QUEUE, 0, -1)]
    assert members[1].endswith("|" + tenant_key("b"))
    results = [f.result(30) for f in many]
    b = one.result(30)
    assert all(r.allowed and r.queue_outcome == "queued_then_allowed" for r in [*results, b])
    admitted = sorted(r.timestamp_ms for r in [*results, b])
    assert b.timestamp_ms <= admitted[1]  # within the first turn of 2
    # first in first out within a tenant: A's tickets were served in the order they were taken
    assert queued(redis_client) == 0


def test_first_in_first_out_within_a_tenant(
        limiter: Any, waiters: Waiters, redis_client: redis.Redis) -> None:
    scope = cap(1)
    fill(limiter, scope, 1)
    order = []
    for k in range(3):
        order.append(waiters.start("a", scope, max_wait=30))
        wait_for(lambda k=k: queued(redis_client) == k + 1)
    times = [f.result(30).timestamp_ms for f in order]
    assert times == sorted(times) and len(set(times)) == 3
    assert times[1] - times[0] >= 1000 - 5 and times[2] - times[1] >= 1000 - 5


def test_no_barging_and_a_killed_waiters_ticket_expires(
        limiter: Any, redis_url: str, redis_client: redis.Redis) -> None:
    scope = cap(1)
    ticket_deadline_ms = int(time.time() * 1000) + 1500
    take_ticket(redis_url, "ghost", 1500)  # its waiter was killed: nobody will use it
    # capacity is free, but a live ticket waits: a request without one may not pass it
    barger = limiter.reserve("u", OWN, scopes=[scope])
    assert not barger.allowed and barger.retry_after_ms > 0
    assert redis_client.zcard(f"ratelimit:{UPSTREAM}:1:shared") == 0  # nothing charged
    # with max_wait it queues behind it, and is admitted once the ghost's deadline passed
    waited = limiter.reserve("u", OWN, scopes=[scope], max_wait=10)
    assert waited.allowed and waited.queue_outcome == "queued_then_allowed"
    assert waited.timestamp_ms >= ticket_deadline_ms - 50
    assert queued(redis_client) == 0 and not redis_client.exists(QUEUE_HASH)


def test_two_live_tickets_in_a_cap_of_three_let_a_third_request_pass(
        limiter: Any, redis_url: str, redis_client: redis.Redis) -> None:
    # The rule is "the windows hold every ticket ahead and this request": a request passes no
    # ticket's place, and capacity nobody waits for is not kept idle.
    scope = cap(3)
    take_ticket(redis_url, "x", 5000)
    take_ticket(redis_url, "y", 5000)
    assert limiter.reserve("u", OWN, scopes=[scope]).allowed
    assert not limiter.reserve("u", OWN, scopes=[scope]).allowed
    assert queued(redis_client) == 2


def test_queue_bounds_refuse_at_once(limiter: Any, redis_url: str,
                                     redis_client: redis.Redis) -> None:
    scope = cap(1, 5)
    fill(limiter, scope, 1)
    take_ticket(redis_url, "a", 10_000)
    take_ticket(redis_url, "b", 10_000)
    started = time.monotonic()
    full = limiter.reserve("c", OWN, scopes=[scope], max_wait=10, max_queue=2)
    assert not full.allowed and full.queue_outcome == "queue_full" and full.retry_after_ms > 0
    tenant_full = limiter.reserve("u", OWN, scopes=[scope], max_wait=10, tenant="a",
                                  max_queue_per_tenant=1)
    assert tenant_full.queue_outcome == "queue_full"
    assert time.monotonic() - started < 1.0
    assert queued(redis_client) == 2  # neither took a ticket


@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="cancellation of an awaiting task")
def test_a_cancelled_waiter_leaves_no_ticket(
        limiter: Any, waiters: Waiters, redis_client: redis.Redis) -> None:
    scope = cap(1, 5)
    fill(limiter, scope, 1)
    waiting = waiters.start("u", scope, max_wait=30)
    wait_for(lambda: queued(redis_client) == 1)
    waiting.cancel()
    wait_for(lambda: queued(redis_client) == 0 and not redis_client.exists(QUEUE_HASH))


@pytest.mark.parametrize("max_wait", [0, -1, 0.0, float("nan"), float("inf"), 86400,
                                      MAX_WAIT_SECONDS + 0.001, True, "1", None])
def test_bad_max_wait_is_refused_before_any_io(unreachable_limiter: Any, max_wait: Any) -> None:
    if max_wait is None:  # no max_wait: not queued, the call goes to Redis
        return
    with pytest.raises((TypeError, ValueError), match="max_wait"):
        unreachable_limiter.reserve("u", OWN, scopes=[cap(1)], max_wait=max_wait)


def test_max_wait_needs_a_shared_scope_and_bounds_are_checked(unreachable_limiter: Any) -> None:
    with pytest.raises(ValueError, match="shared scope"):
        unreachable_limiter.reserve("u", OWN, max_wait=1)
    with pytest.raises(ValueError, match="max_queue"):
        unreachable_limiter.reserve("u", OWN, scopes=[cap(1)], max_wait=1, max_queue=0)
    with pytest.raises(TypeError, match="tenant"):
        unreachable_limiter.reserve("u", OWN, scopes=[cap(1)], max_wait=1, tenant=3)
    assert queue_milliseconds(0.0001) == 1 and queue_milliseconds(300) == 300_000


# --------------------------------------------------------------------------- FastAPI


@pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async "
                                "tests drive on hiredis 1.x")
@pytest.mark.parametrize("dependency_name", ["RateLimit", "TokenRateLimit"])
def test_an_upstreams_max_wait_in_fastapi(make_limiter: LimiterFactory, redis_url: str,
                                          redis_client: redis.Redis,
                                          dependency_name: str) -> None:
    """Upstream(max_wait=...): a request the cap holds back waits (a ticket ahead of it whose
    waiter is gone, until its deadline) and runs, counted queued_then_allowed; one the cap
    cannot admit before its deadline gets the upstream's 429 at once with the cap's
    Retry-After, counted queue_timeout."""
    from fastapi import Depends, FastAPI
    from fastapi.testclient import TestClient

    from genai_ratelimit import fastapi as gr_fastapi
    from genai_ratelimit.metrics import request_outcomes

    with pytest.raises(ValueError, match="max_wait"):
        gr_fastapi.Upstream(UPSTREAM, per_minute=1, max_wait=0)
    limiter = make_limiter.native(redis_url)
    budget = getattr(gr_fastapi, dependency_name)(
        limiter, identify=lambda request: ("tenant", "pro"),
        upstream=gr_fastapi.Upstream(UPSTREAM, per_minute=1, max_wait=5))
    app = FastAPI()

    @app.post("/v1/chat/completions", dependencies=[Depends(budget)])
    async def chat() -> dict[str, bool]:
        return {"ok": True}

    ghost_deadline_ms = int(time.time() * 1000) + 300
    take_ticket(redis_url, "ghost", 300)
    with TestClient(app) as client:
        first = client.post("/v1/chat/completions", json={"model": "gpt-4o", "max_tokens": 10})
        assert int(time.time() * 1000) >= ghost_deadline_ms - 50  # it waited for the ghost
        second = client.post("/v1/chat/completions", json={"model": "gpt-4o", "max_tokens": 10})
    assert first.status_code == 200
    assert second.status_code == 429 and second.headers["x-ratelimit-scope"] == "upstream"
    assert 55 <= int(second.headers["retry-after"]) <= 60  # the cap's minute, not max_wait
    outcomes = {row[0]: row[-1] for row in request_outcomes(limiter).snapshot()[0]}
    assert outcomes == {"queued_then_allowed": 1, "queue_timeout": 1}
    assert queued(redis_client) == 0


# --------------------------------------------------------------------------- the plan, as a table


def raw_answer(allowed: bool, retry_ms: int = 0, scope_index: int = 1, at_ms: int = 1000) -> tuple:
    """The C reserve tuple of one decision over the user's window and the cap's."""
    report = ((1000, 60, False, 999 if allowed else 1000, 0),
              (2, 1, False, 1 if allowed else 0, 1))
    return (allowed, 1 if allowed else 0, -(-retry_ms // 1000), 1, False,
            "m" * 36 if allowed else "", at_ms, report, retry_ms,
            0 if allowed else scope_index, 0, None, 0)  # slot None, no share rule


def drive(plan: Any, answers: list[Any]) -> tuple[list[tuple[str, Any]], Any]:
    """Runs an I/O-free plan on scripted answers (an exception is thrown in): its calls and
    its result."""
    from genai_ratelimit.reservation import advance

    calls: list[tuple[str, Any]] = []
    call, result = advance(plan)
    for answer in answers:
        if call is None:
            break
        calls.append((call[0], call[1] if call[0] != "reserve" else call[2].get("ticket")))
        if isinstance(answer, BaseException):
            call, result = advance(plan, error=answer)
        else:
            call, result = advance(plan, answer)
    assert call is None, f"the plan wanted more: {call}"
    return calls, result


def queued_plan(max_wait: float = 5, **keywords: Any) -> Any:
    from genai_ratelimit.wait_queue import queued_reserve_plan

    return queued_reserve_plan("u", OWN, 1, (), None, [cap(2)], max_wait, **keywords)


def test_the_plan_of_a_request_admitted_at_once_takes_no_ticket() -> None:
    calls, result = drive(queued_plan(), [100.0, raw_answer(True)])
    assert [name for name, _ in calls] == ["clock", "reserve"] and calls[1][1] is None
    assert result.allowed and result.queue_outcome == ""


def test_the_plan_takes_a_ticket_sleeps_the_refusals_wait_and_asks_with_it() -> None:
    calls, result = drive(queued_plan(), [100.0, raw_answer(False, 700), 0, 100.01, None,
                                          raw_answer(True, at_ms=1700), 100.72])
    names = [name for name, _ in calls]
    assert names == ["clock", "reserve", "wait_queue", "clock", "sleep", "reserve", "clock"]
    name, ticket, tenant, numbers = calls[2][1]
    assert (name, tenant, numbers) == (UPSTREAM, tenant_key("u"), (5000, 1000, 100))
    assert calls[4][1] == (0.7,) and calls[5][1] == ticket  # the ticket is the entry's member
    assert result.allowed and result.queue_outcome == "queued_then_allowed"
    assert result.waited_ms == 720


def test_the_plan_gives_up_at_once_when_the_wait_passes_its_deadline() -> None:
    calls, result = drive(queued_plan(max_wait=0.5), [100.0, raw_answer(False, 700), 0, 100.0, 1])
    assert [name for name, _ in calls] == ["clock", "reserve", "wait_queue", "clock", "wait_queue"]
    assert calls[4][1][3][0] == 0  # the ticket left (wait_ms 0)
    assert not result.allowed and result.queue_outcome == "queue_timeout"
    assert result.retry_after_ms == 700 and result.retry_after_s == 1


def test_the_plan_of_a_full_queue_refuses_at_once() -> None:
    for full in (-1, -2):
        calls, result = drive(queued_plan(), [100.0, raw_answer(False, 700), full])
        assert [name for name, _ in calls] == ["clock", "reserve", "wait_queue"]
        assert result.queue_outcome == "queue_full" and result.retry_after_ms == 700


def test_the_plan_never_queues_for_the_users_own_budget() -> None:
    calls, result = drive(queued_plan(), [100.0, raw_answer(False, 700, scope_index=0)])
    assert [name for name, _ in calls] == ["clock", "reserve"]
    assert not result.allowed and result.queue_outcome == ""


def test_the_plan_leaves_its_ticket_when_it_is_cancelled() -> None:
    from genai_ratelimit.reservation import advance

    plan = queued_plan()
    answers = [100.0, raw_answer(False, 700), 0, 100.0]
    call, _ = advance(plan)
    for answer in answers:
        call, _ = advance(plan, answer)
    assert call is not None and call[0] == "sleep"
    call, _ = advance(plan, error=asyncio.CancelledError())
    assert call is not None and call[0] == "wait_queue" and call[1][3][0] == 0
    with pytest.raises(asyncio.CancelledError):
        advance(plan, 1)


@pytest.mark.limiter_kinds("sync", reason="a waiter in a process of its own, killed with SIGKILL")
def test_a_waiter_killed_with_sigkill_leaves_a_ticket_that_expires_at_its_deadline(
        limiter: Any, redis_url: str, redis_client: redis.Redis, storage: str,
        tmp_path: Any) -> None:
    import os
    import signal
    import subprocess
    import sys

    scope = cap(1)
    fill(limiter, scope, 1)
    code = ("import sys\nfrom genai_ratelimit import RateLimiter, Scope\n"
            f"RateLimiter(sys.argv[1], storage={storage!r}).reserve('victim', [(1000, 60)], "
            f"scopes=[Scope({UPSTREAM!r}, windows=[(1, 1)], shared=True)], max_wait=2)\n")
    victim = subprocess.Popen([sys.executable, "-c", code, redis_url], cwd=tmp_path)
    try:
        wait_for(lambda: queued(redis_client) == 1)
        member = redis_client.zrange(QUEUE, 0, 0)[0].decode()
        deadline_ms = int(member.split("|")[1])
        os.kill(victim.pid, signal.SIGKILL)
    finally:
        victim.wait(10)
    survivor = limiter.reserve("survivor", OWN, scopes=[scope], max_wait=10)
    assert survivor.allowed and survivor.queue_outcome == "queued_then_allowed"
    # held back by the dead ticket until its deadline, then woken by it (no later than 250 ms)
    assert deadline_ms <= survivor.timestamp_ms <= deadline_ms + 250
    assert queued(redis_client) == 0 and not redis_client.exists(QUEUE_HASH)


def test_the_tickets_ahead_count_in_the_caps_windows_not_in_the_users_own(
        limiter: Any, redis_url: str, redis_client: redis.Redis) -> None:
    scope = cap(10, 60)
    for tenant in ("x", "y", "z"):
        take_ticket(redis_url, tenant, 5000)
    own = [(2, 60)]  # the user's own: 1 of 2 used; the 3 tickets ahead are not its business
    assert limiter.reserve("u", own).allowed
    reservation = limiter.reserve("u", own, scopes=[scope])
    assert reservation.allowed  # the cap holds the 3 tickets ahead and it
    assert queued(redis_client) == 3


@pytest.mark.limiter_kinds("sync", reason="the C reserve call with a ticket, the Redis rule alone")
def test_a_newcomer_goes_in_the_round_being_served_even_after_an_admission_out_of_order(
        limiter: Any, redis_url: str, redis_client: redis.Redis) -> None:
    scope = cap(5, 60)
    a1, _b1, _a2, a3 = (take_ticket(redis_url, tenant, 5000) for tenant in "abaa")
    # a3 (round 3, rank 3) is admitted while a1, b1 and a2 sleep: the cap holds the 4
    raw = limiter._reserve("a", OWN, scopes=(scope.native(),), ticket=a3)
    assert raw[0]
    # c's ticket goes in round 1 (the head's), behind a1 and b1 only, ahead of a2 (round 2)
    c = take_ticket(redis_url, "c", 5000)
    members = [m.decode() for m in redis_client.zrange(QUEUE, 0, -1)]
    assert [m.split("|")[2] for m in members].index(c) == 2
    assert members[0].split("|")[2] == a1
