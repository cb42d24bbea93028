"""RESP3 replies on our RESP2 connections: a fake Redis on loopback answers with each RESP3
type (double, boolean, null, map, set, attribute, push, big number, verbatim string) where
the limiter expects a RESP2 reply: as the whole decision, as an element of the 4-element
decision array, as the reply to AUTH and to SELECT in the handshake, and as the reply to
SCRIPT LOAD after a NOSCRIPT. The limiter never sends HELLO 3, so every one of them must
raise RateLimiterUnavailable (or a subclass), and never crash the process.

hiredis 0.14 calls these type bytes a protocol error; hiredis 1.x parses them, and a reader
whose reply functions do not cover the RESP3 types makes hiredis hand out the type number
cast to a pointer (a double becomes the "reply" 0x7): dereferencing it kills the process.
So each case runs the limiter in a child process (the fake server stays here, and records
what it was asked): a crash fails that one test and names the signal, instead of taking
pytest down. make test-hiredis1 runs these against hiredis 1.x, make test against 0.14.

Every kind of limiter (the limiter_kind fixture: sync, asyncio, uvloop) is built in the
child; the fake is fake_redis.ScriptedRedis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from fake_redis import ScriptedRedis, answers, decision

TIMEOUT = 0.5       # connect_timeout and socket_timeout of the limiter in the child
CHILD_SECONDS = 10  # watchdog on the child's whole life (start-up, one check, close)
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# What the limiter's check(user, 10, 60) would get from a real Redis for a fresh user.
GOOD_DECISION = decision(1, 9, 0)

# An attribute annotates the reply that follows it: RESP3 sends the two together.
ATTRIBUTE = b"|1\r\n+ttl\r\n:3\r\n"


@dataclass(frozen=True)
class Resp3:
    """One RESP3 value. `alone` is it sent as a complete reply; `element` as an element of
    an array (for an attribute: the attribute plus the element it annotates); `before(r)`
    is the value followed by, or (attribute) annotating, the RESP2 reply r."""

    alone: bytes
    annotates: bool = False

    def element(self) -> bytes:
        return self.alone + b":9\r\n" if self.annotates else self.alone

    def before(self, reply: bytes) -> bytes:
        return self.alone + reply if self.annotates else self.alone


RESP3: dict[str, Resp3] = {
    "double": Resp3(b",1.5\r\n"),
    "bool": Resp3(b"#t\r\n"),
    "null": Resp3(b"_\r\n"),
    # A map and a set of four integers: flattened, they have the decision's four integers.
    "map": Resp3(b"%2\r\n:1\r\n:9\r\n:0\r\n:1\r\n"),
    "set": Resp3(b"~4\r\n:1\r\n:9\r\n:0\r\n:1\r\n"),
    "attribute": Resp3(ATTRIBUTE, annotates=True),
    # A client-tracking invalidation whose null means "everything".
    "push": Resp3(b">2\r\n$10\r\ninvalidate\r\n_\r\n"),
    "big-number": Resp3(b"(3492890328409238509324850943850943825024385\r\n"),
    "verbatim": Resp3(b"=15\r\ntxt:Some string\r\n"),
}


@pytest.fixture
def scripted() -> Iterator[Callable[..., ScriptedRedis]]:
    """scripted(**replies) -> a running ScriptedRedis answering with answers(**replies)."""
    servers: list[ScriptedRedis] = []

    def start(**replies: bytes) -> ScriptedRedis:
        servers.append(ScriptedRedis(answers(**replies)))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


# ------------------------------------------------------------------ the child process

CHILD = r"""
import json, sys
tests_dir, kind, url, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
sys.path.insert(0, tests_dir)
import asyncio
from genai_ratelimit import AsyncRateLimiter, RateLimiter, RateLimiterUnavailable

async def check_async():
    async with AsyncRateLimiter(url, connect_timeout=timeout, socket_timeout=timeout) as limiter:
        return await limiter.check("resp3-user", 10, 60)

def check():
    if kind == "sync":
        with RateLimiter(url, connect_timeout=timeout, socket_timeout=timeout) as limiter:
            return limiter.check("resp3-user", 10, 60)
    if kind == "uvloop":
        import uvloop
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(check_async())
    finally:
        loop.close()

try:
    outcome = {"returned": list(check())}
