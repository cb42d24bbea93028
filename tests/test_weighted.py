"""Weighted checks: `cost` units per request, the honest retry for weights, the running
total beside each window (lua/sliding_window.lua's weights hash), and token windows kept
apart from request windows. Every test runs for every limiter kind (tests/conftest.py),
against the session's real redis-server; what the script logged is read back from Redis.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import pytest
import redis

from genai_ratelimit import RateLimiterError
from helpers_async import LimiterFactory, run_async
from helpers_core import SORTED_SET_SHAPE, Monitor, logged_entries, server_ms


def logged_cost(client: redis.Redis, key: str) -> int:
    """The cost a window holds, summed from the log itself: 1 per entry plus the extra of
    each weighted entry (the weights hash), never from the running total."""
    weights = {m: int(c) for m, c in client.hgetall(f"{key}:w").items() if m != b""}
    return sum(weights.get(member, 1) for member in client.zrange(key, 0, -1))


def running_total(client: redis.Redis, key: str) -> int:
    """The cost the script counts: ZCARD + the weights' "" field."""
    return client.zcard(key) + int(client.hget(f"{key}:w", "") or 0)


# --------------------------------------------------------------- cost=1 is today's check

@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_cost_one_logs_exactly_what_a_plain_check_logs(limiter: Any, redis_client: redis.Redis,
                                                       user_id: str) -> None:
    assert limiter.check(user_id, 3, 60, cost=1) == (True, 2, 0)
    assert limiter.check(user_id, 3, 60) == (True, 1, 0)
    key = f"ratelimit:{user_id}:60"
    assert logged_entries(redis_client, key) == 2
    assert not redis_client.exists(f"{key}:w"), "plain entries must not create the weights hash"
    assert sorted(redis_client.keys(f"ratelimit:{user_id}*")) == [key.encode()]


# ------------------------------------------------------------------ weighted decisions

@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_weighted_checks_admit_while_the_cost_fits(limiter: Any, redis_client: redis.Redis,
                                                   user_id: str) -> None:
    results = [limiter.check(user_id, 100, 60, cost=7) for _ in range(15)]
    assert [r[:2] for r in results[:14]] == [(True, 100 - 7 * (n + 1)) for n in range(14)]
    assert results[14][:2] == (False, 0) and results[14][2] >= 1
    key = f"ratelimit:{user_id}:60"
    assert logged_cost(redis_client, key) == 98 == running_total(redis_client, key)


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_plain_and_weighted_checks_share_one_budget(limiter: Any, redis_client: redis.Redis,
                                                    user_id: str) -> None:
    assert limiter.check(user_id, 10, 60, cost=6) == (True, 4, 0)
    assert limiter.check(user_id, 10, 60) == (True, 3, 0)
    assert limiter.check_windows(user_id, [(10, 60)], cost=3) == (True, 0, 0, 60)
    assert limiter.check(user_id, 10, 60)[0] is False
    assert logged_cost(redis_client, f"ratelimit:{user_id}:60") == 10


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_every_window_is_charged_the_cost(limiter: Any, redis_client: redis.Redis,
                                          user_id: str) -> None:
    assert limiter.check_windows(user_id, [(20, 60), (50, 3600)], cost=8) == (True, 12, 0, 60)
    assert limiter.check_windows(user_id, [(20, 60), (50, 3600)], cost=8) == (True, 4, 0, 60)
    allowed, remaining, retry, window = limiter.check_windows(user_id, [(20, 60), (50, 3600)],
                                                              cost=8)
    assert (allowed, remaining, window) == (False, 0, 60) and retry >= 1
    for seconds in (60, 3600):
        assert logged_cost(redis_client, f"ratelimit:{user_id}:{seconds}") == 16


@pytest.mark.parametrize("cost, error", [(0, ValueError), (-3, ValueError), (True, TypeError),
                                         (1.5, TypeError), ("2", TypeError), (2**53, ValueError)])
def test_a_bad_cost_is_refused_before_any_io(unreachable_limiter: Any, cost: Any,
                                             error: type[Exception]) -> None:
    with pytest.raises(error, match="cost"):
        unreachable_limiter.check("u", 10, 60, cost=cost)
    with pytest.raises(error, match="cost"):
        unreachable_limiter.check_windows("u", [(10, 60)], cost=cost)


