"""Helpers for the core limiter tests: reading the server's clock and command statistics,
watching MONITOR, lining up concurrent callers, real faulty endpoints on loopback (a closed
port, a listener whose accept queue is full, a server that answers garbage, a server that
reads a big command slowly and never answers), fork children that report over a pipe within
a deadline, and a driver that sends signals to the main thread while it is blocked in a
system call.

Nothing here mocks Redis: every helper observes or provokes a real server or socket."""

from __future__ import annotations

import json
import math
import os
import re
import select
import signal
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis

from fake_redis import parse_command
from redis_server import RedisServer, free_port

# The commands the inspection client itself sends while a test measures.
INSPECTION_COMMANDS = frozenset({"info", "time", "echo", "client|list", "client|info",
                                 "client|id", "config|resetstat", "monitor", "hello",
                                 "client|setinfo", "ping"})


# ------------------------------------------------------------------ the server's clock

def server_ms(client: redis.Redis) -> int:
    """The Redis server's clock (TIME) in unix milliseconds, truncated like the script does."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def wait_until_server_ms(client: redis.Redis, target_ms: int, timeout: float) -> int:
    """Polls the server's clock until it reads at least target_ms; returns the reading.
    Fails the test when the deadline passes first."""
    deadline = time.monotonic() + timeout
    while True:
        now = server_ms(client)
        if now >= target_ms:
            return now
        if time.monotonic() >= deadline:
            raise AssertionError(f"the server clock did not reach {target_ms} within {timeout} s "
                                 f"(it reads {now})")
        # Sleep most of what is left, then poll again: the condition is the server's clock.
        time.sleep(min(0.05, max(0.001, (target_ms - now) / 1000 / 2)))


def expected_retry_after(oldest_ms: int, window_ms: int, now_ms: int) -> int:
    """The contract's formula: max(1, ceil((score_k + window_ms - now_ms) / 1000))."""
    return max(1, math.ceil((oldest_ms + window_ms - now_ms) / 1000))


def retry_after_bounds(score_ms: int, window_ms: int, before_ms: int, after_ms: int) -> tuple[int, int]:
    """The retry values the formula allows when the script's `now` lies between the server
    clock read just before and just after the call: (smallest, largest)."""
    return (expected_retry_after(score_ms, window_ms, after_ms),
            expected_retry_after(score_ms, window_ms, before_ms))


# ------------------------------------------------------------ command statistics

def commandstats(client: redis.Redis) -> dict[str, int]:
    """Calls per command since the last reset, as INFO commandstats reports them (commands
    run inside a script are counted too on Redis 7)."""
    info = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(stats["calls"]) for name, stats in info.items()}


def stats_delta(before: dict[str, int], after: dict[str, int],
                ignore: frozenset[str] = INSPECTION_COMMANDS) -> dict[str, int]:
    """Commands whose call count grew between two commandstats snapshots, without the
    inspection client's own commands."""
    delta = {}
    for name, calls in after.items():
        grown = calls - before.get(name, 0)
        if grown and name not in ignore:
            delta[name] = grown
    return delta


@contextmanager
def measured_commands(client: redis.Redis) -> Iterator[dict[str, int]]:
    """`with measured_commands(client) as delta:` fills `delta` with the commands that ran
    on the server inside the block (script-internal commands included)."""
    delta: dict[str, int] = {}
    before = commandstats(client)
    yield delta
    delta.update(stats_delta(before, commandstats(client)))


def connections_received(client: redis.Redis) -> int:
    return int(client.info("stats")["total_connections_received"])


# ------------------------------------------------------------------------ MONITOR

_MONITOR_LINE = re.compile(r"^\+?(?P<time>\d+\.\d+) \[(?P<db>\d+) (?P<source>[^\]]+)\] (?P<args>.*)$", re.S)
_MONITOR_ARG = re.compile(r'"((?:\\.|[^"\\])*)"', re.S)
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "a": "\a", "b": "\b", '"': '"', "\\": "\\"}


