"""A capped, token-limited request in one round trip in and one out: reserve(...,
in_flight=(limit, lease_seconds)) takes the user's in-flight slot and reserves requests and
tokens in ONE script execution, all or nothing (a refused slot reserves nothing, a refused
window holds no slot); reconcile(..., release=True) reconciles and gives the slot back in
ONE script execution. Every limiter kind, both storages (tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from helpers_core import GarbageServer, Monitor, logged

WINDOWS = [(10, 60)]
TOKENS = [(1_000, 60)]


def leases(client: redis.Redis, user: str) -> list[str]:
    return [m.decode() for m in client.zrange(f"ratelimit:{user}:leases", 0, -1)]


def scripts_run(monitor: Monitor) -> list[str]:
    return [c.name for c in monitor.from_others() if c.name in ("EVALSHA", "EVAL")]


def warm_up(limiter: Any, user_id: str) -> None:
    """Every script of the test loaded, on another user: no NOSCRIPT round in the record."""
    other = f"warm-{user_id}"
    limiter.check(other, 5, 60)
    lease = limiter.acquire(other, 2, 30)
    limiter.release(lease)
    for in_flight in (None, (2, 30)):
        r = limiter.reserve(other, WINDOWS, token_windows=TOKENS, tokens=1, in_flight=in_flight)
        limiter.reconcile(r, 1, release=in_flight is not None)
    limiter.reconcile(r, 2)


def test_one_script_execution_takes_the_slot_and_reserves(limiter: Any, redis_client: redis.Redis,
                                                          user_id: str) -> None:
    warm_up(limiter, user_id)
    with Monitor(redis_client) as monitor:
        r = limiter.reserve(user_id, WINDOWS, token_windows=TOKENS, tokens=300, in_flight=(2, 30))
    assert scripts_run(monitor) == ["EVALSHA"]
    assert (r.allowed, r.remaining_tokens, r.remaining_requests) == (True, 700, 9)
    assert r.lease is not None and r.lease.allowed and r.lease.held == 1
    assert r.lease.lease_id == r.member and r.lease.limit == 2 and r.lease.lease_seconds == 30
    assert r.timestamp_ms < r.lease.expires_at_ms <= r.timestamp_ms + 30_000
    assert leases(redis_client, user_id) == [r.member]
    assert logged(redis_client, f"ratelimit:{user_id}:60:tokens") == [(r.timestamp_ms, 300)]


def test_a_refused_slot_reserves_nothing(limiter: Any, redis_client: redis.Redis,
                                         user_id: str) -> None:
    held = limiter.acquire(user_id, 1, 30)
    r = limiter.reserve(user_id, WINDOWS, token_windows=TOKENS, tokens=300, in_flight=(1, 30))
    assert (r.allowed, r.resource, r.window_seconds, r.remaining) == (False, "requests", 0, 0)
    assert r.lease is not None and not r.lease.allowed and r.lease.lease_id == ""
    assert 1 <= r.retry_after_ms <= 30_000 and r.retry_after_s == r.lease.retry_after_s
    assert all(w.remaining is None for w in r.windows) and r.member == ""
    assert logged(redis_client, f"ratelimit:{user_id}:60") == []
    assert logged(redis_client, f"ratelimit:{user_id}:60:tokens") == []
    assert leases(redis_client, user_id) == [held.lease_id]
    assert limiter.reconcile(r, 10, release=True) == 0  # nothing held, nothing sent


def test_a_refused_window_holds_no_slot(limiter: Any, redis_client: redis.Redis,
                                        user_id: str) -> None:
    r = limiter.reserve(user_id, WINDOWS, token_windows=TOKENS, tokens=900, in_flight=(5, 30))
    refused = limiter.reserve(user_id, WINDOWS, token_windows=TOKENS, tokens=200,
                              in_flight=(5, 30))
    assert (refused.allowed, refused.resource, refused.window_seconds) == (False, "tokens", 60)
    assert refused.lease is None
    assert leases(redis_client, user_id) == [r.member]
    assert len(logged(redis_client, f"ratelimit:{user_id}:60")) == 1


def test_reconcile_with_release_is_one_script_execution(limiter: Any, redis_client: redis.Redis,
                                                        user_id: str) -> None:
    warm_up(limiter, user_id)
    r = limiter.reserve(user_id, WINDOWS, token_windows=TOKENS, tokens=300, in_flight=(2, 30))
    with Monitor(redis_client) as monitor:
        assert limiter.reconcile(r, 120, release=True) == 1
    assert scripts_run(monitor) == ["EVALSHA"]
    assert leases(redis_client, user_id) == []
    assert logged(redis_client, f"ratelimit:{user_id}:60:tokens") == [(r.timestamp_ms, 120)]
    assert limiter.release(r.lease) is False  # given back already
    assert limiter.reconcile(r, 120, release=True) == 1  # a replay changes nothing


def test_the_separate_calls_stay_and_count_four_round_trips(limiter: Any, redis_client: redis.Redis,
                                                            user_id: str) -> None:
    """What the combined calls save: a capped, token-limited request is acquire, reserve,
    reconcile and release when made of the separate calls, two scripts when combined."""
    warm_up(limiter, user_id)
    with Monitor(redis_client) as separate:
        lease = limiter.acquire(user_id, 2, 30)
        r = limiter.reserve(user_id, WINDOWS, token_windows=TOKENS, tokens=300)
        limiter.reconcile(r, 100)
        limiter.release(lease)
    with Monitor(redis_client) as combined:
        r = limiter.reserve(user_id, WINDOWS, token_windows=TOKENS, tokens=300, in_flight=(2, 30))
        limiter.reconcile(r, 100, release=True)
    assert (len(scripts_run(separate)), len(scripts_run(combined))) == (4, 2)
    assert leases(redis_client, user_id) == []


def test_in_flight_is_checked_before_any_io(unreachable_limiter: Any) -> None:
    with pytest.raises(TypeError, match="in_flight"):
        unreachable_limiter.reserve("u", WINDOWS, in_flight=5)
    with pytest.raises(ValueError, match="in_flight's limit"):
        unreachable_limiter.reserve("u", WINDOWS, in_flight=(0, 30))
    with pytest.raises(ValueError, match="lease_seconds"):
        unreachable_limiter.reserve("u", WINDOWS, in_flight=(1, 0))


def test_under_the_kill_switch_the_slot_is_granted_and_nothing_is_held(
        unreachable_limiter: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "1")
    r = unreachable_limiter.reserve("u", WINDOWS, token_windows=TOKENS, tokens=5,
                                    in_flight=(1, 30))
    assert r.allowed and r.lease is not None and r.lease.allowed and r.lease.lease_id == ""
    assert unreachable_limiter.reconcile(r, 1, release=True) == 0


SLOT_REFUSED = b"*9\r\n:0\r\n:0\r\n:1\r\n:0\r\n:5\r\n*0\r\n:1000\r\n:0\r\n*4\r\n:0\r\n:%b\r\n:1000\r\n:0\r\n"
ALLOWED = (b"*9\r\n:1\r\n:9\r\n:0\r\n:1\r\n:5\r\n*1\r\n:9\r\n:0\r\n:%b\r\n"
           b"*4\r\n:1\r\n:1\r\n:0\r\n:%b\r\n")


@pytest.mark.parametrize("reply", [
    SLOT_REFUSED % b"9223372036854775807",           # absurd holders
    SLOT_REFUSED % b"0",                              # refused below the limit
    ALLOWED % (b"70000", b"20000"),                   # a tie beyond 2 bytes
    ALLOWED % (b"0", b"9223372036854775807"),         # an expiry beyond the lease
    ALLOWED % (b"0", b"4"),                           # an expiry before now
    b"*9\r\n:0\r\n:0\r\n:1\r\n:0\r\n:-5\r\n*0\r\n:1000\r\n:0\r\n*4\r\n:0\r\n:1\r\n:1000\r\n:0\r\n",
], ids=["absurd-holders", "refused-below-limit", "tie", "expiry-beyond", "expiry-before",
        "negative-now"])
@pytest.mark.storages("zset", reason="the reply decoding is the same for both scripts")
def test_an_absurd_in_flight_reply_is_unavailable_never_a_decision(make_limiter: Any,
                                                                   reply: bytes) -> None:
    from genai_ratelimit import RateLimiterUnavailable

    with GarbageServer(reply) as server:
        limiter = make_limiter(server.url, connect_timeout=0.5, socket_timeout=0.5)
        with pytest.raises(RateLimiterUnavailable):
            limiter.reserve("u", [(10, 60)], in_flight=(1, 30))


@pytest.mark.parametrize("reply", [b"*2\r\n:5\r\n:1\r\n", b"*2\r\n:1\r\n:2\r\n", b":1\r\n"],
                         ids=["found-beyond-windows", "released-2", "not-an-array"])
@pytest.mark.storages("zset", reason="the reply decoding is the same for both scripts")
def test_an_absurd_reconcile_and_release_reply_is_unavailable(make_limiter: Any,
                                                              reply: bytes) -> None:
    from genai_ratelimit import RateLimiterUnavailable

    with GarbageServer(reply) as server:
        limiter = make_limiter(server.url, connect_timeout=0.5, socket_timeout=0.5)
        with pytest.raises(RateLimiterUnavailable):
            limiter.reconcile(_reservation("u"), 1, release=True)


def _reservation(user: str) -> Any:
    """A Reservation with a held lease, as reserve(..., in_flight=...) makes one."""
    from genai_ratelimit import Reservation, WindowState
    from genai_ratelimit.lease import Lease

    member = "0a1b2c3d-4e5f-4a6b-8c7d-0e1f2a3b4c5d"
    lease = Lease(allowed=True, held=1, remaining=0, retry_after_s=0, retry_after_ms=0,
                  lease_id=member, expires_at_ms=10, user_id=user, limit=1, lease_seconds=30)
    return Reservation(allowed=True, remaining=9, retry_after_s=0, window_seconds=60,
                       resource="requests", retry_after_ms=0, user_id=user, cost=1, tokens=None,
                       windows=(WindowState(10, 60, "requests", 9),), member=member,
                       timestamp_ms=5, lease=lease)


@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="asyncio cancellation")
@pytest.mark.parametrize("token_windows", [TOKENS, []], ids=["tokens", "requests"])
def test_a_cancelled_reserve_gives_back_its_slot_and_its_tokens(
        make_limiter: Any, redis_url: str, redis_client: redis.Redis, user_id: str,
        token_windows: list[tuple[int, int]]) -> None:
    """Cancelled after its script reached Redis: the script still takes the slot and holds
    the estimate; once the reply comes the limiter gives back what the request held (the
    slot released, the tokens reconciled to 0, which removes them: it never ran), as
    reconcile(..., 0, release=True) would. The request stays counted, as a cancelled check's does."""
    from helpers_async import run_async
    from test_leases import cancel_while_paused, poll

    tokens_key = f"ratelimit:{user_id}:60:tokens"

    async def scenario() -> None:
        limiter = make_limiter.native(redis_url)
        other = await limiter.reserve(f"warm-{user_id}", WINDOWS, token_windows=TOKENS,
                                      tokens=1, in_flight=(1, 300))  # scripts loaded
        await limiter.reconcile(other, 0, release=True)
        tokens = 300 if token_windows else None
        await cancel_while_paused(redis_client, limiter.reserve(
            user_id, WINDOWS, token_windows=token_windows, tokens=tokens, in_flight=(1, 300)))
        await poll(lambda: leases(redis_client, user_id) == [],
                   "the cancelled reserve's slot is released")
        if token_windows:
            assert logged(redis_client, tokens_key) == []  # reconciled to 0: removed
        assert len(logged(redis_client, f"ratelimit:{user_id}:60")) == 1  # still counted
        again = await limiter.reserve(user_id, WINDOWS, token_windows=token_windows,
                                      tokens=tokens, in_flight=(1, 300))
        assert again.allowed and again.lease is not None and again.lease.allowed
        assert again.remaining_requests == 8
        if token_windows:
            assert again.remaining_tokens == 700
        await limiter.reconcile(again, 0, release=True)

    run_async(scenario(), make_limiter.loop_factory)


