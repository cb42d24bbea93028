"""genai_ratelimit.fastapi through Starlette's TestClient, on a real Redis: identity, tiers,
the 429 and allowed headers on every response type, the kill switch, Redis unavailable, the
fail-open counter, and where the limiter runs (threadpool or event loop).

Every test that uses a limiter runs once per limiter kind (tests/conftest.py): with a blocking
RateLimiter (the dependency is a plain def, run in FastAPI's threadpool), and with an
AsyncRateLimiter (an async def, awaited on the event loop, the default) on a TestClient whose
loop is asyncio's or uvloop's. Here `limiter` and make_limiter.native() give the limiter
itself, not the blocking adapter: the dependency must see the real AsyncRateLimiter."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import fastapi.dependencies.utils as fastapi_dependency_utils
import pytest
import redis
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

import genai_ratelimit.fastapi._answer as ratelimit_responses
from genai_ratelimit import TIER_LIMITS, AsyncRateLimiter, RateLimiter
from genai_ratelimit.fastapi import (
    RateLimit,
    RateLimitHeadersMiddleware,
    default_identify,
    rate_limit,
    window_name,
)
from helpers_async import ASYNC_KINDS, LimiterFactory, run_async
from redis_server import RedisServer, free_port

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async tests "
                                   "drive on hiredis 1.x"),
]

with warnings.catch_warnings():
    # Starlette >= 1.x asks for the `httpx2` package behind its TestClient and warns when it
    # falls back to `httpx` (what the test extra installs); the fallback works the same here.
    warnings.filterwarnings("ignore", message=r".*httpx2")
    from fastapi.testclient import TestClient

DAY_MS = 86_400_000
ALL_FOUR = ("Retry-After", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Window")


class FakeAuth:
    """Stands in for an app's auth middleware: `X-Test-Auth: <user_id>[/<tier>]` becomes
    request.state.user_id (and .tier). The dependency itself never reads client headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"x-test-auth":
                    user_id, _, tier = value.decode().partition("/")
                    state = scope.setdefault("state", {})
                    state["user_id"] = user_id
                    if tier:
                        state["tier"] = tier
        await self.app(scope, receive, send)


def build_app(dependency: Any, *, headers_middleware: bool = True, extra: Sequence[Any] = ()) -> FastAPI:
    """An app whose limited routes return each kind of response a route can return."""
    app = FastAPI()
    if headers_middleware:
        app.add_middleware(RateLimitHeadersMiddleware)
    app.add_middleware(FakeAuth)
    limited = [Depends(dependency), *(Depends(d) for d in extra)]

    @app.get("/dict", dependencies=limited)
    async def as_dict() -> dict[str, str]:
        return {"answer": "ok"}

    @app.get("/json", dependencies=limited)
    async def as_json_response() -> JSONResponse:
        return JSONResponse({"answer": "ok"})

    @app.get("/plain", dependencies=limited)
    def as_plain_response() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/stream", dependencies=limited)
    async def as_stream() -> StreamingResponse:
        async def tokens() -> Any:
            for token in ("data: a\n\n", "data: b\n\n", "data: [DONE]\n\n"):
                yield token
        return StreamingResponse(tokens(), media_type="text/event-stream")

    @app.get("/unlimited")
    async def unlimited() -> dict[str, str]:
        return {"answer": "ok"}

    return app


@pytest.fixture(autouse=True)
def _built_in_tiers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiers file named in the developer's shell must not change the budgets tested here."""
    monkeypatch.delenv("GENAI_RATELIMIT_TIERS", raising=False)


AnyLimiter = RateLimiter | AsyncRateLimiter

ASYNC_ONLY = pytest.mark.limiter_kinds(
    *ASYNC_KINDS, reason="the dependency's async path: an AsyncRateLimiter (or stand-in) awaited "
                         "on the TestClient's loop, asyncio's or uvloop's")


