"""The protocol engine (csrc/proto.c) that both limiters drive: what used to be written
twice (the handshake and how its replies are judged, the NOSCRIPT reload and the check of
SCRIPT LOAD's reply, the replay rule) now behaves the same on the blocking and the asyncio
path, because it is the same code. Each case runs on both, against a scripted fake Redis on
loopback that answers each command with the reply the test chose.

Also here: the C methods' real signatures (inspect.signature) and the engine's Pipeline API
as aio.py uses it."""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Callable, Iterator

import pytest

from fake_redis import ScriptedRedis, decision, in_order, parse_command
from genai_ratelimit import (
    SCRIPT_SHA1,
    AsyncRateLimiter,
    RateLimiter,
    RateLimiterAuthError,
    RateLimiterUnavailable,
    _native,
)
from helpers_async import LimiterFactory
from helpers_core import SORTED_SET_SHAPE

NOSCRIPT = b"-NOSCRIPT No matching script. Please use EVAL.\r\n"
SHA_REPLY = b"$40\r\n" + SCRIPT_SHA1.encode() + b"\r\n"


OK = {"AUTH": b"+OK\r\n", "SELECT": b"+OK\r\n"}


@pytest.fixture
def scripted() -> Iterator[Callable[..., ScriptedRedis]]:
    """scripted(script, **defaults): a fake Redis answering each command with the next reply
    scripted for its name (fake_redis.in_order), +OK to AUTH and SELECT unless scripted."""
    servers: list[ScriptedRedis] = []

    def start(script: dict[str, list[bytes]], **defaults: bytes) -> ScriptedRedis:
        servers.append(ScriptedRedis(in_order(script, **{**OK, **defaults})))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def outcome(make_limiter: LimiterFactory, url: str) -> object:
    """The check's result through a limiter of the kind under test, or what it raised."""
    limiter = make_limiter(url, connect_timeout=2.0, socket_timeout=2.0)
    try:
        return limiter.check("engine-user", 5, 60)
    except Exception as exc:  # noqa: BLE001 - the test judges what was raised
        return exc


# ------------------------------------------------------------------ NOSCRIPT reload

@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_reload_after_noscript_then_the_decision_on_both_paths(scripted, make_limiter):
    server = scripted({"EVALSHA": [NOSCRIPT, decision(1, 4, 0)], "SCRIPT_LOAD": [SHA_REPLY]})
    assert outcome(make_limiter, server.url()) == (True, 4, 0)
    assert server.commands == ["INFO", "EVALSHA", "SCRIPT LOAD", "EVALSHA"]


def test_script_load_answering_something_else_than_the_sha_drops_the_connection(scripted, make_limiter):
    """SCRIPT LOAD's reply is checked on both paths (the asyncio path used to ignore it and
    take the retried EVALSHA's answer as if the load had worked)."""
    server = scripted({"EVALSHA": [NOSCRIPT, decision(1, 4, 0)], "SCRIPT_LOAD": [b":1\r\n"]})
    result = outcome(make_limiter, server.url())
    assert isinstance(result, RateLimiterUnavailable), result
    assert "SCRIPT LOAD" in str(result)


def test_a_refused_script_load_is_what_the_caller_hears(scripted, make_limiter):
    server = scripted({"EVALSHA": [NOSCRIPT, NOSCRIPT],
                       "SCRIPT_LOAD": [b"-ERR scripting is disabled on this server\r\n"]})
    result = outcome(make_limiter, server.url())
    assert isinstance(result, RateLimiterUnavailable), result
    assert "refused to load" in str(result) and "scripting is disabled" in str(result)


# ------------------------------------------------------------------------ handshake

@pytest.mark.parametrize("command", ["AUTH", "SELECT"])
def test_a_handshake_reply_that_is_not_ok_drops_the_connection(scripted, make_limiter, command):
    """+OK is the only good answer to AUTH and SELECT; an integer is garbage, not consent."""
    server = scripted({command: [b":1\r\n"]}, EVALSHA=decision(1, 4, 0))
    result = outcome(make_limiter, server.url(password="pw", db=3, username="user"))
    assert isinstance(result, RateLimiterUnavailable), result
    assert not isinstance(result, RateLimiterAuthError)
    assert f"unexpected reply to {command}" in str(result)
    assert not server.saw("EVALSHA")


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_auth_and_select_go_out_together_and_are_judged_in_order(scripted, make_limiter):
    server = scripted({}, EVALSHA=decision(1, 4, 0))
    assert outcome(make_limiter, server.url(password="pw", db=3, username="app")) == (True, 4, 0)
    assert server.requests[:2] == [[b"AUTH", b"app", b"pw"], [b"SELECT", b"3"]]