@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="asyncio cancellation")
def test_a_cancelled_reserve_of_tokens_without_a_slot_gives_back_its_tokens(
        make_limiter: Any, redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    """A plain reserve holds its estimate until reconciled: cancelled, it is refunded."""
    from helpers_async import run_async
    from test_leases import cancel_while_paused, poll

    tokens_key = f"ratelimit:{user_id}:60:tokens"

    async def scenario() -> None:
        limiter = make_limiter.native(redis_url)
        other = await limiter.reserve(f"warm-{user_id}", WINDOWS, token_windows=TOKENS, tokens=1)
        await limiter.reconcile(other, 0)  # scripts loaded
        await cancel_while_paused(redis_client, limiter.reserve(
            user_id, WINDOWS, token_windows=TOKENS, tokens=900))
        # The script ran (cancel_while_paused): its 900 tokens are logged until refunded.
        await poll(lambda: logged(redis_client, tokens_key) == [],
                   "the cancelled reserve's tokens are refunded")
        again = await limiter.reserve(user_id, WINDOWS, token_windows=TOKENS, tokens=900)
        assert again.allowed and again.remaining_tokens == 100

    run_async(scenario(), make_limiter.loop_factory)


@pytest.mark.limiter_kinds("asyncio", "uvloop", reason="asyncio cancellation")
def test_a_reserve_cancelled_in_its_first_of_two_steps_sends_no_second_and_refunds_the_first(
        make_limiter: Any, redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    """Decided in two steps (a shared upstream first, as on a Redis Cluster; switched on
    here on one node, as tests/test_scopes.py does), cancelled while the upstream's step is
    held on the server: that step still logs its entry; then no second step is sent (no
    slot taken, the user's windows untouched) and the first is refunded."""
    from genai_ratelimit import Scope
    from helpers_async import run_async
    from test_leases import cancel_while_paused, poll

    upstream = Scope("openai/gpt-4o", windows=[(30, 60)], token_windows=[(5_000, 60)],
                     shared=True)
    shared_keys = ["ratelimit:openai/gpt-4o:60:shared", "ratelimit:openai/gpt-4o:60:tokens:shared"]

    async def scenario() -> None:
        limiter = make_limiter.native(redis_url)
        limiter._two_step_scopes = True
        warm = await limiter.reserve(f"warm-{user_id}", WINDOWS, token_windows=TOKENS, tokens=1,
                                     scopes=[upstream], in_flight=(1, 300))  # scripts loaded
        await limiter.reconcile(warm, 0, release=True)
        before = {key: logged(redis_client, key) for key in shared_keys}
        await cancel_while_paused(redis_client, limiter.reserve(
            user_id, WINDOWS, token_windows=TOKENS, tokens=300, scopes=[upstream],
            in_flight=(1, 300)))
        # The first step logged an entry in the upstream's windows: refunded (cost 0 removes it).
        await poll(lambda: {key: logged(redis_client, key) for key in shared_keys} == before,
                   "the first step's entry is refunded")
        assert leases(redis_client, user_id) == []
        assert logged(redis_client, f"ratelimit:{user_id}:60") == []
        assert logged(redis_client, f"ratelimit:{user_id}:60:tokens") == []

    run_async(scenario(), make_limiter.loop_factory)
