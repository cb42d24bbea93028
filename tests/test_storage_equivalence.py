"""The two storages decide alike, to the millisecond: random sequences of checks, weighted
checks, reserves (requests and tokens), reconciles, peeks and resets, on two users, with a
client clock that jumps forward and back, fed to a limiter of each storage. Every answer,
retry_after_ms and timestamp included, is the same; after each step both logs hold the same
(time, cost) entries.

The client clock is set through _native._set_client_clock, so a run decides at the times
the example names (as app servers whose clocks disagree would). A run may also start the
compact windows' tie counter near its limit (65,535), as an older release left it: the
entries of one millisecond keep their ties in order across it, and every reconcile still
finds its entry."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from genai_ratelimit import RateLimiter, RateLimiterUnavailable, _native
from helpers_core import logged, server_ms

USERS = ("alice", "bob")
KEY_PREFIX = {"zset": "rz", "compact": "rc"}
WINDOWS = ((4, 1), (12, 5), (40, 30))
TOKEN_WINDOWS = ((300, 5), (1_000, 30))

DAY = 86_400_000
# One step: (time move in ms, operation, its arguments). Now and then a clock months away
# (a compact window's stored times then move to a new base, or widen).
moves = st.one_of(st.integers(0, 400), st.integers(0, 6_000), st.integers(-800, 0),
                  st.sampled_from([60 * DAY, -60 * DAY, 400 * DAY, -400 * DAY]))
windows = st.lists(st.sampled_from(WINDOWS), min_size=1, max_size=3, unique=True)
operations = st.one_of(
    st.tuples(st.just("check"), st.sampled_from(WINDOWS), st.integers(1, 4)),
    st.tuples(st.just("windows"), windows, st.integers(1, 4)),
    st.tuples(st.just("reserve"), windows, st.integers(1, 300)),
    st.tuples(st.just("reconcile"), st.integers(0, 40), st.integers(0, 400)),
    st.tuples(st.just("peek"), windows, st.integers(1, 4)),
    st.tuples(st.just("reset"), st.booleans()),
)
steps = st.lists(st.tuples(moves, st.sampled_from(USERS), operations), min_size=1, max_size=40)
# Runs near the tie counter's limit: steps mostly in one millisecond, each after setting the
# tie counter of the compact windows whose last entry is older to one of these (None: left as
# it is), as an older release's counter, which went on across milliseconds, could leave it;
# the clock never goes back (a window that logs again in the millisecond of its last entry,
# with a counter near the limit, has few ties left there: it would log in the next
# millisecond, the one case where the storages' answers differ, docs/storage.md);
# reservations that seldom fill their windows, so most are logged;
# reconciles of the latest two. No reset: it deletes the windows, whose ties then start again
# at 0, so an entry logged after it in the millisecond of one logged before takes that one's
# tie, and a late reconcile of the one before finds the new one (the same before and after
# the ties of a millisecond were kept in order; reported apart).
reserves = st.tuples(st.just("reserve"), st.lists(st.sampled_from([(500, 1), (500, 30)]),
                                                  min_size=1, max_size=2, unique=True),
                     st.integers(1, 5))
reconciles = st.tuples(st.just("reconcile"), st.integers(0, 1), st.integers(0, 400))
sans_reset = st.one_of(
    st.tuples(st.just("check"), st.sampled_from(WINDOWS), st.integers(1, 4)),
    st.tuples(st.just("windows"), windows, st.integers(1, 4)),
    st.tuples(st.just("peek"), windows, st.integers(1, 4)),
)
tie_steps = st.lists(st.tuples(st.one_of(st.just(0), st.just(0), st.just(0),
                                         st.sampled_from([1, 2, 3]), st.integers(0, 6_000)),
                               st.sampled_from(USERS[:1]),
                               st.one_of(reserves, reconciles, reserves, reconciles, reserves,
                                         sans_reset),
                               st.sampled_from([None, 65_535, 65_535, 65_534, 65_533, 32_767])),
                     min_size=8, max_size=40)


@pytest.fixture(scope="module")
def pair(redis_url: str) -> Iterator[tuple[RateLimiter, RateLimiter]]:
    # Prefixes of their own: a reset of every window forgets both storages' keys of a user.
    zset = RateLimiter(redis_url, clock="client", storage="zset", key_prefix="rz")
    compact = RateLimiter(redis_url, clock="client", storage="compact", key_prefix="rc")
    try:
        yield zset, compact
    finally:
        _native._set_client_clock(None)
        zset.close()
        compact.close()


def answer(limiter: RateLimiter, prefix: str, user: str, operation: tuple[Any, ...],
           reservations: list[Any]) -> Any:
    """What one limiter answers to one step (reservations: this limiter's, in order)."""
    name = operation[0]
    user = f"{prefix}:{user}"
    if name == "check":
        (limit, seconds), cost = operation[1], operation[2]
        return limiter.check(user, limit, seconds, cost=min(cost, limit))
    if name == "windows":
        cost = min(operation[2], min(limit for limit, _ in operation[1]))
        decision = limiter.check_windows_detailed(user, operation[1], cost=cost)
        return tuple(decision) + (decision.retry_after_ms, decision.timestamp_ms)
    if name == "reserve":
        tokens = min(operation[2], min(limit for limit, _ in TOKEN_WINDOWS))
        res = limiter.reserve(user, operation[1], token_windows=TOKEN_WINDOWS, tokens=tokens)
        reservations.append(res)
        return (res.allowed, res.remaining, res.retry_after_s, res.retry_after_ms,
                res.window_seconds, res.resource, res.timestamp_ms,
                [(w.limit, w.window_seconds, w.resource, w.remaining) for w in res.windows])
    if name == "reconcile":
        if not reservations:
            return None
        # The latest first (0: the last one).
        return limiter.reconcile(reservations[-1 - operation[1] % len(reservations)], operation[2])
    if name == "peek":
        cost = min(operation[2], min(limit for limit, _ in operation[1]))
        return limiter._peek(user, operation[1], cost=cost)
    if operation[1]:
        return limiter.reset(user)
    return limiter.reset(user, list(WINDOWS), token_windows=list(TOKEN_WINDOWS))


def outcome(limiter: RateLimiter, prefix: str, user: str, operation: tuple[Any, ...],
            reservations: list[Any]) -> Any:
    """answer(), or the error it raised: a clock months behind an entry makes a wait longer
    than the C layer believes a script can answer (RL_MAX_CLOCK_SKEW_MS), and both storages
    must be refused alike."""
    try:
        return answer(limiter, prefix, user, operation, reservations)
    except RateLimiterUnavailable as exc:
        return ("unavailable", str(exc).split("script answered", 1)[-1])


def logs(client: redis.Redis, prefix: str, storage: str) -> dict[str, list[tuple[int, int]]]:
    """Every window's (time, cost) entries in one storage (its limiter's key prefix), sorted:
    entries of one millisecond are in member order in a sorted set and in arrival order in
    a compact log, which no decision tells apart (the same times, the same sums)."""
    return {f"{user}:{seconds}{kind}":
            sorted(logged(client, f"{KEY_PREFIX[storage]}:{prefix}:{user}:{seconds}{kind}", storage))
            for user in USERS for _, seconds in WINDOWS + TOKEN_WINDOWS
            for kind in ("", ":tokens")}


def near_the_tie_limit(client: redis.Redis, prefix: str, now: int, tie: int) -> None:
    """Sets the next tie (header bytes 48-49, lib/compact_log.lua) of every compact window of
    the run whose last entry is older than now to `tie`, as an older release's counter
    (which went on across milliseconds and wrapped) could leave it."""
    for key in client.scan_iter(f"rc:{prefix}:*:c", count=1000):
        header = client.getrange(key, 0, 49)
        if header[:1] == b"\x01" and len(header) == 50 and int.from_bytes(header[42:48], "big") < now:
            client.setrange(key, 48, tie.to_bytes(2, "big"))


def run_both(pair: tuple[RateLimiter, RateLimiter], redis_client: redis.Redis,
             steps: list[tuple[Any, ...]]) -> None:
    """Feeds the steps (time move, user, operation[, tie counter]) to both limiters: the same
    answers, the same logs after each step."""
    zset, compact = pair
    prefix = uuid.uuid4().hex[:12]
    now = server_ms(redis_client)
    held: dict[str, list[Any]] = {"zset": [], "compact": []}
    for number, (move, user, operation, *tie) in enumerate(steps):
        now += move
        if tie and tie[0] is not None:
            near_the_tie_limit(redis_client, prefix, now, tie[0])
        _native._set_client_clock(now)
        expected = outcome(zset, prefix, user, operation, held["zset"])
        got = outcome(compact, prefix, user, operation, held["compact"])
        assert got == expected, f"step {number} at {now}: {operation} of {user}"
        assert logs(redis_client, prefix, "compact") == logs(redis_client, prefix, "zset"), number
    _native._set_client_clock(None)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=steps)
