"""Who a request is, and the Redis key identity it counts under."""

from __future__ import annotations

import logging
import re

from fastapi import Request

logger = logging.getLogger("genai_ratelimit")


class Anonymous(str):
    """The identity of an anonymous client: `Anonymous("203.0.113.7") == "ip:203.0.113.7"`.
    Only an Anonymous identity reaches the anonymous key space; a plain str that reads
    "ip:..." is a user id and is kept apart from it (see key_identity)."""

    __slots__ = ()

    def __new__(cls, host: str) -> Anonymous:
        return super().__new__(cls, f"ip:{host}")


# A user id beginning with one of these is stored as "user:<id>": they mark the anonymous
# key space ("ip:"), escaped user ids ("user:"), namespaces ("ns:") and shadow budgets ("shadow:").
_RESERVED_PREFIXES = ("ip:", "user:", "ns:", "shadow:")
_NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")


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


def default_identify(request: Request) -> tuple[str, str | None]:
    """The contract's identity rule: request.state.user_id (set by the app's auth), else the
    client address, Anonymous(host) == "ip:<host>"; tier from request.state.tier. Never query
    parameters or client headers. (Behind a reverse proxy, request.client is what the ASGI
    server reports: configure its trusted proxies, e.g. uvicorn --forwarded-allow-ips.)"""
    user_id = getattr(request.state, "user_id", None)
    if user_id is None or user_id == "":
        client = request.client
        user_id = Anonymous(client.host if client is not None and client.host else "unknown")
    return user_id, getattr(request.state, "tier", None)
