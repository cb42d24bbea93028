"""Rate-limit headers and 429 bodies in the shapes OpenAI's API uses, in one place (a later
provider's shapes, e.g. Anthropic's, belong beside these). No FastAPI here: plain values in,
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
- `retry-after-ms` beside `Retry-After` on a 429: the same wait in milliseconds (the core
  answers whole seconds, rounded up, so it is a multiple of 1000).

The 429 body keeps the contract's `detail` and adds OpenAI's `error` object, which the
`openai` SDK turns into `RateLimitError` (its message, `.type`, `.code`):

    {"detail": "Rate limit exceeded",
     "error": {"message": "Rate limit reached on tokens per min (TPM): Limit 10000, Requested
               4200. Please try again in 17s.", "type": "tokens", "param": null,
               "code": "rate_limit_exceeded"}}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ResourceHeaders",
    "format_duration",
    "rate_limit_headers",
    "retry_headers",
    "rate_limit_error_body",
    "too_large_error_body",
    "limit_name",
]

Resource = Literal["requests", "tokens"]

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


def format_duration(milliseconds: int) -> str:
    """A duration as OpenAI's headers (and Go's time.Duration) write it: "0s", "120ms",
    "1s", "1.5s", "6m0s", "1h2m3s", "24h0m0s"."""
    if milliseconds <= 0:
        return "0s"
    if milliseconds < 1000:
        return f"{milliseconds}ms"
    hours, rest = divmod(milliseconds, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds, millis = divmod(rest, 1000)
    text = f"{seconds}.{millis:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    if minutes:
        return f"{minutes}m{text}"
    return text


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
        headers.append((f"x-ratelimit-limit-{state.resource}", str(state.limit)))
        if state.remaining is not None:
            headers.append((f"x-ratelimit-remaining-{state.resource}", str(max(0, state.remaining))))
        if state.reset_ms is not None:
            headers.append((f"x-ratelimit-reset-{state.resource}", format_duration(state.reset_ms)))
    return headers


def retry_headers(retry_after_s: int) -> list[tuple[str, str]]:
    """Retry-After (whole seconds, the contract's) and retry-after-ms (OpenAI's, which its SDK
    prefers)."""
    return [("Retry-After", str(retry_after_s)), ("retry-after-ms", str(retry_after_s * 1000))]


def _error(message: str, type_: str, code: str) -> dict[str, Any]:
    return {"message": message, "type": type_, "param": None, "code": code}


def rate_limit_error_body(detail: str, resource: Resource, window_seconds: int, limit: int,
                          requested: int, retry_after_s: int) -> dict[str, Any]:
    """The body of a 429 for a request that would fit later: the contract's `detail` and
    OpenAI's error object (type: the resource, as OpenAI sends it; code: rate_limit_exceeded)."""
    message = (f"Rate limit reached on {limit_name(resource, window_seconds)}: Limit {limit}, "
               f"Requested {requested}. Please try again in {format_duration(retry_after_s * 1000)}.")
    return {"detail": detail, "error": _error(message, resource, "rate_limit_exceeded")}


def too_large_error_body(resource: Resource, window_seconds: int, limit: int,
                         requested: int) -> dict[str, Any]:
    """The body of a 429 for a request that can never fit: its estimate is above the limit
    itself, so no wait helps (no Retry-After is sent with it)."""
    message = (f"Request too large on {limit_name(resource, window_seconds)}: Limit {limit}, "
               f"Requested {requested}. This request can never fit the budget: reduce the "
               "prompt or max_tokens.")
    return {"detail": f"Request too large: {requested} {resource} requested, the limit is {limit} "
                      f"{resource} per {_per(window_seconds)}; it can never be allowed",
            "error": _error(message, resource, "rate_limit_exceeded")}


def _per(window_seconds: int) -> str:
    return {60: "minute", 86_400: "day"}.get(window_seconds, f"{window_seconds} s")
