"""The IETF fields, RateLimit-Policy and RateLimit (draft-ietf-httpapi-ratelimit-headers-10),
through Starlette's TestClient on a real Redis, each parsed back with a Structured Field
parser (the `http-sfv` package): every item's name, q, w, qu, r, t and pk; beside the
contract's X-RateLimit-*, on allowed responses, 429s and shadow would-refuse responses; the
partition key never exposes the user id.

Every test that uses a limiter runs once per limiter kind (tests/conftest.py)."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable
from typing import Any

import http_sfv
import pytest
import redis

from genai_ratelimit.fastapi import RateLimit, TokenRateLimit, key_identity
from genai_ratelimit.fastapi._ietf_headers import PARTITION_KEY_SECRET_ENV, PartitionKeys
from test_fastapi import (  # noqa: F401  (fixtures, by name)
    AnyLimiter,
    TestClient,
    _built_in_tiers,
    as_user,
    client_for,
    limiter,
    prefill,
    server_now_ms,
)

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.not_asan(reason="calls the limiters exactly as test_fastapi_tokens.py does, which runs "
                                "under ASan"),
    pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async tests "
                                   "drive on hiredis 1.x"),
]

SECRET = "s3cret-of-this-app"
TOKENS = {"free": {"per_minute": 100, "per_day": 1_000}}
Items = dict[str, dict[str, Any]]


def parsed(response: Any, field: str) -> Items:
    """The field's List, parsed by http-sfv, as {policy name: parameters}. Fails on anything
    that is not a valid Structured Field List of String items."""
    values = response.headers.get_list(field)
    assert values, f"no {field} field"
    members = http_sfv.List()
    members.parse(", ".join(values).encode("ascii"))
    items: Items = {}
    for member in members:
        assert isinstance(member, http_sfv.Item) and isinstance(member.value, str), member
        assert member.value not in items, f"{member.value} twice"
        items[member.value] = dict(member.params)
    return items


def expected_pk(identity: str, secret: str = SECRET) -> bytes:
    return hmac.new(secret.encode(), identity.encode(), hashlib.sha256).digest()[:16]


@pytest.fixture
def ietf(limiter: AnyLimiter, client_for: Callable[..., TestClient]) -> TestClient:
    return client_for(RateLimit(limiter=limiter, headers="ietf", partition_key_secret=SECRET))


def test_an_allowed_response_carries_both_fields_beside_the_contract_s(ietf: TestClient,
                                                                       user_id: str) -> None:
    response = ietf.get("/dict", headers=as_user(user_id))
    assert response.status_code == 200
    assert (response.headers["X-RateLimit-Limit"], response.headers["X-RateLimit-Remaining"],
            response.headers["X-RateLimit-Window"]) == ("5", "4", "minute")
    pk = expected_pk(user_id)
    assert parsed(response, "RateLimit-Policy") == {
        "requests-minute": {"q": 5, "w": 60, "pk": pk},
        "requests-day": {"q": 100, "w": 86400, "pk": pk},
    }
    assert parsed(response, "RateLimit") == {"requests-minute": {"r": 4, "t": 60, "pk": pk}}


def test_the_service_limit_is_the_window_with_fewest_remaining(
        ietf: TestClient, user_id: str, redis_client: redis.Redis) -> None:
    prefill(redis_client, f"ratelimit:{user_id}:86400", [server_now_ms(redis_client) - 3_600_000] * 98)
    response = ietf.get("/dict", headers=as_user(user_id))
    assert response.headers["X-RateLimit-Window"] == "day"
    assert parsed(response, "RateLimit") == {"requests-day": {"r": 1, "t": 86400, "pk": expected_pk(user_id)}}


def test_a_429_says_no_quota_remains_until_its_retry_after(
        ietf: TestClient, user_id: str, redis_client: redis.Redis) -> None:
    prefill(redis_client, f"ratelimit:{user_id}:60", [server_now_ms(redis_client) - 45_000] * 5)
    response = ietf.get("/dict", headers=as_user(user_id))
    assert response.status_code == 429
    (item,) = parsed(response, "RateLimit").items()
    assert item[0] == "requests-minute" and item[1]["r"] == 0
    assert item[1]["t"] == int(response.headers["Retry-After"])
    assert 13 <= item[1]["t"] <= 15
    assert set(parsed(response, "RateLimit-Policy")) == {"requests-minute", "requests-day"}


@pytest.mark.parametrize("route", ["/json", "/plain", "/stream"])
def test_every_response_type_gets_the_fields_once(ietf: TestClient, user_id: str, route: str) -> None:
    response = ietf.get(route, headers=as_user(user_id, "pro"))
    assert response.status_code == 200
    assert len(response.headers.get_list("RateLimit")) == 1
    assert parsed(response, "RateLimit")["requests-minute"]["r"] == 59
    assert parsed(response, "RateLimit-Policy")["requests-minute"]["q"] == 60


def test_contract_headers_only_by_default(limiter: AnyLimiter, client_for: Callable[..., TestClient],
                                          user_id: str) -> None:
    response = client_for(RateLimit(limiter=limiter)).get("/dict", headers=as_user(user_id))
    assert response.headers["X-RateLimit-Remaining"] == "4"
    assert "RateLimit" not in response.headers and "RateLimit-Policy" not in response.headers


def test_both_means_the_same_as_ietf(limiter: AnyLimiter, client_for: Callable[..., TestClient],
                                     user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, headers="both", partition_key_secret=SECRET))
    response = client.get("/dict", headers=as_user(user_id))
    assert response.headers["X-RateLimit-Remaining"] == "4"
    assert parsed(response, "RateLimit") == {"requests-minute": {"r": 4, "t": 60, "pk": expected_pk(user_id)}}


# --- the partition key -------------------------------------------------------------------------


def test_the_partition_key_never_exposes_the_user_id(ietf: TestClient, user_id: str) -> None:
    response = ietf.get("/dict", headers=as_user(user_id))
    raw = response.headers["RateLimit"] + response.headers["RateLimit-Policy"]
    assert user_id not in raw
    assert base64.b64encode(user_id.encode()).decode()[:8] not in raw
    pk = parsed(response, "RateLimit")["requests-minute"]["pk"]
    assert len(pk) == 16 and user_id.encode() not in pk


def test_an_anonymous_client_s_address_is_not_exposed_either(ietf: TestClient) -> None:
    response = ietf.get("/dict")  # TestClient's address: "testclient"
    assert "testclient" not in response.headers["RateLimit"]
    assert parsed(response, "RateLimit")["requests-minute"]["pk"] == expected_pk("ip:testclient")


def test_partition_keys_tell_users_apart_and_stay_the_same_for_one_user(
        ietf: TestClient, user_id: str) -> None:
    first, again = (ietf.get("/dict", headers=as_user(user_id)) for _ in range(2))
    other = ietf.get("/dict", headers=as_user(f"{user_id}-other"))
    key = parsed(first, "RateLimit")["requests-minute"]["pk"]
    assert parsed(again, "RateLimit")["requests-minute"]["pk"] == key
    assert parsed(other, "RateLimit")["requests-minute"]["pk"] != key


def test_a_budget_in_a_namespace_has_its_own_partition_key(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    client = client_for(RateLimit(limiter=limiter, headers="ietf", partition_key_secret=SECRET,
                                  namespace="images"))
    response = client.get("/dict", headers=as_user(user_id))
    pk = parsed(response, "RateLimit")["requests-minute"]["pk"]
    assert pk == expected_pk(key_identity(user_id, "images")) != expected_pk(user_id)


def test_the_secret_decides_the_partition_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    assert PartitionKeys(SECRET).of("user_1") == PartitionKeys(SECRET.encode()).of("user_1")
    assert PartitionKeys(SECRET).of("user_1") != PartitionKeys("another").of("user_1")
    monkeypatch.setenv(PARTITION_KEY_SECRET_ENV, "from-the-environment")
    from_env = PartitionKeys(None)
    assert not from_env.per_process
    assert from_env.of("user_1") == PartitionKeys("from-the-environment").of("user_1")
    assert "from-the-environment" not in repr(from_env)
    monkeypatch.delenv(PARTITION_KEY_SECRET_ENV)
    per_process = PartitionKeys(None)
    assert per_process.per_process and per_process.of("user_1") == PartitionKeys(None).of("user_1")


def test_without_a_secret_a_warning_says_keys_differ_between_workers(
        limiter: AnyLimiter, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(PARTITION_KEY_SECRET_ENV, raising=False)
    RateLimit(limiter=limiter, headers="ietf")
    assert "differ between workers" in caplog.text


@pytest.mark.parametrize(("options", "error"), [
    ({"headers": "IETF"}, ValueError), ({"headers": "x-ratelimit"}, ValueError),
    ({"headers": None}, ValueError),
    ({"headers": "ietf", "partition_key_secret": ""}, ValueError),
    ({"headers": "ietf", "partition_key_secret": 42}, TypeError),
])
def test_bad_header_options_fail_when_the_dependency_is_built(
        limiter: AnyLimiter, options: dict[str, Any], error: type[Exception]) -> None:
    for dependency_class in (RateLimit, TokenRateLimit):
        with pytest.raises(error):
            dependency_class(limiter=limiter, **options)


# --- token budgets and shadow mode -------------------------------------------------------------


def token_limit(limiter: AnyLimiter, tokens: int) -> TokenRateLimit:
    return TokenRateLimit(limiter=limiter, token_limits=TOKENS, estimate=lambda request: tokens,
                          headers="ietf", partition_key_secret=SECRET)


def test_token_windows_are_policies_of_their_own_unit(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    dependency = token_limit(limiter, 30)
    response = client_for(dependency).get("/dict", headers=as_user(user_id))
    assert response.status_code == 200
    # A token budget of its own counts in a namespace: the partition is that budget's.
    pk = expected_pk(key_identity(user_id, dependency.namespace))
    assert parsed(response, "RateLimit-Policy") == {
        "requests-minute": {"q": 5, "w": 60, "pk": pk},
        "requests-day": {"q": 100, "w": 86400, "pk": pk},
        "tokens-minute": {"q": 100, "qu": "tokens", "w": 60, "pk": pk},
        "tokens-day": {"q": 1000, "qu": "tokens", "w": 86400, "pk": pk},
    }
    assert parsed(response, "RateLimit") == {
        "requests-minute": {"r": 4, "t": 60, "pk": pk},
        "tokens-minute": {"r": 70, "t": 60, "pk": pk},
    }
    assert response.headers["x-ratelimit-remaining-tokens"] == "70"


def test_a_token_429_names_the_token_window(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    client = client_for(token_limit(limiter, 60))
    assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    response = client.get("/dict", headers=as_user(user_id))
    assert response.status_code == 429
    limits = parsed(response, "RateLimit")
    assert list(limits) == ["tokens-minute"]
    assert limits["tokens-minute"]["r"] == 0
    assert limits["tokens-minute"]["t"] == int(response.headers["Retry-After"])


def test_a_request_that_can_never_fit_gets_the_policies_only(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    response = client_for(token_limit(limiter, 500)).get("/dict", headers=as_user(user_id))
    assert response.status_code == 429
    assert response.headers["x-should-retry"] == "false"
    assert parsed(response, "RateLimit-Policy")["tokens-minute"]["q"] == 100
    assert "RateLimit" not in response.headers  # no remaining to tell: nothing was asked


def test_a_shadow_would_refuse_carries_no_ietf_field(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    """The IETF fields describe what is enforced: a shadow budget's verdict goes out in
    X-RateLimit-Shadow-* only."""
    client = client_for(RateLimit(limiter=limiter, tier_limits={"free": {"per_minute": 1, "per_day": 10}},
                                  mode="shadow", headers="ietf", partition_key_secret=SECRET))
    assert client.get("/dict", headers=as_user(user_id)).status_code == 200
    response = client.get("/dict", headers=as_user(user_id))
    assert response.status_code == 200
    assert response.headers["X-RateLimit-Shadow"] == "would-refuse"
    assert response.headers["X-RateLimit-Shadow-Remaining"] == "0"
    assert "RateLimit" not in response.headers and "RateLimit-Policy" not in response.headers
    assert "Retry-After" not in response.headers
