"""Shared caps that follow the provider (docs/upstreams.md): `observe_upstream(name, status,
headers)` records what the provider said (lua/observe_upstream.lua) and every admission
through the shared scope `name` counts against it in its own script (lua/lib/upstream.lua):
two limiter instances stand for two replicas, on every limiter kind and both storages; a
Redis Cluster; and a FastAPI route whose forward_to_upstream hands the upstream's answer
over by itself. The time is the test's (ManualClock, clock="client") where a reset must
pass: no sleep."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import redis
from fastapi import Depends, FastAPI, Request, Response
from fastapi.testclient import TestClient
from redis.cluster import RedisCluster as ClusterClient

from genai_ratelimit import Scope
from genai_ratelimit.fastapi import (
    RateLimit,
    RateLimitHeadersMiddleware,
    TokenRateLimit,
    Upstream,
    forward_to_upstream,
)
from genai_ratelimit.testing import ManualClock
from helpers_async import LimiterFactory

UPSTREAM = "openai/gpt-4o"
VIEW_KEY = f"ratelimit:{UPSTREAM}:upstream"


def cap(per_minute: int = 100, tokens_per_minute: int | None = None) -> Scope:
    return Scope(UPSTREAM, windows=[(per_minute, 60)],
                 token_windows=[(tokens_per_minute, 60)] if tokens_per_minute else (),
                 shared=True)


def openai_headers(remaining: int, reset: str, limit: int = 20) -> dict[str, str]:
    return {"x-ratelimit-limit-requests": str(limit),
            "x-ratelimit-remaining-requests": str(remaining), "x-ratelimit-reset-requests": reset}


def user_keys(client: redis.Redis) -> list[bytes]:
    """Every key but the shared cap's and its view: what tenants were charged."""
    return sorted(k for k in client.keys("*") if UPSTREAM.encode() not in k)