@pytest.fixture
def limiter(make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> AnyLimiter:
    """A limiter of the kind under test on the session's Redis, on a clean database: the
    RateLimiter or AsyncRateLimiter itself, as a service hands it to RateLimit."""
    return make_limiter.native(redis_url)  # type: ignore[no-any-return]


def client_options(make_limiter: LimiterFactory) -> dict[str, Any]:
    """TestClient arguments that run the app on a loop of the kind under test (the blocking
    limiter's app runs on asyncio's default loop)."""
    if make_limiter.loop_factory is None:
        return {}
    return {"backend_options": {"loop_factory": make_limiter.loop_factory}}


@pytest.fixture
def sync_limiter(redis_url: str, redis_client: redis.Redis) -> Iterator[RateLimiter]:
    """A blocking RateLimiter, for the tests about the threadpool path itself."""
    with RateLimiter(redis_url) as rl:
        yield rl


async def running_loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


@pytest.fixture
def client_for(make_limiter: LimiterFactory) -> Iterator[Callable[..., TestClient]]:
    """client_for(dependency, **build_app_options): a started TestClient of build_app's app,
    on a loop of the kind under test."""
    clients: list[TestClient] = []

    def make(dependency: Any, **kwargs: Any) -> TestClient:
        client = TestClient(build_app(dependency, **kwargs), **client_options(make_limiter))
        client.__enter__()
        clients.append(client)
        served_by = client.portal.call(running_loop_module)  # type: ignore[union-attr]
        assert served_by == ("uvloop" if make_limiter.kind == "uvloop" else "asyncio"), served_by
        return client

    yield make
    if clients:
        # The AsyncRateLimiters' connections belong to the loop of the client that used them:
        # they are closed there while it still runs (the other clients' loops run too);
        # make_limiter closes whatever was used on loops already gone.
        for limiter in make_limiter.async_limiters:
            if not limiter.closed:
                clients[0].portal.call(limiter.aclose)  # type: ignore[union-attr]
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(limiter: AnyLimiter, client_for: Callable[..., TestClient]) -> TestClient:
    dependency = RateLimit(limiter=limiter)
    assert inspect.iscoroutinefunction(dependency.__call__) == isinstance(limiter, AsyncRateLimiter)
    return client_for(dependency)


def as_user(user_id: str, tier: str | None = None) -> dict[str, str]:
    return {"X-Test-Auth": f"{user_id}/{tier}" if tier else user_id}


def server_now_ms(redis_client: redis.Redis) -> int:
    seconds, micros = redis_client.time()
    return seconds * 1000 + micros // 1000


def prefill(redis_client: redis.Redis, key: str, scores: list[int]) -> None:
    redis_client.zadd(key, {f"prefill-{i}": score for i, score in enumerate(scores)})


@pytest.fixture
def closed_port_url() -> str:
    """A loopback port where nothing listens: connecting is refused at once."""
    return f"redis://127.0.0.1:{free_port()}/0"


# --- 429 and the allowed headers ------------------------------------------------------------


def test_sixth_free_request_in_a_minute_is_429_with_all_four_headers(
        client: TestClient, user_id: str) -> None:
    started = time.monotonic()
    for _ in range(5):
        assert client.get("/dict", headers=as_user(user_id, "free")).status_code == 200
    response = client.get("/dict", headers=as_user(user_id, "free"))
    elapsed = time.monotonic() - started
    assert response.status_code == 429
    assert response.json()["detail"] == "Rate limit exceeded"  # the contract's, beside OpenAI's error
    assert all(name in response.headers for name in ALL_FOUR)
    # The first request, counted at most `elapsed` before the refusal, leaves the minute 60 s
    # after it was counted: 60 (whole seconds, rounded up) unless the burst took over 1 s.
    assert math.ceil(60 - elapsed) <= int(response.headers["Retry-After"]) <= 60
    assert response.headers["X-RateLimit-Limit"] == "5"
    assert response.headers["X-RateLimit-Remaining"] == "0"
    assert response.headers["X-RateLimit-Window"] == "minute"


def test_retry_after_is_the_time_until_the_oldest_request_leaves_the_window(
        client: TestClient, user_id: str, redis_client: redis.Redis) -> None:
    # The minute is full of requests made 45 s ago: a retry is honest after 15 s.
    prefill(redis_client, f"ratelimit:{user_id}:60", [server_now_ms(redis_client) - 45_000] * 5)
    response = client.get("/dict", headers=as_user(user_id))
    assert response.status_code == 429
    assert 13 <= int(response.headers["Retry-After"]) <= 15


def test_remaining_counts_down_on_allowed_responses(client: TestClient, user_id: str) -> None:
    seen = []
    for _ in range(5):
        response = client.get("/dict", headers=as_user(user_id, "free"))
        assert response.status_code == 200
        assert response.headers["X-RateLimit-Limit"] == "5"
        assert response.headers["X-RateLimit-Window"] == "minute"
        assert "Retry-After" not in response.headers
        seen.append(int(response.headers["X-RateLimit-Remaining"]))
    assert seen == [4, 3, 2, 1, 0]


@pytest.mark.parametrize("route", ["/dict", "/json", "/plain", "/stream"])
def test_allowed_headers_reach_every_response_type(client: TestClient, user_id: str, route: str) -> None:
    response = client.get(route, headers=as_user(user_id, "pro"))
    assert response.status_code == 200
    assert response.headers["X-RateLimit-Limit"] == "60"
    assert response.headers["X-RateLimit-Remaining"] == "59"
    assert response.headers["X-RateLimit-Window"] == "minute"
    assert response.headers.get_list("X-RateLimit-Remaining") == ["59"]  # never twice
    if route == "/stream":
        assert response.text == "data: a\n\ndata: b\n\ndata: [DONE]\n\n"


def test_route_without_the_dependency_is_not_limited(client: TestClient, user_id: str,
                                                     redis_client: redis.Redis) -> None:
    for _ in range(10):
        response = client.get("/unlimited", headers=as_user(user_id))
        assert response.status_code == 200
        assert "X-RateLimit-Remaining" not in response.headers
    assert redis_client.keys("*") == []


def test_without_the_middleware_returned_values_still_get_headers_and_a_warning_is_logged(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ratelimit_responses, "_warned_no_middleware", False)
    client = client_for(RateLimit(limiter=limiter), headers_middleware=False)
    with caplog.at_level(logging.WARNING, logger="genai_ratelimit"):
        first = client.get("/dict", headers=as_user(user_id))
        second = client.get("/dict", headers=as_user(user_id))
    assert first.headers["X-RateLimit-Remaining"] == "4"
    assert second.headers["X-RateLimit-Remaining"] == "3"
    warnings = [r for r in caplog.records if "RateLimitHeadersMiddleware" in r.getMessage()]
    assert len(warnings) == 1  # once per process, not per request


def test_a_429_keeps_its_own_headers_when_an_earlier_limit_allowed(
        redis_url: str, redis_client: redis.Redis, make_limiter: LimiterFactory,
        client_for: Callable[..., TestClient], user_id: str) -> None:
    roomy = make_limiter.native(redis_url, key_prefix="roomy")
    strict = make_limiter.native(redis_url, key_prefix="strict")
    client = client_for(RateLimit(limiter=roomy),
                        extra=[RateLimit(limiter=strict,
                                         tier_limits={"free": {"per_minute": 1, "per_day": 10}})])
    assert client.get("/stream", headers=as_user(user_id)).status_code == 200
    response = client.get("/stream", headers=as_user(user_id))
    assert response.status_code == 429
    assert response.headers.get_list("X-RateLimit-Remaining") == ["0"]
    assert response.headers.get_list("X-RateLimit-Limit") == ["1"]


def test_two_limits_on_one_route_report_the_tighter_one(
        redis_url: str, redis_client: redis.Redis, make_limiter: LimiterFactory,
        client_for: Callable[..., TestClient], user_id: str) -> None:
    roomy = make_limiter.native(redis_url, key_prefix="roomy")
    tight = make_limiter.native(redis_url, key_prefix="tight")
    client = client_for(RateLimit(limiter=tight, tier_limits={"free": {"per_minute": 3, "per_day": 10}}),
                        extra=[RateLimit(limiter=roomy)])
    response = client.get("/json", headers=as_user(user_id))
    assert response.status_code == 200
    assert response.headers["X-RateLimit-Limit"] == "3"
    assert response.headers["X-RateLimit-Remaining"] == "2"


def test_two_dependencies_with_one_budget_on_one_route_count_each_request_once(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(RateLimit(limiter=limiter), extra=[RateLimit(limiter=limiter)])
    statuses = [client.get("/dict", headers=as_user(user_id)).status_code for _ in range(6)]
    assert statuses == [200] * 5 + [429]
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 5


def test_a_second_dependency_with_its_own_budget_counts_in_the_namespace_it_names(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    strict = RateLimit(limiter=limiter, tier_limits={"free": {"per_minute": 3, "per_day": 10}},
                       namespace="strict")
    client = client_for(RateLimit(limiter=limiter), extra=[strict])
    responses = [client.get("/dict", headers=as_user(user_id)) for _ in range(4)]
    assert [r.status_code for r in responses] == [200] * 3 + [429]
    assert responses[-1].headers["X-RateLimit-Limit"] == "3"
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 4  # the default budget saw 4 requests
    assert redis_client.zcard(f"ratelimit:ns:strict:{user_id}:60") == 3


def test_dependencies_that_name_one_namespace_share_its_budget(
        limiter: AnyLimiter, make_limiter: LimiterFactory, user_id: str,
        redis_client: redis.Redis) -> None:
    # Two routes, two RateLimit instances (one fails open), one budget they both draw on.
    chat = RateLimit(limiter=limiter, namespace="chat")
    embeddings = RateLimit(limiter=limiter, namespace="chat", on_unavailable="allow")
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)
    app.add_middleware(FakeAuth)

    @app.get("/chat", dependencies=[Depends(chat)])
    async def chat_route() -> dict[str, str]:
        return {}

    @app.get("/embeddings", dependencies=[Depends(embeddings)])
    async def embeddings_route() -> dict[str, str]:
        return {}

    with TestClient(app, **client_options(make_limiter)) as client:
        statuses = [client.get(route, headers=as_user(user_id)).status_code
                    for route in ["/chat", "/embeddings"] * 3]
        for async_limiter in make_limiter.async_limiters:
            client.portal.call(async_limiter.aclose)
    assert statuses == [200] * 5 + [429]
    assert redis_client.zcard(f"ratelimit:ns:chat:{user_id}:60") == 5
    assert redis_client.keys(f"ratelimit:{user_id}:*") == []


def test_a_named_namespace_keeps_the_budget_of_any_instance_that_names_it(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, namespace="images"),
                        extra=[RateLimit(limiter=limiter, namespace="images")])
    statuses = [client.get("/json", headers=as_user(user_id)).status_code for _ in range(6)]
    assert statuses == [200] * 5 + [429]


def test_a_budget_of_its_own_has_no_namespace_unless_named(closed_port_url: str) -> None:
    # A budget's keys never depend on its numbers: an edit keeps every count.
    with RateLimiter(closed_port_url) as limiter:
        for budget in ({"free": {"per_minute": 3, "per_day": 10}}, TIER_LIMITS):
            assert RateLimit(limiter=limiter, tier_limits=budget).namespace is None
        assert RateLimit(limiter=limiter, namespace="images").namespace == "images"


@pytest.mark.parametrize("namespace", ["", "a:b", "has space", "x" * 65, 7])
def test_a_namespace_that_is_not_a_short_plain_name_is_refused(limiter: AnyLimiter, namespace: Any) -> None:
    with pytest.raises((ValueError, TypeError), match="namespace"):
        RateLimit(limiter=limiter, namespace=namespace)


# --- tiers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["free", "pro", "enterprise"])
def test_each_tier_gets_its_per_minute_budget(client: TestClient, user_id: str, tier: str) -> None:
    budget = TIER_LIMITS[tier]["per_minute"]
    assert budget == {"free": 5, "pro": 60, "enterprise": 600}[tier]
    for number in range(1, budget + 1):
        response = client.get("/dict", headers=as_user(user_id, tier))
        assert response.status_code == 200, f"request {number} of {budget}"
    assert response.headers["X-RateLimit-Remaining"] == "0"
    response = client.get("/dict", headers=as_user(user_id, tier))
    assert response.status_code == 429
    assert response.headers["X-RateLimit-Limit"] == str(budget)
    assert response.headers["X-RateLimit-Window"] == "minute"


def test_tier_in_query_or_client_headers_does_not_raise_the_budget(client: TestClient, user_id: str) -> None:
    forged = {**as_user(user_id, "free"), "X-Tier": "enterprise", "X-RateLimit-Tier": "enterprise",
              "Tier": "enterprise", "X-User-Tier": "enterprise"}
    for _ in range(5):
        response = client.get("/dict", params={"tier": "enterprise"}, headers=forged)
        assert response.status_code == 200
        assert response.headers["X-RateLimit-Limit"] == "5"
    assert client.get("/dict", params={"tier": "enterprise"}, headers=forged).status_code == 429


def test_forged_user_id_in_query_or_headers_does_not_change_identity(
        client: TestClient, user_id: str) -> None:
    for n in range(5):
        response = client.get("/dict", params={"user_id": f"other-{n}"},
                              headers={**as_user(user_id), "X-User-Id": f"other-{n}"})
        assert response.status_code == 200
    assert client.get("/dict", params={"user_id": "fresh"}, headers=as_user(user_id)).status_code == 429


@pytest.mark.parametrize("tier", [None, "platinum", ""])
def test_missing_or_unknown_tier_gets_the_free_budget(
        client: TestClient, user_id: str, tier: str | None) -> None:
    headers = {"X-Test-Auth": f"{user_id}/{tier}"} if tier else as_user(user_id)
    response = client.get("/dict", headers=headers)
    assert response.headers["X-RateLimit-Limit"] == "5"


def test_changing_tier_changes_only_the_budget_not_the_keys(
        client: TestClient, user_id: str, redis_client: redis.Redis) -> None:
    for _ in range(5):
        assert client.get("/dict", headers=as_user(user_id, "free")).status_code == 200
    assert client.get("/dict", headers=as_user(user_id, "free")).status_code == 429
    upgraded = client.get("/dict", headers=as_user(user_id, "pro"))
    assert upgraded.status_code == 200
    assert upgraded.headers["X-RateLimit-Remaining"] == "54"  # the 5 free requests still count
    assert sorted(redis_client.keys("*")) == [f"ratelimit:{user_id}:60".encode(),
                                              f"ratelimit:{user_id}:86400".encode()]


# --- the day window --------------------------------------------------------------------------


def test_prefilled_day_window_trips_with_window_day(client: TestClient, user_id: str,
                                                     redis_client: redis.Redis) -> None:
    now = server_now_ms(redis_client)
    two_hours_ago = now - 2 * 3_600_000
    # 100 requests today, none in the last minute: the minute allows, the day rejects.
    prefill(redis_client, f"ratelimit:{user_id}:86400", [two_hours_ago + i for i in range(100)])
    response = client.get("/dict", headers=as_user(user_id, "free"))
    assert response.status_code == 429
    assert response.headers["X-RateLimit-Window"] == "day"
    assert response.headers["X-RateLimit-Limit"] == "100"
    assert response.headers["X-RateLimit-Remaining"] == "0"
    # The oldest entry leaves the day window 22 h from now.
    assert 22 * 3600 - 5 <= int(response.headers["Retry-After"]) <= 22 * 3600
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 0  # a rejection writes nothing


def test_when_both_windows_reject_the_minutes_retry_after_wins(client: TestClient, user_id: str,
                                                              redis_client: redis.Redis) -> None:
    now = server_now_ms(redis_client)
    recent = [now - 30_000 + i for i in range(5)]  # the minute is full: free again in ~30 s
    older = [now - 2 * 3_600_000 + i for i in range(95)]
    prefill(redis_client, f"ratelimit:{user_id}:60", recent)
    prefill(redis_client, f"ratelimit:{user_id}:86400", older + recent)
    response = client.get("/dict", headers=as_user(user_id, "free"))
    assert response.status_code == 429
    assert response.headers["X-RateLimit-Window"] == "minute"
    assert response.headers["X-RateLimit-Limit"] == "5"
    assert 25 <= int(response.headers["Retry-After"]) <= 30


def test_allowed_headers_describe_the_window_with_fewest_remaining(client: TestClient, user_id: str,
                                                                   redis_client: redis.Redis) -> None:
    now = server_now_ms(redis_client)
    prefill(redis_client, f"ratelimit:{user_id}:86400", [now - 3_600_000 + i for i in range(97)])
    response = client.get("/stream", headers=as_user(user_id, "free"))
    assert response.status_code == 200
    assert response.headers["X-RateLimit-Window"] == "day"
    assert response.headers["X-RateLimit-Limit"] == "100"
    assert response.headers["X-RateLimit-Remaining"] == "2"


# --- identity --------------------------------------------------------------------------------


def test_missing_user_id_falls_back_to_the_client_address(
        client: TestClient, redis_client: redis.Redis) -> None:
    for _ in range(5):
        assert client.get("/dict").status_code == 200
    assert client.get("/dict").status_code == 429
    # Starlette's TestClient connects as the host "testclient".
    assert redis_client.zcard("ratelimit:ip:testclient:60") == 5


def test_each_user_id_has_its_own_budget(client: TestClient, user_id: str) -> None:
    for _ in range(5):
        client.get("/dict", headers=as_user(user_id))
    assert client.get("/dict", headers=as_user(user_id)).status_code == 429
    assert client.get("/dict", headers=as_user(user_id + "-other")).status_code == 200


def test_identify_overrides_identity_and_tier(limiter: AnyLimiter, client_for: Callable[..., TestClient],
                                              redis_client: redis.Redis) -> None:
    seen: list[Request] = []

    def identify(request: Request) -> tuple[str, str]:
        seen.append(request)
        return "org:acme", "pro"

    client = client_for(RateLimit(limiter=limiter, identify=identify))
    response = client.get("/dict", headers=as_user("someone-else", "free"))
    assert response.headers["X-RateLimit-Limit"] == "60"
    assert len(seen) == 1
    assert redis_client.zcard("ratelimit:org:acme:60") == 1
    assert redis_client.keys("ratelimit:someone-else:*") == []


def test_identity_that_is_not_a_string_is_a_programming_error(
        limiter: AnyLimiter, client_for: Callable[..., TestClient]) -> None:
    client = client_for(RateLimit(limiter=limiter, identify=lambda request: (None, "free")))  # type: ignore[arg-type,return-value]
    # TestClient re-raises server exceptions by default (raise_server_exceptions=True).
    with pytest.raises(TypeError, match="non-empty str"):
        client.get("/dict")


def test_a_user_id_that_looks_like_an_address_does_not_share_the_anonymous_budget(
        client: TestClient, redis_client: redis.Redis) -> None:
    # The anonymous client at "testclient" spends its budget; a signed-in user whose id
    # happens to read "ip:testclient" still has all of theirs.
    assert [client.get("/dict").status_code for _ in range(6)] == [200] * 5 + [429]
    response = client.get("/dict", headers=as_user("ip:testclient"))
    assert response.status_code == 200
    assert response.headers["X-RateLimit-Remaining"] == "4"
    assert redis_client.zcard("ratelimit:ip:testclient:60") == 5


def test_an_identify_result_that_looks_like_an_address_does_not_share_the_anonymous_budget(
        limiter: AnyLimiter, client_for: Callable[..., TestClient]) -> None:
    anonymous = client_for(RateLimit(limiter=limiter))
    assert [anonymous.get("/dict").status_code for _ in range(6)] == [200] * 5 + [429]
    custom = client_for(RateLimit(limiter=limiter, identify=lambda request: ("ip:testclient", None)))
    assert custom.get("/dict").status_code == 200


def test_an_identify_that_delegates_to_the_default_rule_keeps_the_anonymous_budget(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], redis_client: redis.Redis) -> None:
    def identify(request: Request) -> tuple[str, str | None]:
        user_id, _ = default_identify(request)
        return user_id, "pro"

    client = client_for(RateLimit(limiter=limiter, identify=identify))
    response = client.get("/dict")
    assert response.headers["X-RateLimit-Limit"] == "60"
    assert redis_client.zcard("ratelimit:ip:testclient:60") == 1


