"""Hostile replies: a fake Redis on loopback (tests/fake_redis.py) answers the rate-limit
script with garbage, wrong types, impossible values, truncated replies, an error, a huge bulk
string, silence or a slow trickle. Every case must raise RateLimiterUnavailable (or its
subclass RateLimiterTimeout) within socket_timeout plus a margin, without crashing the
process; and once the fake heals into a proxy to a real redis-server, the SAME limiter object
must give that server's exact answer again.

Every case runs for every limiter kind (tests/conftest.py): the blocking RateLimiter, and
the AsyncRateLimiter on asyncio's loop and on uvloop's (one loop per limiter, kept for the
test, so its connections live across calls as in a service). The existing
garbage tests in test_limiter_faults.py cover five replies for the sync limiter's first call;
these add the async limiter, recovery of the same object, values out of range, the deadline
of a trickle, the 64 KiB reply cap, the NOSCRIPT loop bound and file-descriptor hygiene."""

from __future__ import annotations

import gc
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import redis

from fake_redis import (
    Behaviour,
    FakeRedis,
    Reply,
    ReplyThenStray,
    Silence,
    Stream,
    Trickle,
    decision,
    open_fds,
)
from helpers_core import SORTED_SET_SHAPE, logged_entries

TIMEOUT = 0.5  # connect_timeout and socket_timeout of every limiter here
MARGIN = 0.5   # slack for a loaded machine on top of the timeout
LIMIT = 10     # every check asks for 10 per 60 s: a good answer for a fresh user is (True, 9, 0)


@dataclass(frozen=True)
class Case:
    make: Callable[[], Behaviour]   # a fresh misbehaviour (some keep state)
    timeout: bool = False           # the documented error is RateLimiterTimeout
    error_reply: bool = False       # a well-formed error reply: the connection stays in step


CASES: dict[str, Case] = {
    # not RESP at all
    "garbage-bytes": Case(lambda: Reply(b"\x00\xff\xfe\x01 not RESP at all\r\n")),
    # RESP, but the wrong type for the script's {allowed, remaining, retry, window} array
    "status-ok": Case(lambda: Reply(b"+OK\r\n")),
    "bulk-string": Case(lambda: Reply(b"$3\r\nabc\r\n")),
    "integer": Case(lambda: Reply(b":5\r\n")),
    "nil-bulk": Case(lambda: Reply(b"$-1\r\n")),
    "nil-array": Case(lambda: Reply(b"*-1\r\n")),
    "array-of-2-integers": Case(lambda: Reply(b"*2\r\n:1\r\n:2\r\n")),
    "array-of-4-with-a-string": Case(lambda: Reply(
        b"*7\r\n:1\r\n$1\r\n9\r\n:0\r\n:1\r\n:0\r\n*1\r\n:9\r\n:0\r\n")),
    "array-of-4-with-an-array": Case(lambda: Reply(
        b"*7\r\n*1\r\n:1\r\n:9\r\n:0\r\n:1\r\n:0\r\n*1\r\n:9\r\n:0\r\n")),
    "integer-beyond-64-bits": Case(lambda: Reply(
        b"*7\r\n:1\r\n:99999999999999999999\r\n:0\r\n:1\r\n:0\r\n*1\r\n:9\r\n:0\r\n")),
    # the right shape, values no script run can produce for check(user, 10, 60)
    "allowed-7": Case(lambda: Reply(decision(7, 9, 0))),
    "negative-remaining": Case(lambda: Reply(decision(1, -1, 0))),
    "reject-without-retry": Case(lambda: Reply(decision(0, 0, 0))),
    "window-index-0": Case(lambda: Reply(decision(1, 9, 0, 0))),
    "window-index-2-of-1": Case(lambda: Reply(decision(1, 9, 0, 2))),
    "remaining-not-below-limit": Case(lambda: Reply(decision(1, LIMIT, 0))),  # at most 9 remain
    "reject-with-remaining": Case(lambda: Reply(decision(0, 5, 3))),         # reject => 0 remain
    "allow-with-retry": Case(lambda: Reply(decision(1, 5, 3))),              # allow => retry 0
    # cut short
    "truncated-then-close": Case(lambda: Reply(b"*7\r\n:1\r\n:9\r\n", close=True)),
    "close-without-reply": Case(lambda: Reply(b"", close=True)),
    # an error reply (in step: the connection may be kept)
    "error-reply": Case(lambda: Reply(b"-ERR boom\r\n"), error_reply=True),
    # a gigabyte announced, streamed as fast as the client reads
    "huge-bulk-string": Case(lambda: Stream(b"$1000000000\r\n", b"x" * 16384, 0.002, 10**9)),
    # never, or too slowly: a valid reply at 1 byte / 50 ms takes 1.2 s, the timeout is 0.5 s
    "never-replies": Case(lambda: Silence(), timeout=True),
    "slow-trickle": Case(lambda: Trickle(decision(1, 9, 0), 0.05), timeout=True),
}

