"""The FastAPI layer wired to genai_ratelimit.fastapi._usage and genai_ratelimit.proxies, through
Starlette's TestClient on the real Redis of the package's own pytest plugin: a maximum the
upstream would refuse is the route's 422 (nothing reserved), one it accepts ("50000",
50000.0) is reserved in full; the default identify counts an anonymous IPv6 client per /64
and refuses a request without an address (500, never `ip:unknown`); and
TokenRateLimit(aborted_stream=...) picks what a stream that ends without its usage costs: its
estimate (the default) or what it streamed."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse

from genai_ratelimit import RateLimiter
from genai_ratelimit._native import MAX_LIMIT
from genai_ratelimit.fastapi import RateLimit, RateLimitHeadersMiddleware, TokenRateLimit
from genai_ratelimit.testing import LimiterFactory

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async tests "
                                   "drive on hiredis 1.x"),
]

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r".*httpx2")
    from fastapi.testclient import TestClient

TOKENS = {"free": {"per_minute": 1_000_000, "per_day": 10_000_000}}


# This file uses the package's own pytest plugin (genai_ratelimit.pytest_plugin, docs/testing.md)
# as a user's suite would: its throwaway Redis, flushed before each test, and its limiters.


@pytest.fixture
def blocking_limiter(ratelimit_factory: LimiterFactory) -> RateLimiter:
    """A RateLimiter on the plugin's Redis, closed by the plugin after the test."""
    return ratelimit_factory.rate_limiter()


@pytest.fixture
def store(ratelimit_redis_url: str) -> Iterator[redis.Redis]:
    """An inspection client (redis-py) on the plugin's Redis."""
    client = redis.Redis.from_url(ratelimit_redis_url)
    try:
        yield client
    finally:
        client.close()


def token_costs(store: redis.Redis, prefix: str, identity: str, window: int = 60) -> list[int]:
    key = f"{prefix}:{identity}:{window}:tokens"
    weights = store.hgetall(key + ":w")
    return [int(weights.get(member, 1)) for member in store.zrange(key, 0, -1)]


def gateway(dependency: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)

    @app.post("/v1/chat/completions", dependencies=[Depends(dependency)])
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()

        async def events() -> Any:
            for word in body.get("words", []):
                chunk = {"object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": {"content": word}}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            # The upstream broke off: no usage chunk, no [DONE].

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/absurd", dependencies=[Depends(dependency)])
    async def absurd() -> dict[str, Any]:
        return {"answer": "intact", "usage": {"total_tokens": 2**53}}

    @app.post("/v1/plain", dependencies=[Depends(dependency)])
    async def plain() -> dict[str, str]:
        return {"answer": "no usage"}

    return app


# --- the maximum ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["50000", 50000.0, " 50_000 "])
def test_a_maximum_the_upstream_accepts_is_reserved_in_full(
        blocking_limiter: RateLimiter, store: redis.Redis, value: object) -> None:
    tokens = TokenRateLimit(blocking_limiter, namespace="max", token_limits=TOKENS)
    with TestClient(gateway(tokens)) as client:
        assert client.post("/v1/plain", json={"model": "m", "max_tokens": value}).status_code == 200
    assert token_costs(store, blocking_limiter.key_prefix, "ns:max:ip:testclient") == [50_000]  # was 1,001


@pytest.mark.parametrize("value", [True, 1.5, "5e4", "lots", 0, -1, {"n": 1}])
def test_a_maximum_the_upstream_refuses_is_a_422_and_reserves_nothing(
        blocking_limiter: RateLimiter, store: redis.Redis, value: object) -> None:
    tokens = TokenRateLimit(blocking_limiter, namespace="max", token_limits=TOKENS)
    with TestClient(gateway(tokens)) as client:
        answer = client.post("/v1/plain", json={"model": "m", "max_tokens": value})
    assert answer.status_code == 422
    (error,) = answer.json()["detail"]
    assert error["loc"] == ["body", "max_tokens"]
    assert "positive whole number" in error["msg"]
    assert list(store.scan_iter(f"{blocking_limiter.key_prefix}:*")) == []