def test_a_refused_select_after_a_good_auth_names_the_database(scripted, make_limiter):
    server = scripted({"SELECT": [b"-ERR DB index is out of range\r\n"]})
    result = outcome(make_limiter, server.url(password="pw", db=99))
    assert isinstance(result, RateLimiterUnavailable) and not isinstance(result, RateLimiterAuthError)
    assert "SELECT 99" in str(result) and "out of range" in str(result)


def test_a_refused_password_is_an_auth_error_even_when_select_follows(scripted, make_limiter):
    server = scripted({"AUTH": [b"-WRONGPASS invalid username-password pair\r\n"]})
    result = outcome(make_limiter, server.url(password="nope", db=2))
    assert isinstance(result, RateLimiterAuthError), result
    assert "nope" not in str(result)


# ------------------------------------------------------------------- the Pipeline API

def test_pipeline_handshake_with_nothing_to_send_is_ready_at_once():
    loop = asyncio.new_event_loop()
    try:
        pipeline = _native.Pipeline(1.0)
        future = loop.create_future()
        assert pipeline.handshake(future) is False
        # Only INFO memory is queued, and nobody waits for it.
        sent = pipeline.take()
        assert sent is not None and parse_command(sent)[0] == [b"INFO", b"memory"]
        assert pipeline.pending == 1 and not future.done()
        assert pipeline.eviction_warning is None
        pipeline.feed(b"$52\r\n# Memory\r\nmaxmemory:0\r\nmaxmemory_policy:noeviction\r\n\r\n")
        assert pipeline.pending == 0 and pipeline.eviction_warning == "" and not future.done()
    finally:
        loop.close()


def test_pipeline_handshake_resolves_its_future_when_the_last_step_answers():
    loop = asyncio.new_event_loop()
    try:
        pipeline = _native.Pipeline(1.0)
        future = loop.create_future()
        assert pipeline.handshake(future, password="pw", db=4) is True
        sent = pipeline.take()
        assert sent is not None and parse_command(sent)[0] == [b"AUTH", b"pw"]
        assert pipeline.pending == 3  # AUTH, SELECT, INFO memory
        pipeline.feed(b"+OK\r\n")
        assert not future.done()  # SELECT is still due
        pipeline.feed(b"+OK\r\n")
        assert future.done() and future.result() is None and pipeline.pending == 1
        pipeline.feed(b"-NOPERM no INFO for this user\r\n")  # refused: not an error
        assert pipeline.pending == 0 and pipeline.eviction_warning == ""
    finally:
        loop.close()


def test_pipeline_take_replays_marks_decisions_once_and_fails_the_rest():
    loop = asyncio.new_event_loop()
    try:
        codec = _native.Codec("engine")
        pipeline = _native.Pipeline(1.0)
        request = codec.check("u", 5, 60)
        decision_future, command_future = loop.create_future(), loop.create_future()
        pipeline.push(decision_future, request)
        pipeline.push_command(command_future, "PING")
        pipeline.take()
        lost = RateLimiterUnavailable("connection to Redis lost")
        replays = pipeline.take_replays(lost)
        assert replays == [(decision_future, request)] and request.replayed
        assert command_future.exception() is lost and pipeline.pending == 0
        # A replay that breaks too is not replayed a second time.
        pipeline.push(decision_future, request)
        pipeline.take()
        assert pipeline.take_replays(lost) == []
        assert decision_future.exception() is lost
    finally:
        loop.close()


# ----------------------------------------------------- out of memory (debug builds)

HOOKS_MISSING = ("this build has no failure-injection hook (Pipeline._debug_fail_allocation): "
                 "only the debug and sanitized builds do (make install-debug / install-asan, "
                 "which test-valgrind and test-asan run)")
needs_hooks = pytest.mark.skipif(not hasattr(_native.Pipeline, "_debug_fail_allocation"),
                                 reason=HOOKS_MISSING)