# A multi-bulk header announcing a billion elements, then nothing. Kept out of CASES (and so
# out of the recovery and descriptor tests, which it would only slow down): it has its own
# tests below, and joins the within-the-timeout test.
HUGE_ARRAY = Case(lambda: Reply(b"*1000000000\r\n"))
TIMED_CASES = {**CASES, "huge-array-header": HUGE_ARRAY}


@pytest.fixture(scope="module")
def upstream(redis_url: str) -> tuple[str, int]:
    """(host, port) of the session's real redis-server, where a healed fake proxies."""
    options = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    if "path" in options:
        pytest.fail("these tests need a TCP REDIS_URL (the fake proxies over TCP)")
    return options.get("host", "127.0.0.1"), int(options.get("port", 6379))


@pytest.fixture(autouse=True)
def _collect_garbage_here() -> Iterator[None]:
    """A hostile reply can leave a large partial reply behind in a reference cycle (the async
    limiter's aborted connection). Collect it inside the test that made it, so its cost is
    paid here and never shows up in the timing of a later, unrelated test."""
    yield
    gc.collect()


def fresh_user() -> str:
    return f"hostile-{uuid.uuid4().hex}"


def hostile_call(driver, user: str | None = None):
    """Runs one check against the misbehaving fake; returns (exception or None, seconds)."""
    from genai_ratelimit import RateLimiterError

    started = time.monotonic()
    try:
        driver.check(user or fresh_user(), LIMIT, 60)
    except RateLimiterError as exc:
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


def assert_good_answer(driver, redis_client: redis.Redis) -> None:
    """The next call, through the healed fake, is the real server's exact decision."""
    user = fresh_user()
    assert driver.check(user, LIMIT, 60) == (True, LIMIT - 1, 0)
    assert logged_entries(redis_client, f"ratelimit:{user}:60") == 1


@pytest.fixture
def run_case(upstream, make_limiter):
    """run_case(behaviour) -> (fake, driver): a fake with that misbehaviour and a limiter
    of the kind under test on it. Both are closed after the test, the limiter first."""
    opened: list = []

    def run(behaviour: Behaviour, timeout: float = TIMEOUT):
        fake = FakeRedis(behaviour, upstream)
        opened.append(fake)
        driver = make_limiter(fake.url, connect_timeout=timeout, socket_timeout=timeout)
        opened.append(driver)
        return fake, driver

    yield run
    for thing in reversed(opened):
        thing.close()


# ---------------------------------------------------------------- each hostile reply

@pytest.mark.parametrize("case", TIMED_CASES)
def test_hostile_reply_raises_unavailable_within_the_socket_timeout(run_case, case):
    from genai_ratelimit import RateLimiterTimeout, RateLimiterUnavailable

    fake, driver = run_case(TIMED_CASES[case].make())
    error, elapsed = hostile_call(driver)
    assert 1 <= fake.decisions <= 2  # a reply lost to a broken connection is replayed once
    assert isinstance(error, RateLimiterUnavailable), f"got {error!r} instead of an error"
    if TIMED_CASES[case].timeout:
        assert isinstance(error, RateLimiterTimeout), repr(error)
    assert str(error)
    assert elapsed < TIMEOUT + MARGIN, f"took {elapsed:.2f} s"


