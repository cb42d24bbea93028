"""Shared pieces of the benchmark: the Redis under test, the timing loops, and the baseline
implementations (redis-py `register_script` of this package's script, the design's original
four-op script, the `limits` library) that the package is measured against.

Nothing here imports genai_ratelimit at module level: the baselines must run before (and
without) the package being importable.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from genai_ratelimit import _native

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"
RAW_BINARY = BENCH_DIR / "bin" / "raw_hiredis"
# The check's script exactly as the limiter sends it: lua/sliding_window.lua with the lua/lib
# files it includes prepended, as the build embeds it (the extension exports that text).
# lua/sliding_window.lua alone does not run: its library functions are missing.
SCRIPT_TEXT: str = _native.SCRIPT_SOURCE
# The same text in a file, for benchmarks/bin/raw_hiredis --script (written where the binary
# is, so that both are rebuilt together).
SCRIPT_PATH = BENCH_DIR / "bin" / "sliding_window.built.lua"
# An empty script: what any EVALSHA costs the server before the script does anything.
EMPTY_SCRIPT = "return {1}"


def write_built_script() -> Path:
    """Writes SCRIPT_TEXT to SCRIPT_PATH (when it differs) and returns the path."""
    SCRIPT_PATH.parent.mkdir(parents=True, exist_ok=True)
    if not SCRIPT_PATH.is_file() or SCRIPT_PATH.read_text(encoding="utf-8") != SCRIPT_TEXT:
        SCRIPT_PATH.write_text(SCRIPT_TEXT, encoding="utf-8")
    return SCRIPT_PATH

# The design this package comes from: one window, client time, the four commands in one Lua
# script, every call (trim, count, add, expire; the caller compares the count with the limit).
# It writes on every rejection too, which is the bug the package's script fixes ("a throttled
# client never extends its own penalty"). The reference for "server time per decision".
ORIGINAL_FOUR_OP_SCRIPT = """\
-- KEYS[1] the window's sorted set; ARGV: now_ms, window_ms, limit, member
local key = KEYS[1]
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', key, 0, now - window)
local count = redis.call('ZCARD', key)
redis.call('ZADD', key, now, ARGV[4])
redis.call('EXPIRE', key, math.ceil(window / 1000) + 1)
return {count < tonumber(ARGV[3]) and 1 or 0, count}
"""

# The same four commands with ZADD + EXPIRE only on allow: the stricter reference (a rejection
# costs it two commands; it computes no retry time and reads no server clock).
FOUR_OP_ADD_ON_ALLOW_SCRIPT = """\
local key = KEYS[1]
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', key, 0, now - window)
local count = redis.call('ZCARD', key)
if count < limit then
  redis.call('ZADD', key, now, ARGV[4])
  redis.call('EXPIRE', key, math.ceil(window / 1000) + 1)
  return {1, limit - count - 1}
