"""TokenRateLimit(prices=..., spend_limits=...): money budgets over HTTP, through the ASGI app
on a real Redis, with a blocking RateLimiter and an AsyncRateLimiter (tests/conftest.py): the
worst case held after the tokens are reserved and settled to the exact cost; the three
refusals of a budget (permanent, until_reset, in_flight) and what they leave behind (nothing);
an unpriced model; an override that changes a limit without resetting what was spent; shadow
mode."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse

from genai_ratelimit import AsyncRateLimiter, PriceTable, RateLimiter
from genai_ratelimit.fastapi import RateLimitHeadersMiddleware, SpendLevel, TokenRateLimit
from helpers_async import LimiterFactory

pytestmark = [
    pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async tests "
                                   "drive on hiredis 1.x"),
]

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r".*httpx2")
    from fastapi.testclient import TestClient

# 1 micro-USD per input token, 2 per output token.
PRICES = PriceTable.from_mapping({"version": "test", "currency": "USD",
                                  "models": {"m": {"input": 1_000_000, "output": 2_000_000}}})
TOKENS = {"free": {"per_minute": 10_000, "per_day": 100_000}}
BUDGET = {"free": {"daily_usd": "0.0001"}}  # 100 micro-USD a day

AnyLimiter = RateLimiter | AsyncRateLimiter


@pytest.fixture(autouse=True)
def _built_in_tiers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GENAI_RATELIMIT_TIERS", raising=False)


@pytest.fixture
def limiter(make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> AnyLimiter:
    return make_limiter.native(redis_url)  # type: ignore[no-any-return]


def build_app(dependency: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)
    limited = [Depends(dependency)]

    @app.post("/json", dependencies=limited)
    async def as_json(request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"object": "chat.completion",
                "usage": {"prompt_tokens": 1, "completion_tokens": body["report"] - 1,
                          "total_tokens": body["report"]}}

    @app.post("/stream", dependencies=limited)
    async def as_stream(request: Request) -> StreamingResponse:
        body = await request.json()

        async def events() -> Any:
            yield f"data: {json.dumps({'choices': [{'delta': {'content': 'hi'}}]})}\n\n"
            final = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": body["report"] - 1,
                                              "total_tokens": body["report"]}}
            yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/silent", dependencies=limited)
    async def silent() -> dict[str, str]:
        return {"answer": "no usage here"}

    return app


@pytest.fixture
def client_for(make_limiter: LimiterFactory) -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []

    def make(dependency: Any) -> TestClient:
        options = ({} if make_limiter.loop_factory is None
                   else {"backend_options": {"loop_factory": make_limiter.loop_factory}})
        client = TestClient(build_app(dependency), **options)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    if clients:
        for limiter in make_limiter.async_limiters:
            if not limiter.closed:
                clients[0].portal.call(limiter.aclose)  # type: ignore[union-attr]
    for client in clients:
        client.__exit__(None, None, None)


def user(user_id: str) -> Callable[[Request], tuple[str, str]]:
    return lambda request: (user_id, "free")


def chat(report: int = 1, max_tokens: int = 40, model: str = "m") -> dict[str, Any]:
    # 8 characters of prompt: 2 input tokens; worst case 2 x 1 + max_tokens x 2 micro-USD
    return {"model": model, "max_tokens": max_tokens, "report": report,
            "messages": [{"role": "user", "content": "x" * 8}]}


def budget(redis_client: redis.Redis, owner: str, name: str = "daily_usd") -> dict[str, int]:
    """The spent and held fields of an owner's budget hash (the period's), from Redis."""
    keys = redis_client.keys(f"ratelimit:{owner}:*:budget={name}")
    if not keys:
        return {"spent": 0, "held": 0}
    (key,) = keys
    fields = redis_client.hgetall(key)
    return {"spent": int(fields.get(b"spent", 0)), "held": int(fields.get(b"held", 0))}


def token_entries(redis_client: redis.Redis, user_id: str) -> int:
    return sum(redis_client.zcard(key) for key in redis_client.keys(f"ratelimit:*{user_id}:60:tokens"))


def request_entries(redis_client: redis.Redis, user_id: str) -> int:
    return sum(redis_client.zcard(key) for key in redis_client.keys(f"ratelimit:*{user_id}:60"))


def spend_limit(limiter: AnyLimiter, user_id: str, **options: Any) -> TokenRateLimit:
    return TokenRateLimit(limiter=limiter, identify=user(user_id), token_limits=TOKENS,
                          prices=PRICES, spend_limits=options.pop("spend_limits", BUDGET), **options)


@pytest.mark.parametrize("route", ["/json", "/stream"])
def test_an_allowed_request_holds_its_worst_case_and_settles_its_cost(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis, route: str) -> None:
    client = client_for(spend_limit(limiter, user_id))
    silent = client.post("/silent", json=chat())
    assert silent.status_code == 200
    assert budget(redis_client, user_id) == {"spent": 0, "held": 82}  # no usage: kept held
    assert silent.headers["x-ratelimit-limit-spend"] == "0.0001"
    assert silent.headers["x-ratelimit-remaining-spend"] == "0.000018"
    assert silent.headers["x-ratelimit-spend-budget"] == "key/daily_usd"
    assert silent.headers["x-ratelimit-spend-currency"] == "USD"
    assert silent.headers["x-ratelimit-reset-spend"].endswith("T00:00:00Z")
    redis_client.delete(*redis_client.keys(f"ratelimit:{user_id}:*:budget=*"))
    answered = client.post(route, json=chat(report=17))
    assert answered.status_code == 200
    assert budget(redis_client, user_id) == {"spent": 1 + 16 * 2, "held": 0}  # the exact cost


def test_a_worst_case_above_the_whole_limit_is_refused_for_good(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(spend_limit(limiter, user_id))
    refused = client.post("/json", json=chat(max_tokens=100))  # 202 micro-USD > 100
    assert refused.status_code == 429
    assert refused.headers["x-should-retry"] == "false"
    assert "retry-after" not in refused.headers
    assert refused.headers["x-ratelimit-resource"] == "spend"
    assert refused.headers["x-ratelimit-scope"] == "key"
    body = refused.json()
    assert body["budget"]["reason"] == "permanent"
    assert body["budget"]["requested"] == "0.000202"
    assert body["error"]["code"] == "spend_too_large"
    assert "can never be allowed" in body["error"]["message"]
    # the token reservation was given back exactly: no token, no request, nothing held
    assert token_entries(redis_client, user_id) == 0
    assert request_entries(redis_client, user_id) == 0
    assert budget(redis_client, user_id) == {"spent": 0, "held": 0}


def test_a_budget_held_by_requests_in_flight_answers_a_short_retry(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    dependency = spend_limit(limiter, user_id, max_in_flight={"free": 5})
    client = client_for(dependency)
    assert client.post("/silent", json=chat()).status_code == 200  # 82 held, never settled
    tokens_before = token_entries(redis_client, user_id)
    refused = client.post("/json", json=chat(report=5))
    assert refused.status_code == 429
    assert refused.json()["budget"]["reason"] == "in_flight"
    assert refused.headers["retry-after"] == "1"
    assert refused.headers["x-should-retry"] == "true"
    assert token_entries(redis_client, user_id) == tokens_before == 1
    assert request_entries(redis_client, user_id) == 1
    assert budget(redis_client, user_id) == {"spent": 0, "held": 82}
    assert redis_client.zcard(f"ratelimit:{user_id}:leases") == 0  # every slot given back


def test_a_budget_spent_until_its_reset_is_not_retried(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(spend_limit(limiter, user_id))
    assert client.post("/json", json=chat(report=41)).status_code == 200  # 81 spent
    refused = client.post("/json", json=chat(report=5))
    assert refused.status_code == 429
    body = refused.json()
    assert body["budget"]["reason"] == "until_reset"
    assert body["budget"]["remaining"] == "0.000019"
    assert body["error"]["code"] == "insufficient_quota"
    assert refused.headers["x-ratelimit-reset-spend"] == body["budget"]["reset_at"]
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-should-retry"] == (
        "true" if int(refused.headers["retry-after"]) <= 300 else "false")
    assert budget(redis_client, user_id) == {"spent": 81, "held": 0}
    assert token_entries(redis_client, user_id) == 1


def test_an_unpriced_model_is_refused_naming_it(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(spend_limit(limiter, user_id))
    refused = client.post("/json", json=chat(model="gpt-unknown"))
    assert refused.status_code == 400
    assert "gpt-unknown" in refused.json()["error"]["message"]
    assert refused.json()["error"]["code"] == "model_not_priced"
    assert token_entries(redis_client, user_id) == 0


def test_an_override_changes_the_limit_without_resetting_the_spend(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    overrides: dict[tuple[str, str, str], str] = {}
    dependency = spend_limit(limiter, user_id,
                             spend_limit_of=lambda level, owner, name: overrides.get((level, owner, name)))
    client = client_for(dependency)
    assert client.post("/json", json=chat(report=41)).status_code == 200  # 81 of 100 spent
    assert client.post("/json", json=chat(report=41)).status_code == 429
    overrides[("key", user_id, "daily_usd")] = "0.0005"  # this key's budget is 500, not 100
    allowed = client.post("/json", json=chat(report=41))
    assert allowed.status_code == 200
    assert allowed.headers["x-ratelimit-limit-spend"] == "0.0005"
    assert budget(redis_client, user_id) == {"spent": 162, "held": 0}  # nothing was reset


def test_levels_are_held_together_and_a_refusal_charges_none(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    org = SpendLevel("org", owner_of=lambda request: f"org-{user_id}",
                     budgets={"monthly_usd": "0.00015"})
    client = client_for(spend_limit(limiter, user_id, spend_limits={"free": {"daily_usd": 1}},
                                    spend_levels=[org]))
    assert client.post("/json", json=chat(report=41)).status_code == 200  # 81 in both
    refused = client.post("/json", json=chat(report=41))
    assert refused.status_code == 429
    assert refused.json()["budget"]["level"] == "org"
    assert budget(redis_client, user_id) == {"spent": 81, "held": 0}
    assert budget(redis_client, f"org:org-{user_id}", "monthly_usd") == {"spent": 81, "held": 0}


def test_spend_is_counted_by_tier_and_level_in_money_units(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str) -> None:
    """request_outcomes: the money held, released and settled at each level the request
    held (micro-USD), each budget's use after its hold; a refusal counts no money."""
    from genai_ratelimit.metrics import SPEND, SPEND_BUDGET_USE, exported, request_outcomes, samples
    org = SpendLevel("org", owner_of=lambda request: f"org-{user_id}",
                     budgets={"monthly_usd": "0.00015"})
    client = client_for(spend_limit(limiter, user_id, spend_limits={"free": {"daily_usd": 1}},
                                    spend_levels=[org]))
    tally = request_outcomes(limiter)
    assert client.post("/json", json=chat(report=41)).status_code == 200  # held 82, cost 81
    assert client.post("/json", json=chat(report=41)).status_code == 429  # the org's: none
    for level in ("key", "org"):
        assert [tally.spent(state, tier="free", level=level, mode="enforce", currency="USD")
                for state in ("held", "released", "settled")] == [82, 82, 81]
    assert tally.spent("held") == 2 * 82
    # After the hold the key's $1 is 82 / 1,000,000 used; the org's 82 / 150: above half.
    assert tally.budget_use() == (("free", "key", "0.5", 1), ("free", "org", "0.8", 1))
    got = {(family.name, values): value for family, values, value in samples(exported(limiter))
           if family in (SPEND, SPEND_BUDGET_USE)}
    assert got[("spend_units", ("free", "org", "enforce", "USD", "settled"))] == 81
    assert got[("spend_budget_use", ("free", "org", "0.8"))] == 1
    with pytest.raises(ValueError, match="state"):
        tally.add_spend("spent", tier="free", level="key", mode="enforce", currency="USD",
                        amount=1)


