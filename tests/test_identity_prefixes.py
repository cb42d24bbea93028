"""Who an anonymous client is (genai_ratelimit.proxies): IPv6 clients counted per /64 (the
prefixes configurable), a proxy that reaches the service on a unix socket trusted when asked
(unix_socket=True), and an address nobody reported refused with a distinct 500 and a
warning, never counted in one `ip:unknown` bucket shared by every such client.

Unit tests on real Starlette requests; then a real uvicorn on a unix socket (the test client
plays the proxy, as nginx's `proxy_pass http://unix:...` would) counting against the
session's real redis-server."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Iterator

import httpx
import pytest
import redis
from starlette.exceptions import HTTPException
from starlette.requests import Request

from genai_ratelimit.fastapi import Anonymous
from genai_ratelimit.proxies import ClientNetworks, TrustedProxies, client_network
from helpers_uvicorn import HTTPX_SOCKETS, UvicornServer

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    HTTPX_SOCKETS,
    pytest.mark.not_asan(reason="uvicorn serves the app on a unix socket in another process"),
    pytest.mark.no_hiredis1(reason="uvicorn serves the app on a unix socket in another process"),
]


def request(peer: str | None, *forwarded: str, user_id: str | None = None) -> Request:
    scope = {"type": "http", "method": "GET", "path": "/chat", "query_string": b"",
             "headers": [(b"x-forwarded-for", value.encode()) for value in forwarded],
             "client": (peer, 51234) if peer is not None else None}
    req = Request(scope)
    if user_id is not None:
        req.state.user_id = user_id
    return req


# --- networks ---------------------------------------------------------------------------


@pytest.mark.parametrize("address, v4, v6, network", [
    ("203.0.113.7", 32, 64, "203.0.113.7"),  # IPv4 keys are unchanged by default
    ("203.0.113.7", 24, 64, "203.0.113.0/24"),
    ("2001:db8:1:2:a:b:c:d", 32, 64, "2001:db8:1:2::/64"),
    ("2001:db8:1:2ff:a:b:c:d", 32, 56, "2001:db8:1:200::/56"),
    ("2001:db8::7", 32, 128, "2001:db8::7"),
    ("fe80::1%eth0", 32, 64, "fe80::/64"),
    ("::ffff:203.0.113.7", 32, 64, "203.0.113.7"),  # IPv4-mapped: counted as IPv4
    ("[2001:db8::1]:443", 32, 64, "2001:db8::/64"),
    ("testclient", 32, 64, "testclient"),  # not an address: as it is
])
def test_the_network_a_client_is_counted_by(address: str, v4: int, v6: int, network: str) -> None:
    assert client_network(address, v4_prefix=v4, v6_prefix=v6) == network


@pytest.mark.parametrize("kwargs, error", [
    ({"v6_prefix": 0}, ValueError), ({"v4_prefix": 33}, ValueError), ({"v6_prefix": 129}, ValueError),
    ({"v4_prefix": True}, TypeError), ({"v6_prefix": "64"}, TypeError),
])
def test_bad_prefixes_are_refused_when_built(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error, match="prefix"):
        ClientNetworks(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(error, match="prefix"):
        TrustedProxies(["10.0.0.0/8"], **kwargs)  # type: ignore[arg-type]
    with pytest.raises(error, match="prefix"):
        client_network("203.0.113.7", **kwargs)  # type: ignore[arg-type]


def test_rotating_addresses_within_a_64_is_one_client() -> None:
    # The issue: 12 of 12 admitted against 5/min by rotating within one /64.
    networks = ClientNetworks()
    seen = {networks.identify(request(f"2001:db8:1:2::{n:x}"))[0] for n in range(1, 13)}
    assert seen == {Anonymous("2001:db8:1:2::/64")}
    assert networks.identify(request("2001:db8:1:3::1"))[0] == Anonymous("2001:db8:1:3::/64")
    assert isinstance(networks.identify(request("203.0.113.7"))[0], Anonymous)
    assert networks.identify(request("2001:db8::1", user_id="u1")) == ("u1", None)
    wider = ClientNetworks(v6_prefix=48)
    assert wider.identify(request("2001:db8:1:2::1"))[0] == Anonymous("2001:db8:1::/48")


def test_a_trusted_proxy_s_forwarded_client_is_counted_per_network_too() -> None:
    proxies = TrustedProxies(["10.0.0.0/8"], v4_prefix=24)
    assert proxies.identify(request("10.1.2.3", "2001:db8:1:2::99"))[0] == Anonymous("2001:db8:1:2::/64")
    assert proxies.identify(request("10.1.2.3", "203.0.113.77"))[0] == Anonymous("203.0.113.0/24")
    assert proxies.client_host(request("10.1.2.3", "2001:db8:1:2::99")) == "2001:db8:1:2::99"


# --- the unix socket, and addresses nobody reported -----------------------------------------


def test_a_trusted_unix_socket_peer_is_a_proxy() -> None:
    proxies = TrustedProxies(unix_socket=True)
    assert proxies.client_host(request(None, "203.0.113.7")) == "203.0.113.7"
    assert proxies.client_host(request(None, "6.6.6.6, 203.0.113.7")) == "203.0.113.7"  # forged hop
    assert proxies.client_host(request("", "203.0.113.7")) == "203.0.113.7"  # an empty host
    assert proxies.client_host(request("/run/app.sock", "203.0.113.7")) == "203.0.113.7"  # a path
    # A TCP peer is not trusted unless listed: the client itself.
    assert proxies.client_host(request("198.51.100.4", "203.0.113.7")) == "198.51.100.4"
    # A unix socket proxy behind listed TCP proxies: walked through.
    chained = TrustedProxies(["10.0.0.0/8"], unix_socket=True)
    assert chained.client_host(request(None, "6.6.6.6, 203.0.113.7, 10.9.9.9")) == "203.0.113.7"


def refusal(identify: object, req: Request) -> HTTPException:
    with pytest.raises(HTTPException) as caught:
        identify(req)  # type: ignore[operator]
    return caught.value


@pytest.mark.parametrize("identify, req, why", [
    (TrustedProxies(["127.0.0.1"]).identify, request(None, "203.0.113.7"), "does not trust it"),
    (TrustedProxies(unix_socket=True).identify, request(None), "sent no client address"),
    (TrustedProxies(unix_socket=True).identify, request(None, "unknown"), "sent no client address"),
    (ClientNetworks().identify, request(None), "reports no client address"),
], ids=["unix-not-trusted", "no-header", "junk-header", "networks-no-peer"])
def test_an_unknown_address_is_refused_with_a_distinct_500_and_a_warning(
        identify: object, req: Request, why: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from genai_ratelimit.fastapi import _clients as proxies

    monkeypatch.setattr(proxies, "_last_unknown_warning", float("-inf"))
    with caplog.at_level(logging.WARNING, logger="genai_ratelimit"):
        refused = refusal(identify, req)
        refusal(identify, req)  # the second within a minute is not logged again
    assert refused.status_code == 500
    assert refused.headers == {"x-should-retry": "false"}  # the SDKs do not retry it
    assert "address is unknown" in refused.detail
    messages = [r.getMessage() for r in caplog.records if r.name == "genai_ratelimit"]
    assert len(messages) == 1 and why in messages[0] and "unix_socket=True" in messages[0]


def test_a_signed_in_user_needs_no_address() -> None:
    assert TrustedProxies(unix_socket=True).identify(request(None, user_id="u1")) == ("u1", None)


def test_trusting_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="unix_socket=True"):
        TrustedProxies()
    with pytest.raises(TypeError, match="unix_socket"):
        TrustedProxies(unix_socket="yes")  # type: ignore[arg-type]
    assert "unix_socket=True" in repr(TrustedProxies(unix_socket=True))


# --- over real HTTP: uvicorn on a unix socket, real Redis --------------------------------------

APP = textwrap.dedent("""
    from fastapi import Depends, FastAPI
    from genai_ratelimit import AsyncRateLimiter
    from genai_ratelimit.fastapi import RateLimit
    from genai_ratelimit.proxies import TrustedProxies

    budget = {"free": {"per_minute": 5, "per_day": 100}}
    app = FastAPI()
    socket_proxy = RateLimit(AsyncRateLimiter(), tier_limits=budget, namespace="uds",
                             identify=TrustedProxies(unix_socket=True).identify)
    tcp_only = RateLimit(AsyncRateLimiter(), tier_limits=budget, namespace="tcp",
                         identify=TrustedProxies(["127.0.0.1"]).identify)

    @app.get("/socket", dependencies=[Depends(socket_proxy)])
    async def behind_the_socket_proxy():
        return {"ok": True}

    @app.get("/tcp-only", dependencies=[Depends(tcp_only)])
    async def trusting_tcp_proxies_only():
        return {"ok": True}

    default = RateLimit(AsyncRateLimiter(), tier_limits=budget, namespace="default")

    @app.get("/default", dependencies=[Depends(default)])
    async def with_the_default_identify():
        return {"ok": True}

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}
""")


class UnixSocketServer(UvicornServer):
    """APP under uvicorn on a unix socket (helpers_uvicorn.UvicornServer): the ASGI scope of
    every request has no client address."""

    def __init__(self, redis_url: str) -> None:
        super().__init__(APP, {"REDIS_URL": redis_url}, uds="app.sock")
        self.http = self.client(timeout=10)

    def get(self, path: str, forwarded: str | None = None) -> httpx.Response:
        headers = {"X-Forwarded-For": forwarded} if forwarded is not None else {}
        return self.http.get(path, headers=headers)

    def close(self) -> None:
        self.http.close()
        super().close()


@pytest.fixture
def uds_server(redis_url: str, redis_client: redis.Redis) -> Iterator[UnixSocketServer]:
    server = UnixSocketServer(redis_url)
    try:
        server.start()
        yield server
    finally:
        server.close()


def counted(redis_client: redis.Redis, pattern: str) -> dict[str, int]:
    return {key.decode(): int(redis_client.zcard(key)) for key in redis_client.scan_iter(pattern)}


def test_behind_a_unix_socket_proxy_each_client_has_its_own_budget(
        uds_server: UnixSocketServer, redis_client: redis.Redis) -> None:
    assert [uds_server.get("/socket", "203.0.113.7").status_code for _ in range(5)] == [200] * 5
    assert uds_server.get("/socket", "198.51.100.9, 203.0.113.7").status_code == 429  # forged: still itself
    assert uds_server.get("/socket", "203.0.113.8").status_code == 200  # another client
    assert counted(redis_client, "ratelimit:ns:uds:*:60") == {"ratelimit:ns:uds:ip:203.0.113.7:60": 5,
                                                              "ratelimit:ns:uds:ip:203.0.113.8:60": 1}


def test_behind_a_unix_socket_proxy_an_ipv6_client_is_counted_per_64(
        uds_server: UnixSocketServer, redis_client: redis.Redis) -> None:
    statuses = [uds_server.get("/socket", f"2001:db8:1:2::{n:x}").status_code for n in range(1, 13)]
    assert statuses == [200] * 5 + [429] * 7  # 12 rotated addresses, one /64, a budget of 5
    assert uds_server.get("/socket", "2001:db8:1:3::1").status_code == 200  # the next /64
    assert counted(redis_client, "ratelimit:ns:uds:*:60") == {"ratelimit:ns:uds:ip:2001:db8:1:2::/64:60": 5,
                                                              "ratelimit:ns:uds:ip:2001:db8:1:3::/64:60": 1}


def test_an_untrusted_unix_socket_is_refused_never_one_shared_bucket(
        uds_server: UnixSocketServer, redis_client: redis.Redis) -> None:
    for forwarded in ("203.0.113.7", "203.0.113.8", None):
        answer = uds_server.get("/tcp-only", forwarded)
        assert answer.status_code == 500
        assert answer.headers["x-should-retry"] == "false"
        assert "address is unknown" in answer.json()["detail"]
    assert uds_server.get("/socket").status_code == 500  # a trusted socket proxy that sent no address
    assert list(redis_client.scan_iter("ratelimit:*")) == []  # nothing counted, least of all ip:unknown
    assert "unix_socket=True" in uds_server.log()


def test_the_default_identify_behind_a_unix_socket_is_refused_never_one_shared_bucket(
        uds_server: UnixSocketServer, redis_client: redis.Redis) -> None:
    # The issue: every anonymous client behind a unix-socket proxy was ip:unknown.
    answers = [uds_server.get("/default", f"203.0.113.{n}") for n in range(1, 4)]
    assert [a.status_code for a in answers] == [500] * 3
    assert all(a.headers["x-should-retry"] == "false" for a in answers)
    assert list(redis_client.scan_iter("ratelimit:*")) == []
