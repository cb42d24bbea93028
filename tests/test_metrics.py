"""The limiters' metrics: counters kept in C (csrc/py_metrics.c) that equal the decisions made,
from threads and from coroutines; failures, replays and connection errors counted where
they happen; and their export to Prometheus (prometheus_client) and OpenTelemetry. Real
redis-server, real faults (a closed port, a proxy that loses a reply).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from typing import Any

import pytest
import redis
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest

from genai_ratelimit import AsyncRateLimiter, RateLimiter, RateLimiterUnavailable, Scope, _native
from genai_ratelimit.metrics import (
    FAMILIES,
    LATENCY_BUCKETS,
    OPS,
    PrometheusCollector,
    instrument_otel,
    merge_snapshots,
)
from helpers_async import LimiterFactory, LoopFactory, run_async
from helpers_core import closed_port_url, run_lined_up
from test_idempotent_retry import ReplyDroppingProxy, redis_port  # noqa: F401 (a fixture)

ZERO_COUNTS = {"allowed": 0, "rejected": 0, "unavailable": 0, "fail_open": 0, "shadow": 0,
               "replays": 0, "connection_errors": 0}


def counts(metrics: Any) -> dict[str, Any]:
    return {name: metrics[name] for name in ZERO_COUNTS}


def assert_latency_consistent(metrics: Any, round_trips: int) -> None:
    assert metrics["latency_count"] == round_trips
    assert sum(n for _, n in metrics["latency_buckets"]) == round_trips
    assert metrics["latency_buckets"][-1][0] is None
    assert metrics["latency_sum_s"] >= 0


def test_a_new_limiter_counts_nothing(limiter: Any) -> None:
    m = limiter.metrics()
    assert m["enabled"] is True
    assert counts(m) == ZERO_COUNTS
    assert m["rejected_by_window"] == {}
    assert_latency_consistent(m, 0)


def test_counters_equal_the_decisions_of_a_sequence(limiter: Any, user_id: str) -> None:
    windows = [(2, 60), (3, 3600)]
    outcomes = [limiter.check_windows(user_id, windows)[0] for _ in range(5)]
    limiter.reserve(user_id, [(10, 86400)], token_windows=[(5, 60)], tokens=5)
    limiter.reserve(user_id, [(10, 86400)], token_windows=[(5, 60)], tokens=1)  # tokens refuse
    limiter.peek(user_id, windows)  # not a decision: a round trip only
    limiter.reset(user_id, windows)
    assert limiter.check_windows(user_id, windows)[0] is True
    assert limiter.check(user_id, 1, 60)[0] is False  # the 60 s key holds 1 entry now
    m = limiter.metrics()
    assert outcomes == [True, True, False, False, False]
    assert counts(m) == {**ZERO_COUNTS, "allowed": 4, "rejected": 5}
    assert m["rejected_by_window"] == {"60": 4, "60:tokens": 1}
    assert_latency_consistent(m, 5 + 2 + 1 + 1 + 2)


@pytest.mark.limiter_kinds("sync", reason="threads share one blocking limiter")
def test_counters_equal_the_decisions_of_a_burst_of_threads(limiter: Any, user_id: str) -> None:
    results = run_lined_up(16, lambda i: [limiter.check(user_id, 40, 60)[0] for _ in range(10)])
    allowed = sum(sum(r) for r in results)
    m = limiter.metrics()
    assert allowed == 40
    assert (m["allowed"], m["rejected"], m["rejected_by_window"]) == (40, 120, {"60": 120})
    assert_latency_consistent(m, 160)


@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="coroutines drive the async limiter")
def test_counters_equal_the_decisions_of_a_burst_of_coroutines(
        loop_factory: LoopFactory, redis_url: str, redis_client: redis.Redis,
        user_id: str) -> None:
    async def burst() -> tuple[list[Any], Any]:
        async with AsyncRateLimiter(redis_url) as limiter:
            results = await asyncio.gather(*(limiter.check(user_id, 50, 60) for _ in range(300)))
            return results, limiter.metrics()

    results, m = run_async(burst(), loop_factory)
    assert sum(r[0] for r in results) == 50
    assert (m["allowed"], m["rejected"], m["rejected_by_window"]) == (50, 250, {"60": 250})
    assert m["unavailable"] == m["connection_errors"] == 0
    assert_latency_consistent(m, 300)


def test_unreachable_redis_counts_unavailable_decisions_and_connection_errors(
        unreachable_limiter: Any) -> None:
    for _ in range(3):
        with pytest.raises(RateLimiterUnavailable):
            unreachable_limiter.check("u", 5, 60)
    with pytest.raises(RateLimiterUnavailable):
        unreachable_limiter.peek("u", [(5, 60)])  # not a decision: a connection error only
    m = unreachable_limiter.metrics()
    assert counts(m) == {**ZERO_COUNTS, "unavailable": 3, "connection_errors": 4}
    assert_latency_consistent(m, 0)


def test_every_decision_method_counts_unavailable_when_redis_is_unreachable(
        unreachable_limiter: Any) -> None:
    # The FastAPI layer decides with check_windows_detailed: an outage must count there too.
    calls = [lambda: unreachable_limiter.check("u", 5, 60),
             lambda: unreachable_limiter.check_windows("u", [(5, 60)]),
             lambda: unreachable_limiter.check_windows_detailed("u", [(5, 60)]),
             lambda: unreachable_limiter.reserve("u", [(5, 60)])]
    for n, call in enumerate(calls, 1):
        with pytest.raises(RateLimiterUnavailable):
            call()
        assert unreachable_limiter.metrics()["unavailable"] == n
    assert counts(unreachable_limiter.metrics()) == {**ZERO_COUNTS, "unavailable": 4,
                                                     "connection_errors": 4}


def test_a_lost_reply_counts_one_replay_and_one_decision(make_limiter: LimiterFactory,
                                                         redis_client: redis.Redis,
                                                         redis_port: int, user_id: str) -> None:
    redis_client.script_load(_native.SCRIPT_SOURCE)
    proxy = ReplyDroppingProxy(redis_port, drop=1)
    try:
        with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as limiter:
            assert limiter.check(user_id, 5, 60) == (True, 4, 0)
            m = limiter.metrics()
    finally:
        proxy.close()
    assert counts(m) == {**ZERO_COUNTS, "allowed": 1, "replays": 1, "connection_errors": 1}
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 1


def test_metrics_off_counts_nothing(make_limiter: LimiterFactory, redis_url: str,
                                    redis_client: redis.Redis, user_id: str) -> None:
    limiter = make_limiter(redis_url, metrics=False)
    limiter.check(user_id, 1, 60)
    limiter.check(user_id, 1, 60)
    limiter._record_outcome("fail_open")
    m = limiter.metrics()
    assert m["enabled"] is False
    assert counts(m) == ZERO_COUNTS
    assert_latency_consistent(m, 0)


def test_record_outcome_counts_the_fastapi_layers_outcomes(unreachable_limiter: Any) -> None:
    unreachable_limiter._record_outcome("fail_open")
    unreachable_limiter._record_outcome("shadow")
    unreachable_limiter._record_outcome("shadow")
    unreachable_limiter._record_outcome("reserved_tokens", 250)
    with pytest.raises(ValueError, match="kind must be"):
        unreachable_limiter._record_outcome("allowed")
    with pytest.raises(TypeError):
        unreachable_limiter._record_outcome(1)
    with pytest.raises(ValueError, match="count must be >= 0"):
        unreachable_limiter._record_outcome("charged_tokens", -1)
    with pytest.raises(TypeError, match="count must be an int"):
        unreachable_limiter._record_outcome("charged_tokens", True)
    m = unreachable_limiter.metrics()
    assert counts(m) == {**ZERO_COUNTS, "fail_open": 1, "shadow": 2}
    assert (m["reserved_tokens"], m["charged_tokens"]) == (250, 0)


@pytest.mark.limiter_kinds("sync", reason="the FastAPI layer is tested with both elsewhere; "
                                          "here only its call into the limiter's counters")
def test_fail_open_in_the_fastapi_layer_is_counted(unreachable_limiter: Any) -> None:
    from fastapi import Depends, FastAPI
    from fastapi.testclient import TestClient

    from genai_ratelimit.fastapi import RateLimit

    dependency = RateLimit(limiter=unreachable_limiter, on_unavailable="allow")
    app = FastAPI()

    @app.get("/", dependencies=[Depends(dependency)])
    def root() -> dict[str, str]:
        return {}

    with TestClient(app) as client:
        assert client.get("/").status_code == 200
    m = unreachable_limiter.metrics()
    assert (m["fail_open"], m["unavailable"], dependency.fail_open_count) == (1, 1, 1)


@pytest.mark.limiter_kinds("sync", reason="the FastAPI layer is tested with both elsewhere; "
                                          "here only its call into the limiter's counters")
def test_shadow_mode_in_the_fastapi_layer_is_counted(limiter: Any, user_id: str) -> None:
    from fastapi import Depends, FastAPI
    from fastapi.testclient import TestClient

    from genai_ratelimit.fastapi import RateLimit

    dependency = RateLimit(limiter=limiter, mode="shadow",
                           tier_limits={"free": {"per_minute": 2, "per_day": 10}},
                           identify=lambda request: (user_id, "free"))
    app = FastAPI()

    @app.get("/", dependencies=[Depends(dependency)])
    def root() -> dict[str, str]:
        return {}

    with TestClient(app) as client:
        assert [client.get("/").status_code for _ in range(4)] == [200] * 4
    m = limiter.metrics()
    assert (m["allowed"], m["rejected"], m["shadow"]) == (2, 2, 2)
    assert dependency.shadow_count == 2


# ------------------------------------------------------------------ what is counted, by what

def test_each_round_trip_counts_in_the_latency_of_its_op(limiter: Any, user_id: str) -> None:
    limiter.check(user_id, 5, 60)
    limiter.check_windows(user_id, [(5, 60)])
    limiter.check_windows(user_id, [(5, 60)])
    limiter.check_windows_detailed(user_id, [(5, 60)])
    reservation = limiter.reserve(user_id, [(5, 3600)])
    limiter.reconcile(reservation, 1)
    limiter.peek(user_id, [(5, 60)])
    limiter.reset(user_id, [(5, 60)])
    lease = limiter.acquire(user_id, 2)
    limiter.renew(lease)
    limiter.release(lease)
    m = limiter.metrics()
    assert set(m["latency_by_op"]) == set(OPS)
    assert {op: h["count"] for op, h in m["latency_by_op"].items() if h["count"]} == {
        "check": 1, "check_windows": 2, "check_windows_detailed": 1, "reserve": 1,
        "reconcile": 1, "peek": 1, "reset": 1, "acquire": 1, "renew": 1, "release": 1}
    for histogram in m["latency_by_op"].values():
        assert sum(n for _, n in histogram["buckets"]) == histogram["count"]
        assert [b for b, _ in histogram["buckets"]] == [*LATENCY_BUCKETS, None]
    assert_latency_consistent(m, 11)  # every script round trip, as before ops had their own


def test_rejections_say_the_window_resource_and_scope_that_refused(limiter: Any,
                                                                   user_id: str) -> None:
    upstream = Scope("openai/gpt-4o", windows=[(1, 60)], shared=True)
    route = Scope("route:/v1/chat", windows=[(1, 3600)])
    model = Scope("model:gpt-4o", token_windows=[(10, 60)])
    other = Scope("batch", windows=[(1, 120)])
    own = f"{user_id}-own"
    for scope in (upstream, route, other):
        assert limiter.reserve(f"{user_id}-{scope.name}", [(9, 60)], scopes=[scope]).allowed
        assert not limiter.reserve(f"{user_id}-{scope.name}", [(9, 60)], scopes=[scope]).allowed
    assert limiter.reserve(user_id, [(9, 60)], scopes=[model], tokens=8,
                           token_windows=[(100, 60)]).allowed
    assert not limiter.reserve(user_id, [(9, 60)], scopes=[model], tokens=8,
                               token_windows=[(100, 60)]).allowed
    assert limiter.reserve(own, [(9, 60)], token_windows=[(5, 86400)], tokens=5).allowed
    assert not limiter.reserve(own, [(9, 60)], token_windows=[(5, 86400)], tokens=1).allowed
    assert limiter.check(own, 1, 30)[0] and not limiter.check(own, 1, 30)[0]
    m = limiter.metrics()
    assert sorted(m["rejections"], key=repr) == sorted([
        (60, "requests", "upstream", 1), (3600, "requests", "route", 1),
        (120, "requests", "other", 1), (60, "tokens", "model", 1),
        (86400, "tokens", "user", 1), (30, "requests", "user", 1)], key=repr)
    assert m["rejected"] == 6 == sum(r[3] for r in m["rejections"])
    assert m["rejected_by_window"] == {"60": 1, "3600": 1, "120": 1, "60:tokens": 1,
                                      "86400:tokens": 1, "30": 1}


def test_windows_beyond_the_first_32_share_window_seconds_other(limiter: Any,
                                                                user_id: str) -> None:
    for seconds in range(1, 41):
        assert limiter.check(user_id, 1, seconds)[0]
        assert not limiter.check(user_id, 1, seconds)[0]
    m = limiter.metrics()
    named = [r for r in m["rejections"] if r[0] is not None]
    assert len(named) == 32 and all(r[3] == 1 for r in named)
    assert [r for r in m["rejections"] if r[0] is None] == [(None, "requests", "user", 8)]
    assert m["rejected_by_window"]["other"] == 8 and m["rejected"] == 40


def test_tokens_reserved_charged_and_refunded(limiter: Any, user_id: str) -> None:
    windows, tokens = [(10, 60)], [(1000, 60)]
    first = limiter.reserve(user_id, windows, token_windows=tokens, tokens=600)
    second = limiter.reserve(user_id, windows, token_windows=tokens, tokens=300)
    refused = limiter.reserve(user_id, windows, token_windows=tokens, tokens=200)
    plain = limiter.reserve(user_id, windows)  # no token windows: no tokens to count
    assert (first.allowed, second.allowed, refused.allowed, plain.allowed) == (True, True, False,
                                                                               True)
    assert limiter.reconcile(first, 450) == 1   # 450 charged, 150 refunded
    assert limiter.reconcile(second, 380) == 1  # 380 charged, an overage: nothing refunded
    assert limiter.reconcile(refused, 10) == 0  # nothing was logged: nothing counted
    assert limiter.reconcile(plain, 1) == 1     # a request reservation: no tokens
    m = limiter.metrics()
    assert (m["reserved_tokens"], m["charged_tokens"], m["refunded_tokens"]) == (900, 830, 150)


def test_the_kill_switch_reserves_no_tokens(limiter: Any, user_id: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "1")
    reservation = limiter.reserve(user_id, [(1, 60)], token_windows=[(10, 60)], tokens=5)
    assert reservation.allowed and reservation.member == ""
    assert limiter.reconcile(reservation, 3) == 0
    m = limiter.metrics()
    assert (m["reserved_tokens"], m["charged_tokens"], m["refunded_tokens"]) == (0, 0, 0)


def test_leases_acquired_refused_released_and_not_held(limiter: Any, user_id: str) -> None:
    held = limiter.acquire(user_id, 1)
    refused = limiter.acquire(user_id, 1)
    assert held.allowed and not refused.allowed
    assert limiter.release(held) is True
    assert limiter.release(held) is False  # already given back
    m = limiter.metrics()
    assert (m["leases_acquired"], m["leases_refused"], m["leases_released"],
            m["releases_not_held"]) == (1, 1, 1, 1)
    assert (m["allowed"], m["rejected"]) == (0, 0), "leases are not window decisions"


@pytest.mark.storages("zset", "compact", reason="each storage has its own reserve-with-slot "
                                             "and reconcile-and-release scripts")
def test_a_slot_taken_by_reserve_and_given_back_by_reconcile_counts_like_acquire_and_release(
        limiter: Any, user_id: str) -> None:
    # The FastAPI layer's capped TokenRateLimit: reserve(in_flight=) in, reconcile(release=True)
    # out. The in-flight panel is acquired - released: both ends must count.
    windows, tokens = [(10, 60)], [(1000, 60)]
    held = limiter.reserve(user_id, windows, token_windows=tokens, tokens=50, in_flight=(1, 60))
    refused = limiter.reserve(user_id, windows, token_windows=tokens, tokens=50,
                              in_flight=(1, 60))
    assert held.allowed and not refused.allowed and refused.window_seconds == 0
    assert limiter.reconcile(held, 20, release=True) == 1
    assert limiter.reconcile(held, 20, release=True) == 1  # the slot is free already
    m = limiter.metrics()
    assert (m["leases_acquired"], m["leases_refused"], m["leases_released"],
            m["releases_not_held"]) == (1, 1, 1, 1)
    assert (m["allowed"], m["rejected"]) == (1, 0), "a slot refusal is not a window decision"


# ------------------------------------------------------------------------------- export

def exposition(**limiters: Any) -> str:
    registry = CollectorRegistry()
    registry.register(PrometheusCollector(limiters))
    return generate_latest(registry).decode()


def sample_lines(text: str) -> dict[str, float]:
    """{'name{labels}': value} of every sample of a text exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def series(text: str) -> set[str]:
    return set(sample_lines(text))


