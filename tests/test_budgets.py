"""Calendar budgets with holds in flight (genai_ratelimit/periods.py, lua/lib/budget.lua):
the period arithmetic on fixed instants (DST days of 23 and 25 hours, months at local
midnight, weeks from Monday), then hold_budgets / settle_budgets on every limiter kind
against a real redis-server: all or nothing across levels, the refusal's reason, exact
under concurrency (spent + held sampled in Redis), settle and replay idempotent, a hold
settled after the boundary charged to the period that admitted it (on a ManualClock), and
bad input refused before any I/O. Budgets keep no window log: the storage does not apply.
"""

from __future__ import annotations

import asyncio
import random
import threading
from datetime import datetime, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from fake_redis import FakeRedis, Reply
from genai_ratelimit import (
    AsyncRateLimiter,
    Budget,
    BudgetHold,
    BudgetPeriod,
    RateLimiter,
    RateLimiterError,
    _native,
)
from genai_ratelimit.periods import period_bounds
from genai_ratelimit.testing import ManualClock

pytestmark = pytest.mark.storages("zset", reason="budgets keep no window log: one hash per "
                                                 "budget and period in either storage")

PARIS = ZoneInfo("Europe/Paris")
HOUR_MS = 3_600_000


def utc_ms(*fields: int) -> int:
    """A UTC wall time as unix ms (fields: year, month, day, hour, minute, second, ms)."""
    ms = fields[6] if len(fields) > 6 else 0
    return int(datetime(*fields[:6], tzinfo=timezone.utc).timestamp()) * 1000 + ms


def paris_ms(*fields: int) -> int:
    """A Paris wall time as unix ms (the first occurrence of an ambiguous one)."""
    ms = fields[6] if len(fields) > 6 else 0
    return int(datetime(*fields[:6], tzinfo=PARIS).timestamp()) * 1000 + ms


def budget_key(budget: Budget, start_ms: int, prefix: str = "ratelimit") -> str:
    return f"{prefix}:{budget.owner}:{start_ms}:budget={budget.name}"


def stored(client: redis.Redis, budget: Budget, start_ms: int) -> dict[str, int]:
    """The budget's hash in that period: spent, held (0 when absent) and one field per hold
    (not "until", the key's expiry, which test_a_hold_then_settle_moves_the_amount_to_spent
    reads)."""
    fields = client.hgetall(budget_key(budget, start_ms))
    return {"spent": 0, "held": 0, **{k.decode(): int(v) for k, v in fields.items()
                                      if k != b"until"}}


# ------------------------------------------------------------- periods, no I/O


def test_the_paris_autumn_day_lasts_25_hours() -> None:
    start, end = period_bounds("day", PARIS, paris_ms(2026, 10, 25, 12, 0, 0))
    assert start == utc_ms(2026, 10, 24, 22, 0, 0)  # 00:00 CEST
    assert end == utc_ms(2026, 10, 25, 23, 0, 0)  # 00:00 CET
    assert end - start == 25 * HOUR_MS


def test_the_paris_spring_day_lasts_23_hours() -> None:
    start, end = period_bounds("day", PARIS, paris_ms(2026, 3, 29, 12, 0, 0))
    assert (start, end - start) == (utc_ms(2026, 3, 28, 23, 0, 0), 23 * HOUR_MS)


def test_a_month_starts_at_local_midnight_on_the_first() -> None:
    november = utc_ms(2026, 10, 31, 23, 0, 0)  # 00:00 on 1 November in Paris (CET)
    assert period_bounds("month", PARIS, november - 1) == (utc_ms(2026, 9, 30, 22, 0, 0), november)
    assert period_bounds("month", PARIS, november)[0] == november
    assert period_bounds("month", PARIS, november)[1] == utc_ms(2026, 11, 30, 23, 0, 0)
    # In UTC the same instant is still October.
    assert period_bounds("month", ZoneInfo("UTC"), november)[0] == utc_ms(2026, 10, 1, 0, 0, 0)


def test_a_week_starts_on_monday() -> None:
    saturday = paris_ms(2026, 12, 5, 9, 0, 0)
    start, end = period_bounds("week", PARIS, saturday)
    assert start == paris_ms(2026, 11, 30, 0, 0, 0)  # Monday
    assert end == paris_ms(2026, 12, 7, 0, 0, 0)


ZONES = ["UTC", "Europe/Paris", "America/New_York", "America/Santiago", "Asia/Beirut",
         "Australia/Lord_Howe", "Pacific/Chatham", "America/Havana", "Asia/Kolkata"]


@settings(max_examples=300, deadline=None)
@given(zone=st.sampled_from(ZONES), period=st.sampled_from(["day", "week", "month"]),
       instant=st.integers(utc_ms(2000, 1, 1, 0, 0, 0), utc_ms(2040, 1, 1, 0, 0, 0)))
def test_periods_tile_time_at_local_midnights(zone: str, period: str, instant: int) -> None:
    """Every instant lies in its period; the next period starts where it ends; both ends are
    the first instant of their local day (DST gaps at midnight included)."""
    tz = ZoneInfo(zone)
    start, end = period_bounds(period, tz, instant)
    assert start <= instant < end
    assert period_bounds(period, tz, end)[0] == end
    assert period_bounds(period, tz, start - 1)[1] == start
    for edge in (start, end):
        local = datetime.fromtimestamp(edge / 1000, tz)
        before = datetime.fromtimestamp((edge - 1000) / 1000, tz)
        assert before.date() < local.date()  # a new local day begins at the edge
        if period == "month":
            assert local.day == 1
        if period == "week":
            assert local.weekday() == 0


# ---------------------------------------------------------- bad input, no I/O


