"""RateLimit's max_in_flight through Starlette's TestClient, on a real Redis: the 429 with
X-RateLimit-Window: concurrent, the slot given back after every kind of response, a route
that raises and a window refusal, the tiers file, start-up checks, Redis unavailable. Every
test runs once per limiter kind (tests/conftest.py). What really runs concurrently (streams
held open, disconnects, killed workers, several workers) is in
test_fastapi_in_flight_server.py, over real HTTP."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi import Depends, Request
from fastapi.responses import StreamingResponse

from genai_ratelimit.fastapi import RateLimit, in_flight_lease
from helpers_async import LimiterFactory
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

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async tests "
                                   "drive on hiredis 1.x"),
]

ROUTES = ["/dict", "/json", "/plain", "/stream"]


def leases_key(identity: str) -> str:
    return f"ratelimit:{identity}:leases"


def hold_slots(redis_client: redis.Redis, identity: str, count: int, seconds: int) -> int:
    """Slots taken by other requests of `identity` (leases expiring `seconds` from now);
    returns the soonest expiry."""
    expiry = server_now_ms(redis_client) + seconds * 1000
    redis_client.zadd(leases_key(identity), {f"other-{i}": expiry + i for i in range(count)})
    return expiry


def test_a_tier_without_max_in_flight_takes_no_slot(limiter: Any, client_for: Callable[..., Any],
                                                    redis_client: redis.Redis, user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, max_in_flight={"pro": 2}))
    assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    assert list(redis_client.scan_iter(match="*:leases")) == []


def test_a_request_beyond_max_in_flight_gets_429_concurrent(
        limiter: Any, client_for: Callable[..., Any], redis_client: redis.Redis, user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, max_in_flight={"free": 2}))
    expiry = hold_slots(redis_client, user_id, 2, 30)
    response = client.get("/stream", headers=as_user(user_id))
    assert response.status_code == 429
    assert response.headers["X-RateLimit-Window"] == "concurrent"
    assert response.headers["X-RateLimit-Limit"] == "2"
    assert response.headers["X-RateLimit-Remaining"] == "0"
    # Retry-After: the limiter's hint (5 s while no slot was ever given back on this cap), not
    # the soonest lease's expiry (30 s away here), which is only a bound: a request that ends
    # frees its slot sooner.
    assert expiry - server_now_ms(redis_client) > 28_000
    assert (response.headers["retry-after-ms"], response.headers["Retry-After"]) == ("5000", "5")
    assert response.headers["x-should-retry"] == "true"
    body = response.json()
    assert body["detail"] == "Rate limit exceeded"
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert "concurrent" in body["error"]["message"] and "Limit 2" in body["error"]["message"]
    # Refused for concurrency: not counted in the windows, and no slot taken.
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 0
    assert redis_client.zcard(leases_key(user_id)) == 2


def test_the_concurrency_429_announces_the_limiters_hint_from_the_hold_history(
        limiter: Any, client_for: Callable[..., Any], redis_client: redis.Redis, user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, max_in_flight={"free": 1}))
    hold_slots(redis_client, user_id, 1, 300)
    # Requests on this cap were held 10 s on average; the one in flight started 4 s ago.
    now = server_now_ms(redis_client)
    redis_client.hset(f"{leases_key(user_id)}:stats",
                      mapping={"hold_ms": 10_000, "hold_sq": 10_000 ** 2, "holds": 4,
                               "other-0": now - 4_000})
    response = client.get("/dict", headers=as_user(user_id))
    elapsed = server_now_ms(redis_client) - now
    assert response.status_code == 429
    assert 6_000 - elapsed <= int(response.headers["retry-after-ms"]) <= 6_000
    assert response.headers["Retry-After"] == str(-(-int(response.headers["retry-after-ms"]) // 1000))
    message = response.json()["error"]["message"]
    assert f"please try again in {int(response.headers['retry-after-ms']) / 1000:g}s" in message
    assert "(a slot is free again within 4m5" in message  # the lease's expiry: the bound


def test_a_capped_token_request_refused_by_its_slot_announces_the_same_hint(
        limiter: Any, make_limiter: LimiterFactory, redis_client: redis.Redis, user_id: str) -> None:
    """TokenRateLimit takes its slot in the reserve (reserve(..., in_flight=)): its 429 has the
    hint of the reservation's slot, and the soonest expiry as the message's bound."""
    from fastapi.testclient import TestClient

    from genai_ratelimit.fastapi import TokenRateLimit
    from test_fastapi import client_options
    from test_fastapi_tokens import build_app as token_app
    from test_fastapi_tokens import chat_body

    dependency = TokenRateLimit(limiter=limiter, max_in_flight={"free": 1},
                                token_limits={"free": {"per_minute": 10_000, "per_day": 100_000}})
    hold_slots(redis_client, user_id, 1, 300)
    now = server_now_ms(redis_client)
    redis_client.hset(f"{leases_key(user_id)}:stats",
                      mapping={"hold_ms": 20_000, "hold_sq": 20_000 ** 2, "holds": 4,
                               "other-0": now - 5_000})
    with TestClient(token_app(dependency), **client_options(make_limiter)) as client:
        response = client.post("/json", json=chat_body(report=17), headers={"X-Test-Auth": user_id})
    elapsed = server_now_ms(redis_client) - now
    assert response.status_code == 429 and response.headers["X-RateLimit-Window"] == "concurrent"
    assert 15_000 - elapsed <= int(response.headers["retry-after-ms"]) <= 15_000
    assert "(a slot is free again within 4m5" in response.json()["error"]["message"]


@pytest.mark.parametrize("route", ROUTES)
def test_every_response_type_gives_its_slot_back(route: str, limiter: Any,
                                                 client_for: Callable[..., Any],
                                                 redis_client: redis.Redis, user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, max_in_flight={"free": 1}))
    for remaining in ("4", "3"):
        response = client.get(route, headers=as_user(user_id))
        assert response.status_code == 200, response.text
        assert response.headers["X-RateLimit-Remaining"] == remaining
        assert redis_client.zcard(leases_key(user_id)) == 0


def test_a_route_that_raises_gives_its_slot_back(make_limiter: LimiterFactory, limiter: Any,
                                                 redis_client: redis.Redis, user_id: str) -> None:
    from fastapi.testclient import TestClient

    dependency = RateLimit(limiter=limiter, max_in_flight={"free": 1})
    app = build_app(dependency)

    @app.get("/boom", dependencies=[Depends(dependency)])
    async def boom() -> None:
        raise RuntimeError("the route failed")

    with TestClient(app, raise_server_exceptions=False, **client_options(make_limiter)) as client:
        assert client.get("/boom", headers=as_user(user_id)).status_code == 500
        assert redis_client.zcard(leases_key(user_id)) == 0
        assert client.get("/dict", headers=as_user(user_id)).status_code == 200
        if hasattr(limiter, "aclose"):
            client.portal.call(limiter.aclose)  # type: ignore[union-attr]


def test_a_long_stream_renews_its_lease(make_limiter: LimiterFactory, limiter: Any,
                                        redis_client: redis.Redis, user_id: str) -> None:
    from fastapi.testclient import TestClient

    dependency = RateLimit(limiter=limiter, max_in_flight={"free": 1}, lease_seconds=5)
    app = build_app(dependency)
    seen: list[tuple[float, float]] = []

    @app.get("/long", dependencies=[Depends(dependency)])
    async def long(request: Request) -> StreamingResponse:
        lease = in_flight_lease(request)
        assert lease is not None and lease.allowed and lease.lease_seconds == 5

        async def body() -> Any:
            yield "data: a\n\n"
            before = redis_client.zscore(leases_key(user_id), lease.lease_id)
            renewed = lease.renew(60)
            assert (await renewed if inspect.isawaitable(renewed) else renewed) is True
            seen.append((before, redis_client.zscore(leases_key(user_id), lease.lease_id)))
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    @app.get("/capless")
    async def capless(request: Request) -> dict[str, bool]:
        return {"lease": in_flight_lease(request) is not None}

    with TestClient(app, **client_options(make_limiter)) as client:
        assert client.get("/long", headers=as_user(user_id)).status_code == 200
        assert client.get("/capless").json() == {"lease": False}
        if hasattr(limiter, "aclose"):
            client.portal.call(limiter.aclose)  # type: ignore[union-attr]
    (before, after), = seen
    assert after >= before + 50_000  # 60 s from the renew instead of 5 s from the acquire
    assert redis_client.zcard(leases_key(user_id)) == 0  # and released at the end


def test_a_window_refusal_gives_the_slot_back(limiter: Any, client_for: Callable[..., Any],
                                              redis_client: redis.Redis, user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, max_in_flight={"free": 3}))
    for _ in range(5):
        assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    response = client.get("/dict", headers=as_user(user_id))
    assert (response.status_code, response.headers["X-RateLimit-Window"]) == (429, "minute")
    assert redis_client.zcard(leases_key(user_id)) == 0


def test_two_dependencies_of_one_route_take_one_slot(limiter: Any, client_for: Callable[..., Any],
                                                     redis_client: redis.Redis, user_id: str) -> None:
    first = RateLimit(limiter=limiter, max_in_flight={"free": 1})
    client = client_for(first, extra=[RateLimit(limiter=limiter, max_in_flight={"free": 1})])
    assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    assert redis_client.zcard(leases_key(user_id)) == 0


def test_the_slot_key_follows_the_identity_rules(limiter: Any, client_for: Callable[..., Any],
                                                 redis_client: redis.Redis) -> None:
    """An anonymous client's slots are its address's; a namespace keeps its own."""
    client = client_for(RateLimit(limiter=limiter, max_in_flight={"free": 1}, namespace="images"))
    hold_slots(redis_client, "ns:images:ip:testclient", 1, 30)
    assert client.get("/dict").status_code == 429
    assert client.get("/dict", headers=as_user("ip:testclient")).status_code == 200


def test_without_the_middleware_max_in_flight_is_an_error(
        limiter: Any, client_for: Callable[..., Any], user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, max_in_flight={"free": 1}),
                        headers_middleware=False)
    with pytest.raises(RuntimeError, match="max_in_flight needs RateLimitHeadersMiddleware"):
        client.get("/dict", headers=as_user(user_id))


def test_redis_unavailable_when_taking_a_slot_answers_503(
        make_limiter: LimiterFactory, client_for: Callable[..., Any], closed_port_url: str,
        user_id: str) -> None:
    unreachable = make_limiter.native(closed_port_url, connect_timeout=0.5, socket_timeout=0.5)
    client = client_for(RateLimit(limiter=unreachable, max_in_flight={"free": 1}))
    response = client.get("/dict", headers=as_user(user_id))
    assert (response.status_code, response.headers["Retry-After"]) == (503, "1")
    allowing = RateLimit(limiter=unreachable, max_in_flight={"free": 1}, on_unavailable="allow")
    assert client_for(allowing).get("/dict", headers=as_user(user_id)).status_code == 200
    assert allowing.fail_open_count == 1  # counted once, not once per round trip


# --- configuration ------------------------------------------------------------------------------

@pytest.mark.limiter_kinds("sync", reason="start-up configuration: no limiter call")
def test_the_tiers_file_gives_max_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text("[free]\nper_minute = 5\nper_day = 100\nmax_in_flight = 3\n"
                     "[pro]\nper_minute = 60\nper_day = 5000\n")
    monkeypatch.setenv("GENAI_RATELIMIT_TIERS", str(tiers))
    dependency = RateLimit(max_in_flight={"free": 9, "pro": 20, "unknown": 4})
    assert dependency.max_in_flight == {"free": 3, "pro": 20}  # the file's own cap wins
    assert dependency.namespace is None  # the request budget is the default one: contract keys
    # A cap changes no request budget: the same budget as the file's keeps its keys.
    explicit = RateLimit(tier_limits={"free": {"per_minute": 5, "per_day": 100, "max_in_flight": 2},
                                      "pro": {"per_minute": 60, "per_day": 5000}})
    assert explicit.max_in_flight == {"free": 2}
    assert explicit.tier_limits["free"] == {"per_minute": 5, "per_day": 100}
    assert explicit.namespace is None


@pytest.mark.limiter_kinds("sync", reason="start-up configuration: no limiter call")
@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"max_in_flight": {"free": 0}}, ValueError, r"max_in_flight\['free'\] must be >= 1"),
    ({"max_in_flight": {"free": "3"}}, TypeError, r"max_in_flight\['free'\] must be an int"),
    ({"max_in_flight": [("free", 3)]}, TypeError, "max_in_flight must be a mapping"),
    ({"lease_seconds": 0}, ValueError, "lease_seconds must be >= 1"),
    ({"lease_seconds": 1.5}, TypeError, "lease_seconds must be an int"),
    ({"tier_limits": {"free": {"per_minute": 5, "per_day": 100, "max_in_flight": 0}}},
     ValueError, "max_in_flight must be an integer >= 1"),
])
def test_bad_in_flight_settings_are_refused_at_start_up(kwargs: dict[str, Any],
                                                        error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        RateLimit(**kwargs)


@pytest.mark.limiter_kinds("sync", reason="start-up configuration: no limiter call")
def test_max_in_flight_needs_a_limiter_that_leases() -> None:
    class WindowsOnly:
        def check_windows(self, user_id: str, windows: Any) -> tuple[bool, int, int, int]:
            return True, 1, 0, 60

    with pytest.raises(TypeError, match=r"max_in_flight needs a limiter with acquire\(\)"):
        RateLimit(limiter=WindowsOnly(), max_in_flight={"free": 1})
    RateLimit(limiter=WindowsOnly())  # no cap: no lease needed


def test_shadow_mode_lets_a_request_beyond_max_in_flight_run_without_a_slot(
        limiter: Any, client_for: Callable[..., Any], redis_client: redis.Redis,
        user_id: str) -> None:
    """mode="shadow" never refuses: a request beyond the cap runs, takes no slot (the others'
    are untouched), and is counted and marked as would-refuse for the concurrent window."""
    dependency = RateLimit(limiter=limiter, max_in_flight={"free": 1}, mode="shadow")
    client = client_for(dependency)
    # A shadow cap counts in keys of its own ("shadow:" in front of the identity).
    hold_slots(redis_client, f"shadow:{user_id}", 1, 30)
    response = client.get("/dict", headers=as_user(user_id))
    assert response.status_code == 200
    assert response.headers["X-RateLimit-Shadow"] == "would-refuse"
    assert (response.headers["X-RateLimit-Shadow-Window"], response.headers["X-RateLimit-Shadow-Limit"],
            response.headers["X-RateLimit-Shadow-Remaining"]) == ("concurrent", "1", "0")
    assert "Retry-After" not in response.headers and "X-RateLimit-Limit" not in response.headers
    assert dependency.shadow_count == 1
    assert redis_client.zrange(leases_key(f"shadow:{user_id}"), 0, -1) == [b"other-0"]
    assert redis_client.keys(leases_key(user_id)) == []  # never a real slot
    # The windows decided as usual, in the shadow budget's keys.
    assert redis_client.zcard(f"ratelimit:shadow:{user_id}:60") == 1


def test_enforce_mode_refuses_a_request_beyond_max_in_flight(
        limiter: Any, client_for: Callable[..., Any], redis_client: redis.Redis,
        user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, max_in_flight={"free": 1}))
    hold_slots(redis_client, user_id, 1, 30)
    response = client.get("/dict", headers=as_user(user_id))
    assert (response.status_code, response.headers["X-RateLimit-Window"]) == (429, "concurrent")
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 0
