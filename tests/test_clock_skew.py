"""Clock skew: why the limiter reads the Redis server's clock by default.

Two app servers whose clocks disagree must still enforce ONE window together. With
clock="client" each app server stamps its requests with its own clock (ARGV[2] of the
script); with the default clock="server" it sends "" and the script reads TIME on Redis.

How skew is injected. The C extension reads CLOCK_REALTIME, which is one clock for the whole
machine: no process here can be given a clock 5 s off. So the app servers are emulated at
the one place where their clocks can act: the script call. The tests run the script the
package embeds (by its SHA1, loaded from genai_ratelimit._native.SCRIPT_SOURCE) through
redis-py with exactly the arguments the limiter sends (KEYS/ARGV layout of
lua/sliding_window.lua): a member, the time argument, window_ms and limit. App server A's
clock is right, app server B's runs 5 s ahead. Two MONITOR tests tie the emulation to the
real limiter, of every kind (tests/conftest.py): it sends "" by default and its own clock
with clock="client".

The scenario (window 2 s, limit 5; times are true times since the start):
    t=0     A sends 5, then B sends 5      exact: A's 5 allowed, B's 5 rejected
    t=2.5s  B sends 5, then A sends 5      exact: B's 5 allowed (t=0 has left), A's rejected
    t=5s    A sends 1                      exact: allowed (t=2.5s left at 4.5 s)
With client clocks B's requests carry t+5 s: at t=0 the script drops A's entries as 3 s old
and admits B's 5 too (10 in one 2 s window); at t=5 s A still sees B's entries "from the
future" and is refused for another 5 s, though the true window is empty.
"""

from __future__ import annotations

import math
import multiprocessing
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

from helpers_core import SORTED_SET_SHAPE, Monitor, server_ms, wait_until_server_ms

WINDOW_S = 2
LIMIT = 5
SKEW_MS = {"A": 0, "B": 5_000}   # how far each app server's clock is ahead of true time
SCENARIO = [                      # (true ms since start, app server, requests)
    (0, "A", 5),
    (0, "B", 5),
    (2_500, "B", 5),
    (2_500, "A", 5),
    (5_000, "A", 1),
]


@dataclass(frozen=True)
class Decision:
    at_ms: int        # true ms since the start of the scenario
    server: str
    allowed: bool
    retry_after_s: int


def exact_window(scenario=SCENARIO, limit: int = LIMIT, window_ms: int = WINDOW_S * 1000) -> list[bool]:
    """What an exact sliding window over TRUE time decides for the scenario: a request at t
    is allowed when fewer than `limit` allowed requests lie in (t - window, t]."""
    admitted: list[int] = []
    decisions = []
    for at_ms, _, count in scenario:
        for _ in range(count):
            live = [a for a in admitted if a > at_ms - window_ms]
            decisions.append(len(live) < limit)
            if decisions[-1]:
                admitted.append(at_ms)
    return decisions


@pytest.fixture
def script(redis_client: redis.Redis) -> redis.Redis:
    """The inspection client, with the package's own script loaded under its SHA1."""
    from genai_ratelimit import SCRIPT_SHA1
    from genai_ratelimit._native import SCRIPT_SOURCE

    assert redis_client.script_load(SCRIPT_SOURCE) == SCRIPT_SHA1
    return redis_client


def emulated_check(client: redis.Redis, key: str, time_argument: str) -> tuple[int, int, int, int]:
    """One script call as an app server's limiter makes it: a fresh UUID4 member, the time
    argument ("" = the server's clock), window_ms and limit."""
    from genai_ratelimit import SCRIPT_SHA1

    reply = client.evalsha(SCRIPT_SHA1, 3, key, f"{key}:w", f"{key}:t", str(uuid.uuid4()),
                           time_argument, WINDOW_S * 1000, LIMIT, 1)
    return tuple(int(v) for v in reply[:4])  # type: ignore[return-value]


