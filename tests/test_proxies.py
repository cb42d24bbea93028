"""TrustedProxies: the client address behind reverse proxies, from the hops your own proxies
appended to X-Forwarded-For, never from what a client forged. Unit tests on real Starlette
requests; then a real uvicorn on loopback (the test client plays the proxy) counting against
the session's real redis-server, and what uvicorn's own defaults do with a forged header.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from starlette.exceptions import HTTPException
from starlette.requests import Request

from genai_ratelimit.fastapi import Anonymous
from genai_ratelimit.proxies import TrustedProxies
from redis_server import free_port

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.not_asan(reason="the trusted-proxy rules are pure Python: no C of ours runs"),
    pytest.mark.no_hiredis1(reason="the trusted-proxy rules are pure Python: no hiredis path"),
]


def request(peer: str | None, *forwarded: str, header: str = "x-forwarded-for",
            user_id: str | None = None) -> Request:
    scope = {"type": "http", "method": "GET", "path": "/", "query_string": b"",
             "headers": [(header.encode(), value.encode()) for value in forwarded],
             "client": (peer, 51234) if peer is not None else None}
    req = Request(scope)
    if user_id is not None:
        req.state.user_id = user_id
    return req


PROXIES = TrustedProxies(["10.0.0.0/8", "127.0.0.1", "2001:db8::/32"])


@pytest.mark.parametrize("peer, forwarded, client", [
    # A client that is not a proxy is itself, whatever it sends.
    ("198.51.100.4", ["203.0.113.7"], "198.51.100.4"),
    ("198.51.100.4", [], "198.51.100.4"),
    # One trusted proxy: the hop it appended.
    ("10.1.2.3", ["203.0.113.7"], "203.0.113.7"),
    # A forged hop in front of what the proxy appended is never believed.
    ("10.1.2.3", ["6.6.6.6, 203.0.113.7"], "203.0.113.7"),
    ("10.1.2.3", ["6.6.6.6", "203.0.113.7"], "203.0.113.7"),  # two header lines
    # A chain of trusted proxies is walked through, from the right.
    ("127.0.0.1", ["6.6.6.6, 203.0.113.7, 10.9.9.9"], "203.0.113.7"),
    # Every hop trusted: the leftmost is the best there is.
    ("10.1.2.3", ["10.0.0.5"], "10.0.0.5"),
    # A trusted proxy that sent no header: the proxy itself.
    ("10.1.2.3", [], "10.1.2.3"),
    # Ports, brackets and IPv6.
    ("10.1.2.3", ["203.0.113.7:5100"], "203.0.113.7"),
    ("2001:db8::1", ["[2001:db9::7]:443"], "2001:db9::7"),
    ("::ffff:10.1.2.3", ["203.0.113.7"], "203.0.113.7"),
    # Junk stops the walk: nothing left of it can be believed.
    ("10.1.2.3", ["6.6.6.6, unknown, 10.0.0.8"], "10.0.0.8"),
    ("10.1.2.3", ["6.6.6.6, unknown"], "10.1.2.3"),
])
def test_the_client_is_the_first_untrusted_hop_from_the_right(peer: str, forwarded: list[str],
                                                              client: str) -> None:
    assert PROXIES.client_host(request(peer, *forwarded)) == client


def test_identify_is_the_signed_in_user_or_the_anonymous_client() -> None:
    assert PROXIES.identify(request("10.1.2.3", "203.0.113.7")) == (Anonymous("203.0.113.7"), None)
    assert isinstance(PROXIES.identify(request("10.1.2.3", "203.0.113.7"))[0], Anonymous)
    assert PROXIES.identify(request("10.1.2.3", "203.0.113.7", user_id="u1"))[0] == "u1"
    # No address at all: refused, never one shared "ip:unknown" (tests/test_identity_prefixes.py).
    with pytest.raises(HTTPException) as refused:
        PROXIES.identify(request(None))
    assert refused.value.status_code == 500


def test_another_header_can_be_named() -> None:
    proxies = TrustedProxies(["10.0.0.0/8"], header="X-Real-IP")
    assert proxies.client_host(request("10.0.0.1", "203.0.113.7", header="x-real-ip")) == "203.0.113.7"
    assert proxies.client_host(request("10.0.0.1", "203.0.113.7")) == "10.0.0.1"


@pytest.mark.parametrize("proxies, error, message", [
    ("10.0.0.0/8", TypeError, "list"),
    ([], ValueError, "at least one"),
    (["0.0.0.0/0"], ValueError, "every address"),
    (["::/0"], ValueError, "every address"),
    (["nginx"], ValueError, "not an IP address"),
    ([10], TypeError, "str"),
])
def test_bad_proxy_lists_are_refused(proxies: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        TrustedProxies(proxies)  # type: ignore[arg-type]


# ------------------------------------------------------------- over real HTTP (uvicorn)

APP = textwrap.dedent("""
    from fastapi import Depends, FastAPI
    from genai_ratelimit import AsyncRateLimiter
    from genai_ratelimit.fastapi import RateLimit
    from genai_ratelimit.proxies import TrustedProxies

    budget = {"free": {"per_minute": 2, "per_day": 100}}
    app = FastAPI()
    behind = RateLimit(AsyncRateLimiter(), tier_limits=budget, namespace="behind",
                       identify=TrustedProxies(["127.0.0.1"]).identify)
    default = RateLimit(AsyncRateLimiter(), tier_limits=budget, namespace="default")

    @app.get("/behind", dependencies=[Depends(behind)])
    async def with_trusted_proxies():
        return {"ok": True}

    @app.get("/default", dependencies=[Depends(default)])
    async def with_the_default_identify():
        return {"ok": True}
