"""An upstream's in-flight cap in FastAPI (docs/upstreams.md, "Shares of an in-flight cap"):
`Upstream(name, in_flight=N)` lets at most N requests through the upstream at once, every
user's together; the slot is given back when the response is over; a request beyond the cap
is a 429 with X-RateLimit-Scope: upstream, and the reserved-share rule that refused it in
X-RateLimit-Share (the request's class is its tier). The tiers file's [upstreams."name"]
takes in_flight too. Held requests are real concurrent requests (threads) on a real Redis,
per limiter kind."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi import Depends, FastAPI

from genai_ratelimit._tiers_config import TierConfigError
from genai_ratelimit.fastapi import RateLimit, RateLimitHeadersMiddleware, Upstream
from genai_ratelimit.metrics import request_outcomes
from helpers_async import LimiterFactory

pytestmark = [
    pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async "
                                   "tests drive on hiredis 1.x"),
]

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r".*httpx2")
    from fastapi.testclient import TestClient

CAP = "openai/gpt-4o"
LEASES = f"ratelimit:{CAP}:leases"
TIERS = {t: {"per_minute": 100, "per_day": 1000} for t in ("free", "pro", "enterprise")}


@pytest.fixture(autouse=True)
def _flushed(redis_client: redis.Redis) -> None:
    """Every test starts on a flushed database (redis_client flushes it)."""


class Gateway:
    """An app whose route holds each request until `finish` is set, and the threads that
    send the held requests."""

    def __init__(self, budget: RateLimit, client: redis.Redis) -> None:
        self.finish = threading.Event()
        self.redis = client
        self.app = FastAPI()
        self.app.add_middleware(RateLimitHeadersMiddleware)
        self.threads: list[threading.Thread] = []
        self.codes: list[int] = []
        self.limiter: Any = None

        @self.app.post("/v1/chat/completions", dependencies=[Depends(budget)])
        def chat() -> dict[str, bool]:  # a plain def: the threadpool
            self.finish.wait(20)
            return {"ok": True}

    def hold(self, client: TestClient, tier: str, count: int) -> None:
        """`count` requests of `tier` in flight (each holding its slot) when it returns."""
        held = self.redis.zcard(LEASES) + count
        for _ in range(count):
            thread = threading.Thread(target=lambda: self.codes.append(post(client, tier).status_code))
            thread.start()
            self.threads.append(thread)
        deadline = time.monotonic() + 10
        while self.redis.zcard(LEASES) < held:
            assert time.monotonic() < deadline, "the held requests never took their slots"
            time.sleep(0.005)

    def release_all(self) -> None:
        self.finish.set()
        for thread in self.threads:
            thread.join(20)


def post(client: TestClient, tier: str) -> Any:
    return client.post("/v1/chat/completions", json={},
                       headers={"x-user": f"{tier}-{time.time_ns()}", "x-tier": tier})


@pytest.fixture
def gateway_of(make_limiter: LimiterFactory, redis_url: str,
               redis_client: redis.Redis) -> Iterator[Any]:
    made: list[Gateway] = []

    def build(upstream: Upstream | None) -> Gateway:
        budget = RateLimit(make_limiter.native(redis_url), tier_limits=TIERS,
                           identify=lambda request: (request.headers["x-user"],
                                                     request.headers["x-tier"]),
                           upstream=upstream)
        made.append(Gateway(budget, redis_client))
        made[-1].limiter = budget.limiter
        return made[-1]

    yield build
    for gateway in made:
        gateway.release_all()


def test_an_upstreams_in_flight_cap_refuses_past_n_and_frees_the_slot_after_the_response(
        gateway_of: Any, redis_client: redis.Redis) -> None:
    gateway = gateway_of(Upstream(CAP, in_flight=2, in_flight_lease_seconds=30))
    with TestClient(gateway.app) as client:
        gateway.hold(client, "free", 2)
        refused = post(client, "pro")
        assert refused.status_code == 429
        assert refused.headers["x-ratelimit-scope"] == "upstream"
        assert refused.headers["x-ratelimit-limit"] == "2"
        assert "x-ratelimit-share" not in refused.headers
        assert f"upstream {CAP} allows 2 requests in flight" in refused.json()["error"]["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= 30
        gateway.release_all()
        assert gateway.codes == [200, 200]
        assert redis_client.zcard(LEASES) == 0  # given back when the responses ended
        gateway.finish.clear()
        gateway.threads.clear()
        gateway.hold(client, "pro", 1)
        assert redis_client.pttl(LEASES) <= 30_000
        gateway.release_all()


def test_the_429_names_the_share_rule_and_the_class_is_the_tier(
        gateway_of: Any, redis_client: redis.Redis) -> None:
    gateway = gateway_of(Upstream(CAP, in_flight=4, reserved={"enterprise": 50},
                                  ceilings={"free": (50, 75)}))
    with TestClient(gateway.app) as client:
        gateway.hold(client, "enterprise", 1)  # enterprise is active: 1 more kept for it
        gateway.hold(client, "free", 2)
        refused = post(client, "free")
        assert refused.status_code == 429
        assert refused.headers["x-ratelimit-share"] == "reserve; class=enterprise"
        assert refused.headers["x-ratelimit-scope"] == "upstream"
        assert "reserved for class 'enterprise'" in refused.json()["error"]["message"]
        assert redis_client.zcard(f"{LEASES}:class=free") == 2
        gateway.hold(client, "enterprise", 1)
        full = post(client, "pro")  # no share of its own: the cap is full
        assert full.status_code == 429 and "x-ratelimit-share" not in full.headers
        gateway.release_all()


def test_with_no_other_class_a_tier_may_use_the_whole_cap(gateway_of: Any) -> None:
    gateway = gateway_of(Upstream(CAP, in_flight=3, reserved={"enterprise": 34}))
    with TestClient(gateway.app) as client:
        gateway.hold(client, "free", 3)
        assert post(client, "free").status_code == 429
        gateway.release_all()


def test_in_flight_goes_with_the_upstreams_windows(gateway_of: Any,
                                                   redis_client: redis.Redis) -> None:
    gateway = gateway_of(Upstream(CAP, per_minute=2, in_flight=5))
    with TestClient(gateway.app) as client:
        gateway.hold(client, "free", 2)
        refused = post(client, "free")  # the window refuses: its slot is given back too
        assert refused.status_code == 429 and refused.headers["x-ratelimit-window"] == "minute"
        assert redis_client.zcard(LEASES) == 2
        gateway.release_all()


@pytest.mark.parametrize(("keywords", "error", "message"), [
    ({"in_flight": 0}, ValueError, "in_flight must be >= 1"),
    ({"in_flight": True}, TypeError, "in_flight must be an int"),
    ({"in_flight": 2, "in_flight_lease_seconds": 1.5}, TypeError,
     "in_flight_lease_seconds must be an int"),
    ({"reserved": {"enterprise": 101}, "in_flight": 2}, ValueError, r"in \[0, 100\]"),
    ({}, Exception, "needs at least one of"),
])
def test_bad_upstream_in_flight_is_refused_when_built(keywords: Any, error: type[Exception],
                                                      message: str) -> None:
    with pytest.raises(error, match=message):
        Upstream(CAP, **keywords)


def test_the_tiers_file_takes_in_flight(make_limiter: LimiterFactory, redis_url: str,
                                        redis_client: redis.Redis, tmp_path: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text(
        "[free]\nper_minute = 100\nper_day = 1000\n"
        "[enterprise]\nper_minute = 100\nper_day = 1000\n"
        f'[upstreams."{CAP}"]\nin_flight = 2\nin_flight_lease_seconds = 60\n'
        'reserved = { enterprise = "100" }\n')
    monkeypatch.setenv("GENAI_RATELIMIT_TIERS", str(tiers))
    budget = RateLimit(make_limiter.native(redis_url),
                       identify=lambda request: (request.headers["x-user"],
                                                 request.headers["x-tier"]))
    gateway = Gateway(budget, redis_client)
    try:
        with TestClient(gateway.app) as client:
            gateway.hold(client, "enterprise", 1)
            refused = post(client, "free")
            assert refused.status_code == 429
            assert refused.headers["x-ratelimit-share"] == "reserve; class=enterprise"
            gateway.release_all()
    finally:
        gateway.release_all()
    tiers.write_text(f'[free]\nper_minute = 1\n[upstreams."{CAP}"]\nin_flight = -1\n')
    with pytest.raises(TierConfigError, match="in_flight must be >= 1"):
        RateLimit(make_limiter.native(redis_url))


@pytest.mark.parametrize(("tier", "klass"), [("enterprise", "enterprise"), ("pro", None)])
def test_the_plan_takes_the_upstream_slot_before_the_windows(tier: str, klass: str | None) -> None:
    """The plan as a table: the slot's acquire (the tier as the class when the shares name
    it), then the windows; a refusal by a share rule is the upstream's 429 naming it."""
    from genai_ratelimit import Lease, ShareRefusal, Shares
    from genai_ratelimit.fastapi._plan import Call, Facts, Policy, Refused, UpstreamSlot, plan

    shares = Shares(reserved={"enterprise": 30})
    slot = UpstreamSlot(CAP, 10, 60, shares)
    steps = plan(Facts("alice", tier, ((5, 60),), slots=(slot,)), Policy(clock=lambda: 1_000))
    expected = {"shares": shares} | ({"share_class": klass} if klass else {})
    assert next(steps) == Call("acquire", (CAP, 10, 60), expected)
    granted = Lease(allowed=True, held=1, remaining=9, retry_after_s=0, retry_after_ms=0,
                    lease_id="x" * 36, expires_at_ms=61_000, user_id=CAP, limit=10,
                    lease_seconds=60)
    assert steps.send(granted) == Call("check_windows", ("alice", ((5, 60),)), {})
    steps = plan(Facts("alice", tier, ((5, 60),), slots=(slot,)), Policy(clock=lambda: 1_000))
    next(steps)
    refused = Lease(allowed=False, held=7, remaining=0, retry_after_s=2, retry_after_ms=1_500,
                    lease_id="", expires_at_ms=0, user_id=CAP, limit=10, lease_seconds=60,
                    retry_bound_ms=30_000,
                    share_refusal=ShareRefusal(CAP, "reserve", "enterprise", klass))
    with pytest.raises(StopIteration) as done:
        steps.send(refused)
    outcome = done.value.value
    assert outcome.slots == [] and len(outcome.verdicts) == 1
    verdict = outcome.verdicts[0]
    assert isinstance(verdict, Refused) and verdict.scope == "upstream"
    assert ("X-RateLimit-Share", "reserve; class=enterprise") in verdict.contract
    assert verdict.retry == (2, 1_500) and verdict.outcome == "concurrency_rejected"


