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

pytestmark = [
    pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async tests "
                                   "drive on hiredis 1.x"),
]

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
    assert refused.headers["X-RateLimit-Limit"] == "3"
    assert refused.headers["X-RateLimit-Window"] == "concurrent"
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
    options = client_options(make_limiter)
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
    options = client_options(make_limiter)
    with TestClient(token_app(dependency), **options) as client:
        assert client.post("/json", json=chat_body(report=17),
                           headers={"X-Test-Auth": user_id}).status_code == 200
        if recording.is_async:
            client.portal.call(native.aclose)  # type: ignore[union-attr]
    assert recording.calls == [("acquire", 2), ("reserve", None), ("reconcile", False), ("release", None)]
    assert redis_client.keys(f"ratelimit:{user_id}:*") == []  # nothing in the enforced keys


# --- stable keys: a budget's keys never depend on its numbers -----------------------------------


def budget(per_minute: int) -> dict[str, dict[str, int]]:
    return {"free": {"per_minute": per_minute, "per_day": 1_000}}


def test_a_budget_of_its_own_counts_in_the_contracts_plain_keys(
        limiter: Any, client_for: Callable[..., Any], redis_client: redis.Redis, user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, tier_limits=budget(7)))
    assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    assert sorted(redis_client.keys(f"*{user_id}*")) == [f"ratelimit:{user_id}:60".encode(),
                                                          f"ratelimit:{user_id}:86400".encode()]


def test_a_budget_edit_keeps_every_count_and_the_lower_budget_retries_after_the_kth_oldest(
        limiter: Any, client_for: Callable[..., Any], redis_client: redis.Redis, user_id: str) -> None:
    """Two app instances on one Redis (a rolling deploy): per_minute 10 and per_minute 5."""
    now = server_now_ms(redis_client)
    # Eight requests of the last minute, 55 s to 20 s old, logged by the old instance.
    from test_fastapi import prefill
    prefill(redis_client, f"ratelimit:{user_id}:60", [now - (55 - 5 * i) * 1000 for i in range(8)])
    raised = client_for(RateLimit(limiter=limiter, tier_limits=budget(10)))
    lowered = client_for(RateLimit(limiter=limiter, tier_limits=budget(5)))
    # The raised budget sees the eight: two more fit.
    response = raised.get("/dict", headers=as_user(user_id))
    assert (response.status_code, response.headers["X-RateLimit-Remaining"]) == (200, "1")
    # The lowered one sees the nine: refused until five of them have left the minute, i.e.
    # until the fifth oldest (logged 35 s ago) is 60 s old: about 25 s.
    refused = lowered.get("/dict", headers=as_user(user_id))
    assert refused.status_code == 429
    wait_ms = int(refused.headers["retry-after-ms"])
    elapsed = server_now_ms(redis_client) - now
    assert 25_000 - elapsed - 50 <= wait_ms <= 25_000
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 9