""")


class Served:
    def __init__(self, redis_url: str, proxy_headers: bool) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="genai-ratelimit-proxies-"))
        (self.directory / "proxied_app.py").write_text(APP)
        self.log = self.directory / "uvicorn.log"
        self.port = free_port()
        flags = [] if proxy_headers else ["--no-proxy-headers"]
        env = {**os.environ, "REDIS_URL": redis_url}
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "proxied_app:app", "--app-dir",
                 str(self.directory), "--host", "127.0.0.1", "--port", str(self.port), *flags],
                cwd=self.directory, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/nothing", timeout=1)
                return
            except httpx.TransportError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError(f"uvicorn did not start:\n{self.log.read_text()[-3000:]}")

    def get(self, path: str, forwarded: str | None = None) -> httpx.Response:
        headers = {"X-Forwarded-For": forwarded} if forwarded is not None else {}
        return httpx.get(f"http://127.0.0.1:{self.port}{path}", headers=headers, timeout=10)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@pytest.fixture
def served(redis_url: str, redis_client: redis.Redis, request: pytest.FixtureRequest) -> Iterator[Served]:
    app = Served(redis_url, proxy_headers=request.param)
    try:
        yield app
    finally:
        app.close()


@pytest.mark.parametrize("served", [False], indirect=True, ids=["no-proxy-headers"])
def test_behind_a_trusted_proxy_each_client_has_its_own_budget_and_cannot_forge_another(
        served: Served, redis_client: redis.Redis) -> None:
    # The test client is the proxy (127.0.0.1): it appends the real client's address last.
    assert [served.get("/behind", "203.0.113.7").status_code for _ in range(2)] == [200, 200]
    # The same client forging another address in front: still itself, and over budget.
    assert served.get("/behind", "198.51.100.9, 203.0.113.7").status_code == 429
    assert served.get("/behind", "203.0.113.8").status_code == 200  # another client
    counted = {key.decode(): redis_client.zcard(key)
               for key in redis_client.scan_iter("ratelimit:ns:behind:*:60")}
    assert counted == {"ratelimit:ns:behind:ip:203.0.113.7:60": 2,
                       "ratelimit:ns:behind:ip:203.0.113.8:60": 1}


@pytest.mark.parametrize("served", [True], indirect=True, ids=["uvicorn-default-proxy-headers"])
def test_uvicorn_defaults_trust_a_local_peer_s_forwarded_header(served: Served,
                                                                redis_client: redis.Redis) -> None:
    """The hazard docs/proxies.md describes: uvicorn's defaults (--proxy-headers with
    --forwarded-allow-ips 127.0.0.1) take X-Forwarded-For from any local peer, so a client
    that reaches uvicorn from the same host without a proxy picks its address, and budget,
    at will."""
    statuses = [served.get("/default", f"203.0.113.{n}").status_code for n in range(1, 6)]
    assert statuses == [200] * 5, "each forged address got a fresh budget"
    assert len(list(redis_client.scan_iter("ratelimit:ns:default:ip:*:60"))) == 5
