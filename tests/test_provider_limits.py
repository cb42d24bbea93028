"""genai_ratelimit.provider_limits: a provider response's status and headers read into
numbers, with no I/O (a table: headers in, ProviderLimits out). Garbage, negatives, 2^64, a
reset in the past or days away, a time in another zone: each read as the module's doc says,
never an exception."""

from __future__ import annotations

from typing import Any

import pytest

from genai_ratelimit import ProviderLimits, read_provider_limits
from genai_ratelimit.provider_limits import format_duration, parse_duration

NOW = 1_796_450_000.0  # 2026-12-05T05:53:20Z: the time the RFC 3339 rows are read at
MAX = 2**53 - 1


@pytest.mark.parametrize(("text", "ms"), [
    ("6m0s", 360_000), ("1s", 1000), ("120ms", 120), ("1h2m3.5s", 3_723_500), ("0s", 0),
    ("0.5s", 500), ("1.5", 1500), ("20", 20_000), ("250us", 0.25), ("1m", 60_000),
    (" 2s ", 2000), ("", None), ("-1s", None), ("abc", None), ("5x", None), ("1s2", None),
    ("s", None), ("1h 2m", None), ("9" * 80, None),
])
def test_a_go_duration_is_read_in_milliseconds(text: str, ms: float | None) -> None:
    assert parse_duration(text) == ms


@pytest.mark.parametrize("ms", [0, 1, 120, 999, 1000, 1500, 59_999, 360_000, 3_723_500, 86_400_000])
def test_what_format_duration_writes_parse_duration_reads_back(ms: int) -> None:
    assert parse_duration(format_duration(ms)) == ms


def read(status: Any, headers: Any, **options: Any) -> ProviderLimits:
    return read_provider_limits(status, headers, now=NOW, **options)