def test_with_max_wait_a_request_past_the_cap_waits_for_a_slot_instead_of_a_429(
        gateway_of: Any, redis_client: redis.Redis) -> None:
    """Upstream(in_flight=1, max_wait=...): the second request waits in the cap's queue (its
    ticket in {cap}:leases:queue) while the first holds the slot, and runs when the first's
    response ends and its release wakes it."""
    gateway = gateway_of(Upstream(CAP, in_flight=1, max_wait=20))
    with TestClient(gateway.app) as client:
        gateway.hold(client, "free", 1)
        second: list[int] = []
        waiter = threading.Thread(target=lambda: second.append(post(client, "pro").status_code))
        waiter.start()
        deadline = time.monotonic() + 10
        while redis_client.zcard(f"{LEASES}:queue") < 1:  # it took a ticket: it waits
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.005)
        assert second == []
        gateway.finish.set()  # the first's response ends: its release wakes the waiter
        waiter.join(20)
        assert second == [200]
        gateway.release_all()
        assert gateway.codes == [200]
        assert redis_client.exists(f"{LEASES}:queue", f"{LEASES}:queue:h") == 0
    outcomes = {outcome: count for outcome, *_, count
                in request_outcomes(gateway.limiter).snapshot()[0]}
    assert outcomes == {"allowed": 1, "queued_then_allowed": 1}


def test_max_wait_does_not_wait_for_a_cap_with_reserved_shares_yet(gateway_of: Any) -> None:
    gateway = gateway_of(Upstream(CAP, in_flight=1, reserved={"enterprise": 50}, max_wait=20))
    with TestClient(gateway.app) as client:
        gateway.hold(client, "free", 1)
        started = time.monotonic()
        assert post(client, "free").status_code == 429  # at once (docs/wait-queue.md)
        assert time.monotonic() - started < 10
        gateway.release_all()
