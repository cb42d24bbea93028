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


# --- shadow is an observer ----------------------------------------------------------------------

STRICT = {"free": {"per_minute": 3, "per_day": 100}}


def pair(limiter: Any, order: str, **shadow_options: Any) -> tuple[RateLimit, RateLimit, list[RateLimit]]:
    """An enforced dependency (free: 5 a minute) and a shadow one (3 a minute) in `order`."""
    enforced = RateLimit(limiter=limiter, **shadow_options.pop("enforced", {}))
    shadow = RateLimit(limiter=limiter, tier_limits=STRICT, mode="shadow", namespace="rollout",
                       **shadow_options)
    return enforced, shadow, [enforced, shadow] if order == "enforced-first" else [shadow, enforced]


@pytest.mark.parametrize("order", ["enforced-first", "shadow-first"])
def test_a_shadow_budget_never_changes_the_enforced_headers_in_either_order(
        limiter: Any, client_for: Callable[..., Any], redis_client: redis.Redis, user_id: str,
        order: str) -> None:
    enforced, shadow, dependencies = pair(limiter, order)
    client = client_for(dependencies[0], extra=dependencies[1:])
    responses = [client.get("/stream", headers=as_user(user_id)) for _ in range(6)]
    assert [r.status_code for r in responses] == [200] * 5 + [429]
    # The enforced numbers, request after request: never the shadow budget's 3.
    assert [r.headers["X-RateLimit-Limit"] for r in responses] == ["5"] * 6
    assert [r.headers["X-RateLimit-Remaining"] for r in responses] == ["4", "3", "2", "1", "0", "0"]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in responses[:5]] == ["4", "3", "2", "1", "0"]
    # The shadow verdict only in X-RateLimit-Shadow*.
    assert [r.headers.get("X-RateLimit-Shadow") for r in responses[:5]] == [None] * 3 + ["would-refuse"] * 2
    assert [r.headers["X-RateLimit-Shadow-Limit"] for r in responses[:5]] == ["3"] * 5
    assert [r.headers["X-RateLimit-Shadow-Remaining"] for r in responses[:5]] == ["2", "1", "0", "0", "0"]
    assert responses[5].json()["detail"] == "Rate limit exceeded"
    # The sixth request: refused by the enforced budget before the shadow one saw it, or seen
    # (and counted as would-refuse) first.
    assert shadow.shadow_count == (2 if order == "enforced-first" else 3)
    # Each budget in its own keys: the shadow one's cannot add to the enforced count.
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 5
    assert redis_client.zcard(f"ratelimit:shadow:ns:rollout:{user_id}:60") == 3


@pytest.mark.parametrize("order", ["enforced-first", "shadow-first"])
def test_a_shadow_cap_holds_no_enforced_slot_and_never_refuses(
        limiter: Any, client_for: Callable[..., Any], redis_client: redis.Redis, user_id: str,
        order: str) -> None:
    enforced, shadow, dependencies = pair(limiter, order, max_in_flight={"free": 1},
                                          enforced={"max_in_flight": {"free": 2}})
    client = client_for(dependencies[0], extra=dependencies[1:])
    enforced_key = f"ratelimit:{user_id}:leases"
    shadow_key = f"ratelimit:shadow:ns:rollout:{user_id}:leases"
    expiry = server_now_ms(redis_client) + 30_000
    # One other request in flight, seen by both caps: the enforced cap (2) has room, the
    # shadow cap (1) would refuse, and says so without taking anything from the enforced one.
    redis_client.zadd(enforced_key, {"other": expiry})
    redis_client.zadd(shadow_key, {"other": expiry})
    response = client.get("/dict", headers=as_user(user_id))
    assert response.status_code == 200
    assert response.headers["X-RateLimit-Shadow"] == "would-refuse"
    assert response.headers["X-RateLimit-Shadow-Window"] == "concurrent"
    assert "Retry-After" not in response.headers
    assert (redis_client.zcard(enforced_key), redis_client.zcard(shadow_key)) == (1, 1)
    # The enforced cap alone refuses: two others in flight.
    redis_client.zadd(enforced_key, {"other-2": expiry})
    refused = client.get("/dict", headers=as_user(user_id))
    assert refused.status_code == 429 and refused.headers["X-RateLimit-Limit"] == "2"


