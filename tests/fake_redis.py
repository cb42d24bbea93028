"""A hostile fake Redis on loopback. (The limiter of each kind that meets it comes from the
`make_limiter` fixture, tests/conftest.py.)

FakeRedis listens on 127.0.0.1 (a free port) and speaks just enough RESP to read the
commands a limiter sends. While it is "hostile" it answers every EVALSHA with a chosen
misbehaviour (garbage, a wrong type, a truncated reply, silence, a slow trickle, a huge
bulk string, ...). `heal()` turns it into a transparent proxy to a real redis-server: from
then on every command, on old and new connections alike, is relayed byte for byte. So one
limiter object can meet the fault and then, on the same URL, a good server: what the test
proves is that the limiter got over the fault by itself.

Bounded, and stops by itself: at most `max_connections` connections at once (more are
closed on accept), a `lifetime` after which it shuts everything down even if the test
forgot to, daemon threads only, and every blocking wait polls a stop event.

Nothing here mocks the limiter or Redis's algorithm: the good answers come from a real
server, the bad ones go over a real socket.
"""

from __future__ import annotations

import hashlib
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

# ------------------------------------------------------------------- RESP requests


def parse_command(buf: bytes | bytearray) -> tuple[list[bytes], int] | None:
    """Parses one RESP request (an array of bulk strings) at the start of buf.
    Returns (arguments, bytes consumed), or None when buf holds only part of it."""
    if not buf:
        return None
    if buf[:1] != b"*":
        raise ValueError(f"not a RESP request: {bytes(buf[:20])!r}")
    end = buf.find(b"\r\n")
    if end < 0:
        return None
    count = int(buf[1:end])
    pos = end + 2
    args: list[bytes] = []
    for _ in range(count):
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return None
        if buf[pos:pos + 1] != b"$":
            raise ValueError("a request argument is not a bulk string")
        length = int(buf[pos + 1:end])
        start = end + 2
        if len(buf) < start + length + 2:
            return None
        args.append(bytes(buf[start:start + length]))
        pos = start + length + 2
    return args, pos


def read_commands(conn: socket.socket, stopped: Callable[[], bool]
                  ) -> Iterator[tuple[list[bytes], bytes, bytearray]]:
    """The requests a client sends on conn (a socket with a short timeout), one at a time:
    (arguments, the request's raw bytes, the bytes read after it so far). Ends at EOF, on
    a socket error, on bytes that are not a client's request, or once stopped() is true."""
    buf = bytearray()
    while not stopped():
        try:
            parsed = parse_command(buf)
        except ValueError:
            return  # not a client's request: hang up
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
        raw = bytes(buf[:used])
        del buf[:used]
        yield args, raw, buf


DECISION_NOW_MS = 1_767_225_600_000  # the decision's time in a canned reply (2026-01-01)


def decision(allowed: int, remaining: int, retry_after_s: int, window_index: int = 1,
             windows: int = 1) -> bytes:
    """The RESP text of a well-formed reply of lua/sliding_window.lua to a check of
    `windows` windows: {allowed, remaining, retry, window, now, {remaining per window},
    retry_ms} (every window at `remaining` on allow; the windows up to the rejecting one
    at 0; the wait in ms a whole number of seconds)."""
    reached = windows if allowed else window_index
    each = remaining if allowed else 0
    return (b"*7\r\n:%d\r\n:%d\r\n:%d\r\n:%d\r\n:%d\r\n" % (
        allowed, remaining, retry_after_s, window_index, DECISION_NOW_MS)
        + b"*%d\r\n" % reached + b":%d\r\n" % each * reached
        + b":%d\r\n" % (retry_after_s * 1000))


# ---------------------------------------------------------------- misbehaviours

class Behaviour:
    """What the fake does with one EVALSHA while it is hostile. act() returns True when the
    connection should stay open (and be read on), False when the fake must drop it."""

    def act(self, conn: socket.socket, stop: threading.Event) -> bool:
        raise NotImplementedError


@dataclass
class Reply(Behaviour):
    """Sends `data` at once; then keeps the connection open, or closes it (close=True)."""

    data: bytes
    close: bool = False

    def act(self, conn: socket.socket, stop: threading.Event) -> bool:
        try:
            if self.data:
                conn.sendall(self.data)
        except OSError:
            return False
        return not self.close


def wait_until_delivered(conn: socket.socket, timeout: float = 5.0) -> None:
    """Waits (bounded) until the peer's kernel holds everything sent on conn: nothing left in
    the send queue (SIOCOUTQ: unsent or unacknowledged bytes). sendall() returning does not
    mean that yet, even on loopback: a poll() on the other end may still see nothing."""
    import fcntl
    import struct
    import termios

    deadline = time.monotonic() + timeout
    while True:
        left = struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        if left == 0 or time.monotonic() > deadline:
            return
        time.sleep(0.001)


