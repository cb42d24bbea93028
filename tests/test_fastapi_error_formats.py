"""error_format, the provider header families, retry-after-ms, x-should-retry and the
throttled warning of an unavailable Redis, through FastAPI's TestClient on every limiter
kind (blocking and async). The real SDKs against a real uvicorn are in
test_fastapi_sdk_retries.py."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
import redis

from genai_ratelimit import RateLimiter
from genai_ratelimit.fastapi import RateLimit, TokenRateLimit
from helpers_async import LimiterFactory
from test_fastapi import (  # noqa: F401 (fixtures: _built_in_tiers, client_for, closed_port_url, limiter)
    AnyLimiter,
    TestClient,
    _built_in_tiers,
    as_user,
    client_for,
    closed_port_url,
    limiter,
    prefill,
    server_now_ms,
)

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async tests "
                                   "drive on hiredis 1.x"),
]

FREE_MINUTE = 5
OPENAI_FAMILY = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests")
ANTHROPIC_FAMILY = ("anthropic-ratelimit-requests-limit", "anthropic-ratelimit-requests-remaining",
                    "anthropic-ratelimit-requests-reset")


def refused(client: TestClient, user_id: str) -> Any:
    """Spends the free minute budget, then returns the refused sixth response."""
    for _ in range(FREE_MINUTE):
        assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    response = client.get("/dict", headers=as_user(user_id))
    assert response.status_code == 429
    return response


def parse_rfc3339(text: str) -> float:
    assert text.endswith("Z") and len(text) == 20, text
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


# --- the option is checked when the dependency is built ------------------------------------


@pytest.mark.parametrize("kind", [RateLimit, TokenRateLimit])
@pytest.mark.parametrize("value", ["OpenAI", "json", "", None, 1])
def test_an_unknown_error_format_is_refused_naming_the_option(
        closed_port_url: str, kind: type[RateLimit], value: Any) -> None:
    with RateLimiter(closed_port_url) as limiter:
        with pytest.raises(ValueError, match="error_format"):
            kind(limiter, error_format=value)


@pytest.mark.parametrize("option", ["max_client_wait_seconds", "unavailable_log_interval"])
@pytest.mark.parametrize("value, error", [(-1, ValueError), (math.nan, ValueError), ("60", TypeError),
                                          (True, TypeError)])
def test_a_wait_or_interval_that_is_not_a_number_of_seconds_is_refused(
        closed_port_url: str, option: str, value: Any, error: type[Exception]) -> None:
    with RateLimiter(closed_port_url) as limiter:
        with pytest.raises(error, match=option):
            RateLimit(limiter, **{option: value})


def test_log_user_ids_must_be_a_bool(closed_port_url: str) -> None:
    with RateLimiter(closed_port_url) as limiter:
        with pytest.raises(TypeError, match="log_user_ids"):
            RateLimit(limiter, log_user_ids="no")  # type: ignore[arg-type]


# --- the 429 in each format -------------------------------------------------------------------


def test_the_default_format_is_openai_with_the_contracts_detail(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    response = refused(client_for(RateLimit(limiter=limiter)), user_id)
    body = response.json()
    exact = int(response.headers["retry-after-ms"])
    assert body == {"detail": "Rate limit exceeded", "error": {
        "message": "Rate limit reached on requests per min (RPM): Limit 5, Requested 1. "
                   f"Please try again in {body['error']['message'].rsplit(' ', 1)[1]}",
        "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
    assert body["error"]["message"].endswith(f"{exact / 1000:.3f}".rstrip("0").rstrip(".") + "s.")
    assert response.headers["x-ratelimit-limit-requests"] == "5"
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert not any(name in response.headers for name in ANTHROPIC_FAMILY)


def test_the_anthropic_format_has_anthropics_error_object_and_headers(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    response = refused(client_for(RateLimit(limiter=limiter, error_format="anthropic")), user_id)
    body = response.json()
    assert body["type"] == "error" and body["detail"] == "Rate limit exceeded"
    assert body["error"]["type"] == "rate_limit_error"
    assert body["error"]["message"].startswith(
        "Rate limit reached on requests per min (RPM): Limit 5, Requested 1. Please try again in ")
    headers = response.headers
    assert (headers["anthropic-ratelimit-requests-limit"],
            headers["anthropic-ratelimit-requests-remaining"]) == ("5", "0")
    # The reset is when the refused request can pass: now + the exact wait, to the second.
    reset = parse_rfc3339(headers["anthropic-ratelimit-requests-reset"])
    expected = (server_now_ms(redis_client) + int(headers["retry-after-ms"])) / 1000
    assert abs(reset - expected) <= 1.5
    assert not any(name in headers for name in OPENAI_FAMILY)


def test_the_plain_format_is_the_contracts_body_and_headers_only(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    response = refused(client_for(RateLimit(limiter=limiter, error_format="plain")), user_id)
    assert response.json() == {"detail": "Rate limit exceeded"}
    assert not any(name in response.headers for name in OPENAI_FAMILY + ANTHROPIC_FAMILY)
    assert response.headers["x-should-retry"] == "true"


@pytest.mark.parametrize("error_format", ["openai", "anthropic", "plain"])
def test_retry_after_ms_is_the_exact_wait_and_retry_after_rounds_it_up(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis, error_format: str) -> None:
    # The oldest entry entered the window 58.5 s ago (server clock): it leaves in 1.5 s.
    now = server_now_ms(redis_client)
    prefill(redis_client, f"ratelimit:{user_id}:60", [now - 58_500] + [now - 1000] * 4)
    client = client_for(RateLimit(limiter=limiter, error_format=error_format))
    response = client.get("/dict", headers=as_user(user_id))
    assert response.status_code == 429
    exact = int(response.headers["retry-after-ms"])
    assert 1000 < exact <= 1500  # not rounded up to a second
    assert response.headers["Retry-After"] == str(math.ceil(exact / 1000)) == "2"


def test_rate_limit_decides_in_the_keys_check_windows_reads(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    # RateLimit decides through check_windows: its script and keys, read back here.
    client = client_for(RateLimit(limiter=limiter))
    remaining = [client.get("/dict", headers=as_user(user_id)).headers["X-RateLimit-Remaining"]
                 for _ in range(3)]
    assert remaining == ["4", "3", "2"]
    assert sorted(redis_client.keys("*")) == [f"ratelimit:{user_id}:60".encode(),
                                              f"ratelimit:{user_id}:86400".encode()]
    with RateLimiter(limiter.url) as direct:
        assert direct.check_windows(user_id, [(5, 60), (100, 86_400)]) == (True, 1, 0, 60)
    assert client.get("/dict", headers=as_user(user_id)).headers["X-RateLimit-Remaining"] == "0"


# --- headers of an allowed response ------------------------------------------------------------


@pytest.mark.parametrize("route", ["/dict", "/json", "/stream"])
def test_allowed_responses_carry_the_openai_family_with_a_reset(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str, route: str) -> None:
    client = client_for(RateLimit(limiter=limiter))
    response = client.get(route, headers=as_user(user_id))
    assert response.status_code == 200
    headers = response.headers
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"],
            headers["x-ratelimit-reset-requests"]) == ("5", "4", "1m0s")
    assert response.headers["X-RateLimit-Remaining"] == "4"  # the contract's, unchanged


@pytest.mark.parametrize("route", ["/dict", "/json", "/stream"])
def test_allowed_responses_carry_the_anthropic_family_with_an_rfc3339_reset(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str, route: str,
        redis_client: redis.Redis) -> None:
    client = client_for(RateLimit(limiter=limiter, error_format="anthropic"))
    response = client.get(route, headers=as_user(user_id))
    assert response.status_code == 200
    headers = response.headers
    assert (headers["anthropic-ratelimit-requests-limit"],
            headers["anthropic-ratelimit-requests-remaining"]) == ("5", "4")
    reset = parse_rfc3339(headers["anthropic-ratelimit-requests-reset"])
    assert abs(reset - (server_now_ms(redis_client) / 1000 + 60)) <= 1.5
    assert not any(name in headers for name in OPENAI_FAMILY)


def test_token_rate_limit_sends_anthropics_token_headers_in_the_anthropic_format(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    client = client_for(TokenRateLimit(limiter=limiter, error_format="anthropic",
                                       estimate=lambda request: 10))
    response = client.get("/dict", headers=as_user(user_id))
    assert response.status_code == 200
    for resource in ("requests", "tokens"):
        for field in ("limit", "remaining", "reset"):
            assert f"anthropic-ratelimit-{resource}-{field}" in response.headers
    assert not any(name.startswith("x-ratelimit-") and name.endswith(("-requests", "-tokens"))
                   for name in response.headers)


@pytest.mark.parametrize("error_format", ["openai", "anthropic", "plain"])
def test_a_token_routes_bad_input_is_answered_in_its_format_on_every_limiter(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        error_format: str) -> None:
    # Issue 30 item 9 (tests/test_fastapi_bad_input.py has the rest): 400 / 422, never a 500.
    client = client_for(TokenRateLimit(limiter=limiter, error_format=error_format))
    not_an_object = client.request("GET", "/dict", content=b"[1, 2]", headers=as_user(user_id))
    infinite = client.request("GET", "/dict", content=b'{"max_tokens": 1e400}',
                              headers={**as_user(user_id), "content-type": "application/json"})
    assert (not_an_object.status_code, infinite.status_code) == (400, 422)
    message = "The request body must be a JSON object, got an array."
    expected = {"openai": {"detail": message, "error": {"message": message, "type": "invalid_request_error",
                                                        "param": None, "code": None}},
                "anthropic": {"detail": message, "type": "error",
                              "error": {"type": "invalid_request_error", "message": message}},
                "plain": {"detail": message}}[error_format]
    assert not_an_object.json() == expected
    (error,) = infinite.json()["detail"]
    assert (error["loc"], error["input"]) == (["body", "max_tokens"], "inf")
    assert client.get("/dict", headers=as_user(user_id)).status_code == 200  # no body: fine


# --- x-should-retry ---------------------------------------------------------------------------


def test_a_day_window_refusal_says_do_not_retry(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    now = server_now_ms(redis_client)
    prefill(redis_client, f"ratelimit:{user_id}:86400", [now - 3_600_000] * 100)
    response = client_for(RateLimit(limiter=limiter)).get("/dict", headers=as_user(user_id))
    assert response.status_code == 429
    assert response.headers["X-RateLimit-Window"] == "day"
    assert response.headers["x-should-retry"] == "false"
    assert int(response.headers["retry-after-ms"]) > 300_000


def test_the_retry_threshold_is_configurable(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    now = server_now_ms(redis_client)
    prefill(redis_client, f"ratelimit:{user_id}:60", [now - 30_000] * 5)  # frees in ~30 s
    strict = client_for(RateLimit(limiter=limiter, max_client_wait_seconds=10))
    assert strict.get("/dict", headers=as_user(user_id)).headers["x-should-retry"] == "false"
    patient = client_for(RateLimit(limiter=limiter, max_client_wait_seconds=40))
    assert patient.get("/dict", headers=as_user(user_id)).headers["x-should-retry"] == "true"


# --- the 503 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("error_format, expected", [
    ("openai", {"type": "server_error", "code": "service_unavailable"}),
    ("anthropic", {"type": "overloaded_error"}),
    ("plain", None),
])
def test_the_503_has_the_formats_body(
        make_limiter: LimiterFactory, closed_port_url: str, client_for: Callable[..., TestClient],
        user_id: str, error_format: str, expected: dict[str, str] | None) -> None:
    client = client_for(RateLimit(limiter=make_limiter.native(closed_port_url), error_format=error_format))
    response = client.get("/dict", headers=as_user(user_id))
    assert (response.status_code, response.headers["Retry-After"]) == (503, "1")
    assert response.headers["x-should-retry"] == "true"
    body = response.json()
    assert body["detail"] == "Rate limiter unavailable"
    if expected is None:
        assert body == {"detail": "Rate limiter unavailable"}
    else:
        assert expected.items() <= body["error"].items()
        assert "temporarily unavailable" in body["error"]["message"]


# --- the warning of an unavailable Redis --------------------------------------------------------


def unavailable_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "genai_ratelimit" and "rate limiter unavailable" in r.getMessage()]


@pytest.mark.parametrize("on_unavailable, status", [("deny", 503), ("allow", 200)])
def test_an_outage_logs_one_warning_per_interval_not_one_per_request(
        make_limiter: LimiterFactory, closed_port_url: str, client_for: Callable[..., TestClient],
        user_id: str, caplog: pytest.LogCaptureFixture, on_unavailable: str, status: int) -> None:
    client = client_for(RateLimit(limiter=make_limiter.native(closed_port_url),
                                  on_unavailable=on_unavailable, unavailable_log_interval=60))
    with caplog.at_level(logging.WARNING, logger="genai_ratelimit"):
        for _ in range(20):
            assert client.get("/dict", headers=as_user(user_id)).status_code == status
    lines = unavailable_lines(caplog)
    assert len(lines) == 1, lines
    assert "1 request(s)" in lines[0] and user_id in lines[0]


def test_the_next_warning_counts_the_requests_since_the_last_one(
        make_limiter: LimiterFactory, closed_port_url: str, client_for: Callable[..., TestClient],
        user_id: str, caplog: pytest.LogCaptureFixture) -> None:
    client = client_for(RateLimit(limiter=make_limiter.native(closed_port_url),
                                  unavailable_log_interval=0.3))
    with caplog.at_level(logging.WARNING, logger="genai_ratelimit"):
        assert client.get("/dict", headers=as_user(user_id)).status_code == 503
        assert len(unavailable_lines(caplog)) == 1
        # Requests until the interval has passed and the second line is logged (bounded).
        sent, deadline = 0, time.monotonic() + 10
        while len(unavailable_lines(caplog)) < 2 and time.monotonic() < deadline:
            assert client.get("/dict", headers=as_user(user_id)).status_code == 503
            sent += 1
    lines = unavailable_lines(caplog)
    assert len(lines) == 2, lines
    assert sent > 1  # the line covers every request since the first, not one
    assert f"{sent} request(s) answered 503" in lines[1]


def test_user_ids_can_be_kept_out_of_the_log(
        make_limiter: LimiterFactory, closed_port_url: str, client_for: Callable[..., TestClient],
        user_id: str, caplog: pytest.LogCaptureFixture) -> None:
    client = client_for(RateLimit(limiter=make_limiter.native(closed_port_url), log_user_ids=False,
                                  unavailable_log_interval=0))
    with caplog.at_level(logging.WARNING, logger="genai_ratelimit"):
        for _ in range(3):
            assert client.get("/dict", headers=as_user(user_id)).status_code == 503
    assert len(unavailable_lines(caplog)) == 3
    assert user_id not in caplog.text
