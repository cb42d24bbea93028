"""reserve -> reconcile: requests and tokens decided together, all or nothing, in one script
execution; the estimate corrected afterwards from real usage (lua/reconcile.lua), exactly,
idempotently, and safely after a lost reply. Every test runs for every limiter kind
(tests/conftest.py) against a real redis-server; what was logged is read back from Redis.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import redis

from genai_ratelimit import Reservation, _native
from helpers_async import LimiterFactory
from helpers_core import SORTED_SET_SHAPE, logged_entries, server_ms
from test_idempotent_retry import ReplyDroppingProxy, redis_port  # noqa: F401 (a fixture)
from test_weighted import logged_cost, running_total, wait_until_server_ms

REQUESTS = [(5, 60), (100, 86400)]
TOKENS = [(1000, 60), (20_000, 86400)]


def token_key(user: str, seconds: int = 60) -> str:
    return f"ratelimit:{user}:{seconds}:tokens"


def entry_cost(client: redis.Redis, key: str, member: str) -> int | None:
    """The cost of one logged entry, read back (None when it is not in the window)."""
    if client.zscore(key, member) is None:
        return None
    cost = client.hget(f"{key}:w", member)
    return int(cost) if cost is not None else 1


# ------------------------------------------------------------------------------ reserve

@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_reserve_logs_one_entry_in_every_window(limiter: Any, redis_client: redis.Redis,
                                                user_id: str) -> None:
    before = server_ms(redis_client)
    r = limiter.reserve(user_id, REQUESTS, token_windows=TOKENS, tokens=300)
    after = server_ms(redis_client)
    assert isinstance(r, Reservation)
    assert (r.allowed, r.retry_after_s, r.resource, r.user_id, r.cost, r.tokens) == (
        True, 0, "requests", user_id, 1, 300)
    assert r.remaining_requests == 4 and r.remaining_tokens == 700
    assert [(w.limit, w.window_seconds, w.resource, w.remaining) for w in r.windows] == [
        (5, 60, "requests", 4), (1000, 60, "tokens", 700),
        (100, 86400, "requests", 99), (20_000, 86400, "tokens", 19_700)]
    assert before <= r.timestamp_ms <= after
    for seconds in (60, 86400):
        assert entry_cost(redis_client, f"ratelimit:{user_id}:{seconds}", r.member) == 1
        assert entry_cost(redis_client, token_key(user_id, seconds), r.member) == 300
        assert redis_client.zscore(token_key(user_id, seconds), r.member) == r.timestamp_ms


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_a_request_refused_by_a_token_window_consumes_no_request_budget(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    assert limiter.reserve(user_id, REQUESTS, token_windows=TOKENS, tokens=900).allowed
    r = limiter.reserve(user_id, REQUESTS, token_windows=TOKENS, tokens=200)
    assert (r.allowed, r.resource, r.window_seconds, r.member) == (False, "tokens", 60, "")
    assert r.retry_after_s >= 1
    assert r.remaining_requests == 4, "the request window keeps what it had"
    assert logged_entries(redis_client, f"ratelimit:{user_id}:60") == 1
    assert running_total(redis_client, token_key(user_id)) == 900
    # The day windows, after the refusing minute window, were never reached.
    assert [w.remaining for w in r.windows if w.window_seconds == 86400] == [None, None]


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_a_request_refused_by_a_request_window_consumes_no_tokens(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    for _ in range(5):
        assert limiter.reserve(user_id, REQUESTS, token_windows=TOKENS, tokens=10).allowed
    r = limiter.reserve(user_id, REQUESTS, token_windows=TOKENS, tokens=10)
    assert (r.allowed, r.resource, r.window_seconds) == (False, "requests", 60)
    assert running_total(redis_client, token_key(user_id)) == 50
    assert running_total(redis_client, token_key(user_id, 86400)) == 50


def test_reserve_validates_everything_before_any_io(unreachable_limiter: Any) -> None:
    with pytest.raises(ValueError, match="tokens 1001 can never be allowed: the token window "
                                         "of 60 s allows at most 1000"):
        unreachable_limiter.reserve("u", REQUESTS, token_windows=TOKENS, tokens=1001)
    with pytest.raises(ValueError, match="token_windows need tokens="):
        unreachable_limiter.reserve("u", REQUESTS, token_windows=TOKENS)
    with pytest.raises(ValueError, match="tokens= needs token_windows"):
        unreachable_limiter.reserve("u", REQUESTS, tokens=5)
    with pytest.raises(ValueError, match="at least one window"):
        unreachable_limiter.reserve("u", [])
    with pytest.raises(ValueError, match="token window_seconds 60 appears twice"):
        unreachable_limiter.reserve("u", token_windows=[(10, 60), (20, 60)], tokens=1)
    with pytest.raises(TypeError, match="token_windows"):
        unreachable_limiter.reserve("u", REQUESTS, token_windows="60", tokens=1)


def test_reserve_with_token_windows_only(limiter: Any, redis_client: redis.Redis,
                                         user_id: str) -> None:
    r = limiter.reserve(user_id, token_windows=[(100, 60)], tokens=40)
    assert (r.allowed, r.remaining, r.resource, r.remaining_requests) == (True, 60, "tokens", None)
    assert not redis_client.exists(f"ratelimit:{user_id}:60")


# ---------------------------------------------------------------------------- reconcile

@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_a_refund_frees_the_budget_at_once(limiter: Any, redis_client: redis.Redis,
                                           user_id: str) -> None:
    r = limiter.reserve(user_id, REQUESTS, token_windows=TOKENS, tokens=900)
    assert not limiter.reserve(user_id, REQUESTS, token_windows=TOKENS, tokens=500).allowed
    assert limiter.reconcile(r, 250) == 2
    assert entry_cost(redis_client, token_key(user_id), r.member) == 250
    assert entry_cost(redis_client, token_key(user_id, 86400), r.member) == 250
    assert entry_cost(redis_client, f"ratelimit:{user_id}:60", r.member) == 1, \
        "request windows keep counting the request once"
    assert limiter.reserve(user_id, REQUESTS, token_windows=TOKENS, tokens=500).allowed
    assert running_total(redis_client, token_key(user_id)) == 750 == logged_cost(
        redis_client, token_key(user_id))


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_an_overage_charges_and_delays_later_requests_by_the_right_time(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    r = limiter.reserve(user_id, token_windows=[(1000, 60)], tokens=100)
    assert limiter.reconcile(r, 1200) == 1
    key = token_key(user_id)
    assert running_total(redis_client, key) == 1200, "used may go above the limit"
    before = server_ms(redis_client)
    later = limiter.reserve(user_id, token_windows=[(1000, 60)], tokens=1)
    after = server_ms(redis_client)
    assert not later.allowed
    # 1200 + 1 - 1000 = 201 units must leave: the overcharged entry itself.
    low = max(1, math.ceil((r.timestamp_ms + 60_000 - after) / 1000))
    high = max(1, math.ceil((r.timestamp_ms + 60_000 - before) / 1000))
    assert low <= later.retry_after_s <= high
    # The same wait to the millisecond, not rounded up: for a retry-after-ms header.
    assert r.timestamp_ms + 60_000 - after <= later.retry_after_ms <= r.timestamp_ms + 60_000 - before
    assert later.retry_after_s == math.ceil(later.retry_after_ms / 1000)


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_reconcile_is_idempotent(limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    r = limiter.reserve(user_id, token_windows=[(1000, 60)], tokens=400)
    limiter.reserve(user_id, token_windows=[(1000, 60)], tokens=7)
    assert limiter.reconcile(r, 90) == 1
    state = (redis_client.zrange(token_key(user_id), 0, -1, withscores=True),
             redis_client.hgetall(f"{token_key(user_id)}:w"))
    assert limiter.reconcile(r, 90) == 1
    assert (redis_client.zrange(token_key(user_id), 0, -1, withscores=True),
            redis_client.hgetall(f"{token_key(user_id)}:w")) == state
    assert running_total(redis_client, token_key(user_id)) == 97


def test_reconcile_to_zero_removes_the_entry(limiter: Any, redis_client: redis.Redis,
                                             user_id: str) -> None:
    r = limiter.reserve(user_id, token_windows=[(1000, 60)], tokens=400)
    assert limiter.reconcile(r, 0) == 1
    assert redis_client.zscore(token_key(user_id), r.member) is None
    assert not redis_client.exists(f"{token_key(user_id)}:w")
    assert limiter.reconcile(r, 0) == 0
    assert limiter.reconcile(r, 50) == 0, "a removed entry is not brought back"


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_reconcile_to_one_leaves_a_plain_entry(limiter: Any, redis_client: redis.Redis,
                                               user_id: str) -> None:
    r = limiter.reserve(user_id, token_windows=[(1000, 60)], tokens=400)
    assert limiter.reconcile(r, 1) == 1
    assert not redis_client.exists(f"{token_key(user_id)}:w")
    assert running_total(redis_client, token_key(user_id)) == 1


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_reconcile_of_a_weighted_request_reservation_corrects_its_cost(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    r = limiter.reserve(user_id, [(100, 60)], cost=30)
    assert limiter.reconcile(r, 12) == 1
    assert entry_cost(redis_client, f"ratelimit:{user_id}:60", r.member) == 12


def test_reconcile_is_a_no_op_once_the_entry_left_the_window(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    r = limiter.reserve(user_id, token_windows=[(1000, 1)], tokens=300)
    wait_until_server_ms(redis_client, r.timestamp_ms + 1000)
    assert limiter.reconcile(r, 900) == 0
    assert entry_cost(redis_client, token_key(user_id, 1), r.member) in (None, 300)


def test_reconcile_of_a_refused_reservation_sends_nothing(unreachable_limiter: Any) -> None:
    refused = Reservation(allowed=False, remaining=0, retry_after_s=3, retry_after_ms=2500,
                          window_seconds=60,
                          resource="tokens", user_id="u", cost=1, tokens=5, windows=(),
                          member="", timestamp_ms=1)
    assert unreachable_limiter.reconcile(refused, 10) == 0


@pytest.mark.parametrize("actual, error", [(-1, ValueError), (1.0, TypeError), (True, TypeError),
                                           (None, TypeError)])
def test_reconcile_refuses_a_bad_actual(limiter: Any, user_id: str, actual: Any,
                                        error: type[Exception]) -> None:
    r = limiter.reserve(user_id, token_windows=[(1000, 60)], tokens=10)
    with pytest.raises(error, match="actual"):
        limiter.reconcile(r, actual)


def test_reconcile_needs_a_reservation(unreachable_limiter: Any) -> None:
    with pytest.raises(TypeError, match="Reservation"):
        unreachable_limiter.reconcile(("u", "m"), 10)


def test_the_kill_switch_reserves_without_redis_and_reconciles_nothing(
        unreachable_limiter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "1")
    r = unreachable_limiter.reserve("u", REQUESTS, token_windows=TOKENS, tokens=300)
    assert (r.allowed, r.remaining, r.member) == (True, 5, "")
    assert r.remaining_tokens == 1000
    assert unreachable_limiter.reconcile(r, 10) == 0


# ------------------------------------------------------------------- lost replies

@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_a_reserve_whose_reply_was_lost_is_counted_once(
        make_limiter: LimiterFactory, redis_client: redis.Redis, redis_port: int,  # noqa: F811
        user_id: str) -> None:
    redis_client.script_load(_native.SCRIPT_SOURCE)  # the first attempt runs the script
    proxy = ReplyDroppingProxy(redis_port, drop=1)
    try:
        with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as limiter:
            r = limiter.reserve(user_id, [(1, 60)], token_windows=[(100, 60)], tokens=100)
    finally:
        proxy.close()
    assert len(proxy.dropped_replies) == 1
    assert (r.allowed, r.remaining) == (True, 0)
    assert logged_entries(redis_client, f"ratelimit:{user_id}:60") == 1
    assert running_total(redis_client, token_key(user_id)) == 100


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_a_reconcile_whose_reply_was_lost_never_charges_twice(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        redis_port: int, user_id: str) -> None:  # noqa: F811
    with make_limiter(redis_url) as limiter:
        r = limiter.reserve(user_id, token_windows=[(1000, 60)], tokens=100)
    redis_client.script_load(_native.RECONCILE_SOURCE)
    proxy = ReplyDroppingProxy(redis_port, drop=1)
    try:
        with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as limiter:
            assert limiter.reconcile(r, 700) == 1
    finally:
        proxy.close()
    assert len(proxy.dropped_replies) == 1
    assert running_total(redis_client, token_key(user_id)) == 700


def test_a_refund_to_zero_of_a_plain_entry_gives_its_request_back(limiter: Any,
                                                                     user_id: str) -> None:
    """A request window of cost-1 entries (no weights): reconcile(r, 0) removes the entry,
    so the budget is whole again; replayed, it finds nothing."""
    first = limiter.reserve(user_id, [(2, 60)])
    second = limiter.reserve(user_id, [(2, 60)])
    assert (first.allowed, second.allowed) == (True, True)
    assert limiter.reconcile(first, 0) == 1
    assert limiter.check_windows(user_id, [(2, 60)])[:2] == (True, 0)
    assert limiter.reconcile(first, 0) == 0
    assert limiter.check_windows(user_id, [(2, 60)])[0] is False
