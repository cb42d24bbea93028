"""Helpers for tests/test_review_defects.py: real faulty endpoints on loopback (a server that
takes the handshake command and then hangs up or falls silent, a server that reads a big
command slowly and never answers), certificates made with the openssl CLI, running a
limiter in a child process with an environment of its own, fork children that report over
a pipe within a deadline, a driver that sends signals to the main thread while it is
blocked in a system call, and a scanner for C source.

Nothing here mocks Redis or the limiter: every helper provokes or observes a real socket,
process, signal or file."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fake_redis import parse_command

# ------------------------------------------------------------- a slow reader


class SlowReader:
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
        self._stop = threading.Event()
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(4)
        self.server.settimeout(0.05)
        self.port = self.server.getsockname()[1]
        self._conn: socket.socket | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.server.accept()
                break
            except (TimeoutError, OSError):
                continue
        else:
            return
        self._conn = conn
        conn.settimeout(0.05)
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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._conn is not None:
            self._conn.close()
        self.server.close()

    def __enter__(self) -> SlowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


# ------------------------------------------------------------- fork children


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


# --------------------------------------------------------------- certificates


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> Path:
    """A self-signed CA: <name>.crt and <name>.key in directory. Returns the certificate."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
            "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN=genai-ratelimit {name}",
            cwd=directory)
    return directory / f"{name}.crt"


def make_server_certificate(directory: Path, ca: str, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1/localhost signed by the CA `ca`: (certificate, key)."""
    (directory / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext",
            cwd=directory)
    return directory / f"{name}.crt", directory / f"{name}.key"


# A limiter run in a child process: argv[1] is "sync" or "async", argv[2] the URL, argv[3]
# the user id. It prints one JSON line: the check's result, or the exception's type, classes
# and message.
_CHILD_CHECK = r"""
import asyncio, json, sys
from genai_ratelimit import AsyncRateLimiter, RateLimiter

kind, url, user = sys.argv[1], sys.argv[2], sys.argv[3]

def sync_check():
    with RateLimiter(url, connect_timeout=3, socket_timeout=3) as limiter:
        return limiter.check(user, 100, 60)

async def async_check():
    async with AsyncRateLimiter(url, connect_timeout=3, socket_timeout=3) as limiter:
        return await limiter.check(user, 100, 60)

def on_loop(new_loop):
    loop = new_loop()
    try:
        return loop.run_until_complete(async_check())
    finally:
        loop.close()

try:
    if kind == "sync":
        result = sync_check()
    elif kind == "uvloop":
        import uvloop
        result = on_loop(uvloop.new_event_loop)
    else:
        result = on_loop(asyncio.new_event_loop)
    print(json.dumps({"result": list(result)}))
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__,
                      "classes": [c.__name__ for c in type(exc).__mro__],
                      "message": str(exc)}))
"""


def check_in_child(kind: str, url: str, user: str, env: dict[str, str],
                   cwd: Path) -> dict[str, Any]:
    """Runs one check of `user` (limit 100 a minute) through the kind of limiter
    ("sync", "asyncio", "uvloop") in a fresh Python process with `env` added to a copy of this
    environment (LD_PRELOAD included: under make test-asan the child loads the same
    sanitized build); returns its JSON report."""
    child_env = dict(os.environ)
    child_env.update(env)
    done = subprocess.run([sys.executable, "-c", _CHILD_CHECK, kind, url, user], cwd=cwd,
                          env=child_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"the child failed: {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# ------------------------------------------------------------------- C source


def blank_comments_and_literals(source: str, keep_literals: bool = False) -> str:
    """The source with comments (and, unless keep_literals, string and char literals)
    replaced by spaces of the same length: every offset and line stays where it was."""
    pattern = re.compile(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)

    def blank(match: re.Match[str]) -> str:
        text = match.group(0)
        if text.startswith("/"):
            return re.sub(r"[^\n]", " ", text)
        if keep_literals:
            return text
        return text[0] + " " * (len(text) - 2) + text[-1]

    return pattern.sub(blank, source)


def comment_text_by_line(source: str) -> dict[int, str]:
    """The comment text on each line (1-based) of a C source."""
    comments: dict[int, str] = {}
    for match in re.finditer(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'',
                             source, re.S):
        text = match.group(0)
        if not text.startswith("/"):
            continue
        line = source.count("\n", 0, match.start()) + 1
        for offset, part in enumerate(text.split("\n")):
            comments[line + offset] = comments.get(line + offset, "") + " " + part
    return comments


def call_arguments(code: str, open_paren: int) -> list[str]:
    """The top-level arguments of the call whose '(' is at code[open_paren]."""
    depth, start, args = 0, open_paren + 1, []
    for i in range(open_paren, len(code)):
        ch = code[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                args.append(code[start:i].strip())
                return args
        elif ch == "," and depth == 1:
            args.append(code[start:i].strip())
            start = i + 1
    return args


def function_bodies(code: str) -> list[tuple[int, int]]:
    """(start, end) offsets of every top-level brace block of comment- and literal-blanked
    C code: function bodies (and initialisers, which do no harm here)."""
    bodies, depth, start = [], 0, 0
    for i, ch in enumerate(code):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                bodies.append((start, i + 1))
    return bodies
