"""Exports the limiters' counters (`limiter.metrics()`, kept in C: nothing is added to a
check's path) to Prometheus and to OpenTelemetry. Both read the counters when scraped.

    from prometheus_client import REGISTRY
    from genai_ratelimit.metrics import PrometheusCollector
    REGISTRY.register(PrometheusCollector({"api": limiter}))

    from genai_ratelimit.metrics import instrument_otel
    instrument_otel({"api": limiter})          # the global MeterProvider's meter

What is exported (label `limiter`: the name given to each limiter):
    genai_ratelimit_decisions_total{outcome, window}   outcome: allowed, rejected (window:
        the rejecting window, "60", "86400", "60:tokens"), unavailable, fail_open, shadow
    genai_ratelimit_replays_total                       decisions sent again after a broken
                                                        connection (counted once by the script)
    genai_ratelimit_connection_errors_total             connections that failed to open or broke
    genai_ratelimit_redis_latency_seconds               histogram of script round trips

Needs the `prometheus` extra (prometheus_client) or the `otel` extra (opentelemetry-api).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, TypedDict

__all__ = ["LimiterMetrics", "PrometheusCollector", "instrument_otel", "decision_counts"]

NAMESPACE = "genai_ratelimit"


class LimiterMetrics(TypedDict):
    """A limiter's counters (`limiter.metrics()`), each exact and monotonic since the limiter
    was made (counted in C; the blocking limiter's threads count with atomic adds)."""

    enabled: bool  # False when built with metrics=False: then every count stays 0
    allowed: int  # decisions allowed (check, check_windows, reserve)
    rejected: int  # decisions rejected, all windows
    rejected_by_window: dict[str, int]  # "60", "86400", "60:tokens" (token windows), "other"
    unavailable: int  # decisions that raised (Redis unreachable, timed out, garbage)
    fail_open: int  # requests the FastAPI layer let through with Redis unavailable
    shadow: int  # rejections the FastAPI layer let through in shadow mode
    replays: int  # decisions sent again after a broken connection
    connection_errors: int  # connections that could not open or broke mid-call
    latency_buckets: tuple[tuple[float | None, int], ...]  # (upper bound s | None, count)
    latency_sum_s: float  # the sum of the round trips counted in the buckets
    latency_count: int  # script round trips (decisions, peeks, resets, reconciles)


class _Measured(Protocol):
    def metrics(self) -> LimiterMetrics: ...


def _named(limiters: Mapping[str, _Measured] | _Measured) -> dict[str, _Measured]:
    """{name: limiter}; a lone limiter is named "default"."""
    if isinstance(limiters, Mapping):
        named = dict(limiters)
    else:
        named = {"default": limiters}
    for name, limiter in named.items():
        if not callable(getattr(limiter, "metrics", None)):
            raise TypeError(f"limiter {name!r} has no metrics(): pass a RateLimiter or an "
                            f"AsyncRateLimiter, not {type(limiter).__name__}")
    return named


def decision_counts(snapshot: LimiterMetrics) -> Iterator[tuple[str, str, int]]:
    """(outcome, window, count) of every decision counter in a metrics() snapshot; window
    is "" except for rejections."""
    yield "allowed", "", snapshot["allowed"]
    for window, count in sorted(snapshot["rejected_by_window"].items()):
        yield "rejected", window, count
    for outcome in ("unavailable", "fail_open", "shadow"):
        yield outcome, "", snapshot[outcome]


def _cumulative(snapshot: LimiterMetrics) -> list[tuple[str, int]]:
    """The latency buckets as Prometheus's cumulative (le, count) pairs, "+Inf" last."""
    out, total = [], 0
    for bound, count in snapshot["latency_buckets"]:
        total += count
        out.append(("+Inf" if bound is None else repr(bound), total))
    return out


class PrometheusCollector:
    """A prometheus_client collector of one or more limiters (a mapping name -> limiter,
    or one limiter, named "default"). Register it once: REGISTRY.register(collector)."""

    def __init__(self, limiters: Mapping[str, _Measured] | _Measured, *,
                 namespace: str = NAMESPACE) -> None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError as exc:
            raise ImportError("PrometheusCollector needs prometheus_client: "
                              "pip install 'genai-ratelimit[prometheus]'") from exc
        self._limiters = _named(limiters)
        self._namespace = namespace

    def describe(self) -> list[Any]:
        """Nothing up front: the families are made from the counters at each scrape."""
        return []

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        ns = self._namespace
        decisions = CounterMetricFamily(
            f"{ns}_decisions", "Rate-limit decisions by outcome (and the rejecting window).",
            labels=["limiter", "outcome", "window"])
        replays = CounterMetricFamily(
            f"{ns}_replays", "Decisions sent again after a broken connection.", labels=["limiter"])
        errors = CounterMetricFamily(
            f"{ns}_connection_errors", "Redis connections that failed to open or broke.",
            labels=["limiter"])
        latency = HistogramMetricFamily(
            f"{ns}_redis_latency_seconds", "Round trips of the limiter's scripts to Redis.",
            labels=["limiter"])
        for name, limiter in self._limiters.items():
            snapshot = limiter.metrics()
            for outcome, window, count in decision_counts(snapshot):
                decisions.add_metric([name, outcome, window], count)
            replays.add_metric([name], snapshot["replays"])
            errors.add_metric([name], snapshot["connection_errors"])
            latency.add_metric([name], _cumulative(snapshot), snapshot["latency_sum_s"])
        return [decisions, replays, errors, latency]


def instrument_otel(limiters: Mapping[str, _Measured] | _Measured, *,
                    meter: Any = None) -> list[Any]:
    """Registers observable counters for the limiters on an OpenTelemetry meter (default:
    the global MeterProvider's meter "genai_ratelimit"). OpenTelemetry has no observable
    histogram: the latency is exported as two counters, its buckets (attribute `le`, each
    bucket's own count) and its sum in seconds. Returns the instruments."""
    if meter is None:
        try:
            from opentelemetry import metrics as otel_metrics
        except ImportError as exc:
            raise ImportError("instrument_otel needs opentelemetry-api: "
                              "pip install 'genai-ratelimit[otel]'") from exc
        meter = otel_metrics.get_meter(NAMESPACE)
    from opentelemetry.metrics import Observation

    named = _named(limiters)

    def observe(read: Callable[[str, LimiterMetrics], Iterable[tuple[float, dict[str, str]]]]
                ) -> Callable[[Any], Iterable[Any]]:
        def callback(options: Any) -> Iterable[Any]:
            for name, limiter in named.items():
                for value, attributes in read(name, limiter.metrics()):
                    yield Observation(value, {"limiter": name, **attributes})
        return callback

    def decisions(name: str, s: LimiterMetrics) -> Iterable[tuple[float, dict[str, str]]]:
        for outcome, window, count in decision_counts(s):
            yield count, {"outcome": outcome, "window": window}

    def buckets(name: str, s: LimiterMetrics) -> Iterable[tuple[float, dict[str, str]]]:
        for bound, count in s["latency_buckets"]:
            yield count, {"le": "+Inf" if bound is None else repr(bound)}

    return [
        meter.create_observable_counter(
            f"{NAMESPACE}.decisions", callbacks=[observe(decisions)], unit="{decision}",
            description="Rate-limit decisions by outcome (and the rejecting window)."),
        meter.create_observable_counter(
            f"{NAMESPACE}.replays", callbacks=[observe(lambda n, s: [(s["replays"], {})])],
            unit="{decision}", description="Decisions sent again after a broken connection."),
        meter.create_observable_counter(
            f"{NAMESPACE}.connection_errors",
            callbacks=[observe(lambda n, s: [(s["connection_errors"], {})])],
            unit="{connection}", description="Redis connections that failed to open or broke."),
        meter.create_observable_counter(
            f"{NAMESPACE}.redis.latency.buckets", callbacks=[observe(buckets)],
            unit="{round_trip}", description="Script round trips to Redis per latency bucket."),
        meter.create_observable_counter(
            f"{NAMESPACE}.redis.latency.sum",
            callbacks=[observe(lambda n, s: [(s["latency_sum_s"], {})])], unit="s",
            description="The sum of the script round trips to Redis."),
    ]
