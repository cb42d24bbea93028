"""check and check_windows against a real Redis: the round trip, the data the script leaves
in Redis (keys, members, scores, TTLs), the honest retry time, rejections that write nothing,
tiers, and the multi-window rules. Concurrency, faults, input validation and the kill switch
have their own files.

Every test with a limiter runs once per limiter kind (tests/conftest.py): the blocking
RateLimiter, and AsyncRateLimiter on asyncio's loop and on uvloop's, driven through the
blocking adapter; a limiter a test builds itself comes from `make_limiter`."""

from __future__ import annotations

import hashlib
import math
import uuid
from pathlib import Path

import pytest
import redis

from helpers_core import (
    SORTED_SET_SHAPE,
    Monitor,
    connections_received,
    logged,
    logged_entries,
    measured_commands,
    retry_after_bounds,
    server_ms,
    wait_until_server_ms,
)

REPO = Path(__file__).resolve().parent.parent
SCRIPT_COMMANDS_ON_ALLOW = {"time", "hget", "zcount", "zadd", "zremrangebyscore", "expire"}


def warm_up(limiter) -> None:
    """One call on an unrelated user, so that connecting and loading the script are behind us."""
    limiter.check(f"warm-up-{uuid.uuid4().hex}", 1000, 60)


def members_and_scores(client: redis.Redis, key: str) -> list[tuple[str, int]]:
    """The window's (member, score) pairs; ("", time) in the compact storage, which keeps
    no member per entry."""
    if client.exists(f"{key}:c"):
        return [("", at) for at, _ in logged(client, key)]
    return [(m.decode(), int(s)) for m, s in client.zrange(key, 0, -1, withscores=True)]


# ------------------------------------------------------------------ one round trip

def test_check_returns_a_tuple_of_bool_int_int(limiter, user_id):
    result = limiter.check(user_id, 10, 60)
    assert type(result) is tuple and len(result) == 3
    allowed, remaining, retry_after_s = result
    assert type(allowed) is bool and type(remaining) is int and type(retry_after_s) is int
    assert result == (True, 9, 0)


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_check_sends_exactly_one_evalsha_and_nothing_else(limiter, redis_client, user_id):
    warm_up(limiter)
    with Monitor(redis_client) as monitor:
        limiter.check(user_id, 10, 60)
    sent = monitor.from_others()
    assert [c.name for c in sent] == ["EVALSHA"], [c.args for c in sent]
    from genai_ratelimit import SCRIPT_SHA1
    assert sent[0].args[1] == SCRIPT_SHA1


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_check_executes_the_script_once_per_call(limiter, redis_client, user_id):
    warm_up(limiter)
    with measured_commands(redis_client) as delta:
        for _ in range(5):
            limiter.check(user_id, 10, 60)
    client_commands = {name: calls for name, calls in delta.items()
                       if name not in SCRIPT_COMMANDS_ON_ALLOW}
    assert client_commands == {"evalsha": 5}


def test_sequential_checks_reuse_one_connection(limiter, redis_client, user_id):
    warm_up(limiter)
    before = connections_received(redis_client)
    for _ in range(20):
        limiter.check(user_id, 100, 60)
    assert connections_received(redis_client) == before


def test_first_check_after_an_empty_script_cache_loads_the_script_once(limiter, redis_client, user_id):
    # The redis_client fixture flushed the script cache: NOSCRIPT, SCRIPT LOAD, EVALSHA again.
    with measured_commands(redis_client) as delta:
        assert limiter.check(user_id, 10, 60) == (True, 9, 0)
        assert limiter.check(user_id, 10, 60) == (True, 8, 0)
    assert delta.get("script|load") == 1
    assert delta.get("evalsha") == 3
    assert logged_entries(redis_client, f"ratelimit:{user_id}:60") == 2


# ------------------------------------------------------------ what lands in Redis

