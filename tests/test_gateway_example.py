"""examples/gateway/ end to end: app.py under uvicorn with 2 workers, forwarding to
examples/gateway/fake_upstream.py, a real HTTP server in a process of its own (uvicorn, one
worker, which records what it answered: GET /report), limited on the session's redis-server
with the example's own tiers file. The clients are the real openai and anthropic SDKs.

- usage reconciled exactly: every request, streamed or not, over the three APIs, is charged
  in the token windows the usage the upstream reported for it (entry by entry), and a chat
  stream the client never asked usage of was made to carry it;
- the gateway's 429 reaches each SDK (its request budget, then a request too large for the
  token budget), and the upstream never sees a refused request;
- a client that disconnects mid-stream leaks nothing: the upstream sees its connection
  closed, and no in-flight slot is left (the tier's max_in_flight admits new streams); one
  that leaves while a JSON answer is awaited closes the upstream request too;
- the upstream's status, headers and body pass through, but for the limiter's headers, and
  an upstream error charges no tokens; forward_to_upstream, in process, sends the client's
  headers but the hop-by-hop ones and those it is told to replace; an upstream that cannot
  be reached is a 502 charged nothing, one that does not answer in time a 504 that keeps the
  estimate;
- a bad setting stops the gateway with one line naming it; `python app.py KEY` prints the
  id a key is counted under.

Each test prints its figures (pytest -s): requests, tokens reconciled, leaks."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis
from fastapi import Depends, FastAPI, Request, Response
from fastapi.testclient import TestClient

from genai_ratelimit import RateLimiter
from genai_ratelimit.fastapi import RateLimitHeadersMiddleware, TokenRateLimit, forward_to_upstream
from genai_ratelimit.testing import ThrowawayRedis
from helpers_core import logged
from helpers_uvicorn import HTTPX_SOCKETS, UvicornServer
from redis_server import env_redis_url, free_port
from test_fastapi_cancel import wait_for

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    HTTPX_SOCKETS,
    pytest.mark.not_asan(reason="its limiters run in uvicorn server processes, which this process's ASan "
                                "does not reach"),
    pytest.mark.no_hiredis1(reason="its limiters run in uvicorn server processes, on the codec and pipeline"
                                   " the async tests drive on hiredis 1.x"),
]

GATEWAY = Path(__file__).resolve().parent.parent / "examples" / "gateway"
PRO_KEY = f"sk-pro-{uuid.uuid4().hex}"
MESSAGES = [{"role": "user", "content": "Say something short."}]
# examples/gateway/tiers.toml's free tier: 5 requests a minute, 20,000 tokens, 2 in flight.
FREE_PER_MINUTE, FREE_TOKENS_PER_MINUTE, FREE_IN_FLIGHT = 5, 20_000, 2


def key_id(api_key: str) -> str:
    """examples/gateway/app.py's identity of a key (its README says the same)."""
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def redis_url(ratelimit_redis_server: ThrowawayRedis) -> str:
    """The gateway's Redis, as a user's own gateway tests would get it: the throwaway
    redis-server of the package's pytest plugin (a unix socket, stopped by its pid), or
    REDIS_URL when set. redis_client (tests/conftest.py) flushes it before each test."""
    return env_redis_url() or ratelimit_redis_server.url


@pytest.fixture(scope="module")
def upstream() -> Iterator[UvicornServer]:
    server = UvicornServer((GATEWAY / "fake_upstream.py").read_text(encoding="utf-8"), {})
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def gateway(upstream: UvicornServer, redis_url: str, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[UvicornServer]:
    key_tiers = tmp_path_factory.mktemp("gateway") / "key-tiers.json"
    key_tiers.write_text(json.dumps({key_id(PRO_KEY): "pro"}), encoding="utf-8")
    server = UvicornServer((GATEWAY / "app.py").read_text(encoding="utf-8"), {
        "REDIS_URL": redis_url, "GATEWAY_UPSTREAM_URL": upstream.base_url,
        "GENAI_RATELIMIT_TIERS": str(GATEWAY / "tiers.toml"), "GATEWAY_KEY_TIERS": str(key_tiers),
    }, workers=2)
    server.start()
    try:
        yield server
    finally:
        server.close()


def report(upstream: UvicornServer, api_key: str) -> list[dict[str, Any]]:
    """What the upstream answered to this key, in order."""
    with upstream.client(timeout=5.0) as client:
        return [record for record in client.get("/report").json() if record["api_key"] == api_key]


def outcomes(upstream: UvicornServer, api_key: str) -> list[str]:
    """How each of this key's requests ended at the upstream ("completed", "disconnected"...)."""
    return [record["outcome"] for record in report(upstream, api_key)]


def token_charges(client: redis.Redis, api_key: str, window_seconds: int = 60) -> list[int]:
    """The tokens charged to each request of this key, in its token window, oldest first."""
    return [cost for _, cost in logged(client, f"ratelimit:{key_id(api_key)}:{window_seconds}:tokens")]


def leases_held(client: redis.Redis, api_key: str) -> int:
    return int(client.zcard(f"ratelimit:{key_id(api_key)}:leases"))


def no_errors_logged(server: UvicornServer) -> None:
    log = server.log()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]


