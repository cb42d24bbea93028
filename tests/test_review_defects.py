"""Defects found by a code review, one test per behaviour the fixed code must have:

- the handshake (AUTH, SELECT) classifies a lost connection and a silent server the same in
  both limiters: RateLimiterUnavailable and RateLimiterTimeout, never RateLimiterAuthError
  (which only a refused password earns);
- both limiters trust the same CAs: with ssl_ca_certs only that file, without it the
  system's default store (SSL_CERT_FILE stands in for the system store: OpenSSL's default
  verify paths and Python's ssl default certificates both honour it);
- connect_timeout and socket_timeout above one day (86400 s) are refused, by the Python
  limiters and by the C types, instead of overflowing a cast to milliseconds;
- in a fork child, close(), .closed and .open_connections go through the fork check: they
  see a fresh pool, never the parent's state or its mutex;
- a blocking call stays within socket_timeout across signals (EINTR) and a slow write, and
  a signal handler that raises interrupts the call with its exception (PEP 475);
- the script's replay marker looks for the member in the longest window, where it lives
  longest.

Real servers and real faults only (see tests/helpers_defects.py)."""

from __future__ import annotations

import re
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from fake_redis import ScriptedRedis
from genai_ratelimit import (
    RateLimiter,
    RateLimiterAuthError,
    RateLimiterError,
    RateLimiterTimeout,
    RateLimiterUnavailable,
)
from helpers_async import LimiterFactory
from helpers_core import PasswordRedisServer, connections_received, run_lined_up
from helpers_defects import (
    SignalDriver,
    SlowReader,
    check_in_child,
    fork_and_report,
    make_ca,
    make_server_certificate,
)
from redis_server import RedisServer, free_port


def check_once(make_limiter: LimiterFactory, url: str, *, connect_timeout: float,
               socket_timeout: float, user: str = "handshake-user") -> tuple[bool, int, int]:
    """One check through a new limiter of the kind under test (closed after the test)."""
    limiter = make_limiter(url, connect_timeout=connect_timeout, socket_timeout=socket_timeout)
    return limiter.check(user, 10, 60)  # type: ignore[no-any-return]


def failure(call: Callable[[], Any]) -> RateLimiterError:
    """The RateLimiterError that call() must raise."""
    with pytest.raises(RateLimiterError) as info:
        call()
    return info.value


# ============================================================ 2. handshake errors

TIMEOUT_ORDERS = [pytest.param((0.6, 0.3), id="socket-timeout-first"),
                  pytest.param((0.3, 0.6), id="connect-timeout-first")]


def test_connection_lost_during_auth_is_unavailable_not_an_auth_error(make_limiter: LimiterFactory) -> None:
    with ScriptedRedis(lambda args: None) as server:  # reads a command, hangs up
        error = failure(lambda: check_once(make_limiter, server.url(password="pw"),
                                           connect_timeout=0.5, socket_timeout=0.5))
        assert server.commands[:1] == ["AUTH"], server.commands
    assert type(error) is RateLimiterUnavailable, (
        f"a connection lost during AUTH raised {type(error).__name__}: {error}")


@pytest.mark.parametrize("timeouts", TIMEOUT_ORDERS)
def test_server_silent_after_auth_is_a_timeout(
        make_limiter: LimiterFactory, timeouts: tuple[float, float]) -> None:
    connect_timeout, socket_timeout = timeouts
    with ScriptedRedis(lambda args: b"") as server:  # reads, never answers
        error = failure(lambda: check_once(make_limiter, server.url(password="pw"),
                                           connect_timeout=connect_timeout,
                                           socket_timeout=socket_timeout))
        assert server.commands[:1] == ["AUTH"], server.commands
    assert type(error) is RateLimiterTimeout, (
        f"a server silent after AUTH raised {type(error).__name__}: {error}")


def test_connection_lost_during_select_is_unavailable_not_an_auth_error(make_limiter: LimiterFactory) -> None:
    with ScriptedRedis(lambda args: None) as server:  # reads a command, hangs up
        error = failure(lambda: check_once(make_limiter, server.url(db=2),
                                           connect_timeout=0.5, socket_timeout=0.5))
        assert server.commands[:1] == ["SELECT"], server.commands
    assert type(error) is RateLimiterUnavailable, (
        f"a connection lost during SELECT raised {type(error).__name__}: {error}")