@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_key_is_prefix_user_and_window(limiter, redis_client):
    limiter.check("user_8421", 10, 60)
    assert redis_client.keys("*") == [b"ratelimit:user_8421:60"]
    assert redis_client.type("ratelimit:user_8421:60") == b"zset"


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_key_prefix_option_replaces_the_prefix(make_limiter, redis_url, redis_client):
    with make_limiter(redis_url, key_prefix="myapp") as limiter:
        limiter.check("user_8421", 10, 60)
    assert redis_client.keys("*") == [b"myapp:user_8421:60"]


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_members_are_canonical_uuid4_text(limiter, redis_client, user_id):
    for _ in range(10):
        limiter.check(user_id, 10, 60)
    members = [m for m, _ in members_and_scores(redis_client, f"ratelimit:{user_id}:60")]
    assert len(members) == 10 and len(set(members)) == 10
    for member in members:
        parsed = uuid.UUID(member)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
        assert len(member) == 36 and member == str(parsed)  # canonical: lowercase, hyphenated


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_scores_are_the_servers_time_in_unix_milliseconds(limiter, redis_client, user_id):
    before = server_ms(redis_client)
    limiter.check(user_id, 10, 60)
    after = server_ms(redis_client)
    [(_, score)] = members_and_scores(redis_client, f"ratelimit:{user_id}:60")
    assert before <= score <= after
    raw = redis_client.zscore(f"ratelimit:{user_id}:60",
                              members_and_scores(redis_client, f"ratelimit:{user_id}:60")[0][0])
    assert raw == int(raw)  # whole milliseconds


def test_client_clock_scores_are_the_callers_time_in_milliseconds(make_limiter, redis_url, redis_client,
                                                                  user_id):
    import time

    with make_limiter(redis_url, clock="client") as limiter:
        before = math.floor(time.time() * 1000)
        assert limiter.check(user_id, 10, 60) == (True, 9, 0)
        after = math.ceil(time.time() * 1000)
    [(_, score)] = members_and_scores(redis_client, f"ratelimit:{user_id}:60")
    assert before <= score <= after


def test_remaining_counts_down_then_rejects(limiter, user_id):
    results = [limiter.check(user_id, 3, 60) for _ in range(4)]
    assert results[:3] == [(True, 2, 0), (True, 1, 0), (True, 0, 0)]
    allowed, remaining, retry_after_s = results[3]
    assert (allowed, remaining) == (False, 0) and retry_after_s >= 1


# ------------------------------------------------------------------ honest retry

def test_retry_after_follows_the_oldest_score_read_back_from_redis(limiter, redis_client, user_id):
    key = f"ratelimit:{user_id}:60"
    for _ in range(5):
        limiter.check(user_id, 5, 60)
    oldest = min(score for _, score in members_and_scores(redis_client, key))
    before = server_ms(redis_client)
    allowed, remaining, retry_after_s = limiter.check(user_id, 5, 60)
    after = server_ms(redis_client)
    low, high = retry_after_bounds(oldest, 60_000, before, after)
    assert (allowed, remaining) == (False, 0)
    assert low <= retry_after_s <= high


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_retry_after_rounds_the_oldest_entrys_remaining_life_up(limiter, redis_client, user_id):
    # Entries placed on the server's timeline: the oldest leaves the 10 s window in 2.4 s, the
    # others much later. The honest answer is ceil(2.4) = 3, not 2 (floor or round) and not
    # what the newest entry would say.
    key = f"ratelimit:{user_id}:10"
    now = server_ms(redis_client)
    oldest = now - 7_600
    redis_client.zadd(key, {str(uuid.uuid4()): oldest, str(uuid.uuid4()): now - 3_000,
                            str(uuid.uuid4()): now - 1_000})
    before = server_ms(redis_client)
    allowed, remaining, retry_after_s = limiter.check(user_id, 3, 10)
    after = server_ms(redis_client)
    low, high = retry_after_bounds(oldest, 10_000, before, after)
    assert (allowed, remaining) == (False, 0)
    assert low <= retry_after_s <= high


def test_two_rejections_at_different_moments_give_different_retry_after(limiter, redis_client, user_id):
    key = f"ratelimit:{user_id}:3"
    assert limiter.check(user_id, 1, 3)[0] is True
    [(_, score)] = members_and_scores(redis_client, key)

    before = server_ms(redis_client)
    first = limiter.check(user_id, 1, 3)
    after = server_ms(redis_client)
    low, high = retry_after_bounds(score, 3_000, before, after)
    assert first[0] is False and low <= first[2] <= high

    wait_until_server_ms(redis_client, score + 1_100, timeout=5)
    before = server_ms(redis_client)
    second = limiter.check(user_id, 1, 3)
    after = server_ms(redis_client)
    low, high = retry_after_bounds(score, 3_000, before, after)
    assert second[0] is False and low <= second[2] <= high

    assert second[2] < first[2]


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_retry_after_a_downgrade_points_at_the_entry_that_frees_a_slot(limiter, redis_client, user_id):
    # 60 entries spread over the last 58.5 s of a 60 s window, then the limit drops to 5:
    # the count falls below 5 only when the 56th oldest entry expires, not the oldest.
    key = f"ratelimit:{user_id}:60"
    now = server_ms(redis_client)
    scores = [now - 58_500 + i * 500 for i in range(60)]
    redis_client.zadd(key, {str(uuid.uuid4()): s for s in scores})
    decisive = sorted(scores)[60 - 5]  # the (count - limit + 1)-th oldest, 0-based count - limit

    before = server_ms(redis_client)
    allowed, remaining, retry_after_s = limiter.check(user_id, 5, 60)
    after = server_ms(redis_client)
    low, high = retry_after_bounds(decisive, 60_000, before, after)
    oldest_low, oldest_high = retry_after_bounds(min(scores), 60_000, before, after)
    assert (allowed, remaining) == (False, 0)
    assert low <= retry_after_s <= high
    assert not oldest_low <= retry_after_s <= oldest_high


