"""peek and reset: peek answers what the next check would, from a read-only script that
writes nothing (lua/peek.lua); reset forgets a user's entries at once (lua/reset.lua), in
the windows named or in every window of the user. Every test runs for every limiter kind
(tests/conftest.py) against a real redis-server; what Redis holds is read back.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from genai_ratelimit import RateLimiterUnavailable, Scope, _native
from helpers_core import SORTED_SET_SHAPE, Monitor, logged_entries, wait_until_server_ms

WINDOWS = [(3, 60), (5, 3600)]
READ_ONLY = {"ZCOUNT", "ZCARD", "ZRANGE", "ZRANGEBYSCORE", "ZRANK", "ZSCORE", "HGET", "HMGET", "TIME"}


def key(user: str, seconds: int, suffix: str = "") -> str:
    return f"ratelimit:{user}:{seconds}{suffix}"


def snapshot(client: redis.Redis, user: str) -> dict[bytes, tuple[bytes | None, int]]:
    """Every key of the user: its serialized value and its TTL in ms."""
    keys = client.keys(f"ratelimit:{user}:*")
    return {k: (client.dump(k), client.pttl(k)) for k in keys}


def assert_peek_matches_reserve(limiter: Any, user: str, windows: list[tuple[int, int]],
                                **arguments: Any) -> None:
    """Peeks, then reserves with the same arguments: the same decision and deciding window,
    the same remaining, and on a refusal the same moment at which the refusing window frees
    enough (now + wait: the two calls run a few ms apart)."""
    native = {**arguments, "scopes": tuple(s.native() for s in arguments.get("scopes", ()))}
    peek = limiter._peek(user, windows, **native)
    r = limiter.reserve(user, windows, **arguments)
    assert (peek[0], peek[1], peek[3], peek[4]) == (
        r.allowed, r.remaining, r.window_seconds, r.resource == "tokens")
    if r.allowed:
        assert (peek[2], peek[7]) == (0, 0)
    else:
        assert peek[5] + peek[7] == r.timestamp_ms + r.retry_after_ms


# --------------------------------------------------------------------------------- peek

def test_peek_answers_what_the_next_check_answers(limiter: Any, user_id: str) -> None:
    for _ in range(4):
        before = limiter.peek(user_id, WINDOWS)
        assert limiter.check_windows(user_id, WINDOWS)[:2] == before[:2]
    assert limiter.peek(user_id, WINDOWS)[:2] == (False, 0)


def test_peek_matches_weighted_and_token_windows(limiter: Any, user_id: str) -> None:
    """Costs other than 1 are kept in the weights hash (<key>:w): peek reads them."""
    tokens = [(100, 60)]
    for cost, estimate in [(2, 30), (1, 50), (2, 10), (1, 30), (1, 5)]:
        assert_peek_matches_reserve(limiter, user_id, WINDOWS, cost=cost,
                                    token_windows=tokens, tokens=estimate)


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_peek_reports_every_windows_use(limiter: Any, redis_client: redis.Redis,
                                        user_id: str) -> None:
    limiter.check_windows(user_id, WINDOWS, cost=2)
    first = int(redis_client.zrange(key(user_id, 60), 0, 0, withscores=True)[0][1])
    allowed, remaining, retry, window, is_tokens, now, usage, retry_ms = limiter._peek(
        user_id, WINDOWS)
    assert (allowed, remaining, retry, window, is_tokens, retry_ms) == (True, 0, 0, 60, False, 0)
    assert usage == ((3, 60, False, 2, first), (5, 3600, False, 2, first))
    assert now >= first
    limiter.reset(user_id)
    assert limiter._peek(user_id, WINDOWS)[6] == ((3, 60, False, 0, None),
                                                  (5, 3600, False, 0, None))


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_peek_never_writes(limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    for _ in range(3):
        limiter.check_windows(user_id, WINDOWS, cost=1)
    limiter.reserve(user_id, [(10, 86400)], token_windows=[(100, 86400)], tokens=7)
    redis_client.script_load(_native.PEEK_SOURCE)  # no NOSCRIPT round in the record
    before = snapshot(redis_client, user_id)
    with Monitor(redis_client) as monitor:
        assert limiter.peek(user_id, WINDOWS)[0] is False
        assert limiter.peek(user_id, [(10, 86400)], token_windows=[(100, 86400)],
                            tokens=7)[0] is True
    scripts = [c.name for c in monitor.from_scripts()]
    assert scripts and set(scripts) <= READ_ONLY, scripts
    sent = [c.name for c in monitor.from_others()]
    assert sent == ["EVALSHA", "EVALSHA"], sent
    after = snapshot(redis_client, user_id)
    assert after.keys() == before.keys()
    for k, (value, ttl) in after.items():
        assert value == before[k][0], k
        assert 0 <= before[k][1] - ttl < 5000, "peek must not refresh a TTL"


def test_peek_with_scopes_answers_what_reserve_with_them_answers(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    """A route's budget of the user and an upstream's shared cap, peeked like reserve
    decides them (read-only: the keys are untouched), then each scope alone."""
    route = Scope("route:/v1/chat", windows=[(2, 60)])
    upstream = Scope(f"{user_id}-upstream", windows=[(3, 60)], token_windows=[(50, 60)],
                     shared=True)
    for estimate in (10, 20, 15, 5):
        before = snapshot(redis_client, user_id)
        assert_peek_matches_reserve(limiter, user_id, [(9, 60)], scopes=[route, upstream],
                                    token_windows=[(100, 60)], tokens=estimate)
        assert snapshot(redis_client, user_id).keys() >= before.keys()
    usage = limiter._peek(user_id, [], scopes=(route.native(),))[6]
    assert usage[0][:4] == (2, 60, False, 2)
    shared = limiter._peek("anyone", [], scopes=(upstream.native(),), tokens=1)[6]
    assert [u[:4] for u in shared] == [(3, 60, False, 2), (50, 60, True, 30)]  # 10 + 20 in
    assert limiter.peek("anyone", scopes=[upstream], tokens=20)[0] is True
    assert limiter.peek("anyone", scopes=[upstream], tokens=21)[:2] == (False, 0)


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_peek_counts_entries_that_left_the_window_as_gone_without_trimming(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    windows = [(2, 1)]
    limiter.check_windows(user_id, windows, cost=2)  # weighted: "<key>:w" holds it
    last = int(redis_client.zrange(key(user_id, 1), -1, -1, withscores=True)[0][1])
    assert limiter.peek(user_id, windows)[:2] == (False, 0)
    wait_until_server_ms(redis_client, last + 1001, timeout=5)
    assert limiter.peek(user_id, windows) == (True, 1, 0, 1)
    assert logged_entries(redis_client, key(user_id, 1)) == 1, "peek left the old entry in place"
    assert redis_client.hget(key(user_id, 1, ":w"), "") == b"1"
    assert limiter.check_windows(user_id, windows) == (True, 1, 0, 1)


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_peek_after_script_flush_loads_its_script(limiter: Any, redis_client: redis.Redis,
                                                  user_id: str) -> None:
    limiter.check_windows(user_id, WINDOWS)
    redis_client.script_flush()
    assert limiter.peek(user_id, WINDOWS) == (True, 1, 0, 60)
    assert redis_client.script_exists(_native.PEEK_SHA1) == [True]


def test_peek_checks_its_input_before_any_io(unreachable_limiter: Any) -> None:
    with pytest.raises(TypeError, match="windows"):
        unreachable_limiter.peek("u", 5)
    with pytest.raises(ValueError, match="at least one window"):
        unreachable_limiter.peek("u", [])
    with pytest.raises(ValueError, match="can never be allowed"):
        unreachable_limiter.peek("u", [(2, 60)], cost=3)
    with pytest.raises(ValueError, match="user_id"):
        unreachable_limiter.peek("", [(2, 60)])
    with pytest.raises(RateLimiterUnavailable):
        unreachable_limiter.peek("u", [(2, 60)])


def test_peek_under_the_kill_switch_answers_like_check(unreachable_limiter: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "1")
    assert unreachable_limiter.peek("u", WINDOWS) == unreachable_limiter.check_windows(
        "u", WINDOWS) == (True, 3, 0, 60)
    # A reset is no decision: it forgets what Redis holds, switch or not (test_kill_switch.py).
    with pytest.raises(RateLimiterUnavailable):
        unreachable_limiter.reset("u")
    with pytest.raises(RateLimiterUnavailable):
        unreachable_limiter.reset("u", WINDOWS)


# -------------------------------------------------------------------------------- reset

def test_reset_frees_the_budget_at_once(limiter: Any, redis_client: redis.Redis,
                                        user_id: str) -> None:
    for _ in range(3):
        limiter.check_windows(user_id, WINDOWS, cost=1)
    limiter.check_windows(user_id, [(10, 60)], cost=2)  # a weighted entry in the 60 s key
    assert limiter.check_windows(user_id, WINDOWS)[0] is False
    assert limiter.reset(user_id, WINDOWS) == 4 + 3
    for seconds in (60, 3600):
        assert redis_client.exists(key(user_id, seconds), key(user_id, seconds, ":w"),
                                   key(user_id, seconds, ":t")) == 0
    assert limiter.check_windows(user_id, WINDOWS) == (True, 2, 0, 60)


def test_reset_of_one_window_keeps_the_others(limiter: Any, redis_client: redis.Redis,
                                              user_id: str) -> None:
    limiter.check_windows(user_id, WINDOWS)
    assert limiter.reset(user_id, [(3, 60)]) == 1
    assert logged_entries(redis_client, key(user_id, 60)) == 0
    assert logged_entries(redis_client, key(user_id, 3600)) == 1
    assert limiter.reset(user_id, [(3, 60)]) == 0


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_reset_of_every_window_finds_token_and_weights_keys(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    limiter.reserve(user_id, WINDOWS, cost=2, token_windows=[(100, 60), (1000, 86400)], tokens=9)
    limiter.check_windows(user_id, [(4, 7)])
    assert len(redis_client.keys(f"ratelimit:{user_id}:*")) == 13  # windows, weights, totals
    assert limiter.reset(user_id) == 5
    assert redis_client.keys(f"ratelimit:{user_id}:*") == []


def test_reset_of_every_window_leaves_users_whose_ids_start_alike(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    """User ids may hold ':' and glob characters: "u" must not reset "u:60" or "u*"."""
    others = [f"{user_id}:60", f"{user_id}*", f"{user_id}:tokens", f"{user_id}[a]", f"{user_id}\\"]
    for user in [user_id, *others]:
        limiter.check_windows(user, WINDOWS)
    assert limiter.reset(user_id) == 2
    for user in others:
        assert limiter.peek(user, WINDOWS)[:2] == (True, 1), user
    for user in others:
        assert limiter.reset(user) == 2, user
    assert redis_client.keys(f"ratelimit:{user_id}*") == []


def test_reset_of_every_window_scans_past_one_step(limiter: Any, redis_client: redis.Redis,
                                                   user_id: str) -> None:
    """More keys than one SCAN step (COUNT 1000) looks at: every one of the user's is found."""
    with redis_client.pipeline(transaction=False) as pipe:
        for i in range(3000):
            pipe.zadd(f"ratelimit:other-{user_id}-{i}:60", {"m": 1})
        pipe.execute()
    seconds = [1 + i for i in range(20)]
    for s in seconds:
        limiter.check_windows(user_id, [(5, s)])
    assert limiter.reset(user_id) == 20
    assert redis_client.keys(f"ratelimit:{user_id}:*") == []
    assert redis_client.dbsize() == 3000


