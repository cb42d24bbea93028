"""The example service (examples/app.py) under a real uvicorn on loopback, driven by a real
HTTP client (httpx): the 429 path, the headers of streamed and JSON responses as they arrive
on the wire, tiers, identity, and start-up with a broken tiers file or Redis down.

Every test runs once per limiter kind (tests/conftest.py): with the example's limiter forced
to a blocking RateLimiter (the dependency runs in FastAPI's threadpool, uvicorn picks its
loop), and to an AsyncRateLimiter awaited on uvicorn's loop, `--loop asyncio` or
`--loop uvloop`. See SERVED_MODULE."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from genai_ratelimit import TIER_LIMITS
from helpers_async import loop_factory_of
from helpers_uvicorn import HTTPX_SOCKETS, UvicornServer
from redis_server import free_port

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    HTTPX_SOCKETS,
    pytest.mark.not_asan(reason="its limiters run in uvicorn server processes, which this process's ASan "
                                "does not reach"),
    pytest.mark.no_hiredis1(reason="its limiters run in uvicorn server processes, on the codec and pipeline"
                                   " the async tests drive on hiredis 1.x"),
]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
KEYS = {"free": "sk-demo-free", "pro": "sk-demo-pro", "enterprise": "sk-demo-enterprise"}
USERS = {"free": "user_free", "pro": "user_pro", "enterprise": "user_enterprise"}
CHAT = "/v1/chat/completions"
ALL_FOUR = ("Retry-After", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Window")
# Per limiter kind: the class the example's limiter is forced to, and uvicorn's --loop
# (None: uvicorn's default, "auto").
LIMITER_CLASSES = {"sync": "RateLimiter", "asyncio": "AsyncRateLimiter", "uvloop": "AsyncRateLimiter"}
UVICORN_LOOPS = {"sync": None, "asyncio": "asyncio", "uvloop": "uvloop"}

# What uvicorn serves: examples/app.py itself, imported after both limiter names of
# genai_ratelimit were pointed at the class under test, so whichever one app.py builds is of
# that class. It checks that the served dependency really holds one and says so in the log.
# GET /served-loop (added here, not limited) names the module of the loop serving requests.
SERVED_MODULE = """
import asyncio
import sys
sys.path.insert(0, {examples!r})
import genai_ratelimit
genai_ratelimit.RateLimiter = genai_ratelimit.AsyncRateLimiter = getattr(genai_ratelimit, {cls!r})
import app as example
app = example.app
kind = type(example.rate_limit.limiter).__name__
if kind != {cls!r}:
    raise SystemExit(f"examples/app.py serves a {{kind}}, not the {cls} under test")

@app.get("/served-loop")
async def served_loop():
    return {{"module": type(asyncio.get_running_loop()).__module__}}

# For the identity tests: a user whose id reads like the anonymous key of 127.0.0.1, and
# routes behind two RateLimit dependencies on the example's limiter: one with the same
# budget as the example's, one with a stricter budget in a namespace of its own.
from fastapi import Depends
from genai_ratelimit.fastapi import RateLimit
example.API_KEYS["sk-test-address-like"] = ("ip:127.0.0.1", "free")
STRICT = {{"free": {{"per_minute": 3, "per_day": 10}}}}

@app.post("/v1/twice-limited", dependencies=[Depends(example.rate_limit),
                                             Depends(RateLimit(limiter=example.rate_limit.limiter))])
async def twice_limited():
    return {{}}

@app.post("/v1/strictly-limited", dependencies=[
    Depends(example.rate_limit), Depends(RateLimit(limiter=example.rate_limit.limiter, tier_limits=STRICT,
                                                   namespace="strict"))])
async def strictly_limited():
    return {{}}

# Shadow mode: the stricter budget rolled out without refusing; /shadow-count reads its counter.
SHADOW = RateLimit(limiter=example.rate_limit.limiter, tier_limits=STRICT, mode="shadow",
                   shadow_log_interval=0, headers="ietf", partition_key_secret="served")

@app.post("/v1/shadow-limited", dependencies=[Depends(SHADOW)])
async def shadow_limited():
    return {{"ran": True}}

@app.get("/shadow-count")
async def shadow_count():
    return {{"count": SHADOW.shadow_count}}