def test_shadow_mode_leaks_no_money_header(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    client = client_for(spend_limit(limiter, user_id, mode="shadow"))
    for _ in range(2):
        answered = client.post("/json", json=chat(max_tokens=100))  # would be refused for good
        assert answered.status_code == 200
        assert not any("spend" in name.lower() for name in answered.headers)
        assert answered.headers["x-ratelimit-shadow"] == "would-refuse"
    assert budget(redis_client, user_id) == {"spent": 0, "held": 0}


def test_spend_limits_are_checked_when_built(limiter: AnyLimiter) -> None:
    with pytest.raises(TypeError, match="no float"):
        TokenRateLimit(limiter=limiter, prices=PRICES, spend_limits={"free": {"daily_usd": 0.5}})
    with pytest.raises(ValueError, match="daily_eur"):
        TokenRateLimit(limiter=limiter, prices=PRICES, spend_limits={"free": {"daily_eur": 1}})
    with pytest.raises(ValueError, match="finer than one money unit"):
        TokenRateLimit(limiter=limiter, prices=PRICES, spend_limits={"free": {"daily_usd": "0.0000001"}})
    with pytest.raises(ValueError, match="need prices"):
        TokenRateLimit(limiter=limiter, spend_limits={"free": {"daily_usd": 1}})


def test_the_tiers_file_gives_the_money_budgets(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text('[free]\nper_minute = 100\nper_day = 1000\ntokens_per_minute = 10000\n'
                     'tokens_per_day = 100000\ndaily_usd = "0.0001"\n')
    monkeypatch.setenv("GENAI_RATELIMIT_TIERS", str(tiers))
    dependency = TokenRateLimit(limiter=limiter, identify=user(user_id), prices=PRICES)
    client = client_for(dependency)
    assert client.post("/json", json=chat(report=41)).headers["x-ratelimit-limit-spend"] == "0.0001"
    assert client.post("/json", json=chat(report=41)).json()["budget"]["reason"] == "until_reset"
    tiers.write_text('[free]\nper_minute = 100\nper_day = 1000\ndaily_usd = 0.5\n')
    with pytest.raises(TypeError, match="no float"):
        TokenRateLimit(limiter=limiter, prices=PRICES)
    tiers.write_text('[free]\nper_minute = 100\nper_day = 1000\nhourly_usd = 1\n')
    with pytest.raises(ValueError, match="hourly_usd"):
        TokenRateLimit(limiter=limiter, prices=PRICES)


def test_async_owners_and_overrides_are_awaited(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis) -> None:
    async def team_of(request: Request) -> str:
        return f"t-{user_id}"

    async def limit_of(level: str, owner: str, name: str) -> str | None:
        return "0.001" if level == "team" else None

    team = SpendLevel("team", owner_of=team_of, budgets={"weekly_usd": "0.0001"})
    client = client_for(spend_limit(limiter, user_id, spend_levels=[team], spend_limit_of=limit_of))
    answered = client.post("/json", json=chat(report=41))
    assert answered.status_code == 200
    assert answered.headers["x-ratelimit-spend-budget"] == "key/daily_usd"  # 19 left of 100
    assert budget(redis_client, f"team:t-{user_id}", "weekly_usd") == {"spent": 81, "held": 0}


def test_a_stream_cut_short_settles_what_it_streamed_when_the_policy_says_so(
        limiter: AnyLimiter, make_limiter: LimiterFactory, user_id: str,
        redis_client: redis.Redis) -> None:
    dependency = spend_limit(limiter, user_id, aborted_stream="streamed")
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)

    @app.post("/cut", dependencies=[Depends(dependency)])
    async def cut() -> StreamingResponse:
        async def events() -> Any:
            yield f"data: {json.dumps({'choices': [{'delta': {'content': 'x' * 40}}]})}\n\n"
            raise RuntimeError("the upstream broke off")

        return StreamingResponse(events(), media_type="text/event-stream")

    options = ({} if make_limiter.loop_factory is None
               else {"backend_options": {"loop_factory": make_limiter.loop_factory}})
    with TestClient(app, raise_server_exceptions=False, **options) as client:
        client.post("/cut", json=chat())
        for native in make_limiter.async_limiters:
            client.portal.call(native.aclose)  # type: ignore[union-attr]
    # the prompt's 2 tokens at 1 + the 10 tokens of text delivered at 2 micro-USD
    assert budget(redis_client, user_id) == {"spent": 2 + 10 * 2, "held": 0}


def test_record_usage_settles_with_the_usage_it_is_given(
        limiter: AnyLimiter, make_limiter: LimiterFactory, user_id: str,
        redis_client: redis.Redis) -> None:
    from genai_ratelimit.fastapi import record_usage
    dependency = spend_limit(limiter, user_id)
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)

    @app.post("/record", dependencies=[Depends(dependency)])
    async def records(request: Request) -> dict[str, Any]:
        body = await request.json()
        if body["report"] == 0:
            await record_usage(request, 30)  # a total alone: settled at the worst case
        else:
            await record_usage(request, 30, usage={"input_tokens": 10, "output_tokens": 20})
        return {}

    options = ({} if make_limiter.loop_factory is None
               else {"backend_options": {"loop_factory": make_limiter.loop_factory}})
    with TestClient(app, **options) as client:
        assert client.post("/record", json=chat(report=1)).status_code == 200
        assert budget(redis_client, user_id) == {"spent": 10 + 20 * 2, "held": 0}
        assert client.post("/record", json=chat(report=0, max_tokens=10)).status_code == 200
        assert budget(redis_client, user_id) == {"spent": 50 + 22, "held": 0}
        for native in make_limiter.async_limiters:
            client.portal.call(native.aclose)  # type: ignore[union-attr]


