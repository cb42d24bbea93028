"""Reserved shares of a shared cap (docs/upstreams.md, "Reserved shares"): per class, a
share the class keeps for itself and a ceiling it may not pass once the cap is above a
saturation level, decided in the cap's own script (lua/lib/shares.lua) on every limiter
kind and both storages; the refusal names its rule; a cap without shares costs no command
more; bad input is refused before any I/O."""

from __future__ import annotations

import asyncio
import threading
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
import redis
from fastapi import Depends, FastAPI, Request
from fastapi.testclient import TestClient

from genai_ratelimit import Scope, ShareRefusal
from genai_ratelimit.fastapi import RateLimit, RateLimitHeadersMiddleware, Upstream
from genai_ratelimit.testing import ManualClock
from helpers_async import LimiterFactory

CAP = "openai"


@pytest.fixture(autouse=True)
def _flushed(redis_client: redis.Redis) -> None:
    """Every test starts on a flushed database (redis_client flushes it)."""


def cap(limit: int = 10, seconds: int = 60, **shares: Any) -> Scope:
    return Scope(CAP, windows=[(limit, seconds)], shared=True, **shares)


def refusal(reservation: Any) -> tuple[str, str] | None:
    r = reservation.share_refusal
    return None if r is None else (r.rule, r.share_class)


def take(limiter: Any, scope: Scope, klass: str | None, count: int) -> list[Any]:
    return [limiter.reserve(f"{klass}-{i}", [(1000, 60)], scopes=[scope], scope_class=klass)
            for i in range(count)]


def activate(limiter: Any, scope: Scope, klass: str | None) -> None:
    """Makes `klass` active in the cap (it sent a request within the window) while holding
    nothing of it: a reservation refunded at once."""
    reservation = limiter.reserve(f"active-{klass}", [(1000, 60)], scopes=[scope],
                                  scope_class=klass)
    assert reservation.allowed
    limiter.reconcile(reservation, 0)


def companion(storage: str, klass: str, seconds: int = 60) -> str:
    suffix = ":c" if storage == "compact" else ""
    return f"ratelimit:{CAP}:{seconds}:shared{suffix}:class={klass}"


def test_a_reserve_is_kept_from_every_other_class_while_its_class_is_active(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        storage: str) -> None:
    limiter = make_limiter(redis_url)
    scope = cap(reserved={"enterprise": 30}, ceilings={"free": (50, 80)})
    activate(limiter, scope, "enterprise")  # it sent a request in the window: its reserve binds
    free = take(limiter, scope, "free", 9)
    # 10 - 3 reserved: the free class is refused at 7, by enterprise's reserve.
    assert [r.allowed for r in free] == [True] * 7 + [False] * 2
    assert [r.remaining for r in free[:7]] == [6, 5, 4, 3, 2, 1, 0]
    assert refusal(free[7]) == ("reserve", "enterprise")
    assert free[7].scope == scope and free[7].scope_class == "free"
    assert "reserved for class 'enterprise'" in free[7].share_refusal.describe()
    # The untracked requests of the cap (no class) are held off the reserve the same way.
    assert refusal(limiter.reserve("anon", [(5, 60)], scopes=[scope])) == ("reserve", "enterprise")
    enterprise = take(limiter, scope, "enterprise", 4)
    assert [r.allowed for r in enterprise] == [True, True, True, False]
    assert enterprise[3].share_refusal is None  # the cap itself is full: no share rule
    assert redis_client.zcard(companion(storage, "free")) == 7


def test_a_used_reserve_holds_nothing_more_and_its_class_shares_the_rest(
        make_limiter: LimiterFactory, redis_url: str) -> None:
    limiter = make_limiter(redis_url)
    scope = cap(reserved={"enterprise": 30, "pro": 20})
    activate(limiter, scope, "pro")
    assert all(r.allowed for r in take(limiter, scope, "enterprise", 4))  # 1 past its 3
    # free (no share) may take 10 - 4 - 2 (pro's reserve): 4.
    assert [r.allowed for r in take(limiter, scope, None, 5)] == [True] * 4 + [False]
    assert all(r.allowed for r in take(limiter, scope, "pro", 2))
    assert not take(limiter, scope, "pro", 1)[0].allowed


