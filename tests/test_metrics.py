"""The limiters' metrics: counters kept in C (csrc/metrics.c) that equal the decisions made,
from threads and from coroutines; failures, replays and connection errors counted where
they happen; and their export to Prometheus (prometheus_client) and OpenTelemetry. Real
redis-server, real faults (a closed port, a proxy that loses a reply).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest

from genai_ratelimit import AsyncRateLimiter, RateLimiter, RateLimiterUnavailable, _native
from genai_ratelimit.metrics import PrometheusCollector, instrument_otel
from helpers_async import LimiterFactory, LoopFactory, run_async
from helpers_core import run_lined_up
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
    with pytest.raises(ValueError, match="kind must be"):
        unreachable_limiter._record_outcome("allowed")
    with pytest.raises(TypeError):
        unreachable_limiter._record_outcome(1)
    assert counts(unreachable_limiter.metrics()) == {**ZERO_COUNTS, "fail_open": 1, "shadow": 2}


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


# ------------------------------------------------------------------------------- export

def test_prometheus_collector_exports_the_counters(redis_url: str, redis_client: redis.Redis,
                                                   user_id: str) -> None:
    with RateLimiter(redis_url) as limiter:
        for _ in range(3):
            limiter.check_windows(user_id, [(2, 60), (10, 3600)])
        registry = CollectorRegistry()
        registry.register(PrometheusCollector({"api": limiter}))
        text = generate_latest(registry).decode()
    lines = set(text.splitlines())
    assert 'genai_ratelimit_decisions_total{limiter="api",outcome="allowed",window=""} 2.0' in lines
    assert 'genai_ratelimit_decisions_total{limiter="api",outcome="rejected",window="60"} 1.0' in lines
    assert 'genai_ratelimit_replays_total{limiter="api"} 0.0' in lines
    assert 'genai_ratelimit_redis_latency_seconds_count{limiter="api"} 3.0' in lines
    assert 'genai_ratelimit_redis_latency_seconds_bucket{le="+Inf",limiter="api"} 3.0' in lines


def test_otel_instruments_report_the_counters(redis_url: str, redis_client: redis.Redis,
                                              user_id: str) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    with RateLimiter(redis_url) as limiter:
        limiter.check(user_id, 1, 60)
        limiter.check(user_id, 1, 60)
        instrument_otel({"api": limiter}, meter=provider.get_meter("test"))
        data = reader.get_metrics_data()
    points = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    points[(metric.name, tuple(sorted(point.attributes.items())))] = point.value
    provider.shutdown()
    api = ("limiter", "api")
    assert points[("genai_ratelimit.decisions",
                   (api, ("outcome", "allowed"), ("window", "")))] == 1
    assert points[("genai_ratelimit.decisions",
                   (api, ("outcome", "rejected"), ("window", "60")))] == 1
    assert points[("genai_ratelimit.connection_errors", (api,))] == 0
    assert sum(v for (name, _), v in points.items()
               if name == "genai_ratelimit.redis.latency.buckets") == 2


def test_exporters_refuse_what_has_no_metrics() -> None:
    with pytest.raises(TypeError, match="no metrics"):
        PrometheusCollector({"api": object()})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="no metrics"):
        instrument_otel(object())  # type: ignore[arg-type]
