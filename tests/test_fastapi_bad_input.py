"""A token route's bad input is the client's error, never a 500 (issue 30, item 9): a maximum
the JSON cannot carry as a number (1e400, NaN), a body that is not JSON, JSON that is not an
object, an empty body announced as JSON. Each gets a 4xx naming the problem, in the error
shape the route speaks (error_format: OpenAI's `error` object, Anthropic's `{"type":
"error", ...}`, or the plain `detail`), whether the route then reads the body the documented
way (`await request.json()`) or not. Then any JSON value and any bytes, through the same
route (hypothesis): never a 500. Starlette's TestClient on the session's real Redis."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi import Depends, FastAPI, Request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genai_ratelimit import RateLimiter
from genai_ratelimit.fastapi import RateLimitHeadersMiddleware, TokenRateLimit

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r".*httpx2")
    from fastapi.testclient import TestClient

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async tests "
                                   "drive on hiredis 1.x"),
]

LARGE = {"free": {"per_minute": 1_000_000, "per_day": 10_000_000}}
FORMATS = ["openai", "anthropic", "plain"]
JSON_HEADERS = {"content-type": "application/json"}


@pytest.fixture
def blocking_limiter(redis_url: str, redis_client: redis.Redis) -> Iterator[RateLimiter]:
    limiter = RateLimiter(redis_url)
    yield limiter
    limiter.close()


def gateway(limiter: RateLimiter, error_format: str = "openai", *, middleware: bool = True) -> FastAPI:
    app = FastAPI()
    if middleware:
        app.add_middleware(RateLimitHeadersMiddleware)
    tokens = TokenRateLimit(limiter, namespace="bad", tier_limits=LARGE, token_limits=LARGE,
                            error_format=error_format)  # type: ignore[arg-type]

    @app.post("/v1/chat/completions", dependencies=[Depends(tokens)])
    async def chat(request: Request) -> dict[str, Any]:
        if not await request.body():  # a request without a body, which TokenRateLimit lets by
            return {"model": None, "fields": []}
        body = await request.json()  # the documented pattern (docs/tokens.md)
        return {"model": body.get("model"), "fields": sorted(body)}

    @app.post("/v1/audio/transcriptions", dependencies=[Depends(tokens)])
    async def transcribe(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}  # a form upload: not JSON, and fine

    @app.get("/v1/models", dependencies=[Depends(tokens)])
    async def models() -> dict[str, list[str]]:
        return {"data": []}

    return app


def assert_shape(answer: Any, error_format: str, status: int, *words: str) -> dict[str, Any]:
    """The answer is `status` in the format's shape, and its message names the problem."""
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert "detail" in body
    if error_format == "openai":
        error = body["error"]
        assert error["type"] == "invalid_request_error" and error["code"] is None
        assert set(error) == {"message", "type", "param", "code"}
        message = error["message"]
    elif error_format == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        message = body["error"]["message"]
    else:
        assert set(body) == {"detail"}
        message = json.dumps(body["detail"])
    for word in words:
        assert word in message, message
    return body


@pytest.mark.parametrize("error_format", FORMATS)
@pytest.mark.parametrize("text", ["1e400", "-1e400", "NaN", "Infinity", '{"a": Infinity}', "[1e999]"])
def test_a_maximum_json_cannot_write_back_is_a_422_not_a_500(
        blocking_limiter: RateLimiter, redis_client: redis.Redis, error_format: str, text: str) -> None:
    # The issue: the 422 carried `input: inf`, which the response could not encode: 500.
    with TestClient(gateway(blocking_limiter, error_format)) as client:
        answer = client.post("/v1/chat/completions", headers=JSON_HEADERS,
                             content=f'{{"model": "m", "max_tokens": {text}}}'.encode())
    body = assert_shape(answer, error_format, 422, "max_tokens", "positive whole number")
    (error,) = body["detail"]  # FastAPI's validation shape, whatever the format
    assert error["loc"] == ["body", "max_tokens"]
    assert isinstance(error["input"], str)  # what was sent, written as text
    if error_format == "openai":
        assert body["error"]["param"] == "max_tokens"
    assert list(redis_client.scan_iter("ratelimit:*")) == []  # nothing reserved


def test_without_the_middleware_the_422_is_fastapis_and_still_not_a_500(
        blocking_limiter: RateLimiter, caplog: pytest.LogCaptureFixture) -> None:
    with TestClient(gateway(blocking_limiter, middleware=False)) as client:
        answer = client.post("/v1/chat/completions", headers=JSON_HEADERS,
                             content=b'{"max_tokens": 1e400}')
        not_json = client.post("/v1/chat/completions", headers=JSON_HEADERS, content=b"{")
    assert answer.status_code == 422
    assert answer.json()["detail"][0]["loc"] == ["body", "max_tokens"]
    assert not_json.status_code == 400
    assert "not valid JSON" in not_json.json()["detail"]


