"""The FastAPI layer's request outcomes (issue 24 item 1): every request a dependency decides
lands in exactly one outcome of genai_ratelimit_requests_total, whose sum is the number of
requests, with the HTTP status of docs/operations-dashboard.md's table; a per-tier in-flight
gauge; no empty label, no user id; the exposition passes `promtool check metrics`.

Real Redis (the session's); "Redis down" is a limiter on a closed port. Every limiter kind
(tests/conftest.py): a blocking RateLimiter (RateLimit then runs in the threadpool), and an
AsyncRateLimiter on each kind's loop."""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from typing import Any

import pytest
import redis
from fastapi import Depends, FastAPI, Request
from fastapi.testclient import TestClient

from genai_ratelimit import AsyncRateLimiter
from genai_ratelimit.fastapi import RateLimit, RateLimitHeadersMiddleware, TokenRateLimit, Upstream
from genai_ratelimit.metrics import OUTCOMES, PrometheusCollector, request_outcomes
from helpers_async import LimiterFactory, run_async
from helpers_core import closed_port_url
from test_fastapi import client_options

# Left out of make test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async tests "
                                   "drive on hiredis 1.x"),
]

# The HTTP status each outcome answers (the route's own status: 200 here).
STATUS = {"allowed": 200, "rejected": 429, "too_large": 429, "concurrency_rejected": 429,
          "shadow_would_refuse": 200, "unavailable_denied": 503, "fail_open": 200,
          "queued_then_allowed": 200, "queue_timeout": 429, "queue_full": 429,
          "queue_abandoned": 499}


def by_header(request: Request) -> tuple[str, str]:
    return request.headers.get("x-user", "anon"), request.headers.get("x-tier", "free")


def estimate(request: Request) -> int:
    return int(request.headers.get("x-tokens", "10"))


class Gateway:
    """An app with one route per way a request can end, on `up` (the session's Redis) and
    `down` (a closed port)."""

    def __init__(self, up: Any, down: Any, make_limiter: LimiterFactory, url: str) -> None:
        self.up, self.down, self.url = up, down, url
        self.loop_factory = make_limiter.loop_factory
        self.client_options = client_options(make_limiter)  # TestClient on the kind's loop
        tiers = {"free": {"per_minute": 3}, "pro": {"per_minute": 100}}
        self.chat = RateLimit(up, tier_limits=tiers, identify=by_header,
                              max_in_flight={"free": 1, "pro": 5})
        self.shadow = RateLimit(up, tier_limits={"free": {"per_minute": 1}}, identify=by_header,
                                mode="shadow")
        self.tokens = TokenRateLimit(up, tier_limits={"free": {"per_minute": 100}},
                                     token_limits={"free": {"per_minute": 100}},
                                     identify=by_header, estimate=estimate, namespace="tok")
        self.open = RateLimit(down, on_unavailable="allow", identify=by_header, namespace="o")
        self.closed = RateLimit(down, on_unavailable="deny", identify=by_header, namespace="c")
        # Upstreams whose requests wait in a queue (docs/wait-queue.md)
        self.queued = RateLimit(up, identify=by_header, namespace="q",
                                upstream=Upstream("gw/queued", per_minute=1, max_wait=5))
        self.full = RateLimit(up, identify=by_header, namespace="f",
                              upstream=Upstream("gw/full", per_minute=1, max_wait=5, max_queue=1))
        app = FastAPI()
        app.add_middleware(RateLimitHeadersMiddleware)
        self.seen_in_flight: list[int] = []

        @app.get("/chat", dependencies=[Depends(self.chat)])
        def chat(request: Request) -> dict[str, int]:
            # The route runs while its request is in flight: the gauge counts it.
            seen = request_outcomes(up).in_flight(request.headers.get("x-tier", "free"))
            self.seen_in_flight.append(seen)
            return {"in_flight": seen}

        @app.get("/shadow", dependencies=[Depends(self.shadow)])
        def shadow() -> dict[str, str]:
            return {}

        @app.post("/tokens", dependencies=[Depends(self.tokens)])
        def tokens() -> dict[str, str]:
            return {}

        @app.get("/open", dependencies=[Depends(self.open)])
        def fail_open() -> dict[str, str]:
            return {}

        @app.get("/closed", dependencies=[Depends(self.closed)])
        def closed() -> dict[str, str]:
            return {}

        @app.get("/queued", dependencies=[Depends(self.queued)])
        def queued() -> dict[str, str]:
            return {}

        @app.get("/full", dependencies=[Depends(self.full)])
        def full() -> dict[str, str]:
            return {}

        self.app = app

    def totals(self) -> Counter[str]:
        """Outcome -> requests, both limiters together."""
        found: Counter[str] = Counter()
        for limiter in (self.up, self.down):
            for outcome, *_, count in request_outcomes(limiter).snapshot()[0]:
                found[outcome] += count
        return found