def test_two_caps_on_one_route_hold_one_slot_of_their_key(
        limiter: Any, client_for: Callable[..., Any], redis_client: redis.Redis, user_id: str) -> None:
    """Caps 3 and 5 on one identity's key: a request holds one slot (not two), so three
    requests in flight fit the cap of 3; a fourth is refused by it."""
    three = RateLimit(limiter=limiter, max_in_flight={"free": 3})
    five = RateLimit(limiter=limiter, max_in_flight={"free": 5})
    client = client_for(five, extra=[three])
    key = f"ratelimit:{user_id}:leases"
    expiry = server_now_ms(redis_client) + 30_000
    redis_client.zadd(key, {"other-1": expiry, "other-2": expiry})
    allowed = client.get("/dict", headers=as_user(user_id))
    assert allowed.status_code == 200  # 3 in flight with it: one slot, within both caps
    redis_client.zadd(key, {"other-3": expiry})
    refused = client.get("/dict", headers=as_user(user_id))
    assert refused.status_code == 429
    assert (refused.headers["X-RateLimit-Limit"], refused.headers["X-RateLimit-Window"]) == ("3", "concurrent")
    assert redis_client.zcard(key) == 3  # the refused request's slot is given back


# --- one round trip in, one out (issue 25 item 3) -----------------------------------------------


class Recording:
    """A limiter that records the calls the dependency and the middleware make."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.is_async = inspect.iscoroutinefunction(inner.check_windows)
        self.calls: list[tuple[str, object]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def reserve(self, user_id: str, windows: Any = (), *, in_flight: Any = None, **kwargs: Any) -> Any:
        self.calls.append(("reserve", in_flight))
        return self.inner.reserve(user_id, windows, in_flight=in_flight, **kwargs)

    def reconcile(self, reservation: Any, actual: int, *, release: bool = False) -> Any:
        self.calls.append(("reconcile", release))
        return self.inner.reconcile(reservation, actual, release=release)

    def acquire(self, *args: Any) -> Any:
        self.calls.append(("acquire", args[1]))
        return self.inner.acquire(*args)

    def release(self, lease: Any) -> Any:
        self.calls.append(("release", None))
        return self.inner.release(lease)


@pytest.fixture
def native(make_limiter: Any, redis_url: str) -> Any:
    return make_limiter.native(redis_url)


@pytest.mark.parametrize("route", ["/json", "/stream"])
def test_a_capped_token_request_takes_its_slot_in_the_reserve_and_gives_it_back_in_the_reconcile(
        native: Any, make_limiter: Any, redis_client: redis.Redis, user_id: str, route: str) -> None:
    from fastapi.testclient import TestClient

    from test_fastapi_tokens import build_app as token_app
    from test_fastapi_tokens import chat_body, token_costs

    recording = Recording(native)
    dependency = TokenRateLimit(limiter=recording,  # type: ignore[arg-type]
                                token_limits={"free": {"per_minute": 100, "per_day": 1_000}},
                                max_in_flight={"free": 2})
    options = ({} if make_limiter.loop_factory is None
               else {"backend_options": {"loop_factory": make_limiter.loop_factory}})
    with TestClient(token_app(dependency), **options) as client:
        response = client.post(route, json=chat_body(report=17),
                               headers={"X-Test-Auth": user_id})
        assert response.status_code == 200
        if recording.is_async:
            client.portal.call(native.aclose)  # type: ignore[union-attr]
    # Two round trips: reserve + slot in, reconcile + release out; no acquire, no release.
    assert recording.calls == [("reserve", (2, 300)), ("reconcile", True)]
    assert token_costs(redis_client, user_id) == [17]
    assert redis_client.zcard(f"ratelimit:{user_id}:leases") == 0


def test_a_shadow_token_cap_never_passes_in_flight(
        native: Any, make_limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    from fastapi.testclient import TestClient

    from test_fastapi_tokens import build_app as token_app
    from test_fastapi_tokens import chat_body

    recording = Recording(native)
    dependency = TokenRateLimit(limiter=recording,  # type: ignore[arg-type]
                                token_limits={"free": {"per_minute": 100, "per_day": 1_000}},
                                max_in_flight={"free": 2}, mode="shadow")
    options = ({} if make_limiter.loop_factory is None
               else {"backend_options": {"loop_factory": make_limiter.loop_factory}})
    with TestClient(token_app(dependency), **options) as client:
        assert client.post("/json", json=chat_body(report=17),
                           headers={"X-Test-Auth": user_id}).status_code == 200
        if recording.is_async:
            client.portal.call(native.aclose)  # type: ignore[union-attr]
    assert recording.calls == [("acquire", 2), ("reserve", None), ("reconcile", False), ("release", None)]
    assert redis_client.keys(f"ratelimit:{user_id}:*") == []  # nothing in the enforced keys
