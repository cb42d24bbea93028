"""The FastAPI package's shape and start-up behaviour (issue 22): real signatures from one
options object, the concurrency 429's Retry-After, shadow as an observer, stable keys,
start-up checks. Over Starlette's TestClient on a real Redis, once per limiter kind."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import redis

from genai_ratelimit.fastapi import RateLimit, TokenRateLimit
from genai_ratelimit.fastapi._options import Options, SharedOptions
from test_fastapi import (  # noqa: F401 (fixtures)
    _built_in_tiers,
    as_user,
    build_app,
    client_for,
    client_options,
    closed_port_url,
    limiter,
    server_now_ms,
)

SHARED = [field.name for field in dataclasses.fields(Options)]


# --- one options object, real signatures ------------------------------------------------------


def test_the_options_object_and_its_typed_dict_list_the_same_keywords() -> None:
    assert SHARED == list(SharedOptions.__annotations__)


@pytest.mark.parametrize("cls", [RateLimit, TokenRateLimit])
def test_the_classes_show_their_real_signature(cls: type[RateLimit]) -> None:
    parameters = inspect.signature(cls).parameters
    assert list(parameters)[:5] == ["limiter", "tier_limits", "identify", "on_unavailable", "namespace"]
    for name in SHARED:
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert parameters[name].default == getattr(Options(), name)
    assert not any(p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
                   for p in parameters.values())
    if cls is TokenRateLimit:
        assert {"token_limits", "estimate", "default_max_tokens"} <= set(parameters)


def test_an_instance_still_shows_the_dependency_signature_fastapi_reads(limiter: Any) -> None:
    assert list(inspect.signature(RateLimit(limiter=limiter)).parameters) == ["request", "response"]
    assert list(inspect.signature(TokenRateLimit(limiter=limiter)).parameters) == ["request", "response"]


def test_an_unknown_keyword_is_a_type_error_naming_it(limiter: Any) -> None:
    with pytest.raises(TypeError, match="max_inflight"):
        RateLimit(limiter=limiter, max_inflight={"free": 1})  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="max_inflight"):
        TokenRateLimit(limiter=limiter, max_inflight={"free": 1})  # type: ignore[call-arg]


# --- the concurrency 429's Retry-After ---------------------------------------------------------


@pytest.mark.parametrize("value", [-1, 61, float("nan"), float("inf")])
def test_in_flight_retry_after_is_checked_at_start_up(limiter: Any, value: float) -> None:
    with pytest.raises(ValueError, match="in_flight_retry_after"):
        RateLimit(limiter=limiter, max_in_flight={"free": 1}, in_flight_retry_after=value)


@pytest.mark.parametrize(("setting", "expected"), [(0.25, ("250", "1")), (5, ("5000", "5")),
                                                   (60, ("30000", "30"))])
def test_a_concurrency_429_announces_in_flight_retry_after_never_past_the_soonest_expiry(
        limiter: Any, client_for: Callable[..., Any], redis_client: redis.Redis, user_id: str,
        setting: float, expected: tuple[str, str]) -> None:
    client = client_for(RateLimit(limiter=limiter, max_in_flight={"free": 1},
                                  in_flight_retry_after=setting))
    # One slot held by another request, its lease expiring in 30 s.
    expiry = server_now_ms(redis_client) + 30_000
    redis_client.zadd(f"ratelimit:{user_id}:leases", {"other": expiry})
    response = client.get("/dict", headers=as_user(user_id))
    assert response.status_code == 429
    wait_ms, wait_s = response.headers["retry-after-ms"], response.headers["Retry-After"]
    if setting == 60:  # the expiry (30 s, minus the time the request took) comes first
        assert 29_000 <= int(wait_ms) <= 30_000 and wait_s == "30"
    else:
        assert (wait_ms, wait_s) == expected
    assert response.headers["x-should-retry"] == "true"
