"""The example service (examples/app.py, a TokenRateLimit on its chat route) under a real
uvicorn, driven by the `openai` SDK itself (max_retries=0): a token budget running out
raises openai.RateLimitError carrying our message and headers; a streamed completion is
reconciled from its final usage chunk, or by the route's own record_usage; a JSON answer
from its usage; a request that can never fit has no Retry-After; a route that reports
nothing keeps its estimate. The token windows are read back from Redis.

One served app per limiter kind, as in test_fastapi_server.py."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from genai_ratelimit import TIER_LIMITS, TIER_TOKEN_LIMITS
from genai_ratelimit.fastapi._openai_headers import format_duration
from helpers_async import loop_factory_of
from helpers_uvicorn import HTTPX_SOCKETS
from test_fastapi_server import KEYS, UvicornApp, clean_env

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    HTTPX_SOCKETS,
    pytest.mark.not_asan(reason="its limiters run in a uvicorn server process (the SDK is the client), "
                                "which this process's ASan does not reach"),
    pytest.mark.no_hiredis1(reason="its limiters run in uvicorn server processes, on the codec and pipeline"
                                   " the async tests drive on hiredis 1.x"),
]

FREE_TOKENS = TIER_TOKEN_LIMITS["free"]["per_minute"]
FREE_REQUESTS = TIER_LIMITS["free"]["per_minute"]
# The example's short answer when no max_tokens is asked: 11 words, one token each.
SHORT_ANSWER_TOKENS = 11

# A route of the example's dependency that reports no usage at all.
SILENT_ROUTE = """

@app.post("/v1/silent", dependencies=[Depends(example.rate_limit)])
async def silent():
    return {"answer": "no usage reported"}
"""


@pytest.fixture(scope="module")
def limiter_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    loop_factory_of(kind)
    return kind


@pytest.fixture(scope="module")
def served(redis_url: str, limiter_kind: str) -> Iterator[UvicornApp]:
    server = UvicornApp(clean_env(REDIS_URL=redis_url), limiter_kind)
    module = server.directory / "served_app.py"
    module.write_text(module.read_text(encoding="utf-8") + SILENT_ROUTE, encoding="utf-8")
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def sdk(served: UvicornApp, redis_client: redis.Redis) -> Iterator[openai.OpenAI]:
    """The openai SDK as the free user, on a Redis database flushed for this test."""
    client = openai.OpenAI(api_key=KEYS["free"], base_url=served.base_url + "/v1", max_retries=0,
                           timeout=10.0)
    try:
        yield client
    finally:
        client.close()


def entry_costs(redis_client: redis.Redis, window: int = 60) -> list[int]:
    """The cost of each entry of the free user's token window, read back from Redis."""
    key = f"ratelimit:user_free:{window}:tokens"
    weights = redis_client.hgetall(key + ":w")
    return [int(weights.get(member, 1)) for member in redis_client.zrange(key, 0, -1)]


MESSAGES = [{"role": "user", "content": "Tell me about rate limits."}]  # 26 characters: 7 tokens
PROMPT_TOKENS = math.ceil(len(MESSAGES[0]["content"]) / 4)


def test_a_token_budget_running_out_raises_rate_limit_error_with_our_message_and_headers(
        sdk: openai.OpenAI, redis_client: redis.Redis) -> None:
    started = time.monotonic()
    spent = 0
    for _ in range(3):  # 3 x 3,007 tokens of 10,000; the fourth does not fit, 2 requests would
        completion = sdk.chat.completions.create(model="demo-1", messages=MESSAGES,  # type: ignore[arg-type]
                                                 max_tokens=3000, stream=False)
        assert completion.usage is not None
        spent += completion.usage.total_tokens
    assert spent == 3 * (3000 + PROMPT_TOKENS)
    with pytest.raises(openai.RateLimitError) as caught:
        sdk.chat.completions.create(model="demo-1", messages=MESSAGES,  # type: ignore[arg-type]
                                    max_tokens=3000, stream=False)
    elapsed_ms = (time.monotonic() - started) * 1000
    error = caught.value
    headers = error.response.headers
    retry = int(headers["retry-after"])
    exact = int(headers["retry-after-ms"])  # the exact wait: Retry-After rounds it up
    # The fourth fits once the first reservation, made at most `elapsed_ms` before the
    # refusal, leaves the minute: 60 s after it was counted.
    assert 60_000 - elapsed_ms <= exact <= 60_000
    assert retry == math.ceil(exact / 1000)
    ours = (f"Rate limit reached on tokens per min (TPM): Limit {FREE_TOKENS}, "
            f"Requested {3000 + PROMPT_TOKENS}. Please try again in {format_duration(exact)}.")
    # openai >= 2 writes "Error code: 429 - <error.message>"; 1.x the body's repr around it.
    assert ours in error.message
    assert isinstance(error.body, dict) and error.body["message"] == ours
    assert (error.type, error.code) == ("tokens", "rate_limit_exceeded")
    assert headers["x-ratelimit-limit-tokens"] == str(FREE_TOKENS)
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-reset-tokens"] == format_duration(exact)
    assert headers["x-ratelimit-limit-requests"] == str(FREE_REQUESTS)
    assert headers["x-ratelimit-remaining-requests"] == str(FREE_REQUESTS - 3)
    assert headers["x-ratelimit-reset-requests"] == format_duration(exact)
    assert (headers["x-ratelimit-window"], headers["x-ratelimit-resource"]) == ("minute", "tokens")
    assert redis_client.zcard("ratelimit:user_free:60") == 3  # the refusal spent no request