def _unescape(text: str) -> str:
    """Undoes Redis' sdscatrepr quoting of one MONITOR argument."""
    out, i = [], 0
    raw = bytearray()
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "x" and i + 3 < len(text):
                raw.append(int(text[i + 2:i + 4], 16))
                i += 4
                continue
            raw.extend(_ESCAPES.get(nxt, nxt).encode())
            i += 2
            continue
        raw.extend(ch.encode())
        i += 1
    out.append(raw.decode("utf-8", errors="surrogateescape"))
    return "".join(out)


@dataclass
class MonitoredCommand:
    source: str            # "lua" for commands run by a script, else "host:port" or "unix:..."
    args: list[str]        # the command and its arguments, unquoted

    @property
    def name(self) -> str:
        return self.args[0].upper() if self.args else ""

    @property
    def from_script(self) -> bool:
        return self.source == "lua"


@dataclass
class Monitor:
    """Records every command the server runs while it is open (MONITOR). Commands run by
    scripts show up with source "lua". Closing it waits until the server echoed a sentinel
    sent after everything else, so no command of the block can be missed."""

    client: redis.Redis
    commands: list[MonitoredCommand] = field(default_factory=list)
    _token: str = field(default_factory=lambda: f"monitor-end-{uuid.uuid4().hex}")

    def __enter__(self) -> Monitor:
        # A raw socket, so what we read is exactly the server's MONITOR text.
        kwargs = self.client.connection_pool.connection_kwargs
        if kwargs.get("path"):
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.connect(kwargs["path"])
        else:
            self._sock = socket.create_connection((kwargs.get("host", "localhost"),
                                                   kwargs.get("port", 6379)))
        self._sock.settimeout(10)
        self._lines = self._sock.makefile("rb")
        if kwargs.get("password"):
            auth = [b"AUTH"] + ([kwargs["username"].encode()] if kwargs.get("username") else [])
            self._send(*auth, kwargs["password"].encode())
            assert self._lines.readline().startswith(b"+OK"), "MONITOR could not authenticate"
        self._send(b"MONITOR")
        assert self._lines.readline().startswith(b"+OK"), "MONITOR was refused"
        self._inspector = self.client.client_info()["addr"]
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _send(self, *args: bytes) -> None:
        out = b"*%d\r\n" % len(args)
        for arg in args:
            out += b"$%d\r\n%s\r\n" % (len(arg), arg)
        self._sock.sendall(out)

    def _read(self) -> None:
        try:
            while True:
                raw = self._lines.readline()
                if not raw:
                    raise ConnectionError("the MONITOR connection closed")
                line = raw.rstrip(b"\r\n").decode("utf-8", errors="surrogateescape")
                match = _MONITOR_LINE.match(line)
                if match is None:
                    continue
                args = [_unescape(a) for a in _MONITOR_ARG.findall(match["args"])]
                if len(args) == 2 and args[0].upper() == "ECHO" and args[1] == self._token:
                    return
                self.commands.append(MonitoredCommand(source=match["source"], args=args))
        except BaseException as exc:  # reported by __exit__
            self._error = exc

    def __exit__(self, *exc: object) -> None:
        self.client.echo(self._token)
        self._thread.join(10)
        alive = self._thread.is_alive()
        self._lines.close()
        self._sock.close()
        if alive:
            raise AssertionError("MONITOR did not see its end marker within 10 s")
        if self._error is not None:
            raise AssertionError(f"reading MONITOR failed: {self._error!r}")

    def from_others(self) -> list[MonitoredCommand]:
        """Top-level commands from any client but the inspection client."""
        return [c for c in self.commands if not c.from_script and c.source != self._inspector]

    def from_scripts(self) -> list[MonitoredCommand]:
        return [c for c in self.commands if c.from_script]


# ---------------------------------------------------------------- concurrency

