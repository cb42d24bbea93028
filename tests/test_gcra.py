"""GCRA (check_rate, lua/gcra.lua): conformance with a reference model of the algorithm on a
fake clock, for every limiter kind (tests/conftest.py: sync, asyncio, uvloop) against a real
redis-server; what Redis holds (one key, its TTL) is read back. GCRA keeps no window log, so
the storage option does not apply and the tests are not run per storage.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.cluster import RedisCluster as ClusterClient

from genai_ratelimit import RateLimiter, _native
from helpers_async import LimiterFactory
from helpers_core import closed_port_url

MAX_CLOCK_SKEW_MS = 86_400_000


class ReferenceGcra:
    """GCRA by its definition, in exact fractions: T = period / rate, a request of `cost`
    at `now` is allowed when max(TAT, now) + cost * T - now <= burst * T, and then
    TAT = max(TAT, now) + cost * T. Answers what _check_rate answers: (allowed, remaining,
    retry_after_s, retry_after_ms, now_ms)."""

    def __init__(self, rate: int, period_seconds: int, burst: int) -> None:
        self.interval = Fraction(period_seconds * 1000, rate)
        self.burst = burst
        self.tat: Fraction | None = None

    def decide(self, now: int, cost: int) -> tuple[bool, int, int, int, int]:
        tat = max(self.tat, Fraction(now)) if self.tat is not None else Fraction(now)
        depth = self.burst * self.interval
        if tat + cost * self.interval - now <= depth:
            self.tat = tat + cost * self.interval
            return (True, math.floor((now + depth - self.tat) / self.interval), 0, 0, now)
        remaining = max(0, math.floor((now + depth - tat) / self.interval))
        # The earliest t at which the same request conforms: TAT - (burst - cost) * T.
        wait_ms = math.ceil(tat - (self.burst - cost) * self.interval - now)
        assert wait_ms >= 1
        return (False, remaining, math.ceil(wait_ms / 1000), wait_ms, now)

    def ttl_ms(self, now: int) -> int:
        """The key's TTL right after an allow at now: until the whole burst is available again, and 1 s."""
        assert self.tat is not None
        return math.ceil(self.tat - now) + 1000