def varied_workload(limiter: Any, user: str) -> None:
    """Allowed and rejected decisions over request and token windows and every kind of
    scope, a reconcile, leases, a peek and a reset: every family gets samples."""
    upstream = Scope("openai/gpt-4o", windows=[(1, 60)], shared=True)
    route = Scope("route:/v1/chat", windows=[(1, 60)])
    reservations = []
    for _ in range(2):  # the second of each is refused
        limiter.check_windows(user, [(1, 60), (10, 86400)])
        reservations.append(limiter.reserve(user, [(9, 3600)], token_windows=[(100, 60)],
                                            tokens=60))
        limiter.reserve(f"{user}-up", [(9, 3600)], scopes=[upstream])
        limiter.reserve(f"{user}-route", [(9, 3600)], scopes=[route])
    limiter.reconcile(reservations[0], 10)
    lease = limiter.acquire(user, 1)
    limiter.acquire(user, 1)
    limiter.release(lease)
    limiter.peek(user, [(1, 60)])
    limiter.reset(f"{user}-x", [(1, 60)])


@pytest.mark.limiter_kinds("sync", reason="the exporter reads metrics(); both kinds give one shape")
def test_prometheus_collector_exports_every_family(limiter: Any, user_id: str) -> None:
    varied_workload(limiter, user_id)
    samples = sample_lines(exposition(api=limiter))
    m = limiter.metrics()
    assert samples['genai_ratelimit_decisions_total{limiter="api",outcome="allowed"}'] == m["allowed"]
    assert samples['genai_ratelimit_decisions_total{limiter="api",outcome="rejected"}'] == 4
    assert samples['genai_ratelimit_rejections_total{limiter="api",resource="requests",'
                   'scope="user",window_seconds="60"}'] == 1
    assert samples['genai_ratelimit_rejections_total{limiter="api",resource="tokens",'
                   'scope="user",window_seconds="60"}'] == 1
    assert samples['genai_ratelimit_rejections_total{limiter="api",resource="requests",'
                   'scope="upstream",window_seconds="60"}'] == 1
    assert samples['genai_ratelimit_rejections_total{limiter="api",resource="requests",'
                   'scope="route",window_seconds="60"}'] == 1
    assert samples['genai_ratelimit_reserved_tokens_total{limiter="api"}'] == 60
    assert samples['genai_ratelimit_charged_tokens_total{limiter="api"}'] == 10
    assert samples['genai_ratelimit_refunded_tokens_total{limiter="api"}'] == 50
    assert samples['genai_ratelimit_lease_acquisitions_total{limiter="api",outcome="refused"}'] == 1
    assert samples['genai_ratelimit_lease_releases_total{limiter="api",outcome="released"}'] == 1
    assert samples['genai_ratelimit_redis_latency_seconds_count{limiter="api",op="reserve"}'] == 6
    assert samples['genai_ratelimit_redis_latency_seconds_bucket{le="+Inf",limiter="api",'
                   'op="check_windows"}'] == 2
    assert not any('op="check"' in name for name in samples), "an op never used has no series"