def run_lined_up(count: int, call: Callable[[int], Any], timeout: float = 30.0) -> list[Any]:
    """Runs call(i) in `count` threads released together by a barrier; returns the results
    in index order. An exception in any thread fails the test with that exception."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait(timeout)
            results[i] = call(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"a thread was still running after {timeout} s")
    if errors:
        raise errors[0]
    return results


def process_worker(url: str, user_ids: list[str], limit: int, window_seconds: int,
                   barrier: Any, results: Any, worker_index: int) -> None:
    """One process of the multi-process tests: its own RateLimiter; for each user id, waits
    at the barrier with the other processes, then makes one check and reports it."""
    from genai_ratelimit import RateLimiter

    try:
        with RateLimiter(url) as limiter:
            for round_index, user in enumerate(user_ids):
                barrier.wait(60)
                results.put((worker_index, round_index, limiter.check(user, limit, window_seconds)))
    except BaseException as exc:  # the parent fails the test with it
        results.put((worker_index, -1, f"{type(exc).__name__}: {exc}"))


# ------------------------------------------------------------ faulty endpoints

def closed_port_url() -> str:
    """A redis:// URL on a loopback port nothing listens on."""
    return f"redis://127.0.0.1:{free_port()}/0"


# A user name and password pieces that appear nowhere else in a message: a password holding
# an unencoded '/', '?', '#', '&' or '@' splits there, and any piece, or the user name, in an
# error would be a leak.
USERINFO_PIECES = ("uZer7", "Pa55", "w0rd", "40417", "Secret9", "x9q")


def unencoded_password_urls(port: int) -> list[tuple[str, str]]:
    """(id, URL) of every URL form (redis, rediss, cluster, Sentinel, unix) with a password
    holding an unencoded delimiter, its host a loopback port nothing listens on (or a
    socket path that does not exist): whatever the parser makes of it, no error may show a
    USERINFO_PIECES piece."""
    host = f"127.0.0.1:{port}"
    return [
        ("redis-slash", f"redis://:Pa55/w0rd@{host}/0"),
        ("redis-slash-no-port", "redis://:Pa55/w0rd@localhost"),
        ("redis-user-slash", f"redis://uZer7:Pa55/w0rd@{host}"),
        ("redis-slash-digits", f"redis://uZer7:40417/w0rd@{host}"),  # its head reads as a port
        ("redis-at", f"redis://uZer7:Secret9@x9q@{host}/0"),
        ("redis-at-then-slash", f"redis://uZer7:Secret9@x9q/w0rd@{host}/0"),
        ("redis-question", f"redis://uZer7:Pa55?w0rd@{host}"),
        ("redis-hash", f"redis://uZer7:Pa55#w0rd@{host}"),
        ("redis-hash-digits", f"redis://uZer7:40417#w0rd@{host}"),
        ("rediss-slash", f"rediss://:Pa55/w0rd@{host}/0?ssl_cert_reqs=none"),
        ("rediss-at", f"rediss://uZer7:Secret9@x9q@{host}/0?ssl_cert_reqs=none"),
        ("cluster-slash", f"redis+cluster://uZer7:Pa55/w0rd@{host}"),
        ("cluster-at", f"redis+cluster://uZer7:Secret9@x9q@{host}"),
        ("tls-cluster-slash", f"rediss+cluster://uZer7:Pa55/w0rd@{host}"),
        ("sentinel-slash", f"redis+sentinel://uZer7:Pa55/w0rd@{host}/mymaster"),
        ("sentinel-at", f"redis+sentinel://uZer7:Secret9@x9q@{host}/mymaster"),
        ("tls-sentinel-slash", f"rediss+sentinel://:Pa55/w0rd@{host}/mymaster"),
        ("unix-slash", "unix://uZer7:Pa55/w0rd@/nonexistent/redis.sock"),
        ("unix-at", "unix://uZer7:Secret9@x9q@/nonexistent/redis.sock"),
        ("unix-query-ampersand", "unix:///nonexistent/redis.sock?password=Pa55&w0rd=x9q"),
    ]


def userinfo_shown(text: str) -> list[str]:
    """The USERINFO_PIECES that text shows, in any case (a host name is lowercased)."""
    return [piece for piece in USERINFO_PIECES if piece.lower() in text.lower()]


class FullBacklogListener:
    """A loopback listener that never accepts and whose accept queue is full, so a new
    connect() gets no answer at all (its SYN is dropped) until the client gives up."""

    def __init__(self) -> None:
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(0)
        self.port = self.server.getsockname()[1]
        self.fillers: list[socket.socket] = []
        for _ in range(16):
            filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            filler.settimeout(0.2)
            self.fillers.append(filler)
            try:
                filler.connect(("127.0.0.1", self.port))
            except OSError:
                return  # this connect got no answer: the queue is full
        raise RuntimeError("could not fill the accept queue of a loopback listener")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        for filler in self.fillers:
            filler.close()
        self.server.close()

    def __enter__(self) -> FullBacklogListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_LoopbackServerT = TypeVar("_LoopbackServerT", bound="LoopbackServer")


