"""A waiting request whose client disconnects leaves the upstream's queue at once: a real
uvicorn server, real client sockets closed while their request waits, the queue read in the
session's real redis-server. Both dependencies (RateLimit, TokenRateLimit), both queues (a
window cap's, reserve(max_wait=...), and an in-flight cap's, acquire(max_wait=...)); and a
body-carrying request that waits and is admitted still gets its whole body in the route."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from helpers_uvicorn import HTTPX_SOCKETS, UvicornServer

pytestmark = [
    HTTPX_SOCKETS,
    pytest.mark.not_asan(reason="its limiters run in uvicorn server processes, which this process's ASan "
                                "does not reach"),
    pytest.mark.no_hiredis1(reason="its limiters run in uvicorn server processes, on the codec and pipeline"
                                   " the async tests drive on hiredis 1.x"),
]

APP = '''
import asyncio
import hashlib
import os
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse

from genai_ratelimit import AsyncRateLimiter, RateLimiter
from genai_ratelimit.fastapi import RateLimit, RateLimitHeadersMiddleware, TokenRateLimit, Upstream
from genai_ratelimit.metrics import request_outcomes

SIGNALS = Path(os.environ["SIGNAL_DIR"])
PREFIX = os.environ["UPSTREAM_PREFIX"]
limiter = AsyncRateLimiter() if os.environ["LIMITER"] == "async" else RateLimiter()
RUNS = []  # the users whose route ran
TIERS = {"free": {"per_minute": 100_000}}


def identify(request):
    return request.headers["x-user"], "free"


def dependency(kind, cap):
    upstream = (Upstream(f"{PREFIX}/{kind}/window", per_minute=1, max_wait=120) if cap == "window"
                else Upstream(f"{PREFIX}/{kind}/in-flight", in_flight=1, max_wait=60))
    make = RateLimit if kind == "requests" else TokenRateLimit
    return make(limiter, tier_limits=TIERS, identify=identify, upstream=upstream)


app = FastAPI()
app.add_middleware(RateLimitHeadersMiddleware)


@app.get("/healthz")
async def healthz():
    return {"ok": True}


@app.get("/abandoned")
async def abandoned():
    return {"count": request_outcomes(limiter).total(outcome="queue_abandoned"), "runs": RUNS}


def route(kind, cap):
    # No body parameter: FastAPI reads no body before the dependency; the route reads it.
    async def handler(request: Request, until: str = ""):
        RUNS.append(request.headers["x-user"])
        digest = hashlib.sha256(await request.body()).hexdigest()

        async def stream():
            yield digest + "\\n"
            while until and not (SIGNALS / until).exists():  # the test's signal ends it
                await asyncio.sleep(0.01)
            yield "done\\n"
        return StreamingResponse(stream(), media_type="text/plain")
    app.post(f"/{kind}/{cap}", dependencies=[Depends(dependency(kind, cap))])(handler)


for kind in ("requests", "tokens"):
    for cap in ("window", "in-flight"):
        route(kind, cap)
'''


BLOCKING_PREFIX = f"dc-sync-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def signals(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("signals")


@pytest.fixture(scope="module")
def prefix() -> str:
    return f"dc-{uuid.uuid4().hex[:8]}"


def serve(redis_url: str, signals: Path, prefix: str, limiter: str) -> Iterator[UvicornServer]:
    served = UvicornServer(APP, {"REDIS_URL": redis_url, "SIGNAL_DIR": str(signals),
                                 "UPSTREAM_PREFIX": prefix, "LIMITER": limiter,
                                 "RATE_LIMIT_DISABLED": ""})
    served.start()
    try:
        yield served
    finally:
        served.close()


@pytest.fixture(scope="module")
def server(redis_url: str, signals: Path, prefix: str) -> Iterator[UvicornServer]:
    yield from serve(redis_url, signals, prefix, "async")


@pytest.fixture(scope="module")
def blocking_server(redis_url: str, signals: Path) -> Iterator[UvicornServer]:
    yield from serve(redis_url, signals, BLOCKING_PREFIX, "sync")


class Client:
    """One HTTP/1.1 request over a socket of its own, sent at once; `response()` reads it."""

    def __init__(self, server: UvicornServer, path: str, user: str, body: bytes) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=90)
        head = (f"POST {path} HTTP/1.1\r\nHost: test\r\nx-user: {user}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                "connection: close\r\n\r\n").encode()
        self.sock.sendall(head + body)
        self.first_line = b""

    def response(self) -> bytes:
        chunks = []
        while chunk := self.sock.recv(65536):
            chunks.append(chunk)
        self.sock.close()
        return b"".join(chunks)

    def status_line(self) -> bytes:
        """Reads until the status line is in (the response is streamed: the rest follows)."""
        data = b""
        while b"\r\n" not in data:
            chunk = self.sock.recv(1)
            if not chunk:
                break
            data += chunk
        self.first_line = data
        return data

    def close(self) -> None:
        self.sock.close()


def body_of(size: int) -> bytes:
    """A JSON body of about `size` bytes (a TokenRateLimit estimates from it)."""
    return json.dumps({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "x" * size}]}).encode()


def queue_members(r: redis.Redis, name: str, in_flight: bool) -> list[bytes]:
    suffix = ":leases:queue" if in_flight else ":queue"
    keys = [key for key in r.scan_iter(match=f"*{name}*") if key.decode().endswith(suffix)]
    return [member for key in keys for member in r.zrange(key, 0, -1)]


def wait_for(check, timeout: float) -> float:
    """Polls `check()` (a Redis read) until true; how long it took. Fails past `timeout`."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.01)
    return time.monotonic() - start