def test_both_storages_answer_every_call_alike(pair: tuple[RateLimiter, RateLimiter],
                                               redis_client: redis.Redis,
                                               steps: list[tuple[int, str, tuple[Any, ...]]]) -> None:
    run_both(pair, redis_client, steps)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=tie_steps)
@example(steps=[(0, "alice", ("reserve", [(4, 1)], 10), None),
                (5, "alice", ("reserve", [(4, 1)], 20), 65_535),
                (0, "alice", ("reserve", [(4, 1)], 30), None),
                (0, "alice", ("reconcile", 0, 50), None)])
def test_both_storages_answer_alike_across_the_tie_counters_limit(
        pair: tuple[RateLimiter, RateLimiter], redis_client: redis.Redis,
        steps: list[tuple[int, str, tuple[Any, ...], int | None]]) -> None:
    """Entries of one millisecond after the tie counter neared 65,535: the ties of a new
    millisecond start again at 0 rather than wrap within it, so each entry keeps its place
    and each reconcile finds its own (the counter once wrapped to 0 after 65,535 in one
    millisecond, and the reconcile of that entry found nothing)."""
    # Every window of the run logged once first, a millisecond before: from the first step
    # on, its tie counter is set near its limit at each new millisecond.
    prelude = [(0, USERS[0], ("reserve", [(500, 1), (500, 30)], 1), None),
               (0, USERS[0], ("windows", list(WINDOWS), 1), None)]
    run_both(pair, redis_client, prelude + [(steps[0][0] + 1, *steps[0][1:])] + steps[1:])