class LoopbackServer:
    """A TCP server on a free loopback port that stands in for Redis: a thread accepts
    connections and serves each on a thread of its own (`_answer`, given by the subclass);
    close() stops it and closes every connection it accepted. It starts serving at once, so
    a subclass sets what `_answer` reads before calling this __init__."""

    def __init__(self, backlog: int, poll: float = 0.1, receive_buffer: int | None = None) -> None:
        self.poll = poll  # how often a waiting accept or read looks at the stop event (s)
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:  # set before listen(): accepted sockets inherit it
            self.server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(backlog)
        self.server.settimeout(poll)
        self.port = self.server.getsockname()[1]
        self._stop = threading.Event()
        self._connections: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> socket.socket | None:
        """The next connection, recorded for close() (and `_accepted`); None once closing."""
        while not self._stop.is_set():
            try:
                conn, _ = self.server.accept()
            except (TimeoutError, OSError):
                continue
            self._accepted(conn)
            return conn
        return None

    def _accepted(self, conn: socket.socket) -> None:
        self._connections.append(conn)

    def _serve(self) -> None:
        while (conn := self._accept()) is not None:
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def _reads(self, conn: socket.socket, size: int = 65536) -> Iterator[bytes]:
        """What the client sends on `conn`, read by read, until it hangs up, the socket
        fails or the server closes."""
        conn.settimeout(self.poll)
        while not self._stop.is_set():
            try:
                data = conn.recv(size)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            yield data

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in self._connections:
            conn.close()
        self.server.close()

    def __enter__(self: _LoopbackServerT) -> _LoopbackServerT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GarbageServer(LoopbackServer):
    """A loopback TCP server that answers every request with the same bytes (not a
    decision of the rate-limit script) and keeps the connection open afterwards. With
    `drip`, it sends them one byte at a time, `drip` seconds apart."""

    def __init__(self, reply: bytes, drip: float | None = None) -> None:
        self.reply = reply
        self.drip = drip
        self.requests = 0
        super().__init__(backlog=16)

    def _answer(self, conn: socket.socket) -> None:
        for _ in self._reads(conn):
            self.requests += 1
            try:
                if self.drip is None:
                    conn.sendall(self.reply)
                    continue
                for i in range(len(self.reply)):
                    if self._stop.wait(self.drip):
                        return
                    conn.sendall(self.reply[i:i + 1])
            except OSError:
                return


class PasswordRedisServer(RedisServer):
    """A RedisServer that requires a password (RedisServer counts its -NOAUTH as ready)."""

    def __init__(self, password: str, *extra_args: str) -> None:
        super().__init__("--requirepass", password, *extra_args)
        self.password = password


# The limiter reads INFO memory once per connection, at connect (is eviction on?); fakes that
# answer per read rather than per command refuse it, as an ACL without +info would.
INFO_REQUEST = b"*2\r\n$4\r\nINFO\r\n$6\r\nmemory\r\n"
INFO_REFUSED = b"-NOPERM this fake does not answer INFO\r\n"


class RendezvousServer(LoopbackServer):
    """A loopback server that holds every request until `parallel` requests are waiting at
    once (each on its own connection), then answers each with `reply`. When they never
    meet within `patience` seconds it answers anyway and `met` stays False: a client that
    serialises its callers behind one socket can never make them meet."""

    def __init__(self, reply: bytes, parallel: int, patience: float = 2.0) -> None:
        self.reply = reply
        self.met = False
        self.accepted = 0
        self._barrier = threading.Barrier(parallel, timeout=patience)
        super().__init__(backlog=64)

    def _accepted(self, conn: socket.socket) -> None:
        self.accepted += 1
        super()._accepted(conn)

    def _answer(self, conn: socket.socket) -> None:
        for data in self._reads(conn):
            if data == INFO_REQUEST:
                conn.sendall(INFO_REFUSED)  # the connection's INFO memory, on its own
                continue
            try:
                self._barrier.wait()
                self.met = True
            except threading.BrokenBarrierError:
                pass
            try:
                conn.sendall(INFO_REFUSED * data.count(INFO_REQUEST) + self.reply)
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self._barrier.abort()  # a request held at the barrier is answered now
        super().close()


