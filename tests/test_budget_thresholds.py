"""Soft limits of calendar budgets (Budget(..., thresholds=...), lua/lib/budget.lua): a
threshold is crossed when the budget's use (spent + held) reaches it, decided in the hold
or settle script, so it fires once per period across every replica and every replay; each
crossing is on the answer (BudgetHold.crossed, BudgetSettlement.crossed), counted
(genai_ratelimit_budget_thresholds_crossed_total), logged (WARNING) and given to
on_budget_threshold. On every limiter kind against a real redis-server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
from typing import Any

import pytest
import redis

from genai_ratelimit import (
    AsyncRateLimiter,
    Budget,
    BudgetCrossing,
    BudgetSettlement,
    _native,
)
from genai_ratelimit.metrics import (
    _from_json,
    budget_thresholds,
    exported,
    merge_snapshots,
    samples,
)
from genai_ratelimit.testing import ManualClock
from test_idempotent_retry import ReplyDroppingProxy, redis_port  # noqa: F401 - a fixture

pytestmark = pytest.mark.storages("zset", reason="budgets keep no window log: one hash per "
                                                 "budget and period in either storage")


def native(limiter: Any) -> Any:
    """The RateLimiter or AsyncRateLimiter behind the fixture's blocking interface."""
    return getattr(limiter, "inner", limiter)


def recorder(limiter: Any) -> list[BudgetCrossing]:
    """Installs a callback that records every crossing; returns the list it fills."""
    calls: list[BudgetCrossing] = []
    limiter.on_budget_threshold = calls.append
    return calls


def thresholds_of(crossings: Any) -> list[int]:
    return [c.threshold for c in crossings]


def budget_key(budget: Budget, start_ms: int) -> str:
    return f"ratelimit:{budget.owner}:{start_ms}:budget={budget.name}"


# ---------------------------------------------------------------- on Redis


def test_crossing_50_then_80_fires_each_once(limiter: Any, redis_client: redis.Redis,
                                             caplog: pytest.LogCaptureFixture) -> None:
    budget = Budget("key-1", "monthly_usd", 100, thresholds=(50, 80, 95), level="key")
    calls = recorder(limiter)
    caplog.set_level(logging.WARNING, logger="genai_ratelimit")
    assert limiter.hold_budgets(budget, 30).crossed == ()
    at_55 = limiter.hold_budgets(budget, 25)
    assert thresholds_of(at_55.crossed) == [50]
    (crossing,) = at_55.crossed
    assert crossing.budget is budget and crossing.by == "hold" and crossing.hold_id == at_55.hold_id
    assert (crossing.period_start_ms, crossing.period_end_ms) == (
        at_55.periods[0].period_start_ms, at_55.periods[0].period_end_ms)
    assert limiter.hold_budgets(budget, 5).crossed == ()  # 60
    assert thresholds_of(limiter.hold_budgets(budget, 20).crossed) == [80]  # 80: reached
    assert limiter.hold_budgets(budget, 1).crossed == ()
    assert thresholds_of(calls) == [50, 80]
    counts = budget_thresholds(native(limiter))
    assert counts.snapshot() == (("monthly_usd", "key", "50", 1), ("monthly_usd", "key", "80", 1))
    warnings = [r for r in caplog.records if r.name == "genai_ratelimit"
                and r.levelno == logging.WARNING and "reached" in r.getMessage()]
    assert len(warnings) == 2
    assert "'monthly_usd' of 'key-1'" in warnings[0].getMessage()
    assert "50%" in warnings[0].getMessage() and "month starting" in warnings[0].getMessage()
    key = budget_key(budget, at_55.periods[0].period_start_ms)
    assert int(redis_client.hget(key, "fired")) == 80


def test_jumping_from_40_to_96_percent_fires_50_80_and_95_in_one_reply(limiter: Any) -> None:
    budget = Budget("key-1", "daily", 1000, "day", "Europe/Paris", thresholds=(50, 80, 95))
    calls = recorder(limiter)
    first = limiter.hold_budgets(budget, 400)
    assert limiter.settle_budgets(first, 400).crossed == ()
    jump = limiter.hold_budgets(budget, 560)  # 40 % -> 96 %
    assert thresholds_of(jump.crossed) == [50, 80, 95]
    assert thresholds_of(calls) == [50, 80, 95]
    assert budget_thresholds(native(limiter)).total(budget="daily") == 3