@pytest.mark.parametrize("case", CASES)
def test_after_a_hostile_reply_the_same_limiter_gets_the_good_servers_answer(
        run_case, redis_client, case):
    fake, driver = run_case(CASES[case].make())
    hostile_call(driver)
    fake.heal()
    assert_good_answer(driver, redis_client)


@pytest.mark.parametrize("case", [c for c in CASES if not CASES[c].error_reply])
def test_a_connection_that_answered_anything_but_a_decision_is_never_used_again(
        run_case, redis_client, case):
    """Only a well-formed error reply leaves a connection in step. After anything else the
    limiter must throw the connection away: the good answer comes on a new connection."""
    fake, driver = run_case(CASES[case].make())
    hostile_call(driver)
    accepted = fake.accepted
    fake.heal()
    assert_good_answer(driver, redis_client)
    assert fake.accepted == accepted + 1, "the good answer came on a connection used before"


def test_error_reply_keeps_the_connection_in_step(run_case, redis_client):
    """-ERR boom is a complete reply: the connection may be kept, but the answer after it
    must be the one to the next request (proved by an exact count on the real server)."""
    fake, driver = run_case(Reply(b"-ERR boom\r\n"))
    error, _ = hostile_call(driver)
    assert "boom" in str(error)
    fake.heal()
    user = fresh_user()
    assert [driver.check(user, LIMIT, 60) for _ in range(3)] == [
        (True, 9, 0), (True, 8, 0), (True, 7, 0)]
    assert logged_entries(redis_client, f"ratelimit:{user}:60") == 3


# ------------------------------------------------------------------- specific bounds

def test_noscript_forever_is_answered_by_one_reload_then_an_error(run_case, redis_client):
    """A server that answers NOSCRIPT even right after SCRIPT LOAD: one reload and one retry,
    then RateLimiterUnavailable naming NOSCRIPT, never a loop."""
    from genai_ratelimit import RateLimiterUnavailable

    fake, driver = run_case(Reply(b"-NOSCRIPT No matching script. Please use EVAL.\r\n"))
    error, elapsed = hostile_call(driver)
    assert isinstance(error, RateLimiterUnavailable) and "NOSCRIPT" in str(error)
    assert elapsed < TIMEOUT + MARGIN
    fake.heal()
    assert_good_answer(driver, redis_client)  # every byte sent before it was answered first
    assert (fake.decisions, fake.script_loads) == (2, 1)


def test_huge_bulk_string_is_refused_after_64_kib_not_read_to_its_end(run_case):
    """A bulk string announced as 1 GB and streamed fast: the limiter stops at its 64 KiB
    reply cap, long before its (here generous) 5 s timeout, instead of buffering it."""
    from genai_ratelimit import RateLimiterTimeout, RateLimiterUnavailable

    stream = Stream(b"$1000000000\r\n", b"x" * 16384, 0.0, 10**9)
    fake, driver = run_case(stream, timeout=5.0)
    error, elapsed = hostile_call(driver)
    assert isinstance(error, RateLimiterUnavailable) and not isinstance(error, RateLimiterTimeout)
    assert "65536" in str(error)
    assert elapsed < 1.0


def test_slow_trickle_is_cut_by_the_deadline_of_the_whole_call_not_per_byte(run_case):
    """Each byte arrives well within the timeout, the reply as a whole does not: a client
    that re-armed a full timeout per read would wait 1.2 s and then accept the reply."""
    from genai_ratelimit import RateLimiterTimeout

    fake, driver = run_case(Trickle(decision(1, 9, 0), 0.05))
    error, elapsed = hostile_call(driver)
    assert isinstance(error, RateLimiterTimeout)
    assert TIMEOUT - 0.05 <= elapsed < TIMEOUT + MARGIN


