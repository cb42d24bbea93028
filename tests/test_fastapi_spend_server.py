"""Issue 33's LiteLLM scenario, exact, under a real uvicorn with the real openai SDK: a $0.45
key, 5 concurrent requests each with a $0.15 worst case and a $0.12 actual cost. The fake
upstream (the served route) answers only when the test opens its gate, so the requests stay
in flight while they hold. Never more held + spent than $0.45 at any sampled instant, 3
admitted at first (the others get the in_flight 429, which the SDK retries), and once those
settle the others are refused until the day resets (x-should-retry: false: the SDK raises);
the final spend is the sum of the actual costs. Once with a blocking RateLimiter (in the
threadpool), once with an AsyncRateLimiter."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import openai
import pytest
import redis

from helpers_uvicorn import HTTPX_SOCKETS, UvicornServer

pytestmark = [
    HTTPX_SOCKETS,
    pytest.mark.not_asan(reason="its limiters run in a uvicorn server process"),
    pytest.mark.no_hiredis1(reason="its limiters run in uvicorn server processes"),
]

SERVED = '''
import asyncio
import os

import redis.asyncio
from fastapi import Depends, FastAPI, Request

from genai_ratelimit import AsyncRateLimiter, PriceTable, RateLimiter
from genai_ratelimit.fastapi import RateLimitHeadersMiddleware, TokenRateLimit

# $0 per input token, $0.001 per output token: 150 output tokens are $0.15.
prices = PriceTable.from_mapping({"version": "test", "currency": "USD",
                                  "models": {"m": {"input": 0, "output": 1_000_000_000}}})
limiter = RateLimiter() if os.environ["LIMITER"] == "sync" else AsyncRateLimiter()
spend = TokenRateLimit(limiter, identify=lambda request: ("key-045", "free"),
                       token_limits={"free": {"per_minute": 1_000_000, "per_day": 10_000_000}},
                       tier_limits={"free": {"per_minute": 1_000, "per_day": 10_000}},
                       prices=prices, spend_limits={"free": {"daily_usd": "0.45"}})
gate = redis.asyncio.Redis.from_url(os.environ["REDIS_URL"])

app = FastAPI()
app.add_middleware(RateLimitHeadersMiddleware)


@app.get("/healthz")
async def healthz():
    return {"ok": True}


@app.post("/v1/chat/completions", dependencies=[Depends(spend)])
async def chat(request: Request):
    while not await gate.get("gate"):  # the fake upstream answers when the test says so
        await asyncio.sleep(0.01)
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 120, "total_tokens": 123}}
'''


@pytest.fixture(params=["sync", "async"])
def served(request: pytest.FixtureRequest, redis_url: str,
           redis_client: redis.Redis) -> Iterator[UvicornServer]:
    server = UvicornServer(SERVED, {"REDIS_URL": redis_url, "LIMITER": request.param,
                                    "GENAI_RATELIMIT_TIERS": "", "RATE_LIMIT_DISABLED": ""})
    server.start()
    try:
        yield server
    finally:
        server.close()


def budget_of(redis_client: redis.Redis) -> tuple[int, int]:
    keys = redis_client.keys("ratelimit:key-045:*:budget=daily_usd")
    if not keys:
        return 0, 0
    fields = redis_client.hgetall(keys[0])
    return int(fields.get(b"spent", 0)), int(fields.get(b"held", 0))


def test_five_concurrent_requests_never_spend_more_than_the_cap(
        served: UvicornServer, redis_client: redis.Redis) -> None:
    results: list[object] = [None] * 5
    start = threading.Barrier(5)

    def ask(index: int) -> None:
        client = openai.OpenAI(api_key="k", base_url=served.base_url + "/v1", max_retries=20,
                               timeout=30.0)
        start.wait()
        try:
            results[index] = client.chat.completions.create(
                model="m", max_tokens=150, messages=[{"role": "user", "content": "hi"}])
        except openai.RateLimitError as error:
            results[index] = error
        finally:
            client.close()

    samples: list[tuple[int, int]] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            samples.append(budget_of(redis_client))

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=ask, args=(index,)) for index in range(5)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20
    while budget_of(redis_client) != (0, 450_000):  # 3 admitted, each holding $0.15
        assert time.monotonic() < deadline, f"never 3 in flight: {budget_of(redis_client)}"
    redis_client.set("gate", 1)  # the upstream answers
    for thread in threads:
        thread.join(60)
    sampling.set()
    sampler.join()
    admitted = [r for r in results if not isinstance(r, openai.RateLimitError)]
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(admitted) == 3 and len(refused) == 2
    for error in refused:  # refused once the settlements left $0.09: until the day resets
        assert error.response.headers["x-should-retry"] == "false"
        assert error.body["code"] == "insufficient_quota"  # type: ignore[index]
        assert error.response.json()["budget"]["reason"] == "until_reset"
    assert budget_of(redis_client) == (3 * 120_000, 0)  # the sum of the actual costs
    assert max(spent + held for spent, held in samples) <= 450_000
    assert (0, 450_000) in samples