def test_the_exposition_follows_prometheus_naming_and_label_rules(redis_url: str,
                                                                  redis_client: redis.Redis,
                                                                  user_id: str) -> None:
    with RateLimiter(redis_url) as limiter:
        varied_workload(limiter, user_id)
        text = exposition(api=limiter)
    allowed_values = {"outcome": {"allowed", "rejected", "unavailable", "acquired", "refused",
                                  "released", "not_held"},
                      "resource": {"requests", "tokens"},
                      "scope": {"user", "route", "model", "upstream", "other"},
                      "op": set(OPS), "limiter": {"api"}}
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
    assert len(types) == len(FAMILIES)
    for name, kind in types.items():
        assert name.startswith("genai_ratelimit_")
        if kind == "counter":
            assert name.endswith("_total"), name
        elif kind == "histogram":
            assert name.endswith("_seconds"), name
        else:  # a gauge: a count now, never _total
            assert kind == "gauge" and not name.endswith("_total"), name
    for sample in series(text):
        labels = dict(pair.split("=", 1) for pair in sample[sample.index("{") + 1:-1].split(","))
        for label, quoted in labels.items():
            value = quoted.strip('"')
            assert value, f"an empty label value in {sample}"
            if label == "window_seconds":
                assert value.isdigit() or value == "other", sample
            elif label != "le":
                assert value in allowed_values[label], sample