@pytest.mark.parametrize(("kwargs", "error", "text"), [
    ({"tz": "Europe/Atlantis"}, ValueError, "Europe/Atlantis"),
    ({"tz": "../etc/passwd"}, ValueError, "../etc/passwd"),
    ({"tz": 1}, TypeError, "tz"),
    ({"limit": 0}, ValueError, "limit"),
    ({"limit": True}, TypeError, "limit"),
    ({"limit": 2**53}, ValueError, "limit"),
    ({"period": "year"}, ValueError, "period"),
    ({"owner": ""}, ValueError, "owner"),
    ({"name": "x" * 300}, ValueError, "name"),
])
def test_a_bad_budget_is_refused_when_built(kwargs: dict[str, Any], error: type[Exception],
                                             text: str) -> None:
    arguments: dict[str, Any] = {"owner": "org", "name": "monthly", "limit": 10, **kwargs}
    with pytest.raises(error, match=text.replace(".", r"\.")):
        Budget(**arguments)


def test_bad_hold_and_settle_arguments_raise_before_any_io(unreachable_limiter: Any) -> None:
    budget = Budget("org", "monthly", 10)
    for amount, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError),
                          ([1, 2], ValueError)):
        with pytest.raises(error, match="amount"):
            unreachable_limiter.hold_budgets([budget], amount)
    with pytest.raises(ValueError, match="appears twice"):
        unreachable_limiter.hold_budgets([budget, Budget("org", "monthly", 5)], 1)
    with pytest.raises(TypeError, match="Budget"):
        unreachable_limiter.hold_budgets(["org"], 1)
    with pytest.raises(ValueError, match="1 to 16"):
        unreachable_limiter.hold_budgets([], 1)
    with pytest.raises(ValueError, match="hold_seconds"):
        unreachable_limiter.hold_budgets([budget], 1, hold_seconds=-1)
    hold = BudgetHold(allowed=True, hold_id="0" * 36, periods=(), now_ms=0)
    with pytest.raises(TypeError, match="hold"):
        unreachable_limiter.settle_budgets("not a hold", 1)
    with pytest.raises(ValueError, match="actual"):
        unreachable_limiter.settle_budgets(hold, [1])


# ------------------------------------------------------------------ on Redis


def test_a_hold_then_settle_moves_the_amount_to_spent(limiter: Any,
                                                       redis_client: redis.Redis) -> None:
    budget = Budget("team-a", "daily_tokens", 1000, "day", "Europe/Paris", level="team")
    hold = limiter.hold_budgets(budget, 300)
    assert hold.allowed and len(hold.hold_id) == 36 and hold.reason is None
    (period,) = hold.periods
    assert period.remaining == 700 and period.amount == 300
    assert period.period_start_ms <= hold.now_ms < period.period_end_ms
    assert (period.period_start_ms, period.period_end_ms) == budget.period_at(hold.now_ms)
    assert stored(redis_client, budget, period.period_start_ms) == {
        "spent": 0, "held": 300, hold.hold_id: 300}
    assert limiter.settle_budgets(hold, 120) == 1
    assert stored(redis_client, budget, period.period_start_ms) == {"spent": 120, "held": 0}
    # Settling again (or a replay after a lost reply) changes nothing.
    assert limiter.settle_budgets(hold, 120) == 0
    assert limiter.settle_budgets(hold, 999) == 0
    assert stored(redis_client, budget, period.period_start_ms) == {"spent": 120, "held": 0}
    # The key lives until its period's end plus the longest hold (a day by default).
    key = budget_key(budget, period.period_start_ms)
    ttl = redis_client.pttl(key)
    expected = period.period_end_ms + 86_400_000 - hold.now_ms
    assert expected - 5_000 <= ttl <= expected
    assert int(redis_client.hget(key, "until")) == period.period_end_ms + 86_400_000
    # A longer hold extends the key's life; a shorter one never shortens it.
    limiter.hold_budgets(budget, 1, hold_seconds=2 * 86_400)
    assert redis_client.pttl(key) > expected + 86_400_000 - 5_000
    limiter.hold_budgets(budget, 1, hold_seconds=60)
    assert redis_client.pttl(key) > expected + 86_400_000 - 5_000


def test_a_settle_above_the_hold_is_charged_and_zero_gives_it_back(
        limiter: Any, redis_client: redis.Redis) -> None:
    budget = Budget("key-1", "monthly_usd", 1_000_000)  # micro-USD
    first = limiter.hold_budgets(budget, 150_000)
    second = limiter.hold_budgets(budget, 150_000)
    start = first.periods[0].period_start_ms
    assert limiter.settle_budgets(first, 170_000) == 1  # more than held: charged
    assert limiter.settle_budgets(second, 0) == 1  # released unused
    assert stored(redis_client, budget, start) == {"spent": 170_000, "held": 0}
    assert limiter.hold_budgets(budget, 0).periods[0].remaining == 830_000


def test_the_refusal_names_the_budget_and_its_reason(limiter: Any) -> None:
    budget = Budget("key-1", "daily", 100, "day", "Europe/Paris", level="key")
    other = Budget("org", "monthly", 10_000, level="org")
    permanent = limiter.hold_budgets([other, budget], 101)
    assert (permanent.allowed, permanent.refused, permanent.reason) == (False, 1, "permanent")
    assert permanent.refused_by is not None and permanent.refused_by.budget is budget
    assert permanent.reset_at_ms == permanent.periods[1].period_end_ms
    assert permanent.hold_id == ""
    held = limiter.hold_budgets([other, budget], 60)
    in_flight = limiter.hold_budgets([other, budget], 60)
    assert (in_flight.allowed, in_flight.refused, in_flight.reason) == (False, 1, "in_flight")
    assert in_flight.periods[1].remaining == 40 and in_flight.periods[0].remaining == 9_940
    limiter.settle_budgets(held, 60)
    until_reset = limiter.hold_budgets([other, budget], 60)
    assert (until_reset.refused, until_reset.reason) == (1, "until_reset")
    assert until_reset.reset_at_ms == budget.period_at(until_reset.now_ms)[1]


