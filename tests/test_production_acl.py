"""The least-privilege ACL user of docs/security.md ("A least-privilege ACL user"), created
from the page's own line on a private redis-server, drives every kind of limiter: checks until a
rejection, check_windows, and the script reload after SCRIPT FLUSH. The same line without one
of its commands, or a key prefix outside its pattern, fails: the line is what the limiter
needs, and the tests can tell."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from genai_ratelimit import RateLimiterError
from helpers_async import LimiterFactory
from helpers_core import SORTED_SET_SHAPE, logged_entries, window_script
from redis_server import RedisServer

SECURITY_PAGE = Path(__file__).resolve().parent.parent / "docs" / "security.md"
ACL_COMMAND = "ACL SETUSER ratelimiter "
# How Redis words an ACL refusal: of a command sent (NOPERM), or of one inside a script.
NOT_PERMITTED = r"(?i)NOPERM|no permissions|can't run this command"


def documented_acl_line() -> str:
    """The one line of docs/security.md that creates the limiter's ACL user."""
    lines = [line for line in SECURITY_PAGE.read_text(encoding="utf-8").splitlines()
             if line.startswith(ACL_COMMAND)]
    assert len(lines) == 1, f"docs/security.md must hold exactly one {ACL_COMMAND!r} line, found {len(lines)}"
    return lines[0]