def test_promtool_check_metrics_accepts_the_real_exposition(redis_url: str,
                                                            redis_client: redis.Redis,
                                                            user_id: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: Debian's `prometheus` package has it (make test "
                    "installs it: scripts/ensure-debian-packages.sh prometheus)")
    with RateLimiter(redis_url) as limiter:
        varied_workload(limiter, user_id)
        text = exposition(api=limiter, second=limiter)

    def check(text: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                              text=True, timeout=30)

    done = check(text)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), done
    # The same promtool finds what it is there to find: a counter named without _total.
    bad = check("# HELP genai_ratelimit_decisions Decisions.\n"
                "# TYPE genai_ratelimit_decisions counter\ngenai_ratelimit_decisions 1\n")
    assert bad.returncode != 0 and "_total" in bad.stdout + bad.stderr


@pytest.mark.limiter_kinds("sync", "asyncio", reason="one limiter of each kind; the uvloop "
                                                     "kind counts in the same C")
def test_ten_thousand_users_make_no_more_series(make_limiter: LimiterFactory, redis_url: str,
                                                redis_client: redis.Redis, user_id: str) -> None:
    # A generous timeout: 100 users' calls queue on few connections, on a loaded machine
    # (or under ASan) a call may wait more than the default second for its turn.
    native = make_limiter.native(redis_url, socket_timeout=30.0)
    runner = asyncio.new_event_loop() if make_limiter.is_async else None

    async def one_user(user: str) -> None:
        await native.check_windows(user, [(1, 60), (5, 86400)])
        await native.check_windows(user, [(1, 60), (5, 86400)])  # refused by the 60 s window
        reservation = await native.reserve(user, [(9, 60)], token_windows=[(10, 60)], tokens=9)
        await native.reconcile(reservation, 4)

    async def many_users(users: range) -> None:
        await asyncio.gather(*(one_user(f"{user_id}-{n}") for n in users))

    def decide(users: range) -> None:
        if runner is None:
            for n in users:
                user = f"{user_id}-{n}"
                native.check_windows(user, [(1, 60), (5, 86400)])
                native.check_windows(user, [(1, 60), (5, 86400)])
                native.reconcile(native.reserve(user, [(9, 60)], token_windows=[(10, 60)],
                                                tokens=9), 4)
            return
        for start in range(users.start, users.stop, 100):  # batches of concurrent users
            batch = range(start, min(start + 100, users.stop))
            runner.run_until_complete(many_users(batch))

    try:
        decide(range(10))
        before = series(exposition(api=native))
        decide(range(10, 10_000))
        after_text = exposition(api=native)
    finally:
        if runner is not None:
            runner.run_until_complete(native.aclose())
            runner.close()
    assert series(after_text) == before
    samples = sample_lines(after_text)
    assert samples['genai_ratelimit_decisions_total{limiter="api",outcome="rejected"}'] == 10_000
    assert samples['genai_ratelimit_reserved_tokens_total{limiter="api"}'] == 90_000
    assert samples['genai_ratelimit_refunded_tokens_total{limiter="api"}'] == 50_000