@pytest.mark.parametrize("error_format", FORMATS)
@pytest.mark.parametrize("content, words", [
    (b"not json", ["not valid JSON", "line 1 column 1"]),
    (b'{"model": "m",', ["not valid JSON"]),
    (b'{"model": "m"} trailing', ["not valid JSON", "Extra data"]),
    (b"\xff\xfe\xfa", ["not valid JSON"]),
    (b'{"n": 1' + b"0" * 5000 + b"}", ["not valid JSON"]),  # more digits than Python converts
    (b"[1, 2]", ["must be a JSON object", "an array"]),
    (b'"text"', ["must be a JSON object", "a string"]),
    (b"42", ["must be a JSON object", "a number"]),
    (b"true", ["must be a JSON object", "a boolean"]),
    (b"null", ["must be a JSON object", "null"]),
    (b"", ["empty", "JSON object"]),  # under a JSON content-type
    (b"  \n", ["not valid JSON"]),
    (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", ["nested too deeply"]),
], ids=["text", "cut", "trailing", "not-utf-8", "long-number", "array", "string", "number", "boolean",
        "null", "empty", "blank", "too-deep"])
def test_a_body_that_is_not_a_json_object_is_a_400_naming_the_problem(
        blocking_limiter: RateLimiter, redis_client: redis.Redis, error_format: str,
        content: bytes, words: list[str]) -> None:
    # The issue: these passed TokenRateLimit with the default estimate, and the route's
    # `await request.json()` answered 500.
    with TestClient(gateway(blocking_limiter, error_format)) as client:
        answer = client.post("/v1/chat/completions", headers=JSON_HEADERS, content=content)
        assert_shape(answer, error_format, 400, *words)
        assert list(redis_client.scan_iter("ratelimit:*")) == []  # nothing reserved
        # The same without a content-type: a token route's body is JSON (no body is no body).
        assert client.post("/v1/chat/completions", content=content).status_code == (400 if content else 200)


def test_a_form_upload_and_a_request_without_a_body_are_estimated_as_before(
        blocking_limiter: RateLimiter, redis_client: redis.Redis) -> None:
    with TestClient(gateway(blocking_limiter)) as client:
        upload = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF....")},
                             data={"model": "whisper-1"})
        form = client.post("/v1/audio/transcriptions", data={"model": "whisper-1"})
        listed = client.get("/v1/models")
        bodiless = client.post("/v1/audio/transcriptions")  # no body, none announced
    statuses = [upload.status_code, form.status_code, listed.status_code, bodiless.status_code]
    assert statuses == [200] * 4
    key = "ratelimit:ns:bad:ip:testclient:60:tokens"
    weights = redis_client.hgetall(key + ":w")
    assert [int(weights[m]) for m in redis_client.zrange(key, 0, -1)] == [1_000] * 4  # the default


def test_a_shadow_budget_answers_bad_input_too(blocking_limiter: RateLimiter) -> None:
    # Bad input is not a budget's verdict: a shadow budget (which never refuses for its
    # limits) answers it as the enforced one does, as it always answered a bad maximum.
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)
    shadow = TokenRateLimit(blocking_limiter, namespace="bad", mode="shadow", token_limits=LARGE)

    @app.post("/v1/chat/completions", dependencies=[Depends(shadow)])
    async def chat(request: Request) -> dict[str, Any]:
        return dict(await request.json())

    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json=[1, 2]).status_code == 400
        assert client.post("/v1/chat/completions", json={"max_tokens": "lots"}).status_code == 422
        assert client.post("/v1/chat/completions", json={"max_tokens": 5}).status_code == 200


# --- any JSON value, any bytes: never a 500 ---------------------------------------------------

JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: (st.lists(children, max_size=4)
                      | st.dictionaries(st.text(max_size=10), children, max_size=4)),
    max_leaves=12)
# Objects shaped like a request: the fields the estimate reads, with any value.
FIELDS = st.sampled_from(["model", "messages", "max_tokens", "max_completion_tokens", "max_output_tokens",
                          "n", "system", "input", "tools", "prompt", "stream"])
REQUESTS = st.dictionaries(FIELDS, JSON_VALUES, max_size=5)


def check_answer(answer: Any, error_format: str, document: object) -> None:
    # 429: a maximum of millions fills the budget, or never fits it.
    assert answer.status_code in (200, 400, 422, 429), (answer.status_code, answer.text)
    if answer.status_code in (400, 422):
        assert_shape(answer, error_format, answer.status_code)
    if not isinstance(document, dict):
        assert answer.status_code == 400


@pytest.mark.parametrize("error_format", ["openai", "anthropic"])
def test_any_json_value_is_answered_never_with_a_500(blocking_limiter: RateLimiter,
                                                     error_format: str) -> None:
    with TestClient(gateway(blocking_limiter, error_format)) as client:
        @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(document=JSON_VALUES | REQUESTS)
        def check(document: object) -> None:
            content = json.dumps(document).encode()  # NaN and Infinity written as such
            answer = client.post("/v1/chat/completions", headers=JSON_HEADERS, content=content)
            check_answer(answer, error_format, document)
            if isinstance(document, dict) and answer.status_code == 400:
                raise AssertionError(f"a JSON object was refused as malformed: {answer.text}")

        check()


@pytest.mark.parametrize("error_format", ["openai", "anthropic"])
def test_any_bytes_are_answered_never_with_a_500(blocking_limiter: RateLimiter, error_format: str) -> None:
    with TestClient(gateway(blocking_limiter, error_format)) as client:
        @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(content=st.binary(max_size=64) | st.text(max_size=64).map(str.encode),
               content_type=st.sampled_from([None, "application/json", "text/plain"]))
        def check(content: bytes, content_type: str | None) -> None:
            headers = {"content-type": content_type} if content_type else {}
            answer = client.post("/v1/chat/completions", headers=headers, content=content)
            try:
                document: object = json.loads(content)
            except (ValueError, RecursionError):
                document = None
            if not content and content_type != "application/json":
                document = {}  # no body, none announced: a request like any other
            check_answer(answer, error_format, document)

        check()


def test_the_fuzz_strategies_reach_the_issues_cases() -> None:
    # The JSON strategy writes non-finite floats (1e400 is read back as inf).
    assert math.isinf(json.loads(json.dumps({"max_tokens": math.inf}))["max_tokens"])