@needs_hooks
def test_a_handshake_that_runs_out_of_memory_queues_nothing_and_holds_its_future_once():
    """The handshake (AUTH, SELECT, INFO memory) queues all its steps or none: each of its
    allocations fails in turn, and each time nothing is queued, nothing is to be written,
    the future's reference count is what it was (the caller keeps the only reference it
    gave), and the same pipeline then completes a handshake whose future resolves once."""
    loop = asyncio.new_event_loop()
    try:
        failures = 0
        for n in range(1, 20):
            pipeline = _native.Pipeline(1.0)
            future = loop.create_future()
            references = sys.getrefcount(future)
            pipeline._debug_fail_allocation(n)
            try:
                queued = pipeline.handshake(future, username="app", password="pw", db=4)
            except MemoryError:
                failures += 1
                assert pipeline.pending == 0 and pipeline.take() is None, f"allocation {n}"
                assert sys.getrefcount(future) == references, f"allocation {n}"
                assert pipeline.handshake(future, username="app", password="pw", db=4) is True
            else:
                assert queued is True
                break
            finally:
                pipeline._debug_fail_allocation(0)
            sent = pipeline.take()
            assert sent is not None and parse_command(sent)[0] == [b"AUTH", b"app", b"pw"]
            assert pipeline.pending == 3
            pipeline.feed(b"+OK\r\n+OK\r\n-NOPERM no INFO\r\n")
            assert future.done() and future.result() is None and pipeline.pending == 0
            del pipeline
            assert sys.getrefcount(future) == references, f"allocation {n}: after the pipeline"
        else:
            pytest.fail("the handshake never succeeded")
        assert failures >= 5, f"only {failures} of the handshake's allocations failed in turn"
    finally:
        loop.close()


@needs_hooks
def test_a_decision_that_runs_out_of_memory_queues_nothing_and_holds_its_future_once():
    loop = asyncio.new_event_loop()
    try:
        request = _native.Codec("engine").check("u", 5, 60)
        for n in (1, 2):
            pipeline = _native.Pipeline(1.0)
            future = loop.create_future()
            references = (sys.getrefcount(future), sys.getrefcount(request))
            pipeline._debug_fail_allocation(n)
            with pytest.raises(MemoryError):
                pipeline.push(future, request)
            assert pipeline.pending == 0 and pipeline.take() is None
            assert (sys.getrefcount(future), sys.getrefcount(request)) == references
    finally:
        loop.close()


# ------------------------------------------------------------------- real signatures

@pytest.mark.parametrize("function, parameters", [
    (RateLimiter.check, ["self", "user_id", "limit", "window_seconds", "cost"]),
    (RateLimiter.check_windows, ["self", "user_id", "windows", "cost"]),
    (RateLimiter.reserve, ["self", "user_id", "windows", "cost", "token_windows", "tokens",
                           "scopes", "in_flight", "scope_class", "max_wait", "tenant",
                           "max_queue", "max_queue_per_tenant"]),
    (RateLimiter.reconcile, ["self", "reservation", "actual", "release"]),
    (RateLimiter._reserve, ["self", "user_id", "windows", "cost", "token_windows", "tokens",
                            "scopes", "in_flight", "shares", "ticket", "probe"]),
    (RateLimiter._reconcile, ["self", "user_id", "windows", "member", "timestamp_ms", "cost",
                              "tokens", "scopes", "tie", "release", "shares"]),
    (RateLimiter.close, ["self"]),
    (_native.Codec.check, ["self", "user_id", "limit", "window_seconds", "cost"]),
    (_native.Codec.reconcile, ["self", "user_id", "windows", "member", "timestamp_ms", "cost",
                               "tokens", "scopes", "tie", "release", "shares"]),
    (_native.Pipeline.feed, ["self", "data"]),
    (_native.Pipeline.handshake, ["self", "future", "username", "password", "db", "ping"]),
    (RateLimiter._peek, ["self", "user_id", "windows", "cost", "token_windows", "tokens",
                         "scopes"]),
    (RateLimiter._reset, ["self", "user_id", "windows", "token_windows", "cursor"]),
    (RateLimiter.metrics, ["self"]),
    (RateLimiter._record_outcome, ["self", "kind", "count"]),
    (_native.Codec.peek, ["self", "user_id", "windows", "cost", "token_windows", "tokens",
                          "scopes"]),
    (_native.Codec.reset, ["self", "user_id", "windows", "token_windows", "cursor"]),
    (_native.Pipeline, ["timeout", "codec"]),
    (_native.Codec, ["key_prefix", "client_clock", "metrics", "hash_tag", "storage"]),
])
def test_c_functions_have_real_signatures(function, parameters):
    assert list(inspect.signature(function).parameters) == parameters


def test_the_limiter_types_signature_lists_every_keyword():
    signature = inspect.signature(_native.Limiter)
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in signature.parameters.values())
    assert {"host", "socket_timeout", "ssl_ca_certs", "max_connections"} <= set(signature.parameters)


def test_check_by_keyword_matches_the_signature(redis_url, redis_client):
    with RateLimiter(redis_url) as limiter:
        assert limiter.check(user_id="kw", limit=2, window_seconds=60) == (True, 1, 0)


def test_async_check_by_keyword_matches_the_signature(redis_url, redis_client):
    async def run() -> tuple[bool, int, int]:
        async with AsyncRateLimiter(redis_url) as limiter:
            return await limiter.check(user_id="kw", limit=2, window_seconds=60)
    assert asyncio.run(run()) == (True, 1, 0)