@pytest.fixture
def gateway(make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> Gateway:
    """The gateway on limiters of the kind under test (closed with the test's make_limiter)."""
    return Gateway(make_limiter.native(redis_url),
                   make_limiter.native(closed_port_url(), connect_timeout=0.5, socket_timeout=0.5),
                   make_limiter, redis_url)


def take_slots(gateway: Gateway, user: str, count: int) -> None:
    """Holds `count` of user's in-flight slots, as requests in flight elsewhere would."""
    for _ in range(count):
        if isinstance(gateway.up, AsyncRateLimiter):
            lease = run_async(gateway.up.acquire(user, count, 60), gateway.loop_factory)
        else:
            lease = gateway.up.acquire(user, count, 60)
        assert lease.allowed


def ghost_ticket(gateway: Gateway, upstream: str, wait_ms: int) -> None:
    """A ticket in the upstream's wait queue whose waiter is gone (it expires after wait_ms)."""
    import uuid

    from genai_ratelimit import RateLimiter
    from genai_ratelimit.wait_queue import tenant_key

    with RateLimiter(gateway.url) as raw:
        assert raw._wait_queue(upstream, str(uuid.uuid4()), tenant_key("ghost"),
                               (wait_ms, 1000, 100)) == 0


def burst(client: TestClient, gateway: Gateway, user: str) -> list[tuple[str, int]]:
    answers: list[tuple[str, int]] = []

    def send(what: str, method: str, path: str, **headers: str) -> None:
        response = client.request(method, path, headers={"x-user": user, **headers})
        answers.append((what, response.status_code))

    for _ in range(5):  # 3 allowed, then 2 refused by the minute
        send("chat", "GET", "/chat")
    for _ in range(3):  # 1 allowed, 2 the budget would refuse (they run)
        send("shadow", "GET", "/shadow")
    send("tokens", "POST", "/tokens", **{"x-tokens": "60"})     # allowed
    send("tokens", "POST", "/tokens", **{"x-tokens": "60"})     # refused on tokens
    send("tokens", "POST", "/tokens", **{"x-tokens": "1000"})   # too large
    send("open", "GET", "/open")
    send("open", "GET", "/open")
    send("closed", "GET", "/closed")
    # A ticket ahead whose waiter is gone (deadline 200 ms): the request waits for it, then
    # runs; the next cannot be admitted before its max_wait (the cap's minute): 429 at once.
    ghost_ticket(gateway, "gw/queued", 200)
    send("queued", "GET", "/queued")
    send("queued", "GET", "/queued")
    # A queue of 1 that holds a ticket already: 429 at once.
    ghost_ticket(gateway, "gw/full", 10_000)
    send("full", "GET", "/full")
    # A pro user whose 5 slots are held elsewhere: the concurrency 429.
    take_slots(gateway, f"{user}-busy", 5)
    answers.append(("busy", client.get("/chat", headers={"x-user": f"{user}-busy",
                                                         "x-tier": "pro"}).status_code))
    return answers


EXPECTED = Counter({"allowed": 3 + 1 + 1, "rejected": 2 + 1, "too_large": 1,
                    "shadow_would_refuse": 2, "fail_open": 2, "unavailable_denied": 1,
                    "concurrency_rejected": 1, "queued_then_allowed": 1, "queue_timeout": 1,
                    "queue_full": 1})


def test_every_request_lands_in_exactly_one_outcome(gateway: Gateway, user_id: str) -> None:
    with TestClient(gateway.app, **gateway.client_options) as client:
        answers = burst(client, gateway, user_id)
    totals = gateway.totals()
    assert sum(totals.values()) == len(answers) == 18
    assert totals == EXPECTED
    # Every outcome but queue_abandoned, which needs a client that leaves while it waits (a
    # real socket closed: tests/test_fastapi_queue_disconnect.py).
    assert set(totals) == set(OUTCOMES) - {"queue_abandoned"}, "the burst makes every outcome"
    # Each outcome's HTTP status, as the table says: the statuses the client saw.
    expected_statuses = Counter(STATUS[o] for o in EXPECTED.elements())
    assert Counter(status for _, status in answers) == expected_statuses
    # Nothing is left in flight, and each allowed /chat saw itself in flight.
    assert request_outcomes(gateway.up).in_flight() == 0
    assert gateway.seen_in_flight == [1, 1, 1]


def test_the_labels_say_tier_scope_mode_window_and_resource(gateway: Gateway,
                                                           user_id: str) -> None:
    with TestClient(gateway.app, **gateway.client_options) as client:
        burst(client, gateway, user_id)
    up = {tuple(labels): count for *labels, count in request_outcomes(gateway.up).snapshot()[0]}
    down = {tuple(labels): count for *labels, count in request_outcomes(gateway.down).snapshot()[0]}
    # (outcome, tier, scope, mode, window_seconds, resource)
    assert up == {
        ("allowed", "free", "none", "enforce", "none", "none"): 3 + 1,
        ("allowed", "free", "none", "shadow", "none", "none"): 1,
        ("rejected", "free", "user", "enforce", "60", "requests"): 2,
        ("rejected", "free", "user", "enforce", "60", "tokens"): 1,
        ("too_large", "free", "user", "enforce", "60", "tokens"): 1,
        ("shadow_would_refuse", "free", "user", "shadow", "60", "requests"): 2,
        ("concurrency_rejected", "pro", "user", "enforce", "none", "in_flight"): 1,
        ("queued_then_allowed", "free", "none", "enforce", "none", "none"): 1,
        ("queue_timeout", "free", "upstream", "enforce", "60", "requests"): 1,
        ("queue_full", "free", "upstream", "enforce", "60", "requests"): 1,
    }
    assert down == {
        ("fail_open", "free", "none", "enforce", "none", "none"): 2,
        ("unavailable_denied", "free", "none", "enforce", "none", "none"): 1,
    }


def test_the_limiter_level_decisions_relate_to_the_outcomes(gateway: Gateway,
                                                            user_id: str) -> None:
    """The limiter counts Redis decisions, the layer HTTP requests: a shadow would-refuse is a
    rejected decision (of the shadow keys) and a request that ran; a concurrency 429 is a
    refused lease, no decision; an outage is an unavailable decision per request; a request
    that waited in a queue is a refused decision and then its tries with its ticket."""
    with TestClient(gateway.app, **gateway.client_options) as client:
        burst(client, gateway, user_id)
    up, down = gateway.up.metrics(), gateway.down.metrics()
    tally = request_outcomes(gateway.up)
    assert up["allowed"] == tally.total(outcome="allowed") + tally.total(
        outcome="queued_then_allowed")
    # A request that waited in a queue was refused once before it took its ticket (and
    # again if it woke before its turn: its retries are decisions too).
    queued = sum(tally.total(outcome=o) for o in ("queued_then_allowed", "queue_timeout",
                                                  "queue_full"))
    retries = up["rejected"] - (tally.total(outcome="rejected")
                                + tally.total(outcome="shadow_would_refuse") + queued)
    assert 0 <= retries <= 2
    assert up["leases_refused"] == tally.total(outcome="concurrency_rejected")
    assert down["unavailable"] == request_outcomes(gateway.down).total() == 3
    assert down["fail_open"] == request_outcomes(gateway.down).total(outcome="fail_open")
    assert up["shadow"] == tally.total(outcome="shadow_would_refuse")


def exposition(gateway: Gateway) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(PrometheusCollector({"api": gateway.up, "down": gateway.down}))
    return generate_latest(registry).decode()


def requests_series(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("genai_ratelimit_requests_total{")}


def test_the_exposition_sums_to_the_requests_and_passes_promtool(gateway: Gateway,
                                                                 user_id: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: Debian's `prometheus` package has it (make test "
                    "installs it: scripts/ensure-debian-packages.sh prometheus)")
    with TestClient(gateway.app, **gateway.client_options) as client:
        answers = burst(client, gateway, user_id)
    text = exposition(gateway)
    found = requests_series(text)
    assert sum(found.values()) == len(answers)
    for name in found:
        for pair in name[name.index("{") + 1:-1].split(","):
            label, value = pair.split("=", 1)
            assert value.strip('"'), f"an empty label value in {name}"
            assert user_id not in value
    assert "# TYPE genai_ratelimit_in_flight_requests gauge" in text
    assert 'genai_ratelimit_in_flight_requests{limiter="api",tier="free"} 0.0' in text
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), done