def test_snapshots_of_several_processes_add_up(limiter: Any, user_id: str) -> None:
    varied_workload(limiter, user_id)
    one = limiter.metrics()
    both = merge_snapshots([one, one])
    assert both["allowed"] == 2 * one["allowed"] and both["rejected"] == 2 * one["rejected"]
    assert sorted(both["rejections"]) == sorted((w, r, s, 2 * n) for w, r, s, n in one["rejections"])
    reserve = both["latency_by_op"]["reserve"]
    assert reserve["count"] == 2 * one["latency_by_op"]["reserve"]["count"]
    assert [n for _, n in reserve["buckets"]] == [
        2 * n for _, n in one["latency_by_op"]["reserve"]["buckets"]]
    assert both["latency_count"] == 2 * one["latency_count"]


# ------------------------------------------------------------------------ OpenTelemetry

def otel_points(reader: InMemoryMetricReader) -> dict[tuple[str, tuple[tuple[str, Any], ...]], Any]:
    points = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    points[(metric.name, tuple(sorted(point.attributes.items())))] = point
    return points


def test_otel_reports_every_counter_with_the_prometheus_labels(redis_url: str,
                                                               redis_client: redis.Redis,
                                                               user_id: str) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        with RateLimiter(redis_url) as limiter:
            instrument_otel({"api": limiter}, meter=provider.get_meter("test"))
            varied_workload(limiter, user_id)
            points = otel_points(reader)
            prometheus = sample_lines(exposition(api=limiter))
    finally:
        provider.shutdown()
    api = ("limiter", "api")
    assert points[("genai_ratelimit.decisions", (api, ("outcome", "rejected")))].value == 4
    assert points[("genai_ratelimit.rejections", (api, ("resource", "tokens"), ("scope", "user"),
                                                  ("window_seconds", "60")))].value == 1
    assert points[("genai_ratelimit.tokens.refunded", (api,))].value == 50
    # Every Prometheus counter sample is an OpenTelemetry point with the same labels and value.
    by_prometheus_name = {f"genai_ratelimit_{f.name}_total": f.otel_name for f in FAMILIES
                          if f.kind == "counter"}
    counters = 0
    for sample, value in prometheus.items():
        name, _, labels = sample.partition("{")
        if name not in by_prometheus_name:
            continue
        attributes = tuple(sorted((k, v.strip('"')) for k, v in
                                  (pair.split("=", 1) for pair in labels[:-1].split(","))))
        assert points[(by_prometheus_name[name], attributes)].value == value, sample
        counters += 1
    assert counters >= 15