def test_the_ceiling_holds_once_the_cap_is_above_its_saturation(
        make_limiter: LimiterFactory, redis_url: str) -> None:
    limiter = make_limiter(redis_url)
    scope = cap(ceilings={"free": (50, 80)}, reserved={"pro": 0})
    activate(limiter, scope, "pro")  # another class is active: free's ceiling binds
    # free may fill the cap up to its saturation (8 of 10): past it, its ceiling (5).
    free = take(limiter, scope, "free", 9)
    assert [r.allowed for r in free] == [True] * 8 + [False]
    assert refusal(free[8]) == ("ceiling", "free")
    assert "ceiling" in free[8].share_refusal.describe()
    assert all(r.allowed for r in take(limiter, scope, "pro", 2))  # pro: no ceiling


def test_with_no_other_class_active_a_class_may_use_the_whole_cap(
        make_limiter: LimiterFactory, redis_url: str) -> None:
    """Work-conserving: a reserve binds only while its class is active, a ceiling only
    while another class is (docs/upstreams.md, "Reserved shares")."""
    limiter = make_limiter(redis_url)
    scope = cap(reserved={"enterprise": 30}, ceilings={"free": (50, 80)})
    free = take(limiter, scope, "free", 11)
    assert [r.allowed for r in free] == [True] * 10 + [False]
    assert free[10].share_refusal is None  # the cap itself is full


def test_a_refused_class_becomes_active(make_limiter: LimiterFactory, redis_url: str) -> None:
    with ManualClock() as clock:
        limiter = make_limiter(redis_url, clock="client")
        scope = cap(reserved={"enterprise": 30, "free": 0})
        assert all(r.allowed for r in take(limiter, scope, "free", 10))
        clock.advance(30)
        assert not take(limiter, scope, "enterprise", 1)[0].allowed  # the cap is full
        clock.advance(31)  # free's entries left; enterprise asked within the window
        assert [r.allowed for r in take(limiter, scope, "free", 8)] == [True] * 7 + [False]
        clock.advance(61)  # enterprise asked nothing for a window: its reserve lapses
        assert all(r.allowed for r in take(limiter, scope, "free", 10))


def test_under_saturation_free_stops_at_its_ceiling(
        make_limiter: LimiterFactory, redis_url: str) -> None:
    limiter = make_limiter(redis_url)
    scope = cap(ceilings={"free": (20, 50)}, reserved={"pro": 0})
    assert all(r.allowed for r in take(limiter, scope, "pro", 5))  # 5: not above 50 %
    free = take(limiter, scope, "free", 3)
    # 6 and 7 are above 5: free may hold 2 (20 %), the third is refused by its ceiling.
    assert [r.allowed for r in free] == [True, True, False]
    assert [r.remaining for r in free[:2]] == [1, 0]
    assert refusal(free[2]) == ("ceiling", "free")
    assert all(r.allowed for r in take(limiter, scope, "pro", 3))  # pro fills the cap
    assert not take(limiter, scope, "pro", 1)[0].allowed


def test_a_ceiling_refusal_waits_for_the_classs_own_oldest_entry(
        make_limiter: LimiterFactory, redis_url: str) -> None:
    with ManualClock() as clock:
        limiter = make_limiter(redis_url, clock="client")
        scope = cap(ceilings={"free": (20, 50)}, reserved={"pro": 0})
        assert all(r.allowed for r in take(limiter, scope, "pro", 5))
        clock.advance(10)
        assert all(r.allowed for r in take(limiter, scope, "free", 2))
        refused = take(limiter, scope, "free", 1)[0]
        assert refusal(refused) == ("ceiling", "free")
        assert refused.retry_after_ms == 60_000  # free's first entry leaves in 60 s
        clock.advance(60)
        # free's two left with pro's five: the cap is at 0.
        assert take(limiter, scope, "free", 1)[0].allowed