@pytest.mark.parametrize(("user_id", "key"), [
    ("user_8421", "ratelimit:user_8421:60"),              # an ordinary id is its own key
    ("org:acme", "ratelimit:org:acme:60"),
    ("ip:testclient", "ratelimit:user:ip:testclient:60"),  # the reserved prefixes are escaped
    ("user:7", "ratelimit:user:user:7:60"),
    ("ns:chat:7", "ratelimit:user:ns:chat:7:60"),
])
def test_the_key_of_a_user_id(client: TestClient, redis_client: redis.Redis, user_id: str, key: str) -> None:
    assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    assert sorted(redis_client.keys("*:60")) == [key.encode()]


# --- configuration checked when the dependency is built ---------------------------------------


def test_on_unavailable_other_than_deny_or_allow_is_a_value_error(limiter: AnyLimiter) -> None:
    with pytest.raises(ValueError, match="on_unavailable"):
        RateLimit(limiter=limiter, on_unavailable="ignore")  # type: ignore[arg-type]


@pytest.mark.parametrize("tier_limits", [
    {"pro": {"per_minute": 60, "per_day": 5000}},          # no free tier
    {"free": {"per_minute": 0, "per_day": 100}},           # a zero budget
    {"free": {}},                                          # no window
    {"free": {"per_minute": 5, "per_day": 100, "per_hour": 2}},  # an hour below the minute
    {"free": {"per_minute": True, "per_day": 100}},
    {"free": {"per_minute": 5.0, "per_day": 100}},
])
def test_bad_tier_limits_fail_when_the_dependency_is_built(limiter: AnyLimiter, tier_limits: Any) -> None:
    with pytest.raises(ValueError, match="tier_limits"):
        RateLimit(limiter=limiter, tier_limits=tier_limits)


