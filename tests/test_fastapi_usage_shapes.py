"""Every API's usage, end to end: a gateway under a real uvicorn (TokenRateLimit +
RateLimitHeadersMiddleware, no record_usage anywhere) whose routes answer as OpenAI chat
completions, OpenAI Responses and Anthropic Messages do, JSON and streamed, driven by the
real `openai` and `anthropic` SDKs. The token windows are read back from the session's real
Redis: each request's reservation is reconciled to the total the response billed (Anthropic's
cache tokens included). Then, through Starlette's TestClient on the same Redis: a request's
estimate counts its system prompt and tools, and a body nested too deep for the model lookup
is counted, never a 500."""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis
from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse

from genai_ratelimit import RateLimiter
from genai_ratelimit.fastapi import RateLimit, RateLimitHeadersMiddleware, TokenRateLimit
from helpers_uvicorn import HTTPX_SOCKETS, UvicornServer

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r".*httpx2")
    from fastapi.testclient import TestClient

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    HTTPX_SOCKETS,
    pytest.mark.not_asan(reason="uvicorn and the real openai / anthropic SDK clients run the requests"),
    pytest.mark.no_hiredis1(reason="uvicorn and the real openai / anthropic SDK clients run the requests"),
]

# The upstream's usage (what the fake provider bills for every answer).
PROMPT, WORDS = 9, ["Hello", " there", " friend"]
CACHE_WRITE, CACHE_READ = 2_000, 30_000

GATEWAY = '''
import asyncio
import json
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from genai_ratelimit import AsyncRateLimiter
from genai_ratelimit.fastapi import RateLimitHeadersMiddleware, TokenRateLimit


PROMPT, WORDS = PROMPT_AND_WORDS
CACHE_WRITE, CACHE_READ = CACHE_WRITE_AND_READ

app = FastAPI()
app.add_middleware(RateLimitHeadersMiddleware)
tokens = TokenRateLimit(AsyncRateLimiter(), namespace="shapes",
                        tier_limits={"free": {"per_minute": 1_000, "per_day": 10_000}},
                        token_limits={"free": {"per_minute": 10_000_000, "per_day": 100_000_000}})


def sse(events):
    async def stream():
        for name, data in events:
            yield (f"event: {name}\\n" if name else "") + f"data: {json.dumps(data)}\\n\\n"
    return StreamingResponse(stream(), media_type="text/event-stream")


@app.get("/healthz")
async def healthz():
    return {"ok": True}


@app.post("/v1/chat/completions", dependencies=[Depends(tokens)])
async def chat(request: Request):
    body = await request.json()
    usage = {"prompt_tokens": PROMPT, "completion_tokens": len(WORDS),
             "total_tokens": PROMPT + len(WORDS)}
    head = {"id": "chatcmpl-1", "created": 1, "model": body["model"]}
    if not body.get("stream"):
        return {**head, "object": "chat.completion", "usage": usage,
                "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                             "message": {"role": "assistant", "content": "".join(WORDS)}}]}
    chunk = {**head, "object": "chat.completion.chunk"}
    events = [(None, {**chunk, "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}],
                      "usage": None}) for w in WORDS]
    events.append((None, {**chunk, "choices": [], "usage": usage}))

    async def stream():
        for _, data in events:
            yield f"data: {json.dumps(data)}\\n\\n"
        yield "data: [DONE]\\n\\n"
    return StreamingResponse(stream(), media_type="text/event-stream")


# A TokenRateLimit that charges a stream cut short what it streamed.
cut = TokenRateLimit(AsyncRateLimiter(), namespace="cut", aborted_stream="streamed",
                     tier_limits={"free": {"per_minute": 1_000, "per_day": 10_000}},
                     token_limits={"free": {"per_minute": 10_000_000, "per_day": 100_000_000}})


@app.post("/cut/v1/chat/completions", dependencies=[Depends(cut)])
async def held_open(request: Request):
    async def stream():
        for w in WORDS:
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                     "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\\n\\n"
        await asyncio.Event().wait()  # held open until the client goes away
    return StreamingResponse(stream(), media_type="text/event-stream")


@app.post("/v1/responses", dependencies=[Depends(tokens)])
async def responses(request: Request):
    body = await request.json()
    text = "".join(WORDS)
    output = [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    response = {"id": "resp_1", "object": "response", "created_at": 1, "model": body["model"],
                "status": "completed", "output": output,
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "usage": {"input_tokens": PROMPT, "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": len(WORDS), "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": PROMPT + len(WORDS)}}
    if not body.get("stream"):
        return response
    events = [("response.created", {"type": "response.created", "sequence_number": 0,
                                    "response": {**response, "status": "in_progress", "output": [],
                                                 "usage": None}})]
    events += [("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "msg_1",
                "output_index": 0, "content_index": 0, "delta": w, "logprobs": [], "sequence_number": n + 1})
               for n, w in enumerate(WORDS)]
    events.append(("response.completed", {"type": "response.completed", "sequence_number": 9,
                                          "response": response}))
    return sse(events)


@app.post("/v1/messages", dependencies=[Depends(tokens)])
async def messages(request: Request):
    body = await request.json()
    usage = {"input_tokens": PROMPT, "cache_creation_input_tokens": CACHE_WRITE,
             "cache_read_input_tokens": CACHE_READ, "output_tokens": len(WORDS)}
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": body["model"],
               "stop_reason": "end_turn", "stop_sequence": None}
    if not body.get("stream"):
        return {**message, "content": [{"type": "text", "text": "".join(WORDS)}], "usage": usage}
    events = [("message_start", {"type": "message_start", "message": {
                  **message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}}),
              ("content_block_start", {"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "text", "text": ""}}),
              ("ping", {"type": "ping"})]
    events += [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": w}}) for w in WORDS]
    events += [("content_block_stop", {"type": "content_block_stop", "index": 0}),
               ("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                  "usage": {"output_tokens": len(WORDS)}}),
               ("message_stop", {"type": "message_stop"})]
    return sse(events)
'''.replace("PROMPT_AND_WORDS", repr((PROMPT, WORDS))).replace(
    "CACHE_WRITE_AND_READ", repr((CACHE_WRITE, CACHE_READ)))