end
return {0, 0}
"""


# --------------------------------------------------------------------------- the server

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisTarget:
    """Where the benchmark sends its traffic, and whether we own (and may flush) it."""
    url: str
    host: str = "127.0.0.1"
    port: int = 6379
    unix_path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None
    owned: bool = False
    process: subprocess.Popen | None = None
    directory: Path | None = None

    @classmethod
    def from_url(cls, url: str) -> RedisTarget:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            db = 0
            for item in parts.query.split("&"):
                if item.startswith("db="):
                    db = int(item[3:])
            return cls(url=url, unix_path=parts.path, db=db)
        if parts.scheme != "redis":
            raise SystemExit(f"benchmarks: REDIS_URL must be redis:// or unix:// (got {parts.scheme}://)")
        db = int(parts.path.lstrip("/") or 0)
        return cls(url=url, host=parts.hostname or "127.0.0.1", port=parts.port or 6379, db=db,
                   username=unquote(parts.username) if parts.username else None,
                   password=unquote(parts.password) if parts.password else None)

    @classmethod
    def start_own(cls) -> RedisTarget:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("benchmarks: redis-server is not installed (apt-get install redis-server)")
        directory = Path(tempfile.mkdtemp(prefix="genai-ratelimit-bench-"))
        for _ in range(5):
            port = free_port()
            process = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(directory),
                 "--logfile", str(directory / "redis.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and process.poll() is None:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                        s.sendall(b"PING\r\n")
                        if s.recv(64).startswith(b"+PONG"):
                            return cls(url=f"redis://127.0.0.1:{port}/0", port=port, owned=True,
                                       process=process, directory=directory)
                except OSError:
                    pass
                time.sleep(0.02)  # polling for readiness until PONG or the deadline
            process.kill()
            process.wait()
        raise SystemExit("benchmarks: could not start redis-server")

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def redis_kwargs(self) -> dict[str, Any]:
        if self.unix_path:
            return dict(unix_socket_path=self.unix_path, db=self.db,
                        username=self.username, password=self.password)
        return dict(host=self.host, port=self.port, db=self.db,
                    username=self.username, password=self.password)

    def raw_args(self) -> list[str]:
        if self.unix_path:
            args = ["--unix", self.unix_path]
        else:
            args = ["--host", self.host, "--port", str(self.port)]
        return args + ["--db", str(self.db)]

    def raw_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.password:
            env["RAW_HIREDIS_PASSWORD"] = self.password
        if self.username:
            env["RAW_HIREDIS_USERNAME"] = self.username
        return env


def admin_client(target: RedisTarget):
    import redis
    return redis.Redis(**target.redis_kwargs(), decode_responses=True)


def clean_keys(admin, prefixes: Sequence[str], owned: bool) -> None:
    """Empties the database we own; on somebody else's server deletes only our keys."""
    if owned:
        admin.flushdb()
        return
    for prefix in prefixes:
        batch = []
        for key in admin.scan_iter(match=f"{prefix}*", count=1000):
            batch.append(key)
            if len(batch) == 500:
                admin.unlink(*batch)
                batch.clear()
        if batch:
            admin.unlink(*batch)


def script_stats(admin) -> tuple[int, float]:
    """(calls, usec) of script executions so far (EVALSHA + EVAL), from INFO commandstats."""
    stats = admin.info("commandstats")
    calls, usec = 0, 0.0
    for name in ("cmdstat_evalsha", "cmdstat_eval"):
        if name in stats:
            calls += int(stats[name]["calls"])
            usec += float(stats[name]["usec"])
    return calls, usec