class RateDriver:
    """check_rate / _check_rate of a limiter of any kind, called blocking."""

    def __init__(self, limiter: Any) -> None:
        self.limiter = limiter

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.limiter, RateLimiter):
            return getattr(self.limiter, name)(*args, **kwargs)
        return self.limiter.run(getattr(self.limiter.inner, name)(*args, **kwargs))

    def check_rate(self, *args: Any, **kwargs: Any) -> tuple[bool, int, int]:
        return self._call("check_rate", *args, **kwargs)  # type: ignore[no-any-return]

    def detailed(self, *args: Any, **kwargs: Any) -> tuple[bool, int, int, int, int]:
        return self._call("_check_rate", *args, **kwargs)  # type: ignore[no-any-return]

    def metrics(self) -> Any:
        return self.limiter.metrics()

    def many(self, count: int, threads: int, *args: Any) -> list[tuple[bool, int, int, int, int]]:
        """count calls of _check_rate(*args) at once: from `threads` threads on the blocking
        limiter, as `count` concurrent tasks on one loop for an async one."""
        if isinstance(self.limiter, RateLimiter):
            results: list[Any] = []
            lock = threading.Lock()

            def worker(n: int) -> None:
                mine = [self.limiter._check_rate(*args) for _ in range(n)]
                with lock:
                    results.extend(mine)

            workers = [threading.Thread(target=worker, args=(count // threads,))
                       for _ in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(timeout=60)
            return results
        inner = self.limiter.inner

        async def all_at_once() -> list[Any]:
            return list(await asyncio.gather(*[inner._check_rate(*args) for _ in range(count)]))

        return self.limiter.run(all_at_once())  # type: ignore[no-any-return]


@pytest.fixture
def make_rate_limiter(limiter_kind: str) -> Iterator[Callable[..., RateDriver]]:
    """make_rate_limiter(url, **options): a RateDriver over a limiter of the kind under test
    (no storage: GCRA has one layout)."""
    factory = LimiterFactory(limiter_kind)
    try:
        yield lambda url, **options: RateDriver(factory(url, **options))
    finally:
        factory.close()


@pytest.fixture
def fake_clock() -> Iterator[Callable[[int], None]]:
    """Sets what clock="client" reads (ms); the real clock again after the test."""
    try:
        yield _native._set_client_clock
    finally:
        _native._set_client_clock(None)


def gcra_key(user: str, period_seconds: int) -> str:
    return f"ratelimit:{user}:{period_seconds}:gcra"


# ------------------------------------------------------------------------ conformance

# Rates whose emission interval is a whole number of ms, and others (60 s / 7, 1 s / 3,
# a prime rate per day, one far above the period's ms).
RATES = st.sampled_from([(1, 1), (10, 1), (3, 1), (5, 60), (7, 60), (600, 60), (13, 3600),
                         (100_003, 86_400), (1_000_003, 60), (2, 7)])
STEPS = st.lists(st.tuples(
    st.one_of(st.integers(0, 50), st.integers(0, 20_000), st.integers(0, 200_000)),
    st.integers(1, 10)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rate=RATES, burst=st.integers(1, 10), steps=STEPS, start=st.integers(1, 10**13))
def test_every_decision_matches_the_reference_model(make_rate_limiter: Any, redis_url: str,
                                                    redis_client: redis.Redis, fake_clock: Any,
                                                    user_id: str, rate: tuple[int, int],
                                                    burst: int,
                                                    steps: list[tuple[int, int]],
                                                    start: int) -> None:
    """Sequences of (advance the clock, cost): every answer, remaining and the exact wait
    included, is the model's; an allow leaves the TAT in one key with the model's TTL (the
    TTL is then lifted so that a slow machine cannot expire it mid-sequence), a refusal
    writes nothing."""
    limiter = make_rate_limiter(redis_url, clock="client")
    per, period = rate
    model = ReferenceGcra(per, period, burst)
    user = f"{user_id}-{per}-{period}-{burst}-{start}-{len(steps)}"
    key = gcra_key(user, period)
    now = start
    redis_client.delete(key)
    for advance, cost in steps:
        now += advance
        cost = min(cost, burst)
        fake_clock(now)
        before = redis_client.get(key)
        started = time.monotonic()
        answer = limiter.detailed(user, per, period, burst, cost=cost)
        assert answer == model.decide(now, cost), (now, cost)
        if answer[0]:
            ttl = redis_client.pttl(key)
            # The TTL set, less the real time since (the clock Redis expires keys by).
            elapsed_ms = math.ceil((time.monotonic() - started) * 1000)
            assert model.ttl_ms(now) - elapsed_ms - 1 <= ttl <= model.ttl_ms(now)
            assert redis_client.persist(key)
        else:
            assert redis_client.get(key) == before
    assert set(redis_client.keys(f"ratelimit:{user}:*")) <= {key.encode()}


def scale_of(rate: int, period_seconds: int) -> int:
    return rate // math.gcd(rate, period_seconds * 1000)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.integers(0, 30_000), st.integers(1, 4),
                                st.sampled_from([7, 11, 60, 600, 13, 1_000_003])),
                      min_size=1, max_size=25))
def test_a_rate_edited_between_calls_keeps_the_tat_rounded_up_to_a_ms(
        make_rate_limiter: Any, redis_url: str, redis_client: redis.Redis, fake_clock: Any,
        user_id: str, steps: list[tuple[int, int, int]]) -> None:
    """The model with the rate changed from call to call (one key per period): a TAT
    written at another scale that falls between two ms is read as the next ms."""
    limiter = make_rate_limiter(redis_url, clock="client")
    key = gcra_key(user_id, 60)
    redis_client.delete(key)
    now, tat, written_scale = 1_000_000, None, 0
    for advance, cost, rate in steps:
        now += advance
        fake_clock(now)
        model = ReferenceGcra(rate, 60, 4)
        model.tat = tat  # as read: a refusal leaves the stored value as it was
        if tat is not None and tat.denominator != 1 and written_scale != scale_of(rate, 60):
            model.tat = Fraction(math.ceil(tat))
        answer = limiter.detailed(user_id, rate, 60, 4, cost=cost)
        assert answer == model.decide(now, cost), (now, cost, rate)
        if answer[0]:
            tat, written_scale = model.tat, scale_of(rate, 60)
            assert redis_client.persist(key)


def test_check_rate_answers_the_first_three_fields(make_rate_limiter: Any, redis_url: str,
                                                   redis_client: redis.Redis, fake_clock: Any,
                                                   user_id: str) -> None:
    limiter = make_rate_limiter(redis_url, clock="client")
    fake_clock(1_000_000)
    assert [limiter.check_rate(user_id, 7, 60, 3) for _ in range(4)] == [
        (True, 2, 0), (True, 1, 0), (True, 0, 0), (False, 0, 9)]


def test_a_burst_then_one_request_per_interval(make_rate_limiter: Any, redis_url: str,
                                               redis_client: redis.Redis, fake_clock: Any,
                                               user_id: str) -> None:
    """10 a minute, burst 5: 5 at once, then exactly one per 6 s, never 1 ms sooner."""
    limiter = make_rate_limiter(redis_url, clock="client")
    now = 5_000_000
    fake_clock(now)
    assert [limiter.check_rate(user_id, 10, 60, 5)[0] for _ in range(6)] == [True] * 5 + [False]
    for _ in range(5):
        fake_clock(now + 5_999)
        assert limiter.detailed(user_id, 10, 60, 5)[:4] == (False, 0, 1, 1)
        now += 6_000
        fake_clock(now)
        assert limiter.detailed(user_id, 10, 60, 5)[:2] == (True, 0)


def test_a_refused_heavy_request_reports_what_lighter_ones_may_still_use(
        make_rate_limiter: Any, redis_url: str, redis_client: redis.Redis, fake_clock: Any,
        user_id: str) -> None:
    """remaining counts requests of cost 1, on a refusal too; the wait is the heavy one's."""
    limiter = make_rate_limiter(redis_url, clock="client")
    fake_clock(1_000)
    assert limiter.detailed(user_id, 60, 60, 10, cost=7) == (True, 3, 0, 0, 1_000)
    assert limiter.detailed(user_id, 60, 60, 10, cost=5) == (False, 3, 2, 2_000, 1_000)
    assert redis_client.get(gcra_key(user_id, 60)) == b"8000000000"


def test_the_value_is_one_integer_for_scales_up_to_999(
        make_rate_limiter: Any, redis_url: str, redis_client: redis.Redis, fake_clock: Any,
        user_id: str) -> None:
    """One key, one value: the TAT's ms, then 6 digits of scale * 1000 + remainder, an
    integer that Redis keeps in the key's own object; a larger scale, the string
    "<ms>:<remainder>:<scale>"."""
    limiter = make_rate_limiter(redis_url, clock="client")
    fake_clock(1_000_000)
    limiter.check_rate(user_id, 60, 60, 10, cost=10)  # T = 1000 ms
    assert redis_client.get(gcra_key(user_id, 60)) == b"1010000000000"
    limiter.check_rate(user_id, 7, 3600, 10)  # T = 3,600,000 / 7 ms = 514285 + 5/7 ms
    assert redis_client.get(gcra_key(user_id, 3600)) == b"1514285007005"
    for period in (60, 3600):
        assert redis_client.object("encoding", gcra_key(user_id, period)) == b"int"
    # 100 years / 1,000,003 (prime): T = 3,153,590 + 539,230 / 1,000,003 ms
    limiter.check_rate(user_id, 1_000_003, 3_153_600_000, 10)
    assert redis_client.get(gcra_key(user_id, 3_153_600_000)) == b"4153590:539230:1000003"


def test_a_rate_change_keeps_the_state_and_rounds_up_under_one_ms(
        make_rate_limiter: Any, redis_url: str, redis_client: redis.Redis, fake_clock: Any,
        user_id: str) -> None:
    """The key does not name the rate: a budget's edit keeps the user's TAT (its fraction of
    a ms, in the old rate's units, rounded up to the next ms: never earlier)."""
    limiter = make_rate_limiter(redis_url, clock="client")
    fake_clock(1_000_000)
    assert limiter.check_rate(user_id, 7, 60, 1)[0]  # TAT = 1,008,571 + 3/7 ms
    assert limiter.detailed(user_id, 60, 60, 1) == (False, 0, 9, 8_572, 1_000_000)
    fake_clock(1_008_572)  # TAT read as 1,008,572: the whole burst is available again
    assert limiter.detailed(user_id, 60, 60, 1) == (True, 0, 0, 0, 1_008_572)
    assert redis_client.get(gcra_key(user_id, 60)) == b"1009572000000"


def test_an_idle_key_expires_once_the_bucket_is_full(make_rate_limiter: Any, redis_url: str,
                                                     redis_client: redis.Redis,
                                                     user_id: str) -> None:
    """On the server's clock: the key lives until TAT, plus 1 s."""
    limiter = make_rate_limiter(redis_url)
    started = time.monotonic()
    assert limiter.check_rate(user_id, 1, 60, 3, cost=2) == (True, 1, 0)
    assert limiter.check_rate(user_id, 1, 60, 3) == (True, 0, 0)
    ttl = redis_client.pttl(gcra_key(user_id, 60))
    # TAT = the first call's time + 3 minutes: the TTL is that and 1 s, less the real time
    # since the first call (each ms-floored server time may add 1 ms).
    elapsed_ms = math.ceil((time.monotonic() - started) * 1000)
    assert 181_000 - elapsed_ms - 2 <= ttl <= 181_000


def test_server_clock_refusal_waits_for_the_theoretical_arrival_time(
        make_rate_limiter: Any, redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    limiter = make_rate_limiter(redis_url)
    assert limiter.detailed(user_id, 1, 60, 1)[0]
    allowed, remaining, retry_s, retry_ms, now_ms = limiter.detailed(user_id, 1, 60, 1)
    assert (allowed, remaining) == (False, 0)
    tat = int(redis_client.get(gcra_key(user_id, 60))) // 1_000_000
    assert retry_ms == tat - now_ms <= 60_000 and retry_s == math.ceil(retry_ms / 1000)


def test_a_refusal_writes_nothing(make_rate_limiter: Any, redis_url: str,
                                  redis_client: redis.Redis, fake_clock: Any,
                                  user_id: str) -> None:
    limiter = make_rate_limiter(redis_url, clock="client")
    fake_clock(2_000_000)
    limiter.check_rate(user_id, 5, 60, 1)
    key = gcra_key(user_id, 60)
    before = (redis_client.dump(key), redis_client.pttl(key))
    redis_client.execute_command("CONFIG", "RESETSTAT")
    assert limiter.check_rate(user_id, 5, 60, 1)[0] is False
    stats = redis_client.info("commandstats")
    assert "cmdstat_set" not in stats and "cmdstat_pexpire" not in stats
    assert redis_client.dump(key) == before[0]
    assert redis_client.pttl(key) <= before[1]


def test_each_period_and_user_has_its_own_key(make_rate_limiter: Any, redis_url: str,
                                              redis_client: redis.Redis, user_id: str) -> None:
    limiter = make_rate_limiter(redis_url)
    limiter.check_rate(user_id, 5, 60, 1)
    limiter.check_rate(user_id, 5, 3600, 1)
    limiter.check_rate(user_id + ":60", 5, 60, 1)
    assert sorted(redis_client.keys("ratelimit:*")) == sorted(
        [gcra_key(user_id, 60).encode(), gcra_key(user_id, 3600).encode(),
         gcra_key(user_id + ":60", 60).encode()])
    # GCRA's key never meets a window's: a window of the same length is another key.
    assert limiter.check_rate(user_id, 5, 60, 1)[0] is False


# --------------------------------------------------------------------------- input

BAD_INPUT = [
    ((None, 5, 60, 1), {}, TypeError, "user_id must be a str"),
    (("", 5, 60, 1), {}, ValueError, "user_id must not be empty"),
    (("u", True, 60, 1), {}, TypeError, "rate must be an int"),
    (("u", 5, 60.0, 1), {}, TypeError, "period_seconds must be an int"),
    (("u", 5, 60, False), {}, TypeError, "burst must be an int"),
    (("u", 0, 60, 1), {}, ValueError, "rate must be >= 1"),
    (("u", 5, 0, 1), {}, ValueError, "period_seconds must be >= 1"),
    (("u", 5, 60, 0), {}, ValueError, "burst must be >= 1"),
    (("u", 5, 60, 1), {"cost": 0}, ValueError, "cost must be >= 1"),
    (("u", 5, 60, 1), {"cost": True}, TypeError, "cost must be an int"),
    (("u", 5, 60, 3), {"cost": 4}, ValueError, "cost 4 can never be allowed"),
    (("u", 2**53, 60, 1), {}, ValueError, "rate must be at most"),
    (("u", 5, 3_153_600_001, 1), {}, ValueError, "period_seconds must be at most"),
    (("u", 1, 86_400, 2**40), {}, ValueError, "out of range"),
]


@pytest.mark.parametrize(("args", "kwargs", "error", "message"), BAD_INPUT)
def test_bad_input_raises_before_any_io(make_rate_limiter: Any, args: tuple[Any, ...],
                                        kwargs: dict[str, Any], error: type[Exception],
                                        message: str) -> None:
    """On a closed port: an input error raised instead of RateLimiterUnavailable proves the
    input was checked first."""
    limiter = make_rate_limiter(closed_port_url(), connect_timeout=0.5, socket_timeout=0.5)
    with pytest.raises(error, match=message):
        limiter.check_rate(*args, **kwargs)


def test_cost_and_burst_are_keyword_and_required_as_documented(make_rate_limiter: Any) -> None:
    limiter = make_rate_limiter(closed_port_url(), connect_timeout=0.5, socket_timeout=0.5)
    with pytest.raises(TypeError):
        limiter.check_rate("u", 5, 60)
    with pytest.raises(TypeError):
        limiter.check_rate("u", 5, 60, 1, 1)


# --------------------------------------------------------------- kill switch, metrics

def test_kill_switch_allows_with_the_whole_burst_and_sends_nothing(
        monkeypatch: pytest.MonkeyPatch, make_rate_limiter: Any) -> None:
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "true")
    limiter = make_rate_limiter(closed_port_url(), connect_timeout=0.5, socket_timeout=0.5)
    assert limiter.check_rate("u", 5, 60, 4, cost=3) == (True, 4, 0)


def test_decisions_are_counted_like_checks(make_rate_limiter: Any, redis_url: str,
                                           redis_client: redis.Redis, user_id: str) -> None:
    limiter = make_rate_limiter(redis_url)
    for _ in range(3):
        limiter.check_rate(user_id, 1, 60, 2)
    m = limiter.metrics()
    assert (m["allowed"], m["rejected"]) == (2, 1)


def test_unreachable_redis_counts_as_unavailable(make_rate_limiter: Any) -> None:
    from genai_ratelimit import RateLimiterUnavailable

    limiter = make_rate_limiter(closed_port_url(), connect_timeout=0.5, socket_timeout=0.5)
    with pytest.raises(RateLimiterUnavailable):
        limiter.check_rate("u", 5, 60, 1)
    assert limiter.metrics()["unavailable"] == 1


# ----------------------------------------------------------------------- concurrency

def test_concurrent_callers_at_one_instant_get_exactly_the_burst(
        make_rate_limiter: Any, redis_url: str, redis_client: redis.Redis, fake_clock: Any,
        user_id: str) -> None:
    """Many callers on one key at a frozen clock: exactly `burst` admitted; then the clock
    moves by k intervals and exactly k more are (the script is atomic)."""
    limiter = make_rate_limiter(redis_url, clock="client", max_connections=8)
    now = 7_000_000
    fake_clock(now)
    first = limiter.many(240, 8, user_id, 10, 60, 25)  # T = 6 s
    assert sum(r[0] for r in first) == 25
    assert sorted(r[1] for r in first if r[0]) == list(range(25))
    fake_clock(now + 7 * 6_000 + 5_999)
    again = limiter.many(240, 8, user_id, 10, 60, 25)
    assert sum(r[0] for r in again) == 7
    assert {r[3] for r in again if not r[0]} == {1}


def test_concurrent_callers_on_the_server_clock_stay_within_the_model(
        make_rate_limiter: Any, redis_url: str, redis_client: redis.Redis,
        user_id: str) -> None:
    """On the server's clock, over whatever time the calls took: never more than burst +
    elapsed / T admitted (GCRA's bound on any interval), and at least the burst."""
    limiter = make_rate_limiter(redis_url, max_connections=8)
    results = limiter.many(400, 8, user_id, 100, 1, 20)  # T = 10 ms
    admitted = [r for r in results if r[0]]
    times = [r[4] for r in results]
    elapsed = max(times) - min(times)
    assert 20 <= len(admitted) <= 20 + elapsed // 10
    assert all(r[3] >= 1 and r[2] == math.ceil(r[3] / 1000) for r in results if not r[0])


# --------------------------------------------------------------------------- cluster

def test_check_rate_on_a_cluster_keys_under_the_users_hash_tag(
        make_rate_limiter: Any, redis_cluster: Any, fake_clock: Any) -> None:
    limiter = make_rate_limiter(redis_cluster.url, clock="client")
    fake_clock(3_000_000)
    client = ClusterClient(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        for i in range(30):  # users over every master
            user = f"user_{i}"
            assert limiter.check_rate(user, 2, 60, 2) == (True, 1, 0)
            assert limiter.check_rate(user, 2, 60, 2) == (True, 0, 0)
            assert limiter.detailed(user, 2, 60, 2)[:4] == (False, 0, 30, 30_000)
            assert client.get(f"ratelimit:{{{user}}}:60:gcra") == b"3060000000000"
        # An id's braces are percent-encoded in its tag, as in every other key (script.c).
        assert limiter.check_rate("a{b}", 2, 60, 2) == (True, 1, 0)
        assert client.get("ratelimit:{a%7Bb%7D}:60:gcra") == b"3030000000000"
    finally:
        client.close()


# ------------------------------------------------------------------------- the script

def test_the_script_is_embedded_with_its_library() -> None:
    source = _native.GCRA_SOURCE
    assert "local function gcra_decide" in source and "local function script_now" in source
    assert source.index("gcra_decide(") < source.index("return gcra_decide(")


def test_over_maxmemory_the_decision_is_refused_and_nothing_written(
        private_redis: Any, make_rate_limiter: Any, user_id: str) -> None:
    from genai_ratelimit import RateLimiterError

    client = redis.Redis.from_url(private_redis.url)
    try:
        limiter = make_rate_limiter(private_redis.url)
        limiter.check_rate("warm", 5, 60, 5)  # the script is loaded while memory allows
        client.config_set("maxmemory-policy", "noeviction")
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", max(1, used - 1_000_000))
        with pytest.raises(RateLimiterError, match="out of memory"):
            limiter.check_rate(user_id, 5, 60, 5)
        assert client.exists(gcra_key(user_id, 60)) == 0
    finally:
        client.config_set("maxmemory", 0)
        client.close()


def test_a_connection_lost_mid_call_is_decided_anew_at_most_once_more(
        make_rate_limiter: Any, redis_url: str, redis_client: redis.Redis, fake_clock: Any,
        user_id: str) -> None:
    """The replay marker a broken connection adds is ignored: the call is decided again. A
    killed connection between calls is reopened by the next one."""
    limiter = make_rate_limiter(redis_url, clock="client")
    fake_clock(9_000_000)
    assert limiter.check_rate(user_id, 10, 60, 3) == (True, 2, 0)
    redis_client.client_kill_filter(_type="normal", skipme=True)
    assert limiter.check_rate(user_id, 10, 60, 3) == (True, 1, 0)


# ------------------------------------------------------------------------------ leaks

LEAK_CHILD = '''
import asyncio, gc, os, sys
from genai_ratelimit import AsyncRateLimiter, RateLimiter

PAGE = os.sysconf("SC_PAGE_SIZE")
url, count = sys.argv[1], int(sys.argv[2])

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

def sync_calls(n):
    with RateLimiter(url) as limiter:
        for i in range(n):  # allowed, refused (a full bucket), and an input error
            limiter.check_rate(f"leak-{i % 97}", 10**6, 1, 10**6, cost=1 + i % 3)
            limiter.check_rate("leak-full", 1, 3600, 1)
            try:
                limiter.check_rate("leak", 1, 60, 1, cost=2)
            except ValueError:
                pass

def async_calls(n):
    async def run():
        async with AsyncRateLimiter(url) as limiter:
            for start in range(0, n, 64):
                await asyncio.gather(*[limiter.check_rate(f"leak-{i % 97}", 10**6, 1, 10**6)
                                       for i in range(start, min(n, start + 64))])
    asyncio.run(run())

for calls in (sync_calls, async_calls):
    calls(count // 10)
    gc.collect()
    before = rss()
    calls(count)
    gc.collect()
    print(calls.__name__, before, rss())
'''


@pytest.mark.slow
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="RSS under AddressSanitizer measures its quarantine, not leaks")
def test_check_rate_does_not_grow_memory(redis_url: str, redis_client: redis.Redis,
                                         tmp_path: Any) -> None:
    """100,000 rounds of each kind in a child process: its RSS stays flat (a leak of one
    small object per call would add megabytes)."""
    script = tmp_path / "leak_child.py"
    script.write_text(LEAK_CHILD, encoding="utf-8")
    result = subprocess.run([sys.executable, str(script), redis_url, "100000"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for line in result.stdout.splitlines():
        name, before, after = line.split()
        assert int(after) - int(before) < 4 * 1024 * 1024, line