OPENAI_TOTAL = PROMPT + len(WORDS)
ANTHROPIC_TOTAL = PROMPT + CACHE_WRITE + CACHE_READ + len(WORDS)


@pytest.fixture(scope="module")
def gateway(redis_url: str) -> Iterator[UvicornServer]:
    server = UvicornServer(GATEWAY, {"REDIS_URL": redis_url, "GENAI_RATELIMIT_TIERS": "",
                                     "RATE_LIMIT_DISABLED": ""})
    server.start()
    try:
        yield server
    finally:
        server.close()


def token_costs(redis_client: redis.Redis, window: int = 60, namespace: str = "shapes",
                identity: str = "127.0.0.1") -> list[int]:
    """The cost of every entry of the anonymous client's token window (weights hash)."""
    key = f"ratelimit:ns:{namespace}:ip:{identity}:{window}:tokens"
    weights = redis_client.hgetall(key + ":w")
    return [int(weights.get(member, 1)) for member in redis_client.zrange(key, 0, -1)]


@pytest.fixture
def openai_client(gateway: UvicornServer, redis_client: redis.Redis) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="sk-test", max_retries=0)
    yield client
    client.close()


@pytest.fixture
def anthropic_client(gateway: UvicornServer, redis_client: redis.Redis) -> Iterator[anthropic.Anthropic]:
    client = anthropic.Anthropic(base_url=gateway.base_url, api_key="sk-ant-test", max_retries=0)
    yield client
    client.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_openai_chat_completions_usage_is_reconciled(openai_client: openai.OpenAI,
                                                     redis_client: redis.Redis, stream: bool) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    if stream:
        chunks = openai_client.chat.completions.create(
            model="gpt-test", messages=messages, max_tokens=500, stream=True,
            stream_options={"include_usage": True})
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        completion = openai_client.chat.completions.create(model="gpt-test", messages=messages,
                                                           max_tokens=500)
        assert completion.usage is not None and completion.usage.total_tokens == OPENAI_TOTAL
        text = completion.choices[0].message.content or ""
    assert text == "".join(WORDS)
    assert token_costs(redis_client) == [OPENAI_TOTAL]  # reserved 501, billed 12
    assert token_costs(redis_client, 86_400) == [OPENAI_TOTAL]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_openai_responses_usage_is_reconciled(openai_client: openai.OpenAI, redis_client: redis.Redis,
                                              stream: bool) -> None:
    if stream:
        events = list(openai_client.responses.create(model="gpt-test", input="hi", max_output_tokens=500,
                                                     stream=True))
        assert events[-1].type == "response.completed"
        assert events[-1].response.usage is not None
        assert events[-1].response.usage.total_tokens == OPENAI_TOTAL
    else:
        response = openai_client.responses.create(model="gpt-test", input="hi", max_output_tokens=500)
        assert response.output_text == "".join(WORDS)
    assert token_costs(redis_client) == [OPENAI_TOTAL]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_anthropic_messages_usage_with_cache_tokens_is_reconciled(
        anthropic_client: anthropic.Anthropic, redis_client: redis.Redis, stream: bool) -> None:
    # The issue: 100,000 billed, 10 charged. Now the reservation (500 + the prompt) grows to
    # what was billed: input, cache writes, cache reads and output.
    arguments: Any = {"model": "claude-test", "max_tokens": 500, "system": "be brief",
                      "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        with anthropic_client.messages.stream(**arguments) as events:
            text = "".join(events.text_stream)
            final = events.get_final_message()
        assert final.usage.cache_read_input_tokens == CACHE_READ
    else:
        message = anthropic_client.messages.create(**arguments)
        text = "".join(block.text for block in message.content if block.type == "text")
    assert text == "".join(WORDS)
    assert token_costs(redis_client) == [ANTHROPIC_TOTAL]
    assert token_costs(redis_client, 86_400) == [ANTHROPIC_TOTAL]


def test_a_stream_the_client_leaves_is_charged_what_it_streamed(gateway: UvicornServer,
                                                                 redis_client: redis.Redis) -> None:
    client = openai.OpenAI(base_url=gateway.base_url + "/cut/v1", api_key="sk-test", max_retries=0)
    stream = client.chat.completions.create(model="gpt-test", max_tokens=1_000, stream=True,
                                            messages=[{"role": "user", "content": "x" * 40}])
    received = []
    for chunk in stream:
        received.append(chunk.choices[0].delta.content)
        if len(received) == len(WORDS):
            break
    assert token_costs(redis_client, namespace="cut") == [1_010]  # reserved: 1,000 + 10
    stream.close()  # the client goes away; the server's stream is still open
    client.close()
    # 10 prompt tokens + "Hello there friend" (18 characters: 5 tokens, in 3 chunks). The
    # disconnect reaches the server when it does: wait for the charge, at most 10 s.
    deadline = time.monotonic() + 10
    while token_costs(redis_client, namespace="cut") == [1_010] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert token_costs(redis_client, namespace="cut") == [10 + 5]


# --- TestClient: the estimate and the model lookup on hostile bodies ------------------------


@pytest.fixture
def blocking_limiter(redis_url: str, redis_client: redis.Redis) -> Iterator[RateLimiter]:
    limiter = RateLimiter(redis_url)
    yield limiter
    limiter.close()


def test_a_long_system_prompt_and_tools_are_reserved(blocking_limiter: RateLimiter,
                                                     redis_client: redis.Redis) -> None:
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)
    budget = TokenRateLimit(blocking_limiter, namespace="estimate",
                            token_limits={"free": {"per_minute": 10_000, "per_day": 100_000}})

    @app.post("/v1/messages", dependencies=[Depends(budget)])
    async def messages() -> dict[str, str]:
        return {"answer": "no usage reported"}

    with TestClient(app) as client:
        # The issue: 5 of 5 admitted against a 10,000-token minute, 2 tokens reserved each.
        system = {"model": "m", "max_tokens": 10, "system": "x" * 100_000,
                  "messages": [{"role": "user", "content": "hi"}]}
        tools = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
                 "tools": [{"name": "f", "description": "x" * 100_000, "input_schema": {"type": "object"}}]}
        assert [client.post("/v1/messages", json=body).status_code for body in (system, tools)] == [429, 429]
        assert client.post("/v1/messages", json={**system, "system": "x" * 20_000}).status_code == 200
    key = "ratelimit:ns:estimate:ip:testclient:60:tokens"
    weights = redis_client.hgetall(key + ":w")
    assert [int(weights[m]) for m in redis_client.zrange(key, 0, -1)] == [5_000 + 1 + 10]


