"""RateLimit and TokenRateLimit with scopes, through Starlette's TestClient on a real Redis:
upstream caps shared by every user (a 429 that says the service is at capacity, with
X-RateLimit-Scope: upstream), a route's own budget, per-model budgets read from the request's
JSON `model`, the tiers file's [models] and [upstreams] sections, and the contract's single
check_windows call when no scope is configured. Every test runs per limiter kind."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi import Depends, FastAPI, Request

from genai_ratelimit import Scope
from genai_ratelimit._tiers_config import TierConfigError
from genai_ratelimit.fastapi import RateLimit, RateLimitHeadersMiddleware, TokenRateLimit, Upstream
from helpers_async import LimiterFactory
from test_fastapi_tokens import FakeAuth, _built_in_tiers, as_user, limiter  # noqa: F401 (fixtures)

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r".*httpx2")
    from fastapi.testclient import TestClient

UPSTREAM_KEY = "ratelimit:openai/gpt-4o:60:shared"


def build_app(chat: Any, embed: Any | None = None) -> FastAPI:
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)
    app.add_middleware(FakeAuth)

    @app.post("/chat", dependencies=[Depends(chat)])
    async def chat_route(request: Request) -> dict[str, Any]:
        return {"echo": await request.json()}  # the body is still readable

    @app.post("/embed", dependencies=[Depends(embed or chat)])
    async def embed_route() -> dict[str, str]:
        return {"ok": "yes"}

    return app


@pytest.fixture
def client_for(make_limiter: LimiterFactory) -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []

    def make(chat: Any, embed: Any | None = None) -> TestClient:
        options = ({} if make_limiter.loop_factory is None
                   else {"backend_options": {"loop_factory": make_limiter.loop_factory}})
        client = TestClient(build_app(chat, embed), **options)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    if clients:
        for limiter in make_limiter.async_limiters:
            if not limiter.closed:
                clients[0].portal.call(limiter.aclose)
    for client in clients:
        client.__exit__(None, None, None)


def chat(client: TestClient, user: str, model: str = "gpt-4o") -> Any:
    return client.post("/chat", headers=as_user(user), json={"model": model, "messages": []})


@pytest.mark.parametrize("error_format", ["openai", "anthropic", "plain"])
def test_an_upstream_refusal_says_the_service_is_at_capacity(
        limiter: Any, client_for: Any, redis_client: redis.Redis, user_id: str,
        error_format: str) -> None:
    cap = Upstream("openai/gpt-4o", per_minute=2)
    client = client_for(RateLimit(limiter, upstream=cap, error_format=error_format))
    for n in range(2):
        ok = chat(client, f"{user_id}-{n}")
        assert ok.status_code == 200 and ok.json()["echo"]["model"] == "gpt-4o"
        assert ok.headers["x-ratelimit-limit"] == "5"  # the user's own tier budget
    refused = chat(client, user_id)
    assert refused.status_code == 429
    assert refused.headers["x-ratelimit-scope"] == "upstream"
    assert (refused.headers["x-ratelimit-limit"], refused.headers["x-ratelimit-window"]) == (
        "2", "minute")
    assert int(refused.headers["retry-after"]) >= 1
    body = refused.json()
    assert body["detail"] == "Rate limit exceeded"  # the contract's, for every 429
    if error_format == "openai":
        assert body["error"]["type"] == "requests"
        assert "at capacity" in body["error"]["message"]
        assert "not your own" in body["error"]["message"]
    elif error_format == "anthropic":
        assert body["error"]["type"] == "rate_limit_error" and "at capacity" in body["error"]["message"]
    assert redis_client.zcard(UPSTREAM_KEY) == 2
    assert redis_client.exists(f"ratelimit:{user_id}:60") == 0  # the user was not charged


def test_a_tenant_refusal_leaves_the_upstream_alone_and_has_no_scope_header(
        limiter: Any, client_for: Any, redis_client: redis.Redis, user_id: str) -> None:
    client = client_for(RateLimit(limiter, {"free": {"per_minute": 1, "per_day": 10}},
                                  upstream=Upstream("openai/gpt-4o", per_minute=30)))
    assert chat(client, user_id).status_code == 200
    refused = chat(client, user_id)
    assert refused.status_code == 429 and "x-ratelimit-scope" not in refused.headers
    assert refused.json()["detail"] == "Rate limit exceeded"
    assert "at capacity" not in refused.json()["error"]["message"]
    assert redis_client.zcard(UPSTREAM_KEY) == 1


def test_a_route_budget_counts_on_its_route_only(limiter: Any, client_for: Any,
                                                  redis_client: redis.Redis, user_id: str) -> None:
    client = client_for(RateLimit(limiter), RateLimit(limiter, route_limits={"per_minute": 2}))
    for _ in range(2):
        assert client.post("/embed", headers=as_user(user_id)).status_code == 200
    refused = client.post("/embed", headers=as_user(user_id))
    assert refused.status_code == 429
    assert refused.headers["x-ratelimit-scope"] == "route"
    assert "route /embed" in refused.json()["error"]["message"]
    assert chat(client, user_id).status_code == 200  # the tier budget still has room
    assert redis_client.zcard(f"ratelimit:{user_id}:60:scope=route%3A/embed") == 2
    assert client.post("/embed", headers=as_user(user_id + "-b")).status_code == 200


def test_a_model_budget_reads_the_model_from_the_body(limiter: Any, client_for: Any,
                                                      redis_client: redis.Redis,
                                                      user_id: str) -> None:
    client = client_for(RateLimit(limiter, model_limits={"gpt-4o": {"per_minute": 1}}))
    assert chat(client, user_id).status_code == 200
    refused = chat(client, user_id)
    assert refused.status_code == 429 and refused.headers["x-ratelimit-scope"] == "model"
    assert chat(client, user_id, model="gpt-4o-mini").status_code == 200  # no budget of its own
    assert redis_client.zcard(f"ratelimit:{user_id}:60:scope=model%3Agpt-4o") == 1
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 2  # the refused one is not logged


def test_the_tiers_file_sections_give_model_budgets_and_upstreams(
        limiter: Any, client_for: Any, redis_client: redis.Redis, user_id: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text('[free]\nper_minute = 50\nper_day = 500\n\n'
                     '[models."gpt-4o-mini"]\nper_minute = 1\n\n'
                     '[upstreams."openai/gpt-4o"]\nmodels = ["gpt-4o"]\nper_minute = 2\n',
                     encoding="utf-8")
    monkeypatch.setenv("GENAI_RATELIMIT_TIERS", str(tiers))
    client = client_for(RateLimit(limiter))
    assert chat(client, user_id + "-a").status_code == 200
    assert chat(client, user_id + "-b").status_code == 200
    assert chat(client, user_id + "-c").headers["x-ratelimit-scope"] == "upstream"
    assert chat(client, user_id, model="gpt-4o-mini").status_code == 200  # not that upstream
    assert chat(client, user_id, model="gpt-4o-mini").headers["x-ratelimit-scope"] == "model"
    assert redis_client.zcard(UPSTREAM_KEY) == 2


class CallLog:
    """A real limiter that notes which of its methods a dependency called."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, []
        self.is_async = not hasattr(inner, "_reserve")

    def check_windows(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("check_windows")
        return self.inner.check_windows(*args, **kwargs)

    def reserve(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("reserve")
        return self.inner.reserve(*args, **kwargs)


def test_without_scopes_one_check_windows_call_decides(limiter: Any, client_for: Any,
                                                        user_id: str) -> None:
    plain, scoped = CallLog(limiter), CallLog(limiter)
    client = client_for(RateLimit(plain), RateLimit(scoped, route_limits={"per_minute": 5}))
    assert chat(client, user_id).status_code == 200
    assert plain.calls == ["check_windows"]
    assert client.post("/embed", headers=as_user(user_id)).status_code == 200
    assert scoped.calls == ["reserve"]


def test_token_rate_limit_counts_tokens_in_the_upstream_token_caps(
        limiter: Any, client_for: Any, redis_client: redis.Redis, user_id: str) -> None:
    cap = Upstream("openai/gpt-4o", per_minute=100, tokens_per_minute=100)
    client = client_for(TokenRateLimit(limiter, upstream=cap, estimate=lambda request: 60))
    first = chat(client, user_id + "-a")
    assert first.status_code == 200
    refused = chat(client, user_id)
    assert refused.status_code == 429
    assert (refused.headers["x-ratelimit-scope"], refused.headers["x-ratelimit-resource"]) == (
        "upstream", "tokens")
    assert redis_client.exists(f"ratelimit:{user_id}:60", f"ratelimit:{user_id}:60:tokens") == 0
    # The first request's usage (reported by its response? none here) keeps the estimate.
    assert redis_client.hget("ratelimit:openai/gpt-4o:60:tokens:shared:w", "") == b"59"


def test_an_upstream_can_be_chosen_per_request(limiter: Any, client_for: Any,
                                               redis_client: redis.Redis, user_id: str) -> None:
    caps = {"gpt-4o": Upstream("openai/gpt-4o", per_minute=1)}

    async def upstream_of(request: Request) -> Upstream | None:
        return caps.get(json.loads(await request.body()).get("model"))

    client = client_for(RateLimit(limiter, upstream=upstream_of))
    assert chat(client, user_id).status_code == 200
    assert chat(client, user_id).headers["x-ratelimit-scope"] == "upstream"
    assert chat(client, user_id, model="other").status_code == 200


@pytest.mark.parametrize("arguments, error, message", [
    ({"route_limits": {"per_minute": 0}}, ValueError, "integer >= 1"),
    ({"route_limits": {"per_hour": 3}}, ValueError, "unknown key"),
    ({"route_limits": {"tokens_per_minute": 3}}, ValueError, "need TokenRateLimit"),
    ({"model_limits": {"gpt-4o": {}}}, ValueError, "at least one"),
    ({"upstream": "openai"}, TypeError, "Upstream"),
    ({"upstream": [Upstream("a", per_minute=1), Upstream("a", per_day=9)]}, ValueError,
     "share a name"),
])
def test_bad_scope_settings_fail_at_start_up(arguments: dict[str, Any], error: type[Exception],
                                             message: str) -> None:
    with pytest.raises(error, match=message):
        RateLimit(**arguments)


def test_a_bad_upstream_or_tiers_section_fails_when_made(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TierConfigError, match="at least one"):
        Upstream("openai/gpt-4o")
    with pytest.raises(TypeError, match="models"):
        Upstream("openai/gpt-4o", per_minute=1, models="gpt-4o")  # type: ignore[arg-type]
    tiers = tmp_path / "tiers.json"
    tiers.write_text(json.dumps({"free": {"per_minute": 5, "per_day": 9},
                                 "upstreams": {"x": {"per_minute": 1, "models": "gpt"}}}))
    monkeypatch.setenv("GENAI_RATELIMIT_TIERS", str(tiers))
    with pytest.raises(TierConfigError, match="models must be a list"):
        RateLimit()


def test_upstream_gives_a_shared_scope() -> None:
    assert Upstream("u", per_minute=3, tokens_per_day=9).scope() == Scope(
        "u", windows=[(3, 60)], token_windows=[(9, 86_400)], shared=True)
    assert Upstream("u", tokens_per_day=9).scope(tokens=False) is None


def test_shadow_mode_lets_an_upstream_refusal_through_and_says_so(
        limiter: Any, client_for: Any, redis_client: redis.Redis, user_id: str) -> None:
    client = client_for(RateLimit(limiter, upstream=Upstream("openai/gpt-4o", per_minute=1),
                                  mode="shadow"))
    assert chat(client, user_id + "-a").status_code == 200
    through = chat(client, user_id)
    assert through.status_code == 200
    assert through.headers["x-ratelimit-shadow"] == "would-refuse"
    assert through.headers["x-ratelimit-shadow-scope"] == "upstream"
    assert "retry-after" not in through.headers and "x-ratelimit-scope" not in through.headers
    # A shadow cap counts in keys of its own: never in the enforced cap's.
    assert redis_client.keys(UPSTREAM_KEY) == []
    assert redis_client.zcard("ratelimit:shadow:openai/gpt-4o:60:shared") == 1  # the refused one not logged


def test_a_scoped_dependency_takes_its_in_flight_slot_first_and_gives_it_back(
        limiter: Any, client_for: Any, redis_client: redis.Redis, user_id: str) -> None:
    client = client_for(RateLimit(limiter, upstream=Upstream("openai/gpt-4o", per_minute=1,
                                                             models=("gpt-4o",)),
                                  max_in_flight={"free": 1}))
    def scripts_run() -> int:
        return int(redis_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    client.post("/embed", headers=as_user(user_id + "-warm"))  # every script loaded once
    before = scripts_run()
    assert chat(client, user_id).status_code == 200
    # acquire, the one reserve (tier + upstream), release: three scripts.
    assert scripts_run() - before == 3
    assert redis_client.zcard(f"ratelimit:{user_id}:leases") == 0  # released after the response
    refused = chat(client, user_id + "-b")
    assert refused.headers["x-ratelimit-scope"] == "upstream"
    assert redis_client.zcard(f"ratelimit:{user_id}-b:leases") == 0  # a 429 gives it back too