except Exception as exc:
    outcome = {"raised": type(exc).__name__, "message": str(exc),
               "unavailable": isinstance(exc, RateLimiterUnavailable)}
print(json.dumps(outcome))
"""


def check_in_child(kind: str, url: str, cwd: str) -> dict:
    """One check by a fresh limiter of that kind in a child process. Returns what it
    returned or raised; fails the test, naming the signal, when the child died of one."""
    proc = subprocess.run(
        # -W error: a warning in the child (an unclosed transport, ...) fails it too.
        [sys.executable, "-W", "error", "-c", CHILD, TESTS_DIR, kind, url, str(TIMEOUT)],
        # Not the source tree: its genai_ratelimit has no compiled extension.
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=CHILD_SECONDS,
    )
    if proc.returncode < 0:
        pytest.fail(f"the child running the {kind} limiter was killed by "
                    f"{signal.Signals(-proc.returncode).name}\n--- stderr:\n{proc.stderr[-3000:]}")
    assert proc.returncode == 0, f"the child exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_unavailable(outcome: dict) -> None:
    assert "raised" in outcome, f"the check returned {outcome.get('returned')} instead of raising"
    assert outcome["unavailable"], f"raised {outcome['raised']}: {outcome['message']}"
    assert outcome["message"]


@pytest.fixture(scope="module")
def child_cwd(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("resp3-child"))


# -------------------------------------------------------------------------- the cases

@pytest.mark.parametrize("resp3", RESP3)
def test_resp3_value_as_the_decision_reply_raises_unavailable(scripted, child_cwd, resp3, limiter_kind):
    server = scripted(EVALSHA=RESP3[resp3].before(GOOD_DECISION))
    assert_unavailable(check_in_child(limiter_kind, server.url(), child_cwd))
    assert server.saw("EVALSHA")


@pytest.mark.parametrize("resp3", RESP3)
def test_resp3_value_inside_the_decision_array_raises_unavailable(scripted, child_cwd, resp3, limiter_kind):
    """The second of the four integers (remaining) replaced by the RESP3 value."""
    server = scripted(EVALSHA=b"*7\r\n:1\r\n" + RESP3[resp3].element()
                      + b":0\r\n:1\r\n:0\r\n*1\r\n:9\r\n:0\r\n")
    assert_unavailable(check_in_child(limiter_kind, server.url(), child_cwd))
    assert server.saw("EVALSHA")


@pytest.mark.parametrize("resp3", RESP3)
def test_resp3_reply_to_auth_raises_unavailable(scripted, child_cwd, resp3, limiter_kind):
    """Whatever a RESP3 value to AUTH means, it is not RESP2's +OK: the handshake fails,
    even though the server would then answer the decision well."""
    server = scripted(AUTH=RESP3[resp3].before(b"+OK\r\n"), EVALSHA=GOOD_DECISION)
    assert_unavailable(check_in_child(limiter_kind, server.url(password="secret"), child_cwd))
    assert server.saw("AUTH")


@pytest.mark.parametrize("resp3", RESP3)
def test_resp3_reply_to_select_raises_unavailable(scripted, child_cwd, resp3, limiter_kind):
    server = scripted(SELECT=RESP3[resp3].before(b"+OK\r\n"), EVALSHA=GOOD_DECISION)
    assert_unavailable(check_in_child(limiter_kind, server.url(db=3), child_cwd))
    assert server.saw("SELECT")


@pytest.mark.parametrize("resp3", RESP3)
def test_resp3_reply_to_script_load_after_noscript_raises_unavailable(
        scripted, child_cwd, resp3, limiter_kind):
    """Every EVALSHA gets NOSCRIPT, so the limiter loads the script; SCRIPT LOAD gets the
    RESP3 value (an attribute: annotating the right SHA1)."""
    from genai_ratelimit import _native

    sha = _native.SCRIPT_SHA1.encode()
    server = scripted(EVALSHA=b"-NOSCRIPT No matching script. Please use EVAL.\r\n",
                      SCRIPT_LOAD=RESP3[resp3].before(b"$%d\r\n%s\r\n" % (len(sha), sha)))
    assert_unavailable(check_in_child(limiter_kind, server.url(), child_cwd))
    assert server.saw("SCRIPT LOAD")