def test_a_cost_above_a_limit_can_never_fit_and_is_refused_before_any_io(
        unreachable_limiter: Any) -> None:
    with pytest.raises(ValueError, match=r"cost 11 can never be allowed: the window of 60 s "
                                         r"allows at most 10"):
        unreachable_limiter.check("u", 10, 60, cost=11)
    with pytest.raises(ValueError, match="the window of 86400 s allows at most 50"):
        unreachable_limiter.check_windows("u", [(100, 60), (50, 86400)], cost=60)


def test_cost_is_keyword_only(unreachable_limiter: Any) -> None:
    with pytest.raises(TypeError):
        unreachable_limiter.check("u", 10, 60, 2)


# -------------------------------------------------------------- the retry for weights

@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_retry_after_waits_for_the_entries_whose_costs_free_enough(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    """Entries of costs 5, 1, 30, 2 in a 60-unit window (used 38); a request of cost 40 needs
    38 + 40 - 60 = 18 units freed: the 1st (5), 2nd (1) and 3rd (30) must leave, so the
    retry is the third entry's expiry, against its score read back."""
    key = f"ratelimit:{user_id}:60"
    for cost in (5, 1, 30, 2):
        assert limiter.check(user_id, 60, 60, cost=cost)[0] is True
    scores = [int(score) for _, score in redis_client.zrange(key, 0, -1, withscores=True)]
    before = server_ms(redis_client)
    allowed, remaining, retry = limiter.check(user_id, 60, 60, cost=40)
    after = server_ms(redis_client)
    assert (allowed, remaining) == (False, 0)
    expected = {max(1, math.ceil((scores[2] + 60_000 - now) / 1000)) for now in (before, after)}
    assert retry in set(range(min(expected), max(expected) + 1))
    # Had it counted entries rather than costs it would name the 18th entry (none) or the 1st.
    assert logged_cost(redis_client, key) == 38, "a rejection writes nothing"


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_retry_after_of_plain_entries_is_unchanged(limiter: Any, redis_client: redis.Redis,
                                                   user_id: str) -> None:
    key = f"ratelimit:{user_id}:60"
    for _ in range(3):
        limiter.check(user_id, 3, 60)
    oldest = int(redis_client.zrange(key, 0, 0, withscores=True)[0][1])
    before = server_ms(redis_client)
    allowed, _, retry = limiter.check(user_id, 3, 60)
    after = server_ms(redis_client)
    assert not allowed
    assert max(1, math.ceil((oldest + 60_000 - after) / 1000)) <= retry
    assert retry <= max(1, math.ceil((oldest + 60_000 - before) / 1000))


# -------------------------------------------------------- the running total is kept exact

def wait_until_server_ms(client: redis.Redis, deadline_ms: int) -> None:
    """Waits for the server's clock (not a guessed sleep): polls TIME, at most 5 s."""
    for _ in range(500):
        if server_ms(client) > deadline_ms:
            return
        threading.Event().wait(0.01)
    pytest.fail("the server's clock did not reach the deadline within 5 s")


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_entries_leaving_the_window_take_their_weight_with_them(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    key = f"ratelimit:{user_id}:1"
    assert limiter.check(user_id, 10, 1, cost=7)[0] is True
    assert limiter.check(user_id, 10, 1)[0] is True
    assert limiter.check(user_id, 10, 1, cost=3)[0] is False
    newest = int(redis_client.zrange(key, -1, -1, withscores=True)[0][1])
    wait_until_server_ms(redis_client, newest + 1000)
    assert limiter.check(user_id, 10, 1, cost=9) == (True, 1, 0)
    assert running_total(redis_client, key) == 9 == logged_cost(redis_client, key)
    assert int(redis_client.hget(f"{key}:w", "")) == 8


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_the_weights_hash_empty_field_holds_the_sum_of_cost_minus_one(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    # README: the field "" is the sum of (cost - 1) over the weighted entries, so that used
    # = ZCARD + it; the entries' own fields hold their costs.
    key = f"ratelimit:{user_id}:60"
    for cost in (5, 1, 3):
        assert limiter.check(user_id, 100, 60, cost=cost)[0] is True
    weights = {field.decode(): int(value) for field, value in redis_client.hgetall(f"{key}:w").items()}
    assert weights.pop("") == (5 - 1) + (3 - 1)
    assert sorted(weights.values()) == [3, 5]
    assert redis_client.zcard(key) + (5 - 1) + (3 - 1) == 5 + 1 + 3


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_the_weights_hash_lives_as_long_as_its_window(limiter: Any, redis_client: redis.Redis,
                                                      user_id: str) -> None:
    key = f"ratelimit:{user_id}:60"
    limiter.check(user_id, 100, 60, cost=5)
    assert 0 < redis_client.ttl(f"{key}:w") <= 61
    assert 0 < redis_client.ttl(key) <= 61


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_a_window_of_many_entries_is_trimmed_in_batches(limiter: Any, redis_client: redis.Redis,
                                                        user_id: str) -> None:
    """2,500 weighted entries leave at once (more than Lua's unpack takes in one call)."""
    key = f"ratelimit:{user_id}:60"
    now = server_ms(redis_client)
    old = now - 120_000
    members = {f"00000000-0000-4000-8000-{n:012d}": old + n for n in range(2500)}
    redis_client.zadd(key, members)
    redis_client.hset(f"{key}:w", mapping={**{m: 3 for m in members}, "": 2 * 2500})
    assert limiter.check(user_id, 10, 60, cost=4) == (True, 6, 0)
    assert logged_entries(redis_client, key) == 1
    assert redis_client.hlen(f"{key}:w") == 2 and redis_client.hget(f"{key}:w", "") == b"3"
    assert running_total(redis_client, key) == 4 == logged_cost(redis_client, key)


# ---------------------------------------------------------------- exact under concurrency

@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_fifty_callers_of_cost_seven_against_a_limit_of_one_hundred_admit_exactly_fourteen(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        user_id: str) -> None:
    key = f"ratelimit:{user_id}:60"
    if make_limiter.is_async:
        async def main() -> list[tuple[bool, int, int]]:
            limiter = make_limiter.native(redis_url)
            try:
                return await asyncio.gather(*(limiter.check(user_id, 100, 60, cost=7)
                                              for _ in range(200)))
            finally:
                await limiter.aclose()

        results = run_async(main(), make_limiter.loop_factory)
    else:
        limiter = make_limiter(redis_url)
        results = []
        barrier = threading.Barrier(50)
        lock = threading.Lock()

        def one() -> None:
            barrier.wait(10)
            result = limiter.check(user_id, 100, 60, cost=7)
            with lock:
                results.append(result)

        threads = [threading.Thread(target=one) for _ in range(50)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert sum(1 for r in results if r[0]) == 14
    assert sorted(r[1] for r in results if r[0]) == [100 - 7 * n for n in range(14, 0, -1)]
    assert logged_cost(redis_client, key) == 98 == running_total(redis_client, key)


# ------------------------------------------------------------------------- token keys

@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
@pytest.mark.parametrize("user", ["u", "u:60", "u:60:tokens", "60", "tokens", "u:w", "ns:x:60"])
def test_token_windows_never_share_a_key_with_request_windows(
        limiter: Any, redis_client: redis.Redis, user_id: str, user: str) -> None:
    """A token window's key ends in ":tokens" and every request window's key in its length,
    for any user id: the budgets of two users, or of one user's requests and tokens, never
    meet. Requests and tokens of the ids around `user` all land on distinct keys."""
    base = f"{user_id}:{user}"
    reservation = limiter.reserve(base, [(5, 60)], token_windows=[(1000, 60)], tokens=10)
    assert reservation.allowed
    others = [f"{base}:60", f"{base}:60:tokens", f"{base}:tokens"]
    for other in others:
        assert limiter.check(other, 1, 60) == (True, 0, 0)
    keys = sorted(redis_client.keys(f"ratelimit:{user_id}*"))
    assert len(keys) == len(set(keys))
    assert logged_entries(redis_client, f"ratelimit:{base}:60") == 1
    assert running_total(redis_client, f"ratelimit:{base}:60:tokens") == 10


def test_a_closed_limiter_refuses_weighted_calls(make_limiter: LimiterFactory,
                                                 redis_url: str) -> None:
    limiter = make_limiter(redis_url)
    limiter.close()
    with pytest.raises(RateLimiterError):
        limiter.check("u", 10, 60, cost=2)


# ----------------------------------------------------------- the running totals (:t)

def prefill_without_totals(client: redis.Redis, key: str, count: int, start_ms: int
                           ) -> list[tuple[str, int, int]]:
    """`count` weighted entries (costs 2..40), one per ms from start_ms, as a version of the
    script that kept no running totals logged them: the sorted set and the weights hash.
    Returns (member, time, cost) in the set's order."""
    entries = [(f"00000000-0000-4000-8000-{n:012d}", start_ms + n, 2 + n * 7 % 39)
               for n in range(count)]
    client.zadd(key, {member: at for member, at, _ in entries})
    client.hset(f"{key}:w", mapping={**{member: cost for member, _, cost in entries},
                                     "": sum(cost - 1 for _, _, cost in entries)})
    for name in (key, f"{key}:w"):
        client.expire(name, 3600)
    return entries


def freeing_wait_ms(entries: list[tuple[str, int, int]], need: int, window_ms: int,
                    now_ms: int) -> int:
    """The wait the contract defines, by walking the entries oldest first: until the one at
    which the costs add up to `need` leaves the window."""
    freed = 0
    for _, at, cost in entries:
        freed += cost
        if freed >= need:
            return max(1, at + window_ms - now_ms)
    return window_ms


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_a_refusal_on_a_weighted_window_finds_its_entry_in_a_few_commands(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    """The entry whose leaving frees enough is found by a search on the running totals, not
    by walking the window 64 entries at a time (3,000 entries: 94 ZRANGE + HMGET before)."""
    key = f"ratelimit:{user_id}:3600"
    entries = prefill_without_totals(redis_client, key, 3000, server_ms(redis_client) - 600_000)
    total = sum(cost for _, _, cost in entries)
    limit = total // 2
    first = limiter.check_windows_detailed(user_id, [(limit, 3600)], cost=5)  # builds the totals
    assert redis_client.exists(f"{key}:t")
    with Monitor(redis_client) as monitor:
        second = limiter.check_windows_detailed(user_id, [(limit, 3600)], cost=5)
    commands = [c.name for c in monitor.commands if c.from_script]
    assert len(commands) < 30, commands
    for decision in (first, second):
        assert decision[0] is False
        assert decision.retry_after_ms == freeing_wait_ms(entries, total + 5 - limit, 3_600_000,
                                                          decision.timestamp_ms)


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_peek_on_a_window_without_totals_walks_it_and_writes_nothing(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    key = f"ratelimit:{user_id}:3600"
    entries = prefill_without_totals(redis_client, key, 500, server_ms(redis_client) - 600_000)
    total = sum(cost for _, _, cost in entries)
    raw = limiter._peek(user_id, [(total // 3, 3600)], cost=3)
    assert raw[0] is False
    assert raw[7] == freeing_wait_ms(entries, total + 3 - total // 3, 3_600_000, raw[5])
    assert not redis_client.exists(f"{key}:t"), "a read-only script built the totals"


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_totals_that_disagree_with_the_window_are_rebuilt_before_a_search(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    """Written by an older process during a rolling upgrade, say: the search notices."""
    key = f"ratelimit:{user_id}:3600"
    entries = prefill_without_totals(redis_client, key, 300, server_ms(redis_client) - 600_000)
    total = sum(cost for _, _, cost in entries)
    assert limiter.check_windows(user_id, [(total // 2, 3600)])[0] is False
    # An older version logs one more weighted entry, in the middle, without its total.
    middle = entries[150][1]
    redis_client.zadd(key, {"00000000-0000-4000-9000-000000000000": middle})
    redis_client.hset(f"{key}:w", "00000000-0000-4000-9000-000000000000", 30)
    redis_client.hincrby(f"{key}:w", "", 29)
    entries = sorted([*entries, ("00000000-0000-4000-9000-000000000000", middle, 30)],
                     key=lambda e: (e[1], e[0]))
    decision = limiter.check_windows_detailed(user_id, [(total // 2, 3600)])
    assert decision.retry_after_ms == freeing_wait_ms(entries, total + 30 + 1 - total // 2,
                                                      3_600_000, decision.timestamp_ms)


def assert_totals_follow_the_log(client: redis.Redis, key: str) -> None:
    """Every weighted entry's running total is the origin plus the costs of the entries up to
    and including it, in the set's order; only weighted entries have one."""
    weights = {m: int(c) for m, c in client.hgetall(f"{key}:w").items() if m != b""}
    totals = {m: int(s) for m, s in client.zrange(f"{key}:t", 0, -1, withscores=True)}
    running = totals.pop(b"")
    for member in client.zrange(key, 0, -1):
        running += weights.get(member, 1)
        if member in weights:
            assert totals.pop(member) == running, member
    assert totals == {}


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_reconcile_moves_the_running_totals_of_every_entry_after_it(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    """Near the end (read at once with the last totals) or far from it (39 weighted entries
    after it), to a cost, to 1 (no total of its own) or to 0 (gone)."""
    key = f"ratelimit:{user_id}:3600:tokens"
    reservations = [limiter.reserve(user_id, [(1000, 3600)], token_windows=[(10**6, 3600)],
                                    tokens=100 + n) for n in range(40)]
    costs = [100 + n for n in range(40)]
    for index, actual in ((0, 7), (30, 1), (35, 0), (38, 500), (2, 0), (39, 1)):
        assert limiter.reconcile(reservations[index], actual) == 1
        costs[index] = actual
        assert_totals_follow_the_log(redis_client, key)
        assert logged_cost(redis_client, key) == running_total(redis_client, key) == sum(costs)
    decision = limiter.reserve(user_id, [(1000, 3600)], token_windows=[(sum(costs), 3600)],
                               tokens=10)
    assert decision.allowed is False
    assert limiter.reconcile(reservations[0], 7) == 1  # the same cost again: nothing moves
    assert_totals_follow_the_log(redis_client, key)


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_entries_logged_before_later_ones_keep_every_running_total_exact(
        redis_client: redis.Redis, user_id: str) -> None:
    """Members of one millisecond sort by their text, so a new entry often lands before the
    last ones (its total and theirs from the window's, in one ZADD); a clock far behind puts
    it before many (the search by rank). Either way the totals follow the log, and a
    refusal waits for the entry the walk finds."""
    import random
    import uuid

    from genai_ratelimit import _native

    sha, source = _native.SCRIPT_SHA1, _native.SCRIPT_SOURCE
    redis_client.script_load(source)
    key = f"ratelimit:{user_id}:3600"
    start = server_ms(redis_client)
    pick = random.Random(5)
    logged: list[tuple[str, int, int]] = []

    def log(at: int, cost: int, limit: int = 10**9) -> list[Any]:
        member = str(uuid.UUID(int=pick.getrandbits(128), version=4))
        reply = redis_client.evalsha(sha, 3, key, f"{key}:w", f"{key}:t", member, at,
                                     3_600_000, limit, cost)
        if reply[0] == 1:
            logged.append((member, at, cost))
        return reply  # type: ignore[no-any-return]

    for n in range(60):  # 20 milliseconds of 3 entries, costs 1 to 9
        log(start + n // 3, pick.choice([1, 1, 3, 9]))
    assert_totals_follow_the_log(redis_client, key)
    for n in range(5):  # a clock 1 s behind: before all of them
        log(start - 1000 + n, pick.choice([1, 4]))
        assert_totals_follow_the_log(redis_client, key)
    logged.sort(key=lambda e: (e[1], e[0]))
    used = sum(cost for _, _, cost in logged)
    now = start + 100
    refused = log(now, 5, limit=used)
    assert refused[0] == 0
    assert refused[6] == freeing_wait_ms(logged, 5, 3_600_000, now)