def sdk_clients(gateway: UvicornServer, api_key: str, max_retries: int = 0
                ) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=api_key, max_retries=max_retries,
                          timeout=20.0),
            anthropic.Anthropic(base_url=gateway.base_url, api_key=api_key, max_retries=max_retries,
                                timeout=20.0))


def test_each_request_is_charged_the_usage_the_upstream_reported(
        gateway: UvicornServer, upstream: UvicornServer, redis_client: redis.Redis) -> None:
    rounds, answered = 3, []
    for _ in range(rounds):  # fresh clients each round: new connections, either worker
        oa, an = sdk_clients(gateway, PRO_KEY)
        with oa, an:
            chat = oa.chat.completions.create(model="fake-1", max_tokens=6, messages=MESSAGES)
            assert chat.choices[0].message.content == "w0 w1 w2 w3 w4 w5"
            answered.append(chat.usage.total_tokens if chat.usage else None)
            # No stream_options here: the gateway asks the upstream for the usage chunk.
            chunks = list(oa.chat.completions.create(model="fake-1", max_tokens=4, messages=MESSAGES,
                                                     stream=True))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "w0 w1 w2 w3 "
            answered.append(chunks[-1].usage.total_tokens if chunks[-1].usage else None)
            response = oa.responses.create(model="fake-1", input="Say something short.", max_output_tokens=5)
            assert response.output_text == "w0 w1 w2 w3 w4"
            answered.append(response.usage.total_tokens if response.usage else None)
            events = list(oa.responses.create(model="fake-1", input="Say something.", max_output_tokens=3,
                                              stream=True))
            assert events[-1].type == "response.completed"
            answered.append(events[-1].response.usage.total_tokens if events[-1].response.usage else None)
            message = an.messages.create(model="fake-1", max_tokens=7, messages=MESSAGES)
            assert message.content[0].text == "w0 w1 w2 w3 w4 w5 w6"  # type: ignore[union-attr]
            answered.append(message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
                            + message.usage.output_tokens)
            with an.messages.stream(model="fake-1", max_tokens=2, messages=MESSAGES) as stream:
                final = stream.get_final_message()
            assert final.content[0].text == "w0 w1 "  # type: ignore[union-attr]
            answered.append(final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
                            + final.usage.output_tokens)

    records = report(upstream, PRO_KEY)
    assert len(records) == 6 * rounds and all(r["outcome"] == "completed" for r in records)
    assert all(r["accept_encoding"] == "identity" for r in records)
    assert all(r["include_usage"] for r in records if r["stream"] and r["path"] == "/v1/chat/completions")
    billed = [r["total_tokens"] for r in records]
    assert billed == answered  # what the SDKs read is what the upstream billed
    # Every request's entry in both token windows is its usage, exactly (not its estimate).
    assert sorted(token_charges(redis_client, PRO_KEY)) == sorted(billed)
    assert sorted(token_charges(redis_client, PRO_KEY, 86400)) == sorted(billed)
    assert len(logged(redis_client, f"ratelimit:{key_id(PRO_KEY)}:60")) == 6 * rounds
    assert leases_held(redis_client, PRO_KEY) == 0
    no_errors_logged(gateway)
    print(f"\n[gateway usage] {len(records)} requests (3 APIs x JSON/stream x {rounds}, 2 workers): "
          f"{sum(billed)} tokens reported by the upstream, {sum(token_charges(redis_client, PRO_KEY))} "
          "charged, entry by entry")