@dataclass
class ReplyThenStray(Behaviour):
    """Sends `data` at once; then, when the test sets `release`, a `stray` reply nobody
    asked for, and sets `sent`. The connection stays open."""

    data: bytes
    stray: bytes
    release: threading.Event = field(default_factory=threading.Event)
    sent: threading.Event = field(default_factory=threading.Event)

    def act(self, conn: socket.socket, stop: threading.Event) -> bool:
        try:
            conn.sendall(self.data)
            while not self.release.wait(0.05):
                if stop.is_set():
                    return False
            conn.sendall(self.stray)
            wait_until_delivered(conn)
        except OSError:
            return False
        self.sent.set()
        return True


@dataclass
class Silence(Behaviour):
    """Never answers: holds the connection until the client gives up (or the fake stops)."""

    def act(self, conn: socket.socket, stop: threading.Event) -> bool:
        while not stop.is_set():
            try:
                if conn.recv(65536) == b"":
                    return False
            except TimeoutError:
                continue
            except OSError:
                return False
        return False


@dataclass
class Trickle(Behaviour):
    """Sends `data` one byte every `interval` seconds: a valid reply, far too slowly."""

    data: bytes
    interval: float

    def act(self, conn: socket.socket, stop: threading.Event) -> bool:
        for i in range(len(self.data)):
            if i and stop.wait(self.interval):
                return False
            try:
                conn.sendall(self.data[i:i + 1])
            except OSError:
                return False
        return True


@dataclass
class Stream(Behaviour):
    """Sends `header`, then `chunk` every `interval` seconds until `total` bytes went out
    or the client hung up. With header b"$1000000000\\r\\n" it is a bulk string of a gigabyte
    that a client would have to read to the end to stay in step."""

    header: bytes
    chunk: bytes
    interval: float
    total: int
    sent: int = 0

    def act(self, conn: socket.socket, stop: threading.Event) -> bool:
        self.sent = 0
        try:
            conn.sendall(self.header)
            while self.sent < self.total and not stop.is_set():
                conn.sendall(self.chunk)
                self.sent += len(self.chunk)
                if self.interval and stop.wait(self.interval):
                    break
        except OSError:
            return False
        return False


# ------------------------------------------------------------------------ server

