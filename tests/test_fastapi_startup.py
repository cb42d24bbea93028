"""A misconfigured app does not start, whichever documented way it was built.

The ways the README and docs/ build an app: `FastAPI()` + `app.add_middleware(
RateLimitHeadersMiddleware)` (README, getting-started.md, fastapi.md and most pages),
`FastAPI(lifespan=rate_limit_lifespan)` + the middleware (fastapi.md), a lifespan of one's
own around `rate_limit_lifespan` (fastapi.md), `FastAPI(middleware=[Middleware(...)])` and
an app wrapped in the middleware from outside (fastapi.md). Each app is one module's
source: run in a TestClient (`with TestClient(app)` runs the lifespan) on every limiter kind,
and served by a real uvicorn process. The misconfiguration: two dependencies whose budgets
differ on the same keys; with the lifespan and no middleware, also a max_in_flight without
the middleware that releases its slots."""

from __future__ import annotations

import textwrap
import time
from typing import Any

import pytest
import redis

from helpers_uvicorn import HTTPX_SOCKETS, UvicornServer
from test_fastapi import _built_in_tiers, client_options  # noqa: F401 (fixture)

pytestmark = [
    pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async "
                                   "tests drive on hiredis 1.x"),
]

NOT_ASAN = pytest.mark.not_asan(reason="its limiters run in uvicorn server processes, which this "
                                       "process's ASan does not reach")

HEAD = """\
import contextlib

from fastapi import Depends, FastAPI
from starlette.middleware import Middleware

from genai_ratelimit import AsyncRateLimiter
from genai_ratelimit.fastapi import RateLimit, RateLimitHeadersMiddleware, rate_limit_lifespan

limiter = {limiter}
five = RateLimit(limiter=limiter, tier_limits={{"free": {{"per_minute": 5, "per_day": 100}}}})
other = RateLimit(limiter=limiter, tier_limits={{"free": {{"per_minute": {other}, "per_day": 100}}}},
                  {in_flight})


@contextlib.asynccontextmanager
async def lifespan(app):   # a lifespan of one's own (fastapi.md): the ways "own_lifespan*"
    async with rate_limit_lifespan(app):
        yield

"""

# How each way builds `api` (the FastAPI app whose routes are limited) and `app` (what is served).
WAYS = {
    "add_middleware": """\
        app = api = FastAPI()
        app.add_middleware(RateLimitHeadersMiddleware)
        """,
    "lifespan": """\
        app = api = FastAPI(lifespan=rate_limit_lifespan)
        app.add_middleware(RateLimitHeadersMiddleware)
        """,
    "own_lifespan": """\
        app = api = FastAPI(lifespan=lifespan)
        app.add_middleware(RateLimitHeadersMiddleware)
        """,
    "middleware_keyword": """\
        app = api = FastAPI(middleware=[Middleware(RateLimitHeadersMiddleware)])
        """,
    "wrapped": """\
        api = FastAPI()
        app = RateLimitHeadersMiddleware(api)
        """,
    "lifespan_without_middleware": """\
        app = api = FastAPI(lifespan=rate_limit_lifespan)
        """,
    "own_lifespan_without_middleware": """\
        app = api = FastAPI(lifespan=lifespan)
        """,
}

ROUTES = """
@api.get("/v1/chat", dependencies=[Depends(five), Depends(other)])
async def chat():
    return {"ok": True}


@api.get("/healthz")
async def healthz():
    return {"ok": True}
"""

TWO_BUDGETS = "would count in the same keys"
NO_MIDDLEWARE = "max_in_flight needs RateLimitHeadersMiddleware"
# (way, misconfiguration): the message the app is refused with.
REFUSED = [(way, "two budgets", TWO_BUDGETS) for way in WAYS] + [
    (way, "max_in_flight without the middleware", NO_MIDDLEWARE)
    for way in WAYS if way.endswith("without_middleware")]


def source(way: str, limiter: str, misconfiguration: str | None) -> str:
    return (HEAD.format(limiter=limiter, other=7 if misconfiguration == "two budgets" else 5,
                        in_flight="max_in_flight={'free': 2}"
                        if misconfiguration == "max_in_flight without the middleware" else "")
            + textwrap.dedent(WAYS[way]) + ROUTES)