# ----------------------------------------------------------------- either storage's log


def _compact_value(client: redis.Redis, key: str) -> tuple[dict[str, int], bytes] | None:
    """The header fields and the entries' bytes of the compact string of window `key`
    ("<key>:c", lua/lib/compact_log.lua), or None when it is absent."""
    value = client.get(f"{key}:c")
    if value is None:
        return None
    head = value[:51]
    fields = {
        "version": head[0], "S": head[1], "C": head[2], "R": head[3],
        "base": int.from_bytes(head[4:10], "big"), "head": int.from_bytes(head[10:14], "big"),
        "tail": int.from_bytes(head[14:18], "big"),
    }
    if fields["version"] == 1:  # layout 1: the running totals' origin always in the header
        fields["origin"] = int.from_bytes(head[22:29], "big")
    elif fields["version"] == 2:  # layout 2: after the 37 bytes every window has, if weighted
        fields["origin"] = int.from_bytes(head[37:44], "big") if fields["C"] else 0
    else:  # layout 2's short form (3): a 13-byte header, the origin after it if weighted
        fields["origin"] = int.from_bytes(head[13:20], "big") if fields["C"] else 0
        fields["head"] = (27 if fields["C"] else 13) + 16 * fields["R"]
        fields["tail"] = len(value)
    return fields, value[fields["head"]:fields["tail"]]


def logged(client: redis.Redis, key: str, storage: str | None = None) -> list[tuple[int, int]]:
    """The (time in unix ms, cost) of every entry window `key` holds, oldest first, in
    `storage`, or (None) whichever storage keeps it: the sorted set `key` (with its weights
    "<key>:w") or the compact string "<key>:c"."""
    compact = _compact_value(client, key) if storage != "zset" else None
    if compact is None:
        weights = {m: int(c) for m, c in client.hgetall(f"{key}:w").items() if m != b""}
        return [(int(score), weights.get(member, 1))
                for member, score in client.zrange(key, 0, -1, withscores=True)]
    fields, entries = compact
    stamp, cost = fields["S"], fields["C"]
    size = stamp + 2 + cost
    out, total = [], fields["origin"]
    for at in range(0, len(entries), size):
        time_ms = fields["base"] + int.from_bytes(entries[at:at + stamp], "big")
        running = int.from_bytes(entries[at + stamp + 2:at + size], "big") if cost else total + 1
        out.append((time_ms, running - total))
        total = running
    return out


def logged_entries(client: redis.Redis, key: str) -> int:
    """How many entries window `key` holds, in whichever storage keeps it (ZCARD for the
    sorted set)."""
    return len(logged(client, key))


def window_exists(client: redis.Redis, key: str) -> bool:
    """Whether window `key` has a key in Redis, in either storage."""
    return bool(client.exists(key, f"{key}:c"))


def window_ttl(client: redis.Redis, key: str) -> int:
    """The TTL (s) of window `key`'s key in whichever storage keeps it (-2: none)."""
    ttl = client.ttl(key)
    return ttl if ttl != -2 else client.ttl(f"{key}:c")


def window_script(storage: str) -> tuple[str, str]:
    """(SHA1, source) of the script that decides a check in `storage`."""
    from genai_ratelimit import _native

    if storage == "compact":
        return _native.COMPACT_SHA1, _native.COMPACT_SOURCE
    return _native.SCRIPT_SHA1, _native.SCRIPT_SOURCE

# The reason of a test that only the sorted-set storage can pass: its subject is the
# contract's sorted sets themselves (key names, UUID4 members, scores, the commands a
# script runs, their TTLs, entries written by hand). tests/test_compact.py holds the
# compact storage's own tests of the same kind.
SORTED_SET_SHAPE = "the sorted sets' own key shape, members, scores, commands or TTLs"


# ------------------------------------------------------------------ a slow reader

