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
import socket
import threading
from collections.abc import Iterator

import pytest

from fake_redis import decision, parse_command
from genai_ratelimit import (
    SCRIPT_SHA1,
    AsyncRateLimiter,
    RateLimiter,
    RateLimiterAuthError,
    RateLimiterUnavailable,
    _native,
)
from helpers_async import LimiterFactory

NOSCRIPT = b"-NOSCRIPT No matching script. Please use EVAL.\r\n"
SHA_REPLY = b"$40\r\n" + SCRIPT_SHA1.encode() + b"\r\n"


class ScriptedRedis:
    """Answers each command with the next reply scripted for its name (AUTH, SELECT,
    EVALSHA, SCRIPT, PING), falling back to `default[name]`; logs every command it read.
    Bounded: daemon threads, a stop flag polled every 50 ms, closed by the test."""

    def __init__(self, script: dict[bytes, list[bytes]], default: dict[bytes, bytes] | None = None) -> None:
        self.script = {name: list(replies) for name, replies in script.items()}
        self.default = {b"PING": b"+PONG\r\n", b"AUTH": b"+OK\r\n", b"SELECT": b"+OK\r\n",
                        **(default or {})}
        self.commands: list[list[bytes]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def url(self, path: str = "/0", auth: str = "") -> str:
        return f"redis://{auth}127.0.0.1:{self.port}{path}"

    def _next_reply(self, name: bytes) -> bytes | None:
        with self._lock:
            replies = self.script.get(name)
            if replies:
                return replies.pop(0)
            return self.default.get(name)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(0.05)
        buf = bytearray()
        with conn:
            while not self._stop.is_set():
                parsed = parse_command(buf)
                if parsed is None:
                    try:
                        data = conn.recv(65536)
                    except TimeoutError:
                        continue
                    except OSError:
                        return
                    if not data:
                        return
                    buf += data
                    continue
                args, used = parsed
                del buf[:used]
                with self._lock:
                    self.commands.append(args)
                reply = self._next_reply(args[0].upper())
                if reply is None:
                    reply = b"-ERR the scripted fake has no reply for '%s'\r\n" % args[0]
                try:
                    conn.sendall(reply)
                except OSError:
                    return

    def names(self) -> list[bytes]:
        with self._lock:
            return [c[0].upper() for c in self.commands]

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        self._thread.join(timeout=5)


@pytest.fixture
def scripted() -> Iterator[list[ScriptedRedis]]:
    servers: list[ScriptedRedis] = []
    yield servers
    for server in servers:
        server.close()


def serve(servers: list[ScriptedRedis], script: dict[bytes, list[bytes]],
          default: dict[bytes, bytes] | None = None) -> ScriptedRedis:
    server = ScriptedRedis(script, default)
    servers.append(server)
    return server


def outcome(make_limiter: LimiterFactory, url: str) -> object:
    """The check's result through a limiter of the kind under test, or what it raised."""
    limiter = make_limiter(url, connect_timeout=2.0, socket_timeout=2.0)
    try:
        return limiter.check("engine-user", 5, 60)
    except Exception as exc:  # noqa: BLE001 - the test judges what was raised
        return exc


# ------------------------------------------------------------------ NOSCRIPT reload

def test_reload_after_noscript_then_the_decision_on_both_paths(scripted, make_limiter):
    server = serve(scripted, {b"EVALSHA": [NOSCRIPT, decision(1, 4, 0)], b"SCRIPT": [SHA_REPLY]})
    assert outcome(make_limiter, server.url()) == (True, 4, 0)
    assert server.names() == [b"EVALSHA", b"SCRIPT", b"EVALSHA"]


def test_script_load_answering_something_else_than_the_sha_drops_the_connection(scripted, make_limiter):
    """SCRIPT LOAD's reply is checked on both paths (the asyncio path used to ignore it and
    take the retried EVALSHA's answer as if the load had worked)."""
    server = serve(scripted, {b"EVALSHA": [NOSCRIPT, decision(1, 4, 0)], b"SCRIPT": [b":1\r\n"]})
    result = outcome(make_limiter, server.url())
    assert isinstance(result, RateLimiterUnavailable), result
    assert "SCRIPT LOAD" in str(result)


def test_a_refused_script_load_is_what_the_caller_hears(scripted, make_limiter):
    server = serve(scripted, {b"EVALSHA": [NOSCRIPT, NOSCRIPT],
                              b"SCRIPT": [b"-ERR scripting is disabled on this server\r\n"]})
    result = outcome(make_limiter, server.url())
    assert isinstance(result, RateLimiterUnavailable), result
    assert "refused to load" in str(result) and "scripting is disabled" in str(result)


# ------------------------------------------------------------------------ handshake

@pytest.mark.parametrize("command", [b"AUTH", b"SELECT"])
def test_a_handshake_reply_that_is_not_ok_drops_the_connection(scripted, make_limiter, command):
    """+OK is the only good answer to AUTH and SELECT; an integer is garbage, not consent."""
    server = serve(scripted, {command: [b":1\r\n"]},
                   default={b"EVALSHA": decision(1, 4, 0)})
    result = outcome(make_limiter, server.url("/3", "user:pw@"))
    assert isinstance(result, RateLimiterUnavailable), result
    assert not isinstance(result, RateLimiterAuthError)
    assert f"unexpected reply to {command.decode()}" in str(result)
    assert b"EVALSHA" not in server.names()


def test_auth_and_select_go_out_together_and_are_judged_in_order(scripted, make_limiter):
    server = serve(scripted, {}, default={b"EVALSHA": decision(1, 4, 0)})
    assert outcome(make_limiter, server.url("/3", "app:pw@")) == (True, 4, 0)
    assert server.commands[:2] == [[b"AUTH", b"app", b"pw"], [b"SELECT", b"3"]]


def test_a_refused_select_after_a_good_auth_names_the_database(scripted, make_limiter):
    server = serve(scripted, {b"SELECT": [b"-ERR DB index is out of range\r\n"]})
    result = outcome(make_limiter, server.url("/99", ":pw@"))
    assert isinstance(result, RateLimiterUnavailable) and not isinstance(result, RateLimiterAuthError)
    assert "SELECT 99" in str(result) and "out of range" in str(result)


def test_a_refused_password_is_an_auth_error_even_when_select_follows(scripted, make_limiter):
    server = serve(scripted, {b"AUTH": [b"-WRONGPASS invalid username-password pair\r\n"]})
    result = outcome(make_limiter, server.url("/2", ":nope@"))
    assert isinstance(result, RateLimiterAuthError), result
    assert "nope" not in str(result)


# ------------------------------------------------------------------- the Pipeline API

def test_pipeline_handshake_with_nothing_to_send_is_ready_at_once():
    loop = asyncio.new_event_loop()
    try:
        pipeline = _native.Pipeline(1.0)
        future = loop.create_future()
        assert pipeline.handshake(future) is False
        assert pipeline.take() is None and pipeline.pending == 0 and not future.done()
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
        assert pipeline.pending == 2
        pipeline.feed(b"+OK\r\n")
        assert not future.done()  # SELECT is still due
        pipeline.feed(b"+OK\r\n")
        assert future.done() and future.result() is None and pipeline.pending == 0
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


# ------------------------------------------------------------------- real signatures

@pytest.mark.parametrize("function, parameters", [
    (RateLimiter.check, ["self", "user_id", "limit", "window_seconds"]),
    (RateLimiter.check_windows, ["self", "user_id", "windows"]),
    (RateLimiter.close, ["self"]),
    (_native.Codec.check, ["self", "user_id", "limit", "window_seconds"]),
    (_native.Pipeline.feed, ["self", "data"]),
    (_native.Pipeline.handshake, ["self", "future", "username", "password", "db", "ping"]),
    (_native.Pipeline, ["timeout"]),
    (_native.Codec, ["key_prefix", "client_clock"]),
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