@pytest.fixture
def admin(private_redis: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(private_redis.url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def acl_url(private_redis: RedisServer, admin: redis.Redis) -> Callable[..., str]:
    """acl_url(without=()): creates the documented user (minus the rules in `without`) with a
    fresh password and returns its URL, on database 1 so that SELECT is sent too."""

    def create(without: tuple[str, ...] = ()) -> str:
        password = secrets.token_hex(16)
        words = [word for word in documented_acl_line().split() if word not in without]
        admin.execute_command(  # type: ignore[no-untyped-call]
            *[">" + password if word == ">CHANGE-ME" else word for word in words])
        return f"redis://ratelimiter:{password}@127.0.0.1:{private_redis.port}/1"

    return create


def test_the_documented_acl_user_checks_until_it_is_rejected(
        acl_url: Callable[..., str], make_limiter: LimiterFactory, user_id: str) -> None:
    limiter = make_limiter(acl_url())
    started = time.monotonic()
    assert [limiter.check(user_id, 3, 60) for _ in range(3)] == [(True, 2, 0), (True, 1, 0), (True, 0, 0)]
    allowed, remaining, retry_after_s = limiter.check(user_id, 3, 60)
    elapsed = time.monotonic() - started
    assert (allowed, remaining) == (False, 0)
    # The first check leaves the minute 60 s after it was counted, at most `elapsed` ago.
    assert math.ceil(60 - elapsed) <= retry_after_s <= 60


def test_the_documented_acl_user_checks_windows(
        acl_url: Callable[..., str], make_limiter: LimiterFactory, admin: redis.Redis, user_id: str) -> None:
    limiter = make_limiter(acl_url())
    started = time.monotonic()
    assert limiter.check_windows(user_id, [(5, 60), (100, 86_400)]) == (True, 4, 0, 60)
    allowed, remaining, retry_after_s, window_seconds = limiter.check_windows(
        user_id, [(1, 60), (100, 86_400)])
    elapsed = time.monotonic() - started
    assert (allowed, remaining, window_seconds) == (False, 0, 60)
    # The first check leaves the minute 60 s after it was counted, at most `elapsed` ago.
    assert math.ceil(60 - elapsed) <= retry_after_s <= 60
    admin.select(1)
    assert logged_entries(admin, f"ratelimit:{user_id}:86400") == 1


def test_the_documented_acl_user_reloads_the_script_after_script_flush(
        acl_url: Callable[..., str], make_limiter: LimiterFactory, admin: redis.Redis, user_id: str,
        storage: str) -> None:
    sha = window_script(storage)[0]
    limiter = make_limiter(acl_url())
    assert limiter.check(user_id, 5, 60) == (True, 4, 0)
    admin.script_flush()
    assert admin.script_exists(sha) == [False]
    assert limiter.check(user_id, 5, 60) == (True, 3, 0)  # NOSCRIPT, SCRIPT LOAD, EVALSHA again
    assert admin.script_exists(sha) == [True]


def test_the_documented_acl_user_weighs_reserves_and_reconciles(
        acl_url: Callable[..., str], make_limiter: LimiterFactory, admin: redis.Redis, user_id: str) -> None:
    """Every command of both scripts on their weighted paths: weights written, trimmed by
    a 1 s window, a weighted retry, a reserve over request and token windows, a refund,
    an overage and a removal."""
    limiter = make_limiter(acl_url())
    assert limiter.check(user_id, 10, 1, cost=6) == (True, 4, 0)
    allowed, _, retry = limiter.check(user_id, 10, 1, cost=6)
    assert not allowed and retry == 1
    r = limiter.reserve(user_id, [(5, 60)], token_windows=[(1000, 60)], tokens=600)
    assert r.allowed
    assert not limiter.reserve(user_id, [(5, 60)], token_windows=[(1000, 60)], tokens=600).allowed
    assert limiter.reconcile(r, 100) == 1
    assert limiter.reconcile(r, 1500) == 1
    assert limiter.reconcile(r, 0) == 1
    admin.select(1)
    assert logged_entries(admin, f"ratelimit:{user_id}:60:tokens") == 0
    assert logged_entries(admin, f"ratelimit:{user_id}:60") == 1


def test_the_documented_acl_user_waits_in_a_shared_caps_queue(
        acl_url: Callable[..., str], make_limiter: LimiterFactory, admin: redis.Redis,
        user_id: str) -> None:
    """docs/wait-queue.md: tickets taken, admitted, timed out and left, with no other command."""
    from genai_ratelimit import Scope

    limiter = make_limiter(acl_url())
    cap = Scope("acl/provider", windows=[(1, 1)], shared=True)
    assert limiter.reserve(user_id, [(100, 60)], scopes=[cap]).allowed
    waited = limiter.reserve(user_id, [(100, 60)], scopes=[cap], max_wait=5)
    assert waited.allowed and waited.queue_outcome == "queued_then_allowed"
    late = limiter.reserve(user_id, [(100, 60)], scopes=[cap], max_wait=0.1)
    assert not late.allowed and late.queue_outcome == "queue_timeout"
    admin.select(1)
    assert not admin.keys("ratelimit:acl/provider:queue*")  # every ticket gone, its keys too


def test_the_documented_acl_user_waits_for_an_in_flight_cap_and_is_woken_by_the_release(
        acl_url: Callable[..., str], make_limiter: LimiterFactory, admin: redis.Redis,
        user_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/wait-queue.md, in-flight caps: a ticket taken, the subscriber's SUBSCRIBE, the
    release's PUBLISH on the prefix's channel, the admission, with no other command. The
    backstop is longer than the test: only the release's message wakes the waiter."""
    import threading

    from genai_ratelimit import RateLimiter, wait_queue

    monkeypatch.setattr(wait_queue, "WAKE_BACKSTOP_SECONDS", 60.0)
    monkeypatch.setattr(wait_queue, "TICKET_LIVE_MS", 120_000)
    url = acl_url()
    limiter = make_limiter(url)
    held = limiter.acquire("acl/slots", 1, 60)
    assert held.allowed
    results: list[Any] = []

    def wait() -> None:
        with RateLimiter(url) as own:
            results.append(own.acquire("acl/slots", 1, 60, max_wait=30))

    waiter = threading.Thread(target=wait)
    waiter.start()
    admin.select(1)
    deadline = time.monotonic() + 10
    while not admin.exists("ratelimit:acl/slots:leases:queue"):
        assert time.monotonic() < deadline
        time.sleep(0.002)
    time.sleep(0.05)
    assert limiter.release(held)
    waiter.join(10)
    assert results and results[0].allowed
    assert results[0].queue_outcome == "queued_then_allowed"
    assert not admin.keys("ratelimit:acl/slots:leases:queue*")


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
@pytest.mark.parametrize("rule", ["+zadd", "+evalsha", "+time", "+hget", "+hset"])
def test_the_documented_line_without_one_of_its_commands_is_not_enough(
        acl_url: Callable[..., str], make_limiter: LimiterFactory, user_id: str, rule: str) -> None:
    limiter = make_limiter(acl_url(without=(rule,)), connect_timeout=2.0, socket_timeout=2.0)
    with pytest.raises(RateLimiterError, match=NOT_PERMITTED):
        limiter.check(user_id, 5, 60, cost=2)  # a weighted check: the weights are written


def test_the_documented_acl_user_cannot_touch_keys_outside_its_prefix(
        acl_url: Callable[..., str], make_limiter: LimiterFactory, user_id: str) -> None:
    limiter = make_limiter(acl_url(), key_prefix="other", connect_timeout=2.0, socket_timeout=2.0)
    with pytest.raises(RateLimiterError, match=NOT_PERMITTED):
        limiter.check(user_id, 5, 60)