def test_the_providers_remaining_is_shared_by_every_replica_until_its_reset(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    with ManualClock() as clock:
        a = make_limiter(redis_url, clock="client")
        b = make_limiter(redis_url, clock="client")
        assert a.reserve("t1", [(50, 60)], scopes=[cap()]).allowed
        seen = a.observe_upstream(UPSTREAM, 200, openai_headers(2, "60s"))
        assert (seen.requests_remaining, seen.requests_reset_ms, seen.closed_until_ms) == (2, 60_000, 0)
        answers = [limiter.reserve(f"t{i}", [(50, 60)], scopes=[cap()])
                   for i, limiter in enumerate((b, a, b, a))]
        assert [r.allowed for r in answers] == [True, True, False, False]
        assert [r.remaining_of("requests", cap()) for r in answers[:2]] == [1, 0]
        for refused in answers[2:]:
            assert refused.scope == cap() and refused.retry_after_s == 60
        clock.advance(59.9)
        assert not b.reserve("t9", [(50, 60)], scopes=[cap()]).allowed
        clock.advance(0.1)  # the provider's reset: the operator's cap alone again
        assert b.reserve("t9", [(50, 60)], scopes=[cap()]).allowed
    # The refusals charged no tenant: t2 and t3 have no entry.
    assert redis_client.exists("ratelimit:t2:60", "ratelimit:t3:60",
                               "ratelimit:t2:60:c", "ratelimit:t3:60:c") == 0


def test_a_429_closes_the_cap_for_every_replica_with_the_providers_retry_after(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    a, b = make_limiter(redis_url), make_limiter(redis_url)
    seen = a.observe_upstream(UPSTREAM, 429, {"retry-after": "5"})
    assert seen.close_ms == 5000 and seen.closed_until_ms > 0
    for limiter in (a, b):
        refused = limiter.reserve("tenant", [(50, 60)], scopes=[cap()])
        assert not refused.allowed and refused.scope == cap()
        assert refused.retry_after_s == 5 and 4000 < refused.retry_after_ms <= 5000
        assert refused.member == ""
    assert user_keys(redis_client) == []  # no tenant charged, nothing logged in the cap
    assert redis_client.exists(f"ratelimit:{UPSTREAM}:60:shared", f"ratelimit:{UPSTREAM}:60:shared:c") == 0
    # The view outlives the closure by the bound (60 s), then expires.
    assert 64_000 < redis_client.pttl(VIEW_KEY) <= 65_000


def test_a_closed_cap_takes_no_in_flight_slot(make_limiter: LimiterFactory, redis_url: str,
                                              redis_client: redis.Redis) -> None:
    limiter = make_limiter(redis_url)
    limiter.observe_upstream(UPSTREAM, 529, {"retry-after": "3"})
    refused = limiter.reserve("tenant", [(50, 60)], scopes=[cap()], in_flight=(2, 30))
    assert not refused.allowed and refused.lease is None and refused.retry_after_s == 3
    assert user_keys(redis_client) == []


def test_a_header_that_lies_never_opens_more_than_the_cap_nor_closes_past_the_bound(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    limiter = make_limiter(redis_url)
    # remaining far above its own limit and the operator's cap, a reset days away.
    limiter.observe_upstream(UPSTREAM, 200, {
        "x-ratelimit-limit-requests": "1000", "x-ratelimit-remaining-requests": "99999",
        "x-ratelimit-reset-requests": "72h0m0s"}, max_close_seconds=10)
    assert [limiter.reserve(f"t{i}", [(50, 60)], scopes=[cap(per_minute=3)]).allowed
            for i in range(5)] == [True, True, True, False, False]
    assert 0 < redis_client.pttl(VIEW_KEY) <= 20_000  # the reset read as 10 s, then the bound
    redis_client.flushdb()
    # A retry-after of three days closes for the bound, not for three days.
    limiter.observe_upstream(UPSTREAM, 429, {"retry-after": str(3 * 86400)}, max_close_seconds=10)
    refused = limiter.reserve("tenant", [(50, 60)], scopes=[cap()])
    assert not refused.allowed and refused.retry_after_s == 10
    assert 0 < redis_client.pttl(VIEW_KEY) <= 20_000


def test_the_providers_tokens_narrow_the_token_cap(make_limiter: LimiterFactory, redis_url: str,
                                                   redis_client: redis.Redis) -> None:
    with ManualClock() as clock:
        limiter = make_limiter(redis_url, clock="client")
        limiter.observe_upstream(UPSTREAM, 200, {"anthropic-ratelimit-tokens-remaining": "1000",
                                                 "anthropic-ratelimit-tokens-reset": _rfc3339(
                                                     clock.now_ms + 30_000)})
        scope = cap(tokens_per_minute=90_000)
        kept = limiter.reserve("t1", [(50, 60)], token_windows=[(50_000, 60)], tokens=600,
                               scopes=[scope])
        assert kept.allowed and kept.remaining_of("tokens", scope) == 400
        refused = limiter.reserve("t2", [(50, 60)], token_windows=[(50_000, 60)], tokens=600,
                                  scopes=[scope])
        assert not refused.allowed and refused.resource == "tokens" and refused.scope == scope
        assert 29 <= refused.retry_after_s <= 31
        assert limiter.reserve("t2", [(50, 60)], token_windows=[(50_000, 60)], tokens=400,
                               scopes=[scope]).allowed


def test_a_later_word_of_the_provider_replaces_the_view_and_a_closure_only_lengthens(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    limiter = make_limiter(redis_url)
    limiter.observe_upstream(UPSTREAM, 200, openai_headers(0, "30s"))
    assert not limiter.reserve("t", [(50, 60)], scopes=[cap()]).allowed
    limiter.observe_upstream(UPSTREAM, 200, openai_headers(1, "30s"))
    assert limiter.reserve("t", [(50, 60)], scopes=[cap()]).allowed
    first = limiter.observe_upstream(UPSTREAM, 429, {"retry-after": "20"}).closed_until_ms
    assert limiter.observe_upstream(UPSTREAM, 429, {"retry-after": "2"}).closed_until_ms == first


def test_after_its_reset_the_provider_has_its_limit_again_until_its_next_word(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    with ManualClock() as clock:
        limiter = make_limiter(redis_url, clock="client")
        limiter.observe_upstream(UPSTREAM, 200, openai_headers(0, "10s", limit=3),
                                 max_close_seconds=30)
        assert not limiter.reserve("t", [(50, 60)], scopes=[cap()]).allowed
        clock.advance(10)
        answers = [limiter.reserve(f"t{i}", [(50, 60)], scopes=[cap()]) for i in range(4)]
        assert [r.allowed for r in answers] == [True, True, True, False]
        assert answers[3].retry_after_s == 30  # the bound: nobody knows its next reset
        limiter.observe_upstream(UPSTREAM, 200, openai_headers(5, "10s", limit=20))
        assert limiter.reserve("t9", [(50, 60)], scopes=[cap()]).allowed


def test_the_providers_word_leaves_out_the_requests_still_on_their_way(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    limiter = make_limiter(redis_url)
    limiter.observe_upstream(UPSTREAM, 200, openai_headers(5, "30s"))
    for i in range(3):  # three admitted, none answered yet
        assert limiter.reserve(f"t{i}", [(50, 60)], scopes=[cap()]).allowed
    # The first answer: the provider counted its own request, not the two still on their way.
    limiter.observe_upstream(UPSTREAM, 200, openai_headers(4, "30s"))
    assert int(redis_client.hget(VIEW_KEY, "requests")) == 2
    assert [limiter.reserve(f"u{i}", [(50, 60)], scopes=[cap()]).allowed
            for i in range(3)] == [True, True, False]


def test_a_request_whose_answer_is_never_observed_stops_counting_after_the_bound(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    with ManualClock() as clock:
        limiter = make_limiter(redis_url, clock="client")
        limiter.observe_upstream(UPSTREAM, 200, openai_headers(5, "30s"), max_close_seconds=10)
        for i in range(3):  # admitted; their answers are lost
            assert limiter.reserve(f"t{i}", [(50, 60)], scopes=[cap()]).allowed
        clock.advance(9)
        limiter.observe_upstream(UPSTREAM, 200, openai_headers(5, "30s"), max_close_seconds=10)
        assert int(redis_client.hget(VIEW_KEY, "requests")) == 3  # two still on their way
        clock.advance(2)  # the bound since they were counted: they no longer are
        limiter.observe_upstream(UPSTREAM, 200, openai_headers(5, "30s"), max_close_seconds=10)
        assert int(redis_client.hget(VIEW_KEY, "requests")) == 5


def test_a_response_that_says_nothing_writes_nothing(make_limiter: LimiterFactory,
                                                     redis_url: str,
                                                     redis_client: redis.Redis) -> None:
    limiter = make_limiter(redis_url)
    assert limiter.observe_upstream(UPSTREAM, 200, {"content-type": "application/json"}
                                    ).closed_until_ms == 0
    assert limiter.observe_upstream(UPSTREAM, 200, openai_headers(-3, "garbage", limit=0)
                                    ).closed_until_ms == 0
    assert redis_client.keys("*") == []


@pytest.mark.limiter_kinds("sync", reason="counts the server's commands of one decision path")
def test_a_cap_nobody_observed_with_no_queue_costs_two_exists_per_admission(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    limiter = make_limiter(redis_url)
    limiter.reserve("warm", [(50, 60)], scopes=[cap()])  # the script loaded
    redis_client.config_resetstat()
    for i in range(5):
        assert limiter.reserve(f"t{i}", [(50, 60)], scopes=[cap()]).allowed
    stats = redis_client.info("commandstats")
    # The view's one read per admission and its wait queue's (docs/wait-queue.md); the rest
    # is the windows' own (HGET: the weights).
    assert stats["cmdstat_exists"]["calls"] == 5 + 5
    assert not {"cmdstat_hmget", "cmdstat_hincrby", "cmdstat_hset"} & set(stats)


@pytest.mark.parametrize("name", ["", 7, "x" * 257])
def test_a_bad_upstream_name_is_refused_before_any_io(unreachable_limiter: Any, name: Any) -> None:
    with pytest.raises((TypeError, ValueError)):
        unreachable_limiter.observe_upstream(name, 429, {"retry-after": "5"})


def test_observations_follow_the_shared_scope_on_a_cluster(make_limiter: LimiterFactory,
                                                           redis_cluster: Any) -> None:
    a, b = make_limiter(redis_cluster.url), make_limiter(redis_cluster.url)
    a.observe_upstream("openai", 429, {"retry-after": "4"})
    refused = b.reserve("tenant", [(5, 60)], scopes=[Scope("openai", [(100, 60)], shared=True)])
    assert not refused.allowed and refused.retry_after_s == 4 and refused.scope is not None
    inspector = ClusterClient(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        assert inspector.exists("ratelimit:{openai}:upstream") == 1
    finally:
        inspector.close()


# --------------------------------------------------------------------------- FastAPI


@pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async "
                                "tests drive on hiredis 1.x")
@pytest.mark.parametrize("dependency", [RateLimit, TokenRateLimit])
def test_forward_to_upstream_hands_the_providers_429_to_the_cap(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        dependency: type[RateLimit]) -> None:
    """The provider answers its first request with 429 retry-after 5: the gateway's next
    request is refused by the cap, with the provider's Retry-After, and never reaches it."""
    served: list[int] = []

    async def provider(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        served.append(1)
        status, headers = (429, [(b"retry-after", b"5")]) if len(served) == 1 else (200, [])
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), *headers]})
        await send({"type": "http.response.body", "body": json.dumps({"ok": True}).encode()})

    upstream_client = httpx.AsyncClient(base_url="http://provider.test",
                                        transport=httpx.ASGITransport(app=provider))
    budget = dependency(make_limiter.native(redis_url), identify=lambda request: ("tenant", "pro"),
                        upstream=Upstream(UPSTREAM, per_minute=100, max_close_seconds=30))
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)

    @app.post("/v1/chat/completions", dependencies=[Depends(budget)])
    async def chat(request: Request) -> Response:
        return await forward_to_upstream(request, upstream_client)

    with TestClient(app) as client:
        first = client.post("/v1/chat/completions", json={"model": "gpt-4o"})
        second = client.post("/v1/chat/completions", json={"model": "gpt-4o"})
        client.portal.call(upstream_client.aclose)
    assert first.status_code == 429 and len(served) == 1
    assert second.status_code == 429 and second.headers["x-ratelimit-scope"] == "upstream"
    assert second.headers["retry-after"] == "5"
    assert 0 < redis_client.pttl(VIEW_KEY) <= 35_000  # the closure, then the bound


def _rfc3339(unix_ms: int) -> str:
    from genai_ratelimit.fastapi._openai_headers import rfc3339
    return rfc3339(unix_ms)