@pytest.mark.parametrize(("status", "headers", "expected"), [
    # OpenAI's family: limit, remaining, reset as a duration.
    (200, {"x-ratelimit-limit-requests": "20", "x-ratelimit-remaining-requests": "7",
           "x-ratelimit-reset-requests": "6s", "x-ratelimit-limit-tokens": "40000",
           "x-ratelimit-remaining-tokens": "39000", "x-ratelimit-reset-tokens": "1.5s"},
     {"requests_limit": 20, "requests_remaining": 7, "requests_reset_ms": 6000,
      "tokens_limit": 40000, "tokens_remaining": 39000, "tokens_reset_ms": 1500}),
    # Header names in any case; bytes pairs as ASGI and httpx carry them.
    (200, [(b"X-RateLimit-Remaining-Requests", b"3"), (b"X-RateLimit-Reset-Requests", b"120ms")],
     {"requests_remaining": 3, "requests_reset_ms": 120}),
    # A reset further away than the bound is the bound; a duration in h/m/s with a fraction.
    (200, {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1h2m3.5s"},
     {"requests_remaining": 0, "requests_reset_ms": 60_000}),
    (200, {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1h2m3.5s"},
     {"requests_remaining": 0, "requests_reset_ms": 3_723_500, "max_close_seconds": 86_400}),
    # Garbage, a sign, a fraction: ignored.
    (200, {"x-ratelimit-remaining-requests": "lots", "x-ratelimit-reset-requests": "soon"}, {}),
    (200, {"x-ratelimit-remaining-requests": "-5", "x-ratelimit-reset-requests": "-6s"}, {}),
    (200, {"x-ratelimit-remaining-requests": "2.5", "x-ratelimit-reset-requests": "1s"},
     {"requests_reset_ms": 1000}),
    # 2^64 is read as 2^53 - 1; a remaining above the limit is the limit.
    (200, {"x-ratelimit-remaining-tokens": str(2**64), "x-ratelimit-reset-tokens": "1s"},
     {"tokens_remaining": MAX, "tokens_reset_ms": 1000}),
    (200, {"x-ratelimit-limit-requests": "20", "x-ratelimit-remaining-requests": "5000",
           "x-ratelimit-reset-requests": "1s"},
     {"requests_limit": 20, "requests_remaining": 20, "requests_reset_ms": 1000}),
    # A reset of 0 (what remained is back): the remaining is kept, the reset is not.
    (200, {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "0s"},
     {"requests_remaining": 0}),
    # Anthropic's family: RFC 3339 resets in any offset, the tightest token kind.
    (200, {"anthropic-ratelimit-requests-limit": "50", "anthropic-ratelimit-requests-remaining": "49",
           "anthropic-ratelimit-requests-reset": "2026-12-05T11:23:30+05:30",
           "anthropic-ratelimit-input-tokens-remaining": "900",
           "anthropic-ratelimit-input-tokens-reset": "2026-12-05T05:53:40Z",
           "anthropic-ratelimit-output-tokens-remaining": "80",
           "anthropic-ratelimit-output-tokens-reset": "2026-12-05T05:53:25.5Z"},
     {"requests_limit": 50, "requests_remaining": 49, "requests_reset_ms": 10_000,
      "tokens_remaining": 80, "tokens_reset_ms": 5500}),
    # A reset in the past, days away, without a zone, or garbage.
    (200, {"anthropic-ratelimit-tokens-remaining": "5",
           "anthropic-ratelimit-tokens-reset": "2026-12-05T05:53:00Z"}, {"tokens_remaining": 5}),
    (200, {"anthropic-ratelimit-tokens-remaining": "5",
           "anthropic-ratelimit-tokens-reset": "2026-12-08T21:53:20-08:00"},
     {"tokens_remaining": 5, "tokens_reset_ms": 60_000}),
    (200, {"anthropic-ratelimit-tokens-remaining": "5",
           "anthropic-ratelimit-tokens-reset": "2026-12-05T05:53:30"}, {"tokens_remaining": 5}),
    (200, {"anthropic-ratelimit-tokens-remaining": "5",
           "anthropic-ratelimit-tokens-reset": "yesterday"}, {"tokens_remaining": 5}),
    # A 429: retry-after in seconds, as an HTTP-date, retry-after-ms first, bounded.
    (429, {"retry-after": "5"}, {"close_ms": 5000}),
    (429, {"retry-after": "5", "retry-after-ms": "4321"}, {"close_ms": 4321}),
    (429, {"retry-after": "Sat, 05 Dec 2026 05:53:30 GMT"}, {"close_ms": 10_000}),
    (429, {"retry-after": "999999"}, {"close_ms": 60_000}),
    (429, {"retry-after": "999999"}, {"close_ms": 10_000, "max_close_seconds": 10}),
    # Anthropic's 529 overloaded closes too; a 503 does not.
    (529, {"retry-after": "2"}, {"close_ms": 2000}),
    (503, {"retry-after": "2"}, {}),
    # A 429 without a usable retry-after: until the exhausted resource's reset, else 1 s.
    (429, {"retry-after": "-3", "x-ratelimit-remaining-requests": "0",
           "x-ratelimit-reset-requests": "7s"},
     {"close_ms": 7000, "requests_remaining": 0, "requests_reset_ms": 7000}),
    (429, {"retry-after": "garbage"}, {"close_ms": 1000}),
    (429, {}, {"close_ms": 1000}),
    # A status that is not an int, headers that are not pairs.
    ("429", {"retry-after": "5"}, {"status": None}),
    (True, {"retry-after": "5"}, {"status": None}),
    (200, [("only-a-name",), None, (1, 2), ("x-ratelimit-remaining-requests", "1"),
           ("x-ratelimit-reset-requests", "1s")],
     {"requests_remaining": 1, "requests_reset_ms": 1000}),
    (200, {"x-ratelimit-remaining-requests": "9" * 100, "x-ratelimit-reset-requests": "1s"},
     {"requests_reset_ms": 1000}),
])
def test_a_response_is_read_bounded_and_never_raises(status: Any, headers: Any,
                                                     expected: dict[str, Any]) -> None:
    options = {"max_close_seconds": expected.pop("max_close_seconds")} \
        if "max_close_seconds" in expected else {}
    limits = read(status, headers, **options)
    want = {"status": status if isinstance(status, int) and not isinstance(status, bool) else None,
            **expected}
    got = {name: getattr(limits, name) for name in ProviderLimits.__dataclass_fields__
           if getattr(limits, name) not in (None, 0) or name in want}
    got.pop("closed_until_ms", None)
    assert got == want


def test_only_what_says_something_is_sent() -> None:
    assert not read(200, {}).says_anything
    assert not read(200, {"x-ratelimit-remaining-requests": "3"}).says_anything  # no reset
    assert not read(200, {"x-ratelimit-limit-requests": "0"}).says_anything
    limits = read(200, {"x-ratelimit-remaining-requests": "3", "x-ratelimit-reset-requests": "2s",
                        "x-ratelimit-remaining-tokens": "9", "x-ratelimit-limit-tokens": "90"})
    assert limits.says_anything
    assert limits.observation() == (3, 2000, -1, -1, -1, 90, -1, 60_000)
    assert read(429, {"retry-after": "5"}).observation(10) == (-1, -1, -1, -1, -1, -1, 5000, 10_000)


@pytest.mark.parametrize(("value", "error"), [
    (0, ValueError), (-1, ValueError), (float("nan"), ValueError), (86_401, ValueError),
    (float("inf"), ValueError), ("60", TypeError), (True, TypeError), (None, TypeError),
])
def test_a_bad_bound_is_refused(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="max_close_seconds"):
        read(429, {"retry-after": "5"}, max_close_seconds=value)