def abandoned(server: UvicornServer) -> int:
    with server.client(timeout=10) as client:
        return int(client.get("/abandoned").json()["count"])


def users() -> tuple[str, str, str]:
    """Three users of their own (a user's token budget is not another test's)."""
    tag = uuid.uuid4().hex[:6]
    return f"alice-{tag}", f"bob-{tag}", f"carol-{tag}"


def runs(server: UvicornServer) -> list[str]:
    """The users whose route ran."""
    with server.client(timeout=10) as client:
        return list(client.get("/abandoned").json()["runs"])


@pytest.mark.parametrize("kind", ["requests", "tokens"])
def test_a_window_caps_waiter_that_disconnects_leaves_the_queue(
        server: UvicornServer, redis_url: str, prefix: str, kind: str) -> None:
    r = redis.Redis.from_url(redis_url)
    alice, bob, carol = users()
    name = f"{prefix}/{kind}/window"
    before = abandoned(server)
    first = Client(server, f"/{kind}/window", alice, body_of(10))
    assert first.response().startswith(b"HTTP/1.1 200")      # the cap's one a minute
    waiting = Client(server, f"/{kind}/window", bob, body_of(10))
    wait_for(lambda: len(queue_members(r, name, False)) == 1, 10)
    behind = Client(server, f"/{kind}/window", carol, body_of(10))
    wait_for(lambda: len(queue_members(r, name, False)) == 2, 10)
    (bob_ticket, carol_ticket) = queue_members(r, name, False)
    waiting.close()                                           # bob's client goes away
    took = wait_for(lambda: queue_members(r, name, False) == [carol_ticket], 5)
    assert took < 2, took                                     # at once, not at its deadline
    assert abandoned(server) == before + 1
    behind.close()
    wait_for(lambda: queue_members(r, name, False) == [], 5)
    assert abandoned(server) == before + 2
    assert bob not in runs(server) and carol not in runs(server)
    print(f"window/{kind}: the ticket left {took * 1000:.0f} ms after the close")