def test_a_threshold_is_reached_at_the_limits_percent_rounded_up(limiter: Any) -> None:
    """50 % of 7 is 3.5: 3 units do not reach it, 4 do (integers, no float decides)."""
    budget = Budget("key-1", "odd", 7, thresholds=(50,))
    assert limiter.hold_budgets(budget, 3).crossed == ()
    assert thresholds_of(limiter.hold_budgets(budget, 1).crossed) == [50]


def test_a_threshold_of_a_huge_limit_is_exact(limiter: Any) -> None:
    """Near 2^53 a double cannot hold limit * percent: the script computes it as 100q + r."""
    limit = 2**53 - 1
    mark = -(-limit * 95 // 100)  # ceil(95 % of the limit)
    budget = Budget("org", "huge", limit, thresholds=(95,))
    assert limiter.hold_budgets(budget, mark - 1).crossed == ()
    assert thresholds_of(limiter.hold_budgets(budget, 1).crossed) == [95]


def test_a_settle_above_its_hold_crosses_and_says_so(limiter: Any) -> None:
    budget = Budget("key-1", "monthly_usd", 100, thresholds=(50, 80))
    calls = recorder(limiter)
    hold = limiter.hold_budgets(budget, 30)
    settled = limiter.settle_budgets(hold, 85)
    assert isinstance(settled, BudgetSettlement) and isinstance(settled, int) and settled == 1
    assert [(c.threshold, c.by, c.hold_id) for c in settled.crossed] == [
        (50, "settle", hold.hold_id), (80, "settle", hold.hold_id)]
    assert thresholds_of(calls) == [50, 80]
    # A settle below its hold lowers the use: nothing fires again when it rises back.
    again = limiter.hold_budgets(budget, 10)
    assert again.crossed == () and limiter.settle_budgets(again, 0).crossed == ()
    assert limiter.settle_budgets(hold, 100) == 0  # settled already: nothing, nothing fires
    assert len(calls) == 2


def test_a_refused_hold_fires_nothing(limiter: Any, redis_client: redis.Redis) -> None:
    budget = Budget("key-1", "daily", 100, "day", thresholds=(10,))
    org = Budget("org", "daily", 5, "day")
    calls = recorder(limiter)
    refused = limiter.hold_budgets([budget, org], 50)
    assert not refused.allowed and refused.crossed == () and calls == []
    assert redis_client.keys("*budget=*") == []


def test_a_budget_without_thresholds_writes_no_soft_limit_field(
        limiter: Any, redis_client: redis.Redis) -> None:
    budget = Budget("key-1", "daily", 100, "day")
    hold = limiter.hold_budgets(budget, 100)
    assert hold.crossed == ()
    fields = redis_client.hgetall(budget_key(budget, hold.periods[0].period_start_ms))
    assert not {b"fired", b"fired_from", b"fired_by"} & set(fields)


def test_each_level_of_one_hold_fires_its_own(limiter: Any) -> None:
    org = Budget("org", "monthly", 1000, thresholds=(50,), level="org")
    key = Budget("key-1", "monthly", 100, thresholds=(50, 90), level="key")
    hold = limiter.hold_budgets([org, key], 95)
    assert [(c.budget.level, c.threshold) for c in hold.crossed] == [("key", 50), ("key", 90)]
    assert [(c.budget.level, c.threshold) for c in limiter.hold_budgets(org, 405).crossed] == [
        ("org", 50)]


def test_a_callback_that_raises_is_logged_and_the_hold_stands(
        limiter: Any, caplog: pytest.LogCaptureFixture) -> None:
    budget = Budget("key-1", "daily", 100, "day", thresholds=(50,))

    def broken(crossing: BudgetCrossing) -> None:
        raise RuntimeError("the webhook is down")

    limiter.on_budget_threshold = broken
    caplog.set_level(logging.WARNING, logger="genai_ratelimit")
    hold = limiter.hold_budgets(budget, 60)
    assert hold.allowed and thresholds_of(hold.crossed) == [50]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "on_budget_threshold raised" in errors[0].getMessage()
    assert errors[0].exc_info is not None and "webhook is down" in str(errors[0].exc_info[1])
    assert limiter.settle_budgets(hold, 60) == 1  # the hold was made: it settles


@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="an async callback is awaited")
def test_an_async_callback_is_awaited_and_may_raise(loop_factory: Any, redis_url: str,
                                                    redis_client: redis.Redis,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    budget = Budget("key-1", "daily", 100, "day", thresholds=(50, 80))
    seen: list[int] = []

    async def send(crossing: BudgetCrossing) -> None:
        await asyncio.sleep(0)
        seen.append(crossing.threshold)
        if crossing.threshold == 80:
            raise RuntimeError("503 from the webhook")

    async def run() -> tuple[Any, Any]:
        async with AsyncRateLimiter(redis_url) as limiter:
            limiter.on_budget_threshold = send
            first = await limiter.hold_budgets(budget, 60)
            second = await limiter.hold_budgets(budget, 30)
            return first, second

    from helpers_async import run_async
    caplog.set_level(logging.WARNING, logger="genai_ratelimit")
    first, second = run_async(run(), loop_factory)
    assert seen == [50, 80]
    assert first.allowed and second.allowed and thresholds_of(second.crossed) == [80]
    assert ["on_budget_threshold raised" in r.getMessage()
            for r in caplog.records if r.levelno == logging.ERROR] == [True]


@pytest.mark.limiter_kinds("asyncio", reason="cancellation is an asyncio matter")
def test_a_hold_cancelled_on_its_way_still_tells_its_crossing_once(
        loop_factory: Any, redis_url: str, redis_client: redis.Redis) -> None:
    """The caller is cancelled while the hold that crosses 50 % is on its way: the hold is
    given back once its reply is in, and the crossing it recorded is told (by the task that
    gives it back), once."""
    budget = Budget("org", "monthly", 100, thresholds=(50,))
    calls: list[BudgetCrossing] = []

    async def cancel_one() -> None:
        async with AsyncRateLimiter(redis_url) as limiter:
            limiter.on_budget_threshold = calls.append
            await limiter.hold_budgets(budget, 0)  # connected: the next hold is sent at once
            task = asyncio.ensure_future(limiter.hold_budgets(budget, 60))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert limiter._leftovers  # the give-back runs on its own
        assert budget_thresholds(limiter).total() == 1

    from helpers_async import run_async
    run_async(cancel_one(), loop_factory)
    assert thresholds_of(calls) == [50]
    (key,) = redis_client.keys("*budget=monthly")
    assert int(redis_client.hget(key, "held")) == 0 and int(redis_client.hget(key, "fired")) == 50


@pytest.mark.limiter_kinds("asyncio", reason="cancellation is an asyncio matter")
def test_a_caller_cancelled_in_its_async_callback_leaves_nothing_held(
        loop_factory: Any, redis_url: str, redis_client: redis.Redis) -> None:
    budget = Budget("org", "monthly", 100, thresholds=(50,))
    entered = asyncio.Event()

    async def slow(crossing: BudgetCrossing) -> None:
        entered.set()
        await asyncio.Event().wait()  # a webhook that never answers

    async def cancel_in_callback() -> None:
        async with AsyncRateLimiter(redis_url) as limiter:
            limiter.on_budget_threshold = slow
            task = asyncio.ensure_future(limiter.hold_budgets(budget, 60))
            await entered.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    from helpers_async import run_async
    run_async(cancel_in_callback(), loop_factory)
    (key,) = redis_client.keys("*budget=monthly")
    assert redis_client.hmget(key, "spent", "held", "fired") == [b"0", b"0", b"50"]


@pytest.mark.limiter_kinds("sync", reason="threads share one blocking RateLimiter; the async "
                                          "kinds run the same race as tasks below")
def test_threads_crossing_together_fire_each_threshold_once(limiter: Any) -> None:
    budget = Budget("org", "monthly", 200, thresholds=(50, 80, 95))
    calls = recorder(limiter)
    lock = threading.Lock()
    crossed: list[int] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        for _ in range(30):
            hold = limiter.hold_budgets(budget, 1)
            with lock:
                crossed.extend(thresholds_of(hold.crossed))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(crossed) == [50, 80, 95]
    assert sorted(thresholds_of(calls)) == [50, 80, 95]
    assert budget_thresholds(limiter).total() == 3


@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="tasks on one AsyncRateLimiter")
def test_tasks_crossing_together_fire_each_threshold_once(loop_factory: Any, redis_url: str,
                                                          redis_client: redis.Redis) -> None:
    budget = Budget("org", "monthly", 100, thresholds=(50, 80, 95))
    calls: list[int] = []

    async def race() -> tuple[list[int], int]:
        async with AsyncRateLimiter(redis_url) as limiter:
            limiter.on_budget_threshold = lambda c: calls.append(c.threshold)
            holds = await asyncio.gather(*(limiter.hold_budgets(budget, 1) for _ in range(120)))
            return [t for h in holds for t in thresholds_of(h.crossed)], budget_thresholds(
                limiter).total()

    from helpers_async import run_async
    crossed, counted = run_async(race(), loop_factory)
    assert sorted(crossed) == sorted(calls) == [50, 80, 95] and counted == 3


