"""Reserved shares of an in-flight cap (docs/upstreams.md, "Reserved shares"):
`acquire(name, limit, lease_seconds, shares=Shares(...), share_class=...)` decides a class's
reserve and ceiling in the lease's own script (lua/lease.lua, by lua/lib/shares.lua's
share_rule, the window caps' rule), work-conserving: a reserve binds while its class is
active, a ceiling while another class is. The per-class holders stay exact through release,
renew and expiry, and under concurrency; a refusal names its rule; bad input raises before
any I/O. Every test runs for every limiter kind against a real redis-server."""

from __future__ import annotations

import asyncio
import threading
from decimal import Decimal
from typing import Any

import pytest
import redis

from genai_ratelimit import AsyncRateLimiter, ShareRefusal, Shares, _native
from helpers_async import LimiterFactory, LoopFactory, run_async
from helpers_core import wait_until_server_ms
from test_idempotent_retry import ReplyDroppingProxy, redis_port  # noqa: F401 (a fixture)
from test_production_acl import acl_url, admin  # noqa: F401 (fixtures)

CAP = "openai/gpt-4o"
SHARES = Shares(reserved={"enterprise": 30}, ceilings={"free": (50, 80)})


@pytest.fixture(autouse=True)
def _flushed(redis_client: redis.Redis) -> None:
    """Every test starts on a flushed database (redis_client flushes it)."""


def class_key(klass: str) -> str:
    return f"ratelimit:{CAP}:leases:class={klass}"


def take(limiter: Any, klass: str | None, count: int, lease_seconds: int = 60,
         shares: Shares = SHARES) -> list[Any]:
    return [limiter.acquire(CAP, 10, lease_seconds, shares=shares, share_class=klass)
            for _ in range(count)]


def rule(lease: Any) -> tuple[str, str] | None:
    refusal = lease.share_refusal
    return None if refusal is None else (refusal.rule, refusal.share_class)


def test_a_class_alone_may_use_the_whole_cap(limiter: Any, redis_client: redis.Redis) -> None:
    free = take(limiter, "free", 11)
    # No other class is active: enterprise's reserve and free's ceiling do not bind.
    assert [lease.allowed for lease in free] == [True] * 10 + [False]
    assert free[10].share_refusal is None  # the cap itself is full
    assert redis_client.zcard(class_key("free")) == 10


def test_a_refused_class_becomes_active_and_its_reserve_binds_the_next_free_slots(
        limiter: Any, redis_client: redis.Redis) -> None:
    free = take(limiter, "free", 10)
    enterprise = take(limiter, "enterprise", 1)[0]
    assert not enterprise.allowed and enterprise.share_refusal is None  # the cap is full
    for lease in free[:3]:
        assert limiter.release(lease)
    again = take(limiter, "free", 1)[0]
    assert not again.allowed and rule(again) == ("reserve", "enterprise")
    assert isinstance(again.share_refusal, ShareRefusal)
    assert again.share_refusal.cap_name == CAP and again.share_refusal.request_class == "free"
    assert "reserved for class 'enterprise'" in again.share_refusal.describe()
    assert 1 <= again.retry_after_ms <= again.retry_bound_ms <= 60_000
    assert [lease.allowed for lease in take(limiter, "enterprise", 3)] == [True] * 3
    assert redis_client.zcard(class_key("enterprise")) == 3


def test_a_ceiling_binds_above_saturation_while_another_class_is_active(limiter: Any) -> None:
    assert all(lease.allowed for lease in take(limiter, "enterprise", 3))  # its reserve, used
    free = take(limiter, "free", 6)
    # 3 + 5 = 8 held: the 9th would pass the saturation (80 %) with free above 50 %.
    assert [lease.allowed for lease in free] == [True] * 5 + [False]
    assert rule(free[5]) == ("ceiling", "free")
    assert "at its ceiling" in free[5].share_refusal.describe()
    # A request of no class has no ceiling: it takes the rest.
    rest = take(limiter, None, 3)
    assert [lease.allowed for lease in rest] == [True, True, False]


def test_requests_of_no_class_are_held_off_an_active_reserve(limiter: Any) -> None:
    limiter.release(take(limiter, "enterprise", 1)[0])  # enterprise asked: active
    anonymous = take(limiter, None, 8)
    assert [lease.allowed for lease in anonymous] == [True] * 7 + [False]
    assert rule(anonymous[7]) == ("reserve", "enterprise")
    assert anonymous[7].share_refusal.request_class is None


