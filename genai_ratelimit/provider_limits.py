"""What an upstream provider says about its own limits, read from one response: no I/O.

OpenAI sends `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, the reset as a Go
duration ("1s", "6m0s", "120ms", "1h2m3.5s"); Anthropic sends
`anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}`,
the reset as an RFC 3339 time in any offset; both send `retry-after` (seconds or an
HTTP-date; OpenAI also `retry-after-ms`) on a 429, and Anthropic answers 529 when it is
overloaded. `read_provider_limits(status, headers)` turns that into numbers the shared cap
can use (`RateLimiter.observe_upstream` records them, lua/lib/upstream.lua counts
admissions against them). The provider's words are bounded here, once:

- a number that is not a plain decimal integer (garbage, a sign, a fraction) is ignored; one
  above 2^53 - 1 (2^64, say) is read as 2^53 - 1; a remaining above the provider's own limit
  is read as that limit; a limit of 0 is ignored;
- a reset that is not in the future (zero, negative, a time in the past) is ignored: what
  remained has come back;
- a reset or a closure further away than `max_close_seconds` (the operator's bound) is read
  as that bound: a header that lies, or a clock that is days off, closes an upstream for at
  most that long, and can never raise the operator's cap (the cap admits against the smaller
  of its own count and the provider's);
- a 429 or 529 without a usable retry-after closes the upstream until the reset of the
  resource that ran out, else for one second.

The Go duration grammar is written here once: `format_duration` (the OpenAI-style headers
this package sends) and `parse_duration` (the ones it reads)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from email.utils import parsedate_to_datetime

__all__ = [
    "CLOSING_STATUSES",
    "DEFAULT_MAX_CLOSE_SECONDS",
    "ProviderLimits",
    "format_duration",
    "parse_duration",
    "read_provider_limits",
    "validate_max_close_seconds",
]

# The statuses that close an upstream: too many requests, and Anthropic's overloaded.
CLOSING_STATUSES = frozenset({429, 529})
DEFAULT_MAX_CLOSE_SECONDS = 60.0
MAX_CLOSE_SECONDS = 86_400.0  # the longest bound an operator may set (csrc RL_MAX_UPSTREAM_MS)
_MAX_COUNT = 2**53 - 1  # exact in the scripts' doubles (csrc RL_MAX_LIMIT)
_UNHINTED_CLOSE_MS = 1000  # a 429 that says nothing about when to come back
_MAX_HEADER_TEXT = 64  # a value longer than any sane number, duration or date is garbage

_INTEGER = re.compile(r"\s*([0-9]+)\s*")
_DECIMAL = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_MS = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "μs": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4,
            "h": 3.6e6}


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
    text = f"{seconds}.{millis:03d}".rstrip("0") + "s" if millis else f"{seconds}s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    if minutes:
        return f"{minutes}m{text}"
    return text


def parse_duration(text: str) -> float | None:
    """A Go duration ("6m0s", "1h2m3.5s", "120ms", "0s") in milliseconds, or a plain
    number of seconds ("1.5"); None for anything else (a sign, garbage, an empty text)."""
    text = text.strip()
    if not text or len(text) > _MAX_HEADER_TEXT:
        return None
    plain = _DECIMAL.fullmatch(text)
    if plain:
        return float(plain.group(1)) * 1000
    total, at = 0.0, 0
    for part in _DURATION_PART.finditer(text):
        if part.start() != at:
            return None
        total += float(part.group(1)) * _UNIT_MS[part.group(2)]
        at = part.end()
    return total if at == len(text) else None


def validate_max_close_seconds(value: object) -> float:
    """The operator's bound on a closure or a reset: a number of seconds in (0, 86400]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"max_close_seconds must be a number of seconds, not "
                        f"{type(value).__name__}")
    if not 0 < value <= MAX_CLOSE_SECONDS:  # NaN fails this too
        raise ValueError(f"max_close_seconds must be above 0 and at most {MAX_CLOSE_SECONDS:g} "
                         f"(one day), got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class ProviderLimits:
    """One response's word on the provider's limits, bounded (see the module's doc). None
    where it said nothing usable. Tokens: the tightest of Anthropic's tokens, input-tokens
    and output-tokens. `close_ms`: a 429/529's wait (ms); `closed_until_ms`: after
    `observe_upstream` recorded it, until when the upstream is closed for every replica
    (unix ms, 0 when open)."""

    status: int | None = None
    requests_limit: int | None = None
    requests_remaining: int | None = None
    requests_reset_ms: int | None = None
    tokens_limit: int | None = None
    tokens_remaining: int | None = None
    tokens_reset_ms: int | None = None
    close_ms: int | None = None
    closed_until_ms: int = 0

    @property
    def says_anything(self) -> bool:
        """Whether there is anything to record (else observe_upstream sends nothing, but
        for a 2xx: the provider's answer ends a cold start)."""
        return (self.close_ms is not None or self.requests_limit is not None
                or self.tokens_limit is not None
                or (self.requests_remaining is not None and self.requests_reset_ms is not None)
                or (self.tokens_remaining is not None and self.tokens_reset_ms is not None))

    def observation(self, max_close_seconds: float = DEFAULT_MAX_CLOSE_SECONDS
                    ) -> tuple[int, int, int, int, int, int, int, int]:
        """The C layer's form (lua/observe_upstream.lua's ARGV[2..9]): per resource the
        remaining, the ms until its reset (a remaining is sent only with its reset) and the
        limit; the ms closed for; the bound in ms. -1 where unknown."""
        def known(value: int | None) -> int:
            return -1 if value is None else value
        requests = self.requests_reset_ms is not None and self.requests_remaining is not None
        tokens = self.tokens_reset_ms is not None and self.tokens_remaining is not None
        return (known(self.requests_remaining) if requests else -1,
                known(self.requests_reset_ms) if requests else -1,
                known(self.requests_limit),
                known(self.tokens_remaining) if tokens else -1,
                known(self.tokens_reset_ms) if tokens else -1,
                known(self.tokens_limit),
                known(self.close_ms),
                math.ceil(validate_max_close_seconds(max_close_seconds) * 1000))


def _lowered(headers: Mapping[str, str] | Iterable[tuple[str | bytes, str | bytes]]
             ) -> dict[str, str]:
    """Header names lower-cased, the first value of each kept; bytes decoded as Latin-1 (as
    HTTP carries them); anything that is not a name and a value is skipped."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    found: dict[str, str] = {}
    for item in items:
        try:
            name, value = item
        except (TypeError, ValueError):
            continue
        if isinstance(name, bytes):
            name = name.decode("latin-1")
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if isinstance(name, str) and isinstance(value, str):
            found.setdefault(name.lower(), value)
    return found


def _count(text: str | None) -> int | None:
    if text is None or len(text) > _MAX_HEADER_TEXT:
        return None
    match = _INTEGER.fullmatch(text)
    return min(int(match.group(1)), _MAX_COUNT) if match else None


def _rfc3339_in_ms(text: str | None, now: float) -> float | None:
    """An RFC 3339 time with an offset ("2026-12-05T10:00:00Z", "...+05:30") as ms from
    now; None for garbage or a time without an offset (whose zone nobody knows)."""
    if text is None or len(text) > _MAX_HEADER_TEXT:
        return None
    text = text.strip()
    if text[-1:] in ("Z", "z"):
        text = text[:-1] + "+00:00"
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None or moment.utcoffset() is None:
        return None
    try:
        return (moment.timestamp() - now) * 1000
    except (OverflowError, OSError, ValueError):
        return None


def _retry_after_ms(fields: Mapping[str, str], now: float) -> float | None:
    """retry-after-ms, else retry-after (seconds, or an HTTP-date), in ms from now."""
    exact = fields.get("retry-after-ms")
    if exact is not None and len(exact) <= _MAX_HEADER_TEXT:
        match = _DECIMAL.fullmatch(exact)
        if match:
            return float(match.group(1))
    text = fields.get("retry-after")
    if text is None or len(text) > _MAX_HEADER_TEXT:
        return None
    match = _DECIMAL.fullmatch(text)
    if match:
        return float(match.group(1)) * 1000
    try:
        moment = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if moment is None or moment.tzinfo is None:
        return None
    return (moment.timestamp() - now) * 1000


def _bounded(wait_ms: float | None, bound_ms: int) -> int | None:
    """A wait in whole ms (rounded up), at most the bound; None when not in the future."""
    if wait_ms is None or not math.isfinite(wait_ms) or wait_ms <= 0:
        return None
    return min(math.ceil(wait_ms), bound_ms)


def _resource(fields: Mapping[str, str], names: tuple[str, str, str], now: float,
              bound_ms: int, rfc3339: bool) -> tuple[int | None, int | None, int | None]:
    """(limit, remaining, reset in ms) of one resource, each None when not said."""
    limit = _count(fields.get(names[0])) or None  # a limit of 0 says nothing usable
    remaining = _count(fields.get(names[1]))
    if remaining is not None and limit is not None:
        remaining = min(remaining, limit)
    reset_text = fields.get(names[2])
    if reset_text is None:
        reset = None
    elif rfc3339:
        reset = _bounded(_rfc3339_in_ms(reset_text, now), bound_ms)
    else:
        reset = _bounded(parse_duration(reset_text), bound_ms)
    return limit, remaining, reset


def _tightest(*views: tuple[int | None, int | None, int | None]
              ) -> tuple[int | None, int | None, int | None]:
    """Of several (limit, remaining, reset) views, the one with the fewest remaining that
    has a reset (else the first that says anything)."""
    usable = [v for v in views if v[1] is not None and v[2] is not None]
    if usable:
        return min(usable, key=lambda v: (v[1], -(v[2] or 0)))
    return next((v for v in views if any(x is not None for x in v)), (None, None, None))


def read_provider_limits(status: object,
                         headers: Mapping[str, str] | Iterable[tuple[str | bytes, str | bytes]],
                         *, max_close_seconds: float = DEFAULT_MAX_CLOSE_SECONDS,
                         now: float | None = None) -> ProviderLimits:
    """One response's status and headers as ProviderLimits, bounded (see the module's
    doc). Never raises for what the provider sent: garbage is ignored. `now`: unix seconds
    (the default: this machine's clock), against which RFC 3339 and HTTP-date times are
    read. `max_close_seconds` raises TypeError/ValueError when it is not in (0, 86400]."""
    bound_ms = math.ceil(validate_max_close_seconds(max_close_seconds) * 1000)
    now = time.time() if now is None else now
    fields = _lowered(headers)
    code = status if isinstance(status, int) and not isinstance(status, bool) else None
    openai_requests = _resource(fields, ("x-ratelimit-limit-requests",
                                         "x-ratelimit-remaining-requests",
                                         "x-ratelimit-reset-requests"), now, bound_ms, False)
    openai_tokens = _resource(fields, ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
                                       "x-ratelimit-reset-tokens"), now, bound_ms, False)
    anthropic = {kind: _resource(fields, (f"anthropic-ratelimit-{kind}-limit",
                                          f"anthropic-ratelimit-{kind}-remaining",
                                          f"anthropic-ratelimit-{kind}-reset"), now, bound_ms, True)
                 for kind in ("requests", "tokens", "input-tokens", "output-tokens")}
    requests = _tightest(openai_requests, anthropic["requests"])
    tokens = _tightest(openai_tokens, anthropic["tokens"], anthropic["input-tokens"],
                       anthropic["output-tokens"])
    close_ms = None
    if code in CLOSING_STATUSES:
        close_ms = _bounded(_retry_after_ms(fields, now), bound_ms)
        if close_ms is None:  # until the exhausted resource comes back, else a second
            spent = [reset for _, remaining, reset in (requests, tokens)
                     if remaining == 0 and reset is not None]
            close_ms = max(spent) if spent else min(_UNHINTED_CLOSE_MS, bound_ms)
    return ProviderLimits(status=code, requests_limit=requests[0],
                          requests_remaining=requests[1], requests_reset_ms=requests[2],
                          tokens_limit=tokens[0], tokens_remaining=tokens[1],
                          tokens_reset_ms=tokens[2], close_ms=close_ms)


def observe_plan(name: str, status: object,
                 headers: Mapping[str, str] | Iterable[tuple[str | bytes, str | bytes]],
                 max_close_seconds: float) -> Generator[tuple[str, tuple[object, ...],
                                                              dict[str, object]], int,
                                                        ProviderLimits]:
    """observe_upstream for both limiters (reservation.py's plan protocol): reads the
    response, yields the one C call when there is something to record, and returns the
    ProviderLimits with the upstream's closed-until time."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"an upstream's name must be a non-empty str, got {name!r}")
    limits = read_provider_limits(status, headers, max_close_seconds=max_close_seconds)
    # A success that says nothing is still the provider's answer: a cap that follows it
    # (Scope.probe) learns that it was heard from, and its cold start ends.
    if not limits.says_anything and not (isinstance(status, int) and 200 <= status < 300):
        return limits
    closed_until_ms = yield ("observe_upstream", (name, limits.observation(max_close_seconds)), {})
    return replace(limits, closed_until_ms=closed_until_ms)