def test_an_absurd_usage_is_clamped_and_the_response_stays_intact(
        blocking_limiter: RateLimiter, store: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    # The issue: usage.total_tokens of 2**53 gave the client a 200 with an empty body.
    tokens = TokenRateLimit(blocking_limiter, namespace="absurd", token_limits=TOKENS)
    with TestClient(gateway(tokens)) as client:
        answer = client.post("/v1/absurd", json={"max_tokens": 10})
    assert answer.status_code == 200
    assert answer.json()["answer"] == "intact"
    assert token_costs(store, blocking_limiter.key_prefix, "ns:absurd:ip:testclient") == [MAX_LIMIT]
    assert "above the most a budget can count" in caplog.text


# --- the default identify ---------------------------------------------------------------


def test_the_default_identify_counts_an_ipv6_client_per_64(blocking_limiter: RateLimiter,
                                                           store: redis.Redis) -> None:
    limit = RateLimit(blocking_limiter, namespace="v6",
                      tier_limits={"free": {"per_minute": 5, "per_day": 100}})
    statuses = []
    for n in range(1, 13):  # the issue: 12 of 12 admitted against 5/min by rotating in a /64
        with TestClient(gateway(limit), client=(f"2001:db8:1:2::{n:x}", 40000)) as client:
            statuses.append(client.post("/v1/plain", json={}).status_code)
    assert statuses == [200] * 5 + [429] * 7
    assert store.zcard(f"{blocking_limiter.key_prefix}:ns:v6:ip:2001:db8:1:2::/64:60") == 5
    with TestClient(gateway(limit), client=("203.0.113.7", 40000)) as client:  # IPv4: per address
        assert client.post("/v1/plain", json={}).status_code == 200
    assert store.zcard(f"{blocking_limiter.key_prefix}:ns:v6:ip:203.0.113.7:60") == 1


def test_the_default_identify_refuses_a_request_without_an_address(blocking_limiter: RateLimiter,
                                                                   store: redis.Redis) -> None:
    limit = RateLimit(blocking_limiter, namespace="none")
    app = gateway(limit)
    with TestClient(app, client=None) as client:  # type: ignore[arg-type]  # no peer: a unix socket
        answer = client.post("/v1/plain", json={})
    assert answer.status_code == 500
    assert answer.headers["x-should-retry"] == "false"
    assert "address is unknown" in answer.json()["detail"]
    assert list(store.scan_iter(f"{blocking_limiter.key_prefix}:*")) == []  # no ip:unknown


@pytest.mark.parametrize("dependency_class", [RateLimit, TokenRateLimit])
def test_a_shadow_budget_lets_a_request_without_an_address_through_uncounted(
        blocking_limiter: RateLimiter, store: redis.Redis, dependency_class: type[RateLimit]) -> None:
    shadow = dependency_class(blocking_limiter, namespace="shadow-none", mode="shadow")
    with TestClient(gateway(shadow), client=None) as client:  # type: ignore[arg-type]
        assert client.post("/v1/plain", json={}).status_code == 200  # an observer never refuses
    assert list(store.scan_iter(f"{blocking_limiter.key_prefix}:*")) == []


# --- an interrupted stream ----------------------------------------------------------------


def chat(words: list[str]) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 1_000, "stream": True, "words": words,
            "messages": [{"role": "user", "content": "x" * 40}]}  # 10 prompt tokens


def test_by_default_a_stream_without_usage_keeps_its_estimate(blocking_limiter: RateLimiter,
                                                              store: redis.Redis) -> None:
    tokens = TokenRateLimit(blocking_limiter, namespace="keep", token_limits=TOKENS)
    assert tokens.aborted_stream == "estimate"
    with TestClient(gateway(tokens)) as client:
        assert client.post("/v1/chat/completions", json=chat(["Hello", " world"])).status_code == 200
    assert token_costs(store, blocking_limiter.key_prefix, "ns:keep:ip:testclient") == [1_010]


def test_aborted_stream_streamed_charges_the_prompt_and_what_was_sent(
        blocking_limiter: RateLimiter, store: redis.Redis) -> None:
    tokens = TokenRateLimit(blocking_limiter, namespace="streamed", token_limits=TOKENS,
                            aborted_stream="streamed")
    with TestClient(gateway(tokens)) as client:
        answer = client.post("/v1/chat/completions", json=chat(["Hello", " world", "!"]))
        assert answer.status_code == 200
        assert client.post("/v1/plain", json={"max_tokens": 7}).status_code == 200  # not a stream
    # 10 prompt tokens + "Hello world!" (12 characters: 3 tokens, 3 chunks): 13. The JSON
    # answer without usage keeps its estimate (7) whatever the policy.
    assert sorted(token_costs(store, blocking_limiter.key_prefix, "ns:streamed:ip:testclient")) == [7, 13]


def test_aborted_stream_is_checked_when_built(blocking_limiter: RateLimiter) -> None:
    with pytest.raises(ValueError, match="aborted_stream"):
        TokenRateLimit(blocking_limiter, aborted_stream="refund")  # type: ignore[arg-type]