def test_many_users_make_no_more_series(gateway: Gateway, user_id: str) -> None:
    with TestClient(gateway.app, **gateway.client_options) as client:
        for n in range(3):
            client.get("/chat", headers={"x-user": f"{user_id}-{n}"})
        before = set(requests_series(exposition(gateway)))
        for n in range(3, 300):  # bounded: 297 more users, one request each
            client.get("/chat", headers={"x-user": f"{user_id}-{n}"})
    after = requests_series(exposition(gateway))
    assert set(after) == before
    assert sum(after.values()) == 300


def test_a_label_set_beyond_the_bound_counts_as_other() -> None:
    from genai_ratelimit.metrics import MAX_REQUEST_SERIES, RequestOutcomes

    tally = RequestOutcomes()
    for n in range(MAX_REQUEST_SERIES + 5):
        tally.add("rejected", tier=f"t{n}", scope="user", mode="enforce", window_seconds="60",
                  resource="requests")
    requests, _ = tally.snapshot()
    assert len(requests) == MAX_REQUEST_SERIES + 1
    assert ("rejected", "other", "other", "enforce", "other", "other", 5) in requests
    assert tally.total() == MAX_REQUEST_SERIES + 5
    with pytest.raises(ValueError, match="outcome must be one of"):
        tally.add("shadow", tier="free", scope="user", mode="enforce", window_seconds="60",
                  resource="requests")
    with pytest.raises(ValueError, match="non-empty"):
        tally.add("allowed", tier="", scope="none", mode="enforce", window_seconds="none",
                  resource="none")


