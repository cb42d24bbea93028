"""max_in_flight over real HTTP: a FastAPI app under a real uvicorn (one worker, then four),
driven by real HTTP clients (httpx), counting against the session's real redis-server.

The app's streams stay open until the test creates their signal file, so nothing here rests
on a guessed sleep; how many run at once is counted server-side, in Redis, by the streams
themselves (INCR when one starts, DECR when it ends, and the peak), and read back with the
lease sorted set. The single-worker server runs once with an AsyncRateLimiter (the
dependency on uvicorn's loop) and once with a blocking RateLimiter (FastAPI's threadpool)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from helpers_uvicorn import HTTPX_SOCKETS, UvicornServer

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    HTTPX_SOCKETS,
    pytest.mark.not_asan(reason="its limiters run in uvicorn server processes, which this process's ASan "
                                "does not reach"),
    pytest.mark.no_hiredis1(reason="its limiters run in uvicorn server processes, on the codec and pipeline"
                                   " the async tests drive on hiredis 1.x"),
]

USER = "user_streamer"
CAP = 3
TIERS = {"free": {"per_minute": 1000, "per_day": 100_000, "max_in_flight": CAP}}

APP = '''
import asyncio
import os
from pathlib import Path

import anyio
import redis.asyncio as aioredis
from fastapi import Depends, FastAPI
from fastapi.responses import StreamingResponse

from genai_ratelimit import AsyncRateLimiter, RateLimiter
from genai_ratelimit.fastapi import RateLimit, RateLimitHeadersMiddleware

SIGNALS = Path(os.environ["SIGNAL_DIR"])
limiter = AsyncRateLimiter() if os.environ["LIMITER"] == "async" else RateLimiter()
limit = RateLimit(limiter=limiter, lease_seconds=int(os.environ["LEASE_SECONDS"]))
counts = aioredis.from_url(os.environ["REDIS_URL"])
# The streams running now, and the most that ever ran at once (for every worker).
enter = counts.register_script(
    "local n = redis.call('INCR', KEYS[1]) "
    "if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end "
    "return n")


class Identity:
    """x-user: <id> becomes request.state.user_id; every response says which worker sent it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"x-user":
                    scope.setdefault("state", {})["user_id"] = value.decode()

            async def send_with_pid(message):
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", ()),
                                                      (b"x-worker-pid", str(os.getpid()).encode())]}
                await send(message)

            return await self.app(scope, receive, send_with_pid)
        return await self.app(scope, receive, send)


app = FastAPI()
app.add_middleware(RateLimitHeadersMiddleware)
app.add_middleware(Identity)


@app.get("/healthz")
async def healthz():
    return {"pid": os.getpid()}


@app.post("/stream", dependencies=[Depends(limit)])
async def stream(until: str):
    async def body():
        await enter(keys=["running", "peak"])
        try:
            yield f"started {os.getpid()}\\n"
            while not (SIGNALS / until).exists():  # the test's signal ends the stream
                await asyncio.sleep(0.01)
            yield "done\\n"
        finally:
            with anyio.CancelScope(shield=True):  # counted down even when cancelled
                await counts.decr("running")
    return StreamingResponse(body(), media_type="text/plain")