def test_a_reserve_stops_binding_once_its_class_was_idle_for_a_lease(
        limiter: Any, redis_client: redis.Redis) -> None:
    asked = take(limiter, "enterprise", 1, lease_seconds=1)[0]
    assert limiter.release(asked)
    free = take(limiter, "free", 8, lease_seconds=30)
    assert [lease.allowed for lease in free] == [True] * 7 + [False]
    wait_until_server_ms(redis_client, asked.expires_at_ms + 1, timeout=5)
    # enterprise holds nothing and asked for nothing within its lease's length (1 s).
    assert [lease.allowed for lease in take(limiter, "free", 4)] == [True] * 3 + [False]


def test_release_and_renew_keep_the_class_holders_exact(limiter: Any,
                                                        redis_client: redis.Redis) -> None:
    enterprise = take(limiter, "enterprise", 2)
    free = take(limiter, "free", 3)
    assert limiter.release(free[0]) and not limiter.release(free[0])
    assert redis_client.zcard(class_key("free")) == 2
    assert limiter.renew(enterprise[1], 120)
    expiry = redis_client.zscore(class_key("enterprise"), enterprise[1].lease_id)
    assert expiry == redis_client.zscore(f"ratelimit:{CAP}:leases", enterprise[1].lease_id)
    assert redis_client.pttl(class_key("enterprise")) > 60_000
    assert limiter.release(enterprise[0])
    assert set(m.decode() for m in redis_client.zrange(class_key("enterprise"), 0, -1)) == {
        enterprise[1].lease_id}


def test_an_expired_lease_leaves_its_class_at_the_next_acquire(
        limiter: Any, redis_client: redis.Redis) -> None:
    short = take(limiter, "free", 2, lease_seconds=1)
    take(limiter, "free", 1, lease_seconds=60)
    wait_until_server_ms(redis_client, max(lease.expires_at_ms for lease in short) + 1, timeout=5)
    assert take(limiter, "enterprise", 1)[0].allowed
    assert redis_client.zcard(class_key("free")) == 1
    assert redis_client.zcard(class_key("enterprise")) == 1


def test_concurrent_acquires_keep_every_share(make_limiter: LimiterFactory, redis_url: str,
                                             redis_client: redis.Redis) -> None:
    """40 threads, each with its own limiter, 30 free and 10 enterprise, race for 10 slots
    while enterprise is active: free never holds more than 7, enterprise at least 3, and
    the class sets hold exactly the admitted leases."""
    with make_limiter(redis_url) as first:
        first.release(take(first, "enterprise", 1)[0])
    results: list[tuple[str, bool]] = []
    lock = threading.Lock()
    start = threading.Barrier(40)

    def contender(klass: str) -> None:
        with make_limiter(redis_url) as own:
            start.wait(10)
            allowed = take(own, klass, 1)[0].allowed
        with lock:
            results.append((klass, allowed))

    threads = [threading.Thread(target=contender, args=("free" if i % 4 else "enterprise",))
               for i in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 40
    free = sum(allowed for klass, allowed in results if klass == "free")
    enterprise = sum(allowed for klass, allowed in results if klass == "enterprise")
    assert free + enterprise == 10 and free <= 7 and enterprise >= 3
    assert redis_client.zcard(class_key("free")) == free
    assert redis_client.zcard(class_key("enterprise")) == enterprise
    assert redis_client.zcard(f"ratelimit:{CAP}:leases") == 10


@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="coroutines of one loop, pipelined")
def test_coroutines_racing_keep_every_share(loop_factory: LoopFactory, redis_url: str,
                                           redis_client: redis.Redis) -> None:
    async def scenario() -> None:
        async with AsyncRateLimiter(redis_url) as limiter:
            await (await limiter.acquire(CAP, 10, 60, shares=SHARES,
                                         share_class="enterprise")).release()
            leases = await asyncio.gather(*(
                limiter.acquire(CAP, 10, 60, shares=SHARES,
                                share_class="enterprise" if i % 4 == 0 else "free")
                for i in range(40)))
            free = sum(lease.allowed for lease in leases if lease.share_class == "free")
            enterprise = sum(lease.allowed for lease in leases
                             if lease.share_class == "enterprise")
            assert free + enterprise == 10 and free <= 7 and enterprise >= 3
            assert redis_client.zcard(class_key("free")) == free

    run_async(scenario(), loop_factory)