class FakeRedis:
    """A loopback server that misbehaves on every EVALSHA until heal(), then proxies to
    `upstream` ((host, port) of a real redis-server). See the module docstring."""

    def __init__(self, behaviour: Behaviour | None, upstream: tuple[str, int] | None = None,
                 *, max_connections: int = 64, lifetime: float = 120.0) -> None:
        self._behaviour = behaviour
        self.upstream = upstream
        self.max_connections = max_connections
        self._deadline = time.monotonic() + lifetime
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self.accepted = 0          # connections accepted so far
        self.active = 0            # connections being served now
        self.decisions = 0         # EVALSHA commands answered with a misbehaviour
        self.script_loads = 0      # SCRIPT LOAD commands answered while hostile
        self.proxied = 0           # connections that became a proxy to upstream
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(128)
        self.server.settimeout(0.05)
        self.port = self.server.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name=f"fake-redis-{self.port}",
                                        daemon=True)
        self._threads: list[threading.Thread] = []
        self._thread.start()

    # -- what the tests use
    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def set_behaviour(self, behaviour: Behaviour | None) -> None:
        """The misbehaviour for the next EVALSHA (None: heal). A connection that already
        became a proxy stays one."""
        with self._changed:
            self._behaviour = behaviour
            self._changed.notify_all()

    def heal(self) -> None:
        """From now on, every command is relayed to the real server."""
        if self.upstream is None:
            raise RuntimeError("this FakeRedis has no upstream to heal to")
        self.set_behaviour(None)

    def wait_until(self, condition: Callable[[FakeRedis], bool], timeout: float = 10.0) -> None:
        """Blocks until condition(self) holds (checked on every change of the counters);
        fails the test when `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not condition(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"the fake Redis did not reach the expected state within {timeout} s "
                        f"(accepted={self.accepted}, active={self.active}, "
                        f"decisions={self.decisions}, proxied={self.proxied})")
                self._changed.wait(left)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in list(self._threads):
            t.join(5)
        self.server.close()

    def __enter__(self) -> FakeRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- bookkeeping
    def _bump(self, name: str, delta: int = 1) -> None:
        with self._changed:
            setattr(self, name, getattr(self, name) + delta)
            self._changed.notify_all()

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._sockets.add(s)

    def _forget(self, s: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(s)
        s.close()

    # -- serving
    def _serve(self) -> None:
        while not self._stop.is_set():
            if time.monotonic() > self._deadline:  # the test forgot us: stop by ourselves
                self._stop.set()
                break
            try:
                conn, _ = self.server.accept()
            except (TimeoutError, OSError):
                continue
            if self.active >= self.max_connections:
                conn.close()
                continue
            conn.settimeout(0.05)
            self._track(conn)
            self._bump("accepted")
            self._bump("active")
            thread = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            for args, raw, rest in read_commands(conn, self._stop.is_set):
                with self._changed:
                    behaviour = self._behaviour
                if behaviour is None:
                    self._proxy(conn, raw + bytes(rest))
                    return
                name = args[0].upper()
                if name == b"EVALSHA":
                    self._bump("decisions")
                    if not behaviour.act(conn, self._stop):
                        return
                elif name == b"SCRIPT" and len(args) == 3 and args[1].upper() == b"LOAD":
                    self._bump("script_loads")
                    sha = hashlib.sha1(args[2]).hexdigest().encode()
                    conn.sendall(b"$%d\r\n%s\r\n" % (len(sha), sha))
                elif name == b"PING":
                    conn.sendall(b"+PONG\r\n")
                else:
                    conn.sendall(b"-ERR the fake Redis does not know '%s'\r\n" % args[0])
        except OSError:
            return
        finally:
            self._forget(conn)
            self._bump("active", -1)

    def _proxy(self, conn: socket.socket, pending: bytes) -> None:
        """Relays bytes both ways between conn and a new connection to upstream until
        either side closes or the fake stops."""
        assert self.upstream is not None
        upstream = socket.create_connection(self.upstream, timeout=5)
        self._track(upstream)
        self._bump("proxied")
        try:
            upstream.sendall(pending)
            with selectors.DefaultSelector() as selector:
                selector.register(conn, selectors.EVENT_READ, upstream)
                selector.register(upstream, selectors.EVENT_READ, conn)
                while not self._stop.is_set():
                    for key, _ in selector.select(timeout=0.05):
                        source: socket.socket = key.fileobj  # type: ignore[assignment]
                        try:
                            data = source.recv(65536)
                        except (TimeoutError, BlockingIOError):
                            continue
                        if not data:
                            return
                        key.data.sendall(data)
        except OSError:
            return
        finally:
            self._forget(upstream)


# ------------------------------------------------------- a scripted fake Redis

class ScriptedRedis:
    """A loopback server that answers each command with answer(args): bytes to send (see
    answers() and in_order()), b"" to stay silent, or None to hang up. It records every
    command it was sent (`requests`, the arguments) and its name (`commands`, "SCRIPT LOAD"
    for that one). Daemon threads only; stops on close() or, if a test forgot, after
    `lifetime` seconds."""

    def __init__(self, answer: Callable[[list[bytes]], bytes | None], lifetime: float = 60.0) -> None:
        self.answer = answer
        self.commands: list[str] = []
        self.requests: list[list[bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._deadline = time.monotonic() + lifetime
        self._connections: list[socket.socket] = []
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(16)
        self.server.settimeout(0.05)
        self.port = self.server.getsockname()[1]
        self._threads = [threading.Thread(target=self._serve, daemon=True)]
        self._threads[0].start()

    def url(self, password: str | None = None, db: int = 0, username: str = "") -> str:
        auth = f"{username}:{password}@" if password is not None else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def saw(self, name: str) -> bool:
        with self._lock:
            return name in self.commands

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self.server.close()

    def __enter__(self) -> ScriptedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            conn.settimeout(0.05)
            thread = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _handle(self, conn: socket.socket) -> None:
        def stopped() -> bool:
            return self._stop.is_set() or time.monotonic() >= self._deadline

        with conn:
            for args, _, _ in read_commands(conn, stopped):
                name = b" ".join(args[:2] if args[0].upper() == b"SCRIPT" else args[:1])
                with self._lock:
                    self.commands.append(name.decode("ascii", "replace").upper())
                    self.requests.append(args)
                reply = self.answer(args)
                if reply is None:
                    return  # hang up (the with block closes the connection)
                try:
                    conn.sendall(reply)
                except OSError:
                    return


def answers(**replies: bytes) -> Callable[[list[bytes]], bytes]:
    """answer(args) for ScriptedRedis: replies by command name (SCRIPT_LOAD for SCRIPT LOAD);
    SCRIPT LOAD defaults to the script's SHA1, PING to PONG, anything else to an error."""

    def answer(args: list[bytes]) -> bytes:
        name = args[0].upper().decode()
        if name == "SCRIPT" and len(args) == 3 and args[1].upper() == b"LOAD":
            sha = hashlib.sha1(args[2]).hexdigest().encode()
            return replies.get("SCRIPT_LOAD", b"$40\r\n" + sha + b"\r\n")
        if name in replies:
            return replies[name]
        if name == "PING":
            return b"+PONG\r\n"
        return b"-ERR the fake Redis does not know '%s'\r\n" % args[0]

    return answer


def in_order(script: dict[str, list[bytes]], **defaults: bytes) -> Callable[[list[bytes]], bytes]:
    """answer(args) for ScriptedRedis: the next reply scripted for the command's name
    (SCRIPT_LOAD for SCRIPT LOAD), then answers(**defaults) once those run out."""
    queues = {name: list(replies) for name, replies in script.items()}
    fallback = answers(**defaults)
    lock = threading.Lock()

    def answer(args: list[bytes]) -> bytes:
        name = args[0].upper().decode()
        if name == "SCRIPT" and len(args) >= 2:
            name = "SCRIPT_" + args[1].upper().decode()
        with lock:
            queue = queues.get(name)
            if queue:
                return queue.pop(0)
        return fallback(args)

    return answer


def open_fds() -> int:
    """How many file descriptors this process holds now."""
    import os

    return len(os.listdir("/proc/self/fd"))