def test_the_gateways_429_reaches_both_sdks_and_never_the_upstream(
        gateway: UvicornServer, upstream: UvicornServer, redis_client: redis.Redis) -> None:
    openai_key, anthropic_key = f"sk-free-{uuid.uuid4().hex}", f"sk-free-{uuid.uuid4().hex}"
    oa, _ = sdk_clients(gateway, openai_key)
    _, an = sdk_clients(gateway, anthropic_key)
    with oa, an:
        for _ in range(FREE_PER_MINUTE):
            oa.chat.completions.create(model="fake-1", max_tokens=3, messages=MESSAGES)
            an.messages.create(model="fake-1", max_tokens=3, messages=MESSAGES)
        with pytest.raises(openai.RateLimitError) as refused:
            oa.chat.completions.create(model="fake-1", max_tokens=3, messages=MESSAGES)
        assert refused.value.status_code == 429
        assert refused.value.response.headers["x-ratelimit-window"] == "minute"
        assert 0 < int(refused.value.response.headers["retry-after"]) <= 60
        with pytest.raises(anthropic.RateLimitError) as refused_anthropic:
            an.messages.create(model="fake-1", max_tokens=3, messages=MESSAGES)
        assert refused_anthropic.value.status_code == 429
        assert refused_anthropic.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]

    # A request that can never fit the token budget: 429 at once, even with the SDK's retries
    # (x-should-retry: false), before anything is reserved.
    large_key = f"sk-free-{uuid.uuid4().hex}"
    oa, _ = sdk_clients(gateway, large_key, max_retries=2)
    with oa:
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as too_large:
            oa.chat.completions.create(model="fake-1", max_tokens=FREE_TOKENS_PER_MINUTE + 1,
                                       messages=MESSAGES)
        assert time.monotonic() - started < 5.0
    assert too_large.value.response.headers["x-should-retry"] == "false"

    assert len(report(upstream, openai_key)) == FREE_PER_MINUTE
    assert len(report(upstream, anthropic_key)) == FREE_PER_MINUTE
    assert report(upstream, large_key) == []
    no_errors_logged(gateway)
    print(f"\n[gateway 429] openai and anthropic SDKs: {FREE_PER_MINUTE} admitted each, the next refused "
          "(429 minute window); a too-large request refused at once with retries on; the upstream "
          f"saw {2 * FREE_PER_MINUTE} requests")


def test_a_client_that_disconnects_mid_stream_leaks_nothing(
        gateway: UvicornServer, upstream: UvicornServer, redis_client: redis.Redis) -> None:
    api_key = f"sk-free-{uuid.uuid4().hex}"
    oa, an = sdk_clients(gateway, api_key)
    with oa, an:
        # One stream of each API, left after its first events ("slow": 500 words, 20 ms apart).
        opens: list[Any] = [
            lambda: oa.chat.completions.create(model="slow-1", max_tokens=600, messages=MESSAGES,
                                               stream=True),
            lambda: oa.responses.create(model="slow-1", input="Go on.", max_output_tokens=600, stream=True),
            lambda: an.messages.create(model="slow-1", max_tokens=600, messages=MESSAGES, stream=True),
        ]
        for number, open_stream in enumerate(opens, start=1):
            stream = open_stream()
            assert leases_held(redis_client, api_key) == 1
            events = iter(stream)
            for _ in range(3):
                next(events)
            stream.close()
            wait_for(lambda left=number: outcomes(upstream, api_key) == ["disconnected"] * left,
                     f"the upstream saw stream {number}'s client leave")
            wait_for(lambda: leases_held(redis_client, api_key) == 0, f"stream {number}'s slot was freed")
        # The tier's whole max_in_flight is free again: two streams at once are admitted.
        held = [oa.chat.completions.create(model="slow-1", max_tokens=600, messages=MESSAGES, stream=True)
                for _ in range(FREE_IN_FLIGHT)]
        assert leases_held(redis_client, api_key) == FREE_IN_FLIGHT
        for stream in held:
            next(iter(stream))
            stream.close()
    wait_for(lambda: outcomes(upstream, api_key) == ["disconnected"] * 5,
             "the upstream saw every stream's client leave")
    wait_for(lambda: leases_held(redis_client, api_key) == 0, "every in-flight slot was freed")
    # A stream cut short keeps its estimate (aborted_stream="estimate"): never less than billed.
    charges = token_charges(redis_client, api_key)
    assert len(charges) == 5 and all(charge > 600 for charge in charges)
    no_errors_logged(gateway)
    print(f"\n[gateway disconnects] 5 streams left mid-way (chat, responses, messages, then "
          f"{FREE_IN_FLIGHT} at once): 5 upstream connections closed, {leases_held(redis_client, api_key)} "
          f"in-flight slots left, {sum(charges)} tokens kept as estimates")


