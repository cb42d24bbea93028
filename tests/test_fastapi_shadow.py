"""Shadow mode (`mode="shadow"`) through Starlette's TestClient, on a real Redis: a budget
that decides and counts as usual but never refuses; what it would have refused runs, carries
the 429's headers (not its retry instructions) and X-RateLimit-Shadow: would-refuse, and is
counted (shadow_count) and logged. The same over real HTTP: tests/test_fastapi_server.py.

Every test that uses a limiter runs once per limiter kind (tests/conftest.py): a blocking
RateLimiter and an AsyncRateLimiter on asyncio's or uvloop's loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import redis

from genai_ratelimit import AsyncRateLimiter
from genai_ratelimit.fastapi import RateLimit, TokenRateLimit
from helpers_async import LimiterFactory, run_async
from test_fastapi import (  # noqa: F401  (fixtures, by name)
    AnyLimiter,
    TestClient,
    _built_in_tiers,
    as_user,
    build_app,
    client_for,
    limiter,
)

STRICT = {"free": {"per_minute": 2, "per_day": 100}}
TOKENS = {"free": {"per_minute": 100, "per_day": 1_000}}
RETRY_INSTRUCTIONS = ("Retry-After", "retry-after-ms", "x-should-retry")


def shadow_key(redis_client: redis.Redis, user_id: str, window: int = 60, suffix: str = "") -> str:
    """The key of the shadow budget's window (keys of its own: "shadow:" in front)."""
    (key,) = redis_client.keys(f"ratelimit:shadow:*{user_id}:{window}{suffix}")
    return key.decode()  # type: ignore[no-any-return]


# --- RateLimit ----------------------------------------------------------------------------------


def test_shadow_mode_refuses_nothing_and_counts_what_it_would_have_refused(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    dependency = RateLimit(limiter=limiter, tier_limits=STRICT, mode="shadow")
    assert dependency.mode == "shadow" and dependency.shadow_count == 0
    client = client_for(dependency)
    responses = [client.get("/dict", headers=as_user(user_id)) for _ in range(5)]
    assert [r.status_code for r in responses] == [200] * 5
    assert [r.json() for r in responses] == [{"answer": "ok"}] * 5  # the route ran each time
    assert dependency.shadow_count == 3
    # The script's rule holds: a request the budget refuses is not logged in its window.
    assert redis_client.zcard(shadow_key(redis_client, user_id)) == 2


def test_a_would_refuse_response_carries_the_429_headers_without_its_retry_instructions(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, tier_limits=STRICT, mode="shadow"))
    allowed = [client.get("/dict", headers=as_user(user_id)) for _ in range(2)]
    for response in allowed:
        assert "X-RateLimit-Shadow" not in response.headers
        assert "X-RateLimit-Limit" not in response.headers  # no enforced budget here
    assert allowed[1].headers["X-RateLimit-Shadow-Remaining"] == "0"
    shadowed = client.get("/dict", headers=as_user(user_id))
    assert shadowed.status_code == 200
    assert shadowed.headers["X-RateLimit-Shadow"] == "would-refuse"
    assert shadowed.headers["X-RateLimit-Shadow-Limit"] == "2"
    assert shadowed.headers["X-RateLimit-Shadow-Remaining"] == "0"
    assert shadowed.headers["X-RateLimit-Shadow-Window"] == "minute"
    # Never an enforced header: the trio, the error format's family, the IETF fields.
    for name in ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Window",
                 "x-ratelimit-remaining-requests", "x-ratelimit-limit-requests", "RateLimit"):
        assert name not in shadowed.headers, name
    for name in RETRY_INSTRUCTIONS:
        assert name not in shadowed.headers, name


@pytest.mark.parametrize("route", ["/json", "/plain", "/stream"])
def test_would_refuse_headers_reach_every_response_type(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str, route: str) -> None:
    client = client_for(RateLimit(limiter=limiter, tier_limits=STRICT, mode="shadow"))
    for _ in range(2):
        assert client.get(route, headers=as_user(user_id)).status_code == 200
    response = client.get(route, headers=as_user(user_id))
    assert response.status_code == 200
    assert response.headers.get_list("X-RateLimit-Shadow") == ["would-refuse"]
    assert response.headers.get_list("X-RateLimit-Shadow-Remaining") == ["0"]
    assert "X-RateLimit-Remaining" not in response.headers
    if route == "/stream":
        assert response.text == "data: a\n\ndata: b\n\ndata: [DONE]\n\n"