def test_a_refusal_by_any_level_holds_nothing_anywhere(limiter: Any,
                                                       redis_client: redis.Redis) -> None:
    org = Budget("org:acme", "monthly", 1000, "month", "Europe/Paris", level="org")
    team = Budget("team:a", "monthly", 500, "month", "Europe/Paris", level="team")
    key = Budget("key:k1", "daily", 300, "day", "Europe/Paris", level="key")
    user = Budget("user:u1", "daily", 100, "day", "Europe/Paris", level="user")
    levels = [org, team, key, user]
    first = limiter.hold_budgets(levels, 80)
    assert first.allowed
    starts = [p.period_start_ms for p in first.periods]

    def state() -> list[dict[str, int]]:
        return [stored(redis_client, b, start) for b, start in zip(levels, starts, strict=True)]

    before = state()
    assert [s["held"] for s in before] == [80, 80, 80, 80]
    # The user refuses (80 + 80 > 100): no org, team or key is charged.
    refused = limiter.hold_budgets(levels, 80)
    assert (refused.allowed, refused.refused, refused.reason) == (False, 3, "in_flight")
    assert refused.refused_by is not None and refused.refused_by.budget.level == "user"
    assert state() == before
    # The org refuses (80 + 950 > 1000): another user's budget is not charged.
    other_user = Budget("user:u2", "daily", 10_000, "day", "Europe/Paris", level="user")
    by_org = limiter.hold_budgets([org, other_user], 950)
    assert (by_org.refused, by_org.reason) == (0, "in_flight")
    assert redis_client.exists(budget_key(other_user, by_org.periods[1].period_start_ms)) == 0
    assert state() == before


def test_the_script_replayed_with_the_same_hold_id_holds_once(
        redis_url: str, redis_client: redis.Redis) -> None:
    """What proto.c's replay after a lost reply runs: the same command again, with the
    replay marker. The second run answers allowed and holds nothing more."""
    budget = Budget("org", "daily", 100, "day")
    now = utc_ms(2026, 12, 5, 12, 0, 0)
    previous, start, end, following = (budget.period_at(now - 86_400_000)[0],
                                       *budget.period_at(now), budget.period_at(now + 86_400_000)[1])
    keys = [budget_key(budget, s) for s in (previous, start, end)]
    hold_id = "6f1c1b4e-8a31-4c55-9c1e-2f3b8f1a7d10"
    argv = [hold_id, now, 3_600_000, 100, 30, previous, start, end, following, 0]
    script = _native.BUDGET_HOLD_SOURCE
    first = redis_client.eval(script, 3, *keys, *argv)
    second = redis_client.eval(script, 3, *keys, *argv, "1")
    assert first[:3] == second[:3] == [1, -1, 0]
    assert stored(redis_client, budget, start) == {"spent": 0, "held": 30, hold_id: 30}
    settle = _native.BUDGET_SETTLE_SOURCE
    assert redis_client.eval(settle, 1, keys[1], hold_id, 25, 100, 0) == 1
    assert redis_client.eval(settle, 1, keys[1], hold_id, 25, 100, 0, "1") == 0
    assert stored(redis_client, budget, start) == {"spent": 25, "held": 0}


def test_over_maxmemory_a_hold_writes_nothing(limiter: Any, redis_client: redis.Redis) -> None:
    budget = Budget("org", "daily", 100, "day")
    redis_client.config_set("maxmemory", 1)
    try:
        with pytest.raises(RateLimiterError, match="out of memory"):
            limiter.hold_budgets(budget, 10)
    finally:
        redis_client.config_set("maxmemory", 0)
    assert redis_client.keys("*budget=*") == []


def test_the_kill_switch_holds_nothing_and_its_settle_sends_nothing(
        unreachable_limiter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "1")
    budget = Budget("org", "daily", 100, "day")
    hold = unreachable_limiter.hold_budgets(budget, 1000)
    assert hold.allowed and hold.hold_id == "" and hold.periods[0].remaining == 100
    assert unreachable_limiter.settle_budgets(hold, 5) == 0


def test_a_hold_at_2359599_is_charged_to_the_period_that_admitted_it(
        make_limiter: Any, redis_url: str, redis_client: redis.Redis) -> None:
    """On a ManualClock (clock="client"): a daily budget in Paris on the 25-hour day. A
    hold made at 23:59:59.900 local and settled after midnight is charged to the old day;
    the new day starts with its whole limit. The client's own guess of the period (this
    machine's date) is weeks away: the script answers stale and the plan asks again."""
    limiter = make_limiter(redis_url, clock="client")
    budget = Budget("key-1", "daily", 100, "day", "Europe/Paris")
    old_day = (utc_ms(2026, 10, 24, 22, 0, 0), utc_ms(2026, 10, 25, 23, 0, 0))
    with ManualClock(paris_ms(2026, 10, 25, 23, 59, 59, 900)) as clock:
        hold = limiter.hold_budgets(budget, 70)
        assert hold.allowed
        assert hold.now_ms == clock.now_ms
        assert (hold.periods[0].period_start_ms, hold.periods[0].period_end_ms) == old_day
        clock.advance(0.2)  # 00:00:00.100 on the 26th
        fresh = limiter.hold_budgets(budget, 100)
        assert fresh.allowed and fresh.periods[0].period_start_ms == old_day[1]
        assert limiter.settle_budgets(hold, 90) == 1
    assert stored(redis_client, budget, old_day[0]) == {"spent": 90, "held": 0}
    assert stored(redis_client, budget, old_day[1]) == {"spent": 0, "held": 100,
                                                        fresh.hold_id: 100}


