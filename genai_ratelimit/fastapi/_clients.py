"""Who a request is: the client's network (an IPv6 client per /64), its address behind the
reverse proxies you trust (the public face is genai_ratelimit.proxies, whose docstring tells
how to use them), the contract's identity rule and the Redis key identity it counts under."""


from __future__ import annotations

import functools
import ipaddress
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from fastapi import Request
from starlette.exceptions import HTTPException

logger = logging.getLogger("genai_ratelimit")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

DEFAULT_V4_PREFIX = 32
DEFAULT_V6_PREFIX = 64
UNKNOWN_LOG_INTERVAL = 60.0  # seconds between two warnings of unknown client addresses


def _address(text: str) -> Address | None:
    """An IP address from a header hop or a peer: "203.0.113.7", "[2001:db8::1]:443",
    "203.0.113.7:5100"; None when it is not one ("unknown", obfuscated identifiers, junk).
    An IPv4-mapped IPv6 address is its IPv4 address."""
    text = text.strip()
    if text.startswith("["):  # [IPv6]:port
        text = text[1:text.find("]")] if "]" in text else ""
    elif text.count(":") == 1:  # IPv4:port
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _prefix(name: str, value: object, bits: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not 1 <= value <= bits:
        raise ValueError(f"{name} must be between 1 and {bits}, got {value} (0 would put every "
                         f"client in one bucket)")
    return value


def client_network(address: str, v4_prefix: int = DEFAULT_V4_PREFIX,
                   v6_prefix: int = DEFAULT_V6_PREFIX) -> str:
    """The network an anonymous client is counted by: the address itself when the prefix is
    the whole address ("203.0.113.7"), else the network in CIDR form ("2001:db8:1:2::/64",
    "203.0.113.0/24"). An IPv4-mapped IPv6 address counts as IPv4. Anything that is not an IP
    address (a test client's "testclient") is returned as it is."""
    return _network_text(address, _prefix("v4_prefix", v4_prefix, 32),
                         _prefix("v6_prefix", v6_prefix, 128))


# Parsing an address costs more than the rest of a request's identity: the networks of the
# most recent clients are remembered (a bounded cache; a flood of new addresses only evicts).
@functools.lru_cache(maxsize=4096)
def _network_text(address: str, v4_prefix: int, v6_prefix: int) -> str:
    """client_network with prefixes already checked."""
    found = _address(address)
    if found is None:
        return address
    if isinstance(found, ipaddress.IPv4Address):
        if v4_prefix == 32:
            return str(found)
        return str(ipaddress.IPv4Network((int(found), v4_prefix), strict=False))
    if v6_prefix == 128:
        return str(ipaddress.IPv6Address(int(found)))  # without a zone id
    return str(ipaddress.IPv6Network((int(found), v6_prefix), strict=False))


def state_value(request: Request, name: str) -> Any:
    """request.state.<name>, or None when the app set none. Starlette's State raises (and
    formats a message) for every missing attribute; its dict is read directly when it has
    one, which is several times cheaper on the anonymous path."""
    scope = getattr(request, "scope", None)
    values = scope.get("state") if isinstance(scope, dict) else None
    if isinstance(values, dict):  # the dict Starlette's request.state reads and writes
        return values.get(name)
    state = request.state
    values = getattr(state, "_state", None)  # an instance attribute: no __getattr__ call
    if isinstance(values, dict):
        return values.get(name)
    return getattr(state, name, None)


class Anonymous(str):
    """The identity of an anonymous client: `Anonymous("203.0.113.7") == "ip:203.0.113.7"`.
    Only an Anonymous identity reaches the anonymous key space; a plain str that reads
    "ip:..." is a user id and is kept apart from it (genai_ratelimit.fastapi's key_identity).
    Public as genai_ratelimit.fastapi.Anonymous (defined here, where the identity rule is)."""

    __slots__ = ()

    def __new__(cls, host: str) -> Anonymous:
        return super().__new__(cls, f"ip:{host}")


@functools.lru_cache(maxsize=4096)  # the most recent clients' networks, as _network_text
def _anonymous(network: str) -> Anonymous:
    """Anonymous(network), one object per network (an Anonymous is immutable)."""
    return Anonymous(network)


class UnknownClientAddress(LookupError):
    """An anonymous request whose client address cannot be known. Raised by
    ClientNetworks.network_of; identify answers it with HTTP 500 (see the module)."""


_last_unknown_warning = float("-inf")


def _refuse_unknown_client(request: Request, unknown: UnknownClientAddress) -> NoReturn:
    """Log (at most once per UNKNOWN_LOG_INTERVAL) and refuse: HTTP 500 with
    x-should-retry: false (the SDKs retry neither), raised from `unknown` (a shadow
    dependency, which never refuses, lets the request through uncounted)."""
    global _last_unknown_warning

    now = time.monotonic()
    if now - _last_unknown_warning >= UNKNOWN_LOG_INTERVAL:
        _last_unknown_warning = now
        logger.warning(
            "refused an anonymous request to %s: %s. Counting it would put every such client in "
            "one shared bucket. Behind a proxy on a unix socket, use "
            "RateLimit(identify=TrustedProxies(unix_socket=True).identify); else identify "
            "the client yourself (identify=...). (Logged at most once per %d s.)",
            request.url.path, unknown, UNKNOWN_LOG_INTERVAL)
    raise HTTPException(
        status_code=500, headers={"x-should-retry": "false"},
        detail="Rate limit: the client's address is unknown, so its budget cannot be found "
               "(a configuration error of the server; see its log)") from unknown


def _is_unix_peer(host: str | None) -> bool:
    """The peer of a unix socket connection, as ASGI servers report it: no client address
    (uvicorn, hypercorn), an empty host or a path."""
    return not host or host.startswith(("/", "unix:"))


class ClientNetworks:
    """An `identify` that counts anonymous clients per network: request.state.user_id when
    the app's auth set one, else Anonymous(client_network(address, v4_prefix, v6_prefix)).
    The tier from request.state.tier. An address the server does not report is refused,
    never counted in a shared bucket."""

    def __init__(self, *, v4_prefix: int = DEFAULT_V4_PREFIX, v6_prefix: int = DEFAULT_V6_PREFIX) -> None:
        self.v4_prefix = _prefix("v4_prefix", v4_prefix, 32)
        self.v6_prefix = _prefix("v6_prefix", v6_prefix, 128)

    def __repr__(self) -> str:
        return f"ClientNetworks(v4_prefix={self.v4_prefix}, v6_prefix={self.v6_prefix})"

    def client_host(self, request: Request) -> str | None:
        """The client's address: the peer the server reports (None when it reports none)."""
        client = request.client
        return client.host if client is not None and client.host else None

    def network_of(self, request: Request) -> str:
        """client_network of client_host; raises UnknownClientAddress when there is none."""
        host = self.client_host(request)
        if host is None or _is_unix_peer(host):
            raise UnknownClientAddress(self._unknown_reason(request))
        return _network_text(host, self.v4_prefix, self.v6_prefix)

    def _unknown_reason(self, request: Request) -> str:
        return "the server reports no client address (a unix socket?)"

    def identify(self, request: Request) -> tuple[str, str | None]:
        """An `identify` for RateLimit / TokenRateLimit."""
        user_id = state_value(request, "user_id")
        if user_id is None or user_id == "":
            try:
                user_id = _anonymous(self.network_of(request))
            except UnknownClientAddress as unknown:
                _refuse_unknown_client(request, unknown)
        return user_id, state_value(request, "tier")


class TrustedProxies(ClientNetworks):
    """The addresses (or networks, "10.0.0.0/8") of the proxies in front of the service, and
    with unix_socket=True the peer of a unix socket connection (a proxy that reaches the
    service on a unix socket: the server reports no address for it). Anonymous clients are
    counted per network (v4_prefix, v6_prefix; see ClientNetworks)."""

    def __init__(self, proxies: Iterable[str] = (), *, header: str = "x-forwarded-for",
                 unix_socket: bool = False, v4_prefix: int = DEFAULT_V4_PREFIX,
                 v6_prefix: int = DEFAULT_V6_PREFIX) -> None:
        super().__init__(v4_prefix=v4_prefix, v6_prefix=v6_prefix)
        if isinstance(proxies, str):
            raise TypeError("proxies must be a list of addresses or networks, not one str")
        if not isinstance(unix_socket, bool):
            raise TypeError(f"unix_socket must be a bool, not {type(unix_socket).__name__}")
        networks: list[Network] = []
        for proxy in proxies:
            if not isinstance(proxy, str):
                raise TypeError(f"a trusted proxy must be a str, not {type(proxy).__name__}")
            try:
                networks.append(ipaddress.ip_network(proxy.strip(), strict=False))
            except ValueError:
                raise ValueError(f"not an IP address or network: {proxy!r}") from None
        if not networks and not unix_socket:
            raise ValueError("name at least one trusted proxy, or unix_socket=True (or do not "
                             "use TrustedProxies)")
        if any(network.prefixlen == 0 for network in networks):
            raise ValueError("a trusted proxy network of every address (/0) would let any "
                             "client choose its own address")
        if not isinstance(header, str) or not header:
            raise ValueError("header must be a non-empty header name")
        self.networks = tuple(networks)
        self.header = header.lower()
        self.unix_socket = unix_socket

    def __repr__(self) -> str:
        return (f"TrustedProxies({[str(n) for n in self.networks]!r}, header={self.header!r}, "
                f"unix_socket={self.unix_socket}, v4_prefix={self.v4_prefix}, "
                f"v6_prefix={self.v6_prefix})")

    def trusts(self, host: str) -> bool:
        address = _address(host)
        return address is not None and any(address in network for network in self.networks)

    def client_host(self, request: Request) -> str | None:
        """The client's address: the peer unless it is a trusted proxy (an address of the
        list, or with unix_socket=True a unix socket peer); then the first hop of the header,
        from the right, that is not a trusted proxy. None when there is no address: no peer
        address and the unix socket not trusted, or a unix socket proxy that sent no address
        in the header."""
        peer = request.client.host if request.client is not None and request.client.host else None
        if _is_unix_peer(peer):
            if not self.unix_socket:
                return None
            client = None
        elif peer is None or not self.trusts(peer):
            return peer
        else:
            client = peer
        hops = [hop for value in request.headers.getlist(self.header)
                for hop in value.split(",") if hop.strip()]
        for hop in reversed(hops):
            address = _address(hop)
            if address is None:
                break  # not an address: nothing to its left can be believed either
            client = str(address)
            if not any(address in network for network in self.networks):
                break
        return client

    def _unknown_reason(self, request: Request) -> str:
        peer = request.client.host if request.client is not None and request.client.host else None
        if not self.unix_socket:
            return ("the server reports no client address (a unix socket peer?), and "
                    "TrustedProxies(unix_socket=False) does not trust it")
        return (f"the proxy on the unix socket{'' if peer is None else f' ({peer})'} sent no "
                f"client address in {self.header}")


# --- the key identity ----------------------------------------------------------------------

Identify = Callable[[Request], "tuple[str, str | None]"]

# A user id beginning with one of these is stored as "user:<id>": they mark the anonymous
# key space ("ip:"), escaped user ids ("user:"), namespaces ("ns:") and shadow budgets ("shadow:").
_RESERVED_PREFIXES = ("ip:", "user:", "ns:", "shadow:")


def key_identity(user_id: str, namespace: str | None = None) -> str:
    """What goes between the key prefix and the window in a Redis key:
    "ip:<host>" for an Anonymous identity; the user id itself, or "user:<id>" when it begins
    with "ip:", "user:" or "ns:"; and "ns:<namespace>:" in front of either when a namespace
    applies. Distinct (identity, namespace) pairs never give the same string."""
    if isinstance(user_id, Anonymous):
        identity = str(user_id)
    elif user_id.startswith(_RESERVED_PREFIXES):
        identity = f"user:{user_id}"
    else:
        identity = user_id
    return identity if namespace is None else f"ns:{namespace}:{identity}"


_DEFAULT_NETWORKS = ClientNetworks()


def default_identify(request: Request) -> tuple[str, str | None]:
    """The contract's identity rule: request.state.user_id (set by the app's auth), else the
    client's network, Anonymous(client_network(host)): "ip:203.0.113.7", an IPv6 client per
    /64 ("ip:2001:db8:1:2::/64"); tier from request.state.tier. Never query parameters or
    client headers. A request the server reports no address for is refused (500), never
    counted in one shared bucket (genai_ratelimit.proxies). (Behind a reverse proxy,
    request.client is what the ASGI server reports: configure its trusted proxies, e.g.
    uvicorn --forwarded-allow-ips, or use proxies.TrustedProxies.)"""
    return _DEFAULT_NETWORKS.identify(request)
