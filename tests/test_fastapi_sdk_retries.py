"""The real `openai` and `anthropic` SDKs, with their default retries, as clients of a real
uvicorn serving a RateLimit in each error format:

- the SDK's error object carries our message, type and code;
- a refusal that frees in about 2 s: the SDK sleeps what retry-after-ms says (within 50 ms
  of the exact wait the script computed) and its retry succeeds;
- a day-window refusal (x-should-retry: false): both SDKs give up at once;
- a concurrency 429 (max_in_flight, Retry-After: in_flight_retry_after = 1 s): the SDK
  retries and succeeds once the held stream ends (on a signal);
- a concurrency 429 with the limiter's hint (no in_flight_retry_after): streams held 3 s
  and 12 s, the SDK's default retries reach the 200, none waits more than twice the hold;
- a client that reads remaining + reset on allowed responses paces itself and is never
  refused (slow: it waits out one minute window).

The time of each attempt is taken by the SDK's own HTTP client (event hooks): the wait is
from the refused response's arrival to the retry's sending."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import anthropic
import openai
import pytest
import redis

from helpers_uvicorn import HTTPX_SOCKETS, UvicornServer
from redis_server import free_port
from test_fastapi import prefill, server_now_ms

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    HTTPX_SOCKETS,
    pytest.mark.not_asan(reason="its limiters run in a uvicorn server process (the SDKs are the clients), "
                                "which this process's ASan does not reach"),
    pytest.mark.no_hiredis1(reason="its limiters run in uvicorn server processes, on the codec and pipeline"
                                   " the async tests drive on hiredis 1.x"),
]

APP = '''
import os
from fastapi import Depends, FastAPI, Request
from genai_ratelimit import AsyncRateLimiter
from genai_ratelimit.fastapi import RateLimit, RateLimitHeadersMiddleware


def identify(request: Request):
    """Stands in for an app's auth: the API key the SDK sends is the user id."""
    key = request.headers.get("x-api-key") or request.headers.get("authorization", "")
    return key.removeprefix("Bearer "), "free"


limiter = AsyncRateLimiter(os.environ["REDIS_URL"])
app = FastAPI()
app.add_middleware(RateLimitHeadersMiddleware)


@app.post("/openai/v1/chat/completions",
          dependencies=[Depends(RateLimit(limiter, identify=identify, error_format="openai"))])
async def chat():
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "demo-1",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}]}


@app.post("/anthropic/v1/messages",
          dependencies=[Depends(RateLimit(limiter, identify=identify, error_format="anthropic"))])
async def messages():
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "demo-1",
            "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}


# max_in_flight: one request per user in flight; a held stream ends on a signal (/release).
import asyncio
from fastapi.responses import StreamingResponse

HELD: dict[str, asyncio.Event] = {}


def capped(error_format):
    return RateLimit(limiter, identify=identify, error_format=error_format,
                     tier_limits={"free": {"per_minute": 1000, "per_day": 100000}},
                     namespace=f"capped-{error_format}", max_in_flight={"free": 1},
                     in_flight_retry_after=1)


CAPPED = {name: capped(name) for name in ("openai", "anthropic")}


async def held_stream(request: Request):
    key = identify(request)[0]
    HELD[key] = asyncio.Event()

    async def chunks():
        yield "data: held\\n\\n"
        await HELD[key].wait()
        yield "data: [DONE]\\n\\n"
    return StreamingResponse(chunks(), media_type="text/event-stream")


for _name in ("openai", "anthropic"):
    app.add_api_route(f"/hold/{_name}", held_stream, dependencies=[Depends(CAPPED[_name])])


@app.post("/release/{key}")
async def release(key: str):
    HELD[key].set()
    return {}


@app.post("/capped/openai/v1/chat/completions", dependencies=[Depends(CAPPED["openai"])])
async def capped_chat():
    return await chat()


@app.post("/capped/anthropic/v1/messages", dependencies=[Depends(CAPPED["anthropic"])])
async def capped_messages():
    return await messages()


# The same cap without in_flight_retry_after: the 429 announces the limiter's hint (the hold
# history of the cap). /timed/{name}?seconds= streams for that long, then ends.
def hinted(error_format):
    return RateLimit(limiter, identify=identify, error_format=error_format,
                     tier_limits={"free": {"per_minute": 1000, "per_day": 100000}},
                     namespace=f"hinted-{error_format}", max_in_flight={"free": 1})