print(f"serving examples/app.py with a {{kind}}", flush=True)
"""


class UvicornApp(UvicornServer):
    """examples/app.py served by `python -m uvicorn` in a subprocess on a free loopback port
    (helpers_uvicorn.UvicornServer), with the limiter class and loop of a limiter kind."""

    def __init__(self, env: dict[str, str], limiter_kind: str) -> None:
        self.limiter_class = LIMITER_CLASSES[limiter_kind]
        super().__init__(SERVED_MODULE.format(examples=str(EXAMPLES), cls=self.limiter_class),
                         env, loop=UVICORN_LOOPS[limiter_kind])

    def start(self, timeout: float = 30.0) -> None:
        super().start(timeout)
        assert f"serving examples/app.py with a {self.limiter_class}" in self.log()
        if self.loop is not None:
            served = httpx.get(self.base_url + "/served-loop", timeout=1.0).json()
            assert served["module"].split(".")[0] == self.loop, served


def clean_env(**env: str) -> dict[str, str]:
    base = {"GENAI_RATELIMIT_TIERS": "", "RATE_LIMIT_DISABLED": "", "EXAMPLE_KEY_PREFIX": "ratelimit"}
    return {**base, **env}


@pytest.fixture(scope="module")
def limiter_kind(request: pytest.FixtureRequest) -> str:
    """conftest's limiter_kind (the same parameters), scoped to the module: one served app
    per kind serves all of its tests."""
    kind: str = request.param
    loop_factory_of(kind)  # fails the uvloop case that GENAI_RATELIMIT_REQUIRE_UVLOOP kept
    return kind


@pytest.fixture(scope="module")
def served(redis_url: str, limiter_kind: str) -> Iterator[UvicornApp]:
    server = UvicornApp(clean_env(REDIS_URL=redis_url), limiter_kind)
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def http(served: UvicornApp, redis_client: redis.Redis) -> Iterator[httpx.Client]:
    """A client of the served app, on a Redis database flushed for this test."""
    with httpx.Client(base_url=served.base_url, timeout=10.0) as client:
        yield client


def chat(http: httpx.Client, tier: str | None, *, stream: bool = True,
         headers: dict[str, str] | None = None, params: dict[str, str] | None = None) -> httpx.Response:
    """One chat completion as the user of `tier` (None: anonymous), read in full."""
    headers = dict(headers or {})
    if tier is not None:
        headers["Authorization"] = f"Bearer {KEYS[tier]}"
    body = {"messages": [{"role": "user", "content": "hello"}], "stream": stream}
    return http.post(CHAT, json=body, headers=headers, params=params)


# --- the 429 path and the headers on the wire ---------------------------------------------


def test_sixth_free_request_gets_429_with_all_four_headers_over_http(http: httpx.Client) -> None:
    started = time.monotonic()
    remaining = []
    for _ in range(5):
        response = chat(http, "free")
        assert response.status_code == 200
        remaining.append(response.headers["X-RateLimit-Remaining"])
    assert remaining == ["4", "3", "2", "1", "0"]
    response = chat(http, "free")
    elapsed = time.monotonic() - started
    assert response.status_code == 429
    assert response.json()["detail"] == "Rate limit exceeded"
    assert response.json()["error"]["type"] == "requests"  # the example's TokenRateLimit
    assert all(name in response.headers for name in ALL_FOUR)
    # The first request leaves the minute 60 s after it was counted, at most `elapsed` ago.
    assert math.ceil(60 - elapsed) <= int(response.headers["Retry-After"]) <= 60
    assert (response.headers["X-RateLimit-Limit"], response.headers["X-RateLimit-Remaining"],
            response.headers["X-RateLimit-Window"]) == ("5", "0", "minute")


def test_streamed_response_carries_the_headers_before_its_body(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "stream please"}], "stream": True}
    with http.stream("POST", CHAT, json=body, headers={"Authorization": f"Bearer {KEYS['pro']}"}) as response:
        # Headers are read when the response starts, before any of the stream is consumed.
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["X-RateLimit-Limit"] == "60"
        assert response.headers["X-RateLimit-Remaining"] == "59"
        assert response.headers["X-RateLimit-Window"] == "minute"
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event[len("data: "):]) for event in events[:-1]]
    assert len(chunks) > 3
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)


def test_json_response_carries_the_headers(http: httpx.Client) -> None:
    response = chat(http, "enterprise", stream=False)
    assert response.status_code == 200
    assert response.json()["object"] == "chat.completion"
    assert response.headers["X-RateLimit-Limit"] == "600"
    assert response.headers["X-RateLimit-Remaining"] == "599"
    assert response.headers["X-RateLimit-Window"] == "minute"


@pytest.mark.parametrize("tier", ["free", "pro", "enterprise"])
def test_each_tier_gets_its_per_minute_budget_over_http(http: httpx.Client, tier: str) -> None:
    budget = TIER_LIMITS[tier]["per_minute"]
    codes = [chat(http, tier, stream=False).status_code for _ in range(budget + 1)]
    assert codes == [200] * budget + [429]


def test_tier_in_query_or_forged_headers_does_not_raise_the_budget_over_http(http: httpx.Client) -> None:
    forged = {"X-Tier": "enterprise", "X-RateLimit-Tier": "enterprise", "X-User-Id": "someone-else"}
    codes = [chat(http, "free", params={"tier": "enterprise"}, headers=forged).status_code for _ in range(6)]
    assert codes == [200] * 5 + [429]


def test_day_window_trips_with_window_day_over_http(http: httpx.Client, redis_client: redis.Redis) -> None:
    seconds, micros = redis_client.time()
    now = seconds * 1000 + micros // 1000
    redis_client.zadd("ratelimit:user_free:86400", {f"old-{i}": now - 3 * 3_600_000 + i for i in range(100)})
    response = chat(http, "free")
    assert response.status_code == 429
    assert response.headers["X-RateLimit-Window"] == "day"
    assert response.headers["X-RateLimit-Limit"] == "100"
    assert 21 * 3600 - 5 <= int(response.headers["Retry-After"]) <= 21 * 3600


# --- identity ------------------------------------------------------------------------------


def test_anonymous_requests_are_limited_by_client_address(
        http: httpx.Client, redis_client: redis.Redis) -> None:
    # --no-proxy-headers: a forged X-Forwarded-For does not buy a fresh budget.
    codes = [chat(http, None, headers={"X-Forwarded-For": f"203.0.113.{n}"}).status_code for n in range(6)]
    assert codes == [200] * 5 + [429]
    assert redis_client.zcard("ratelimit:ip:127.0.0.1:60") == 5


def test_a_user_whose_id_reads_like_an_address_has_a_budget_of_their_own_over_http(
        http: httpx.Client, redis_client: redis.Redis) -> None:
    assert [chat(http, None).status_code for _ in range(6)] == [200] * 5 + [429]
    response = chat(http, None, headers={"Authorization": "Bearer sk-test-address-like"})
    assert response.status_code == 200
    assert response.headers["X-RateLimit-Remaining"] == "4"
    assert redis_client.zcard("ratelimit:ip:127.0.0.1:60") == 5
    assert redis_client.zcard("ratelimit:user:ip:127.0.0.1:60") == 1


def test_two_dependencies_with_one_budget_count_each_request_once_over_http(
        http: httpx.Client, redis_client: redis.Redis) -> None:
    headers = {"Authorization": f"Bearer {KEYS['free']}"}
    codes = [http.post("/v1/twice-limited", headers=headers).status_code for _ in range(6)]
    assert codes == [200] * 5 + [429]
    assert redis_client.zcard("ratelimit:user_free:60") == 5


def test_a_stricter_second_dependency_counts_in_its_own_namespace_over_http(
        http: httpx.Client, redis_client: redis.Redis) -> None:
    headers = {"Authorization": f"Bearer {KEYS['free']}"}
    responses = [http.post("/v1/strictly-limited", headers=headers) for _ in range(4)]
    assert [r.status_code for r in responses] == [200] * 3 + [429]
    assert responses[-1].headers["X-RateLimit-Limit"] == "3"
    assert redis_client.zcard("ratelimit:user_free:60") == 4
    assert redis_client.zcard("ratelimit:ns:strict:user_free:60") == 3


def test_shadow_mode_refuses_nothing_and_its_counter_and_log_say_what_it_would_have_over_http(
        http: httpx.Client, served: UvicornApp, redis_client: redis.Redis) -> None:
    start = http.get("/shadow-count").json()["count"]  # the served app lives for the module
    headers = {"Authorization": f"Bearer {KEYS['free']}"}
    responses = [http.post("/v1/shadow-limited", headers=headers) for _ in range(5)]
    assert [(r.status_code, r.json()) for r in responses] == [(200, {"ran": True})] * 5
    assert [r.headers.get("X-RateLimit-Shadow") for r in responses] == [None] * 3 + ["would-refuse"] * 2
    assert all("Retry-After" not in r.headers for r in responses)
    # The verdict only in X-RateLimit-Shadow-* (no enforced budget on this route).
    assert responses[-1].headers["X-RateLimit-Shadow-Remaining"] == "0"
    assert "X-RateLimit-Remaining" not in responses[-1].headers
    assert "RateLimit" not in responses[-1].headers
    assert http.get("/shadow-count").json()["count"] - start == 2
    (shadow_key,) = redis_client.keys("ratelimit:shadow:*user_free:60")
    assert redis_client.zcard(shadow_key) == 3  # what it refused was not logged in its window
    def logged() -> list[str]:
        return [line for line in served.log().splitlines() if "shadow mode:" in line]

    deadline = time.monotonic() + 10  # the server process writes its log: wait for both lines
    while len(logged()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = logged()
    assert len(lines) == 2 and all(":user_free';" in line for line in lines), served.log()[-2000:]
    assert "1 request(s) the budget would have refused were let through" in lines[-1]
    assert "Limit 3" in lines[-1]


def test_invalid_api_key_is_401_and_not_counted(http: httpx.Client, redis_client: redis.Redis) -> None:
    response = chat(http, None, headers={"Authorization": "Bearer sk-wrong"})
    assert response.status_code == 401
    assert redis_client.keys("*") == []


def test_health_route_is_not_limited(http: httpx.Client, redis_client: redis.Redis) -> None:
    for _ in range(20):
        response = http.get("/healthz")
        assert response.status_code == 200
        assert "X-RateLimit-Remaining" not in response.headers
    assert redis_client.keys("*") == []


def scraped(http: httpx.Client) -> dict[str, float]:
    """GET /metrics: the value of every sample of the example's limiter, by its text."""
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in response.text.splitlines():
        if line.startswith("genai_ratelimit_") and 'limiter="chat"' in line:
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_metrics_route_counts_the_decisions_it_served(http: httpx.Client,
                                                      redis_client: redis.Redis) -> None:
    allowed = 'genai_ratelimit_decisions_total{limiter="chat",outcome="allowed"}'
    refused = ('genai_ratelimit_rejections_total{limiter="chat",resource="requests",'
               'scope="user",window_seconds="60"}')
    round_trips = 'genai_ratelimit_redis_latency_seconds_count{limiter="chat",op="reserve"}'
    before = scraped(http)
    statuses = [chat(http, "free", stream=False).status_code for _ in range(6)]
    after = scraped(http)
    assert statuses == [200] * 5 + [429]
    assert after[allowed] - before[allowed] == 5
    assert after[refused] - before.get(refused, 0) == 1
    assert after[round_trips] - before.get(round_trips, 0) == 6
    assert "X-RateLimit-Remaining" not in http.get("/metrics").headers, "not limited"