class RespPipe:
    """A bare pipelined RESP connection (socket + the hiredis package's reader) for the sections
    that need many commands fast and do not measure the client: pre-filling keys and sending
    the server-time workloads. Replies come back as Python values; error replies raise."""

    def __init__(self, target: RedisTarget) -> None:
        import hiredis
        if target.unix_path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.connect(target.unix_path)
        else:
            self._sock = socket.create_connection((target.host, target.port), timeout=30)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = hiredis.Reader()
        if target.password:
            self.execute([["AUTH", *([target.username] if target.username else []), target.password]])
        if target.db:
            self.execute([["SELECT", target.db]])

    @staticmethod
    def _encode(args: Sequence[Any]) -> bytes:
        out = [b"*%d\r\n" % len(args)]
        for arg in args:
            if not isinstance(arg, bytes):
                arg = str(arg).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
        return b"".join(out)

    def encode(self, commands: Sequence[Sequence[Any]]) -> bytes:
        return b"".join(self._encode(c) for c in commands)

    def execute(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        return self.execute_encoded(self.encode(commands), len(commands))

    def execute_encoded(self, payload: bytes, count: int) -> list[Any]:
        """Sends `count` commands already encoded by encode(); returns their replies."""
        import hiredis
        self._sock.sendall(payload)
        replies: list[Any] = []
        while len(replies) < count:
            reply = self._reader.gets()
            if reply is False:
                data = self._sock.recv(1 << 16)
                if not data:
                    raise ConnectionError("Redis closed the connection")
                self._reader.feed(data)
                continue
            if isinstance(reply, hiredis.ReplyError):
                raise RuntimeError(f"Redis error reply: {reply}")
            replies.append(reply)
        return replies

    def close(self) -> None:
        self._sock.close()


# --------------------------------------------------------------------------- measurements

@dataclass
class Sample:
    """One contender's run: what a row of the table is made of."""
    calls: int
    elapsed_s: float
    p50_us: float
    p99_us: float
    cpu_us_per_call: float
    allowed: int = 0
    rejected: int = 0
    server_us_per_call: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def percentile(sorted_values: Sequence[float], p: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, int(p * (len(sorted_values) - 1) + 0.5))
    return sorted_values[index]


def timed_loop(fn: Callable[..., Any], arglist: Sequence[tuple], duration: float, max_calls: int,
               warmup: int, verdict: str = "index0") -> Sample:
    """Calls fn(*arglist[i % len(arglist)]) back to back for `duration` seconds (or max_calls),
    after `warmup` unmeasured calls. Latency per call from perf_counter_ns; client CPU from
    getrusage over the measured loop. `verdict`: how to read "allowed" from a result
    ("index0": result[0], "bool": the result itself)."""
    n = len(arglist)
    for i in range(warmup):
        fn(*arglist[i % n])
    latencies: list[int] = []
    append = latencies.append
    clock = time.perf_counter_ns
    allowed = 0
    i = 0
    cpu0 = _cpu_seconds()
    t0 = clock()
    deadline = t0 + int(duration * 1e9)
    t = t0
    if verdict == "bool":
        while t < deadline and i < max_calls:
            if fn(*arglist[i % n]):
                allowed += 1
            t1 = clock()
            append(t1 - t)
            t = t1
            i += 1
    else:
        while t < deadline and i < max_calls:
            if fn(*arglist[i % n])[0]:
                allowed += 1
            t1 = clock()
            append(t1 - t)
            t = t1
            i += 1
    elapsed = (t - t0) / 1e9
    cpu = _cpu_seconds() - cpu0
    latencies.sort()
    return Sample(calls=i, elapsed_s=elapsed, p50_us=percentile(latencies, 0.5) / 1e3,
                  p99_us=percentile(latencies, 0.99) / 1e3,
                  cpu_us_per_call=cpu * 1e6 / i if i else 0.0, allowed=allowed, rejected=i - allowed)


async def async_timed_loop(fn: Callable[..., Any], arglist: Sequence[tuple], concurrency: int,
                           duration: float, max_calls: int, warmup: int,
                           verdict: str = "index0") -> Sample:
    """`concurrency` coroutines each awaiting fn(*args) back to back until the deadline.
    Latency is per call (issue to completion); calls/s is over all coroutines."""
    n = len(arglist)
    state = {"next": 0, "allowed": 0}
    latencies: list[int] = []
    clock = time.perf_counter_ns

    async def warm(worker: int) -> None:
        for i in range(worker, warmup, concurrency):
            await fn(*arglist[i % n])

    await asyncio.gather(*(warm(w) for w in range(concurrency)))

    deadline = clock() + int(duration * 1e9)

    async def worker() -> None:
        append = latencies.append
        while True:
            i = state["next"]
            if i >= max_calls:
                return
            start = clock()
            if start >= deadline:
                return
            state["next"] = i + 1
            result = await fn(*arglist[i % n])
            append(clock() - start)
            if (result if verdict == "bool" else result[0]):
                state["allowed"] += 1

    cpu0 = _cpu_seconds()
    t0 = clock()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = (clock() - t0) / 1e9
    cpu = _cpu_seconds() - cpu0
    calls = len(latencies)
    latencies.sort()
    return Sample(calls=calls, elapsed_s=elapsed, p50_us=percentile(latencies, 0.5) / 1e3,
                  p99_us=percentile(latencies, 0.99) / 1e3,
                  cpu_us_per_call=cpu * 1e6 / calls if calls else 0.0,
                  allowed=state["allowed"], rejected=calls - state["allowed"])


class RawClient:
    """benchmarks/bin/raw_hiredis kept running in --serve mode: one connection and one loaded
    script for the whole benchmark, so its runs interleave with the other contenders' at no
    start-up cost. Each run's JSON line becomes a Sample; in pipelined mode the latency columns
    are per batch (extra holds them per call)."""

    def __init__(self, target: RedisTarget, args: Sequence[str]) -> None:
        cmd = [str(RAW_BINARY), "--script", str(write_built_script()), *target.raw_args(), "--serve", *args]
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, text=True, env=target.raw_env())

    def run(self, duration: float, max_calls: int, warmup: int) -> Sample:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(f"run {duration} {max_calls} {warmup}\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self._proc.wait(10)
            self._stderr.seek(0)
            raise RuntimeError(f"raw_hiredis failed ({self._proc.returncode}): "
                               f"{self._stderr.read().decode(errors='replace').strip()}")
        data = json.loads(line)
        return Sample(calls=data["calls"], elapsed_s=data["elapsed_s"], p50_us=data["p50_us"],
                      p99_us=data["p99_us"], cpu_us_per_call=data["cpu_us_per_call"],
                      allowed=data["allowed"], rejected=data["rejected"],
                      extra={"depth": data["depth"], "p50_per_call_us": data["p50_per_call_us"],
                             "p99_per_call_us": data["p99_per_call_us"]})

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write("quit\n")
                self._proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()


def summarize(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def load_average() -> str:
    """The machine's load, to quote beside a table: "load average 1.02 0.98 0.80 (2 CPUs)"."""
    load = os.getloadavg()
    return f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)"


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """The contenders' order in round `round_index`: rotated by one each round and reversed on
    odd rounds, so that no contender always runs first, last or after the same neighbour."""
    shift = round_index % len(names)
    order = [*names[shift:], *names[:shift]]
    return order[::-1] if round_index % 2 else order


def print_ratio_table(rows: dict[str, list[tuple[float, ...]]], baseline: str,
                      columns: Sequence[tuple[str, str]], ratios: Sequence[tuple[int, str]]) -> None:
    """A markdown table of one row per contender: the median over rounds of each value
    (`columns`: (header, format) per value of a round), then per (value index, header) in
    `ratios` the median over rounds of that value divided by the baseline's of the same round."""
    base = rows[baseline]
    print("| contender | " + " | ".join([header for header, _ in columns] + [h for _, h in ratios]) + " |")
    print("| --- |" + " ---: |" * (len(columns) + len(ratios)))
    for name, values in rows.items():
        cells = [format(statistics.median(v[index] for v in values), fmt)
                 for index, (_, fmt) in enumerate(columns)]
        cells += [f"{statistics.median(v[index] / b[index] for v, b in zip(values, base, strict=True)):.2f}×"
                  for index, _ in ratios]
        print(f"| {name} | " + " | ".join(cells) + " |")


# --------------------------------------------------------------------------- the baselines

class RedisPyLimiter:
    """This package's algorithm the way the original design runs it: redis-py,
    `register_script` with the script as built (SCRIPT_TEXT), the same keys and ARGV, a
    Python uuid4 member, the server's clock. Same results as RateLimiter.check/check_windows."""

    def __init__(self, client, key_prefix: str = "ratelimit") -> None:
        self._script = client.register_script(SCRIPT_TEXT)
        self._prefix = key_prefix

    def check(self, user_id: str, limit: int, window_seconds: int) -> tuple[bool, int, int]:
        key = f"{self._prefix}:{user_id}:{window_seconds}"
        reply = self._script(keys=[key, f"{key}:w", f"{key}:t"],
                             args=[str(uuid.uuid4()), "", window_seconds * 1000, limit, 1])
        return bool(reply[0]), int(reply[1]), int(reply[2])

    def check_windows(self, user_id: str, windows: Sequence[tuple[int, int]]) -> tuple[bool, int, int, int]:
        keys = [f"{self._prefix}:{user_id}:{window}" for _, window in windows]
        args: list[Any] = [str(uuid.uuid4()), ""]
        for limit, window in windows:
            args += [window * 1000, limit, 1]
        companions = [f"{key}:{suffix}" for suffix in ("w", "t") for key in keys]
        reply = self._script(keys=keys + companions, args=args)
        return bool(reply[0]), int(reply[1]), int(reply[2]), windows[int(reply[3]) - 1][1]


class AsyncRedisPyLimiter:
    """RedisPyLimiter on redis.asyncio (issue 5's baseline)."""

    def __init__(self, client, key_prefix: str = "ratelimit") -> None:
        self._script = client.register_script(SCRIPT_TEXT)
        self._prefix = key_prefix

    async def check(self, user_id: str, limit: int, window_seconds: int) -> tuple[bool, int, int]:
        key = f"{self._prefix}:{user_id}:{window_seconds}"
        reply = await self._script(keys=[key, f"{key}:w", f"{key}:t"],
                                   args=[str(uuid.uuid4()), "", window_seconds * 1000, limit, 1])
        return bool(reply[0]), int(reply[1]), int(reply[2])


class FourOpLimiter:
    """The design's original script (ORIGINAL_FOUR_OP_SCRIPT): one window, client time,
    redis-py register_script, a Python uuid4 member."""

    def __init__(self, client, key_prefix: str = "ratelimit", script: str = ORIGINAL_FOUR_OP_SCRIPT) -> None:
        self._script = client.register_script(script)
        self._prefix = key_prefix

    def check(self, user_id: str, limit: int, window_seconds: int) -> tuple[bool, int]:
        reply = self._script(keys=[f"{self._prefix}:{user_id}:{window_seconds}"],
                             args=[int(time.time() * 1000), window_seconds * 1000, limit,
                                   str(uuid.uuid4())])
        return bool(reply[0]), int(reply[1])


def redis_py_client(target: RedisTarget, pure_python_parser: bool = False):
    """A redis-py client; with pure_python_parser the RESP parser is redis-py's own Python one
    even though the hiredis package is installed (redis-py >= 5: redis._parsers._RESP2Parser;
    older: redis.connection.PythonParser)."""
    import redis
    if not pure_python_parser:
        return redis.Redis(**target.redis_kwargs())
    try:
        from redis._parsers import _RESP2Parser as parser_class
    except ImportError:  # redis-py 4.x
        from redis.connection import PythonParser as parser_class  # type: ignore[attr-defined,no-redef]
    kwargs = target.redis_kwargs()
    if "unix_socket_path" in kwargs:
        kwargs["path"] = kwargs.pop("unix_socket_path")
        pool = redis.ConnectionPool(connection_class=redis.UnixDomainSocketConnection,
                                    parser_class=parser_class, **kwargs)
    else:
        pool = redis.ConnectionPool(parser_class=parser_class, **kwargs)
    return redis.Redis(connection_pool=pool)


def parser_name(client) -> str:
    connection = client.connection_pool.get_connection()
    try:
        return type(connection._parser).__name__
    finally:
        client.connection_pool.release(connection)


def limits_storage_uri(target: RedisTarget, asynchronous: bool = False) -> str:
    scheme = "async+redis" if asynchronous else "redis"
    auth = ""
    if target.password:
        auth = f"{target.username or ''}:{target.password}@"
    if target.unix_path:
        return f"{'async+' if asynchronous else ''}redis+unix://{auth}{target.unix_path}?db={target.db}"
    return f"{scheme}://{auth}{target.host}:{target.port}/{target.db}"