@pytest.mark.limiter_kinds("sync", "asyncio", reason="the wrapper of a blocking and of a "
                                                     "coroutine method")
def test_otel_latency_is_a_histogram_with_explicit_buckets_per_op(limiter: Any,
                                                                  user_id: str) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        # The AsyncRateLimiter itself behind the blocking adapter: its methods get wrapped.
        instrument_otel({"api": getattr(limiter, "inner", limiter)},
                        meter=provider.get_meter("test"))
        for _ in range(3):
            limiter.check(user_id, 5, 60)
        limiter.reserve(user_id, [(5, 60)])
        limiter.peek(user_id, [(5, 60)])
        points = otel_points(reader)
    finally:
        provider.shutdown()
    check = points[("genai_ratelimit.redis.latency", (("limiter", "api"), ("op", "check")))]
    assert type(check).__name__ == "HistogramDataPoint"
    assert tuple(check.explicit_bounds) == LATENCY_BUCKETS
    assert (check.count, sum(check.bucket_counts)) == (3, 3)
    assert 0 < check.sum < 3.0
    assert points[("genai_ratelimit.redis.latency",
                   (("limiter", "api"), ("op", "reserve")))].count == 1
    assert points[("genai_ratelimit.redis.latency", (("limiter", "api"), ("op", "peek")))].count == 1


