"""genai_ratelimit.fastapi.TokenRateLimit through Starlette's TestClient, on a real Redis:
requests and tokens reserved in one call, reconciled from a JSON body's usage, from a
stream's final usage chunk, or by record_usage (exactly once); the estimate; the 429s (retry
later, and never fits); OpenAI's headers and error body.

Every test that uses a limiter runs once per limiter kind (tests/conftest.py): a blocking
RateLimiter (reserve and reconcile in FastAPI's threadpool) and an AsyncRateLimiter awaited
on the TestClient's loop, asyncio's or uvloop's."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from genai_ratelimit import TIER_LIMITS, TIER_TOKEN_LIMITS, AsyncRateLimiter, RateLimiter
from genai_ratelimit.fastapi import (
    RateLimit,
    RateLimitHeadersMiddleware,
    TokenRateLimit,
    record_usage,
)
from genai_ratelimit.fastapi._openai_headers import format_duration
from genai_ratelimit.fastapi._usage import UsageScanner, estimate_openai_tokens
from helpers_async import LimiterFactory
from redis_server import free_port

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async tests "
                                   "drive on hiredis 1.x"),
]

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r".*httpx2")
    from fastapi.testclient import TestClient

SMALL = {"free": {"per_minute": 100, "per_day": 1_000}}  # tokens
OPENAI_SIX = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
              "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")

AnyLimiter = RateLimiter | AsyncRateLimiter


class FakeAuth:
    """`X-Test-Auth: <user_id>[/<tier>]` becomes request.state.user_id (and .tier)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"x-test-auth":
                    user_id, _, tier = value.decode().partition("/")
                    state = scope.setdefault("state", {})
                    state["user_id"] = user_id
                    if tier:
                        state["tier"] = tier
        await self.app(scope, receive, send)


def usage(total: int) -> dict[str, int]:
    return {"prompt_tokens": 1, "completion_tokens": total - 1, "total_tokens": total}


def build_app(dependency: Any, *, middleware: bool = True, extra: tuple[Any, ...] = ()) -> FastAPI:
    """Routes that report their usage each way a route can. The body's "report" is the usage
    total the route reports."""
    app = FastAPI()
    if middleware:
        app.add_middleware(RateLimitHeadersMiddleware)
    app.add_middleware(FakeAuth)
    limited = [Depends(dependency), *(Depends(d) for d in extra)]

    @app.post("/json", dependencies=limited)
    async def as_json(request: Request) -> dict[str, Any]:
        body = await request.json()  # still readable after the estimate read it
        return {"object": "chat.completion", "echo": body, "usage": usage(body["report"])}

    @app.post("/json-response", dependencies=limited)
    async def as_json_response(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"object": "chat.completion", "usage": usage(body["report"])})

    @app.post("/stream", dependencies=limited)
    async def as_stream(request: Request) -> StreamingResponse:
        body = await request.json()

        async def events() -> Any:
            for word in ("Hello", " there"):
                yield f"data: {json.dumps({'choices': [{'delta': {'content': word}}]})}\n\n"
            # the final usage chunk, split across two body messages
            final = f"data: {json.dumps({'choices': [], 'usage': usage(body['report'])})}\n\n"
            yield final[:20]
            yield final[20:]
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/record", dependencies=limited)
    async def records(request: Request) -> dict[str, Any]:
        body = await request.json()
        found = await record_usage(request, body["report"])
        # A usage in the body too: the middleware must not reconcile a second time.
        return {"found": found, "usage": usage(body["report"] + 50)}

    @app.post("/record-twice", dependencies=limited)
    async def records_twice(request: Request) -> dict[str, Any]:
        await record_usage(request, 5)
        try:
            await record_usage(request, 6)
        except RuntimeError as exc:
            return {"error": str(exc)}
        return {"error": None}

    @app.post("/record-stream", dependencies=limited)
    async def records_from_the_stream(request: Request) -> StreamingResponse:
        body = await request.json()

        async def events() -> Any:
            yield "data: {\"choices\": [{\"delta\": {\"content\": \"hi\"}}]}\n\n"
            await record_usage(request, body["report"])
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/silent", dependencies=limited)
    async def silent() -> dict[str, str]:
        return {"answer": "no usage here"}

    @app.post("/unlimited-record")
    async def unlimited_record(request: Request) -> dict[str, str]:
        try:
            await record_usage(request, 5)
        except RuntimeError as exc:
            return {"error": str(exc)}
        return {"error": ""}

    return app


@pytest.fixture(autouse=True)
def _built_in_tiers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GENAI_RATELIMIT_TIERS", raising=False)