def test_two_budgets_on_the_same_keys_are_refused_naming_both_and_the_fix(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    from genai_ratelimit.fastapi import RateLimitConfigError, check_app

    five = RateLimit(limiter=limiter, tier_limits=budget(5))
    seven = RateLimit(limiter=limiter, tier_limits=budget(7))
    app = build_app(five, extra=[seven])
    with pytest.raises(RateLimitConfigError) as raised:
        check_app(app)
    message = str(raised.value)
    assert repr(five) in message and repr(seven) in message
    assert "namespace=" in message and "route_limits=" in message
    # Without the lifespan, the middleware refuses it when the app starts
    # (test_fastapi_startup.py); without either, the first request finds it (a 500, logged),
    # nothing is counted.
    from fastapi.testclient import TestClient

    with pytest.raises(RateLimitConfigError):
        with TestClient(app):
            pass
    bare = build_app(five, headers_middleware=False, extra=[seven])
    with TestClient(bare, raise_server_exceptions=False) as plain:
        assert plain.get("/dict", headers=as_user(user_id)).status_code == 500
        assert plain.get("/dict", headers=as_user(user_id)).status_code == 500
    assert redis_client.keys(f"*{user_id}*") == []
    # A namespace for one of them, or the same budget: accepted.
    check_app(build_app(five, extra=[RateLimit(limiter=limiter, tier_limits=budget(7),
                                               namespace="seven")]))
    check_app(build_app(five, extra=[RateLimit(limiter=limiter, tier_limits=budget(5))]))
    # A shadow budget counts apart: never a collision with the enforced one.
    check_app(build_app(five, extra=[RateLimit(limiter=limiter, tier_limits=budget(3),
                                               mode="shadow")]))


# --- fail at start-up ---------------------------------------------------------------------------


@pytest.mark.parametrize("build", [
    lambda limiter: RateLimit(limiter=limiter, tier_limits={"free": {"per_minute": 2**53}}),
    lambda limiter: TokenRateLimit(limiter=limiter, token_limits={"free": {"per_minute": 2**64}}),
    lambda limiter: RateLimit(limiter=limiter, route_limits={"per_minute": 2**53}),
    lambda limiter: RateLimit(limiter=limiter, max_in_flight={"free": 2**53}),
    lambda limiter: RateLimit(limiter=limiter, lease_seconds=2**53),
])
def test_a_budget_above_max_limit_fails_when_the_dependency_is_built(limiter: Any, build: Any) -> None:
    with pytest.raises(ValueError, match="at most 9007199254740991"):
        build(limiter)


def test_an_upstream_above_max_limit_fails_when_built() -> None:
    from genai_ratelimit.fastapi import Upstream

    with pytest.raises(ValueError, match="at most 9007199254740991"):
        Upstream("openai", per_minute=2**53)


def test_a_tiers_file_above_max_limit_fails_at_start_up(tmp_path: Any, monkeypatch: Any,
                                                        limiter: Any) -> None:
    path = tmp_path / "tiers.json"
    path.write_text('{"free": {"per_minute": 18446744073709551616}}')
    monkeypatch.setenv("GENAI_RATELIMIT_TIERS", str(path))
    with pytest.raises(ValueError, match="at most 9007199254740991"):
        RateLimit(limiter=limiter)


# --- windows ------------------------------------------------------------------------------------


def test_a_tier_may_have_any_of_four_windows(
        limiter: Any, client_for: Callable[..., Any], redis_client: redis.Redis, user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, tier_limits={
        "free": {"per_second": 2, "per_hour": 50}}))
    responses = [client.get("/dict", headers=as_user(user_id)) for _ in range(3)]
    assert [r.status_code for r in responses] == [200, 200, 429]
    assert responses[1].headers["X-RateLimit-Window"] == "second"
    assert responses[2].headers["X-RateLimit-Window"] == "second"
    assert sorted(redis_client.keys(f"*{user_id}*")) == [f"ratelimit:{user_id}:1".encode(),
                                                          f"ratelimit:{user_id}:3600".encode()]