def test_limiter_without_check_windows_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="limiter"):
        RateLimit(limiter=object())  # type: ignore[arg-type]


def test_tier_limits_argument_sets_the_budget(limiter: AnyLimiter, client_for: Callable[..., TestClient],
                                              user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, tier_limits={"free": {"per_minute": 2, "per_day": 3}}))
    assert [client.get("/dict", headers=as_user(user_id)).status_code for _ in range(3)] == [200, 200, 429]


def test_core_package_imports_without_fastapi_and_the_integration_says_what_to_install(
        tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['fastapi'] = None  # as if FastAPI were not installed\n"
        "import genai_ratelimit\n"
        "assert genai_ratelimit.RateLimiter\n"
        "try:\n"
        "    import genai_ratelimit.fastapi\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    # From a temporary directory: `python -c` puts the cwd first on sys.path.
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "pip install 'genai-ratelimit[fastapi]'" in result.stdout


def test_window_names() -> None:
    assert [window_name(s) for s in (1, 60, 3600, 86400, 600)] == ["second", "minute", "hour", "day", "600s"]


@ASYNC_ONLY
def test_ready_dependency_uses_redis_url_on_first_request(
        redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch,
        make_limiter: LimiterFactory, client_for: Callable[..., TestClient], user_id: str) -> None:
    assert isinstance(rate_limit, RateLimit)
    monkeypatch.setenv("REDIS_URL", redis_url)
    dependency = RateLimit()  # what `rate_limit` is: the default limiter, made on first use
    client = client_for(dependency)
    assert client.get("/dict", headers=as_user(user_id)).headers["X-RateLimit-Remaining"] == "4"
    make_limiter.track(dependency.limiter)
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 1


def test_ready_dependency_is_async_with_an_async_limiter_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # never dialled here
    for dependency in (rate_limit, RateLimit(), RateLimit(on_unavailable="allow")):
        assert inspect.iscoroutinefunction(dependency.__call__)
    dependency = RateLimit()
    assert type(dependency.limiter) is AsyncRateLimiter
    assert dependency.limiter.url == "redis://127.0.0.1:1/0"
    assert dependency.limiter is dependency.limiter  # made once


def test_an_explicit_limiter_decides_sync_or_async(sync_limiter: RateLimiter) -> None:
    assert not inspect.iscoroutinefunction(RateLimit(limiter=sync_limiter).__call__)
    assert not inspect.iscoroutinefunction(RateLimit(sync_limiter, on_unavailable="allow").__call__)
    async_limiter = AsyncRateLimiter("redis://127.0.0.1:1/0")
    assert inspect.iscoroutinefunction(RateLimit(limiter=async_limiter).__call__)


# --- kill switch -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "true", "YES", "On"])
def test_kill_switch_lets_everything_through_without_touching_redis(
        closed_port_url: str, make_limiter: LimiterFactory, client_for: Callable[..., TestClient],
        monkeypatch: pytest.MonkeyPatch, user_id: str, value: str) -> None:
    # The limiter points at a port where nothing listens: any Redis I/O would be a 503.
    unreachable = make_limiter.native(closed_port_url)
    monkeypatch.setenv("RATE_LIMIT_DISABLED", value)
    dependency = RateLimit(limiter=unreachable, on_unavailable="deny")
    client = client_for(dependency)
    for _ in range(20):
        assert client.get("/stream", headers=as_user(user_id)).status_code == 200
    monkeypatch.delenv("RATE_LIMIT_DISABLED")
    assert client.get("/stream", headers=as_user(user_id)).status_code == 503


def test_kill_switch_sends_no_command_to_a_live_redis(
        client: TestClient, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, user_id: str) -> None:
    redis_client.config_resetstat()
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "true")
    for _ in range(10):
        assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    stats = redis_client.info("commandstats")
    assert not any(name in stats for name in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_zadd"))
    assert redis_client.keys("*") == []


# --- Redis unavailable -------------------------------------------------------------------------


def test_redis_down_answers_503_with_retry_after_1(closed_port_url: str, make_limiter: LimiterFactory,
        client_for: Callable[..., TestClient], user_id: str) -> None:
    unreachable = make_limiter.native(closed_port_url)
    client = client_for(RateLimit(limiter=unreachable))
    for route in ("/dict", "/stream"):
        response = client.get(route, headers=as_user(user_id))
        assert response.status_code == 503
        assert response.json()["detail"] == "Rate limiter unavailable"
        assert response.headers["Retry-After"] == "1"
        assert "X-RateLimit-Remaining" not in response.headers


def test_redis_paused_answers_503_within_the_socket_timeout(
        private_redis: RedisServer, make_limiter: LimiterFactory, client_for: Callable[..., TestClient],
        user_id: str) -> None:
    limiter = make_limiter.native(private_redis.url, connect_timeout=0.5, socket_timeout=0.5)
    client = client_for(RateLimit(limiter=limiter))
    assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    private_redis.pause()
    try:
        started = time.monotonic()
        response = client.get("/dict", headers=as_user(user_id))
        elapsed = time.monotonic() - started
    finally:
        private_redis.resume()
    assert (response.status_code, response.headers["Retry-After"]) == (503, "1")
    assert elapsed < 0.5 + 0.5  # never a hung request
    assert client.get("/dict", headers=as_user(user_id)).status_code == 200


def test_redis_killed_while_serving_answers_503_then_recovers(
        private_redis: RedisServer, make_limiter: LimiterFactory, client_for: Callable[..., TestClient],
        user_id: str) -> None:
    limiter = make_limiter.native(private_redis.url)
    client = client_for(RateLimit(limiter=limiter))
    assert client.get("/stream", headers=as_user(user_id)).status_code == 200
    private_redis.kill()
    response = client.get("/stream", headers=as_user(user_id))
    assert (response.status_code, response.headers["Retry-After"]) == (503, "1")
    private_redis.start(port=private_redis.port)
    assert client.get("/stream", headers=as_user(user_id)).status_code == 200


def test_on_unavailable_allow_lets_requests_through_and_logs_a_warning(
        closed_port_url: str, make_limiter: LimiterFactory,
        client_for: Callable[..., TestClient], user_id: str,
        caplog: pytest.LogCaptureFixture) -> None:
    unreachable = make_limiter.native(closed_port_url)
    client = client_for(RateLimit(limiter=unreachable, on_unavailable="allow"))
    with caplog.at_level(logging.WARNING, logger="genai_ratelimit"):
        response = client.get("/json", headers=as_user(user_id))
    assert response.status_code == 200
    assert response.json() == {"answer": "ok"}
    assert "X-RateLimit-Remaining" not in response.headers
    assert any(r.name == "genai_ratelimit" and r.levelno == logging.WARNING
               and "unavailable" in r.getMessage() for r in caplog.records)


# --- the fail-open counter ---------------------------------------------------------------------


def test_fail_open_count_counts_each_request_let_through_because_redis_was_unavailable(
        closed_port_url: str, make_limiter: LimiterFactory, client_for: Callable[..., TestClient],
        user_id: str, caplog: pytest.LogCaptureFixture) -> None:
    # unavailable_log_interval=0: a line per request here, to read the count of the last one.
    dependency = RateLimit(limiter=make_limiter.native(closed_port_url), on_unavailable="allow",
                           unavailable_log_interval=0)
    assert dependency.fail_open_count == 0
    client = client_for(dependency)
    with caplog.at_level(logging.WARNING, logger="genai_ratelimit"):
        for number in range(1, 8):
            assert client.get("/dict", headers=as_user(user_id)).status_code == 200
            assert dependency.fail_open_count == number
    assert "fail-open #7" in caplog.text


def test_fail_open_count_stays_zero_when_redis_decides(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    dependency = RateLimit(limiter=limiter, on_unavailable="allow")
    client = client_for(dependency)
    statuses = [client.get("/dict", headers=as_user(user_id)).status_code for _ in range(7)]
    assert statuses == [200] * 5 + [429] * 2
    assert dependency.fail_open_count == 0


def test_fail_open_count_stays_zero_when_unavailable_means_deny(
        closed_port_url: str, make_limiter: LimiterFactory,
        client_for: Callable[..., TestClient], user_id: str) -> None:
    dependency = RateLimit(limiter=make_limiter.native(closed_port_url))
    client = client_for(dependency)
    assert [client.get("/dict", headers=as_user(user_id)).status_code for _ in range(3)] == [503] * 3
    assert dependency.fail_open_count == 0


def test_fail_open_count_ignores_the_kill_switch(
        closed_port_url: str, make_limiter: LimiterFactory, client_for: Callable[..., TestClient],
        monkeypatch: pytest.MonkeyPatch, user_id: str) -> None:
    dependency = RateLimit(limiter=make_limiter.native(closed_port_url), on_unavailable="allow")
    client = client_for(dependency)
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "true")
    assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    assert dependency.fail_open_count == 0  # switched off on purpose, not a failure


def test_fail_open_count_is_exact_under_concurrent_requests(
        closed_port_url: str, make_limiter: LimiterFactory, user_id: str) -> None:
    # 200 requests at once through the ASGI app: with a blocking limiter they fail open in
    # FastAPI's threadpool in parallel, with an async one on the loop.
    import httpx

    dependency = RateLimit(limiter=make_limiter.native(closed_port_url), on_unavailable="allow")
    app = build_app(dependency)

    async def burst() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            responses = await asyncio.gather(
                *(client.get("/dict", headers=as_user(f"{user_id}-{i}")) for i in range(200)))
        return [r.status_code for r in responses]

    assert run_async(burst(), make_limiter.loop_factory) == [200] * 200
    assert dependency.fail_open_count == 200


# --- where the limiter runs ------------------------------------------------------------------


class ThreadRecordingLimiter:
    """A RateLimiter wrapper that remembers which thread made each call."""

    def __init__(self, inner: RateLimiter) -> None:
        self.inner = inner
        self.threads: list[int] = []

    def check_windows(self, user_id: str, windows: Sequence[tuple[int, int]]) -> tuple[bool, int, int, int]:
        self.threads.append(threading.get_ident())
        return self.inner.check_windows(user_id, windows)


@pytest.fixture
def threadpool_calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What FastAPI hands to its threadpool to solve dependencies, recorded as it goes."""
    calls: list[Any] = []
    run_in_threadpool = fastapi_dependency_utils.run_in_threadpool

    async def recording(func: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(func)
        return await run_in_threadpool(func, *args, **kwargs)

    monkeypatch.setattr(fastapi_dependency_utils, "run_in_threadpool", recording)
    return calls


def add_loop_thread_route(app: FastAPI, dependency: Any, seen: list[tuple[int, Any]]) -> None:
    """GET /loop-thread: an async route (it runs on the event loop) behind the dependency,
    recording its thread and loop."""
    @app.get("/loop-thread", dependencies=[Depends(dependency)])
    async def loop_thread() -> dict[str, str]:
        seen.append((threading.get_ident(), asyncio.get_running_loop()))
        return {}


def test_a_blocking_limiter_runs_in_the_threadpool_not_on_the_event_loop(
        sync_limiter: RateLimiter, user_id: str, threadpool_calls: list[Any]) -> None:
    recording = ThreadRecordingLimiter(sync_limiter)
    dependency = RateLimit(limiter=recording)
    assert not inspect.iscoroutinefunction(dependency.__call__)
    app = build_app(dependency)
    loop_threads: list[tuple[int, Any]] = []
    add_loop_thread_route(app, dependency, loop_threads)

    with TestClient(app) as client:
        assert client.get("/loop-thread", headers=as_user(user_id)).status_code == 200
    assert len(recording.threads) == 1 and len(loop_threads) == 1
    assert recording.threads[0] != loop_threads[0][0]
    assert dependency in threadpool_calls  # the probe below sees the threadpool when it is used


@ASYNC_ONLY
def test_the_default_dependency_checks_on_the_event_loop_and_never_uses_the_threadpool(
        redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, user_id: str,
        threadpool_calls: list[Any], make_limiter: LimiterFactory,
        client_for: Callable[..., TestClient]) -> None:
    # The real AsyncRateLimiter that RateLimit() makes, with a record of where each of its
    # checks ran: the thread and the running loop.
    monkeypatch.setenv("REDIS_URL", redis_url)
    dependency = RateLimit()
    limiter = dependency.limiter
    assert type(limiter) is AsyncRateLimiter
    make_limiter.track(limiter)
    checks: list[tuple[int, Any]] = []
    real_check_windows = limiter.check_windows  # the contract: one check_windows call
    # (patched on the instance: the dependency must call it, not its detailed twin)

    async def recording_check_windows(user: str, windows: Any) -> Any:
        checks.append((threading.get_ident(), asyncio.get_running_loop()))
        return await real_check_windows(user, windows)

    monkeypatch.setattr(limiter, "check_windows", recording_check_windows)
    routes: list[tuple[int, Any]] = []
    client = client_for(dependency)
    add_loop_thread_route(client.app, dependency, routes)  # type: ignore[arg-type]

    statuses = [client.get("/loop-thread", headers=as_user(user_id)).status_code for _ in range(6)]
    assert statuses == [200] * 5 + [429]
    assert len(checks) == 6 and len(routes) == 5
    loop_thread, loop = routes[0]
    assert all(check == (loop_thread, loop) for check in checks)  # on the loop's own thread
    assert threadpool_calls == []  # nothing went to the threadpool
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 5


class AwaitableLimiter:
    """An async limiter stand-in: `await check_windows(...)`, answered by a real RateLimiter
    on the loop's default executor. Records the event loop it was awaited on."""

    def __init__(self, inner: RateLimiter) -> None:
        self.inner = inner
        self.awaited_on: list[asyncio.AbstractEventLoop] = []

    async def check_windows(
            self, user_id: str, windows: Sequence[tuple[int, int]]) -> tuple[bool, int, int, int]:
        loop = asyncio.get_running_loop()
        self.awaited_on.append(loop)
        return await loop.run_in_executor(None, self.inner.check_windows, user_id, list(windows))


@ASYNC_ONLY
def test_any_async_limiter_is_awaited_on_the_event_loop(sync_limiter: RateLimiter, user_id: str,
                                                        client_for: Callable[..., TestClient]) -> None:
    async_limiter = AwaitableLimiter(sync_limiter)
    dependency = RateLimit(limiter=async_limiter)
    assert isinstance(dependency, RateLimit)
    assert inspect.iscoroutinefunction(dependency.__call__)
    client = client_for(dependency)
    statuses = [client.get("/stream", headers=as_user(user_id)).status_code for _ in range(6)]
    assert statuses == [200] * 5 + [429]
    assert len(async_limiter.awaited_on) == 6


def test_a_limiter_subclass_that_overrides_check_windows_is_what_decides(
        redis_url: str, user_id: str, client_for: Callable[..., TestClient]) -> None:
    # The contract: the dependency decides with one check_windows call per request, so a
    # subclass that wraps check_windows (to count, audit, shard) sees every decision.
    calls: list[tuple[str, list[tuple[int, int]]]] = []

    class AuditedLimiter(RateLimiter):
        def check_windows(self, user_id: str, windows: Any, *, cost: int = 1) -> Any:
            calls.append((user_id, list(windows)))
            return super().check_windows(user_id, windows, cost=cost)

    with AuditedLimiter(redis_url) as audited:
        client = client_for(RateLimit(limiter=audited))
        statuses = [client.get("/dict", headers=as_user(user_id)).status_code for _ in range(6)]
    assert statuses == [200] * 5 + [429]
    assert calls == [(user_id, [(5, 60), (100, 86_400)])] * 6


def test_a_limiter_answering_plain_tuples_gets_the_rounded_wait_in_ms(
        sync_limiter: RateLimiter, user_id: str, client_for: Callable[..., TestClient]) -> None:
    class PlainTuples:
        def check_windows(self, user_id: str, windows: Any) -> tuple[bool, int, int, int]:
            return tuple(sync_limiter.check_windows(user_id, windows))  # type: ignore[return-value]

    client = client_for(RateLimit(limiter=PlainTuples()))
    responses = [client.get("/dict", headers=as_user(user_id)) for _ in range(6)]
    assert [r.status_code for r in responses] == [200] * 5 + [429]
    refused = responses[-1]
    assert int(refused.headers["retry-after-ms"]) == int(refused.headers["Retry-After"]) * 1000


def test_is_async_attribute_decides_over_introspection(sync_limiter: RateLimiter) -> None:
    class Flagged:
        is_async = True

        def check_windows(self, user_id: str, windows: Any) -> Any:  # e.g. a C method returning an awaitable
            raise AssertionError("not called")

    assert inspect.iscoroutinefunction(RateLimit(limiter=Flagged()).__call__)
    assert not inspect.iscoroutinefunction(RateLimit(limiter=sync_limiter).__call__)


# --- a test client that runs each request on a fresh event loop -------------------------------


def test_a_client_that_runs_each_request_on_a_fresh_loop_is_limited_exactly(
        limiter: AnyLimiter, make_limiter: LimiterFactory, user_id: str, redis_client: redis.Redis) -> None:
    # TestClient outside `with` starts a new event loop for every request: the async limiter
    # opens a connection on each (its connections belong to their loop) and keeps counting.
    client = TestClient(build_app(RateLimit(limiter=limiter)), **client_options(make_limiter))
    statuses = [client.get("/dict", headers=as_user(user_id)).status_code for _ in range(7)]
    assert statuses == [200] * 5 + [429] * 2
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 5
