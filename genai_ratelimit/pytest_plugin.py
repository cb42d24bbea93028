"""genai-ratelimit's pytest plugin: fixtures for the tests of an app that uses the limiter.
Installed with the package (the `pytest11` entry point), so nothing needs registering.

Fixtures (docs/testing.md):
  ratelimit_redis_url     the URL of the test's Redis: REDIS_URL when set (never flushed),
                          else the session's throwaway redis-server, flushed before the test
  ratelimit_redis_server  (session) the throwaway redis-server itself (ThrowawayRedis)
  ratelimit_factory       a LimiterFactory on that Redis: .rate_limiter(), .async_rate_limiter()
  ratelimit_clock         a ManualClock, running for the test: the time clock="client"
                          limiters decide at

Without Redis (no redis-server on PATH, no REDIS_URL) a test that needs it fails, saying so;
the ini option `ratelimit_missing_redis = skip` skips it instead."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .testing import LimiterFactory, ManualClock, RedisNotFound, ThrowawayRedis

MISSING_REDIS_OPTION = "ratelimit_missing_redis"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(MISSING_REDIS_OPTION, default="fail",
                  help="genai-ratelimit: what a test that needs Redis does when there is no "
                       "redis-server on PATH and no REDIS_URL: fail (default) or skip")


def _external_url() -> str | None:
    url = os.environ.get("REDIS_URL", "").strip()
    return url or None


@pytest.fixture(scope="session")
def ratelimit_redis_server(request: pytest.FixtureRequest) -> Iterator[ThrowawayRedis]:
    """A redis-server of this session, on a unix socket in a temporary directory, stopped by
    its pid when the session ends."""
    try:
        server = ThrowawayRedis()
    except RedisNotFound as exc:
        message = f"genai-ratelimit's pytest plugin: {exc}"
        how = request.config.getini(MISSING_REDIS_OPTION)
        if how == "skip":
            pytest.skip(message)
        if how != "fail":
            raise pytest.UsageError(f"{MISSING_REDIS_OPTION} must be fail or skip, got {how!r}") from None
        pytest.fail(message, pytrace=False)
    with server:
        yield server


@pytest.fixture
def ratelimit_redis_url(request: pytest.FixtureRequest) -> str:
    """REDIS_URL when set (used as it is: nothing is flushed there), else the URL of the
    session's throwaway redis-server, its database flushed before this test."""
    external = _external_url()
    if external is not None:
        return external
    server: ThrowawayRedis = request.getfixturevalue("ratelimit_redis_server")
    server.flushdb()
    return server.url


@pytest.fixture
def ratelimit_factory(ratelimit_redis_url: str) -> Iterator[LimiterFactory]:
    """Makes limiters on the test's Redis (clock="client" by default), closed after the test.
    On REDIS_URL their key prefix is one of this test's own, since nothing is flushed there."""
    if ratelimit_redis_url == _external_url():
        factory = LimiterFactory.with_fresh_prefix(ratelimit_redis_url)
    else:
        factory = LimiterFactory(ratelimit_redis_url)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def ratelimit_clock() -> Iterator[ManualClock]:
    """A ManualClock at the current time, running for this test: clock="client" limiters
    (the factory's) decide at its time, which moves only by advance() and set()."""
    with ManualClock() as clock:
        yield clock