def test_clocks_months_and_years_apart_keep_both_storages_alike(
        pair: tuple[RateLimiter, RateLimiter], redis_client: redis.Redis) -> None:
    """A compact window stores times 4 bytes wide for a short window (49 days from its base):
    entries a client clock logged 60 days ahead stay while another clock, 400 days behind,
    logs; the window moves its base and widens its times (it lost the future entries before)."""
    zset, compact = pair
    user = f"u{uuid.uuid4().hex[:8]}"
    now = server_ms(redis_client)
    for window in ((3, 60), (5, 2_592_000)):
        for offset in (0, 1, 2, 60 * DAY, 60 * DAY + 1, -400 * DAY, -400 * DAY + 5, 3, 60 * DAY + 2):
            _native._set_client_clock(now + offset)
            expected = zset.check_windows_detailed(user, [window])
            got = compact.check_windows_detailed(user, [window])
            assert (tuple(got), got.retry_after_ms) == (tuple(expected), expected.retry_after_ms), \
                (window, offset)
    _native._set_client_clock(None)


def test_the_logs_of_both_storages_hold_the_same_entries(pair: tuple[RateLimiter, RateLimiter],
                                                         redis_client: redis.Redis) -> None:
    """The same calls leave the same (time, cost) entries in both storages' windows."""
    zset, compact = pair
    user = f"u{uuid.uuid4().hex[:8]}"
    now = server_ms(redis_client)
    reservations: dict[str, Any] = {}
    for step in range(30):
        _native._set_client_clock(now + step * 97 - (step % 4) * 150)
        for name, limiter in (("zset", zset), ("compact", compact)):
            limiter.check_windows(user, [(10, 5), (40, 30)], cost=1 + step % 3)
            res = limiter.reserve(user, [(20, 5)], token_windows=[(500, 30)], tokens=10 + step)
            if step % 5 == 4 and name in reservations:
                limiter.reconcile(reservations[name], step % 3 * 20)
            reservations[name] = res
    _native._set_client_clock(None)
    for key in ("5", "30", "5:tokens", "30:tokens"):
        assert sorted(logged(redis_client, f"rz:{user}:{key}", "zset")) == \
            sorted(logged(redis_client, f"rc:{user}:{key}", "compact")), key


def test_searches_over_thousands_of_entries_logged_in_bursts_answer_alike(
        pair: tuple[RateLimiter, RateLimiter], redis_client: redis.Redis) -> None:
    """Windows of about 2,000 entries logged in bursts (up to 10 in one millisecond, then gaps
    of up to 1.5 s), plain and with irregular costs: a compact search reads slices of entries
    where the answer should be (in proportion between known entries, which bursts mislead) and
    bisects them. Every refusal's wait, every trim and every peek is the sorted sets', to the
    millisecond, as the window slides over the bursts."""
    zset, compact = pair
    start = server_ms(redis_client)
    times, now = [], start
    for burst in range(40):
        now += (burst * 7919) % 1500 + 1
        times.extend(now + j // 10 for j in range(25 + (burst * 37) % 60))
    for weighted in (False, True):
        user = f"{'w' if weighted else 'p'}{uuid.uuid4().hex[:8]}"
        total = 0
        for n, at in enumerate(times):
            cost = 1 + (n * n) % 37 if weighted else 1
            total += cost
            _native._set_client_clock(at)
            for limiter in (zset, compact):
                assert limiter.check(user, 10**9, 90, cost=cost)[0], (weighted, n)
        # The window slides: entries leave by ones, tens and hundreds; at each step refusals
        # whose freeing entry is anywhere in the window, and a peek.
        for step, offset in enumerate((-1, 0, 1, 8, 150, 900, 901, 2_000, 5_013, 20_000,
                                       31_000, 45_000, 70_000)):
            _native._set_client_clock(times[0] + 90_000 + offset)
            for share in (1, 3, 50, 97, 100):
                limit = max(1, total * share // 100)
                expected = zset.check_windows_detailed(user, [(limit, 90)], cost=7)
                got = compact.check_windows_detailed(user, [(limit, 90)], cost=7)
                assert (tuple(got), got.retry_after_ms, got.timestamp_ms) == \
                    (tuple(expected), expected.retry_after_ms, expected.timestamp_ms), \
                    (weighted, step, share)
                assert compact._peek(user, [(limit, 90)], cost=3) == \
                    zset._peek(user, [(limit, 90)], cost=3), (weighted, step, share)
    _native._set_client_clock(None)