class SlowReader(LoopbackServer):
    """A loopback server that takes a client's command slowly and never answers: once the
    first byte of a connection arrives it reads nothing more for `hold` seconds (the
    client's send blocks on a full window), then reads the rest as fast as it can. It
    records when the first byte came and when the whole command had been read
    (`first_byte_at`, `command_read_at`, time.monotonic()), then holds the connection
    silently until the client hangs up. Its receive buffer is kept small so that the
    client cannot park the command in the server's kernel buffer."""

    def __init__(self, hold: float, receive_buffer: int = 64 * 1024) -> None:
        self.hold = hold
        self.first_byte_at: float | None = None
        self.command_read_at: float | None = None
        self.bytes_read = 0
        super().__init__(backlog=4, poll=0.05, receive_buffer=receive_buffer)

    def _serve(self) -> None:
        # Only the first connection is taken, and served on this thread.
        conn = self._accept()
        if conn is not None:
            self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(self.poll)
        buf = bytearray()
        try:
            while not self._stop.is_set():
                try:
                    first = conn.recv(1)
                    break
                except TimeoutError:
                    continue
            else:
                return
            if not first:
                return
            self.first_byte_at = time.monotonic()
            buf += first
            # The fault: a reader that stalls. Bounded by `hold` and by the stop event.
            if self._stop.wait(self.hold):
                return
            while not self._stop.is_set() and self.command_read_at is None:
                try:
                    data = conn.recv(1 << 20)
                except TimeoutError:
                    continue
                if not data:
                    return
                buf += data
                self.bytes_read = len(buf)
                if parse_command(buf) is not None:
                    self.command_read_at = time.monotonic()
            while not self._stop.is_set():  # never answer; wait for the client to hang up
                try:
                    if conn.recv(1 << 20) == b"":
                        return
                except TimeoutError:
                    continue
        except OSError:
            return


# ------------------------------------------------------------------ signals