WORKER = '''
import json, sys, threading
from genai_ratelimit import Budget, RateLimiter

limiter = RateLimiter(sys.argv[1])
budget = Budget("org:multi", "monthly", 400, thresholds=(25, 50, 75, 100))
calls, lock = [], threading.Lock()

def record(crossing):
    with lock:
        calls.append(crossing.threshold)

limiter.on_budget_threshold = record

def worker():
    for _ in range(60):
        limiter.hold_budgets(budget, 1)

threads = [threading.Thread(target=worker) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(calls))
'''


@pytest.mark.limiter_kinds("sync", reason="processes of blocking RateLimiters")
def test_two_processes_crossing_together_fire_each_threshold_once(
        redis_url: str, redis_client: redis.Redis, tmp_path: Any) -> None:
    """2 processes x 4 threads hold 480 units against 400: every threshold fires in exactly
    one process, once."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    workers = [subprocess.Popen([sys.executable, str(script), redis_url],
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    calls: list[int] = []
    for w in workers:
        out, _ = w.communicate(timeout=60)
        assert w.returncode == 0
        calls += json.loads(out)
    assert sorted(calls) == [25, 50, 75, 100]


def test_a_replayed_hold_reports_its_crossing_once(make_limiter: Any, redis_client: redis.Redis,
                                                   redis_port: int) -> None:
    """The reply of the hold that crossed 50 % is lost after Redis ran it; the replay
    (proto.c's marker) holds nothing more and reports the crossing the first attempt
    recorded: told once, never twice, and no later hold tells it again."""
    redis_client.script_load(_native.BUDGET_HOLD_SOURCE)
    redis_client.script_load(_native.BUDGET_SETTLE_SOURCE)
    budget = Budget("org", "daily", 100, "day", "Europe/Paris", thresholds=(50, 80))
    proxy = ReplyDroppingProxy(redis_port, drop=1)
    try:
        with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as limiter:
            calls = recorder(limiter)
            hold = limiter.hold_budgets(budget, 60)
            metric = budget_thresholds(native(limiter)).total()
    finally:
        proxy.close()
    assert len(proxy.dropped_replies) == 1
    assert hold.allowed and thresholds_of(hold.crossed) == [50] and thresholds_of(calls) == [50]
    assert metric == 1
    key = budget_key(budget, hold.periods[0].period_start_ms)
    assert int(redis_client.hget(key, "held")) == 60
    with make_limiter(f"redis://127.0.0.1:{redis_port}/0") as limiter:
        assert limiter.hold_budgets(budget, 10).crossed == ()  # 70: 50 fired already
        # A settle above its hold whose reply is lost: replayed, reported once.
        proxy = ReplyDroppingProxy(redis_port, drop=1)
        try:
            with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as replaying:
                settled = replaying.settle_budgets(hold, 75)
        finally:
            proxy.close()
        assert len(proxy.dropped_replies) == 1
        assert settled == 0 and thresholds_of(settled.crossed) == [80]  # found by the first
        assert limiter.settle_budgets(hold, 75).crossed == ()  # settled again: not told again


def test_the_script_replayed_tells_the_crossing_and_a_second_call_does_not(
        redis_client: redis.Redis) -> None:
    """The scripts themselves: the same hold run again with the replay marker answers the
    first run's crossing (fired_by names it) and records nothing; the same hold id without
    the marker tells nothing (the reply has no soft-limit elements); a settle is told again
    only when replayed."""
    budget = Budget("org", "daily", 100, "day", thresholds=(50, 80))
    now = 1_780_000_000_000
    (previous, _), (start, end), (_, following) = (budget.period_at(budget.period_at(now)[0] - 1),
                                                   budget.period_at(now),
                                                   budget.period_at(budget.period_at(now)[1]))
    keys = [budget_key(budget, s) for s in (previous, start, end)]
    hold_id = "6f1c1b4e-8a31-4c55-9c1e-2f3b8f1a7d10"
    argv = [hold_id, now, 3_600_000, 100, 60, previous, start, end, following, 50080]
    script = _native.BUDGET_HOLD_SOURCE
    assert redis_client.eval(script, 3, *keys, *argv)[7:] == [[0], [50]]
    assert redis_client.eval(script, 3, *keys, *argv, "1")[7:] == [[0], [50]]
    assert len(redis_client.eval(script, 3, *keys, *argv)) == 7  # nothing to tell: no more
    assert redis_client.hmget(keys[1], "held", "fired") == [b"60", b"50"]
    settle = _native.BUDGET_SETTLE_SOURCE
    assert redis_client.eval(settle, 1, keys[1], hold_id, 90, 100, 50080) == [1, [50], [80]]
    assert redis_client.eval(settle, 1, keys[1], hold_id, 90, 100, 50080, "1") == [0, [50], [80]]
    assert redis_client.eval(settle, 1, keys[1], hold_id, 90, 100, 50080) == 0
    assert redis_client.hmget(keys[1], "spent", "held", "fired") == [b"90", b"0", b"80"]


def test_the_next_period_fires_again(make_limiter: Any, redis_url: str,
                                     redis_client: redis.Redis) -> None:
    limiter = make_limiter(redis_url, clock="client")
    budget = Budget("key-1", "daily", 100, "day", "Europe/Paris", thresholds=(50,))
    calls = recorder(limiter)
    with ManualClock(1_780_000_000_000) as clock:
        first = limiter.hold_budgets(budget, 60)
        assert thresholds_of(first.crossed) == [50]
        assert limiter.hold_budgets(budget, 10).crossed == ()
        clock.set(first.periods[0].period_end_ms)  # 00:00 the next day, Paris
        fresh = limiter.hold_budgets(budget, 50)
    assert thresholds_of(fresh.crossed) == [50]
    assert fresh.crossed[0].period_start_ms == first.periods[0].period_end_ms
    assert [c.period_start_ms for c in calls] == [first.periods[0].period_start_ms,
                                                  first.periods[0].period_end_ms]


def test_the_crossings_are_exported_with_bounded_labels(limiter: Any) -> None:
    budget = Budget("user:8421", "monthly_usd", 100, thresholds=(50,), level="user")
    anonymous = Budget("user:8421", "daily", 10, "day", thresholds=(80,))
    limiter.hold_budgets([budget, anonymous], 9)
    limiter.hold_budgets(budget, 41)
    rows = [(labels, value) for family, labels, value in samples(exported(native(limiter)))
            if family.name == "budget_thresholds_crossed"]
    assert rows == [(("daily", "none", "80"), 1), (("monthly_usd", "user", "50"), 1)]
    assert not any("8421" in "".join(labels) for labels, _ in rows)  # no owner id


# ---------------------------------------------------------------- no I/O


def test_the_crossings_of_several_workers_add_up(unreachable_limiter: Any) -> None:
    """PrometheusCollector(directory=...) sums each worker's snapshot, read back from JSON."""
    snapshot = exported(native(unreachable_limiter))
    one = {**snapshot, "budget_thresholds": (("monthly_usd", "key", "50", 2),)}
    two = {**snapshot, "budget_thresholds": (("monthly_usd", "key", "50", 1),
                                             ("daily", "none", "80", 1))}
    merged = merge_snapshots([_from_json(json.loads(json.dumps(one))),
                              _from_json(json.loads(json.dumps(two)))])
    assert merged["budget_thresholds"] == (("daily", "none", "80", 1),
                                           ("monthly_usd", "key", "50", 3))



@pytest.mark.parametrize(("thresholds", "error", "match"), [
    ((0,), ValueError, r"thresholds\[0\] must be from 1 to 100"),
    ((101,), ValueError, r"thresholds\[0\] must be from 1 to 100"),
    ((50, 50), ValueError, "strictly increasing"),
    ((80, 50), ValueError, "strictly increasing"),
    ((10, 20, 30, 40, 50, 60), ValueError, "at most 5"),
    ((50.0,), TypeError, r"thresholds\[0\] must be an int"),
    ((True,), TypeError, r"thresholds\[0\] must be an int"),
    ("50", TypeError, "thresholds must be a sequence"),
    (50, TypeError, "thresholds must be a sequence"),
])
def test_bad_thresholds_are_refused_when_the_budget_is_built(thresholds: Any,
                                                             error: type[Exception],
                                                             match: str) -> None:
    with pytest.raises(error, match=match):
        Budget("key-1", "daily", 100, "day", thresholds=thresholds)


def test_thresholds_given_as_a_list_are_kept_as_a_tuple() -> None:
    budget = Budget("key-1", "daily", 100, "day", thresholds=[50, 80])
    assert budget.thresholds == (50, 80) and hash(budget) == hash(
        Budget("key-1", "daily", 100, "day", thresholds=(50, 80)))