def test_a_monthly_budget_resets_at_local_midnight_on_the_first(
        make_limiter: Any, redis_url: str, redis_client: redis.Redis) -> None:
    limiter = make_limiter(redis_url, clock="client")
    budget = Budget("org", "monthly_usd", 50_000_000, "month", "Europe/Paris")
    with ManualClock(utc_ms(2026, 10, 31, 22, 30, 0)) as clock:  # 23:30 on 31 October, Paris
        limiter.settle_budgets(limiter.hold_budgets(budget, 50_000_000), 50_000_000)
        clock.set(utc_ms(2026, 10, 31, 22, 59, 59, 999))
        refused = limiter.hold_budgets(budget, 1)
        assert refused.reason == "until_reset"
        assert refused.reset_at_ms == utc_ms(2026, 10, 31, 23, 0, 0)  # not midnight UTC
        clock.set(utc_ms(2026, 10, 31, 23, 0, 0))
        allowed = limiter.hold_budgets(budget, 1)
        assert allowed.allowed and allowed.periods[0].remaining == 50_000_000 - 1


@pytest.mark.limiter_kinds("sync", reason="threads share one blocking RateLimiter; the async "
                                          "kinds run the same race as tasks below")
def test_concurrent_holds_never_exceed_the_budget(limiter: Any,
                                                  redis_client: redis.Redis) -> None:
    budget = Budget("org", "monthly", 50)
    probe = limiter.hold_budgets(budget, 0)
    start = probe.periods[0].period_start_ms
    limiter.settle_budgets(probe, 0)
    key = budget_key(budget, start)
    stop = threading.Event()
    samples: list[int] = []

    def sample() -> None:
        while not stop.is_set():
            spent, held = redis_client.hmget(key, "spent", "held")
            samples.append(int(spent or 0) + int(held or 0))

    admitted: list[BudgetHold] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(10):
            hold = limiter.hold_budgets(budget, 3)
            if hold.allowed:
                with lock:
                    admitted.append(hold)
                if len(admitted) % 2:
                    limiter.settle_budgets(hold, 2)

    sampler = threading.Thread(target=sample)
    sampler.start()
    workers = [threading.Thread(target=worker) for _ in range(8)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    sampler.join()
    assert samples and max(samples) <= 50
    for hold in admitted:
        limiter.settle_budgets(hold, 2)
    final = stored(redis_client, budget, start)
    assert final == {"spent": 2 * len(admitted), "held": 0}
    assert final["spent"] <= 50 and len(admitted) >= 16


@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="tasks on one AsyncRateLimiter")
def test_concurrent_async_holds_admit_exactly_what_fits(loop_factory: Any, redis_url: str,
                                                        redis_client: redis.Redis) -> None:
    budget = Budget("org", "monthly", 50)
    team = Budget("team", "monthly", 1000)

    async def race() -> list[BudgetHold]:
        async with AsyncRateLimiter(redis_url) as limiter:
            return list(await asyncio.gather(*(limiter.hold_budgets([team, budget], 3)
                                               for _ in range(40))))

    from helpers_async import run_async
    holds = run_async(race(), loop_factory)
    admitted = [h for h in holds if h.allowed]
    assert len(admitted) == 16  # 16 * 3 <= 50 < 17 * 3
    assert {h.reason for h in holds if not h.allowed} == {"in_flight"}
    start = admitted[0].periods[1].period_start_ms
    assert stored(redis_client, budget, start)["held"] == 48
    assert stored(redis_client, team, admitted[0].periods[0].period_start_ms)["held"] == 48


@pytest.mark.limiter_kinds("asyncio", reason="cancellation is an asyncio matter")
def test_a_cancelled_async_hold_leaves_nothing_held(loop_factory: Any, redis_url: str,
                                                    redis_client: redis.Redis) -> None:
    budget = Budget("org", "monthly", 50)

    async def cancel_one() -> None:
        async with AsyncRateLimiter(redis_url) as limiter:
            await limiter.hold_budgets(budget, 0)  # connected: the next hold is sent at once
            task = asyncio.ensure_future(limiter.hold_budgets(budget, 10))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    from helpers_async import run_async
    run_async(cancel_one(), loop_factory)
    (key,) = redis_client.keys("*budget=monthly")
    assert int(redis_client.hget(key, "held") or 0) == 0


def test_a_malformed_hold_or_settle_reply_raises(make_limiter: Any) -> None:
    budget = Budget("org", "monthly", 50)
    bad = [b"*2\r\n:1\r\n:0\r\n", b":1\r\n",
           b"*7\r\n:1\r\n:-1\r\n:0\r\n:1\r\n*0\r\n*0\r\n*0\r\n",  # no periods
           b"*7\r\n:1\r\n:-1\r\n:0\r\n:1\r\n*1\r\n:99\r\n*1\r\n:5\r\n*1\r\n:6\r\n",  # not sent
           b"*8\r\n:1\r\n:-1\r\n:0\r\n:1\r\n*0\r\n*0\r\n*0\r\n*0\r\n"]  # 8 elements
    for data in bad:
        with FakeRedis(Reply(data)) as fake:
            limiter = make_limiter(fake.url, socket_timeout=2.0)
            with pytest.raises(RateLimiterError):
                limiter.hold_budgets(budget, 1)
    hold = BudgetHold(allowed=True, hold_id="6f1c1b4e-8a31-4c55-9c1e-2f3b8f1a7d10", now_ms=1,
                      periods=(BudgetPeriod(budget, 1, 49, 0, 10),))
    for data in (b"+OK\r\n", b":2\r\n", b":-1\r\n", b"*1\r\n:1\r\n",  # 1 budget: 0 or 1
                 b"*3\r\n:2\r\n*1\r\n:0\r\n*1\r\n:0\r\n",
                 b"*3\r\n:1\r\n*1\r\n:50\r\n*1\r\n:40\r\n",  # fired fell
                 b"*3\r\n:1\r\n*1\r\n:0\r\n*1\r\n:101\r\n",  # above 100
                 b"*3\r\n:1\r\n*0\r\n*0\r\n"):
        with FakeRedis(Reply(data)) as fake:
            limiter = make_limiter(fake.url, socket_timeout=2.0)
            with pytest.raises(RateLimiterError):
                limiter.settle_budgets(hold, 1)