def test_a_downgrade_after_filling_through_the_limiter_rejects_without_writing(
        limiter, redis_client, user_id):
    key = f"ratelimit:{user_id}:60"
    for _ in range(60):
        assert limiter.check(user_id, 100, 60)[0] is True
    entries = members_and_scores(redis_client, key)
    decisive = sorted(score for _, score in entries)[60 - 5]
    before = server_ms(redis_client)
    allowed, remaining, retry_after_s = limiter.check(user_id, 5, 60)
    after = server_ms(redis_client)
    low, high = retry_after_bounds(decisive, 60_000, before, after)
    assert (allowed, remaining) == (False, 0)
    assert low <= retry_after_s <= high
    assert members_and_scores(redis_client, key) == entries


# ------------------------------------------------------ a rejection writes nothing

@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_rejection_leaves_members_scores_and_ttl_unchanged(limiter, redis_client, user_id):
    key = f"ratelimit:{user_id}:60"
    for _ in range(3):
        limiter.check(user_id, 3, 60)
    # A distinctive TTL: an EXPIRE key 61 during the rejection would show as a longer one.
    redis_client.pexpire(key, 30_000)
    entries = members_and_scores(redis_client, key)
    assert limiter.check(user_id, 3, 60)[0] is False
    assert members_and_scores(redis_client, key) == entries
    assert 0 < redis_client.pttl(key) <= 30_000


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_rejection_runs_no_zadd_and_no_expire(limiter, redis_client, user_id):
    for _ in range(3):
        limiter.check(user_id, 3, 60)
    with measured_commands(redis_client) as delta:
        assert limiter.check(user_id, 3, 60)[0] is False
    assert delta.get("evalsha") == 1
    # Plain windows: no OOM probe either (the entry's own ZADD is the first write).
    assert "zadd" not in delta
    assert "expire" not in delta and "pexpire" not in delta


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_allow_runs_one_zadd_and_one_expire(limiter, redis_client, user_id):
    warm_up(limiter)
    with measured_commands(redis_client) as delta:
        assert limiter.check(user_id, 3, 60)[0] is True
    assert delta.get("zadd") == 1 and delta.get("expire") == 1


# ------------------------------------------------------------------------- TTL

def pttl_after_allow(limiter, redis_client, user_id: str, window_seconds: int) -> tuple[int, int]:
    """Allows one request and reads the key's PTTL. Returns (pttl, the server time that
    passed from just before the call to just after the reading)."""
    before = server_ms(redis_client)
    assert limiter.check(user_id, 10, window_seconds)[0] is True
    pttl = redis_client.pttl(f"ratelimit:{user_id}:{window_seconds}")
    return pttl, server_ms(redis_client) - before


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_ttl_after_an_allow_is_at_most_window_plus_one_second(limiter, redis_client, user_id):
    pttl, elapsed = pttl_after_allow(limiter, redis_client, user_id, 60)
    # EXPIRE key 61 ran somewhere in `elapsed`: what is left lies within it of 61 s.
    assert 61_000 - elapsed <= pttl <= 61_000
    assert 0 < redis_client.ttl(f"ratelimit:{user_id}:60") <= 61


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_each_allow_renews_the_ttl(limiter, redis_client, user_id):
    limiter.check(user_id, 10, 60)
    redis_client.pexpire(f"ratelimit:{user_id}:60", 5_000)
    pttl, elapsed = pttl_after_allow(limiter, redis_client, user_id, 60)
    assert 61_000 - elapsed <= pttl <= 61_000


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_key_is_gone_within_window_plus_one_second_after_the_last_allow(limiter, redis_client, user_id):
    key = f"ratelimit:{user_id}:1"
    assert limiter.check(user_id, 5, 1)[0] is True
    allowed_at = server_ms(redis_client)
    assert redis_client.exists(key) == 1
    deadline = allowed_at + 2_000 + 250  # window + 1 s, plus the server's expiry granularity
    while True:
        # The clock is read first: a key seen after that reading was alive at least then.
        now = server_ms(redis_client)
        if not redis_client.exists(key):
            break
        assert now <= deadline, "the key outlived window + 1 s"
        wait_until_server_ms(redis_client, now + 20, timeout=5)
    assert redis_client.exists(key) == 0