def test_a_client_that_leaves_before_a_json_answer_closes_the_upstream_request(
        gateway: UvicornServer, upstream: UvicornServer, redis_client: redis.Redis) -> None:
    api_key = f"sk-free-{uuid.uuid4().hex}"
    oa, _ = sdk_clients(gateway, api_key)
    with oa, pytest.raises(openai.APITimeoutError):  # the upstream takes 10 s: the client leaves at 0.5
        oa.chat.completions.create(model="slow-1", max_tokens=600, messages=MESSAGES, timeout=0.5)
    wait_for(lambda: outcomes(upstream, api_key) == ["disconnected"], "the upstream saw its client leave")
    wait_for(lambda: leases_held(redis_client, api_key) == 0, "its in-flight slot was freed")
    no_errors_logged(gateway)


def test_the_upstreams_answer_passes_through_but_for_the_limiters_headers(
        gateway: UvicornServer, upstream: UvicornServer, redis_client: redis.Redis) -> None:
    api_key = f"sk-free-{uuid.uuid4().hex}"
    request = {"model": "error-model", "max_tokens": 100, "messages": MESSAGES}
    headers = {"authorization": f"Bearer {api_key}"}
    with upstream.client(timeout=10.0) as direct, gateway.client(timeout=10.0) as through:
        expected = direct.post("/v1/chat/completions", json=request, headers=headers)
        answer = through.post("/v1/chat/completions", json=request, headers=headers)
    assert answer.status_code == expected.status_code == 400
    assert answer.content == expected.content
    assert answer.headers["x-request-id"] == "req-fake"
    assert answer.headers["x-ratelimit-limit-requests"] == str(FREE_PER_MINUTE)  # ours, not the provider's
    assert "anthropic-ratelimit-requests-limit" not in answer.headers
    assert len(answer.headers.get_list("date")) == len(answer.headers.get_list("server")) == 1
    # The SDK reads the upstream's error; a refused request is billed no tokens.
    oa, _ = sdk_clients(gateway, api_key)
    with oa, pytest.raises(openai.BadRequestError, match="does not exist"):
        oa.chat.completions.create(model="error-model", max_tokens=100, messages=MESSAGES)
    assert token_charges(redis_client, api_key) == []
    assert len(logged(redis_client, f"ratelimit:{key_id(api_key)}:60")) == 2  # still two requests
    # Without a key: 401 from the gateway, nothing counted, nothing forwarded.
    with gateway.client(timeout=10.0) as through:
        assert through.post("/v1/messages", json=request).status_code == 401
    no_errors_logged(gateway)


def test_forward_to_upstream_sends_the_clients_headers_but_the_hops_and_those_it_replaces() -> None:
    """forward_to_upstream alone (no budget on the route), in process: the upstream echoes the
    headers and the body it was sent."""
    async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = (await receive())["body"]
        seen = [[name.decode(), value.decode()] for name, value in scope["headers"]]
        answer = json.dumps({"headers": seen, "body": json.loads(body),
                             "query": scope["query_string"].decode()})
        await send({"type": "http.response.start", "status": 201, "headers": [
            (b"content-type", b"application/json"), (b"connection", b"close, x-hop"), (b"x-hop", b"1"),
            (b"x-ratelimit-limit-tokens", b"1"), (b"ratelimit-policy", b'"p";q=1'), (b"x-kept", b"yes")]})
        await send({"type": "http.response.body", "body": answer.encode()})

    upstream = httpx.AsyncClient(base_url="http://upstream.test/base",
                                 transport=httpx.ASGITransport(app=echo))
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward_to_upstream(request, upstream, headers={"authorization": "Bearer sk-upstream",
                                                                     "x-api-key": None})

    with TestClient(app) as client:
        answer = client.post("/v1/chat/completions?trace=1",
                             json={"stream": True, "stream_options": {"x": 1}},
                             headers={"authorization": "Bearer sk-gateway", "x-api-key": "sk-gateway",
                                      "connection": "keep-alive, x-private", "x-private": "hop",
                                      "accept-encoding": "gzip", "x-client": "kept"})
    assert answer.status_code == 201
    assert answer.headers["x-kept"] == "yes"
    assert not {"x-hop", "x-ratelimit-limit-tokens", "ratelimit-policy"} & set(answer.headers)
    sent = answer.json()
    names = [name for name, _ in sent["headers"]]
    assert names.count("authorization") == names.count("accept-encoding") == names.count("host") == 1
    assert {name: value for name, value in sent["headers"]
            if name in ("authorization", "accept-encoding", "host", "x-client")} == {
        "authorization": "Bearer sk-upstream", "accept-encoding": "identity", "host": "upstream.test",
        "x-client": "kept"}
    assert not {"x-api-key", "x-private"} & set(names)
    assert sent["query"] == "trace=1"
    assert sent["body"] == {"stream": True, "stream_options": {"x": 1, "include_usage": True}}