def test_huge_array_header_costs_no_more_than_the_timeout_including_its_cleanup(run_case):
    """`*1000000000` announces a billion elements. Whatever the limiter does with it, the
    whole episode (the call, and freeing what the call left behind, which for the async
    limiter happens when the garbage collector runs) must fit in the timeout plus margin:
    time spent past it is a stall of the caller (sync) or of the event loop (async)."""
    fake, driver = run_case(HUGE_ARRAY.make())
    # What the session built so far is frozen out of the collections below: late in a long
    # session one full collection of it alone takes most of a second on a busy machine, and
    # that is the test process's cost, not the limiter's. The collection after the call then
    # walks only what was made since: the call's leftovers.
    gc.collect()
    gc.freeze()
    try:
        started = time.monotonic()
        error, _ = hostile_call(driver)
        del error
        gc.collect()
        elapsed = time.monotonic() - started
    finally:
        gc.unfreeze()
    assert elapsed < TIMEOUT + MARGIN, f"the call and its cleanup took {elapsed:.2f} s"


def test_a_reply_nobody_asked_for_never_answers_a_later_call(run_case, redis_client):
    """The fake answers the first check with a decision and, in the same packet, a second
    decision nobody asked for (a rejection with retry 42). The second check goes to the good
    server: it must get that server's answer (or an error), never the stray reply."""
    from genai_ratelimit import RateLimiterUnavailable

    fake, driver = run_case(Reply(decision(1, 9, 0) + decision(0, 0, 42)))
    try:
        driver.check(fresh_user(), LIMIT, 60)
    except RateLimiterUnavailable:
        pass
    fake.heal()
    user = fresh_user()
    try:
        answer = driver.check(user, LIMIT, 60)
    except RateLimiterUnavailable:
        answer = driver.check(user, LIMIT, 60)
    assert answer == (True, 9, 0), f"got {answer}, the stray reply or worse"
    assert logged_entries(redis_client, f"ratelimit:{user}:60") == 1


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_a_stray_reply_arriving_between_two_calls_never_answers_the_second(
        run_case, redis_client):
    """The fake answers the first check, then (once that call has returned) sends a second
    decision nobody asked for, a rejection with retry 42, on the idle connection. The next
    check goes to the good server: it must get that server's answer (or an error), never the
    stray reply that was already waiting on its connection."""
    from genai_ratelimit import RateLimiterUnavailable

    stray = ReplyThenStray(decision(1, 9, 0), decision(0, 0, 42))
    fake, driver = run_case(stray)
    assert driver.check(fresh_user(), LIMIT, 60) == (True, 9, 0)
    fake.heal()
    stray.release.set()
    assert stray.sent.wait(5), "the fake did not send the stray reply"
    user = fresh_user()
    try:
        answer = driver.check(user, LIMIT, 60)
    except RateLimiterUnavailable:
        answer = driver.check(user, LIMIT, 60)
    assert answer == (True, 9, 0), f"got {answer}, the stray reply or worse"
    assert logged_entries(redis_client, f"ratelimit:{user}:60") == 1


# ------------------------------------------------------------------------- hygiene

def test_two_hundred_hostile_calls_leak_no_file_descriptor(run_case, redis_client):
    """Open descriptors of this process (fake server included) are counted once the fake has
    closed every connection the limiter dropped, after a warm-up round of every fast case and
    again after 200 more hostile calls: the count must not grow."""
    fast = [name for name, case in CASES.items() if not case.timeout]
    fake, driver = run_case(Reply(b""))

    def hostile_round(calls: int) -> None:
        for i in range(calls):
            fake.set_behaviour(CASES[fast[i % len(fast)]].make())
            hostile_call(driver)
        fake.set_behaviour(CASES["garbage-bytes"].make())  # ends with a dropped connection
        error, _ = hostile_call(driver)
        assert error is not None
        fake.wait_until(lambda f: f.active == 0)
        gc.collect()

    hostile_round(len(fast))
    before = open_fds()
    hostile_round(200)
    after = open_fds()
    assert after <= before, f"{after - before} descriptor(s) more after 200 hostile calls"
    fake.heal()
    assert_good_answer(driver, redis_client)