@pytest.fixture
def limiter(make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> AnyLimiter:
    return make_limiter.native(redis_url)  # type: ignore[no-any-return]


@pytest.fixture
def client_for(make_limiter: LimiterFactory) -> Iterator[Callable[..., TestClient]]:
    """client_for(dependency, **build_app_options): a started TestClient on a loop of the
    kind under test."""
    clients: list[TestClient] = []

    def make(dependency: Any, **kwargs: Any) -> TestClient:
        options = ({} if make_limiter.loop_factory is None
                   else {"backend_options": {"loop_factory": make_limiter.loop_factory}})
        client = TestClient(build_app(dependency, **kwargs), **options)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    if clients:
        for limiter in make_limiter.async_limiters:
            if not limiter.closed:
                clients[0].portal.call(limiter.aclose)  # type: ignore[union-attr]
    for client in clients:
        client.__exit__(None, None, None)


def as_user(user_id: str, tier: str | None = None) -> dict[str, str]:
    return {"X-Test-Auth": f"{user_id}/{tier}" if tier else user_id}


def chat_body(report: int, max_tokens: int = 40, content: str = "") -> dict[str, Any]:
    return {"model": "m", "max_tokens": max_tokens, "report": report,
            "messages": [{"role": "user", "content": content}]}


def request_count(redis_client: redis.Redis, user_id: str, window: int = 60) -> int:
    """Requests logged in a user's request window (in any namespace)."""
    keys = redis_client.keys(f"ratelimit:*{user_id}:{window}")
    return sum(redis_client.zcard(key) for key in keys)


def token_costs(redis_client: redis.Redis, user_id: str, window: int = 60) -> list[int]:
    """The cost of every entry of a user's token window, read back from Redis (the weights
    hash holds each entry's cost when it is not 1)."""
    keys = redis_client.keys(f"ratelimit:*{user_id}:{window}:tokens")  # any namespace
    if not keys:
        return []
    (key,) = keys
    members = redis_client.zrange(key, 0, -1)
    weights = redis_client.hgetall(key + b":w")
    return [int(weights.get(member, 1)) for member in members]


# --- reserve, then reconcile -------------------------------------------------------------


def test_an_allowed_request_reserves_one_request_and_its_estimate(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    response = client.post("/silent", json=chat_body(0, max_tokens=40, content="x" * 8),
                           headers=as_user(user_id))
    assert response.status_code == 200
    assert token_costs(redis_client, user_id) == [42]  # 40 + 8 characters / 4
    assert token_costs(redis_client, user_id, 86_400) == [42]
    assert request_count(redis_client, user_id) == 1
    assert response.headers["x-ratelimit-limit-tokens"] == "100"
    assert response.headers["x-ratelimit-remaining-tokens"] == "58"
    assert response.headers["x-ratelimit-reset-tokens"] == "1m0s"
    assert response.headers["x-ratelimit-limit-requests"] == "5"
    assert response.headers["x-ratelimit-remaining-requests"] == "4"
    assert response.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert (response.headers["X-RateLimit-Limit"], response.headers["X-RateLimit-Remaining"],
            response.headers["X-RateLimit-Window"]) == ("5", "4", "minute")


@pytest.mark.parametrize("route", ["/json", "/json-response"])
def test_a_json_usage_reconciles_the_reservation(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis, route: str) -> None:
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    response = client.post(route, json=chat_body(report=17), headers=as_user(user_id))
    assert response.status_code == 200
    assert token_costs(redis_client, user_id) == [17]
    assert token_costs(redis_client, user_id, 86_400) == [17]


def test_the_route_reads_the_body_the_estimate_read(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    body = chat_body(report=3, content="what is a token?")
    assert client.post("/json", json=body, headers=as_user(user_id)).json()["echo"] == body


def test_a_streams_final_usage_chunk_reconciles_the_reservation(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    with client.stream("POST", "/stream", json=chat_body(report=23), headers=as_user(user_id)) as response:
        assert response.headers["x-ratelimit-remaining-tokens"] == "60"  # the estimate, 40
        text = "".join(response.iter_text())
    assert text.endswith("data: [DONE]\n\n")
    assert token_costs(redis_client, user_id) == [23]


def test_a_larger_usage_charges_the_difference(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    assert client.post("/json", json=chat_body(report=90), headers=as_user(user_id)).status_code == 200
    assert token_costs(redis_client, user_id) == [90]
    response = client.post("/json", json=chat_body(report=1), headers=as_user(user_id))
    assert response.status_code == 429  # 90 used + 40 reserved > 100
    assert response.headers["X-RateLimit-Resource"] == "tokens"


def test_record_usage_reconciles_once_and_the_response_usage_is_then_ignored(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    response = client.post("/record", json=chat_body(report=7), headers=as_user(user_id))
    assert response.json()["found"] == 2  # the minute and the day token windows
    assert token_costs(redis_client, user_id) == [7]  # not the body's 57


def test_record_usage_from_inside_a_stream(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    body = chat_body(report=11)
    with client.stream("POST", "/record-stream", json=body, headers=as_user(user_id)) as response:
        assert "".join(response.iter_text()).endswith("data: [DONE]\n\n")
    assert token_costs(redis_client, user_id) == [11]


def test_record_usage_twice_is_refused(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    response = client.post("/record-twice", json=chat_body(report=0), headers=as_user(user_id))
    assert "already recorded" in response.json()["error"]
    assert token_costs(redis_client, user_id) == [5]


def test_record_usage_on_a_route_without_a_token_limit_is_an_error(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    client = client_for(TokenRateLimit(limiter=limiter))
    response = client.post("/unlimited-record", json={}, headers=as_user(user_id))
    assert "no TokenRateLimit decided this request" in response.json()["error"]


def test_record_usage_zero_removes_the_token_entry_but_not_the_request(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    client.post("/record", json=chat_body(report=0), headers=as_user(user_id))
    assert token_costs(redis_client, user_id) == []
    assert request_count(redis_client, user_id) == 1


def test_a_route_that_reports_nothing_keeps_its_reservation(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    codes = [client.post("/silent", json=chat_body(0), headers=as_user(user_id)).status_code
             for _ in range(3)]
    assert codes == [200, 200, 429]  # 40 + 40, a third 40 does not fit 100
    assert token_costs(redis_client, user_id) == [40, 40]


def test_without_the_middleware_record_usage_still_reconciles_and_a_warning_says_why(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import genai_ratelimit.fastapi._ledger as module

    monkeypatch.setattr(module, "_warned_no_token_middleware", False)
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL), middleware=False)
    with caplog.at_level(logging.WARNING, logger="genai_ratelimit"):
        client.post("/record", json=chat_body(report=9), headers=as_user(user_id))
        client.post("/json", json=chat_body(report=9), headers=as_user(user_id + "-b"))
    assert token_costs(redis_client, user_id) == [9]
    assert token_costs(redis_client, user_id + "-b") == [40]  # nobody read the response
    assert "reconciled only by record_usage" in caplog.text


# --- the estimate --------------------------------------------------------------------------


def test_the_default_estimate_of_an_openai_request() -> None:
    body = {"max_completion_tokens": 100, "max_tokens": 7, "n": 2,
            "messages": [{"role": "system", "content": "abcd" * 10},
                         {"role": "user", "content": [{"type": "text", "text": "abcdefgh"},
                                                      {"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert estimate_openai_tokens(json.dumps(body).encode(), 1000) == 200 + 12
    assert estimate_openai_tokens(json.dumps({"max_tokens": 7}).encode(), 1000) == 7
    assert estimate_openai_tokens(json.dumps({"prompt": "abcde"}).encode(), 30) == 30 + 2
    assert estimate_openai_tokens(b"not json", 30) == 30
    assert estimate_openai_tokens(b"", 30) == 30
    with pytest.raises(ValueError, match="max_tokens"):  # the route's 422 (tests/test_usage_shapes.py)
        estimate_openai_tokens(json.dumps({"max_tokens": True}).encode(), 30)


def test_a_request_without_max_tokens_reserves_the_tiers_default(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    dependency = TokenRateLimit(limiter=limiter, default_max_tokens={"free": 300, "pro": 2_000})
    client = client_for(dependency)
    client.post("/silent", json={"messages": [{"role": "user", "content": "abcd"}]}, headers=as_user(user_id))
    client.post("/silent", json={}, headers=as_user(user_id + "-pro", "pro"))
    assert token_costs(redis_client, user_id) == [301]
    assert token_costs(redis_client, user_id + "-pro") == [2_000]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_estimate_callable_replaces_the_default(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis, kind: str) -> None:
    def sync_estimate(request: Request) -> int:
        return int(request.headers["x-estimate"])

    async def async_estimate(request: Request) -> int:
        return len(await request.body())

    if kind == "sync":
        dependency = TokenRateLimit(limiter=limiter, estimate=sync_estimate)
        expected = 33
    else:
        dependency = TokenRateLimit(limiter=limiter, estimate=async_estimate)
        expected = len(json.dumps(chat_body(0)).encode())
    client = client_for(dependency)
    client.post("/silent", content=json.dumps(chat_body(0)), headers={**as_user(user_id), "x-estimate": "33"})
    assert token_costs(redis_client, user_id) == [expected]


# --- the 429s --------------------------------------------------------------------------------


def test_a_token_refusal_spends_no_request_budget_and_has_openais_headers_and_body(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    for _ in range(2):
        assert client.post("/silent", json=chat_body(0), headers=as_user(user_id)).status_code == 200
    response = client.post("/silent", json=chat_body(0), headers=as_user(user_id))
    assert response.status_code == 429
    assert request_count(redis_client, user_id) == 2
    retry = int(response.headers["Retry-After"])
    assert 1 <= retry <= 60
    exact = int(response.headers["retry-after-ms"])  # the exact wait: Retry-After rounds it up
    assert (retry - 1) * 1000 < exact <= retry * 1000
    assert response.headers["x-should-retry"] == "true"
    assert response.headers["X-RateLimit-Resource"] == "tokens"
    assert (response.headers["X-RateLimit-Limit"], response.headers["X-RateLimit-Remaining"],
            response.headers["X-RateLimit-Window"]) == ("100", "0", "minute")
    assert all(name in response.headers for name in OPENAI_SIX)
    assert response.headers["x-ratelimit-remaining-tokens"] == "0"
    assert response.headers["x-ratelimit-remaining-requests"] == "3"
    assert response.headers["x-ratelimit-reset-tokens"] == format_duration(exact)
    body = response.json()
    assert body["detail"] == "Rate limit exceeded"
    assert body["error"] == {
        "message": f"Rate limit reached on tokens per min (TPM): Limit 100, Requested 40. "
                   f"Please try again in {format_duration(exact)}.",
        "type": "tokens", "param": None, "code": "rate_limit_exceeded"}


def test_a_request_refusal_spends_no_token_budget(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    codes = [client.post("/record", json=chat_body(1), headers=as_user(user_id)).status_code
             for _ in range(5)]
    assert codes == [200] * 5
    response = client.post("/record", json=chat_body(1), headers=as_user(user_id))
    assert response.status_code == 429
    assert response.headers["X-RateLimit-Resource"] == "requests"
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert response.json()["error"]["type"] == "requests"
    assert "requests per min (RPM): Limit 5, Requested 1" in response.json()["error"]["message"]
    assert token_costs(redis_client, user_id) == [1] * 5


def test_an_estimate_above_the_token_limit_never_fits_and_has_no_retry_after(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    response = client.post("/silent", json=chat_body(0, max_tokens=150), headers=as_user(user_id))
    assert response.status_code == 429
    assert "Retry-After" not in response.headers
    assert "retry-after-ms" not in response.headers
    assert response.headers["x-should-retry"] == "false"
    assert response.headers["x-ratelimit-limit-tokens"] == "100"
    body = response.json()
    assert body["detail"] == ("Request too large: 150 tokens requested, the limit is 100 tokens per "
                              "minute; it can never be allowed")
    assert body["error"]["type"] == "tokens"
    assert "Limit 100, Requested 150" in body["error"]["message"]
    assert redis_client.keys("*") == []


def test_tokens_and_requests_count_per_tier(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    client = client_for(TokenRateLimit(limiter=limiter))
    response = client.post("/silent", json=chat_body(0, max_tokens=10), headers=as_user(user_id, "pro"))
    assert response.headers["x-ratelimit-limit-requests"] == str(TIER_LIMITS["pro"]["per_minute"])
    assert response.headers["x-ratelimit-limit-tokens"] == str(TIER_TOKEN_LIMITS["pro"]["per_minute"])
    left = TIER_TOKEN_LIMITS["pro"]["per_minute"] - 10
    assert response.headers["x-ratelimit-remaining-tokens"] == str(left)


def test_a_rate_limit_beside_a_token_rate_limit_counts_the_request_once(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    token_limit = TokenRateLimit(limiter=limiter, token_limits=SMALL, namespace="shared")
    client = client_for(token_limit, extra=(RateLimit(limiter=limiter, namespace="shared"),))
    codes = [client.post("/record", json=chat_body(1), headers=as_user(user_id)).status_code
             for _ in range(6)]
    assert codes == [200] * 5 + [429]
    assert redis_client.zcard(f"ratelimit:ns:shared:{user_id}:60") == 5


def test_a_token_rate_limit_after_a_rate_limit_reserves_only_tokens(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    token_limit = TokenRateLimit(limiter=limiter, token_limits=SMALL, namespace="shared")
    client = client_for(RateLimit(limiter=limiter, namespace="shared"), extra=(token_limit,))
    responses = [client.post("/record", json=chat_body(2), headers=as_user(user_id)) for _ in range(6)]
    assert [r.status_code for r in responses] == [200] * 5 + [429]
    assert responses[0].headers["x-ratelimit-remaining-requests"] == "4"
    assert responses[0].headers["x-ratelimit-remaining-tokens"] == "60"
    assert request_count(redis_client, user_id) == 5
    assert token_costs(redis_client, user_id) == [2] * 5
    assert responses[-1].json()["error"]["type"] == "requests"  # RateLimit's own 429


def test_the_kill_switch_reserves_nothing(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "1")
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    for _ in range(4):
        response = client.post("/record", json=chat_body(3), headers=as_user(user_id))
        assert response.status_code == 200
        assert response.json()["found"] == 0
    assert redis_client.keys("*") == []


def test_redis_down_answers_503(make_limiter: LimiterFactory, client_for: Callable[..., TestClient],
                                user_id: str) -> None:
    down = make_limiter.native(f"redis://127.0.0.1:{free_port()}/0", connect_timeout=0.5, socket_timeout=0.5)
    client = client_for(TokenRateLimit(limiter=down))
    response = client.post("/json", json=chat_body(3), headers=as_user(user_id))
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"


def test_a_custom_token_budget_counts_in_the_plain_keys(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    """A budget's keys never depend on its numbers: an edit keeps every count."""
    client = client_for(TokenRateLimit(limiter=limiter, token_limits=SMALL))
    client.post("/silent", json=chat_body(0), headers=as_user(user_id))
    windows = {k.decode() for k in redis_client.keys(f"ratelimit:{user_id}:*")
               if not k.endswith((b":w", b":t"))}
    assert windows == {f"ratelimit:{user_id}:60", f"ratelimit:{user_id}:86400",
                       f"ratelimit:{user_id}:60:tokens", f"ratelimit:{user_id}:86400:tokens"}
    assert TokenRateLimit(limiter=limiter, token_limits=SMALL).namespace is None


def test_bad_arguments_fail_when_the_dependency_is_built(limiter: AnyLimiter) -> None:
    with pytest.raises(TypeError, match="estimate must be a callable"):
        TokenRateLimit(limiter=limiter, estimate=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="default_max_tokens must be >= 1"):
        TokenRateLimit(limiter=limiter, default_max_tokens=0)
    with pytest.raises(ValueError, match="per_day"):
        TokenRateLimit(limiter=limiter, token_limits={"free": {"per_minute": 10, "per_day": 1}})
    with pytest.raises(TypeError, match="reserve"):
        TokenRateLimit(limiter=object())  # type: ignore[arg-type]


# --- pure pieces ------------------------------------------------------------------------------


@pytest.mark.parametrize("milliseconds,text", [
    (0, "0s"), (120, "120ms"), (1000, "1s"), (1500, "1.5s"), (60_000, "1m0s"), (360_000, "6m0s"),
    (3_723_000, "1h2m3s"), (86_400_000, "24h0m0s"), (61_250, "1m1.25s"),
])
def test_durations_are_written_as_openai_writes_them(milliseconds: int, text: str) -> None:
    assert format_duration(milliseconds) == text


def test_the_stream_scanner_keeps_the_last_usage_and_stops_at_done() -> None:
    scanner = UsageScanner("sse")
    stream = (b'data: {"usage": {"total_tokens": 3}}\r\n\r\n'
              b'data: {"choices": [], "usage": {"total_tokens": 12}}\n\ndata: [DONE]\n\n')
    for start in range(0, len(stream), 7):  # arbitrary chunk boundaries
        scanner.feed(stream[start:start + 7])
    assert scanner.done
    assert scanner.total_tokens() == 12
    assert UsageScanner.for_response("text/event-stream; charset=utf-8") is not None
    assert UsageScanner.for_response("application/json", "gzip") is None
    assert UsageScanner.for_response("text/plain") is None


def test_the_scanners_keep_only_what_they_need() -> None:
    from genai_ratelimit.fastapi import _usage

    json_scanner = UsageScanner("json")
    json_scanner.feed(b'{"usage": {"total_tokens": 5}, "pad": "' + b"x" * _usage.MAX_JSON_BYTES + b'"}')
    assert json_scanner.total_tokens() is None  # too large to read: the reservation stays
    sse = UsageScanner("sse")
    sse.feed(b"data: " + b"x" * (_usage.MAX_EVENT_BYTES + 1))  # an endless line is dropped...
    sse.feed(b'more"usage"\ndata: {"usage": {"total_tokens": 3}}\n\n')  # ...with its event
    sse.feed(b'data: {"usage": {"total_tokens": 4}}')
    assert sse.total_tokens() == 4  # a last event without its blank line still counts
    assert not sse.done