def test_levels_on_a_redis_cluster_are_held_owner_by_owner(
        make_limiter: LimiterFactory, redis_cluster: Any,
        client_for: Callable[..., TestClient], user_id: str) -> None:
    """The key's budget and the org's live in two hash slots: held in two steps, settled in
    two; a refusal by the org gives the key's hold back and reserves no tokens."""
    from redis.cluster import RedisCluster as ClusterClient

    limiter = make_limiter.native(redis_cluster.url)
    org = SpendLevel("org", owner_of=lambda request: f"org-{user_id}",
                     budgets={"monthly_usd": "0.00015"})
    client = client_for(spend_limit(limiter, user_id, spend_limits={"free": {"daily_usd": 1}},
                                    spend_levels=[org]))
    inspector = ClusterClient(host="127.0.0.1", port=redis_cluster.nodes[0].port)

    def stored(owner: str, name: str) -> dict[str, int]:
        (key,) = inspector.keys(f"ratelimit:{{{owner}}}:*:budget={name}",
                                target_nodes=ClusterClient.PRIMARIES)
        fields = inspector.hgetall(key)
        return {"spent": int(fields.get(b"spent", 0)), "held": int(fields.get(b"held", 0))}

    try:
        assert client.post("/json", json=chat(report=41)).status_code == 200  # 81 in both
        refused = client.post("/json", json=chat(report=41))
        assert refused.status_code == 429
        assert refused.json()["budget"]["level"] == "org"
        assert stored(user_id, "daily_usd") == {"spent": 81, "held": 0}
        assert stored(f"org:org-{user_id}", "monthly_usd") == {"spent": 81, "held": 0}
        tokens = inspector.keys(f"ratelimit:{{{user_id}}}:60:tokens",
                                target_nodes=ClusterClient.PRIMARIES)
        assert sum(inspector.zcard(key) for key in tokens) == 1  # the refusal's given back
    finally:
        inspector.close()


@pytest.mark.parametrize("error_format", ["anthropic", "plain"])
def test_the_refusals_keep_the_error_formats_shape(
        limiter: AnyLimiter, client_for: Callable[..., TestClient], user_id: str,
        redis_client: redis.Redis, error_format: str) -> None:
    client = client_for(spend_limit(limiter, user_id, error_format=error_format))
    assert client.post("/json", json=chat(report=41)).headers["x-ratelimit-limit-spend"] == "0.0001"
    refused = client.post("/json", json=chat(report=5))
    assert refused.status_code == 429
    body = refused.json()
    assert body["detail"] == "Spend budget exceeded"
    assert body["budget"]["reason"] == "until_reset"
    if error_format == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
        assert "resets at" in body["error"]["message"]
    else:
        assert "error" not in body
    unpriced = client.post("/json", json=chat(model="other"))
    assert unpriced.status_code == 400 and "'other'" in json.dumps(unpriced.json())