def build(way: str, native: Any, misconfiguration: str | None) -> Any:
    namespace: dict[str, Any] = {"LIMITER": native}
    exec(compile(source(way, "LIMITER", misconfiguration), f"<{way}>", "exec"), namespace)
    return namespace["app"]


# --- TestClient: `with TestClient(app)` runs the lifespan ------------------------------------------


@pytest.mark.parametrize(("way", "misconfiguration", "message"), REFUSED)
def test_a_misconfigured_app_does_not_start_in_a_test_client(
        way: str, misconfiguration: str, message: str, make_limiter: Any, redis_url: str,
        redis_client: redis.Redis) -> None:
    from fastapi.testclient import TestClient

    from genai_ratelimit.fastapi import RateLimitConfigError

    app = build(way, make_limiter.native(redis_url), misconfiguration)
    started = []
    with pytest.raises(RateLimitConfigError, match=message):
        with TestClient(app, **client_options(make_limiter)):
            started.append(True)   # not reached: the lifespan's start-up failed
    assert started == []
    assert redis_client.keys("*") == []


@pytest.mark.parametrize("way", WAYS)
def test_a_well_configured_app_starts_in_a_test_client(
        way: str, make_limiter: Any, redis_url: str, redis_client: redis.Redis) -> None:
    from fastapi.testclient import TestClient

    app = build(way, make_limiter.native(redis_url), None)
    with TestClient(app, **client_options(make_limiter)) as client:
        answers = [client.get("/v1/chat").status_code for _ in range(6)]
    assert answers == [200] * 5 + [429]   # the two dependencies count each request once


def test_the_checks_run_once_with_both_the_lifespan_and_the_middleware(
        make_limiter: Any, redis_url: str, redis_client: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    from genai_ratelimit.fastapi import _startup

    runs: list[object] = []
    check = _startup.check_dependencies

    def counted(*args: Any, **kwargs: Any) -> None:
        runs.append(args)
        check(*args, **kwargs)

    monkeypatch.setattr(_startup, "check_dependencies", counted)
    app = build("lifespan", make_limiter.native(redis_url), None)
    with TestClient(app, **client_options(make_limiter)) as client:
        assert client.get("/v1/chat").status_code == 200
    assert len(runs) == 1


def test_without_lifespan_and_middleware_the_first_request_finds_it(
        make_limiter: Any, redis_url: str, redis_client: redis.Redis) -> None:
    """Nothing of the package sees such an app start: each request answers 500 (logged),
    and nothing is counted."""
    from fastapi.testclient import TestClient

    app = build("wrapped", make_limiter.native(redis_url), "two budgets").app   # the bare app
    with TestClient(app, raise_server_exceptions=False, **client_options(make_limiter)) as client:
        assert [client.get("/v1/chat").status_code for _ in range(2)] == [500, 500]
    assert redis_client.keys("*") == []


# --- a real uvicorn process ------------------------------------------------------------------------


@HTTPX_SOCKETS
@NOT_ASAN
@pytest.mark.parametrize(("way", "misconfiguration", "message"), REFUSED)
def test_a_misconfigured_app_does_not_start_in_uvicorn(
        way: str, misconfiguration: str, message: str, redis_url: str,
        redis_client: redis.Redis) -> None:
    server = UvicornServer(source(way, f"AsyncRateLimiter({redis_url!r})", misconfiguration), {})
    try:
        process = server.spawn()
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            assert not server._ready(), f"the misconfigured app started and answers:\n{server.log()}"
            time.sleep(0.05)  # polling the process until it exits (or answers: the failure)
        assert process.poll() not in (None, 0), server.log()
        log = server.log()
        assert message in log and "Application startup failed" in log, log
    finally:
        server.close()
    assert redis_client.keys("*") == []


@HTTPX_SOCKETS
@NOT_ASAN
@pytest.mark.parametrize("way", WAYS)
def test_a_well_configured_app_starts_in_uvicorn(way: str, redis_url: str,
                                                 redis_client: redis.Redis) -> None:
    server = UvicornServer(source(way, f"AsyncRateLimiter({redis_url!r})", None), {})
    try:
        server.start()
        with server.client(timeout=10) as client:
            answers = [client.get("/v1/chat").status_code for _ in range(6)]
        assert answers == [200] * 5 + [429]
    finally:
        server.close()