def test_a_streamed_completion_is_reconciled_from_its_final_usage_chunk(
        sdk: openai.OpenAI, redis_client: redis.Redis) -> None:
    raw = sdk.chat.completions.with_raw_response.create(
        model="demo-1", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True})
    # reserved: the default 1,000 completion tokens + the prompt
    assert raw.headers["x-ratelimit-remaining-tokens"] == str(FREE_TOKENS - 1000 - PROMPT_TOKENS)
    assert raw.headers["x-ratelimit-reset-tokens"] == "1m0s"
    chunks = list(raw.parse())
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.total_tokens == SHORT_ANSWER_TOKENS + PROMPT_TOKENS
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]).startswith("You said 26")
    assert entry_costs(redis_client) == [usage.total_tokens]
    assert entry_costs(redis_client, 86_400) == [usage.total_tokens]


def test_a_stream_without_a_usage_chunk_is_reconciled_by_the_routes_record_usage(
        sdk: openai.OpenAI, redis_client: redis.Redis) -> None:
    stream = sdk.chat.completions.create(model="demo-1", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    chunks = list(stream)
    assert all(chunk.usage is None for chunk in chunks)
    assert entry_costs(redis_client) == [SHORT_ANSWER_TOKENS + PROMPT_TOKENS]


def test_a_json_completion_is_reconciled_from_its_usage(
        sdk: openai.OpenAI, redis_client: redis.Redis) -> None:
    completion = sdk.chat.completions.create(model="demo-1", messages=MESSAGES,  # type: ignore[arg-type]
                                             stream=False)  # the example streams by default
    assert completion.usage is not None
    assert entry_costs(redis_client) == [completion.usage.total_tokens]
    assert completion.usage.total_tokens == SHORT_ANSWER_TOKENS + PROMPT_TOKENS


def test_a_request_that_can_never_fit_has_no_retry_after(
        sdk: openai.OpenAI, redis_client: redis.Redis) -> None:
    with pytest.raises(openai.RateLimitError) as caught:
        sdk.chat.completions.create(model="demo-1", messages=MESSAGES,  # type: ignore[arg-type]
                                    max_tokens=20_000, stream=False)
    headers = caught.value.response.headers
    assert "retry-after" not in headers and "retry-after-ms" not in headers
    assert headers["x-should-retry"] == "false"
    requested = 20_000 + PROMPT_TOKENS
    assert (f"Request too large on tokens per min (TPM): Limit {FREE_TOKENS}, "
            f"Requested {requested}. This request can never fit") in caught.value.message
    body = caught.value.response.json()
    assert body["detail"] == (f"Request too large: {requested} tokens requested, the limit is "
                              f"{FREE_TOKENS} tokens per minute; it can never be allowed")
    assert redis_client.keys("*") == []


def test_a_route_that_reports_nothing_keeps_its_estimate(
        served: UvicornApp, redis_client: redis.Redis) -> None:
    body = {"model": "demo-1", "messages": MESSAGES, "max_tokens": 123}
    response = httpx.post(served.base_url + "/v1/silent", json=body, timeout=10.0,
                          headers={"Authorization": f"Bearer {KEYS['free']}"})
    assert response.status_code == 200
    assert entry_costs(redis_client) == [123 + PROMPT_TOKENS]
