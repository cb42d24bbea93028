"""Scopes: windows that are not the user's own, decided in the same script as the user's
(reserve(..., scopes=[Scope(...)])), all or nothing. A user's scope (a route's or a model's
budget) keys under the user; a shared scope (an upstream provider's caps) keys under its
name, the same for every user. Also the two-step path (shared scopes first, in a step of
their own, for keys that cannot meet in one script) and its exact refunds. Every test runs
for every limiter kind against a real redis-server; what was logged is read back."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import redis

from genai_ratelimit import RateLimiterUnavailable, Reservation, Scope
from genai_ratelimit.reservation import reserve_plan
from helpers_async import LimiterFactory
from helpers_core import SORTED_SET_SHAPE, logged_entries

UPSTREAM = "openai/gpt-4o"


def upstream(per_minute: int = 30, tokens_per_minute: int | None = None) -> Scope:
    return Scope(UPSTREAM, windows=[(per_minute, 60)],
                 token_windows=[(tokens_per_minute, 60)] if tokens_per_minute else (),
                 shared=True)


def set_two_step(limiter: Any, on: bool) -> None:
    """Switches the two-step path on the limiter under test (the adapter's inner one too)."""
    target = getattr(limiter, "inner", limiter)
    target._two_step_scopes = on


def entries(client: redis.Redis, key: str) -> set[str]:
    return {m.decode() for m in client.zrange(key, 0, -1)}


def cost_of(client: redis.Redis, key: str, member: str) -> int | None:
    if client.zscore(key, member) is None:
        return None
    cost = client.hget(f"{key}:w", member)
    return int(cost) if cost is not None else 1


UP_KEY = f"ratelimit:{UPSTREAM}:60:shared"
UP_TOKENS = f"ratelimit:{UPSTREAM}:60:tokens:shared"


# --------------------------------------------------------------------------- the keys

@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_each_scope_kind_has_its_own_keys(limiter: Any, redis_client: redis.Redis,
                                          user_id: str) -> None:
    route = Scope("route:/v1/chat", windows=[(5, 60)], token_windows=[(500, 60)])
    r = limiter.reserve(user_id, [(10, 60)], token_windows=[(1000, 60)], tokens=7,
                        scopes=[route, upstream(tokens_per_minute=900)])
    assert r.allowed
    assert sorted(k.decode() for k in redis_client.keys("*")) == sorted([
        f"ratelimit:{user_id}:60", f"ratelimit:{user_id}:60:tokens",
        f"ratelimit:{user_id}:60:tokens:w", f"ratelimit:{user_id}:60:tokens:t",
        f"ratelimit:{user_id}:60:scope=route%3A/v1/chat",
        f"ratelimit:{user_id}:60:tokens:scope=route%3A/v1/chat",
        f"ratelimit:{user_id}:60:tokens:scope=route%3A/v1/chat:w",
        f"ratelimit:{user_id}:60:tokens:scope=route%3A/v1/chat:t",
        UP_KEY, UP_TOKENS, f"{UP_TOKENS}:w", f"{UP_TOKENS}:t"])
    assert cost_of(redis_client, f"ratelimit:{user_id}:60:tokens:scope=route%3A/v1/chat",
                   r.member) == 7
    assert cost_of(redis_client, UP_TOKENS, r.member) == 7


ONE = [(1, 60)]


@pytest.mark.parametrize("first, second", [
    # A user named like a shared scope: the shared key ends in ":shared".
    ((UPSTREAM, ONE, []), ("anyone", (), [Scope(UPSTREAM, windows=ONE, shared=True)])),
    # A user's scope named "shared" is ":scope=shared", never the shared kind.
    (("x", (), [Scope("shared", windows=ONE)]), ("anyone", (), [Scope("x", windows=ONE,
                                                                        shared=True)])),
    # A user id spelling a scope marker: its own key still ends in the window's digits.
    (("x:scope=y", ONE, []), ("x", (), [Scope("y", windows=ONE)])),
    (("x:60:scope=y", ONE, []), ("x", (), [Scope("y", windows=ONE)])),
    (("x:60:shared", ONE, []), ("anyone", (), [Scope("x", windows=ONE, shared=True)])),
    # ':' and '%' in a scope's name are percent-encoded: "a:b" and "a%3Ab" never meet.
    (("x", (), [Scope("a:b", windows=ONE)]), ("x", (), [Scope("a%3Ab", windows=ONE)])),
    (("x:a", (), [Scope("b", windows=ONE)]), ("x", (), [Scope("a:b", windows=ONE)])),
])
@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_no_user_id_or_scope_name_can_share_a_key(limiter: Any, redis_client: redis.Redis,
                                                  first: Any, second: Any) -> None:
    """Each pair would share a key in a naive layout: each side fills a one-request budget,
    the other is still allowed, and their keys are disjoint."""
    keys: list[set[bytes]] = []
    for user, windows, scopes in (first, second):
        before = set(redis_client.keys("*"))
        r = limiter.reserve(user, windows, scopes=scopes)
        assert r.allowed, (user, scopes)
        keys.append(set(redis_client.keys("*")) - before)
        assert keys[-1], "every window lives in a key"
        for key in keys[-1]:
            assert entries(redis_client, key.decode()) == {r.member}
    assert not keys[0] & keys[1]


def test_the_same_scope_name_of_two_users_is_two_budgets_and_shared_is_one(
        limiter: Any, user_id: str) -> None:
    route = Scope("route:/v1/embeddings", windows=[(1, 60)])
    shared = Scope("embeddings-backend", windows=[(1, 60)], shared=True)
    assert limiter.reserve(user_id, (), scopes=[route]).allowed
    assert limiter.reserve(user_id + "-b", (), scopes=[route]).allowed
    assert limiter.reserve(user_id, (), scopes=[shared]).allowed
    refused = limiter.reserve(user_id + "-b", (), scopes=[shared])
    assert not refused.allowed and refused.scope == shared and refused.member == ""


# ------------------------------------------------------------ all or nothing, both ways

@pytest.mark.parametrize("two_step", [False, True])
def test_a_request_the_upstream_refuses_leaves_no_entry_in_the_tenant(
        limiter: Any, redis_client: redis.Redis, user_id: str, two_step: bool) -> None:
    set_two_step(limiter, two_step)
    cap = upstream(per_minute=2, tokens_per_minute=1000)
    for n in range(2):
        assert limiter.reserve(f"{user_id}-{n}", [(10, 60)], token_windows=[(5000, 60)],
                               tokens=10, scopes=[cap]).allowed
    r = limiter.reserve(user_id, [(10, 60)], token_windows=[(5000, 60)], tokens=10, scopes=[cap])
    assert (r.allowed, r.scope, r.resource, r.window_seconds, r.member) == (
        False, cap, "requests", 60, "")
    assert r.retry_after_s >= 1
    assert redis_client.exists(f"ratelimit:{user_id}:60", f"ratelimit:{user_id}:60:tokens") == 0
    assert logged_entries(redis_client, UP_KEY) == 2
    # The tenant's windows say untouched (never reached, or all of their budget left).
    own = [w for w in r.windows if w.scope is None]
    assert own and all(w.remaining in (None, w.limit) for w in own)


@pytest.mark.parametrize("two_step", [False, True])
def test_a_request_the_tenant_refuses_leaves_the_upstream_untouched(
        limiter: Any, redis_client: redis.Redis, user_id: str, two_step: bool) -> None:
    set_two_step(limiter, two_step)
    cap = upstream(per_minute=30, tokens_per_minute=1000)
    first = limiter.reserve(user_id, [(1, 60)], token_windows=[(100, 60)], tokens=40,
                            scopes=[cap])
    assert first.allowed
    before = {k: redis_client.zrange(k, 0, -1, withscores=True) for k in (UP_KEY, UP_TOKENS)}
    weights_before = redis_client.hgetall(f"{UP_TOKENS}:w")
    r = limiter.reserve(user_id, [(1, 60)], token_windows=[(100, 60)], tokens=40, scopes=[cap])
    assert (r.allowed, r.scope, r.member) == (False, None, "")
    assert {k: redis_client.zrange(k, 0, -1, withscores=True) for k in (UP_KEY, UP_TOKENS)} \
        == before
    assert redis_client.hgetall(f"{UP_TOKENS}:w") == weights_before
    # A token refusal: the tenant's request window keeps its budget too.
    other = f"{user_id}-t"
    r = limiter.reserve(other, [(5, 60)], token_windows=[(50, 60)], tokens=60 - 20,
                        scopes=[cap])
    assert r.allowed
    r = limiter.reserve(other, [(5, 60)], token_windows=[(50, 60)], tokens=40, scopes=[cap])
    assert not r.allowed and r.resource == "tokens" and r.scope is None
    assert logged_entries(redis_client, f"ratelimit:{other}:60") == 1
    assert logged_entries(redis_client, UP_KEY) == 2


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
@pytest.mark.parametrize("two_step", [False, True])
def test_reconcile_corrects_the_upstream_token_windows_with_the_tenants(
        limiter: Any, redis_client: redis.Redis, user_id: str, two_step: bool) -> None:
    set_two_step(limiter, two_step)
    cap = upstream(per_minute=30, tokens_per_minute=10_000)
    route = Scope("model:gpt-4o", token_windows=[(5000, 60)])
    r = limiter.reserve(user_id, [(10, 60)], token_windows=[(8000, 60)], tokens=900,
                        scopes=[cap, route])
    assert r.allowed
    assert r.remaining_of("tokens", cap) == 9100 and r.remaining_of("tokens", None) == 7100
    tenant_tokens = f"ratelimit:{user_id}:60:tokens"
    route_tokens = f"ratelimit:{user_id}:60:tokens:scope=model%3Agpt-4o"
    assert limiter.reconcile(r, 123) == 3
    assert limiter.reconcile(r, 123) == 3  # idempotent
    members = {tenant_tokens: r.member, route_tokens: r.member,
               UP_TOKENS: r.shared_entries[0][0] if two_step else r.member}
    for key, member in members.items():
        assert cost_of(redis_client, key, member) == 123, key
    # The request windows kept their one request.
    assert cost_of(redis_client, f"ratelimit:{user_id}:60", r.member) == 1
    assert logged_entries(redis_client, UP_KEY) == 1


# ------------------------------------------------- the test: 3 tenants, cap 30/min

TENANTS = 3
CALLERS_PER_TENANT = 4
ATTEMPTS_PER_CALLER = 12  # 144 attempts for 30 places


def check_exactly_30(redis_client: redis.Redis, tenants: list[str],
                     answers: list[tuple[str, Reservation]]) -> None:
    admitted = [(tenant, r) for tenant, r in answers if r.allowed]
    assert len(answers) == TENANTS * CALLERS_PER_TENANT * ATTEMPTS_PER_CALLER
    assert len(admitted) == 30
    assert all(r.scope is not None and r.scope.shared for _, r in answers if not r.allowed)
    assert logged_entries(redis_client, UP_KEY) == 30
    for tenant in tenants:
        logged = entries(redis_client, f"ratelimit:{tenant}:60")
        mine = {r.member for t, r in admitted if t == tenant}
        # Exactly the admitted requests: no entry for a request the upstream refused.
        assert logged == mine


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
@pytest.mark.parametrize("two_step", [False, True])
def test_three_tenants_threads_on_one_upstream_capped_at_30_get_exactly_30(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis, user_id: str,
        two_step: bool) -> None:
    limiter = make_limiter(redis_url)
    set_two_step(limiter, two_step)
    cap = upstream(per_minute=30)
    tenants = [f"{user_id}-{n}" for n in range(TENANTS)]
    answers: list[tuple[str, Reservation]] = []
    lock = threading.Lock()
    start = threading.Barrier(TENANTS * CALLERS_PER_TENANT)
    deadline = time.monotonic() + 30

    def caller(tenant: str) -> None:
        start.wait(timeout=10)
        for _ in range(ATTEMPTS_PER_CALLER):
            assert time.monotonic() < deadline
            r = limiter.reserve(tenant, [(100, 60)], scopes=[cap])
            with lock:
                answers.append((tenant, r))

    threads = [threading.Thread(target=caller, args=(t,)) for t in tenants
               for _ in range(CALLERS_PER_TENANT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=40)
        assert not t.is_alive()
    check_exactly_30(redis_client, tenants, answers)


@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="coroutines on one loop; the threads "
                           "test above covers the blocking limiter")
@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
@pytest.mark.parametrize("two_step", [False, True])
def test_three_tenants_coroutines_on_one_upstream_capped_at_30_get_exactly_30(
        make_limiter: LimiterFactory, loop_factory: Any, redis_url: str,
        redis_client: redis.Redis, user_id: str, two_step: bool) -> None:
    limiter = make_limiter.native(redis_url)
    limiter._two_step_scopes = two_step
    cap = upstream(per_minute=30)
    tenants = [f"{user_id}-{n}" for n in range(TENANTS)]

    async def caller(tenant: str) -> list[tuple[str, Reservation]]:
        return [(tenant, await limiter.reserve(tenant, [(100, 60)], scopes=[cap]))
                for _ in range(ATTEMPTS_PER_CALLER)]

    async def main() -> list[tuple[str, Reservation]]:
        results = await asyncio.wait_for(asyncio.gather(
            *(caller(t) for t in tenants for _ in range(CALLERS_PER_TENANT))), timeout=30)
        await limiter.aclose()
        return [pair for batch in results for pair in batch]

    loop = loop_factory()
    try:
        answers = loop.run_until_complete(main())
    finally:
        loop.close()
    check_exactly_30(redis_client, tenants, answers)


# ------------------------------------------------------------ the two-step path itself

def test_two_steps_refund_the_upstream_exactly_when_the_tenant_refuses(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    set_two_step(limiter, True)
    cap = upstream(per_minute=30, tokens_per_minute=1000)
    kept = limiter.reserve(user_id, [(1, 60)], token_windows=[(500, 60)], tokens=300,
                           scopes=[cap])
    assert kept.allowed and len(kept.shared_entries) == 1
    snapshot = {k: redis_client.zrange(k, 0, -1, withscores=True) for k in (UP_KEY, UP_TOKENS)}
    extra = redis_client.hget(f"{UP_TOKENS}:w", "")
    r = limiter.reserve(user_id, [(1, 60)], token_windows=[(500, 60)], tokens=300, scopes=[cap])
    assert not r.allowed and r.scope is None and r.shared_entries == ()
    # The first step's entry was logged, then reconciled to 0: the upstream is as before.
    assert {k: redis_client.zrange(k, 0, -1, withscores=True) for k in (UP_KEY, UP_TOKENS)} \
        == snapshot
    assert redis_client.hget(f"{UP_TOKENS}:w", "") == extra
    # Its windows report the budget it had, not a charge.
    shared_states = [w for w in r.windows if w.scope == cap]
    assert sorted((w.resource, w.remaining) for w in shared_states) == [
        ("requests", 29), ("tokens", 700)]


def test_two_steps_with_two_upstreams_refund_the_first_when_the_second_refuses(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    set_two_step(limiter, True)
    a = Scope("provider-a", windows=[(5, 60)], shared=True)
    b = Scope("provider-b", windows=[(1, 60)], shared=True)
    assert limiter.reserve(user_id, [(9, 60)], scopes=[a, b]).allowed
    r = limiter.reserve(user_id, [(9, 60)], scopes=[a, b])
    assert not r.allowed and r.scope == b
    assert logged_entries(redis_client, "ratelimit:provider-a:60:shared") == 1
    assert logged_entries(redis_client, f"ratelimit:{user_id}:60") == 1


@pytest.mark.limiter_kinds("sync", reason="the plan is one object for both limiters: driven "
                            "here by hand with the blocking calls")
@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_a_crash_between_the_steps_costs_one_entry_in_the_upstream_only(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        user_id: str) -> None:
    """The plan is driven by hand with the real limiter's calls; after the first step the
    process "dies" (the plan is dropped, nothing more is sent). The tenant is untouched; the
    upstream holds the entry until it leaves its window (its expiry says when)."""
    native = make_limiter(redis_url)
    plan = reserve_plan(user_id, [(10, 60)], 1, (), None, [upstream()], True)
    name, positional, keywords = next(plan)
    assert name == "validate"
    name, positional, keywords = plan.send(None)
    assert name == "reserve" and positional == (user_id, ())
    native._reserve(*positional, **keywords)
    plan.close()  # the crash: the second step never runs, the first is never refunded
    assert logged_entries(redis_client, UP_KEY) == 1
    assert 0 < redis_client.ttl(UP_KEY) <= 61
    assert not redis_client.keys(f"ratelimit:{user_id}*")


@pytest.mark.limiter_kinds("sync", reason="the plan is one object for both limiters: driven "
                            "here by hand with the blocking calls")
def test_a_failing_second_step_is_refunded_and_raises(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        user_id: str) -> None:
    limiter = make_limiter(redis_url)
    plan = reserve_plan(user_id, [(10, 60)], 1, (), None, [upstream()], True)
    next(plan)
    call = plan.send(None)
    call = plan.send(limiter._reserve(*call[1], **call[2]))
    assert call[0] == "reserve" and call[1] == (user_id, ((10, 60),))
    refund = plan.throw(RateLimiterUnavailable("Redis went away mid-decision"))
    assert refund[0] == "reconcile" and refund[2]["scopes"][0][:2] == (UPSTREAM, True)
    assert limiter._reconcile(*refund[1], **refund[2]) == 1
    with pytest.raises(RateLimiterUnavailable, match="went away"):
        plan.send(1)
    assert logged_entries(redis_client, UP_KEY) == 0


# ----------------------------------------------------------------- errors before any I/O

@pytest.mark.parametrize("scopes, error, message", [
    (Scope("x", windows=[(1, 60)]), TypeError, "sequence of Scope"),
    (["x"], TypeError, "Scope objects"),
    ([Scope("x", windows=[(1, 60)]), Scope("x", windows=[(2, 60)], shared=True)], ValueError,
     "appears twice"),
    ([Scope(f"s{n}", windows=[(1, 60)]) for n in range(9)], ValueError, "at most 8 scopes"),
    ([Scope("x", windows=[(1, 60), (2, 60)])], ValueError, "appears twice"),
    ([Scope("x", windows=[(3, 60)])], ValueError, "cost 5 can never be allowed: the window of "
                                                  "60 s of scope 'x' allows at most 3"),
    ([Scope("x", token_windows=[(100, 60)])], ValueError, "need tokens="),
])
def test_bad_scopes_are_refused_before_any_io(unreachable_limiter: Any, scopes: Any,
                                              error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        unreachable_limiter.reserve("u", [(10, 60)], cost=5 if "cost" in message else 1,
                                    scopes=scopes)
    set_two_step(unreachable_limiter, True)
    with pytest.raises(error, match=message):
        unreachable_limiter.reserve("u", [(10, 60)], cost=5 if "cost" in message else 1,
                                    scopes=[*scopes, upstream()] if isinstance(scopes, list)
                                    and len(scopes) < 8 else scopes)


@pytest.mark.parametrize("arguments, error, message", [
    ({"name": ""}, ValueError, "1 to 256 bytes"),
    ({"name": "x" * 257}, ValueError, "1 to 256 bytes"),
    ({"name": 7}, TypeError, "name must be a str"),
    ({"name": "\ud800", "windows": [(1, 60)]}, ValueError, "surrogate"),
    ({"name": "x"}, ValueError, "at least one window"),
    ({"name": "x", "windows": "60"}, TypeError, "sequence of"),
    ({"name": "x", "windows": [(1, 60, 3)]}, TypeError, "pair"),
    ({"name": "x", "windows": [(True, 60)]}, TypeError, "ints"),
    ({"name": "x", "windows": [(0, 60)]}, ValueError, "positive"),
    ({"name": "x", "windows": [(1, 60)], "shared": 1}, TypeError, "bool"),
])
def test_a_bad_scope_is_refused_when_made(arguments: dict[str, Any], error: type[Exception],
                                          message: str) -> None:
    with pytest.raises(error, match=message):
        Scope(**arguments)


def test_the_kill_switch_allows_scoped_requests_and_writes_nothing(
        limiter: Any, redis_client: redis.Redis, user_id: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "1")
    for two_step in (False, True):
        set_two_step(limiter, two_step)
        r = limiter.reserve(user_id, [(10, 60)], scopes=[upstream(per_minute=1)])
        assert r.allowed and r.member == "" and limiter.reconcile(r, 0) == 0
    assert redis_client.keys("*") == []


def test_reset_forgets_a_users_own_scopes_and_never_a_shared_cap(
        limiter: Any, redis_client: redis.Redis, user_id: str) -> None:
    route = Scope("route:/v1/chat", windows=[(5, 60)], token_windows=[(500, 60)])
    cap = upstream(per_minute=30, tokens_per_minute=900)
    neighbour = Scope("x", windows=[(5, 60)])
    assert limiter.reserve(user_id, [(10, 60)], token_windows=[(1000, 60)], tokens=7,
                           scopes=[route, cap]).allowed
    # A user whose id starts like this one's keys ("<id>:5:scope=x" and "<id>:scope=y").
    assert limiter.reserve(f"{user_id}:5", [(10, 60)], scopes=[neighbour]).allowed
    assert limiter.reserve(f"{user_id}:scope=y", [(10, 60)]).allowed
    others = {k for k in redis_client.keys("*") if not k.decode().startswith(f"ratelimit:{user_id}:6")}
    assert limiter.reset(user_id) == 4  # the own request and token windows, the route's two
    assert set(redis_client.keys("*")) == others
    assert logged_entries(redis_client, UP_KEY) == 1 and logged_entries(redis_client, UP_TOKENS) == 1
