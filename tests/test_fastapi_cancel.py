"""A client that disconnects while the dependency's in-flight acquire is on Redis, under a
real uvicorn whose app cancels the request's work when its client goes away (a common ASGI
middleware: nothing is left running for nobody). The cancelled acquire's script still
grants the slot on Redis; the slot must come back once its reply is in, not lease_seconds
later. Redis writes are paused (CLIENT PAUSE) to hold the acquire on the server for as long
as the test needs; every step waits on a condition, never on a guessed sleep."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from helpers_core import commandstats
from helpers_uvicorn import HTTPX_SOCKETS, UvicornServer

pytestmark = [
    HTTPX_SOCKETS,
    pytest.mark.not_asan(reason="its limiter runs in a uvicorn server process, which this "
                                "process's ASan does not reach"),
    pytest.mark.no_hiredis1(reason="its limiter runs in a uvicorn server process, on the codec "
                                   "and pipeline the async tests drive on hiredis 1.x"),
]

USER = "user_leaving"
TIERS = {"free": {"per_minute": 1000, "per_day": 100_000, "max_in_flight": 1}}

APP = '''
import os
from pathlib import Path

import anyio
from fastapi import Depends, FastAPI

from genai_ratelimit import AsyncRateLimiter
from genai_ratelimit.fastapi import RateLimit, RateLimitHeadersMiddleware

SIGNALS = Path(os.environ["SIGNAL_DIR"])
limit = RateLimit(limiter=AsyncRateLimiter(), lease_seconds=300)


class CancelOnDisconnect:
    """Cancels the app's work on a request once its client disconnects before the app is
    done (and then touches the file "cancelled-<x-request>"); x-user: <id> becomes
    request.state.user_id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if b"x-user" in headers:
            scope.setdefault("state", {})["user_id"] = headers[b"x-user"].decode()
        request_id = headers.get(b"x-request", b"-").decode()
        gone = anyio.Event()
        body_read = False
        done = False

        async def app_receive():  # a request without a body, then the disconnect
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async with anyio.create_task_group() as group:
            async def watch():
                while (await receive())["type"] != "http.disconnect":
                    pass
                if done:
                    return
                gone.set()
                group.cancel_scope.cancel()
                (SIGNALS / f"cancelled-{request_id}").touch()

            group.start_soon(watch)
            await self.app(scope, app_receive, send)
            done = True
            group.cancel_scope.cancel()


app = FastAPI()
app.add_middleware(RateLimitHeadersMiddleware)
app.add_middleware(CancelOnDisconnect)


@app.get("/healthz")  # the readiness probe: no x-user
async def healthz():
    return {}


@app.get("/work", dependencies=[Depends(limit)])
async def work():
    return {"ok": True}
'''


@pytest.fixture(scope="module")
def signals(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("signals")


@pytest.fixture(scope="module")
def server(redis_url: str, signals: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[UvicornServer]:
    tiers = tmp_path_factory.mktemp("tiers") / "tiers.json"
    tiers.write_text(json.dumps(TIERS))
    served = UvicornServer(APP, {"REDIS_URL": redis_url, "SIGNAL_DIR": str(signals),
                                 "GENAI_RATELIMIT_TIERS": str(tiers), "RATE_LIMIT_DISABLED": ""})
    served.start()
    try:
        yield served
    finally:
        served.close()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)  # polling a condition, bounded by the deadline


def leases(client: redis.Redis) -> int:
    return int(client.zcard(f"ratelimit:{USER}:leases"))


def test_a_client_gone_while_its_slot_is_being_taken_leaves_no_slot(
        server: UvicornServer, redis_client: redis.Redis, signals: Path) -> None:
    with server.client(timeout=10.0) as client:
        assert client.get("/work", headers={"x-user": USER}).status_code == 200  # warm
    assert leases(redis_client) == 0
    request_id = uuid.uuid4().hex
    redis_client.config_resetstat()
    redis_client.execute_command("CLIENT", "PAUSE", "10000", "WRITE")
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as leaving:
            leaving.sendall(f"GET /work HTTP/1.1\r\nHost: test\r\nx-user: {USER}\r\n"
                            f"x-request: {request_id}\r\n\r\n".encode())
            wait_for(lambda: int(redis_client.info("clients")["blocked_clients"]) >= 1,
                     "the dependency's acquire waits on the paused server")
        wait_for((signals / f"cancelled-{request_id}").exists,
                 "the app cancelled the request's work")
    finally:
        redis_client.execute_command("CLIENT", "UNPAUSE")
    wait_for(lambda: commandstats(redis_client).get("evalsha", 0) >= 1,
             "the acquire's script ran")
    wait_for(lambda: leases(redis_client) == 0, "the slot nobody holds is free again",
             timeout=5.0)
    with server.client(timeout=10.0) as client:
        assert client.get("/work", headers={"x-user": USER}).status_code == 200