# ----------------------------------------------------------------------- tiers

def test_script_sha1_is_the_sha1_of_the_lua_file_with_its_includes():
    from genai_ratelimit import SCRIPT_SHA1
    from test_lua_build import assembled

    assert SCRIPT_SHA1 == hashlib.sha1(assembled("sliding_window.lua", "zset").encode()).hexdigest()


def test_tier_limits_are_the_contracts_budgets():
    from genai_ratelimit import TIER_LIMITS

    assert TIER_LIMITS == {
        "free": {"per_minute": 5, "per_day": 100},
        "pro": {"per_minute": 60, "per_day": 5_000},
        "enterprise": {"per_minute": 600, "per_day": 100_000},
    }


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_every_tier_runs_the_same_script(limiter, redis_client):
    from genai_ratelimit import SCRIPT_SHA1, TIER_LIMITS

    with Monitor(redis_client) as monitor:
        for tier, budget in TIER_LIMITS.items():
            limiter.check_windows(f"{tier}-user", [(budget["per_minute"], 60), (budget["per_day"], 86400)])
    shas = {c.args[1] for c in monitor.from_others() if c.name == "EVALSHA"}
    assert shas == {SCRIPT_SHA1}
    assert redis_client.script_exists(SCRIPT_SHA1) == [True]


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_every_tier_uses_the_same_key_shape(limiter, redis_client):
    from genai_ratelimit import TIER_LIMITS

    for tier, budget in TIER_LIMITS.items():
        limiter.check_windows(f"{tier}-user", [(budget["per_minute"], 60), (budget["per_day"], 86400)])
    expected = {f"ratelimit:{tier}-user:{w}".encode() for tier in TIER_LIMITS for w in (60, 86400)}
    assert set(redis_client.keys("*")) == expected


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_changing_tier_changes_only_the_budget_consulted(limiter, redis_client, user_id):
    from genai_ratelimit import TIER_LIMITS

    free, pro = TIER_LIMITS["free"]["per_minute"], TIER_LIMITS["pro"]["per_minute"]
    for _ in range(free):
        assert limiter.check(user_id, free, 60)[0] is True
    assert limiter.check(user_id, free, 60)[0] is False
    # Upgraded: the same key, the entries already there count against the bigger budget.
    assert limiter.check(user_id, pro, 60) == (True, pro - free - 1, 0)
    # Downgraded again: the free budget is exceeded by what the pro requests left.
    assert limiter.check(user_id, free, 60)[:2] == (False, 0)
    assert redis_client.keys("*") == [f"ratelimit:{user_id}:60".encode()]


# -------------------------------------------------------------- check_windows

def test_check_windows_returns_allowed_remaining_retry_and_window(limiter, user_id):
    result = limiter.check_windows(user_id, [(5, 60), (100, 86400)])
    assert type(result) is tuple and len(result) == 4
    assert [type(v) for v in result] == [bool, int, int, int]
    assert result == (True, 4, 0, 60)


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_check_windows_decides_the_shortest_window_first_even_when_given_longest_first(
        limiter, redis_client, user_id):
    minute, day = f"ratelimit:{user_id}:60", f"ratelimit:{user_id}:86400"
    warm_up(limiter)
    with Monitor(redis_client) as monitor:
        limiter.check_windows(user_id, [(100, 86400), (5, 60)])
    # Each window is measured (ZCOUNT) before the next, the minute first; the entry and the
    # trims come after the decision.
    touched = [c.args[1] for c in monitor.from_scripts() if c.name == "ZCOUNT"]
    assert touched == [minute, day]


def test_check_windows_minute_rejection_never_touches_the_day_key(limiter, redis_client, user_id):
    day = f"ratelimit:{user_id}:86400"
    for _ in range(2):
        limiter.check_windows(user_id, [(2, 60), (100, 86400)])
    day_entries = members_and_scores(redis_client, day)
    with Monitor(redis_client) as monitor:
        result = limiter.check_windows(user_id, [(100, 86400), (2, 60)])
    assert result[0] is False and result[3] == 60
    script_commands = monitor.from_scripts()
    assert script_commands, "MONITOR showed no command run by the script"
    assert not [c.args for c in script_commands if day in c.args[1:]]
    assert members_and_scores(redis_client, day) == day_entries