HINTED = {name: hinted(name) for name in ("openai", "anthropic")}


async def timed_stream(seconds: float):
    async def chunks():
        yield "data: held\\n\\n"
        await asyncio.sleep(seconds)
        yield "data: [DONE]\\n\\n"
    return StreamingResponse(chunks(), media_type="text/event-stream")


for _name in ("openai", "anthropic"):
    app.add_api_route(f"/timed/{_name}", timed_stream, dependencies=[Depends(HINTED[_name])])


@app.post("/hinted/openai/v1/chat/completions", dependencies=[Depends(HINTED["openai"])])
async def hinted_chat():
    return await chat()


@app.post("/hinted/anthropic/v1/messages", dependencies=[Depends(HINTED["anthropic"])])
async def hinted_messages():
    return await messages()


@app.get("/healthz")
async def healthz():
    return {"ok": True}
'''

FORMATS = ("openai", "anthropic")
MESSAGES = [{"role": "user", "content": "hello"}]


class Server(UvicornServer):
    """APP under `python -m uvicorn` on a free loopback port (helpers_uvicorn.UvicornServer)."""

    def __init__(self, redis_url: str) -> None:
        super().__init__(APP, {"REDIS_URL": redis_url, "GENAI_RATELIMIT_TIERS": "",
                               "RATE_LIMIT_DISABLED": ""})


@pytest.fixture(scope="module")
def server(redis_url: str) -> Iterator[Server]:
    served = Server(redis_url)
    served.start()
    try:
        yield served
    finally:
        served.stop()


class Attempts:
    """What the SDK's HTTP client saw: each request's send time, each response's arrival
    time, status and headers (time.monotonic())."""

    def __init__(self) -> None:
        self.sent: list[float] = []
        self.answered: list[tuple[float, int, dict[str, str]]] = []

    def on_request(self, request: Any) -> None:
        self.sent.append(time.monotonic())

    def on_response(self, response: Any) -> None:
        self.answered.append((time.monotonic(), response.status_code, dict(response.headers)))

    def hooks(self) -> dict[str, list[Any]]:
        return {"request": [self.on_request], "response": [self.on_response]}


def make_sdk(error_format: str, server: Server, api_key: str, attempts: Attempts,
             max_retries: int | None = None, prefix: str = "") -> Any:
    options: dict[str, Any] = {"api_key": api_key, "timeout": 10.0}
    if max_retries is not None:
        options["max_retries"] = max_retries
    if error_format == "openai":
        return openai.OpenAI(base_url=server.base_url + prefix + "/openai/v1",
                             http_client=openai.DefaultHttpxClient(event_hooks=attempts.hooks()), **options)
    return anthropic.Anthropic(base_url=server.base_url + prefix + "/anthropic",
                               http_client=anthropic.DefaultHttpxClient(event_hooks=attempts.hooks()),
                               **options)


def call(error_format: str, sdk: Any) -> Any:
    """One request through the SDK; returns the raw response (headers and parsed body)."""
    if error_format == "openai":
        return sdk.chat.completions.with_raw_response.create(model="demo-1", messages=MESSAGES)
    return sdk.messages.with_raw_response.create(model="demo-1", max_tokens=16, messages=MESSAGES)


def rate_limit_error(error_format: str) -> type[Exception]:
    return openai.RateLimitError if error_format == "openai" else anthropic.RateLimitError


def error_object(error: Any) -> dict[str, Any]:
    """Our error object as the SDK keeps it: openai's .body is the `error` object itself,
    anthropic's the whole body."""
    body: dict[str, Any] = error.body
    return body["error"] if "error" in body else body


@pytest.fixture
def api_key(redis_client: redis.Redis) -> str:
    """A fresh user (the API key is the user id), on a Redis database flushed for this test."""
    return f"key-{os.urandom(6).hex()}"


@pytest.mark.parametrize("error_format", FORMATS)
def test_the_sdks_error_carries_our_message_and_code(
        server: Server, redis_client: redis.Redis, api_key: str, error_format: str) -> None:
    attempts = Attempts()
    sdk = make_sdk(error_format, server, api_key, attempts, max_retries=0)
    for _ in range(5):
        call(error_format, sdk)
    with pytest.raises(rate_limit_error(error_format)) as caught:
        call(error_format, sdk)
    sdk.close()
    error: Any = caught.value
    message = error_object(error)["message"]
    assert message.startswith("Rate limit reached on requests per min (RPM): Limit 5, Requested 1. "
                              "Please try again in ")
    assert message in str(error)
    if error_format == "openai":
        assert (error.code, error.type) == ("rate_limit_exceeded", "requests")
    else:
        assert error.body["type"] == "error" and error.body["error"]["type"] == "rate_limit_error"
    assert error.response.headers["x-should-retry"] == "true"


@pytest.mark.parametrize("error_format", FORMATS)
def test_the_sdks_default_retry_waits_the_exact_wait_and_then_succeeds(
        server: Server, redis_client: redis.Redis, api_key: str, error_format: str) -> None:
    # Five requests in the last minute, the oldest 57 s ago: the next one passes in 3 s, less
    # the time the request takes to arrive (seconds on a loaded machine).
    prefilled_at = time.monotonic()  # before the server's clock is read: a lower bound
    now = server_now_ms(redis_client)
    prefill(redis_client, f"ratelimit:{api_key}:60", [now - 57_000] + [now - 1000] * 4)
    attempts = Attempts()
    sdk = make_sdk(error_format, server, api_key, attempts)  # the SDK's default retries
    response = call(error_format, sdk)
    sdk.close()
    assert response.http_response.status_code == 200
    statuses = [status for _, status, _ in attempts.answered]
    assert statuses == [429, 200], statuses
    refused_at, _, headers = attempts.answered[0]
    exact_s = int(headers["retry-after-ms"]) / 1000
    # The exact wait is 3 s from the prefill's clock reading, less what passed until the decision.
    assert 3.0 - (refused_at - prefilled_at) - 0.005 <= exact_s <= 3.0, (exact_s, refused_at - prefilled_at)
    waited = attempts.sent[1] - refused_at
    print(f"{error_format}: exact wait {exact_s * 1000:.0f} ms, the SDK waited {waited * 1000:.1f} ms")
    assert abs(waited - exact_s) < 0.050, (waited, exact_s)


@pytest.mark.parametrize("error_format", FORMATS)
def test_a_day_window_refusal_makes_the_sdk_give_up_at_once(
        server: Server, redis_client: redis.Redis, api_key: str, error_format: str) -> None:
    now = server_now_ms(redis_client)
    prefill(redis_client, f"ratelimit:{api_key}:86400", [now - 3_600_000] * 100)
    attempts = Attempts()
    sdk = make_sdk(error_format, server, api_key, attempts)  # the SDK's default retries
    started = time.monotonic()
    with pytest.raises(rate_limit_error(error_format)) as caught:
        call(error_format, sdk)
    elapsed = time.monotonic() - started
    sdk.close()
    assert elapsed < 1.0
    assert len(attempts.sent) == 1  # no retry at all
    error: Any = caught.value
    assert error.response.headers["x-should-retry"] == "false"
    assert "requests per day (RPD): Limit 100" in error_object(error)["message"]


def openai_reset_seconds(text: str) -> float:
    """OpenAI's durations ("1m0s", "59.9s", "120ms", "1h2m3s") in seconds."""
    total, number = 0.0, ""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0}
    index = 0
    while index < len(text):
        char = text[index]
        if char.isdigit() or char == ".":
            number += char
        elif text.startswith("ms", index):
            total, number, index = total + float(number) / 1000, "", index + 1
        else:
            total, number = total + float(number) * units[char], ""
        index += 1
    return total


def pace(error_format: str, server: Server, api_key: str, count: int, statuses: list[int]) -> None:
    """A client that paces itself on the allowed responses' headers: when nothing remains,
    it waits until the reset the headers name. max_retries=0: a 429 would raise."""
    attempts = Attempts()
    sdk = make_sdk(error_format, server, api_key, attempts, max_retries=0)
    try:
        for _ in range(count):
            raw = call(error_format, sdk)
            statuses.append(raw.http_response.status_code)
            if error_format == "openai":
                remaining = int(raw.headers["x-ratelimit-remaining-requests"])
                wait = openai_reset_seconds(raw.headers["x-ratelimit-reset-requests"])
            else:
                remaining = int(raw.headers["anthropic-ratelimit-requests-remaining"])
                reset = datetime.strptime(raw.headers["anthropic-ratelimit-requests-reset"],
                                          "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
                wait = reset.timestamp() - time.time()
            if remaining == 0:
                time.sleep(max(0.0, wait))  # what the server said, not a guess
    finally:
        sdk.close()


@pytest.mark.slow
def test_clients_that_pace_on_remaining_and_reset_are_never_refused(
        server: Server, redis_client: redis.Redis) -> None:
    results: dict[str, list[int]] = {name: [] for name in FORMATS}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            pace(name, server, f"pacer-{name}-{os.urandom(4).hex()}", 8, results[name])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in FORMATS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    assert not errors, errors
    assert results == {name: [200] * 8 for name in FORMATS}


@pytest.fixture(scope="module")
def server_without_redis() -> Iterator[Server]:
    served = Server(f"redis://127.0.0.1:{free_port()}/0")  # a closed port: Redis is down
    served.start()
    try:
        yield served
    finally:
        served.stop()


@pytest.mark.parametrize("error_format", FORMATS)
def test_the_sdks_503_error_carries_our_message_when_redis_is_down(
        server_without_redis: Server, error_format: str) -> None:
    attempts = Attempts()
    sdk = make_sdk(error_format, server_without_redis, "key-down", attempts, max_retries=0)
    error_type = openai.InternalServerError if error_format == "openai" else anthropic.InternalServerError
    with pytest.raises(error_type) as caught:
        call(error_format, sdk)
    sdk.close()
    error: Any = caught.value
    assert error.status_code == 503
    assert error.response.headers["retry-after"] == "1"
    assert error.response.headers["x-should-retry"] == "true"
    payload = error_object(error)
    assert "rate limiter is temporarily unavailable" in payload["message"]
    if error_format == "openai":
        assert (error.code, error.type) == ("service_unavailable", "server_error")
    else:
        assert payload["type"] == "overloaded_error"


@pytest.mark.parametrize("error_format", FORMATS)
def test_the_sdks_retry_a_concurrency_429_and_succeed_once_the_held_stream_ends(
        error_format: str, server: Server, api_key: str) -> None:
    """A user's one slot held by a stream; the SDK (default retries) is refused for
    concurrency with Retry-After: 1 (in_flight_retry_after), the stream ends on a signal as
    soon as the 429 arrived, and the SDK's retry succeeds."""
    import httpx

    refused = threading.Event()
    attempts = Attempts()

    record = attempts.on_response

    def on_response(response: Any) -> None:
        record(response)
        if response.status_code == 429:
            refused.set()

    attempts.on_response = on_response  # type: ignore[method-assign]
    result: dict[str, Any] = {}
    with httpx.Client(base_url=server.base_url, timeout=10.0) as http, \
            http.stream("GET", f"/hold/{error_format}",
                        headers={"Authorization": f"Bearer {api_key}"}) as held:
        assert held.status_code == 200
        chunks = held.iter_text()  # kept: a dropped iterator closes the stream (a disconnect)
        assert next(chunks).startswith("data: held")

        sdk = make_sdk(error_format, server, api_key, attempts, prefix="/capped")

        def run() -> None:
            try:
                result["response"] = call(error_format, sdk)
            except Exception as exc:  # noqa: BLE001 (reported below)
                result["error"] = exc

        caller = threading.Thread(target=run)
        caller.start()
        assert refused.wait(10), ("the SDK was never refused", attempts.answered, result)
        first = attempts.answered[0][2]
        assert (first["retry-after"], first["retry-after-ms"]) == ("1", "1000")
        assert first["x-should-retry"] == "true"
        assert first["x-ratelimit-window"] == "concurrent"
        http.post(f"/release/{api_key}").raise_for_status()
        assert "".join(chunks).endswith("data: [DONE]\n\n")
        caller.join(30)
        sdk.close()  # its connections: left open, they warn at the end of the session
    assert "error" not in result, result.get("error")
    assert result["response"].http_response.status_code == 200
    statuses = [status for _, status, _ in attempts.answered]
    assert statuses[0] == 429 and statuses[-1] == 200
    # The SDK waited what Retry-After said (1 s), not the lease's 300 s.
    assert 0.9 <= attempts.sent[1] - attempts.answered[0][0] < 5


def hold_then_call(error_format: str, server: Server, api_key: str, seconds: float,
                   warm: bool) -> dict[str, Any]:
    """A stream of `api_key` held `seconds` on the hinted cap of one (after a first one held as
    long, when `warm`: the cap's history), and the SDK's call (default retries) sent as soon as
    the stream holds the slot. What the SDK saw: the hints of its 429s, its statuses, the time
    from its first send to its 200, the hold as the stream's client saw it."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"}
    attempts, result = Attempts(), {}
    with httpx.Client(base_url=server.base_url, timeout=seconds + 10) as http:
        if warm:
            with http.stream("GET", f"/timed/{error_format}", params={"seconds": seconds},
                             headers=headers) as first:
                assert first.status_code == 200
                assert "".join(first.iter_text()).endswith("data: [DONE]\n\n")
        with http.stream("GET", f"/timed/{error_format}", params={"seconds": seconds},
                         headers=headers) as held:
            assert held.status_code == 200
            chunks = held.iter_text()
            assert next(chunks).startswith("data: held")
            held_from = time.monotonic()  # the slot was taken before: the hold is longer
            sdk = make_sdk(error_format, server, api_key, attempts, prefix="/hinted")

            def run() -> None:
                try:
                    result["response"] = call(error_format, sdk)
                except Exception as exc:  # noqa: BLE001 (reported by the test)
                    result["error"] = exc

            caller = threading.Thread(target=run)
            caller.start()
            assert "".join(chunks).endswith("data: [DONE]\n\n")
            hold = time.monotonic() - held_from
            caller.join(3 * seconds + 10)
            sdk.close()
    refusals = [headers for _, status, headers in attempts.answered if status == 429]
    return {
        "error": result.get("error"),
        "statuses": [status for _, status, _ in attempts.answered],
        "hints_ms": [int(headers["retry-after-ms"]) for headers in refusals],
        "windows": {headers["x-ratelimit-window"] for headers in refusals},
        "to_200": attempts.answered[-1][0] - attempts.sent[0] if attempts.answered else None,
        "hold": hold,
    }


@pytest.mark.parametrize(("seconds", "warm"), [
    (3, False),
    (3, True),
    pytest.param(12, True, marks=pytest.mark.slow),
], ids=["3s-no-history", "3s", "12s"])
def test_the_sdks_retries_span_the_held_stream_with_the_limiters_hint(
        server: Server, redis_client: redis.Redis, seconds: float, warm: bool) -> None:
    """Both SDKs at once (a user each), default retries, on a cap of one request in flight
    held `seconds` by a stream: every request is answered 200, neither SDK gives up, and
    neither waits more than twice the hold. With no history the hint is 5 s (two retries span
    10 s); with one the hint is the average hold less how long the held stream has run."""
    outcomes: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            outcomes[name] = hold_then_call(name, server, f"hint-{name}-{os.urandom(4).hex()}",
                                            seconds, warm)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in FORMATS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(6 * seconds + 30)
    assert not errors, errors
    for name, seen in outcomes.items():
        print(f"{name}, stream held {seconds} s ({'with' if warm else 'no'} history): hints "
              f"{seen['hints_ms']} ms, statuses {seen['statuses']}, 200 after {seen['to_200']:.2f} s "
              f"(the hold as its client saw it: {seen['hold']:.2f} s)")
        assert seen["error"] is None, (name, seen)
        assert seen["statuses"][-1] == 200 and seen["statuses"][0] == 429, (name, seen)
        assert seen["windows"] == {"concurrent"}, (name, seen)
        assert seen["to_200"] <= 2 * seconds, (name, seen)
        if not warm:
            assert seen["hints_ms"][0] == 5_000, (name, seen)
        else:  # the average hold (the first stream's) less the little the second one has run
            assert seconds * 1000 - 2_500 <= seen["hints_ms"][0] <= seconds * 1000 + 500, (name, seen)