def test_otel_spans_around_each_call_nest_and_record_failures(
        redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = tracer_provider.get_tracer("test")
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    down = RateLimiter(closed_port_url(), connect_timeout=0.3, socket_timeout=0.3)
    try:
        async def served() -> None:
            async with AsyncRateLimiter(redis_url) as limiter:
                instrument_otel({"async": limiter}, meter=meter_provider.get_meter("t"),
                                tracer=tracer)
                with tracer.start_as_current_span("request"):
                    await asyncio.gather(limiter.check(user_id, 5, 60),
                                         limiter.check_windows(user_id, [(5, 60)]))

        asyncio.run(served())
        instrument_otel({"down": down}, meter=meter_provider.get_meter("t"), tracer=tracer)
        with pytest.raises(RateLimiterUnavailable):
            down.check(user_id, 5, 60)
    finally:
        down.close()
        meter_provider.shutdown()
    spans = {span.name: span for span in exporter.get_finished_spans()
             if span.attributes.get("genai_ratelimit.limiter") != "down"}
    parent = spans["request"]
    for name in ("genai_ratelimit check", "genai_ratelimit check_windows"):
        span = spans[name]
        assert span.kind is SpanKind.CLIENT
        assert span.parent is not None and span.parent.span_id == parent.context.span_id
        assert dict(span.attributes) == {"db.system": "redis", "genai_ratelimit.limiter": "async",
                                         "genai_ratelimit.op": name.split()[1]}
    failed = [s for s in exporter.get_finished_spans()
              if s.attributes.get("genai_ratelimit.limiter") == "down"]
    assert len(failed) == 1 and failed[0].status.status_code is StatusCode.ERROR
    assert failed[0].events[0].name == "exception"


def test_exporters_refuse_what_has_no_metrics() -> None:
    with pytest.raises(TypeError, match="no metrics"):
        PrometheusCollector({"api": object()})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="no metrics"):
        instrument_otel(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty str"):
        PrometheusCollector({"": object()})  # type: ignore[dict-item]