# The futex system call: a thread waiting for the GIL or a lock sleeps in it.
_FUTEX_SYSCALL = {"x86_64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238}


def blocked_outside_locks(native_id: int) -> bool:
    """True when the thread is asleep in a system call other than futex (recv, poll, ...):
    inside the limiter's socket I/O, not waiting for the GIL or a mutex."""
    import platform

    with open(f"/proc/self/task/{native_id}/syscall") as f:
        fields = f.read().split()
    if not fields or fields[0] in ("running", "-1"):
        return False
    futex = _FUTEX_SYSCALL.get(platform.machine())
    if futex is None:
        raise RuntimeError(f"the futex system call number of {platform.machine()} is not known")
    return int(fields[0]) != futex


class SignalDriver:
    """A thread that, once the main thread is asleep in socket I/O (seen twice, 20 ms
    apart, within `wait_blocked` seconds), sends it `signum` every `interval` seconds,
    at most `count` times, until `done` is set. A thread rather than setitimer: a Python
    signal handler only runs when the interrupted C call gives control back to Python, so
    a handler that stops its own timer could never stop it while the call loops on EINTR;
    this driver stops by itself.

    `sent_at` lists when each signal went out; `saw_blocked` says whether the main thread
    was ever seen blocked (if not, no signal was sent and the test's premise failed)."""

    def __init__(self, signum: int, interval: float, count: int,
                 wait_blocked: float = 3.0) -> None:
        self.signum = signum
        self.interval = interval
        self.count = count
        self.wait_blocked = wait_blocked
        self.done = threading.Event()
        self.sent_at: list[float] = []
        self.saw_blocked = False
        self._main = threading.main_thread()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        native_id = self._main.native_id
        assert native_id is not None
        deadline = time.monotonic() + self.wait_blocked
        while not self.done.is_set() and time.monotonic() < deadline:
            if blocked_outside_locks(native_id):
                if self.done.wait(0.02):
                    return
                if blocked_outside_locks(native_id):
                    self.saw_blocked = True
                    break
            elif self.done.wait(0.005):
                return
        if not self.saw_blocked:
            return
        ident = self._main.ident
        assert ident is not None
        while not self.done.is_set() and len(self.sent_at) < self.count:
            self.sent_at.append(time.monotonic())
            signal.pthread_kill(ident, self.signum)
            if self.done.wait(self.interval):
                return

    def stop(self) -> None:
        self.done.set()
        self._thread.join(10)
        if self._thread.is_alive():
            raise AssertionError("the signal driver thread did not stop")


class Interrupted(Exception):
    """Raised by a test's signal handler."""


def assert_a_raising_handler_interrupts_a_blocked_check(
        limiter: Any, pause: Callable[[], None], resume: Callable[[], None]) -> None:
    """PEP 475: a blocking check waiting on a server that `pause` froze raises a SIGALRM
    handler's exception as soon as the signal comes (not once socket_timeout has run out),
    and the interrupted connection is not reused afterwards. The caller has the SIGALRM
    handler restored after (the test_production_faults `sigalrm` fixture, or its own)."""

    def blocked_check() -> tuple[bool, int, int]:
        return limiter.check("interrupted-user", 5, 60)  # type: ignore[no-any-return]

    ran_in: list[str] = []

    def interrupt(signum: int, frame: Any) -> None:
        # Raises on its first call, as long as that call interrupts the check. Python runs it
        # in the frame that was executing when the signal was checked for: run from inside
        # the blocked call, that is blocked_check's. A handler that only runs once the call
        # has returned by itself would raise somewhere in the test's own code instead, so it
        # just records where it ran.
        ran_in.append(frame.f_code.co_name if frame is not None else "?")
        if len(ran_in) == 1 and frame is not None and frame.f_code is blocked_check.__code__:
            raise Interrupted("the handler's own exception")

    signal.signal(signal.SIGALRM, interrupt)
    assert blocked_check() == (True, 4, 0)  # pooled connection, script loaded
    driver = SignalDriver(signal.SIGALRM, interval=1.0, count=1)
    pause()
    try:
        driver.start()
        started = time.monotonic()
        caught: BaseException | None = None
        try:
            blocked_check()
        except BaseException as exc:  # noqa: B036 (the handler's exception is the point)
            caught = exc
        finally:
            elapsed = time.monotonic() - started
            driver.stop()
        assert driver.saw_blocked and driver.sent_at, "no signal reached the blocked check"
        signalled = driver.sent_at[0] - started
        assert isinstance(caught, Interrupted) and elapsed < signalled + 0.5, (
            f"the check raised {type(caught).__name__} after {elapsed:.2f} s (the signal came "
            f"at {signalled:.2f} s; the handler ran in {ran_in}): the handler's exception did "
            "not interrupt the call")
    finally:
        resume()
    # The interrupted connection must not be reused: its reply (to a check with limit 5)
    # would be read as the answer to this one (limit 3).
    assert limiter.check("after-interrupt-user", 3, 60) == (True, 2, 0)


# ------------------------------------------------------------------ fork children

def fork_and_report(child: Callable[[], dict[str, Any]], timeout: float = 5.0) -> dict[str, Any]:
    """Forks; the child runs child() and writes its result (JSON) to a pipe, then leaves
    with os._exit. Returns the child's report. A child that does not report and exit within
    `timeout` seconds (hung, e.g. on a mutex copied in a locked state) is killed and the
    test fails; so does a child that raised (its exception is in the message)."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns that fork() with threads alive may deadlock: that very risk is
        # what the stress test provokes, on purpose and under a deadline.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        status = 1
        try:
            os.close(read_end)
            try:
                report = child()
            except BaseException as exc:
                report = {"child_error": f"{type(exc).__name__}: {exc}"}
            os.write(write_end, json.dumps(report).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    data = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"the fork child did not report within {timeout} s "
                                     f"(hung; killed). Read so far: {bytes(data)!r}")
            ready, _, _ = select.select([read_end], [], [], left)
            if ready:
                chunk = os.read(read_end, 65536)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(read_end)
    left = max(0.1, deadline - time.monotonic())
    while True:  # the child exits right after writing; reap it within the deadline too
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the fork child reported but did not exit (killed)")
        time.sleep(0.005)  # polling the child's exit, with a deadline
        left -= 0.005
    report = json.loads(bytes(data)) if data else {"child_error": "no report"}
    if "child_error" in report:
        raise AssertionError(f"the fork child failed: {report['child_error']}")
    return report  # type: ignore[no-any-return]
