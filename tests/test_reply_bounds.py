"""Every integer of a script's reply is held to what the script can really answer before
anything is computed from it (csrc/script.c, rl_script_decode): a count is 0 to MAX_LIMIT
(2**53 - 1, what Lua's doubles hold exactly), a time is a unix ms from 1970 to the end of
year 9999 (MAX_UNIX_MS), a wait is at most its window (or, for a lease, the longest lease)
plus MAX_CLOCK_SKEW_MS (an entry stamped by a clock ahead of the deciding one: clock="client"
with skewed app servers, or a server clock stepped back). Anything outside is a malformed
reply: RateLimiterUnavailable, never an answer made of wrapped arithmetic (a retry_after_s of
-9223372036854774 once came out of retry_ms = 2**63 - 1) nor undefined behaviour (UBSan).

One case per reply kind and integer, each on every limiter kind (sync, asyncio, uvloop),
against a fake Redis on loopback (tests/fake_redis.ScriptedRedis) that answers the script
with the reply the case chose, the earlier calls of the case (the reserve before a
reconcile, the acquire before a release) with a well-formed one. A reply at the bounds is
still an answer, so the bounds refuse nothing the scripts can say."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fake_redis import DECISION_NOW_MS, ScriptedRedis, in_order
from genai_ratelimit import RateLimiterUnavailable, Scope, _native
from helpers_async import LimiterFactory

LLONG_MAX = 2**63 - 1
LLONG_MIN = -(2**63)
MAX_LIMIT = _native.MAX_LIMIT
MAX_UNIX_MS = _native.MAX_UNIX_MS
SKEW_MS = _native.MAX_CLOCK_SKEW_MS
NOW = DECISION_NOW_MS
LEASE_ID = "00000000-0000-4000-8000-000000000001"


def resp(value: Any) -> bytes:
    """RESP2 text of an int, a str (bulk string) or a list of those."""
    if isinstance(value, list):
        return b"*%d\r\n" % len(value) + b"".join(resp(v) for v in value)
    if isinstance(value, str):
        return b"$%d\r\n%s\r\n" % (len(value.encode()), value.encode())
    return b":%d\r\n" % value


def window_reply(allowed: int = 1, remaining: int = 4, retry: int = 0, window: int = 1,
                 now: int = NOW, each: list[int] | None = None, retry_ms: int = 0,
                 usage: list[int] | None = None) -> bytes:
    """lua/sliding_window.lua's reply (with peek.lua's 8th element when usage is given)."""
    items: list[Any] = [allowed, remaining, retry, window, now,
                        [remaining] if each is None else each, retry_ms]
    if usage is not None:
        items.append(usage)
    return resp(items)


def lease_reply(ok: int = 1, held: int = 1, retry_ms: int = 0, expires: int = NOW + 60_000,
                now: int = NOW, bound: int | None = None) -> bytes:
    """lease.lua's {ok, held, retry_ms, expires, now, bound_ms}; a refusal's bound defaults
    to its hint (retry_ms)."""
    return resp([ok, held, retry_ms, expires, now, (retry_ms if ok == 0 else 0) if bound is None else bound])


REFUSED = {"allowed": 0, "remaining": 0, "retry": 60, "retry_ms": 60_000, "each": [0]}
A_LEASE = lease_reply()  # acquire's well-formed answer: a lease of 60 s held


def check(limiter: Any) -> object:
    return limiter.check("bounds-user", 5, 60)


def check_weighted(limiter: Any) -> object:
    return limiter.check("bounds-user", 10, 60, cost=3)


def check_windows(limiter: Any) -> object:
    return limiter.check_windows("bounds-user", [(5, 60)])


def check_windows_detailed(limiter: Any) -> object:
    return tuple(limiter.check_windows_detailed("bounds-user", [(5, 60)]))


def reserve(limiter: Any) -> object:
    return limiter.reserve("bounds-user", [(5, 60)])


def reserve_with_scopes(limiter: Any) -> object:
    return limiter.reserve("bounds-user", [(5, 60)], scopes=[Scope("route:x", [(5, 60)])])


def reconcile(limiter: Any) -> object:
    return limiter.reconcile(limiter.reserve("bounds-user", [(5, 60)]), 2)


def peek(limiter: Any) -> object:
    return limiter.peek("bounds-user", [(5, 60)])


def reset(limiter: Any) -> object:
    return limiter.reset("bounds-user", [(5, 60)])


def acquire(limiter: Any) -> object:
    lease = limiter.acquire("bounds-user", 3, 60)
    return (lease.allowed, lease.held, lease.retry_after_s, lease.retry_after_ms,
            lease.expires_at_ms)


def release(limiter: Any) -> object:
    return limiter.release(limiter.acquire("bounds-user", 3, 60))


def renew(limiter: Any) -> object:
    return limiter.renew(limiter.acquire("bounds-user", 3, 60))


# (call, the replies of its EVALSHAs in order: the last one is the reply under test)
Case = tuple[Callable[[Any], object], list[bytes]]

MALFORMED: dict[str, Case] = {
    # -- the sliding window: check, check_windows(_detailed), weighted, reserve, scopes
    "check-refused-retry-2**62": (check, [window_reply(0, 0, 2**62, 1, NOW, [0], 2**62)]),
    "check-refused-retry-ms-llong-max": (
        check, [window_reply(0, 0, LLONG_MAX // 1000 + 1, 1, NOW, [0], LLONG_MAX)]),
    "check-refused-retry-of-292-million-years": (   # consistent, and no overflow: absurd
        check, [window_reply(0, 0, 9223372036854775, 1, NOW, [0], 9223372036854775000)]),
    "check-refused-retry-a-day-past-the-window": (
        check, [window_reply(0, 0, 60 + SKEW_MS // 1000 + 1, 1, NOW, [0],
                             60_000 + SKEW_MS + 1000)]),
    "check-refused-retry-llong-min": (check, [window_reply(0, 0, LLONG_MIN, 1, NOW, [0], 1000)]),
    "check-allowed-now-llong-max": (check, [window_reply(now=LLONG_MAX)]),
    "check-allowed-now-after-year-9999": (check, [window_reply(now=MAX_UNIX_MS + 1)]),
    "check-allowed-now-negative": (check, [window_reply(now=-1)]),
    "check-allowed-remaining-llong-max": (check, [window_reply(remaining=LLONG_MAX)]),
    "check-allowed-window-llong-min": (check, [window_reply(window=LLONG_MIN)]),
    "check-weighted-refused-retry-ms-llong-max": (
        check_weighted, [window_reply(0, 0, 2**53, 1, NOW, [0], LLONG_MAX)]),
    "check-windows-refused-retry-2**62": (
        check_windows, [window_reply(0, 0, 2**62, 1, NOW, [0], 2**62)]),
    "check-windows-detailed-now-llong-max": (check_windows_detailed, [window_reply(now=LLONG_MAX)]),
    "reserve-now-llong-max": (reserve, [window_reply(now=LLONG_MAX)]),
    "reserve-refused-retry-ms-llong-max": (
        reserve, [window_reply(0, 0, LLONG_MAX // 1000 + 1, 1, NOW, [0], LLONG_MAX)]),
    "reserve-with-scopes-now-llong-max": (
        reserve_with_scopes, [window_reply(now=LLONG_MAX, each=[4, 4])]),
    "reserve-with-scopes-remaining-llong-max": (
        reserve_with_scopes, [window_reply(each=[4, LLONG_MAX])]),
    # -- reconcile: the number of windows whose entry was found
    "reconcile-found-llong-max": (reconcile, [window_reply(), resp(LLONG_MAX)]),
    "reconcile-found-llong-min": (reconcile, [window_reply(), resp(LLONG_MIN)]),
    # -- peek: sliding_window's 7 and {used, oldest} per window
    "peek-used-llong-max": (peek, [window_reply(usage=[LLONG_MAX, NOW - 1000])]),
    "peek-used-past-max-limit": (peek, [window_reply(usage=[MAX_LIMIT + 1, NOW - 1000])]),
    "peek-oldest-llong-max": (peek, [window_reply(usage=[1, LLONG_MAX])]),
    "peek-oldest-llong-min": (peek, [window_reply(usage=[1, LLONG_MIN])]),
    "peek-now-llong-max": (peek, [window_reply(now=LLONG_MAX, usage=[1, NOW - 1000])]),
    # -- reset: {entries removed, SCAN cursor}
    "reset-removed-llong-max": (reset, [resp([LLONG_MAX, "0"])]),
    "reset-removed-past-max-limit": (reset, [resp([MAX_LIMIT + 1, "0"])]),
    "reset-cursor-of-21-digits": (reset, [resp([1, "1" * 21])]),
    # -- leases: {ok, held, retry_ms, expires, now, bound_ms}
    "acquire-refused-retry-ms-llong-max": (acquire, [lease_reply(0, 3, LLONG_MAX, 0)]),
    "acquire-refused-retry-ms-past-the-longest-lease": (
        acquire, [lease_reply(0, 3, _native.MAX_WINDOW_SECONDS * 1000 + SKEW_MS + 1, 0)]),
    "acquire-refused-held-llong-max": (acquire, [lease_reply(0, LLONG_MAX, 1000, 0)]),
    "acquire-allowed-expires-llong-max": (acquire, [lease_reply(expires=LLONG_MAX)]),
    "acquire-allowed-expires-beyond-the-lease": (
        acquire, [lease_reply(expires=NOW + 60_000 + SKEW_MS + 1)]),
    "acquire-allowed-now-llong-max": (
        acquire, [lease_reply(expires=LLONG_MAX, now=LLONG_MAX - 1)]),
    "release-now-llong-max": (release, [A_LEASE, lease_reply(1, 0, 0, 0, LLONG_MAX)]),
    "release-held-llong-max": (release, [A_LEASE, lease_reply(1, LLONG_MAX, 0, 0)]),
    "renew-expires-llong-max": (renew, [A_LEASE, lease_reply(expires=LLONG_MAX)]),
    "renew-now-after-year-9999": (
        renew, [A_LEASE, lease_reply(expires=MAX_UNIX_MS + 60_000, now=MAX_UNIX_MS + 1)]),
}

# Replies at the bounds: still answers (the script can say them).
AT_THE_BOUNDS: dict[str, tuple[Callable[[Any], object], list[bytes], object]] = {
    "check-refused-retry-a-day-past-the-window": (
        check, [window_reply(0, 0, 60 + SKEW_MS // 1000, 1, NOW, [0], 60_000 + SKEW_MS)],
        (False, 0, 60 + SKEW_MS // 1000)),
    "check-allowed-now-at-the-end-of-year-9999": (
        check_windows_detailed, [window_reply(now=MAX_UNIX_MS)], (True, 4, 0, 60)),
    "peek-used-at-max-limit": (
        peek, [window_reply(0, 0, 60, 1, NOW, [0], 60_000, usage=[MAX_LIMIT, NOW])],
        (False, 0, 60, 60)),
    "reset-removed-at-max-limit": (reset, [resp([MAX_LIMIT, "0"])], MAX_LIMIT),
    "acquire-refused-retry-the-longest-lease-and-a-day": (
        acquire, [lease_reply(0, 3, _native.MAX_WINDOW_SECONDS * 1000 + SKEW_MS, 0)],
        (False, 3, _native.MAX_WINDOW_SECONDS + SKEW_MS // 1000,
         _native.MAX_WINDOW_SECONDS * 1000 + SKEW_MS, 0)),
}


@pytest.fixture
def scripted() -> Iterator[Callable[[list[bytes]], ScriptedRedis]]:
    """scripted(replies): a fake Redis answering its EVALSHAs with `replies` in order."""
    servers: list[ScriptedRedis] = []

    def start(replies: list[bytes]) -> ScriptedRedis:
        servers.append(ScriptedRedis(in_order({"EVALSHA": list(replies)})))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def outcome(make_limiter: LimiterFactory, server: ScriptedRedis,
            call: Callable[[Any], object]) -> object:
    limiter = make_limiter(server.url(), connect_timeout=2.0, socket_timeout=2.0)
    try:
        return call(limiter)
    except Exception as exc:  # noqa: BLE001 - the test judges what was raised
        return exc


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_a_reply_integer_outside_what_the_script_can_answer_is_unavailable(
        case: str, scripted, make_limiter: LimiterFactory) -> None:
    call, replies = MALFORMED[case]
    server = scripted(replies)
    result = outcome(make_limiter, server, call)
    assert isinstance(result, RateLimiterUnavailable), f"{case}: answered {result!r}"
    assert "script answered" in str(result) or "unexpected reply" in str(result), str(result)
    assert server.commands.count("EVALSHA") == len(replies)


@pytest.mark.parametrize("case", list(AT_THE_BOUNDS), ids=list(AT_THE_BOUNDS))
def test_a_reply_at_the_bounds_is_still_an_answer(case: str, scripted,
                                                  make_limiter: LimiterFactory) -> None:
    call, replies, expected = AT_THE_BOUNDS[case]
    assert outcome(make_limiter, scripted(replies), call) == expected


def test_the_message_names_the_integer_and_what_the_script_can_answer(
        scripted, make_limiter: LimiterFactory) -> None:
    server = scripted([lease_reply(0, 3, LLONG_MAX, 0)])
    result = outcome(make_limiter, server, acquire)
    assert isinstance(result, RateLimiterUnavailable), result
    text = str(result)
    assert "lease script" in text and str(LLONG_MAX) in text, text
    assert str(_native.MAX_WINDOW_SECONDS * 1000 + SKEW_MS) in text, text


def test_the_bounds_are_what_the_module_says() -> None:
    """Written once in csrc/native.h; the fuzzer's model and these cases read them here."""
    assert MAX_LIMIT == 2**53 - 1
    assert MAX_UNIX_MS == 253_402_300_799_999  # 9999-12-31T23:59:59.999Z
    end = datetime.datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=datetime.timezone.utc)
    assert round(end.timestamp() * 1000) == MAX_UNIX_MS
    assert SKEW_MS == 86_400_000