def run_with_client_clocks(client: redis.Redis, key: str) -> list[Decision]:
    """The scenario with clock="client": each request carries its app server's skewed
    clock. True time is emulated too (start + offset), so nothing waits."""
    start = server_ms(client)
    decisions = []
    for at_ms, server, count in SCENARIO:
        for _ in range(count):
            stamp = str(start + at_ms + SKEW_MS[server])
            allowed, _, retry, _ = emulated_check(client, key, stamp)
            decisions.append(Decision(at_ms, server, bool(allowed), retry))
    return decisions


def run_with_server_time(client: redis.Redis, key: str) -> list[Decision]:
    """The scenario with the default clock: the app servers' (skewed) clocks are never sent,
    only "". True time is the server's clock, so each step waits until it is due."""
    start = server_ms(client)
    decisions = []
    for at_ms, server, count in SCENARIO:
        wait_until_server_ms(client, start + at_ms, timeout=10)
        for _ in range(count):
            allowed, _, retry, _ = emulated_check(client, key, "")
            decisions.append(Decision(at_ms, server, bool(allowed), retry))
    # The scenario assumes each step took far less than the 0.5 s between its requests and
    # the next window edge; check that it did, or the comparison below would mean nothing.
    assert server_ms(client) - start < 5_000 + 400, "the machine was too slow for the scenario"
    return decisions


def admitted_at(decisions: list[Decision], at_ms: int) -> int:
    return sum(d.allowed for d in decisions if d.at_ms == at_ms)


# -------------------------------------------------------------- clock="client", emulated

def test_client_clocks_five_seconds_apart_admit_twice_the_limit_in_one_window(script, user_id):
    decisions = run_with_client_clocks(script, f"skew:{user_id}")
    assert admitted_at(decisions, 0) == 2 * LIMIT   # exact: LIMIT
    assert sum(exact_window()[:10]) == LIMIT


def test_client_clocks_five_seconds_apart_refuse_a_request_the_exact_window_allows(script, user_id):
    decisions = run_with_client_clocks(script, f"skew:{user_id}")
    last = decisions[-1]
    assert exact_window()[-1] is True                # the true window is empty at t=5 s
    assert (last.server, last.allowed) == ("A", False)
    assert last.retry_after_s == 5                   # B's entries stamped t=7.5 s, +2 s window


def test_client_clocks_five_seconds_apart_promise_a_retry_longer_than_the_window(script, user_id):
    decisions = run_with_client_clocks(script, f"skew:{user_id}")
    refused_a = [d for d in decisions if d.at_ms == 2_500 and d.server == "A"]
    assert refused_a and all(not d.allowed for d in refused_a)
    assert {d.retry_after_s for d in refused_a} == {7}   # a 2 s window, "come back in 7 s"


def test_client_clock_decisions_differ_from_the_exact_window(script, user_id):
    decisions = run_with_client_clocks(script, f"skew:{user_id}")
    assert [d.allowed for d in decisions] != exact_window()


# ----------------------------------------------------------- server time (the default)

def test_server_time_enforces_the_exact_window_whatever_the_app_servers_clocks(script, user_id):
    """The same scenario with ARGV[2] = "": the skewed clocks have no way into the script,
    and every decision is the exact window's; every rejection promises at most the window."""
    decisions = run_with_server_time(script, f"skew:{user_id}")
    assert [d.allowed for d in decisions] == exact_window()
    assert all(1 <= d.retry_after_s <= WINDOW_S for d in decisions if not d.allowed)


# ------------------------------------------------ the real limiter's time argument