def test_an_enforced_budget_beside_a_shadow_one_still_refuses(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    # The rollout: today's budget enforced (free: 5 a minute), the stricter new one in shadow.
    shadow = RateLimit(limiter=limiter, tier_limits=STRICT, mode="shadow")
    client = client_for(RateLimit(limiter=limiter), extra=[shadow])
    responses = [client.get("/dict", headers=as_user(user_id)) for _ in range(6)]
    assert [r.status_code for r in responses] == [200] * 5 + [429]
    assert [r.headers.get("X-RateLimit-Shadow") for r in responses[:5]] == [None] * 2 + ["would-refuse"] * 3
    assert shadow.shadow_count == 3  # the sixth was refused by the enforced budget first
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 5
    assert redis_client.zcard(shadow_key(redis_client, user_id)) == 2


def test_two_shadow_dependencies_sharing_a_budget_count_a_request_once(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    first = RateLimit(limiter=limiter, tier_limits=STRICT, mode="shadow", namespace="new-budget")
    second = RateLimit(limiter=limiter, tier_limits=STRICT, mode="shadow", namespace="new-budget")
    client = client_for(first, extra=[second])
    for _ in range(4):
        assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    assert (first.shadow_count, second.shadow_count) == (2, 0)  # decided once, by the first


def test_shadow_count_stays_zero_when_enforcing(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    dependency = RateLimit(limiter=limiter, tier_limits=STRICT)
    client = client_for(dependency)
    assert [client.get("/dict", headers=as_user(user_id)).status_code for _ in range(3)] == [200, 200, 429]
    assert dependency.mode == "enforce" and dependency.shadow_count == 0


@pytest.mark.parametrize("dependency_class", [RateLimit, TokenRateLimit])
@pytest.mark.parametrize("mode", ["Shadow", "dry-run", "", None, 1])
def test_an_unknown_mode_is_a_value_error(limiter: AnyLimiter, dependency_class: type[RateLimit],
                                          mode: Any) -> None:
    with pytest.raises(ValueError, match="mode must be 'enforce' or 'shadow'"):
        dependency_class(limiter=limiter, mode=mode)


def test_the_would_refuse_warning_is_throttled_and_says_how_many_it_covers(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        caplog: pytest.LogCaptureFixture) -> None:
    client = client_for(RateLimit(limiter=limiter, tier_limits=STRICT, mode="shadow",
                                  shadow_log_interval=3600))
    with caplog.at_level(logging.WARNING, logger="genai_ratelimit"):
        for _ in range(6):
            assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "shadow mode" in r.getMessage()]
    assert len(lines) == 1, lines  # the first would-refuse; the next three wait for the interval
    assert "shadow mode: 1 request(s) the budget would have refused were let through" in lines[0]
    assert "requests per min (RPM): Limit 2" in lines[0]
    assert f":{user_id}'" in lines[0]  # the key identity: the budget's namespace and the user


def test_each_would_refuse_is_logged_with_interval_zero_and_user_ids_can_be_left_out(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        caplog: pytest.LogCaptureFixture) -> None:
    client = client_for(RateLimit(limiter=limiter, tier_limits=STRICT, mode="shadow",
                                  shadow_log_interval=0, log_user_ids=False))
    with caplog.at_level(logging.WARNING, logger="genai_ratelimit"):
        for _ in range(5):
            assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "shadow mode" in r.getMessage()]
    assert len(lines) == 3
    assert all(user_id not in line for line in lines)


class RecordingLimiter:
    """A limiter with the `_record_outcome(kind)` hook some limiters have: every other
    attribute is the real limiter's."""

    def __init__(self, inner: AnyLimiter) -> None:
        self.inner = inner
        self.is_async = isinstance(inner, AsyncRateLimiter)
        self.outcomes: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _record_outcome(self, kind: str) -> None:
        self.outcomes.append(kind)


def test_a_limiter_with_an_outcome_hook_hears_of_each_would_refuse(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    recording = RecordingLimiter(limiter)
    client = client_for(RateLimit(limiter=recording, tier_limits=STRICT, mode="shadow"))
    for _ in range(4):
        assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    assert recording.outcomes == ["shadow", "shadow"]


def test_shadow_count_is_exact_under_concurrent_requests(
        limiter: AnyLimiter, make_limiter: LimiterFactory, user_id: str,
        redis_client: redis.Redis) -> None:
    # 60 requests of one user at once (threadpool or loop) against a budget of 10 a minute.
    import httpx

    dependency = RateLimit(limiter=limiter, tier_limits={"free": {"per_minute": 10, "per_day": 100}},
                           mode="shadow")
    app = build_app(dependency)

    async def burst() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            responses = await asyncio.gather(*(client.get("/dict", headers=as_user(user_id))
                                               for _ in range(60)))
        if isinstance(limiter, AsyncRateLimiter):
            await limiter.aclose()  # its connections belong to this loop
        return [r.status_code for r in responses]

    assert run_async(burst(), make_limiter.loop_factory) == [200] * 60
    assert dependency.shadow_count == 50
    assert redis_client.zcard(shadow_key(redis_client, user_id)) == 10


# --- TokenRateLimit -----------------------------------------------------------------------------


def token_limit(limiter: AnyLimiter, tokens: int, **options: Any) -> TokenRateLimit:
    return TokenRateLimit(limiter=limiter, token_limits=TOKENS, estimate=lambda request: tokens,
                          mode="shadow", **options)


def test_a_token_budget_in_shadow_lets_through_what_its_tokens_would_refuse(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    dependency = token_limit(limiter, 40)
    client = client_for(dependency)
    responses = [client.get("/dict", headers=as_user(user_id)) for _ in range(4)]
    assert [r.status_code for r in responses] == [200] * 4
    assert [r.headers.get("X-RateLimit-Shadow") for r in responses] == [None, None, "would-refuse",
                                                                       "would-refuse"]
    refused = responses[2].headers
    assert (refused["X-RateLimit-Shadow-Resource"], refused["X-RateLimit-Shadow-Limit"],
            refused["X-RateLimit-Shadow-Remaining"]) == ("tokens", "100", "0")
    assert "x-ratelimit-remaining-tokens" not in refused and "X-RateLimit-Limit" not in refused
    for name in RETRY_INSTRUCTIONS:
        assert name not in refused, name
    assert dependency.shadow_count == 2
    # All or nothing, as when enforcing: the refused reservations spent neither requests nor tokens.
    assert redis_client.zcard(shadow_key(redis_client, user_id)) == 2
    assert redis_client.zcard(shadow_key(redis_client, user_id, suffix=":tokens")) == 2


def test_a_request_too_large_for_the_token_budget_runs_in_shadow_and_reserves_nothing(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    dependency = token_limit(limiter, 500)
    client = client_for(dependency)
    with caplog.at_level(logging.WARNING, logger="genai_ratelimit"):
        response = client.get("/json", headers=as_user(user_id))
    assert response.status_code == 200 and response.json() == {"answer": "ok"}
    assert response.headers["X-RateLimit-Shadow"] == "would-refuse"
    assert response.headers["X-RateLimit-Shadow-Resource"] == "tokens"
    assert response.headers["X-RateLimit-Shadow-Limit"] == "100"
    assert "x-should-retry" not in response.headers
    assert dependency.shadow_count == 1
    assert redis_client.keys("*") == []
    assert "Request too large: 500 tokens requested" in caplog.text


def test_a_token_budget_in_shadow_counts_once_per_request_with_the_outcome_hook(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    recording = RecordingLimiter(limiter)
    dependency = token_limit(recording, 60)  # type: ignore[arg-type]
    client = client_for(dependency)
    statuses: Sequence[int] = [client.get("/dict", headers=as_user(user_id)).status_code for _ in range(3)]
    assert statuses == [200] * 3
    assert dependency.shadow_count == 2 and recording.outcomes == ["shadow", "shadow"]
