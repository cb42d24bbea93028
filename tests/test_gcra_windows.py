"""GCRA with windows, in one decision (check_windows_detailed(gcra=...), lua/gcra_windows.lua),
for every limiter kind and both storages: all or nothing across the bucket and the windows, a
replay after a lost reply charged once, the cluster, reset; and a FastAPI tier's `burst`: its
minute budget decided as GCRA (rate per_minute per 60 s, up to `burst` at once) with the
tier's other windows in one call, through RateLimit and the tiers file."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.cluster import RedisCluster as ClusterClient

from genai_ratelimit import RateLimiter, _native
from genai_ratelimit._tiers_config import TIERS_FILE_ENV
from genai_ratelimit.fastapi import RateLimit, TokenRateLimit
from helpers_async import LimiterFactory
from test_fastapi import (  # noqa: F401  (fixtures, by name)
    AnyLimiter,
    TestClient,
    _built_in_tiers,
    as_user,
    build_app,
    client_for,
    limiter,
)
from test_gcra import ReferenceGcra
from test_idempotent_retry import ReplyDroppingProxy, redis_port  # noqa: F401  (fixture)

# The HTTP cases: left out of make test-asan / test-hiredis1, as test_fastapi_shadow.py's (the
# limiter calls below them run there).
NOT_ASAN = pytest.mark.not_asan(reason="FastAPI over TestClient, as test_fastapi.py, which runs under ASan")
NO_HIREDIS1 = pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline "
                                             "the async tests drive on hiredis 1.x")

# 6 a minute (one every 10 s), 2 at once; 40 a day.
BURSTY = {"free": {"per_minute": 6, "per_day": 40, "burst": 2}}


@pytest.fixture
def blocking(make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> Any:
    """A limiter of the kind and storage under test, with the blocking interface."""
    return make_limiter(redis_url)


def decide(limiter: Any, user_id: str, windows: tuple[tuple[int, int], ...],
           gcra: object, cost: int = 1) -> tuple[bool, int, int, int, int]:
    d = limiter.check_windows_detailed(user_id, windows, cost=cost, gcra=gcra)
    return (bool(d[0]), d[1], d[2], d[3], d.retry_after_ms)


@NOT_ASAN
@NO_HIREDIS1
def test_the_burst_then_a_minute_refusal_with_the_theoretical_arrival_times_wait(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, tier_limits=BURSTY))
    first = client.get("/dict", headers=as_user(user_id))
    second = client.get("/dict", headers=as_user(user_id))
    assert (first.status_code, second.status_code) == (200, 200)
    assert first.headers["X-RateLimit-Window"] == "minute"
    assert second.headers["X-RateLimit-Remaining"] == "0"
    refused = client.get("/dict", headers=as_user(user_id))
    assert refused.status_code == 429
    assert refused.headers["X-RateLimit-Window"] == "minute"
    assert refused.headers["X-RateLimit-Limit"] == "6"
    # Two admitted at t: the TAT is t + 20 s, the next one is due at TAT - (2 - 1) * 10 s.
    wait_ms = int(refused.headers["retry-after-ms"])
    assert 9_000 <= wait_ms <= 10_000
    assert int(refused.headers["Retry-After"]) == math.ceil(wait_ms / 1000)


def test_a_bucket_refusal_charges_no_window_and_a_window_refusal_charges_no_bucket(
        blocking: Any, user_id: str, redis_client: redis.Redis) -> None:
    day = ((2, 86_400),)
    assert decide(blocking, user_id, day, (6, 60, 2))[:4] == (True, 1, 0, 60)
    assert decide(blocking, user_id, day, (6, 60, 2))[:4] == (True, 0, 0, 60)
    refused = decide(blocking, user_id, day, (6, 60, 2))
    assert refused[:2] == (False, 0) and refused[3] == 60 and 9_000 <= refused[4] <= 10_000
    # The day window still holds 2: the bucket's refusal logged nothing. A bucket of its own
    # (another rate: another period's key) is refused by the day, and charged nothing.
    other = (100, 3_600, 5)
    refused_by_day = decide(blocking, user_id, day, other)
    assert refused_by_day[0] is False and refused_by_day[3] == 86_400
    assert redis_client.get(f"ratelimit:{user_id}:3600:gcra") is None
    assert decide(blocking, user_id + "-b", (), other)[:4] == (True, 4, 0, 3_600)


def test_cost_weighs_in_the_bucket_and_the_windows(blocking: Any, user_id: str) -> None:
    assert decide(blocking, user_id, ((10, 86_400),), (6, 60, 4), cost=3)[:4] == (True, 1, 0, 60)
    refused = decide(blocking, user_id, ((10, 86_400),), (6, 60, 4), cost=2)
    assert refused[0] is False and refused[3] == 60
    with pytest.raises(ValueError, match="burst of 4"):
        decide(blocking, user_id, ((10, 86_400),), (6, 60, 4), cost=5)


def test_check_rate_and_the_tier_share_the_bucket(blocking: Any, user_id: str) -> None:
    assert decide(blocking, user_id, ((9, 86_400),), (6, 60, 2))[0] is True
    rate = blocking.check_rate if isinstance(blocking, RateLimiter) else (
        lambda *args: blocking.run(blocking.inner.check_rate(*args)))
    assert rate(user_id, 6, 60, 2)[:2] == (True, 0)
    assert decide(blocking, user_id, ((9, 86_400),), (6, 60, 2))[0] is False


@pytest.mark.parametrize("gcra, message", [
    ((6, 60), "gcra must be a"), ([6, 60, 2], "gcra must be a"), ((0, 60, 2), "rate"),
    ((6, 60, True), "burst"),
])
def test_a_malformed_gcra_is_refused_before_any_io(blocking: Any, user_id: str,
                                                   gcra: object, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        decide(blocking, user_id, ((5, 60),), gcra)


@NOT_ASAN
@NO_HIREDIS1
def test_the_tiers_file_gives_the_burst(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        limiter: AnyLimiter, client_for: Callable[..., TestClient],
                                        user_id: str) -> None:
    path = tmp_path / "tiers.toml"
    path.write_text("[free]\nper_minute = 6\nper_day = 40\nburst = 2\n")
    monkeypatch.setenv(TIERS_FILE_ENV, str(path))
    dependency = RateLimit(limiter=limiter)
    assert dependency.tier_limits == BURSTY
    client = client_for(dependency)
    assert [client.get("/dict", headers=as_user(user_id)).status_code for _ in range(3)] == [200, 200, 429]


def test_the_day_window_refuses_after_the_bucket_refills(blocking: Any, user_id: str,
                                                          redis_client: redis.Redis) -> None:
    # The bucket full and idle (its key gone), the day window full: the day refuses.
    for _ in range(4):
        redis_client.delete(f"ratelimit:{user_id}:60:gcra")
        assert decide(blocking, user_id, ((4, 86_400),), (6, 60, 2))[0] is True
    redis_client.delete(f"ratelimit:{user_id}:60:gcra")
    refused = decide(blocking, user_id, ((4, 86_400),), (6, 60, 2))
    assert refused[0] is False and refused[3] == 86_400
    assert redis_client.get(f"ratelimit:{user_id}:60:gcra") is None  # nothing charged


def test_a_lost_reply_is_replayed_and_charged_once(make_limiter: LimiterFactory,
                                                   redis_client: redis.Redis, redis_port: int,
                                                   user_id: str, storage: str) -> None:
    redis_client.script_load(_native.COMPACT_GCRA_WINDOWS_SOURCE if storage == "compact"
                             else _native.GCRA_WINDOWS_SOURCE)
    proxy = ReplyDroppingProxy(redis_port, drop=1)
    try:
        with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as replaying:
            first = replaying.check_windows_detailed(user_id, ((3, 86_400),), gcra=(6, 60, 2))
    finally:
        proxy.close()
    assert len(proxy.dropped_replies) == 1  # the first attempt ran on the server
    assert tuple(first)[:2] == (True, 1)
    # Charged once in both: the bucket admits one more at once (a burst of 2), then refuses.
    with make_limiter(f"redis://127.0.0.1:{redis_port}/0") as direct:
        assert tuple(direct.check_windows_detailed(user_id, ((3, 86_400),), gcra=(6, 60, 2))) == \
            (True, 0, 0, 60)
        refused = direct.check_windows_detailed(user_id, ((3, 86_400),), gcra=(6, 60, 2))
        assert tuple(refused)[:2] == (False, 0) and refused.window_seconds == 60
        # The day holds two entries of 3 (the replayed request's, the second's): a third fits.
        assert direct.peek(user_id, ((3, 86_400),))[:2] == (True, 0)


def test_on_a_cluster_the_bucket_and_the_windows_share_the_users_slot(
        make_limiter: LimiterFactory, redis_cluster: Any) -> None:
    client = ClusterClient(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        with make_limiter(redis_cluster.url) as limiter:
            for i in range(20):  # users over every master
                user = f"user_{i}"
                decisions = [tuple(limiter.check_windows_detailed(user, ((5, 86_400),), gcra=(6, 60, 2)))
                             for _ in range(3)]
                assert [d[:2] for d in decisions] == [(True, 1), (True, 0), (False, 0)]
                assert decisions[2][3] == 60
                assert client.exists(f"ratelimit:{{{user}}}:60:gcra") == 1
    finally:
        client.close()


@NOT_ASAN
@NO_HIREDIS1
def test_a_burst_where_one_reserve_decides_is_refused_when_built(limiter: AnyLimiter) -> None:
    with pytest.raises(ValueError, match="burst .tier 'free'. is decided by a RateLimit without scopes"):
        TokenRateLimit(limiter=limiter, tier_limits=BURSTY)
    with pytest.raises(ValueError, match="RateLimit with tokens or scopes decides in one reserve"):
        RateLimit(limiter=limiter, tier_limits=BURSTY, route_limits={"per_minute": 10})


@NOT_ASAN
@NO_HIREDIS1
def test_a_burst_needs_a_limiter_that_decides_it() -> None:
    class Windows:
        def check_windows(self, user_id: str, windows: object) -> tuple[bool, int, int, int]:
            raise AssertionError("never asked")

    with pytest.raises(TypeError, match="burst needs a limiter with check_windows_detailed"):
        RateLimit(limiter=Windows(), tier_limits=BURSTY)  # type: ignore[arg-type]


def test_reset_of_every_window_forgets_the_bucket_too(blocking: Any, user_id: str,
                                                      redis_client: redis.Redis) -> None:
    for expected in (True, True, False):
        assert decide(blocking, user_id, ((9, 86_400),), (6, 60, 2))[0] is expected
    assert blocking.reset(user_id, [(9, 86_400)]) == 2  # windows named: the bucket stays
    assert redis_client.exists(f"ratelimit:{user_id}:60:gcra") == 1
    assert decide(blocking, user_id, ((9, 86_400),), (6, 60, 2))[0] is False
    assert blocking.reset(user_id) == 0  # every key: no entries left, the bucket deleted
    assert redis_client.keys(f"ratelimit:{user_id}:*") == []
    assert decide(blocking, user_id, ((9, 86_400),), (6, 60, 2))[:2] == (True, 1)


def test_the_kill_switch_allows_with_the_fewest_limit_and_sends_nothing(
        blocking: Any, user_id: str, redis_client: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "1")
    answer = decide(blocking, user_id, ((100, 86_400),), (6, 60, 2))
    assert answer == (True, 2, 0, 60, 0)  # the bucket's burst is the tightest limit
    assert redis_client.keys(f"ratelimit:{user_id}:*") == []


class ReferenceLog:
    """A sliding-window log by its definition: an entry logged at t is in the window at now
    while t > now - window_ms; a request of `cost` fits when the costs in the window and it
    stay within the limit; a refusal waits until the oldest entries whose leaving frees
    enough have left."""

    def __init__(self, limit: int, window_seconds: int) -> None:
        self.limit, self.window_ms = limit, window_seconds * 1000
        self.entries: list[tuple[int, int]] = []

    def left(self, now: int, cost: int) -> tuple[int, int]:
        """(what remains after `cost` (negative: it does not fit), the wait in ms if not)."""
        live = [(t, c) for t, c in self.entries if t > now - self.window_ms]
        remaining = self.limit - sum(c for _, c in live) - cost
        freed, wait = 0, 0
        for t, c in live:
            if remaining + freed >= 0:
                break
            freed += c
            wait = max(1, t + self.window_ms - now)
        return remaining, wait


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rate=st.sampled_from([(5, 60), (7, 60), (3, 1), (1, 1), (2, 7)]), burst=st.integers(1, 6),
       window=st.sampled_from([1, 10, 60]), limit=st.integers(1, 12),
       steps=st.lists(st.tuples(st.one_of(st.integers(0, 50), st.integers(0, 20_000)),
                                st.integers(1, 4)), min_size=1, max_size=20),
       start=st.integers(10**12, 10**13))  # unix ms of 2001 to 2286
def test_every_decision_is_the_bucket_and_the_logs_all_or_nothing(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis, user_id: str,
        rate: tuple[int, int], burst: int, window: int, limit: int,
        steps: list[tuple[int, int]], start: int) -> None:
    """Sequences of (advance the clock, cost) against the reference GCRA (test_gcra.py's)
    and a reference log: the bucket decides first; a refusal by either charges neither."""
    limiter = make_limiter(redis_url, clock="client")
    per, period = rate
    bucket, log = ReferenceGcra(per, period, burst), ReferenceLog(limit, window)
    user = f"{user_id}-{per}-{period}-{burst}-{window}-{limit}-{start}-{len(steps)}"
    now = start
    stale = redis_client.keys(f"ratelimit:{user}:*")  # an example hypothesis runs again
    if stale:
        redis_client.delete(*stale)
    try:
        for advance, cost in steps:
            now += advance
            cost = min(cost, burst, limit)
            _native._set_client_clock(now)
            answer = decide(limiter, user, ((limit, window),), (per, period, burst), cost=cost)
            saved = bucket.tat
            by_bucket = bucket.decide(now, cost)
            if not by_bucket[0]:
                expected = (False, 0, by_bucket[2], period, by_bucket[3])
            else:
                left, wait = log.left(now, cost)
                if left < 0:
                    bucket.tat = saved  # all or nothing: the bucket is not charged
                    expected = (False, 0, math.ceil(wait / 1000), window, wait)
                else:
                    log.entries.append((now, cost))
                    fewest = min((by_bucket[1], period), (left, window), key=lambda x: x[0])
                    expected = (True, fewest[0], 0, fewest[1], 0)
            assert answer == expected, (now, cost)
    finally:
        _native._set_client_clock(None)