def test_cluster_keys_of_different_owners_are_refused_before_any_io() -> None:
    codec = _native.Codec("ratelimit", hash_tag=True)
    rows = tuple((owner, "monthly", 10, 1, 1, 2, 3, 4, 0) for owner in ("org:acme", "user:1"))
    with pytest.raises(ValueError, match="hash slot"):
        codec.hold_budgets("org:acme", rows, 1000)
    same = tuple(("org:acme", name, 10, 1, 1, 2, 3, 4, 0) for name in ("monthly", "daily"))
    assert codec.hold_budgets("org:acme", same, 1000) is not None


def test_rate_limiter_and_async_share_the_names() -> None:
    for name in ("hold_budgets", "settle_budgets"):
        assert callable(getattr(RateLimiter, name)) and callable(getattr(AsyncRateLimiter, name))


def test_a_client_clock_just_before_midnight_needs_one_round_trip(
        make_limiter: Any, redis_url: str, redis_client: redis.Redis) -> None:
    """The client guesses 23:59:59.999 while the script decides at 00:00:00.001 (another
    app server's clock, or the server's): the neighbouring period sent with the guess is
    the script's, so one call holds it in the new day."""
    from genai_ratelimit.periods import hold_plan
    from genai_ratelimit.reservation import advance

    limiter = make_limiter(redis_url, clock="client")

    def send(positional: tuple[Any, ...]) -> Any:  # the C call the limiter's driver makes
        if isinstance(limiter, RateLimiter):
            return limiter._hold_budgets(*positional)
        inner = limiter.inner
        return limiter.run(inner._run(inner._codec.hold_budgets(*positional)))

    budget = Budget("key-1", "daily", 100, "day", "Europe/Paris")
    midnight = paris_ms(2026, 12, 6, 0, 0, 0)
    plan = hold_plan([budget], 5, now_ms=midnight - 1)
    call, result = advance(plan)
    calls = 0
    with ManualClock(midnight + 1):
        while call is not None:
            calls += 1
            call, result = advance(plan, send(call[1]))
    assert calls == 1
    assert result.allowed and result.periods[0].period_start_ms == midnight
    assert stored(redis_client, budget, midnight)["held"] == 5


def test_reset_of_an_owner_leaves_its_budgets_alone(limiter: Any,
                                                    redis_client: redis.Redis) -> None:
    budget = Budget("user_8421", "daily", 100, "day")
    hold = limiter.hold_budgets(budget, 10)
    limiter.check("user_8421", 5, 60)
    assert limiter.reset("user_8421") == 1
    assert stored(redis_client, budget, hold.periods[0].period_start_ms)["held"] == 10


