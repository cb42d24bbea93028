"""Shared fixtures: a real redis-server per test session (or the one REDIS_URL names),
a clean database per test, and a fresh private server for tests that kill or restart it."""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from redis_server import RedisServer, env_redis_url

# The kill switch must never leak in from the developer's shell.
os.environ.pop("RATE_LIMIT_DISABLED", None)
# Nor may a tiers file named in the shell change the budgets the tests expect.
os.environ.pop("GENAI_RATELIMIT_TIERS", None)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The URL of the session's Redis: REDIS_URL when set (e.g. Redis in Docker), else a
    redis-server this session starts on a free loopback port."""
    external = env_redis_url()
    if external:
        yield external
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """An inspection client (redis-py) on a database flushed before the test."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.script_flush()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def limiter(redis_url: str, redis_client: redis.Redis):
    """A RateLimiter on the session's Redis, on a clean database."""
    from genai_ratelimit import RateLimiter

    rl = RateLimiter(redis_url)
    try:
        yield rl
    finally:
        rl.close()


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server owned by this one test, to stop, kill, pause or restart at will."""
    with RedisServer() as server:
        yield server


_counter = itertools.count()


@pytest.fixture
def user_id() -> str:
    """A user id no other test uses."""
    return f"user-{uuid.uuid4().hex[:12]}-{next(_counter)}"


@pytest.fixture(autouse=True)
def _no_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RATE_LIMIT_DISABLED", raising=False)
