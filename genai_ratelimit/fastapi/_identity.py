"""Who a request is, and the Redis key identity it counts under."""

from __future__ import annotations

import logging

from fastapi import Request

from .._keyspace import NAMESPACE_PATTERN
from ..proxies import Anonymous, ClientNetworks

logger = logging.getLogger("genai_ratelimit")


# A user id beginning with one of these is stored as "user:<id>": they mark the anonymous
# key space ("ip:"), escaped user ids ("user:"), namespaces ("ns:") and shadow budgets ("shadow:").
_RESERVED_PREFIXES = ("ip:", "user:", "ns:", "shadow:")
_NAMESPACE_PATTERN = NAMESPACE_PATTERN  # defined once, in genai_ratelimit._keyspace


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