def time_arguments(monitor: Monitor) -> list[str]:
    """ARGV[2] of every EVALSHA of one window seen by MONITOR from the limiter under test:
    EVALSHA sha 3 key weights totals member TIME window_ms limit cost."""
    return [c.args[7] for c in monitor.from_others() if c.name == "EVALSHA"]


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_the_default_clock_sends_no_client_time_to_the_script(make_limiter, redis_url, redis_client,
                                                              user_id):
    with make_limiter(redis_url, connect_timeout=2.0, socket_timeout=2.0) as limiter:
        limiter.check(f"{user_id}-warm-up", 10, 60)  # loads the script: one EVALSHA per call after
        with Monitor(redis_client) as monitor:
            for _ in range(3):
                assert limiter.check(user_id, 10, 60)[0] is True
    assert time_arguments(monitor) == ["", "", ""]


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_clock_client_sends_the_callers_unix_milliseconds(make_limiter, redis_url, redis_client, user_id):
    with make_limiter(redis_url, connect_timeout=2.0, socket_timeout=2.0, clock="client") as limiter:
        limiter.check(f"{user_id}-warm-up", 10, 60)  # loads the script: one EVALSHA per call after
        with Monitor(redis_client) as monitor:
            before = math.floor(time.time() * 1000)
            assert limiter.check(user_id, 10, 60)[0] is True
            after = math.ceil(time.time() * 1000)
    [stamp] = time_arguments(monitor)
    assert before <= int(stamp) <= after


# ------------------------------------------------ the real limiter in two processes

PHASES = [(0, 5), (1_000, 1), (2_500, 5), (5_000, 5)]   # (true ms since start, checks each)
EXPECTED_ADMITTED = [LIMIT, 0, LIMIT, LIMIT]           # both processes together, per phase


def phase_worker(url: str, user: str, starts, results) -> None:
    """One app server process: its own RateLimiter (default clock). It reports ready once
    imported and connected, is told the start (server ms), and at each phase's time by the
    server's clock makes its checks and reports (phase, allowed, retry_after_s)."""
    from genai_ratelimit import RateLimiter

    client = redis.Redis.from_url(url)
    try:
        with RateLimiter(url) as limiter:
            limiter.check(f"{user}-warm-up", LIMIT, WINDOW_S)  # connect and load the script
            results.put(("ready", None, None))
            start_ms = starts.get(timeout=60)
            for phase, (at_ms, checks) in enumerate(PHASES):
                wait_until_server_ms(client, start_ms + at_ms, timeout=15)
                for _ in range(checks):
                    allowed, _, retry = limiter.check(user, LIMIT, WINDOW_S)
                    results.put((phase, allowed, retry))
        results.put(("done", None, None))
    except BaseException as exc:  # the parent fails the test with it
        results.put(("error", f"{type(exc).__name__}: {exc}", None))
    finally:
        client.close()


@pytest.fixture
def two_app_servers(redis_url: str, redis_client: redis.Redis, user_id: str) -> Iterator[list]:
    """Runs phase_worker in two spawned processes; yields every (phase, allowed, retry)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    starts = context.Queue()
    processes = [context.Process(target=phase_worker, args=(redis_url, user_id, starts, results))
                 for _ in range(2)]
    for p in processes:
        p.start()
    collected: list = []
    try:
        ready = 0
        while ready < 2:  # however slow the start-up (ASan, valgrind), phases begin together
            item = results.get(timeout=120)
            if item[0] == "error":
                raise AssertionError(f"an app server process failed: {item[1]}")
            ready += item[0] == "ready"
        start_ms = server_ms(redis_client) + 300
        for _ in processes:
            starts.put(start_ms)
        done = 0
        while done < 2:
            item = results.get(timeout=30)
            if item[0] == "error":
                raise AssertionError(f"an app server process failed: {item[1]}")
            if item[0] == "done":
                done += 1
            else:
                collected.append(item)
        yield collected
    finally:
        for p in processes:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def test_two_processes_with_the_default_clock_enforce_one_exact_window(two_app_servers):
    """Two real processes, each with its own RateLimiter on the same user, fire at each
    phase together. They cannot be given skewed clocks (see the module docstring); the
    tests above show their clocks never reach the script. Here: together they admit exactly
    the limit per window, nothing inside a full window, the limit again once it passed."""
    admitted = [sum(1 for phase, allowed, _ in two_app_servers if phase == i and allowed)
                for i in range(len(PHASES))]
    assert admitted == EXPECTED_ADMITTED
    assert all(1 <= retry <= WINDOW_S for _, allowed, retry in two_app_servers if not allowed)