@pytest.mark.parametrize("depth", [100_000, 900])
def test_a_deeply_nested_body_is_counted_never_a_500(blocking_limiter: RateLimiter,
                                                     redis_client: redis.Redis, depth: int) -> None:
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)
    limit = RateLimit(blocking_limiter, namespace="nested",
                      model_limits={"gpt-test": {"per_minute": 2}})

    @app.post("/v1/chat/completions", dependencies=[Depends(limit)])
    async def chat(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    body = b'{"model": "gpt-test", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    with TestClient(app) as client:
        statuses = [client.post("/v1/chat/completions", content=body,
                                headers={"content-type": "application/json"}).status_code
                    for _ in range(3)]
    assert 500 not in statuses
    assert redis_client.zcard("ratelimit:ns:nested:ip:testclient:60") == statuses.count(200)
    assert statuses.count(200) >= 2


# The usage chunk of a chat stream, as the standard lets an upstream write it (issue 30,
# item 3): each was kept at its estimate (11 tokens: "hi" and max_tokens 10) instead of the
# 5,000 tokens reported.
USAGE_CHUNK = {"id": "c", "object": "chat.completion.chunk", "choices": [],
               "usage": {"prompt_tokens": 1_000, "completion_tokens": 4_000, "total_tokens": 5_000}}
USAGE_JSON = json.dumps(USAGE_CHUNK, indent=1)  # several lines
STANDARD_STREAMS = {
    # Bare CR line ends (the standard's third line end, beside LF and CRLF).
    "bare-cr": f"data: {json.dumps(USAGE_CHUNK)}\r\rdata: [DONE]\r\r".encode(),
    # One event whose JSON spans several data: lines (the standard joins them with LF).
    "multi-line-data": ("".join(f"data: {line}\n" for line in USAGE_JSON.split("\n"))
                        + "\ndata: [DONE]\n\n").encode(),
    # A BOM, a comment, fields without the space, CRLF split between two chunks.
    "bom-comment-crlf": ("\ufeff: keep-alive\r\nevent:chunk\r\nid:7\r\ndata:"
                         + json.dumps(USAGE_CHUNK) + "\r\n\r\ndata:[DONE]\r\n\r\n").encode(),
}


@pytest.mark.parametrize("name", sorted(STANDARD_STREAMS))
@pytest.mark.parametrize("step", [1, 3, 1 << 20], ids=["bytes", "threes", "whole"])
def test_a_stream_written_as_the_standard_allows_is_reconciled(
        blocking_limiter: RateLimiter, redis_client: redis.Redis, name: str, step: int) -> None:
    stream = STANDARD_STREAMS[name]
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)
    budget = TokenRateLimit(blocking_limiter, namespace="standard",
                            token_limits={"free": {"per_minute": 100_000, "per_day": 1_000_000}})

    @app.post("/v1/chat/completions", dependencies=[Depends(budget)])
    async def chat() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(stream), step):  # the upstream's chunks, split anywhere
                yield stream[start:start + step]
        return StreamingResponse(chunks(), media_type="text/event-stream")

    with TestClient(app) as client:
        answer = client.post("/v1/chat/completions", json={
            "model": "m", "max_tokens": 10, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200
        assert answer.content == stream  # passed on untouched
    assert token_costs(redis_client, namespace="standard", identity="testclient") == [5_000]


def test_the_gateway_log_has_no_errors(gateway: UvicornServer) -> None:
    httpx.get(gateway.base_url + "/healthz", timeout=5)
    assert "Traceback" not in gateway.log()
