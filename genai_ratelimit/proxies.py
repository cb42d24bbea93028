"""The client address behind reverse proxies, from a list of proxies you trust.

Behind nginx or a load balancer every connection comes from the proxy: without help, all
anonymous clients share the proxy's address, hence one budget. The proxy says who the client
was in `X-Forwarded-For`, but any client can send that header too. Only the hops that YOUR
proxies appended can be believed: walking the header from the right, the first address that
is not one of your proxies is the client.

    from genai_ratelimit.fastapi import RateLimit
    from genai_ratelimit.proxies import TrustedProxies

    proxies = TrustedProxies(["10.0.0.0/8", "127.0.0.1"])   # your proxies' addresses
    limit = RateLimit(identify=proxies.identify)

A connection from an address that is not a trusted proxy is the client itself, whatever
headers it sends. Run the ASGI server so that it reports the TCP peer (uvicorn
`--no-proxy-headers`), or let the server do the same job with the same list (uvicorn
`--forwarded-allow-ips` with your proxies' addresses, never "*") and keep the default
identify: one of the two, not both.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # FastAPI is an optional extra; this module only needs a request's shape
    from starlette.requests import Request

__all__ = ["TrustedProxies"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An IP address from a header hop or a peer: "203.0.113.7", "[2001:db8::1]:443",
    "203.0.113.7:5100"; None when it is not one ("unknown", obfuscated identifiers, junk)."""
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


class TrustedProxies:
    """The addresses (or networks, "10.0.0.0/8") of the proxies in front of the service."""

    def __init__(self, proxies: Iterable[str], *, header: str = "x-forwarded-for") -> None:
        if isinstance(proxies, str):
            raise TypeError("proxies must be a list of addresses or networks, not one str")
        networks: list[Network] = []
        for proxy in proxies:
            if not isinstance(proxy, str):
                raise TypeError(f"a trusted proxy must be a str, not {type(proxy).__name__}")
            try:
                networks.append(ipaddress.ip_network(proxy.strip(), strict=False))
            except ValueError:
                raise ValueError(f"not an IP address or network: {proxy!r}") from None
        if not networks:
            raise ValueError("name at least one trusted proxy (or do not use TrustedProxies)")
        if any(network.prefixlen == 0 for network in networks):
            raise ValueError("a trusted proxy network of every address (/0) would let any "
                             "client choose its own address")
        if not isinstance(header, str) or not header:
            raise ValueError("header must be a non-empty header name")
        self.networks = tuple(networks)
        self.header = header.lower()

    def __repr__(self) -> str:
        return f"TrustedProxies({[str(n) for n in self.networks]!r}, header={self.header!r})"

    def trusts(self, host: str) -> bool:
        address = _address(host)
        return address is not None and any(address in network for network in self.networks)

    def client_host(self, request: Request) -> str | None:
        """The client's address: the TCP peer unless it is a trusted proxy; then the first
        hop of the header, from the right, that is not a trusted proxy. None when the
        request has no peer address."""
        peer = request.client.host if request.client is not None else None
        if not peer or not self.trusts(peer):
            return peer
        hops = [hop for value in request.headers.getlist(self.header)
                for hop in value.split(",") if hop.strip()]
        client = peer
        for hop in reversed(hops):
            address = _address(hop)
            if address is None:
                break  # not an address: nothing to its left can be believed either
            client = str(address)
            if not any(address in network for network in self.networks):
                break
        return client

    def identify(self, request: Request) -> tuple[str, str | None]:
        """An `identify` for RateLimit: request.state.user_id when the app's auth set one,
        else the anonymous identity of the client address found by client_host; the tier
        from request.state.tier."""
        from .fastapi import Anonymous  # FastAPI is needed only here

        user_id = getattr(request.state, "user_id", None)
        if user_id is None or user_id == "":
            user_id = Anonymous(self.client_host(request) or "unknown")
        return user_id, getattr(request.state, "tier", None)