@pytest.mark.parametrize("kind", ["requests", "tokens"])
def test_an_in_flight_caps_waiter_that_disconnects_leaves_and_the_next_is_admitted(
        server: UvicornServer, redis_url: str, prefix: str, signals: Path, kind: str) -> None:
    r = redis.Redis.from_url(redis_url)
    alice, bob, carol = users()
    name = f"{prefix}/{kind}/in-flight"
    before = abandoned(server)
    release = f"release-{kind}-{uuid.uuid4().hex[:6]}"
    holder = Client(server, f"/{kind}/in-flight?until={release}", alice, body_of(10))
    assert holder.status_line().startswith(b"HTTP/1.1 200")    # it holds the one slot
    waiting = Client(server, f"/{kind}/in-flight", bob, body_of(10))
    wait_for(lambda: len(queue_members(r, name, True)) == 1, 10)
    # RateLimit reads no body: the watch receives it (more than one message's worth) while
    # carol waits. A TokenRateLimit read it for its estimate (a smaller one: its budget).
    big = body_of(300_000 if kind == "requests" else 20_000)
    behind = Client(server, f"/{kind}/in-flight", carol, big)
    try:
        wait_for(lambda: len(queue_members(r, name, True)) == 2, 10)
    except AssertionError:
        waiting.close()
        (signals / release).touch()
        raise AssertionError(behind.response()[:600]) from None
    carol_ticket = queue_members(r, name, True)[1]
    waiting.close()
    took = wait_for(lambda: queue_members(r, name, True) == [carol_ticket], 5)
    assert took < 1.5, took           # well before the 3 s a killed waiter's ticket lives
    assert abandoned(server) == before + 1
    admitted: list[bytes] = []
    reader = threading.Thread(target=lambda: admitted.append(behind.response()))
    reader.start()
    (signals / release).touch()                               # the holder's slot frees
    holder.response()
    reader.join(30)
    assert not reader.is_alive()
    response = admitted[0]
    assert response.startswith(b"HTTP/1.1 200"), response[:300]
    # The route read the whole body, though the watch received it while carol waited.
    assert hashlib.sha256(big).hexdigest().encode() in response
    assert queue_members(r, name, True) == []
    assert abandoned(server) == before + 1
    assert bob not in runs(server)
    print(f"in-flight/{kind}: the ticket left {took * 1000:.0f} ms after the close")


@pytest.mark.parametrize("kind", ["requests", "tokens"])
def test_a_blocking_limiters_waiter_that_disconnects_does_not_run_when_admitted(
        blocking_server: UvicornServer, redis_url: str, signals: Path, kind: str) -> None:
    """A RateLimiter's wait runs in FastAPI's threadpool, which cannot be cancelled: the
    ticket stays until its turn, but then the route does not run for nobody and the slot is
    free at once for the next waiter."""
    server = blocking_server
    r = redis.Redis.from_url(redis_url)
    alice, bob, carol = users()
    name = f"{BLOCKING_PREFIX}/{kind}/in-flight"
    before = abandoned(server)
    release = f"release-sync-{kind}-{uuid.uuid4().hex[:6]}"
    holder = Client(server, f"/{kind}/in-flight?until={release}", alice, body_of(10))
    assert holder.status_line().startswith(b"HTTP/1.1 200")
    waiting = Client(server, f"/{kind}/in-flight", bob, body_of(10))
    wait_for(lambda: len(queue_members(r, name, True)) == 1, 10)
    body = body_of(300_000 if kind == "requests" else 20_000)
    behind = Client(server, f"/{kind}/in-flight", carol, body)
    wait_for(lambda: len(queue_members(r, name, True)) == 2, 10)
    waiting.close()                   # noticed, but its thread waits on
    admitted: list[bytes] = []
    reader = threading.Thread(target=lambda: admitted.append(behind.response()))
    reader.start()
    (signals / release).touch()
    holder.response()
    reader.join(30)
    assert not reader.is_alive()
    assert admitted[0].startswith(b"HTTP/1.1 200"), admitted[0][:900]
    assert hashlib.sha256(body).hexdigest().encode() in admitted[0]
    assert abandoned(server) == before + 1
    assert bob not in runs(server) and carol in runs(server)