def test_check_windows_minute_rejection_adds_no_entry_to_any_window(limiter, redis_client, user_id):
    minute, day = f"ratelimit:{user_id}:60", f"ratelimit:{user_id}:86400"
    for _ in range(2):
        limiter.check_windows(user_id, [(2, 60), (100, 86400)])
    before = (members_and_scores(redis_client, minute), members_and_scores(redis_client, day))
    result = limiter.check_windows(user_id, [(2, 60), (100, 86400)])
    assert result[:2] == (False, 0) and result[3] == 60
    assert (members_and_scores(redis_client, minute), members_and_scores(redis_client, day)) == before


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_check_windows_day_rejection_adds_no_entry_to_the_minute_window(limiter, redis_client, user_id):
    minute, day = f"ratelimit:{user_id}:60", f"ratelimit:{user_id}:86400"
    for _ in range(3):
        assert limiter.check_windows(user_id, [(100, 60), (3, 86400)])[0] is True
    before = (members_and_scores(redis_client, minute), members_and_scores(redis_client, day))
    with measured_commands(redis_client) as delta:
        result = limiter.check_windows(user_id, [(100, 60), (3, 86400)])
    assert result[:2] == (False, 0) and result[3] == 86400
    assert (members_and_scores(redis_client, minute), members_and_scores(redis_client, day)) == before
    assert "zadd" not in delta and "expire" not in delta


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_check_windows_day_rejection_reports_the_days_honest_retry(limiter, redis_client, user_id):
    day = f"ratelimit:{user_id}:86400"
    now = server_ms(redis_client)
    oldest = now - 86_400_000 + 7_200_500  # leaves the day window in about 2 h 0.5 s
    redis_client.zadd(day, {str(uuid.uuid4()): oldest, str(uuid.uuid4()): now - 10_000})
    before = server_ms(redis_client)
    result = limiter.check_windows(user_id, [(100, 60), (2, 86400)])
    after = server_ms(redis_client)
    low, high = retry_after_bounds(oldest, 86_400_000, before, after)
    assert result[0] is False and result[3] == 86400
    assert low <= result[2] <= high


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_check_windows_allow_adds_the_same_entry_to_every_window(limiter, redis_client, user_id):
    limiter.check_windows(user_id, [(5, 60), (100, 86400), (50, 3600)])
    entries = [members_and_scores(redis_client, f"ratelimit:{user_id}:{w}") for w in (60, 3600, 86400)]
    assert len(entries[0]) == 1
    assert entries[0] == entries[1] == entries[2]
    assert redis_client.ttl(f"ratelimit:{user_id}:86400") > 86_000


def test_check_windows_allow_reports_the_window_with_fewest_remaining(limiter, user_id):
    assert limiter.check_windows(user_id, [(10, 60), (3, 86400)]) == (True, 2, 0, 86400)
    assert limiter.check_windows(user_id, [(3, 86400), (10, 60)]) == (True, 1, 0, 86400)


def test_check_windows_allow_tie_reports_the_shorter_window(limiter, user_id):
    assert limiter.check_windows(user_id, [(5, 3600), (5, 60)]) == (True, 4, 0, 60)
    assert limiter.check_windows(user_id, [(5, 60), (5, 3600)]) == (True, 3, 0, 60)


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_check_behaves_like_check_windows_with_one_window(limiter, redis_client):
    # The same sequence through both methods, one user each: the same answers, where a
    # rejection's retry is judged against each key's own oldest entry and the server clock.
    for _ in range(5):
        answers = []
        for user, call in (("user-a", lambda: limiter.check("user-a", 3, 60)),
                           ("user-b", lambda: limiter.check_windows("user-b", [(3, 60)]))):
            key = f"ratelimit:{user}:60"
            before = server_ms(redis_client)
            result = call()
            after = server_ms(redis_client)
            if not result[0]:
                oldest = int(redis_client.zrange(key, 0, 0, withscores=True)[0][1])
                low, high = retry_after_bounds(oldest, 60_000, before, after)
                assert low <= result[2] <= high, (user, result)
            answers.append(result)
        check_answer, windows_answer = answers
        assert len(check_answer) == 3 and windows_answer[3] == 60
        assert check_answer[:2] == windows_answer[:2]
        assert (check_answer[2] == 0) == (windows_answer[2] == 0)
    assert set(redis_client.keys("*")) == {b"ratelimit:user-a:60", b"ratelimit:user-b:60"}
    assert logged_entries(redis_client, "ratelimit:user-a:60") == 3
    assert logged_entries(redis_client, "ratelimit:user-b:60") == 3
