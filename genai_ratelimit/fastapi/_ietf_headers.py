"""The IETF pair of rate-limit fields, `RateLimit-Policy` and `RateLimit`, as
draft-ietf-httpapi-ratelimit-headers-10 writes them, in one place. No FastAPI here: plain
values in, header pairs out.

Both fields are Structured Field Lists (RFC 9651) of Items whose value is a String, the
policy's name:

    RateLimit-Policy: "requests-minute";q=5;w=60;pk=:q3Zr...:, "requests-day";q=100;w=86400;pk=:q3Zr...:
    RateLimit: "requests-minute";r=4;t=60;pk=:q3Zr...:

- `q`: the quota (Integer), `w`: the window in seconds (Integer), `qu`: the quota unit
  (String). Request windows leave `qu` out: the draft's default unit is requests. Token
  windows say `qu="tokens"`, a unit the draft's registry does not list (yet): leaving `qu`
  out would claim requests, which is false; a client that does not know the unit can ignore
  those items.
- `r`: the units remaining (Integer, never negative); `t`: seconds until more quota is
  available (Integer). On a sliding log the exact moment is when the oldest entry leaves the
  window, which an allowed decision does not read: `t` is then the window's length, the
  latest that moment can be (this request is the window's newest entry). On a refusal `t`
  is the honest Retry-After.
- `pk`: the partition key (Byte Sequence): the first 16 bytes of HMAC-SHA256(secret, the
  budget's key identity). Never the user id: without the secret, a key tells nothing about
  who it belongs to, and one user's keys are the same on every response (for a given secret
  and budget), so a client acting for several users can tell their quotas apart.

Policy names: "<resource>-<window>", e.g. "requests-minute", "tokens-day", "requests-3600s".
"""

from __future__ import annotations

import base64
import functools
import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "HEADER_MODES",
    "HeaderMode",
    "PARTITION_KEY_SECRET_ENV",
    "Policy",
    "ServiceLimit",
    "PartitionKeys",
    "ietf_headers",
    "policy_field",
    "service_field",
]

HeaderMode = Literal["contract", "ietf", "both"]
HEADER_MODES: tuple[HeaderMode, ...] = ("contract", "ietf", "both")
PARTITION_KEY_SECRET_ENV = "GENAI_RATELIMIT_PARTITION_KEY_SECRET"

# A Structured Field Integer has at most 15 digits.
_MAX_INTEGER = 999_999_999_999_999
_PARTITION_KEY_BYTES = 16
# The secret of a process that names none: random, so partition keys differ between
# processes (and workers) and across restarts. Configure a secret to keep them stable.
_PROCESS_SECRET = os.urandom(32)


@dataclass(frozen=True, slots=True)
class Policy:
    """One quota policy: a window of one resource."""

    name: str
    quota: int
    window_seconds: int
    unit: str | None  # None: the draft's default, requests


@dataclass(frozen=True, slots=True)
class ServiceLimit:
    """The current service limit of one policy: units remaining, seconds until more."""

    name: str
    remaining: int
    reset_seconds: int


class PartitionKeys:
    """Partition keys: HMAC-SHA256(secret, identity), truncated. `secret` None: the
    $GENAI_RATELIMIT_PARTITION_KEY_SECRET of the environment when set, else a random secret
    of this process (then `per_process` is True: the keys differ between workers)."""

    __slots__ = ("_secret", "per_process")

    def __init__(self, secret: str | bytes | None) -> None:
        if secret is None:
            secret = os.environ.get(PARTITION_KEY_SECRET_ENV) or None
        if secret is not None and not isinstance(secret, (str, bytes)):
            raise TypeError(f"partition_key_secret must be str or bytes, not {type(secret).__name__}")
        if secret is not None and len(secret) == 0:
            raise ValueError("partition_key_secret must not be empty")
        self.per_process = secret is None
        self._secret = _PROCESS_SECRET if secret is None else \
            secret.encode() if isinstance(secret, str) else bytes(secret)

    def __repr__(self) -> str:  # never the secret
        return f"PartitionKeys(per_process={self.per_process})"

    def of(self, identity: str) -> bytes:
        """The partition key of a budget's key identity (16 bytes)."""
        return hmac.digest(self._secret, identity.encode("utf-8", "surrogatepass"),
                           "sha256")[:_PARTITION_KEY_BYTES]


@functools.lru_cache(maxsize=256)  # a budget has a few policy names: formatted once
def _string(text: str) -> str:
    """A Structured Field String: printable ASCII, with " and \\ escaped."""
    if any(not " " <= char <= "~" for char in text):
        raise ValueError(f"a policy name must be printable ASCII, got {text!r}")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _integer(value: int) -> str:
    return str(min(max(0, value), _MAX_INTEGER))


def _byte_sequence(value: bytes) -> str:
    return ":" + base64.b64encode(value).decode("ascii") + ":"


@functools.lru_cache(maxsize=256)
def _policy_item(policy: Policy) -> str:
    """A policy's Item without its partition key (the same on every response)."""
    item = f"{_string(policy.name)};q={_integer(policy.quota)}"
    if policy.unit is not None:
        item += f";qu={_string(policy.unit)}"
    return item + f";w={_integer(max(1, policy.window_seconds))}"


def _pk_parameter(partition_key: bytes | None) -> str:
    return "" if partition_key is None else f";pk={_byte_sequence(partition_key)}"


def policy_field(policies: Sequence[Policy], partition_key: bytes | None) -> str:
    """The RateLimit-Policy field value: one Item per policy."""
    pk = _pk_parameter(partition_key)
    return ", ".join(_policy_item(policy) + pk for policy in policies)


def service_field(limits: Sequence[ServiceLimit], partition_key: bytes | None) -> str:
    """The RateLimit field value: one Item per service limit."""
    pk = _pk_parameter(partition_key)
    return ", ".join(f"{_string(limit.name)};r={_integer(limit.remaining)};"
                     f"t={_integer(limit.reset_seconds)}{pk}" for limit in limits)


def ietf_headers(policies: Sequence[Policy], limits: Sequence[ServiceLimit],
                 partition_key: bytes | None) -> list[tuple[str, str]]:
    """("ratelimit-policy", ...) and, when a service limit is known, ("ratelimit", ...):
    lowercase names, as the middleware compares them. A field with no item is left out (the
    draft's Lists are non-empty)."""
    headers: list[tuple[str, str]] = []
    if policies:
        headers.append(("ratelimit-policy", policy_field(policies, partition_key)))
    if limits:
        headers.append(("ratelimit", service_field(limits, partition_key)))
    return headers