def test_an_unreachable_upstream_is_a_502_charged_nothing_a_silent_one_a_504_that_keeps_its_estimate(
        upstream: UvicornServer, redis_url: str, redis_client: redis.Redis) -> None:
    """forward_to_upstream in process (TestClient), behind a TokenRateLimit on the session's
    Redis: nothing listens on the first upstream's port; the fake upstream takes 10 s to
    answer a "slow" model's JSON, the client of the second waits 0.3 s."""
    budget = TokenRateLimit(RateLimiter(redis_url), identify=lambda request: ("gateway-errors", "free"),
                            tier_limits={"free": {"per_minute": 100, "per_day": 1000}},
                            token_limits={"free": {"per_minute": 10_000, "per_day": 100_000}})
    unreachable = httpx.AsyncClient(base_url=f"http://127.0.0.1:{free_port()}")
    silent = httpx.AsyncClient(base_url=upstream.base_url, timeout=0.3)
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)

    @app.post("/unreachable/v1/chat/completions", dependencies=[Depends(budget)])
    async def to_unreachable(request: Request) -> Response:
        return await forward_to_upstream(request, unreachable, "/v1/chat/completions")

    @app.post("/silent/v1/chat/completions", dependencies=[Depends(budget)])
    async def to_silent(request: Request) -> Response:
        return await forward_to_upstream(request, silent, "/v1/chat/completions")

    request = {"model": "slow-1", "max_tokens": 100, "messages": MESSAGES}
    charges = "ratelimit:gateway-errors:60:tokens"
    with TestClient(app) as client:
        refused = client.post("/unreachable/v1/chat/completions", json=request)
        assert refused.status_code == 502 and refused.json()["error"]["code"] == "upstream_unavailable"
        assert logged(redis_client, charges) == []  # nothing reached an upstream: nothing charged
        timed_out = client.post("/silent/v1/chat/completions", json=request)
        assert timed_out.status_code == 504 and timed_out.json()["error"]["code"] == "upstream_timeout"
        kept = [cost for _, cost in logged(redis_client, charges)]
        assert len(kept) == 1 and kept[0] > 100  # the estimate: the upstream may have generated
        client.portal.call(silent.aclose)
        client.portal.call(unreachable.aclose)
    assert len(logged(redis_client, "ratelimit:gateway-errors:60")) == 2  # both counted as requests


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("GATEWAY_UPSTREAM_URL", "", "gateway: GATEWAY_UPSTREAM_URL is not set (the upstream's base URL"),
    ("GATEWAY_KEY_TIERS", "/nonexistent/tiers.json", "gateway: GATEWAY_KEY_TIERS=/nonexistent/tiers.json"),
    ("GATEWAY_UPSTREAM_TIMEOUT", "ten", "gateway: GATEWAY_UPSTREAM_TIMEOUT: could not convert"),
])
def test_a_bad_setting_stops_the_gateway_with_one_line_naming_it(variable: str, value: str, message: str,
                                                                 tmp_path: Path) -> None:
    shutil.copy(GATEWAY / "app.py", tmp_path / "app.py")  # imported from a copy: no __pycache__ here
    environment = {**os.environ, "GATEWAY_UPSTREAM_URL": "http://127.0.0.1:9", variable: value}
    environment.pop("GENAI_RATELIMIT_TIERS", None)
    started = subprocess.run([sys.executable, "-c", "import app"], cwd=tmp_path, env=environment,
                             capture_output=True, text=True, timeout=60)
    assert started.returncode == 1
    assert started.stderr.startswith(message) and started.stderr.count("\n") == 1, started.stderr


def test_app_py_prints_the_id_a_key_is_counted_under() -> None:
    printed = subprocess.run([sys.executable, "app.py", PRO_KEY, "sk-other"], cwd=GATEWAY,
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0 and printed.stdout.split() == [key_id(PRO_KEY), key_id("sk-other")]