def test_reset_checks_its_input_before_any_io(unreachable_limiter: Any) -> None:
    with pytest.raises(TypeError):
        unreachable_limiter.reset("u", 60)
    with pytest.raises(ValueError, match="user_id"):
        unreachable_limiter.reset("")
    with pytest.raises(RateLimiterUnavailable):
        unreachable_limiter.reset("u")


@pytest.mark.storages("compact", reason="a compact window's value of another layout")
@pytest.mark.parametrize("damage", ["newer layout", "cut short", "wrong type"])
def test_reset_deletes_a_compact_window_it_cannot_read(limiter: Any, redis_client: redis.Redis,
                                                       user_id: str, damage: str) -> None:
    """A window's value of a layout version this release does not know (a newer one's), or
    damaged, refuses every check (never misread): reset is the operator's remedy, so it
    deletes such a key too, and counts the entries it could count (none of that key's)."""
    for every_window in (False, True):
        for _ in range(2):
            limiter.check_windows(user_id, WINDOWS)
        unreadable = key(user_id, 60, ":c")
        value = redis_client.get(unreadable)
        assert value is not None and value[:1] == b"\x03"  # layout 2's short form
        if damage == "newer layout":
            redis_client.set(unreadable, b"\x04" + value[1:])
        elif damage == "cut short":
            redis_client.set(unreadable, value[:20])
        else:
            redis_client.delete(unreadable)
            redis_client.rpush(unreadable, b"x")
        with pytest.raises(RateLimiterUnavailable):
            limiter.check_windows(user_id, WINDOWS)
        removed = limiter.reset(user_id) if every_window else limiter.reset(user_id, WINDOWS)
        assert removed == 2, every_window  # the 3600 s window's two entries
        assert redis_client.keys(f"ratelimit:{user_id}:*") == [], every_window
        assert limiter.check_windows(user_id, WINDOWS) == (True, 2, 0, 60)
        limiter.reset(user_id)


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_reset_deletes_a_sorted_set_window_of_another_type(limiter: Any, redis_client: redis.Redis,
                                                           user_id: str) -> None:
    """A window's key holding another type refuses every check: reset deletes it too (it
    counts 0)."""
    limiter.check_windows(user_id, WINDOWS)
    redis_client.delete(key(user_id, 60))
    redis_client.set(key(user_id, 60), b"x")
    with pytest.raises(RateLimiterUnavailable, match="WRONGTYPE"):
        limiter.check_windows(user_id, WINDOWS)
    assert limiter.reset(user_id, WINDOWS) == 1
    assert limiter.check_windows(user_id, WINDOWS) == (True, 2, 0, 60)
    redis_client.set(key(user_id, 60), b"x")
    assert limiter.reset(user_id) == 1  # the 3600 s window's entry
    assert redis_client.keys(f"ratelimit:{user_id}:*") == []