# --- start-up and Redis down -----------------------------------------------------------------


def test_tiers_file_is_honoured_by_the_served_app(redis_url: str, redis_client: redis.Redis,
                                                  tmp_path: Path, limiter_kind: str) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text("[free]\nper_minute = 2\nper_day = 20\n", encoding="utf-8")
    server = UvicornApp(clean_env(REDIS_URL=redis_url, GENAI_RATELIMIT_TIERS=str(tiers)), limiter_kind)
    server.start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=10.0) as client:
            responses = [chat(client, "pro") for _ in range(3)]  # pro is not in the file: free's budget
        assert [r.status_code for r in responses] == [200, 200, 429]
        assert responses[-1].headers["X-RateLimit-Limit"] == "2"
    finally:
        server.close()


def test_malformed_tiers_file_stops_the_server_at_start_up(redis_url: str, tmp_path: Path,
                                                          limiter_kind: str) -> None:
    tiers = tmp_path / "tiers.json"
    tiers.write_text('{"free": {"per_minute": 5, "per_day": "lots"}}', encoding="utf-8")
    server = UvicornApp(clean_env(REDIS_URL=redis_url, GENAI_RATELIMIT_TIERS=str(tiers)), limiter_kind)
    try:
        process = server.spawn()
        assert process.wait(60) != 0
        log = server.log()
        assert f"GENAI_RATELIMIT_TIERS={tiers}" in log
        assert "tier 'free': per_day must be an integer >= 1, got str 'lots'" in log
    finally:
        server.close()


def test_redis_down_answers_503_with_retry_after_1_over_http(limiter_kind: str) -> None:
    server = UvicornApp(clean_env(REDIS_URL=f"redis://127.0.0.1:{free_port()}/0"), limiter_kind)
    server.start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=10.0) as client:
            for stream in (True, False):
                response = chat(client, "pro", stream=stream)
                assert response.status_code == 503
                assert response.json()["detail"] == "Rate limiter unavailable"
                assert response.headers["Retry-After"] == "1"
            assert client.get("/healthz").status_code == 200
    finally:
        server.close()