@pytest.mark.parametrize("timeouts", TIMEOUT_ORDERS)
def test_server_silent_after_select_is_a_timeout(
        make_limiter: LimiterFactory, timeouts: tuple[float, float]) -> None:
    connect_timeout, socket_timeout = timeouts
    with ScriptedRedis(lambda args: b"") as server:  # reads, never answers
        error = failure(lambda: check_once(make_limiter, server.url(db=2),
                                           connect_timeout=connect_timeout,
                                           socket_timeout=socket_timeout))
        assert server.commands[:1] == ["SELECT"], server.commands
    assert type(error) is RateLimiterTimeout, (
        f"a server silent after SELECT raised {type(error).__name__}: {error}")


def test_wrong_password_is_an_auth_error(make_limiter: LimiterFactory) -> None:
    with PasswordRedisServer("right-password") as server:
        url = f"redis://:wrong-password@127.0.0.1:{server.port}/0"
        error = failure(lambda: check_once(make_limiter, url, connect_timeout=2, socket_timeout=2))
    assert isinstance(error, RateLimiterAuthError), f"{type(error).__name__}: {error}"
    assert "wrong-password" not in str(error)


# ========================================================== 3. one TLS trust policy


@pytest.fixture(scope="module")
def trust(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two CAs (the one that signed the TLS server's certificate, and another), an empty
    certificate directory, and a redis-server with --tls-port."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl command is needed (apt-get install openssl)")
    directory = tmp_path_factory.mktemp("trust")
    server_ca = make_ca(directory, "server-ca")
    other_ca = make_ca(directory, "other-ca")
    certificate, key = make_server_certificate(directory, "server-ca", "server")
    empty_dir = directory / "no-certificates"
    empty_dir.mkdir()
    tls_port = free_port()
    server = RedisServer("--tls-port", str(tls_port), "--tls-cert-file", str(certificate),
                         "--tls-key-file", str(key), "--tls-ca-cert-file", str(server_ca),
                         "--tls-auth-clients", "no")
    server.start()
    try:
        yield {"server_ca": server_ca, "other_ca": other_ca, "empty_dir": empty_dir,
               "tls_port": tls_port, "directory": directory}
    finally:
        server.close()


def tls_check_in_child(trust: dict[str, Any], kind: str, system_ca: Path,
                       ssl_ca_certs: Path | None) -> dict[str, Any]:
    """A check over TLS in a child process whose "system store" is system_ca alone."""
    url = f"rediss://127.0.0.1:{trust['tls_port']}/0"
    if ssl_ca_certs is not None:
        url += f"?ssl_ca_certs={ssl_ca_certs}"
    env = {"SSL_CERT_FILE": str(system_ca), "SSL_CERT_DIR": str(trust["empty_dir"])}
    return check_in_child(kind, url, f"tls-{uuid.uuid4().hex}", env, cwd=trust["directory"])


def test_tls_ca_file_is_the_only_trust_and_the_system_store_is_not_added(
        trust: dict[str, Any], limiter_kind: str) -> None:
    report = tls_check_in_child(trust, limiter_kind, system_ca=trust["server_ca"],
                                ssl_ca_certs=trust["other_ca"])
    assert "error" in report, (
        f"the {limiter_kind} limiter trusted the system store on top of ssl_ca_certs: {report}")
    assert "RateLimiterUnavailable" in report["classes"], report
    assert re.search(r"(?i)certificate[ _]verify", report["message"]), report


def test_tls_without_a_ca_file_trusts_the_system_store(trust: dict[str, Any], limiter_kind: str) -> None:
    report = tls_check_in_child(trust, limiter_kind, system_ca=trust["server_ca"], ssl_ca_certs=None)
    assert report.get("result") == [True, 99, 0], report


def test_tls_ca_file_is_trusted_whatever_the_system_store_holds(
        trust: dict[str, Any], limiter_kind: str) -> None:
    report = tls_check_in_child(trust, limiter_kind, system_ca=trust["other_ca"],
                                ssl_ca_certs=trust["server_ca"])
    assert report.get("result") == [True, 99, 0], report


# ================================================================ 4. huge timeouts

TIMEOUT_NAMES = ["connect_timeout", "socket_timeout"]
OVER_ONE_DAY = [1e12, 1e300, 86400.5]


@pytest.mark.parametrize("value", OVER_ONE_DAY)
@pytest.mark.parametrize("name", TIMEOUT_NAMES)
def test_timeout_over_one_day_is_refused_naming_the_parameter_and_the_bound(
        make_limiter: LimiterFactory, name: str, value: float) -> None:
    with pytest.raises(ValueError) as info:
        make_limiter.native("redis://127.0.0.1:6379/0", **{name: value})
    assert name in str(info.value) and "86400" in str(info.value), str(info.value)


@pytest.mark.parametrize("name", TIMEOUT_NAMES)
def test_timeout_of_exactly_one_day_is_accepted(make_limiter: LimiterFactory, name: str) -> None:
    make_limiter.native("redis://127.0.0.1:6379/0", **{name: 86400})  # nothing is sent


@pytest.mark.parametrize("value", OVER_ONE_DAY)
@pytest.mark.parametrize("name", TIMEOUT_NAMES)
def test_native_limiter_refuses_a_timeout_over_one_day(name: str, value: float) -> None:
    from genai_ratelimit import _native

    with pytest.raises(ValueError):
        _native.Limiter(host="127.0.0.1", **{name: value})


@pytest.mark.parametrize("value", OVER_ONE_DAY)
def test_native_pipeline_refuses_a_timeout_over_one_day(value: float) -> None:
    from genai_ratelimit import _native

    with pytest.raises(ValueError):
        _native.Pipeline(value)


def test_native_types_accept_a_timeout_of_exactly_one_day() -> None:
    from genai_ratelimit import _native

    limiter = _native.Limiter(host="127.0.0.1", connect_timeout=86400, socket_timeout=86400)
    limiter.close()
    _native.Pipeline(86400)


# ===================================================== 6. pool state in a fork child


def child_pool_report(limiter: RateLimiter) -> Callable[[], dict[str, Any]]:
    """What a fork child that made no call yet sees of the pool, then how long close() took."""

    def report() -> dict[str, Any]:
        open_connections = limiter.open_connections
        closed = limiter.closed
        started = time.monotonic()
        limiter.close()
        return {"open_connections": open_connections, "closed": closed,
                "close_seconds": time.monotonic() - started}

    return report


def open_parent_connections(limiter: RateLimiter, user: str, threads: int = 4) -> int:
    """Checks from several threads at once, so the parent holds connections; returns how many."""
    results = run_lined_up(threads, lambda i: limiter.check(f"{user}-{i}", 100, 60))
    assert all(result[0] for result in results)
    return limiter.open_connections


def test_fork_child_sees_a_fresh_pool_and_its_close_leaves_the_parents_connections(
        redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    with RateLimiter(redis_url, max_connections=8) as limiter:
        parent_open = open_parent_connections(limiter, user_id)
        assert parent_open >= 1
        received_before = connections_received(redis_client)

        report = fork_and_report(child_pool_report(limiter), timeout=5.0)

        assert report["open_connections"] == 0, (
            f"the child saw the parent's {report['open_connections']} connections")
        assert report["closed"] is False
        assert report["close_seconds"] < 1.0, report
        assert limiter.open_connections == parent_open
        assert not limiter.closed
        assert limiter.check(f"{user_id}-0", 100, 60) == (True, 98, 0)
        assert connections_received(redis_client) == received_before, \
            "the parent had to dial anew: the child disturbed its connections"


def test_fork_children_never_hang_on_the_pool_while_parent_threads_read_it(
        redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    # Two threads read open_connections without pause; each read releases the GIL and takes
    # the pool's mutex, so a fork() from the main thread now and then copies that mutex in
    # a locked state (measured on the unfixed code: one fork in 20 to 100). A child whose
    # pool calls do not go through the fork check then blocks on it forever.
    forks = 100
    with RateLimiter(redis_url, max_connections=8) as limiter:
        parent_open = open_parent_connections(limiter, user_id)
        stop = threading.Event()
        reads = [0, 0]

        def hammer(index: int) -> None:
            deadline = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < deadline:
                _ = limiter.open_connections  # a read: the property takes the pool mutex
                reads[index] += 1

        threads = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(2)]
        for thread in threads:
            thread.start()
        reports: list[dict[str, Any]] = []
        hung = None
        try:
            for n in range(forks):
                try:
                    reports.append(fork_and_report(child_pool_report(limiter), timeout=5.0))
                except AssertionError as exc:
                    hung = f"fork {n}: {exc}"
                    break
        finally:
            stop.set()
            for thread in threads:
                thread.join(10)
        assert hung is None, hung
        assert min(reads) > forks, f"the reading threads hardly ran: {reads}"
        wrong = [(n, r) for n, r in enumerate(reports)
                 if (r["open_connections"], r["closed"]) != (0, False) or r["close_seconds"] >= 1]
        assert not wrong, f"{len(wrong)} of {forks} children saw the parent's pool: {wrong[:3]}"
        assert limiter.open_connections == parent_open
        assert limiter.check(f"{user_id}-0", 100, 60) == (True, 98, 0)


# ============================================ 7. deadlines across signals and writes


class Interrupted(Exception):
    """Raised by the test's signal handler."""


@pytest.fixture
def sigalrm() -> Iterator[None]:
    """Restores SIGALRM's handler after the test (the driver thread is stopped first)."""
    previous = signal.getsignal(signal.SIGALRM)
    try:
        yield
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_signals_during_a_blocked_check_do_not_extend_the_socket_timeout(
        private_redis: RedisServer, sigalrm: None) -> None:
    calls = [0]

    def count(signum: int, frame: Any) -> None:
        calls[0] += 1

    signal.signal(signal.SIGALRM, count)
    with RateLimiter(private_redis.url, connect_timeout=0.5, socket_timeout=0.5) as limiter:
        assert limiter.check("signals-user", 10, 60) == (True, 9, 0)  # pooled, script loaded
        driver = SignalDriver(signal.SIGALRM, interval=0.05, count=60)
        private_redis.pause()
        try:
            driver.start()
            started = time.monotonic()
            try:
                with pytest.raises(RateLimiterTimeout):
                    limiter.check("signals-user", 10, 60)
            finally:
                elapsed = time.monotonic() - started
                driver.stop()
        finally:
            private_redis.resume()
    assert driver.saw_blocked and driver.sent_at, "no signal reached the blocked check"
    assert elapsed < 2.5, (
        f"with a signal every 50 ms the check took {elapsed:.2f} s for a socket_timeout of "
        f"0.5 s ({len(driver.sent_at)} signals sent): every EINTR restarted the full timeout")


def test_signal_handler_exception_interrupts_a_blocked_check(
        private_redis: RedisServer, sigalrm: None) -> None:
    with RateLimiter(private_redis.url, connect_timeout=1.0, socket_timeout=1.0) as limiter:

        def blocked_check() -> tuple[bool, int, int]:
            return limiter.check("interrupted-user", 5, 60)

        ran_in: list[str] = []

        def interrupt(signum: int, frame: Any) -> None:
            # Raises on its first call, as long as that call interrupts the check. Python
            # runs it in the frame that was executing when the signal was checked for: run
            # from inside the blocked call, that is blocked_check's. A handler that only
            # runs once the call has returned by itself would raise somewhere in the test's
            # own code instead, so it just records where it ran.
            ran_in.append(frame.f_code.co_name if frame is not None else "?")
            if len(ran_in) == 1 and frame is not None and frame.f_code is blocked_check.__code__:
                raise Interrupted("the handler's own exception")

        signal.signal(signal.SIGALRM, interrupt)
        assert blocked_check() == (True, 4, 0)  # pooled connection, script loaded
        driver = SignalDriver(signal.SIGALRM, interval=1.0, count=1)
        private_redis.pause()
        try:
            driver.start()
            started = time.monotonic()
            try:
                with pytest.raises(BaseException) as info:
                    blocked_check()
            finally:
                elapsed = time.monotonic() - started
                driver.stop()
            assert driver.saw_blocked and driver.sent_at, "no signal reached the blocked check"
            signalled = driver.sent_at[0] - started
            assert info.type is Interrupted and elapsed < signalled + 0.5, (
                f"the check raised {info.type.__name__} after {elapsed:.2f} s (the signal came at "
                f"{signalled:.2f} s; the handler ran in {ran_in}): the handler's exception did not "
                "interrupt the call")
        finally:
            private_redis.resume()
        # The interrupted connection must not be reused: its reply (to a check with limit 5)
        # would be read as the answer to this one (limit 3).
        assert limiter.check("after-interrupt-user", 3, 60) == (True, 2, 0)


def test_slow_write_and_read_together_stay_within_the_socket_timeout() -> None:
    timeout = 2.0
    # A command far larger than the socket buffers can park (the client's send buffer grows
    # up to tcp_wmem's maximum), so the send blocks until the server reads.
    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        send_buffer_max = int(f.read().split()[2])
    user = "u" * max(12 * 1024 * 1024, 3 * send_buffer_max)
    with SlowReader(hold=1.3) as server:
        with RateLimiter(server.url, connect_timeout=timeout, socket_timeout=timeout) as limiter:
            started = time.monotonic()
            with pytest.raises(RateLimiterTimeout):
                limiter.check(user, 10, 60)
            elapsed = time.monotonic() - started
        assert server.command_read_at is not None, (
            f"the server read only {server.bytes_read} bytes: the write did not complete")
        write_phase = server.command_read_at - started
    assert timeout * 0.5 <= write_phase < timeout, (
        f"premise: the write phase should take well over half the timeout, took {write_phase:.2f} s")
    assert elapsed < timeout * 1.4, (
        f"the check took {elapsed:.2f} s for a socket_timeout of {timeout} s (writing took "
        f"{write_phase:.2f} s of it): the read got a full timeout of its own")


# ================================================== 9. the replay marker's window


def evalsha(client: redis.Redis, sha: str, keys: list[str], member: str, now_ms: int,
            windows: list[tuple[int, int]], replay: bool = False) -> list[int]:
    """Runs the script as the limiter does: KEYS shortest window first, then their weights
    and their running totals;
    ARGV member, the request time, (window_ms, limit, cost 1) per window, and the optional
    replay marker."""
    argv: list[Any] = [member, now_ms]
    for seconds, limit in windows:
        argv += [seconds * 1000, limit, 1]
    if replay:
        argv.append("1")
    weights = [f"{key}:w" for key in keys]
    totals = [f"{key}:t" for key in keys]
    return client.evalsha(sha, 3 * len(keys), *keys, *weights, *totals, *argv)  # type: ignore[no-any-return]


def test_replay_finds_its_member_in_the_longest_window_after_the_shortest_expired_it(
        redis_client: redis.Redis, user_id: str) -> None:
    from genai_ratelimit import _native

    sha = redis_client.script_load(_native.SCRIPT_SOURCE)
    windows = [(1, 5), (3600, 1)]
    keys = [f"ratelimit:{user_id}:1", f"ratelimit:{user_id}:3600"]
    first, other = str(uuid.uuid4()), str(uuid.uuid4())
    t0 = int(time.time() * 1000)

    assert evalsha(redis_client, sha, keys, first, t0, windows)[0] == 1
    # Rejected by the hour window; on its way it trimmed `first` out of the 1 s window.
    assert evalsha(redis_client, sha, keys, other, t0 + 1200, windows)[0] == 0
    assert redis_client.zscore(keys[0], first) is None
    state = [redis_client.zrange(key, 0, -1, withscores=True) for key in keys]

    reply = evalsha(redis_client, sha, keys, first, t0 + 1300, windows, replay=True)

    assert reply[0] == 1, (
        f"the replay of a request the hour window still counts was answered {reply}: the "
        "script looked for it in the shortest window only")
    assert [redis_client.zrange(key, 0, -1, withscores=True) for key in keys] == state
