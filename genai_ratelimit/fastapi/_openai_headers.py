"""Rate-limit headers and 429/503 bodies in the shapes OpenAI's and Anthropic's APIs use, in
one place. No FastAPI here: plain values in,
header pairs and JSON-able dicts out.

What the headers mean on a sliding log (OpenAI documents them for its own limiter):

- `x-ratelimit-limit-<resource>`: the limit of that resource's tightest window (the one with
  the fewest units remaining; ties: the shorter window), in requests or tokens.
- `x-ratelimit-remaining-<resource>`: the units left in that window after this request's
  reservation (tokens: the estimate, before the response's usage corrects it).
- `x-ratelimit-reset-<resource>`, a duration such as `1s`, `6m0s`, `120ms`:
  - on an allowed request, the time until that window is back to its full limit if nothing
    else is asked: the request was just logged in it, the newest entry, so every unit in the
    window has left it exactly one window length from now. That is the window's length.
  - on a 429, the time until this request can be retried (Retry-After), for both resources:
    no retry can pass before then, whichever resource refused.
- `retry-after-ms` beside `Retry-After` on a 429: the exact wait in milliseconds, as the
  script computed it (Retry-After is that wait rounded up to whole seconds), and
  `x-should-retry: true|false` (false when the wait is longer than a client should sleep).

Anthropic's family says the same with its names: `anthropic-ratelimit-<resource>-limit`,
`-remaining` and `-reset`, the reset as an RFC 3339 time (now + the duration above).

The 429 body keeps the contract's `detail` and adds OpenAI's `error` object, which the
`openai` SDK turns into `RateLimitError` (its message, `.type`, `.code`):

    {"detail": "Rate limit exceeded",
     "error": {"message": "Rate limit reached on tokens per min (TPM): Limit 10000, Requested
               4200. Please try again in 17s.", "type": "tokens", "param": null,
               "code": "rate_limit_exceeded"}}
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from ..provider_limits import format_duration

__all__ = [
    "ResourceHeaders",
    "format_duration",
    "rate_limit_headers",
    "retry_headers",
    "anthropic_headers",
    "family_headers",
    "error_body",
    "refusal_message",
    "rfc3339",
    "ERROR_FORMATS",
    "ErrorFormat",
    "too_large_error_body",
    "limit_name",
]

Resource = Literal["requests", "tokens"]
ErrorFormat = Literal["openai", "anthropic", "plain"]
ERROR_FORMATS: tuple[ErrorFormat, ...] = ("openai", "anthropic", "plain")

# OpenAI's names of a limit, by resource and window length.
_LIMIT_NAMES: Mapping[tuple[str, int], str] = {
    ("requests", 60): "requests per min (RPM)",
    ("requests", 86_400): "requests per day (RPD)",
    ("tokens", 60): "tokens per min (TPM)",
    ("tokens", 86_400): "tokens per day (TPD)",
}


def limit_name(resource: Resource, window_seconds: int) -> str:
    """"tokens per min (TPM)", "requests per day (RPD)", else e.g. "tokens per 3600s"."""
    return _LIMIT_NAMES.get((resource, window_seconds), f"{resource} per {window_seconds}s")


@dataclass(frozen=True, slots=True)
class ResourceHeaders:
    """What the x-ratelimit-*-<resource> headers say about one resource. `remaining` and
    `reset_ms` are None when unknown (a request refused before Redis was asked): the header
    is then left out."""

    resource: Resource
    limit: int
    remaining: int | None
    reset_ms: int | None


def rate_limit_headers(*resources: ResourceHeaders) -> list[tuple[str, str]]:
    """x-ratelimit-limit-<r>, x-ratelimit-remaining-<r>, x-ratelimit-reset-<r> per resource."""
    headers: list[tuple[str, str]] = []
    for state in resources:
        limit_name, remaining_name, reset_name = _openai_names(state.resource)
        headers.append((limit_name, str(state.limit)))
        if state.remaining is not None:
            headers.append((remaining_name, str(max(0, state.remaining))))
        if state.reset_ms is not None:
            headers.append((reset_name, format_duration(state.reset_ms)))
    return headers


@functools.lru_cache(maxsize=16)
def _openai_names(resource: str) -> tuple[str, str, str]:
    """OpenAI's three header names of a resource."""
    return (f"x-ratelimit-limit-{resource}", f"x-ratelimit-remaining-{resource}",
            f"x-ratelimit-reset-{resource}")