@pytest.mark.parametrize(("tiers", "message"), [
    ({"free": {}}, "give at least one of per_second, per_minute, per_hour, per_day"),
    ({"free": {"per_hour": 5, "per_minute": 10}}, "per_hour (5) is smaller than per_minute (10)"),
    ({"free": {"per_second": 1, "tokens_per_day": 5, "tokens_per_hour": 10}},
     "tokens_per_day (5) is smaller than tokens_per_hour (10)"),
])
def test_a_tier_without_a_window_or_with_a_window_out_of_order_fails(
        limiter: Any, tiers: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RateLimit(limiter=limiter, tier_limits=tiers)


def test_token_twins_of_every_window(limiter: Any) -> None:
    dependency = TokenRateLimit(limiter=limiter, token_limits={
        "free": {"per_second": 100, "per_hour": 5_000}})
    assert dependency.token_windows_of("free") == ((100, 1), (5_000, 3_600))


# --- ping and rate_limit_lifespan ---------------------------------------------------------------


def test_ping_answers_a_round_trip_on_both_limiters(make_limiter: Any, redis_url: str) -> None:
    from helpers_async import run_async

    native = make_limiter.native(redis_url)
    if inspect.iscoroutinefunction(native.ping):
        async def twice() -> tuple[float, float]:
            try:
                return await native.ping(), await native.ping()
            finally:
                await native.aclose()
        seconds = run_async(twice(), make_limiter.loop_factory)
    else:
        seconds = (native.ping(), native.ping())
    assert all(0 < s < 5 for s in seconds)


def test_ping_raises_when_redis_cannot_answer(make_limiter: Any, closed_port_url: str) -> None:
    from genai_ratelimit import RateLimiterUnavailable
    from helpers_async import run_async

    native = make_limiter.native(closed_port_url, connect_timeout=0.5, socket_timeout=0.5)
    with pytest.raises(RateLimiterUnavailable):
        if inspect.iscoroutinefunction(native.ping):
            async def once() -> None:
                try:
                    await native.ping()
                finally:
                    await native.aclose()
            run_async(once(), make_limiter.loop_factory)
        else:
            native.ping()


def lifespan_app(dependency: RateLimit, *, middleware: bool = True) -> Any:
    from fastapi import Depends, FastAPI

    from genai_ratelimit.fastapi import RateLimitHeadersMiddleware, rate_limit_lifespan

    app = FastAPI(lifespan=rate_limit_lifespan)
    if middleware:
        app.add_middleware(RateLimitHeadersMiddleware)

    @app.get("/dict", dependencies=[Depends(dependency)])
    async def as_dict() -> dict[str, str]:
        return {"answer": "ok"}

    return app


def test_the_lifespan_pings_checks_and_closes_the_limiter(
        make_limiter: Any, redis_url: str, user_id: str) -> None:
    from fastapi.testclient import TestClient

    native = make_limiter.native(redis_url)
    options = client_options(make_limiter)
    with TestClient(lifespan_app(RateLimit(limiter=native, max_in_flight={"free": 2})),
                    **options) as client:
        assert client.get("/dict", headers={"X-Test-Auth": user_id}).status_code == 200
    assert native.closed


def test_a_missing_middleware_stops_the_app_at_start_up(make_limiter: Any, redis_url: str) -> None:
    from fastapi.testclient import TestClient

    from genai_ratelimit.fastapi import RateLimitConfigError

    native = make_limiter.native(redis_url)
    app = lifespan_app(RateLimit(limiter=native, max_in_flight={"free": 2}), middleware=False)
    with pytest.raises(RateLimitConfigError, match="max_in_flight needs RateLimitHeadersMiddleware"):
        with TestClient(app):
            pass


def test_an_unreachable_redis_stops_the_app_at_start_up(make_limiter: Any, closed_port_url: str) -> None:
    from fastapi.testclient import TestClient

    from genai_ratelimit import RateLimiterUnavailable

    native = make_limiter.native(closed_port_url, connect_timeout=0.5, socket_timeout=0.5)
    options = client_options(make_limiter)
    with pytest.raises(RateLimiterUnavailable):
        with TestClient(lifespan_app(RateLimit(limiter=native)), **options):
            pass


# --- the 429 owns its response ------------------------------------------------------------------


def envelope_app(dependency: RateLimit, **middleware_options: Any) -> Any:
    """An app with the usual uniform error envelope: an app-wide HTTPException handler that
    keeps neither the headers nor the body."""
    from fastapi import HTTPException
    from fastapi.responses import JSONResponse

    app = build_app(dependency)
    if middleware_options:
        from genai_ratelimit.fastapi import RateLimitHeadersMiddleware

        app.user_middleware = [m for m in app.user_middleware if m.cls is not RateLimitHeadersMiddleware]
        app.add_middleware(RateLimitHeadersMiddleware, **middleware_options)

    @app.exception_handler(HTTPException)
    async def uniform(request: Any, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"ok": False, "message": str(exc.detail)}, status_code=418)

    return app


def test_the_429_keeps_its_status_headers_and_body_whatever_the_apps_handler(
        make_limiter: Any, redis_url: str, user_id: str) -> None:
    from fastapi.testclient import TestClient

    native = make_limiter.native(redis_url)
    options = client_options(make_limiter)
    with TestClient(envelope_app(RateLimit(limiter=native, tier_limits=budget(1))), **options) as client:
        assert client.get("/dict", headers=as_user(user_id)).status_code == 200
        refused = client.get("/stream", headers=as_user(user_id))
        if inspect.iscoroutinefunction(native.ping):
            client.portal.call(native.aclose)  # type: ignore[union-attr]
    assert refused.status_code == 429
    for name in ("Retry-After", "retry-after-ms", "x-should-retry", "X-RateLimit-Limit",
                 "X-RateLimit-Remaining", "X-RateLimit-Window", "x-ratelimit-remaining-requests"):
        assert name in refused.headers, name
    body = refused.json()
    assert body["detail"] == "Rate limit exceeded" and body["error"]["code"] == "rate_limit_exceeded"


def test_an_error_envelope_hook_shapes_the_body_and_keeps_the_headers(
        make_limiter: Any, redis_url: str, user_id: str) -> None:
    from fastapi.testclient import TestClient

    native = make_limiter.native(redis_url)
    options = client_options(make_limiter)
    app = envelope_app(RateLimit(limiter=native, tier_limits=budget(1)),
                       error_envelope=lambda status, body: {"ok": False, "status": status,
                                                            "message": body["error"]["message"]})
    with TestClient(app, **options) as client:
        assert client.get("/dict", headers=as_user(user_id)).status_code == 200
        refused = client.get("/dict", headers=as_user(user_id))
        if inspect.iscoroutinefunction(native.ping):
            client.portal.call(native.aclose)  # type: ignore[union-attr]
    assert refused.status_code == 429 and "Retry-After" in refused.headers
    body = refused.json()
    assert (body["ok"], body["status"]) == (False, 429) and "Limit 1" in body["message"]