def test_a_shadow_refusal_for_concurrency_counts_once(gateway: Gateway, user_id: str) -> None:
    """A shadow dependency whose slot is refused goes on to decide the windows (allowed): the
    request is one shadow_would_refuse (for in_flight), not also an allowed."""
    shadow = RateLimit(gateway.up, tier_limits={"free": {"per_minute": 10}}, identify=by_header,
                       mode="shadow", max_in_flight={"free": 1}, namespace="capped")
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)

    @app.get("/", dependencies=[Depends(shadow)])
    def root() -> dict[str, str]:
        return {}

    take_slots(gateway, f"shadow:ns:capped:{user_id}", 1)
    with TestClient(app, **gateway.client_options) as client:
        response = client.get("/", headers={"x-user": user_id})
    assert response.status_code == 200
    assert response.headers["x-ratelimit-shadow"] == "would-refuse"
    assert request_outcomes(gateway.up).snapshot()[0] == (
        ("shadow_would_refuse", "free", "user", "shadow", "none", "in_flight", 1),)
    assert gateway.up.metrics()["allowed"] == 1, "the windows were decided all the same"
    assert request_outcomes(gateway.up).in_flight() == 0


def test_opentelemetry_sees_the_same_outcomes_and_the_in_flight_gauge(gateway: Gateway,
                                                                      user_id: str) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from genai_ratelimit.metrics import instrument_otel

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        instrument_otel({"api": gateway.up, "down": gateway.down},
                        meter=provider.get_meter("test"))
        with TestClient(gateway.app, **gateway.client_options) as client:
            answers = burst(client, gateway, user_id)
        points: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for resource in reader.get_metrics_data().resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        if hasattr(point, "value"):  # not the latency histogram's
                            points[(metric.name, tuple(sorted(point.attributes.items())))] = \
                                point.value
    finally:
        provider.shutdown()
    requests = {attributes: value for (name, attributes), value in points.items()
                if name == "genai_ratelimit.requests"}
    assert sum(requests.values()) == len(answers)
    assert requests[(("limiter", "api"), ("mode", "enforce"), ("outcome", "concurrency_rejected"),
                     ("resource", "in_flight"), ("scope", "user"), ("tier", "pro"),
                     ("window_seconds", "none"))] == 1
    assert points[("genai_ratelimit.requests.in_flight", (("limiter", "api"), ("tier", "free")))] == 0


def test_tokens_reserved_charged_and_refunded_by_tier(gateway: Gateway, user_id: str) -> None:
    """A TokenRateLimit's tokens by tier: the estimate reserved, the usage charged, the rest
    refunded, the same totals as the limiter's own token counters."""
    from genai_ratelimit.fastapi import record_usage

    tokens = TokenRateLimit(gateway.up, tier_limits={"free": {"per_minute": 100},
                                                     "pro": {"per_minute": 100}},
                            token_limits={"free": {"per_minute": 1000},
                                          "pro": {"per_minute": 1000}},
                            identify=by_header, estimate=estimate)
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)

    @app.post("/", dependencies=[Depends(tokens)])
    async def root(request: Request) -> dict[str, str]:
        await record_usage(request, int(request.headers["x-used"]))
        return {}

    with TestClient(app, **gateway.client_options) as client:
        for tier, estimated, used in (("free", 60, 20), ("free", 50, 50), ("pro", 100, 130)):
            response = client.post("/", headers={"x-user": user_id, "x-tier": tier,
                                                 "x-tokens": str(estimated), "x-used": str(used)})
            assert response.status_code == 200
    by_tier = request_outcomes(gateway.up).tokens()
    assert by_tier == (("free", "enforce", "charged", 70), ("free", "enforce", "refunded", 40),
                       ("free", "enforce", "reserved", 110), ("pro", "enforce", "charged", 130),
                       ("pro", "enforce", "reserved", 100))
    m = gateway.up.metrics()
    assert (m["reserved_tokens"], m["charged_tokens"], m["refunded_tokens"]) == (210, 200, 40)
    text = exposition(gateway)
    assert ('genai_ratelimit_request_tokens_total{limiter="api",mode="enforce",state="refunded",'
            'tier="free"} 40.0') in text