def test_reserved_shares_cost_a_cap_without_them_no_command(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    """A shared cap without shares runs none of the commands of the shares' class logs
    (benchmarks/RESULTS.md: its counts equal the build's before shares, per storage)."""
    limiter = make_limiter(redis_url)

    def commands(scope: Scope) -> dict[str, int]:
        limiter.reserve("warm", [(50, 60)], scopes=[scope])
        redis_client.config_resetstat()
        for i in range(5):
            assert limiter.reserve(f"t{i}", [(50, 60)], scopes=[scope]).allowed
        stats = {k: v["calls"] for k, v in redis_client.info("commandstats").items()}
        stats.pop("cmdstat_config|resetstat", None)
        redis_client.flushdb()
        return stats

    shares_own = {"cmdstat_zrangebyscore", "cmdstat_hset", "cmdstat_pexpire"}
    plain = commands(Scope(CAP, [(50, 60)], shared=True))
    # One EXISTS for the provider's view and one for the wait queue per admission.
    assert plain["cmdstat_evalsha"] == 5 and plain["cmdstat_exists"] == 10
    assert not shares_own & set(plain)
    limiter.reserve("warm", [(50, 60)], scopes=[cap(50, reserved={"enterprise": 30})],
                    scope_class="enterprise")
    redis_client.config_resetstat()
    limiter.reserve("t", [(50, 60)], scopes=[cap(50, reserved={"enterprise": 30})],
                    scope_class="enterprise")
    assert shares_own <= set(redis_client.info("commandstats"))


def test_a_refusal_writes_nothing_and_reconcile_moves_the_class_log(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        storage: str) -> None:
    limiter = make_limiter(redis_url)
    scope = cap(reserved={"enterprise": 30}, ceilings={"free": (50, 80)})
    activate(limiter, scope, "enterprise")
    held = take(limiter, scope, "free", 7)
    active = f"ratelimit:{CAP}:shares:active".encode()
    before = {k: redis_client.dump(k) for k in redis_client.keys("*") if k != active}
    assert not take(limiter, scope, "free", 1)[0].allowed
    after = {k: redis_client.dump(k) for k in redis_client.keys("*") if k != active}
    assert before == after  # but the activity stamp of its class
    assert redis_client.hexists(active, "free")
    # reconcile refunds the cap and the class's log in the same script: free gets the room
    # back, and its log no longer counts the entry.
    limiter.reconcile(held[0], 0)
    assert redis_client.zcard(companion(storage, "free")) == 6
    assert redis_client.hget(companion(storage, "free") + ":w", "total") == b"6"
    assert [r.allowed for r in take(limiter, scope, "free", 2)] == [True, False]
    # An enterprise entry refunded gives its reserve back whole: 3 held again, not 2.
    ent = take(limiter, scope, "enterprise", 1)[0]
    limiter.reconcile(ent, 0)
    assert redis_client.hget(companion(storage, "enterprise") + ":w", "total") == b"0"
    assert refusal(take(limiter, scope, "free", 1)[0]) == ("reserve", "enterprise")
    # A higher cost charges the class's log as it charges the cap (and twice is once).
    ent = take(limiter, scope, "enterprise", 1)[0]
    assert limiter.reconcile(ent, 2) == limiter.reconcile(ent, 2)
    assert redis_client.hget(companion(storage, "enterprise") + ":w", "total") == b"2"
    assert [r.allowed for r in take(limiter, scope, "enterprise", 2)] == [True, False]


def test_token_shares_follow_reconcile(make_limiter: LimiterFactory, redis_url: str,
                                       redis_client: redis.Redis, storage: str) -> None:
    """A token cap with a ceiling: the estimate is held in the class's log, the actual
    tokens replace it there as in the cap."""
    limiter = make_limiter(redis_url)
    scope = Scope(CAP, token_windows=[(1000, 60)], shared=True, reserved={"pro": 0},
                  ceilings={"free": (50, 80)})
    limiter.reserve("p", token_windows=[(10**6, 60)], tokens=1, scopes=[scope],
                    scope_class="pro")  # pro is active: free's ceiling binds
    r = limiter.reserve("u", token_windows=[(10**6, 60)], tokens=600, scopes=[scope],
                        scope_class="free")
    assert r.allowed
    key = f"ratelimit:{CAP}:60:tokens:shared{':c' if storage == 'compact' else ''}:class=free:w"
    assert redis_client.hget(key, "total") == b"600"
    # 1 + 600 + 250 > 800 (saturation) and free would hold 850 > 500: its ceiling.
    assert refusal(limiter.reserve("v", token_windows=[(10**6, 60)], tokens=250,
                                   scopes=[scope], scope_class="free")) == ("ceiling", "free")
    limiter.reconcile(r, 300)
    assert redis_client.hget(key, "total") == b"300"
    assert limiter.reserve("v", token_windows=[(10**6, 60)], tokens=250, scopes=[scope],
                           scope_class="free").allowed


def test_a_lost_reply_is_replayed_and_counts_once_in_the_class_log(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        storage: str) -> None:
    """The replay marker goes after the shares' spec: the replay finds the first attempt's
    entry and logs nothing again, in the cap nor in the class's log."""
    from helpers_core import window_script
    from test_idempotent_retry import ReplyDroppingProxy

    redis_client.script_load(window_script(storage)[1])
    port = redis_client.connection_pool.connection_kwargs["port"]
    proxy = ReplyDroppingProxy(port, drop=1)
    scope = cap(reserved={"enterprise": 30}, ceilings={"free": (50, 80)})
    try:
        with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as limiter:
            r = limiter.reserve("u", [(100, 60)], scopes=[scope], scope_class="free")
    finally:
        proxy.close()
    assert len(proxy.dropped_replies) == 1 and r.allowed and r.share_refusal is None
    assert redis_client.zcard(companion(storage, "free")) == 1
    assert redis_client.hget(companion(storage, "free") + ":w", "total") == b"1"
    limiter = make_limiter(redis_url)
    activate(limiter, scope, "enterprise")
    assert [x.allowed for x in take(limiter, scope, "free", 7)] == [True] * 6 + [False]


def test_every_integer_is_computed_once_and_exactly() -> None:
    from genai_ratelimit.shares import spec

    scope = Scope(CAP, [(7, 60)], token_windows=[(1000, 60)], shared=True,
                  reserved={"enterprise": Decimal("33.3"), "pro": "12.5"},
                  ceilings={"free": (Fraction(100, 3), 80)})
    # floor(7 * 33.3 / 100) = 2, floor(7 * 12.5 / 100) = 0, floor(7 / 3) = 2, floor(5.6) = 5
    assert spec(scope, 1, "free") == (
        "S 1 2 3 enterprise free pro 2 60000 requests 2 7 7 0 2 5 0 7 7 "
        "60000 tokens 333 1000 1000 0 333 800 125 1000 1000")


@pytest.mark.parametrize("shares, message", [
    ({"reserved": {"enterprise": 101}}, "reserved['enterprise'] must be in [0, 100]"),
    ({"reserved": {"enterprise": 60, "pro": 41}}, "sum to 101 %, above 100 %"),
    ({"reserved": {"enterprise": -1}}, "reserved['enterprise'] must be in [0, 100]"),
    ({"ceilings": {"free": (0, 80)}}, "ceilings['free'] ceiling must be in (0, 100]"),
    ({"ceilings": {"free": (50, 100.5)}}, "float is never exact"),
    ({"ceilings": {"free": (50, 120)}}, "ceilings['free'] saturation must be in (0, 100]"),
    ({"ceilings": {"free": 50}}, "ceilings['free'] must be a (ceiling, saturation) pair"),
    ({"reserved": {"enterprise": 0.3}}, "float is never exact"),
    ({"reserved": {"enterprise": "abc"}}, "reserved['enterprise'] must be a number"),
    ({"reserved": {"a b": 10}}, "class name 'a b' must be"),
    ({"reserved": [("enterprise", 10)]}, "reserved must be a mapping"),
])
def test_bad_shares_are_refused_naming_the_field(shares: dict[str, Any], message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message.replace("(", r"\(").replace(
            ")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        cap(**shares)


def test_shares_need_a_shared_scope() -> None:
    with pytest.raises(ValueError, match="need shared=True"):
        Scope("route:/x", [(10, 60)], reserved={"enterprise": 10})


def test_bad_classes_are_refused_before_any_io(unreachable_limiter: Any) -> None:
    scope = cap(reserved={"enterprise": 30})
    with pytest.raises(ValueError, match="scope_class 'gold' is not a class of scope 'openai'"):
        unreachable_limiter.reserve("u", [(5, 60)], scopes=[scope], scope_class="gold")
    with pytest.raises(TypeError, match="scope_class must be a str"):
        unreachable_limiter.reserve("u", [(5, 60)], scopes=[scope], scope_class=3)
    with pytest.raises(ValueError, match="needs a shared Scope with reserved or ceilings"):
        unreachable_limiter.reserve("u", [(5, 60)], scopes=[Scope(CAP, [(5, 60)], shared=True)],
                                    scope_class="enterprise")
    with pytest.raises(ValueError, match="in_flight"):
        unreachable_limiter.reserve("u", [(5, 60)], scopes=[scope], scope_class="enterprise",
                                    in_flight=(2, 30))
    with pytest.raises(ValueError, match="at most one scope with reserved shares"):
        unreachable_limiter.reserve("u", [(5, 60)], scopes=[
            scope, Scope("other", [(5, 60)], shared=True, reserved={"enterprise": 1})])


SAMPLE = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = redis.call('ZCOUNT', key, '(' .. (now_ms - tonumber(ARGV[1])), '+inf')
end
return out
"""


def test_concurrent_classes_never_break_the_rules(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        storage: str) -> None:
    """A cap of 100 (60 s): pro fills 51 (above 50 %), then 3 classes hammer it at once.
    Sampled atomically in Redis all along: free <= its ceiling of 20, and the classes other
    than enterprise never hold more than 100 - max(enterprise, 30). At the end the cap is
    full and enterprise holds at least its 30 (its demand, 72, is above it)."""
    scope = cap(100, reserved={"enterprise": 30, "pro": 0}, ceilings={"free": (20, 50)})
    keys = [companion(storage, k) for k in ("enterprise", "free", "pro")]
    samples: list[list[int]] = []
    stop = threading.Event()

    def sample() -> None:
        sampler = redis.Redis.from_url(redis_url)
        while not stop.is_set():
            samples.append(sampler.eval(SAMPLE, 3, *keys, 60_000))
        sampler.close()

    sync = make_limiter(redis_url)
    assert all(r.allowed for r in take(sync, scope, "pro", 51))
    sampler = threading.Thread(target=sample)
    sampler.start()
    demand = [(k, n) for k in ("enterprise", "free", "pro") for n in range(6)]
    try:
        if make_limiter.is_async:
            native = make_limiter.native(redis_url)

            async def hammer() -> None:
                await asyncio.gather(*(
                    native.reserve(f"{k}{n}-{i}", [(1000, 60)], scopes=[scope], scope_class=k)
                    for k, n in demand for i in range(12)))

            assert make_limiter.loop_factory is not None
            loop = make_limiter.loop_factory()
            try:
                loop.run_until_complete(hammer())
            finally:
                loop.run_until_complete(native.aclose())
                loop.close()
        else:
            def worker(k: str, n: int) -> None:
                for i in range(12):
                    sync.reserve(f"{k}{n}-{i}", [(1000, 60)], scopes=[scope], scope_class=k)

            threads = [threading.Thread(target=worker, args=pair) for pair in demand]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        stop.set()
        sampler.join()
    samples.append(redis_client.eval(SAMPLE, 3, *keys, 60_000))
    assert len(samples) > 1
    for enterprise, free, pro in samples:
        assert free <= 20
        assert free + pro <= 100 - max(enterprise, 30)
    enterprise, free, pro = samples[-1]
    assert enterprise + free + pro == 100 and enterprise >= 30 and free <= 20


def test_share_refusal_is_exported() -> None:
    import genai_ratelimit

    assert genai_ratelimit.ShareRefusal is ShareRefusal


# --------------------------------------------------------------------------- FastAPI


@pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async "
                                "tests drive on hiredis 1.x")
def test_fastapi_upstream_shares_follow_the_tier_and_the_429_names_the_rule(
        make_limiter: LimiterFactory, redis_url: str) -> None:
    tiers = {t: {"per_minute": 100, "per_day": 1000} for t in ("free", "pro", "enterprise")}
    upstream = Upstream(CAP, per_minute=10, reserved={"enterprise": 30},
                        ceilings={"free": (50, 80)})
    budget = RateLimit(make_limiter.native(redis_url), tier_limits=tiers,
                       identify=lambda request: (request.headers["x-user"],
                                                 request.headers["x-tier"]),
                       upstream=upstream)
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)

    @app.post("/v1/chat/completions", dependencies=[Depends(budget)])
    async def chat(request: Request) -> dict[str, bool]:
        return {"ok": True}

    def post(client: TestClient, tier: str, n: int) -> Any:
        return client.post("/v1/chat/completions", json={},
                           headers={"x-user": f"{tier}-{n}", "x-tier": tier})

    with TestClient(app) as client:
        first = post(client, "enterprise", 9).status_code  # enterprise is active
        # enterprise holds 1 of its 3: 2 kept for it, 7 for the others
        free = [post(client, "free", n).status_code for n in range(8)]
        refused = post(client, "free", 9)
        pro = [post(client, "pro", n).status_code for n in range(2)]  # no share: held off too
        enterprise = [post(client, "enterprise", n).status_code for n in range(3)]
    assert first == 200
    assert free == [200] * 7 + [429]
    assert refused.status_code == 429
    assert refused.headers["x-ratelimit-scope"] == "upstream"
    assert refused.headers["x-ratelimit-share"] == "reserve; class=enterprise"
    assert "reserved for class 'enterprise'" in refused.json()["error"]["message"]
    assert pro == [429, 429]
    assert enterprise == [200, 200, 429]


def test_bad_upstream_shares_are_refused_at_startup() -> None:
    with pytest.raises(ValueError, match="reserved shares sum to 110 %"):
        Upstream(CAP, per_minute=10, reserved={"enterprise": 60, "pro": 50})
    with pytest.raises(ValueError, match=r"ceilings\['free'\] saturation must be in"):
        Upstream(CAP, per_minute=10, ceilings={"free": (50, 0)})


@pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async "
                                "tests drive on hiredis 1.x")
def test_a_tiers_files_upstream_keeps_its_shares(
        make_limiter: LimiterFactory, redis_url: str, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text(
        "[free]\nper_minute = 100\nper_day = 1000\n"
        "[enterprise]\nper_minute = 100\nper_day = 1000\n"
        f'[upstreams."{CAP}"]\nper_minute = 10\nreserved = {{ enterprise = "30" }}\n'
        "ceilings = { free = [50, 80] }\n")
    monkeypatch.setenv("GENAI_RATELIMIT_TIERS", str(tiers))
    budget = RateLimit(make_limiter.native(redis_url),
                       identify=lambda request: (request.headers["x-user"],
                                                 request.headers["x-tier"]))
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)

    @app.post("/v1/chat/completions", dependencies=[Depends(budget)])
    async def chat(request: Request) -> dict[str, bool]:
        return {"ok": True}

    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json={},
                           headers={"x-user": "e", "x-tier": "enterprise"}).status_code == 200
        codes = [client.post("/v1/chat/completions", json={},
                             headers={"x-user": f"u{n}", "x-tier": "free"}).status_code
                 for n in range(8)]
    assert codes == [200] * 7 + [429]


def test_shares_on_a_cluster_live_in_the_caps_slot(make_limiter: LimiterFactory,
                                                    redis_cluster: Any) -> None:
    """On a Redis Cluster the shared cap is a step of its own (its name is its hash tag): the
    class logs are named after the cap's keys, so they live in its slot, decided in its step."""
    from redis.cluster import RedisCluster as ClusterClient

    limiter = make_limiter(redis_cluster.url)
    scope = cap(reserved={"enterprise": 30}, ceilings={"free": (50, 80)})
    activate(limiter, scope, "enterprise")
    free = [limiter.reserve(f"free-{i}", [(100, 60)], scopes=[scope], scope_class="free")
            for i in range(8)]
    assert [r.allowed for r in free] == [True] * 7 + [False]
    assert refusal(free[-1]) == ("reserve", "enterprise")
    assert limiter.reserve("e", [(100, 60)], scopes=[scope], scope_class="enterprise").allowed
    inspector = ClusterClient(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        suffix = ":c" if make_limiter.storage == "compact" else ""
        assert inspector.zcard(f"ratelimit:{{{CAP}}}:60:shared{suffix}:class=free") == 7
    finally:
        inspector.close()


# --------------------------------------------------------------------------- the HTTP plan


@pytest.mark.parametrize("tier, klass", [("enterprise", "enterprise"), ("free", "free"),
                                         ("pro", None)])
def test_the_plan_passes_the_tier_as_the_class_when_the_upstream_names_it(
        tier: str, klass: str | None) -> None:
    from genai_ratelimit.fastapi._plan import Call, Facts, Policy, Refused, plan
    from genai_ratelimit.reservation import Reservation, WindowState

    upstream = cap(reserved={"enterprise": 30}, ceilings={"free": (50, 80)})
    steps = plan(Facts("alice", tier, ((5, 60),), scopes=(upstream,)),
                 Policy(clock=lambda: 1_000))
    call = next(steps)
    expected = {"scopes": (upstream,)} | ({"scope_class": klass} if klass else {})
    assert call == Call("reserve", ("alice", ((5, 60),)), expected)
    refused = Reservation(
        False, 0, 3, 60, "requests", 2_500, "alice", 1, None,
        (WindowState(5, 60, "requests", 4), WindowState(10, 60, "requests", 0, upstream)),
        "", 1_000, upstream, (upstream,),
        share_refusal=ShareRefusal(upstream, "ceiling", "free", "free"), scope_class=klass)
    with pytest.raises(StopIteration) as done:
        steps.send(refused)
    [verdict] = done.value.value.verdicts
    assert isinstance(verdict, Refused) and verdict.scope == "upstream"
    assert dict(verdict.contract)["X-RateLimit-Share"] == "ceiling; class=free"
    assert verdict.message is not None and "at its ceiling" in verdict.message