def retry_headers(retry_after_s: int, retry_after_ms: int, max_client_wait_seconds: float
                  ) -> list[tuple[str, str]]:
    """Retry-After (whole seconds, rounded up: the contract's), retry-after-ms (the exact
    wait, which both the openai and the anthropic SDK prefer) and x-should-retry: "false" when
    the wait is longer than a client should sleep (both SDKs then give up at once and raise),
    "true" otherwise."""
    should_retry = retry_after_ms <= max_client_wait_seconds * 1000
    return [("Retry-After", str(retry_after_s)), ("retry-after-ms", str(max(0, retry_after_ms))),
            ("x-should-retry", "true" if should_retry else "false")]


def rfc3339(unix_ms: int) -> str:
    """A unix time in ms as Anthropic's reset headers write it: "2026-12-03T10:45:00Z"
    (rounded up to the second: never earlier than the moment it names)."""
    seconds = -(-unix_ms // 1000)
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def anthropic_headers(now_ms: int, *resources: ResourceHeaders) -> list[tuple[str, str]]:
    """anthropic-ratelimit-<r>-limit, -remaining, -reset (an RFC 3339 time: now + reset_ms)
    per resource; the same states as rate_limit_headers, Anthropic's names."""
    headers: list[tuple[str, str]] = []
    for state in resources:
        headers.append((f"anthropic-ratelimit-{state.resource}-limit", str(state.limit)))
        if state.remaining is not None:
            headers.append((f"anthropic-ratelimit-{state.resource}-remaining", str(max(0, state.remaining))))
        if state.reset_ms is not None:
            headers.append((f"anthropic-ratelimit-{state.resource}-reset", rfc3339(now_ms + state.reset_ms)))
    return headers


def family_headers(error_format: ErrorFormat, now_ms: int, *resources: ResourceHeaders
                   ) -> list[tuple[str, str]]:
    """The provider family of headers that goes with an error format: OpenAI's for "openai",
    Anthropic's for "anthropic", none for "plain" (the contract's X-RateLimit-* only)."""
    if error_format == "openai":
        return rate_limit_headers(*resources)
    if error_format == "anthropic":
        return anthropic_headers(now_ms, *resources)
    return []


def refusal_message(resource: Resource, window_seconds: int, limit: int, requested: int,
                    retry_after_ms: int) -> str:
    """What a 429 says: the window, the limit and when to retry."""
    return (f"Rate limit reached on {limit_name(resource, window_seconds)}: Limit {limit}, "
            f"Requested {requested}. Please try again in {format_duration(retry_after_ms)}.")


UNAVAILABLE_MESSAGE = ("The rate limiter is temporarily unavailable, so this request could not be "
                       "admitted. Please try again in 1s.")


def error_body(error_format: ErrorFormat, status: int, detail: str, message: str,
               resource: Resource | None = None) -> dict[str, Any]:
    """The body of a 429 (rate limited) or a 503 (the limiter cannot decide) in one format.
    Every format keeps the contract's `detail`:
    - "plain": {"detail": ...}
    - "openai": + {"error": {"message", "type", "param", "code"}}; 429: type the resource
      ("requests"/"tokens", as OpenAI sends it), code "rate_limit_exceeded"; 503: type
      "server_error", code "service_unavailable".
    - "anthropic": + {"type": "error", "error": {"type", "message"}}; 429: "rate_limit_error";
      503: "overloaded_error" (what Anthropic answers when it cannot take the request now)."""
    body: dict[str, Any] = {"detail": detail}
    if error_format == "openai":
        if status == 429:
            body["error"] = _error(message, resource or "requests", "rate_limit_exceeded")
        else:
            body["error"] = _error(message, "server_error", "service_unavailable")
    elif error_format == "anthropic":
        kind = "rate_limit_error" if status == 429 else "overloaded_error"
        body["type"] = "error"
        body["error"] = {"type": kind, "message": message}
    return body


def _error(message: str, type_: str, code: str) -> dict[str, Any]:
    return {"message": message, "type": type_, "param": None, "code": code}


def too_large_error_body(error_format: ErrorFormat, resource: Resource, window_seconds: int,
                         limit: int, requested: int) -> dict[str, Any]:
    """The body of a 429 for a request that can never fit: its estimate is above the limit
    itself, so no wait helps (no Retry-After is sent with it)."""
    message = (f"Request too large on {limit_name(resource, window_seconds)}: Limit {limit}, "
               f"Requested {requested}. This request can never fit the budget: reduce the "
               "prompt or max_tokens.")
    detail = (f"Request too large: {requested} {resource} requested, the limit is {limit} "
              f"{resource} per {_per(window_seconds)}; it can never be allowed")
    return error_body(error_format, 429, detail, message, resource)


def _per(window_seconds: int) -> str:
    return {60: "minute", 86_400: "day"}.get(window_seconds, f"{window_seconds} s")