'''


@pytest.fixture(scope="module")
def signals(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("signals")


def serve(redis_url: str, signals: Path, tmp: Path, *, limiter: str, workers: int,
          lease_seconds: int) -> Iterator[UvicornServer]:
    tiers = tmp / "tiers.json"
    tiers.write_text(json.dumps(TIERS))
    server = UvicornServer(APP, {
        "REDIS_URL": redis_url, "SIGNAL_DIR": str(signals), "LIMITER": limiter,
        "LEASE_SECONDS": str(lease_seconds), "GENAI_RATELIMIT_TIERS": str(tiers),
        "RATE_LIMIT_DISABLED": ""}, workers=workers)
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module", params=["async", "sync"])
def single(request: pytest.FixtureRequest, redis_url: str, signals: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[UvicornServer]:
    yield from serve(redis_url, signals, tmp_path_factory.mktemp("tiers"), limiter=request.param,
                     workers=1, lease_seconds=60)


@pytest.fixture(scope="module")
def four_workers(redis_url: str, signals: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[UvicornServer]:
    # Leases of 5 s: long enough to see a killed worker's slots still taken, short enough
    # to see them come back.
    yield from serve(redis_url, signals, tmp_path_factory.mktemp("tiers"), limiter="async",
                     workers=4, lease_seconds=5)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)  # polling a condition, bounded by the deadline


class Stream:
    """One streamed request in a thread of its own: its status and headers as soon as they
    come, its first line (the serving worker's pid), and how it ended."""

    def __init__(self, base_url: str, until: str, hanging_up: bool = False) -> None:
        self.base_url = base_url
        self.until = until
        self.status = 0
        self.headers: httpx.Headers | None = None
        self.pid = 0
        self.text = ""
        self.error: BaseException | None = None
        self.answered = threading.Event()
        self.started = threading.Event()
        self.hang_up = threading.Event()  # set: close the connection instead of reading on
        self.hanging_up = hanging_up  # True: wait for hang_up after the first line
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.Client(base_url=self.base_url, timeout=30.0) as client:
                with client.stream("POST", "/stream", params={"until": self.until},
                                   headers={"x-user": USER}) as response:
                    self.status, self.headers = response.status_code, response.headers
                    self.answered.set()
                    lines = response.iter_lines()
                    if response.status_code == 200:
                        first = next(lines)
                        self.pid = int(first.split()[1])
                        self.started.set()
                        if self.hanging_up:
                            # Leaving the block closes the response before its end: the
                            # connection is closed, as a client that goes away does.
                            self.hang_up.wait(20)
                            return
                        self.text = "".join(lines)  # to the end of the response
                    else:
                        self.text = response.read().decode()
        except BaseException as exc:  # a killed worker: the connection breaks
            self.error = exc
        finally:
            self.answered.set()
            self.finished.set()


def open_streams(server: UvicornServer, count: int, until: str,
                 hanging_up: bool = False) -> list[Stream]:
    streams = [Stream(server.base_url, until, hanging_up) for _ in range(count)]
    for stream in streams:
        assert stream.answered.wait(20), "no answer"
    admitted = [s for s in streams if s.status == 200]
    for stream in admitted:
        assert stream.started.wait(20), "an admitted stream never started"
    return streams


def lease_count(redis_client: redis.Redis) -> int:
    return redis_client.zcard(f"ratelimit:{USER}:leases")


def running(redis_client: redis.Redis, key: str = "running") -> int:
    return int(redis_client.get(key) or 0)


def check_refusals(streams: list[Stream]) -> None:
    for stream in streams:
        if stream.status == 200:
            continue
        assert stream.status == 429, stream.text
        assert stream.headers is not None
        assert stream.headers["X-RateLimit-Window"] == "concurrent"
        assert stream.headers["X-RateLimit-Limit"] == str(CAP)
        assert stream.headers["X-RateLimit-Remaining"] == "0"
        assert int(stream.headers["Retry-After"]) >= 1


def test_twenty_concurrent_streams_run_three_at_a_time(single: UvicornServer,
                                                       redis_client: redis.Redis,
                                                       signals: Path) -> None:
    until = uuid.uuid4().hex
    streams = open_streams(single, 20, until)
    statuses = sorted(s.status for s in streams)
    assert statuses == [200] * CAP + [429] * (20 - CAP)
    check_refusals(streams)
    assert running(redis_client) == CAP and lease_count(redis_client) == CAP
    assert redis_client.zcard(f"ratelimit:{USER}:60") == CAP  # refusals were not counted
    (signals / until).touch()
    for stream in streams:
        assert stream.finished.wait(20)
    assert all(s.text == "done" for s in streams if s.status == 200)
    # A client that read its whole response finds the slot free already.
    assert lease_count(redis_client) == 0
    assert running(redis_client, "peak") == CAP
    wait_for(lambda: running(redis_client) == 0, "every stream's generator ended")
    # All slots are free again: three new streams run.
    again = uuid.uuid4().hex
    assert [s.status for s in open_streams(single, CAP, again)] == [200] * CAP
    (signals / again).touch()


def test_a_client_that_disconnects_mid_stream_frees_its_slot(single: UvicornServer,
                                                             redis_client: redis.Redis,
                                                             signals: Path) -> None:
    until = uuid.uuid4().hex
    leaving = open_streams(single, 1, until, hanging_up=True)[0]
    streams = [leaving, *open_streams(single, CAP - 1, until)]
    assert [s.status for s in streams] == [200] * CAP and lease_count(redis_client) == CAP
    leaving.hang_up.set()
    assert leaving.finished.wait(10)
    wait_for(lambda: lease_count(redis_client) == CAP - 1, "the disconnected stream's slot is free")
    replacement = open_streams(single, 2, until)
    assert sorted(s.status for s in replacement) == [200, 429]
    (signals / until).touch()
    for stream in streams + replacement:
        assert stream.finished.wait(20)
    assert lease_count(redis_client) == 0


def test_four_workers_share_the_slots_exactly(four_workers: UvicornServer,
                                              redis_client: redis.Redis, signals: Path) -> None:
    pids: set[int] = set()
    for _ in range(5):  # waves until at least two workers answered (the kernel picks them)
        until = uuid.uuid4().hex
        streams = open_streams(four_workers, 20, until)
        assert sorted(s.status for s in streams) == [200] * CAP + [429] * (20 - CAP)
        check_refusals(streams)
        assert running(redis_client) == CAP and lease_count(redis_client) == CAP
        pids |= {int(s.headers["x-worker-pid"]) for s in streams if s.headers is not None}
        (signals / until).touch()
        for stream in streams:
            assert stream.finished.wait(20)
        assert lease_count(redis_client) == 0
        if len(pids) >= 2:
            break
    assert len(pids) >= 2, "every request went to one worker"
    assert running(redis_client, "peak") == CAP


def test_a_killed_worker_s_slots_free_after_lease_seconds(four_workers: UvicornServer,
                                                          redis_client: redis.Redis,
                                                          signals: Path) -> None:
    until = uuid.uuid4().hex
    streams = open_streams(four_workers, CAP, until)
    assert [s.status for s in streams] == [200] * CAP
    victim = streams[0].pid
    killed = [s for s in streams if s.pid == victim]
    four_workers.kill(victim)  # SIGKILL: no release, no finally of that worker runs
    for stream in killed:
        assert stream.finished.wait(10) and stream.error is not None
    (signals / until).touch()
    for stream in streams:
        assert stream.finished.wait(20)
    # The survivors gave their slots back; the killed worker's are still taken ...
    left = [score for _, score in redis_client.zrange(f"ratelimit:{USER}:leases", 0, -1,
                                                      withscores=True)]
    assert len(left) == len(killed)
    assert server_ms(redis_client) < min(left)  # (checked before they could expire)
    probe = uuid.uuid4().hex
    probes = open_streams(four_workers, CAP - len(killed) + 1, probe)
    assert sorted(s.status for s in probes) == [200] * (CAP - len(killed)) + [429]
    (signals / probe).touch()
    for stream in probes:
        assert stream.finished.wait(20)
    # ... until their leases expire, lease_seconds after they were taken.
    wait_for(lambda: lease_count(redis_client) == 0, "the killed worker's leases expired")
    assert server_ms(redis_client) >= max(left)
    again = uuid.uuid4().hex
    assert [s.status for s in open_streams(four_workers, CAP, again)] == [200] * CAP
    (signals / again).touch()


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000
