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