@pytest.mark.parametrize("seed", [7, 2026])
def test_random_holds_and_settles_leave_every_level_equal_to_its_settled_sum(
        limiter: Any, redis_client: redis.Redis, seed: int) -> None:
    """1,000 random holds and settles over 3 levels (an org, 2 teams, 4 users): every
    level's spent is the sum of its settled actuals, held the sum of its open holds, and no
    refusal held anything."""
    rng = random.Random(seed)
    org = Budget("org", "monthly", 5_000, level="org")
    teams = [Budget(f"team-{t}", "monthly", 2_000, level="team") for t in range(2)]
    users = [Budget(f"user-{u}", "daily", 600, "day", "Europe/Paris", level="user")
             for u in range(4)]
    spent: dict[Budget, int] = dict.fromkeys([org, *teams, *users], 0)
    open_holds: list[tuple[BudgetHold, int]] = []
    starts: dict[Budget, int] = {}
    for _ in range(1000):
        if open_holds and rng.random() < 0.45:
            hold, _amount = open_holds.pop(rng.randrange(len(open_holds)))
            actual = rng.randrange(0, 80)
            assert limiter.settle_budgets(hold, actual) == 3
            for period in hold.periods:
                spent[period.budget] += actual
            continue
        user = rng.randrange(4)
        levels = [org, teams[user // 2], users[user]]
        amount = rng.randrange(1, 60)
        hold = limiter.hold_budgets(levels, amount)
        for period in hold.periods:
            starts[period.budget] = period.period_start_ms
        if hold.allowed:
            open_holds.append((hold, amount))
    for budget in spent:
        if budget not in starts:
            continue
        held = sum(a for h, a in open_holds if any(p.budget == budget for p in h.periods))
        state = stored(redis_client, budget, starts[budget])
        assert (state["spent"], state["held"]) == (spent[budget], held), budget.owner
        assert len(state) == 2 + sum(1 for h, _ in open_holds
                                     if any(p.budget == budget for p in h.periods))


def test_one_owners_budgets_are_held_on_a_redis_cluster(make_limiter: Any,
                                                        redis_cluster: Any) -> None:
    """On a cluster each owner's keys carry it as their hash tag: one owner's budgets are held
    and settled there, in one script."""
    from redis.cluster import RedisCluster as ClusterClient

    limiter = make_limiter(redis_cluster.url)
    monthly = Budget("org:acme", "monthly_usd", 1_000, level="org")
    daily = Budget("org:acme", "daily_usd", 100, "day", "Europe/Paris", level="org")
    hold = limiter.hold_budgets([monthly, daily], 60)
    assert hold.allowed
    assert not limiter.hold_budgets([monthly, daily], 60).allowed
    assert limiter.settle_budgets(hold, 50) == 2
    inspector = ClusterClient(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        key = (f"ratelimit:{{org:acme}}:{hold.periods[1].period_start_ms}"
               ":budget=daily_usd")
        assert int(inspector.hget(key, "spent")) == 50
    finally:
        inspector.close()


def _answer(hold: BudgetHold) -> tuple[Any, ...]:
    """What a hold answers, but its ids and the instant it was decided at."""
    return (hold.allowed, hold.refused, hold.reason, hold.reset_at_ms,
            tuple((p.budget, p.amount, p.remaining, p.period_start_ms, p.period_end_ms)
                  for p in hold.periods))


def test_a_hierarchy_is_held_owner_by_owner_on_a_redis_cluster(
        make_limiter: Any, redis_cluster: Any, redis_url: str,
        redis_client: redis.Redis) -> None:
    """Budgets of an org, a key and a user (three hash slots) on a cluster: held owner by
    owner, with the answers one node gives for the same sequence; a refusal by the user
    gives back the org's and the key's holds exactly (sampled in Redis); a refusal by the
    org holds nothing at any level; the settle reaches every owner, once."""
    from redis.cluster import RedisCluster as ClusterClient

    org = Budget("org:acme", "monthly_usd", 1_000, level="org", thresholds=(10,))
    key = Budget("key:k-81", "daily_usd", 300, "day", "Europe/Paris", level="key")
    user = Budget("user:8421", "daily_usd", 200, "day", "Europe/Paris", level="user")
    levels = [org, key, user]
    cluster = make_limiter(redis_cluster.url)
    single = make_limiter(redis_url)
    inspector = ClusterClient(host="127.0.0.1", port=redis_cluster.nodes[0].port)

    def state(budget: Budget, hold: BudgetHold) -> tuple[int, int]:
        start = next(p.period_start_ms for p in hold.periods if p.budget == budget)
        stored = inspector.hgetall(f"ratelimit:{{{budget.owner}}}:{start}:budget={budget.name}")
        return int(stored.get(b"spent", 0)), int(stored.get(b"held", 0))

    try:
        first = [limiter.hold_budgets(levels, 150) for limiter in (cluster, single)]
        assert _answer(first[0]) == _answer(first[1]) and first[0].allowed
        assert len({p.hold_id for p in first[0].periods}) == 3  # one hold per owner
        assert [c.threshold for c in first[0].crossed] == [10] == \
            [c.threshold for c in first[1].crossed]
        # The user refuses (150 + 150 > 200, in flight): the org and the key give theirs back.
        second = [limiter.hold_budgets(levels, 150) for limiter in (cluster, single)]
        assert _answer(second[0]) == _answer(second[1])
        assert second[0].refused_by.budget == user and second[0].reason == "in_flight"
        assert second[0].hold_id == "" and second[0].periods[0].remaining == 850
        assert [state(b, first[0]) for b in levels] == [(0, 150)] * 3
        # The org refuses for good (permanent): nothing is held at the key or the user.
        third = [limiter.hold_budgets(levels, [2_000, 10, 10]) for limiter in (cluster, single)]
        assert _answer(third[0]) == _answer(third[1])
        assert third[0].refused_by.budget == org and third[0].reason == "permanent"
        assert [state(b, first[0]) for b in levels] == [(0, 150)] * 3
        # The settle reaches every owner once; again, nothing.
        for limiter in (cluster, single):
            assert limiter.settle_budgets(first[0] if limiter is cluster else first[1], 120) == 3
        assert cluster.settle_budgets(first[0], 120) == 0
        assert [state(b, first[0]) for b in levels] == [(120, 0)] * 3
        fourth = [limiter.hold_budgets(levels, 90) for limiter in (cluster, single)]
        assert _answer(fourth[0]) == _answer(fourth[1])
        assert fourth[0].reason == "until_reset" and fourth[0].refused_by.budget == user
        assert [state(b, first[0]) for b in levels] == [(120, 0)] * 3
    finally:
        inspector.close()


WORKER = '''
import json, random, sys, threading
from genai_ratelimit import Budget, RateLimiter

url, seed = sys.argv[1], int(sys.argv[2])
limiter = RateLimiter(url)
budget = Budget("org:multi", "monthly", 3000, "month", "Europe/Paris")
settled, lock = [], threading.Lock()

def work(index):
    rng = random.Random(seed * 100 + index)
    for _ in range(30):
        hold = limiter.hold_budgets(budget, 15)
        if hold.allowed:
            actual = rng.randrange(0, 16)
            assert limiter.settle_budgets(hold, actual) == 1
            with lock:
                settled.append(actual)

threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(settled))
'''


def test_four_processes_of_eight_threads_settle_exactly_under_the_cap(
        redis_url: str, redis_client: redis.Redis, tmp_path: Any) -> None:
    """4 processes x 8 threads hold 15 and settle 0 to 15 against one org's 3,000: spent +
    held (sampled in Redis) never passes the cap, and the final spent is the sum of every
    settled actual."""
    import json
    import subprocess
    import sys

    budget = Budget("org:multi", "monthly", 3000, "month", "Europe/Paris")
    key = budget_key(budget, budget.period_at(int(redis_client.time()[0]) * 1000)[0])
    script = tmp_path / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    workers = [subprocess.Popen([sys.executable, str(script), redis_url, str(seed)],
                                stdout=subprocess.PIPE, text=True) for seed in range(4)]
    samples = []
    while any(w.poll() is None for w in workers):
        spent, held = redis_client.hmget(key, "spent", "held")
        samples.append(int(spent or 0) + int(held or 0))
    settled = []
    for w in workers:
        out, _ = w.communicate(timeout=60)
        assert w.returncode == 0
        settled += json.loads(out)
    assert samples and max(samples) <= 3000
    assert stored(redis_client, budget, budget.period_at(
        int(redis_client.time()[0]) * 1000)[0]) == {"spent": sum(settled), "held": 0}
    assert len(settled) >= 200  # 3,000 / 15 admitted at least before the cap bites


@pytest.mark.parametrize("hash_tag", [False, True])
def test_the_key_grammar_reads_a_budget_key_back(hash_tag: bool) -> None:
    """_native.read_key (the command line's reading) takes a budget's key for a budget, its
    owner, its period's start and its name, never for a window."""
    owner, name, start = "org:a{c}me", "usd:daily%", 1_793_487_600_000
    tagged = _native.key_owner(owner, hash_tag)
    key = f"ratelimit:{tagged}:{start}:budget=usd%3Adaily%25"
    assert _native.read_key(key, "ratelimit", hash_tag) == ("budget", owner, start, False, name, "")
    assert _native.read_key(f"ratelimit:{tagged}:{start}:budget=", "ratelimit", hash_tag) is None


def test_a_replay_across_midnight_finds_the_hold_of_its_first_attempt(
        redis_client: redis.Redis) -> None:
    """The first attempt held at 23:59:59.999 and its reply was lost; the replay (the same
    command with the marker, the server's clock now past midnight) answers from the old day
    and holds nothing in the new one. Without the marker the same call is a new hold."""
    budget = Budget("org", "daily", 100, "day", "Europe/Paris")
    midnight = paris_ms(2026, 12, 6, 0, 0, 0)
    before, after = midnight - 1, midnight + 5
    previous, start, end, following = (budget.period_at(midnight - 86_400_001)[0],
                                       *budget.period_at(before),
                                       budget.period_at(midnight)[1])
    keys = [budget_key(budget, s) for s in (previous, start, end)]
    hold_id = "0b9f7a52-3c1d-4e8f-a6b2-9d0e1f2a3b4c"
    rest = [3_600_000, 100, 30, previous, start, end, following, 0]
    script = _native.BUDGET_HOLD_SOURCE
    first = redis_client.eval(script, 3, *keys, hold_id, before, *rest)
    assert first[:3] == [1, -1, 0] and first[5:7] == [[start], [end]]
    replay = redis_client.eval(script, 3, *keys, hold_id, after, *rest, "1")
    assert replay[:3] == [1, -1, 0] and replay[5:7] == [[start], [end]]
    assert redis_client.exists(keys[2]) == 0
    fresh = redis_client.eval(script, 3, *keys, hold_id, after, *rest)
    assert fresh[5:7] == [[end], [following]]
    assert stored(redis_client, budget, end)["held"] == 30


LEAK_CHILD = '''
import gc, json, os, sys
from genai_ratelimit import Budget, RateLimiter

PAGE = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

limiter = RateLimiter(sys.argv[1])
budgets = [Budget(f"owner-{i}", "monthly", 10**12, "month", "Europe/Paris") for i in range(4)]
bad = (("owner", "monthly", 0, 1, 1, 2, 3, 4, 0),)

def run(n):
    for i in range(n):
        limiter.settle_budgets(limiter.hold_budgets(budgets, i), i)
        try:
            limiter._hold_budgets("owner", bad, 1000)  # refused in C: limit 0
        except ValueError:
            pass

run(2_000)
gc.collect()
before = rss()
run(int(sys.argv[2]))
gc.collect()
print(json.dumps({"before": before, "after": rss()}))
'''


@pytest.mark.slow
@pytest.mark.skipif("libasan" in __import__("os").environ.get("LD_PRELOAD", ""),
                    reason="RSS under AddressSanitizer measures its quarantine, not leaks")
def test_holds_and_settles_do_not_grow_memory(redis_url: str, redis_client: redis.Redis,
                                              tmp_path: Any) -> None:
    """20,000 holds of 4 budgets, their settles and 20,000 holds refused in C: the child's
    resident memory stays flat (a leak of one small object per call would show)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "leak.py"
    script.write_text(LEAK_CHILD, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script), redis_url, "20000"], capture_output=True,
                          text=True, timeout=300, check=True)
    rss = json.loads(done.stdout)
    assert rss["after"] - rss["before"] < 2 * 1024 * 1024, rss


# ------------------------------------------- owner by owner (a cluster's plan), no I/O

def _drive_plan(plan: Any, answer: Any) -> tuple[list[tuple[str, tuple[Any, ...]]], Any]:
    """Runs a plan against `answer(name, positional)` (a reply, or an exception to throw):
    (the calls it made, its result)."""
    from genai_ratelimit.reservation import advance

    calls: list[tuple[str, tuple[Any, ...]]] = []
    call, result = advance(plan)
    while call is not None:
        calls.append((call[0], call[1]))
        reply = answer(call[0], call[1])
        if isinstance(reply, BaseException):
            call, result = advance(plan, error=reply)
        else:
            call, result = advance(plan, reply)
    return calls, result


def _script_reply(rows: tuple[Any, ...], refuse: dict[str, int], now: int = 1_000) -> Any:
    """What budget_hold.lua answers for `rows`: refuse {name: kind} names the budgets that
    refuse (the first of them answers), else allowed; remaining = limit - amount."""
    refused = next((i for i, row in enumerate(rows) if row[1] in refuse), -1)
    periods = tuple((row[2] - (row[3] if refused < 0 else 0), row[5], row[6], 0, 0) for row in rows)
    if refused < 0:
        return (1, -1, 0, now, f"id-{rows[0][0]}", periods)
    return (0, refused, refuse[rows[refused][1]], now, "", periods)


def test_owner_by_owner_asks_every_owner_and_answers_the_first_refusal() -> None:
    """Owners interleaved (a, b, a): b refuses at index 1 and a at index 2; a held nothing, b
    refused: the answer is index 1's, as one script's; nothing held is left to give back."""
    from genai_ratelimit.periods import hold_plan

    budgets = [Budget("a", "one", 100), Budget("b", "two", 100), Budget("a", "three", 100)]
    refuse = {"two": 3, "three": 2}
    calls, hold = _drive_plan(hold_plan(budgets, 10, grouped=True),
                              lambda name, args: _script_reply(args[1], refuse))
    assert [(name, args[0]) for name, args in calls] == [("hold_budgets", "a"),
                                                          ("hold_budgets", "b")]
    assert not hold.allowed and hold.refused == 1 and hold.reason == "in_flight"
    assert hold.hold_id == "" and all(p.hold_id == "" for p in hold.periods)
    assert [p.remaining for p in hold.periods] == [100, 100, 100]


def test_owner_by_owner_gives_back_the_owners_that_held_when_a_later_one_refuses() -> None:
    from genai_ratelimit.periods import hold_plan

    budgets = [Budget("org", "m", 100, level="org"), Budget("key", "d", 100, level="key"),
               Budget("user", "d", 100, level="user")]
    calls, hold = _drive_plan(
        hold_plan(budgets, 10, grouped=True),
        lambda name, args: _script_reply(args[1], {} if args[0] != "user" else {"d": 2})
        if name == "hold_budgets" else (1, ((0, 0),)))
    assert [(name, args[0]) for name, args in calls] == [
        ("hold_budgets", "org"), ("hold_budgets", "key"), ("hold_budgets", "user"),
        ("settle_budgets", "org"), ("settle_budgets", "key")]
    for _, args in calls[3:]:  # each owner's own hold, settled to 0 in its period
        (row,) = args[1]
        assert row[3] == 0 and args[2] == f"id-{row[0]}"
    assert hold.refused_by.budget.level == "user" and hold.reason == "until_reset"
    assert [p.remaining for p in hold.periods] == [100, 100, 100]  # before the holds


def test_owner_by_owner_gives_back_and_raises_when_a_step_fails() -> None:
    from genai_ratelimit.periods import hold_plan

    budgets = [Budget("org", "m", 100), Budget("key", "d", 100)]
    gone = RateLimiterError("Redis went away")

    def answer(name: str, args: tuple[Any, ...]) -> Any:
        if name == "settle_budgets":
            return (1, ((0, 0),))
        return gone if args[0] == "key" else _script_reply(args[1], {})

    with pytest.raises(RateLimiterError, match="went away"):
        _drive_plan(hold_plan(budgets, 10, grouped=True), answer)
    plan = hold_plan(budgets, 10, grouped=True)
    calls: list[str] = []
    try:
        _drive_plan(plan, lambda name, args: calls.append(f"{name} {args[0]}") or answer(name, args))
    except RateLimiterError:
        pass
    assert calls == ["hold_budgets org", "hold_budgets key", "settle_budgets org"]


def test_an_allowed_hold_owner_by_owner_settles_owner_by_owner() -> None:
    from genai_ratelimit.periods import hold_plan, settle_plan

    budgets = [Budget("org", "m", 100, thresholds=(5,)), Budget("key", "d", 100),
               Budget("org", "w", 100, "week")]
    _, hold = _drive_plan(hold_plan(budgets, [10, 20, 30], grouped=True),
                          lambda name, args: _script_reply(args[1], {}))
    assert hold.allowed and hold.hold_id == "id-org"
    assert [p.hold_id for p in hold.periods] == ["id-org", "id-key", "id-org"]
    assert [p.remaining for p in hold.periods] == [90, 80, 70]
    fired = {"org": ((0, 5), (0, 0)), "key": ((0, 0),)}
    calls, settled = _drive_plan(settle_plan(hold, [7, 8, 9]),
                                 lambda name, args: (len(args[1]), fired[args[0]]))
    assert [(args[0], args[2], tuple(row[3] for row in args[1])) for _, args in calls] == [
        ("org", "id-org", (7, 9)), ("key", "id-key", (8,))]
    assert settled == 3 and [(c.budget.name, c.threshold, c.hold_id) for c in settled.crossed] \
        == [("m", 5, "id-org")]


@pytest.mark.limiter_kinds("asyncio", reason="cancellation is an asyncio matter")
def test_a_hold_cancelled_between_owners_on_a_cluster_leaves_nothing_held(
        loop_factory: Any, redis_cluster: Any) -> None:
    """The caller is cancelled once the org and the key held, while the user's step is on its
    way: no further owner is held, and the holds made are given back in the background."""
    from redis.cluster import RedisCluster as ClusterClient

    from helpers_async import run_async

    levels = [Budget("org:acme", "monthly", 100, level="org"),
              Budget("key:k-1", "daily", 100, "day", level="key"),
              Budget("user:1", "daily", 100, "day", level="user")]
    answered: list[int] = []

    async def cancel_between() -> None:
        async with AsyncRateLimiter(redis_cluster.url) as limiter:
            await limiter.hold_budgets(levels[0], 0)  # connected
            original = limiter._run

            async def run(request: Any, *args: Any, **kwargs: Any) -> Any:
                answer = await original(request, *args, **kwargs)
                answered.append(1)
                if len(answered) == 2:  # the org's and the key's holds are in
                    task = asyncio.current_task()
                    assert task is not None
                    task.cancel()
                return answer

            limiter._run = run  # type: ignore[method-assign]
            with pytest.raises(asyncio.CancelledError):
                await limiter.hold_budgets(levels, 10)
            assert limiter._leftovers  # the give-back runs on its own
        # aclose waited for it

    run_async(cancel_between(), loop_factory)
    inspector = ClusterClient(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        for budget in levels:
            (key,) = inspector.keys(f"ratelimit:{{{budget.owner}}}:*:budget={budget.name}",
                                    target_nodes=ClusterClient.PRIMARIES) or [None]
            if budget.level == "org" or key is not None:
                assert key is not None and int(inspector.hget(key, "held") or 0) == 0, budget
    finally:
        inspector.close()
