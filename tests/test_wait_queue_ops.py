"""The operations side of the wait queue of shared caps (docs/wait-queue.md): the metrics
of the waits (genai_ratelimit.metrics.queue_waits: the requests waiting now, by upstream,
and the wait-time histogram by upstream and outcome) counted by both limiters and exported
to Prometheus, `max_wait` on a route (RateLimit / TokenRateLimit) and a tier (tier_limits,
the tiers file), and the queue as the CLI shows it. Waits end on conditions read from
Redis, never on a guessed time."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from genai_ratelimit import Scope
from genai_ratelimit.metrics import (
    QUEUE_WAIT_BUCKETS,
    PrometheusCollector,
    QueueWaits,
    merge_snapshots,
    queue_waits,
)
from helpers_async import LimiterFactory
from test_wait_queue import OWN, QUEUE, UPSTREAM, Waiters, cap, fill, queued, take_ticket, wait_for


def native(limiter: Any) -> Any:
    """The RateLimiter or AsyncRateLimiter behind the blocking interface of the tests."""
    return getattr(limiter, "inner", limiter)


@pytest.fixture
def waiters(make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis):
    crowd = Waiters(make_limiter, redis_url)
    try:
        yield crowd
    finally:
        crowd.close()


def exposition(limiter: Any) -> str:
    registry = CollectorRegistry()
    registry.register(PrometheusCollector({"api": limiter}))
    return generate_latest(registry).decode()


# ------------------------------------------------------------------------------- metrics


def test_each_wait_is_observed_by_upstream_and_outcome(limiter: Any,
                                                       redis_client: redis.Redis) -> None:
    scope = cap(2)
    fill(limiter, scope, 2)
    admitted = limiter.reserve("u", OWN, scopes=[scope], max_wait=5)
    assert admitted.queue_outcome == "queued_then_allowed"
    slow = Scope("llm/slow", windows=[(1, 60)], shared=True)
    fill(limiter, slow, 1)
    late = limiter.reserve("u", OWN, scopes=[slow], max_wait=0.5)
    assert late.queue_outcome == "queue_timeout"
    at_once = limiter.reserve("u", OWN, scopes=[cap(100)], max_wait=5)
    assert at_once.queue_outcome == ""  # decided at once: not a wait

    waits = queue_waits(native(limiter))
    assert waits.waits() == 2
    assert waits.waits(upstream=UPSTREAM, outcome="queued_then_allowed") == 1
    assert waits.waits(upstream="llm/slow", outcome="queue_timeout") == 1
    assert waits.waiting() == 0  # every wait is over
    _, histograms = waits.snapshot()
    by_labels = {(upstream, outcome): h for upstream, outcome, h in histograms}
    allowed = by_labels[(UPSTREAM, "queued_then_allowed")]
    assert allowed["count"] == 1
    assert allowed["sum_s"] == pytest.approx(admitted.waited_ms / 1000)
    assert len(allowed["buckets"]) == len(QUEUE_WAIT_BUCKETS) + 1
    assert by_labels[("llm/slow", "queue_timeout")]["sum_s"] == pytest.approx(
        late.waited_ms / 1000)


def test_the_waiting_gauge_counts_this_processes_tickets_while_they_wait(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        waiters: Waiters) -> None:
    scope = cap(3, 2)  # full: the three wait for the same 2 s, then all are admitted
    fill(make_limiter(redis_url), scope, 3)
    measured = waiters.limiter if waiters.loop is not None else None
    futures = [waiters.start(f"t{i}/u", scope, max_wait=10, tenant=f"t{i}") for i in range(3)]

    def waiting() -> int:
        if measured is None:  # the blocking kind: a limiter per thread, each counts its own
            return sum(queue_waits(limiter).waiting(UPSTREAM) for limiter in make_limiter._blocking)
        return int(queue_waits(measured).waiting(UPSTREAM))

    wait_for(lambda: queued(redis_client) == 3)
    wait_for(lambda: waiting() == 3)  # a take's answer is counted once it is read
    assert queued(redis_client) == 3
    for future in futures:
        assert future.result(timeout=30).queue_outcome == "queued_then_allowed"
    assert queued(redis_client) == 0 and waiting() == 0


def test_the_exposition_has_the_gauge_and_the_histogram_and_passes_promtool(
        limiter: Any) -> None:
    scope = cap(1, 1)
    fill(limiter, scope, 1)
    assert limiter.reserve("u", OWN, scopes=[scope], max_wait=5).allowed
    text = exposition(native(limiter))
    assert "# TYPE genai_ratelimit_queue_wait_seconds histogram" in text
    assert "# TYPE genai_ratelimit_queue_waiting_requests gauge" in text
    assert (f'genai_ratelimit_queue_wait_seconds_count{{limiter="api",outcome='
            f'"queued_then_allowed",upstream="{UPSTREAM}"}} 1.0') in text
    assert (f'genai_ratelimit_queue_waiting_requests{{limiter="api",upstream="{UPSTREAM}"}} '
            '0.0') in text
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: Debian's `prometheus` package has it")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), done


def test_upstreams_beyond_the_bound_count_as_other_and_bad_outcomes_are_refused() -> None:
    from genai_ratelimit.metrics import MAX_QUEUE_UPSTREAMS

    waits = QueueWaits()
    for n in range(MAX_QUEUE_UPSTREAMS + 5):
        waits.observe(f"upstream-{n}", "queue_timeout", 0.1)
    waiting, histograms = waits.snapshot()
    assert len({upstream for upstream, _, _ in histograms}) == MAX_QUEUE_UPSTREAMS + 1
    assert waits.waits(upstream="other") == 5
    leave = waits.enter("upstream-0")
    assert waits.waiting("upstream-0") == 1
    leave()
    leave()  # once only
    assert waits.waiting() == 0
    with pytest.raises(ValueError, match="outcome"):
        waits.observe("x", "queue_full", 1.0)


def test_several_processes_snapshots_add_up() -> None:
    one, two = QueueWaits(), QueueWaits()
    one.observe("a", "queued_then_allowed", 0.3)
    two.observe("a", "queued_then_allowed", 2.0)
    two.enter("a")
    base = {"enabled": True, "rejections": (), "rejected_by_window": {}, "latency_by_op": {},
            "latency_buckets": (), "latency_sum_s": 0.0, "latency_count": 0}
    snapshots = []
    for waits in (one, two):
        waiting, histograms = waits.snapshot()
        snapshots.append(dict(base, queue_waiting=waiting, queue_wait=histograms))
    merged = merge_snapshots(snapshots)  # type: ignore[arg-type]
    assert merged["queue_waiting"] == (("a", 1),)
    ((upstream, outcome, histogram),) = merged["queue_wait"]
    assert (upstream, outcome, histogram["count"]) == ("a", "queued_then_allowed", 2)
    assert math.isclose(histogram["sum_s"], 2.3)


# ----------------------------------------------------- max_wait on a route and on a tier


def gateway(limiter: Any, dependency_name: str, tier_limits: Any, upstream: Any,
            **options: Any) -> Any:
    """An app whose one route decides with the dependency under test; the tier is the
    x-tier header, the identity the x-org header."""
    from fastapi import Depends, FastAPI

    from genai_ratelimit import fastapi as gr_fastapi

    budget = getattr(gr_fastapi, dependency_name)(
        limiter, tier_limits,
        identify=lambda request: (request.headers.get("x-org", "anon"),
                                  request.headers.get("x-tier", "free")),
        upstream=upstream, **options)
    app = FastAPI()

    @app.post("/v1/chat/completions", dependencies=[Depends(budget)])
    async def chat() -> dict[str, bool]:
        return {"ok": True}

    return app


BODY = {"model": "gpt-4o", "max_tokens": 10}


@pytest.mark.parametrize("dependency_name", ["RateLimit", "TokenRateLimit"])
def test_a_routes_max_wait_applies_to_an_upstream_without_one(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        dependency_name: str) -> None:
    """RateLimit(max_wait=...): a request the upstream's cap holds back waits (behind a
    ticket whose waiter is gone, until its deadline) and runs; one the cap cannot admit
    before the route's deadline gets the upstream's 429 at once, queue_timeout."""
    from fastapi.testclient import TestClient

    from genai_ratelimit import fastapi as gr_fastapi
    from genai_ratelimit.metrics import request_outcomes

    limiter = make_limiter.native(redis_url)
    app = gateway(limiter, dependency_name, {"free": {"per_minute": 100}},
                  gr_fastapi.Upstream(UPSTREAM, per_minute=1), max_wait=5)
    take_ticket(redis_url, "ghost", 300)
    with TestClient(app) as client:
        first = client.post("/v1/chat/completions", json=BODY)
        second = client.post("/v1/chat/completions", json=BODY)
    assert first.status_code == 200
    assert second.status_code == 429 and second.headers["x-ratelimit-scope"] == "upstream"
    outcomes = {row[0]: row[-1] for row in request_outcomes(limiter).snapshot()[0]}
    assert outcomes == {"queued_then_allowed": 1, "queue_timeout": 1}
    assert queue_waits(limiter).waits(upstream=UPSTREAM) == 2
    assert queued(redis_client) == 0


@pytest.mark.parametrize("dependency_name", ["RateLimit", "TokenRateLimit"])
def test_a_tiers_max_wait_lets_its_requests_wait_and_others_are_refused_at_once(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        dependency_name: str) -> None:
    from fastapi.testclient import TestClient

    from genai_ratelimit import fastapi as gr_fastapi
    from genai_ratelimit.metrics import request_outcomes

    limiter = make_limiter.native(redis_url)
    tiers = {"free": {"per_minute": 100}, "pro": {"per_minute": 100, "max_wait": 5}}
    app = gateway(limiter, dependency_name, tiers, gr_fastapi.Upstream(UPSTREAM, per_minute=1))
    take_ticket(redis_url, "ghost", 300)
    with TestClient(app) as client:
        free = client.post("/v1/chat/completions", json=BODY, headers={"x-tier": "free"})
        assert free.status_code == 429  # no max_wait: refused at once, the ticket ahead
        pro = client.post("/v1/chat/completions", json=BODY, headers={"x-tier": "pro"})
        assert pro.status_code == 200
    outcomes = {(row[0], row[1]): row[-1] for row in request_outcomes(limiter).snapshot()[0]}
    assert outcomes == {("rejected", "free"): 1, ("queued_then_allowed", "pro"): 1}
    assert queued(redis_client) == 0


def test_the_precedence_tier_then_upstream_then_route() -> None:
    from genai_ratelimit.fastapi import Upstream
    from genai_ratelimit.fastapi._scopes import _Scopes

    own = Upstream("a", per_minute=10, max_wait=10, max_queue=7, max_queue_per_tenant=3)
    bare = Upstream("b", per_minute=10)
    scopes = _Scopes([own, bare], None, None, False, tokens=False, max_wait=2)
    a, b = own.scope(), bare.scope()
    assert a is not None and b is not None
    assert scopes.wait_in([a]) == (10, 7, 3)                  # the upstream's own
    assert scopes.wait_in([b]) == (2, 1000, 100)              # the route's, default bounds
    assert scopes.wait_in([a, b]) == (2, 1000, 100)           # the shortest of the two
    assert scopes.wait_in([a], tier_wait=30) == (30, 7, 3)    # the tier's wins
    assert scopes.wait_in([a, b], tier_wait=1.5) == (1.5, 7, 3)
    none = _Scopes([bare], None, None, False, tokens=False)
    assert none.wait_in([b]) is None
    assert none.wait_in([b], tier_wait=4) == (4, 1000, 100)
    shadow = _Scopes([own], None, None, False, tokens=False, shadow=True, max_wait=2)
    assert shadow.wait_in([a], tier_wait=4) is None           # shadow mode never waits


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, 86_400, True, "5"])
def test_a_bad_max_wait_is_refused_when_the_dependency_is_built(bad: Any) -> None:
    from genai_ratelimit import AsyncRateLimiter
    from genai_ratelimit._tiers_config import TierConfigError
    from genai_ratelimit.fastapi import RateLimit, TokenRateLimit, Upstream

    limiter = AsyncRateLimiter()
    upstream = Upstream("x", per_minute=1)
    for dependency in (RateLimit, TokenRateLimit):
        with pytest.raises((TypeError, ValueError), match="max_wait"):
            dependency(limiter, {"free": {"per_minute": 5}}, upstream=upstream, max_wait=bad)
        with pytest.raises(TierConfigError, match="tier 'pro': max_wait"):
            dependency(limiter, {"free": {"per_minute": 5},
                                 "pro": {"per_minute": 5, "max_wait": bad}}, upstream=upstream)


def test_a_routes_max_wait_needs_an_upstream() -> None:
    from genai_ratelimit import AsyncRateLimiter
    from genai_ratelimit.fastapi import RateLimit

    with pytest.raises(ValueError, match="give the dependency an upstream"):
        RateLimit(AsyncRateLimiter(), {"free": {"per_minute": 5}}, max_wait=3)


def test_the_tiers_file_gives_each_tiers_max_wait(tmp_path: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from genai_ratelimit import AsyncRateLimiter
    from genai_ratelimit._tiers_config import TierConfigError, tier_max_wait_from_env
    from genai_ratelimit.fastapi import RateLimit

    path = tmp_path / "tiers.toml"
    path.write_text('[free]\nper_minute = 5\n\n[pro]\nper_minute = 60\nmax_wait = 5\n\n'
                    '[enterprise]\nper_minute = 600\nmax_wait = 0.25\n\n'
                    '[upstreams."openai/gpt-4o"]\nper_minute = 500\n', encoding="utf-8")
    monkeypatch.setenv("GENAI_RATELIMIT_TIERS", str(path))
    assert tier_max_wait_from_env() == {"pro": 5.0, "enterprise": 0.25}
    dependency = RateLimit(AsyncRateLimiter())
    assert dependency.tier_max_wait == {"pro": 5.0, "enterprise": 0.25}
    assert "max_wait" not in dependency.tier_limits["pro"]  # not a window
    for bad in ("0", "-1", "nan", "86400", "true", '"5"'):
        path.write_text(f"[free]\nper_minute = 5\nmax_wait = {bad}\n", encoding="utf-8")
        with pytest.raises(TierConfigError, match=r"tier 'free': max_wait"):
            RateLimit(AsyncRateLimiter())


# -------------------------------------------------------------------------- the CLI


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    import os
    import sys

    environ = {k: v for k, v in os.environ.items()
               if k not in ("REDIS_URL", "GENAI_RATELIMIT_TIERS", "RATE_LIMIT_DISABLED")}
    return subprocess.run([sys.executable, "-m", "genai_ratelimit", *args], capture_output=True,
                          text=True, timeout=30, env=environ, cwd="/")


@pytest.mark.parametrize("storage_name", ["zset", "compact"])
def test_top_and_inspect_show_the_queue_and_each_classes_use_of_the_shares(
        redis_url: str, redis_client: redis.Redis, storage_name: str) -> None:
    import json

    from genai_ratelimit import RateLimiter

    scope = Scope(UPSTREAM, windows=[(10, 60)], shared=True, reserved={"enterprise": 30},
                  ceilings={"free": (80, 90)})
    with RateLimiter(redis_url, storage=storage_name) as limiter:
        for klass, count in (("free", 4), ("enterprise", 2)):
            for _ in range(count):
                assert limiter.reserve("someone", [(100, 60)], scopes=[scope],
                                       scope_class=klass).allowed
    before = int(time.time() * 1000)
    for tenant in ("acme", "acme", "globex"):
        take_ticket(redis_url, tenant, 30_000)
    assert queued(redis_client) == 3
    expected_classes = [("enterprise", 60, "requests", 2), ("free", 60, "requests", 4)]

    done = cli("--url", redis_url, "top", "--json")
    assert done.returncode == 0, done.stderr
    [upstream] = json.loads(done.stdout)["upstreams"]
    queue = upstream["queue"]
    assert (queue["tickets"], queue["tenants"], queue["expired"], queue["key"]) == (
        3, 2, 0, QUEUE)
    assert before + 30_000 <= queue["first_deadline_ms"] <= queue["latest_deadline_ms"]
    assert [(r["class"], r["window_seconds"], r["resource"], r["used"])
            for r in sorted(upstream["classes"], key=lambda r: r["class"])] == expected_classes
    text = cli("--url", redis_url, "top").stdout
    assert f"'{UPSTREAM}' queue: 3 waiting, 2 tenant(s) among the first" in text
    assert f"'{UPSTREAM}' shares: 60 s requests: free 4, enterprise 2" in text

    done = cli("--url", redis_url, "inspect", "someone", "--upstream", UPSTREAM, "--json")
    assert done.returncode == 0, done.stderr
    [upstream] = json.loads(done.stdout)["upstreams"]
    assert upstream["queue"]["tickets"] == 3
    assert len(upstream["classes"]) == 2
    text = cli("--url", redis_url, "inspect", "someone", "--upstream", UPSTREAM).stdout
    assert "queue: 3 waiting" in text and "shares: 60 s requests: free 4, enterprise 2" in text

    redis_client.delete(QUEUE, f"{QUEUE}:h")  # an empty queue reads as one
    assert "queue: empty" in cli("--url", redis_url, "inspect", "someone", "--upstream",
                                 UPSTREAM).stdout


def test_the_queue_reader_leaves_expired_tickets_out(redis_url: str,
                                                     redis_client: redis.Redis) -> None:
    import asyncio

    from genai_ratelimit import AsyncRateLimiter
    from genai_ratelimit._keyspace import read_queue

    take_ticket(redis_url, "alive", 30_000)
    take_ticket(redis_url, "gone", 1)  # its deadline passes at once; no script purged it yet

    async def read() -> Any:
        async with AsyncRateLimiter(redis_url) as limiter:
            seconds, micros = await limiter._command("TIME")
            now = int(seconds) * 1000 + int(micros) // 1000 + 5
            return await read_queue(limiter._command, QUEUE, now)

    view = asyncio.run(read())
    assert view is not None and (view["tickets"], view["expired"], view["tenants"]) == (1, 1, 1)


# --------------------------------------------------------------------------------- peek


def test_peek_counts_the_live_tickets_as_an_admission_does(limiter: Any, redis_url: str,
                                                          redis_client: redis.Redis) -> None:
    """A request without a ticket goes after every live ticket: peek answers what reserve
    answers (refused, waiting until the ticket ahead expires or the cap frees), and writes
    nothing (the ticket stays)."""
    scope = cap(2, 60)
    fill(limiter, scope, 1)
    assert limiter.peek("u", OWN, scopes=[scope])[:2] == (True, 0)
    take_ticket(redis_url, "ghost", 20_000)
    peeked = limiter.peek("u", OWN, scopes=[scope])
    assert peeked[0] is False and peeked[1] == 0
    assert 19 <= peeked[2] <= 20  # the ticket ahead gives up in 20 s: it frees its place then
    assert queued(redis_client) == 1  # read, not purged nor taken
    reserved = limiter.reserve("u", OWN, scopes=[scope])
    assert not reserved.allowed and abs(reserved.retry_after_s - peeked[2]) <= 1
    redis_client.delete(QUEUE, f"{QUEUE}:h")
    assert limiter.peek("u", OWN, scopes=[scope])[:2] == (True, 0)
    # a ticket whose deadline passed counts for nothing
    take_ticket(redis_url, "ghost", 1)
    wait_for(lambda: int(redis_client.pttl(QUEUE)) <= 1000)  # its 1 ms deadline is over
    assert limiter.peek("u", OWN, scopes=[scope])[:2] == (True, 0)



@pytest.mark.parametrize("dependency_name", ["RateLimit", "TokenRateLimit"])
def test_a_full_queue_is_a_429_at_once_counted_queue_full(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        dependency_name: str) -> None:
    """The third outcome of the queue in the requests metric: the Upstream's bound (here a
    queue of 1, held by a ticket whose waiter is gone) refuses at once; nothing waited."""
    from fastapi.testclient import TestClient

    from genai_ratelimit import fastapi as gr_fastapi
    from genai_ratelimit.metrics import request_outcomes

    limiter = make_limiter.native(redis_url)
    app = gateway(limiter, dependency_name, {"free": {"per_minute": 100}},
                  gr_fastapi.Upstream(UPSTREAM, per_minute=1, max_queue=1), max_wait=5)
    take_ticket(redis_url, "ghost", 30_000, bounds=(1, 1))
    started = time.monotonic()
    with TestClient(app) as client:
        refused = client.post("/v1/chat/completions", json=BODY)
    assert refused.status_code == 429 and refused.headers["x-ratelimit-scope"] == "upstream"
    assert time.monotonic() - started < 5
    outcomes = {row[0]: row[-1] for row in request_outcomes(limiter).snapshot()[0]}
    assert outcomes == {"queue_full": 1}
    assert queue_waits(limiter).waits() == 0  # a full queue is not a wait


def test_otel_records_each_wait_in_a_histogram_once_however_often_instrumented(
        limiter: Any) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from genai_ratelimit.metrics import instrument_otel

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        for _ in range(2):  # instrumenting again replaces the first
            instrument_otel({"api": native(limiter)}, meter=provider.get_meter("test"))
        scope = cap(1, 60)
        fill(limiter, scope, 1)
        assert limiter.reserve("u", OWN, scopes=[scope], max_wait=0.5).queue_outcome == \
            "queue_timeout"
        data = reader.get_metrics_data()
    finally:
        provider.shutdown()
    points = [point for resource in data.resource_metrics for scope_metrics in
              resource.scope_metrics for metric in scope_metrics.metrics
              if metric.name == "genai_ratelimit.queue.wait" for point in metric.data.data_points]
    assert [(dict(p.attributes), p.count) for p in points] == [
        ({"limiter": "api", "upstream": UPSTREAM, "outcome": "queue_timeout"}, 1)]
    assert tuple(points[0].explicit_bounds) == QUEUE_WAIT_BUCKETS
