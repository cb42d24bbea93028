"""rediss:// against a real redis-server with --tls-port and certificates made by this test
(openssl CLI): verification on by default, a CA file, client certificates, ACL users, and
the password kept out of every message. Every limiter kind (tests/conftest.py): the blocking
limiter, and the async one on asyncio's loop and on uvloop's."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from genai_ratelimit import RateLimiterAuthError, RateLimiterTimeout, RateLimiterUnavailable
from helpers_async import LimiterFactory
from helpers_core import SORTED_SET_SHAPE, SignalDriver, assert_a_raising_handler_interrupts_a_blocked_check
from redis_server import RedisServer, free_port
from tls_proxy import TlsProxy

PASSWORD = "tls-s3cret-pw"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> Path:
    """A self-signed CA: <name>.crt and <name>.key in directory. Returns the certificate."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
            "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN=genai-ratelimit {name}",
            cwd=directory)
    return directory / f"{name}.crt"


def make_server_certificate(directory: Path, ca: str, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1/localhost signed by the CA `ca`: (certificate, key)."""
    (directory / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", f"/CN={name}", cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
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


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl command is needed (apt-get install openssl; make test installs it)")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "2", "-subj", "/CN=genai-ratelimit test CA", cwd=d)
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    (d / "other.ext").write_text("subjectAltName=DNS:other.example\n")
    for name, ext in (("server", "server.ext"), ("other", "other.ext"), ("client", None)):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        args = ["x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.crt", "-days", "2"]
        if ext:
            args += ["-extfile", ext]
        _openssl(*args, cwd=d)
    return d


def _tls_server(certs: Path, cert: str = "server", auth_clients: str = "no") -> RedisServer:
    tls_port = free_port()
    server = RedisServer(
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(certs / f"{cert}.crt"),
        "--tls-key-file", str(certs / f"{cert}.key"),
        "--tls-ca-cert-file", str(certs / "ca.crt"),
        "--tls-auth-clients", auth_clients,
    )
    server.tls_port = tls_port  # type: ignore[attr-defined]
    server.start()
    return server


@pytest.fixture(scope="module")
def tls_server(certificates: Path) -> Iterator[RedisServer]:
    server = _tls_server(certificates)
    admin = redis.Redis(port=server.port)
    admin.acl_setuser("app", enabled=True, passwords=[f"+{PASSWORD}"], keys=["*"],
                      commands=["+@all"])
    admin.close()
    yield server
    server.close()


def _run(make_limiter: LimiterFactory, url: str, user: str, calls: int = 3) -> list[Any]:
    """Makes `calls` checks with a limit of 2 per minute through a fresh limiter of the kind
    under test, closed right after. Timeouts are generous: these tests are about certificates,
    and a TLS handshake on a loaded 2-core machine has been seen to take over 2 s."""
    with make_limiter(url, connect_timeout=10, socket_timeout=10) as limiter:
        return [limiter.check(user, 2, 60) for _ in range(calls)]


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_tls_with_ca_file_limits_exactly(make_limiter: LimiterFactory, tls_server: RedisServer,
                                         certificates: Path, user_id: str) -> None:
    url = f"rediss://127.0.0.1:{tls_server.tls_port}/0?ssl_ca_certs={certificates / 'ca.crt'}"
    assert _run(make_limiter, url, user_id) == [(True, 1, 0), (True, 0, 0), (False, 0, 60)]
    assert redis.Redis(port=tls_server.port).zcard(f"ratelimit:{user_id}:60") == 2


def test_tls_verifies_by_default_and_refuses_an_unknown_ca(
        make_limiter: LimiterFactory, tls_server: RedisServer, user_id: str) -> None:
    url = f"rediss://127.0.0.1:{tls_server.tls_port}/0"
    with pytest.raises(RateLimiterUnavailable, match="(?i)certificate"):
        _run(make_limiter, url, user_id, calls=1)


def test_tls_refuses_a_certificate_for_another_name(make_limiter: LimiterFactory, certificates: Path,
                                                    user_id: str) -> None:
    server = _tls_server(certificates, cert="other")
    try:
        url = f"rediss://127.0.0.1:{server.tls_port}/0?ssl_ca_certs={certificates / 'ca.crt'}"
        with pytest.raises(RateLimiterUnavailable):
            _run(make_limiter, url, user_id, calls=1)
    finally:
        server.close()


def test_tls_without_verification_only_when_asked(make_limiter: LimiterFactory,
                                                 tls_server: RedisServer, user_id: str) -> None:
    url = f"rediss://127.0.0.1:{tls_server.tls_port}/0?ssl_cert_reqs=none"
    assert _run(make_limiter, url, user_id)[0] == (True, 1, 0)


def test_tls_client_certificate(make_limiter: LimiterFactory, certificates: Path, user_id: str) -> None:
    server = _tls_server(certificates, auth_clients="yes")
    try:
        base = f"rediss://127.0.0.1:{server.tls_port}/0?ssl_ca_certs={certificates / 'ca.crt'}"
        with pytest.raises(RateLimiterUnavailable):
            _run(make_limiter, base, user_id, calls=1)
        with_cert = (f"{base}&ssl_certfile={certificates / 'client.crt'}"
                     f"&ssl_keyfile={certificates / 'client.key'}")
        assert _run(make_limiter, with_cert, user_id)[0] == (True, 1, 0)
    finally:
        server.close()


def test_tls_acl_user_and_password(make_limiter: LimiterFactory, tls_server: RedisServer,
                                   certificates: Path, user_id: str) -> None:
    ca = certificates / "ca.crt"
    good = f"rediss://app:{PASSWORD}@127.0.0.1:{tls_server.tls_port}/0?ssl_ca_certs={ca}"
    assert _run(make_limiter, good, user_id)[0] == (True, 1, 0)
    bad = f"rediss://app:wrong-{PASSWORD}@127.0.0.1:{tls_server.tls_port}/0?ssl_ca_certs={ca}"
    with pytest.raises(RateLimiterAuthError) as info:
        _run(make_limiter, bad, user_id, calls=1)
    assert PASSWORD not in str(info.value)
    assert "authentication" in str(info.value).lower()


def test_tls_password_never_in_repr(make_limiter: LimiterFactory, tls_server: RedisServer) -> None:
    limiter = make_limiter(
        f"rediss://app:{PASSWORD}@127.0.0.1:{tls_server.tls_port}/0?ssl_cert_reqs=none")
    assert PASSWORD not in repr(limiter)
    assert PASSWORD not in limiter.url


def test_tls_missing_ca_file_fails_at_construction(make_limiter: LimiterFactory, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-ca.pem"
    with pytest.raises(ValueError, match="no-such-ca.pem"):
        make_limiter(f"rediss://127.0.0.1:6379/0?ssl_ca_certs={missing}")


def test_tls_url_with_unknown_cert_reqs_is_refused(make_limiter: LimiterFactory) -> None:
    with pytest.raises(ValueError, match="ssl_cert_reqs"):
        make_limiter("rediss://127.0.0.1:6379/0?ssl_cert_reqs=sometimes")


def test_ssl_parameters_need_rediss(make_limiter: LimiterFactory) -> None:
    with pytest.raises(ValueError, match="rediss"):
        make_limiter("redis://127.0.0.1:6379/0?ssl_cert_reqs=none")


# ------------------------------------------------------ the handshake, byte by byte
# The server's first flight (ServerHello to Finished) through tests/tls_proxy.py, cut and
# delayed in odd ways, and a signal while the client waits for it. The handshake is the
# same whatever the storage: the zset cases alone.
HANDSHAKE_ONLY = "the TLS handshake does not depend on the storage"


@pytest.mark.storages("zset", reason=HANDSHAKE_ONLY)
@pytest.mark.parametrize("shape", ["split", "coalesced", "paused"])
def test_tls_handshake_through_odd_deliveries_of_the_servers_records(
        make_limiter: LimiterFactory, tls_server: RedisServer, certificates: Path, user_id: str,
        shape: str) -> None:
    with TlsProxy(tls_server.tls_port, shape) as proxy:
        url = (f"rediss://app:{PASSWORD}@127.0.0.1:{proxy.port}/0"
               f"?ssl_ca_certs={certificates / 'ca.crt'}")
        started = time.monotonic()
        assert _run(make_limiter, url, user_id) == [(True, 1, 0), (True, 0, 0), (False, 0, 60)]
        elapsed = time.monotonic() - started
    assert proxy.shaped >= 1, f"premise: no first flight went through the proxy {proxy.stats()}"
    # Its own pauses ("paused": 50 ms between records, "split": 1 ms between pieces) add
    # well under a second; connect_timeout (10 s) is not what lets it pass.
    assert elapsed < 5.0, f"{elapsed:.2f} s through {proxy.stats()}"


@pytest.mark.storages("zset", reason=HANDSHAKE_ONLY)
def test_a_signal_during_the_tls_handshake_does_not_fail_it(
        make_limiter: LimiterFactory, tls_server: RedisServer, certificates: Path,
        user_id: str) -> None:
    """The server's first flight is held while the test's thread waits for it inside the
    handshake; SIGALRM (a Python handler) interrupts that wait three times, then the flight
    is delivered. A signal is no timeout: the handshake goes on (as the rest of the
    connection's set-up does), within connect_timeout."""
    caught: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: caught.append(signum))
    try:
        with TlsProxy(tls_server.tls_port, "held") as proxy:
            url = (f"rediss://127.0.0.1:{proxy.port}/0"
                   f"?ssl_ca_certs={certificates / 'ca.crt'}")
            driver = SignalDriver(signal.SIGALRM, interval=0.05, count=3)

            def release_after_the_signals() -> None:
                deadline = time.monotonic() + 10
                while len(driver.sent_at) < driver.count and time.monotonic() < deadline:
                    if driver.done.wait(0.01):
                        break
                proxy.release()

            releaser = threading.Thread(target=release_after_the_signals, daemon=True)
            driver.start()
            releaser.start()
            try:
                with make_limiter(url, connect_timeout=10, socket_timeout=10) as limiter:
                    result = limiter.check(user_id, 2, 60)
            finally:
                driver.stop()
                proxy.release()
                releaser.join(10)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert driver.saw_blocked and len(driver.sent_at) == driver.count, (
        "premise: the signals did not reach the thread blocked in the handshake")
    assert proxy.shaped == 1, proxy.stats()
    assert result == (True, 1, 0)
    # The handler ran once the call gave control back (signals that came while it was
    # pending are one call of it: Python keeps one flag per signal).
    assert caught


@pytest.mark.storages("zset", reason=HANDSHAKE_ONLY)
def test_tls_handshake_stays_within_connect_timeout_when_the_server_trickles(
        make_limiter: LimiterFactory, tls_server: RedisServer, certificates: Path,
        user_id: str) -> None:
    """A server that sends its first flight one byte every 5 ms (about 10 s for the ~2 KB)
    is never silent for a whole socket timeout: connect_timeout must bound the handshake
    as a whole, not each read in it."""
    with TlsProxy(tls_server.tls_port, "trickle", pause=0.005) as proxy:
        url = f"rediss://127.0.0.1:{proxy.port}/0?ssl_ca_certs={certificates / 'ca.crt'}"
        started = time.monotonic()
        with pytest.raises(RateLimiterTimeout, match="(?i)timed out"):
            with make_limiter(url, connect_timeout=0.5, socket_timeout=0.5) as limiter:
                limiter.check(user_id, 2, 60)
        elapsed = time.monotonic() - started
    assert elapsed < 0.5 + 1.0, f"the handshake went on for {elapsed:.2f} s"


@pytest.mark.storages("zset", reason="a signal during a read does not depend on the storage")
@pytest.mark.limiter_kinds("sync", reason="the blocking limiter's own path: the asyncio loop "
                                          "retries its wait and runs handlers itself")
def test_a_signal_handler_that_raises_interrupts_a_blocked_check_over_tls(
        make_limiter: LimiterFactory, certificates: Path) -> None:
    """PEP 475 over TLS, as over TCP (test_production_faults.py): a check waiting on a
    paused server raises the handler's exception as soon as the signal comes, not once the
    socket timeout has run out."""
    server = _tls_server(certificates)
    previous = signal.getsignal(signal.SIGALRM)
    try:
        url = f"rediss://127.0.0.1:{server.tls_port}/0?ssl_ca_certs={certificates / 'ca.crt'}"
        with make_limiter(url, connect_timeout=3, socket_timeout=3) as limiter:
            assert_a_raising_handler_interrupts_a_blocked_check(limiter, server.pause, server.resume)
    finally:
        signal.signal(signal.SIGALRM, previous)
        server.close()


# ------------------------------------------------------------- one TLS trust policy
# Both limiters trust the same CAs: with ssl_ca_certs only that file, without it the system's
# default store (SSL_CERT_FILE stands in for the system store: OpenSSL's default verify paths
# and Python's ssl default certificates both honour it). Each check runs in a child process
# whose environment names its "system store".


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


# ------------------------------------------------------------------ closing a TLS limiter

@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="aclose() of the async limiter's TLS "
                                                       "connections; the blocking one closes in C")
def test_aclose_closes_the_tls_sockets_before_the_loop_ends(
        loop_factory: Any, tls_server: RedisServer, certificates: Path, user_id: str,
        make_limiter: LimiterFactory) -> None:
    """An application's loop ends soon after aclose() (asyncio.Runner, asyncio.run): a TLS
    transport only closed (its close_notify exchange begun) outlives the loop, and its
    socket is left to the garbage collector, which warns (ResourceWarning)."""
    import gc
    import warnings

    url = f"rediss://127.0.0.1:{tls_server.tls_port}/0?ssl_ca_certs={certificates / 'ca.crt'}"

    async def main() -> tuple[bool, int, int]:
        limiter = make_limiter.native(url, connect_timeout=10, socket_timeout=10)
        try:
            return await limiter.check(user_id, 2, 60)
        finally:
            await limiter.aclose()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        # What asyncio.Runner (3.11+) does around one coroutine, written out for 3.10.
        loop = loop_factory()
        try:
            assert loop.run_until_complete(main()) == (True, 1, 0)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == [], unclosed