def test_an_acquire_whose_reply_was_lost_takes_one_slot_of_its_class(
        make_limiter: LimiterFactory, redis_client: redis.Redis, redis_port: int,  # noqa: F811
) -> None:
    redis_client.script_load(_native.LEASE_SOURCE)
    proxy = ReplyDroppingProxy(redis_port, drop=1)
    try:
        with make_limiter(f"redis://127.0.0.1:{proxy.port}/0") as limiter:
            lease = take(limiter, "free", 1)[0]
    finally:
        proxy.close()
    assert len(proxy.dropped_replies) == 1
    assert proxy.dropped_replies[0].startswith(b"*7\r\n:1\r\n:1\r\n")
    assert (lease.allowed, lease.held) == (True, 1)
    assert redis_client.zcard(class_key("free")) == 1


def test_the_documented_acl_user_runs_in_flight_shares(
        acl_url: Any, admin: redis.Redis, make_limiter: LimiterFactory) -> None:  # noqa: F811
    """Every command of the shares (class leases, the classes registry, the activity
    stamps) is within docs/security.md's ACL."""
    limiter = make_limiter(acl_url())
    first = take(limiter, "enterprise", 1)[0]
    assert limiter.renew(first) and limiter.release(first)
    free = take(limiter, "free", 8)
    assert [lease.allowed for lease in free] == [True] * 7 + [False]
    assert rule(free[7]) == ("reserve", "enterprise")


def test_decimal_percents_are_exact(limiter: Any) -> None:
    shares = Shares(reserved={"enterprise": Decimal("12.5")})
    # floor(12.5 % of 10) = 1 slot kept.
    limiter.release(take(limiter, "enterprise", 1, shares=shares)[0])
    assert [lease.allowed for lease in take(limiter, None, 10, shares=shares)] == (
        [True] * 9 + [False])


@pytest.mark.parametrize(("build", "error", "message"), [
    (lambda: Shares(reserved={"enterprise": 101}), ValueError, r"in \[0, 100\]"),
    (lambda: Shares(reserved={"a": 60, "b": 50}), ValueError, "sum to 110 %, above 100 %"),
    (lambda: Shares(reserved={"a": 30.0}), TypeError, "a float is never exact"),
    (lambda: Shares(ceilings={"free": (50, 180)}), ValueError, r"in \(0, 100\]"),
    (lambda: Shares(), ValueError, "needs reserved shares or ceilings"),
    (lambda: Shares(reserved={"a b": 10}), ValueError, "class name"),
])
def test_bad_shares_raise_when_built(build: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize(("keywords", "error", "message"), [
    ({"shares": SHARES, "share_class": "gold"}, ValueError, "not a class of the cap's shares"),
    ({"share_class": "free"}, ValueError, "share_class needs shares="),
    ({"shares": {"enterprise": 30}}, TypeError, "shares must be a Shares"),
    ({"shares": SHARES, "share_class": 3}, TypeError, "share_class must be a str"),
])
def test_bad_share_arguments_raise_before_any_io(unreachable_limiter: Any, keywords: Any,
                                                 error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        unreachable_limiter.acquire(CAP, 10, 60, **keywords)


def test_the_kill_switch_grants_a_lease_with_shares(unreachable_limiter: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "1")
    lease = unreachable_limiter.acquire(CAP, 10, 60, shares=SHARES, share_class="free")
    assert lease.allowed and lease.share_refusal is None and lease.share_class == "free"


def test_in_flight_shares_on_a_cluster_live_in_the_caps_slot(make_limiter: LimiterFactory,
                                                             redis_cluster: Any) -> None:
    """On a Redis Cluster the leases key's hash tag is the cap's name: the class leases, the
    registry and the activity stamps are named after it, so in its slot."""
    from redis.cluster import RedisCluster as ClusterClient

    limiter = make_limiter(redis_cluster.url)
    limiter.release(take(limiter, "enterprise", 1)[0])
    free = take(limiter, "free", 8)
    assert [lease.allowed for lease in free] == [True] * 7 + [False]
    assert rule(free[7]) == ("reserve", "enterprise")
    assert limiter.release(free[0])
    inspector = ClusterClient(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        assert inspector.zcard(f"ratelimit:{{{CAP}}}:leases:class=free") == 6
    finally:
        inspector.close()
