"""Classes weighted by their reserved shares in a window cap's wait queue (docs/wait-queue.md,
"Classes weighted by their shares"; lua/lib/queue.lua's queue_round): under a backlog the
classes are served in proportion to their shares, the tenants of a class in turn, first in
first out within a tenant; a cap without shares keeps the unweighted rounds exactly.

The order tests take the tickets with the numbers the plan sends (wait_queue.queue_class),
then raise the cap's limit one by one and offer every ticket at each step: exactly the head
is admitted (no barging), so the admissions are the queue's order, deterministically."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from genai_ratelimit import RateLimiter, Scope
from genai_ratelimit.wait_queue import UNRESERVED_CLASS, queue_class, tenant_key
from helpers_async import LimiterFactory
from helpers_core import closed_port_url
from test_wait_queue import OWN, QUEUE, QUEUE_HASH, UPSTREAM, Waiters, queued, wait_for

SHARES = {"enterprise": 60, "free": 20}
STEP = 72072000  # lib/queue.lua's QUEUE_STEP_SCALE
BOUNDS = (1000, 100)
SYNC_ONLY = pytest.mark.limiter_kinds("sync", reason="the C calls with a ticket: the Redis rule")


def shared(limit: int = 1, seconds: int = 60, **shares: Any) -> Scope:
    return Scope(UPSTREAM, windows=[(limit, seconds)], shared=True, **shares)


def take(limiter: Any, tenant: str, scope_class: str | None, scope: Scope) -> str:
    """A ticket of `tenant` in `scope_class`, taken as the plan takes it; its id."""
    ticket = str(uuid.uuid4())
    numbers = (60_000, *BOUNDS, *queue_class(scope, scope_class))
    assert limiter._wait_queue(UPSTREAM, ticket, tenant_key(tenant), numbers) >= 0
    return ticket


def admission_order(limiter: Any, tickets: dict[str, str]) -> list[str]:
    """The labels of `tickets` ({ticket: label}) in the order the cap admits them, its limit
    raised by one at each step (a plain scope of the same name: the queue is the name's)."""
    left, order = dict(tickets), []
    for limit in range(1, len(tickets) + 1):
        admitted = [t for t in list(left) if limiter._reserve(
            "u", OWN, scopes=(shared(limit).native(),), ticket=t)[0]]
        assert len(admitted) == 1, "exactly the head is admitted at each step"
        order.append(left.pop(admitted[0]))
    return order


def test_the_weight_of_a_class_is_its_reserved_share_in_basis_points() -> None:
    scope = shared(reserved={"enterprise": 60, "free": "12.5", "pro": "0.004"})
    assert queue_class(scope, "enterprise") == (6000, 0)
    assert queue_class(scope, "free") == (1250, 1)
    assert queue_class(scope, "pro") == (1, 2)  # at least 1 basis point
    # no class, or a class the scope reserves nothing for: the share left unreserved
    assert queue_class(scope, None) == queue_class(scope, "other") == (2750, UNRESERVED_CLASS)
    assert queue_class(shared(reserved={"a": 70, "b": 30}), None) == (100, UNRESERVED_CLASS)
    # no reserved shares (none at all, or ceilings only): unweighted, step 1
    assert queue_class(shared(), None) == (0, 0)
    assert queue_class(shared(ceilings={"free": (50, 80)}), "free") == (0, 0)


@SYNC_ONLY
def test_under_a_backlog_the_classes_are_served_in_proportion_to_their_shares(
        limiter: Any, redis_client: redis.Redis) -> None:
    scope = shared(reserved=SHARES)
    tickets = {take(limiter, "ent", "enterprise", scope): f"E{i}" for i in range(8)}
    tickets |= {take(limiter, "free", "free", scope): f"F{i}" for i in range(8)}
    # enterprise steps 72072000 // 6000 = 12012 rounds, free 36036: three to one
    rounds = sorted(int(score) for _, score in redis_client.zrange(QUEUE, 0, -1, withscores=True))
    assert rounds[:4] == [12012, 24024, 36036, 36036]
    order = admission_order(limiter, tickets)
    assert order == ["E0", "E1", "E2", "F0", "E3", "E4", "E5", "F1", "E6", "E7",
                     "F2", "F3", "F4", "F5", "F6", "F7"]
    assert queued(redis_client) == 0 and not redis_client.exists(QUEUE_HASH)


@SYNC_ONLY
def test_a_class_share_is_split_among_its_waiting_tenants_who_stay_fair(
        limiter: Any, redis_client: redis.Redis) -> None:
    scope = shared(reserved=SHARES)
    tickets = {}
    # two enterprise tenants and one free tenant arrive, then each queues more
    for tenant, scope_class in (("e1", "enterprise"), ("e2", "enterprise"), ("f1", "free")):
        tickets[take(limiter, tenant, scope_class, scope)] = f"{tenant}.0"
    for k in range(1, 4):
        for tenant, scope_class in (("e1", "enterprise"), ("e2", "enterprise"), ("f1", "free")):
            tickets[take(limiter, tenant, scope_class, scope)] = f"{tenant}.{k}"
    late = take(limiter, "e3", "enterprise", scope)  # a third tenant with one ticket
    tickets[late] = "e3.0"
    # first tickets: e1 12012, e2 24024 (a class's newcomers spaced by its step), f1 36036;
    # then each enterprise tenant steps 2 * 12012 (the class's share split between its two),
    # free 36036; e3's first ticket goes 12012 after e2's first
    s = 12012
    rounds = {tickets[m.decode().split("|")[2]]: int(score)
              for m, score in redis_client.zrange(QUEUE, 0, -1, withscores=True)}
    assert rounds == {"e1.0": s, "e2.0": 2 * s, "f1.0": 3 * s, "e1.1": 3 * s, "e2.1": 4 * s,
                      "f1.1": 6 * s, "e1.2": 5 * s, "e2.2": 6 * s, "f1.2": 9 * s,
                      "e1.3": 7 * s, "e2.3": 8 * s, "f1.3": 12 * s, "e3.0": 3 * s}
    order = admission_order(limiter, tickets)
    assert order == ["e1.0", "e2.0", "f1.0", "e1.1", "e3.0", "e2.1", "e1.2", "f1.1", "e2.2",
                     "e1.3", "e2.3", "f1.2", "f1.3"]
    # while both classes wait, enterprise had 3 admissions per free one
    assert [label[0] for label in order[:8]].count("e") == 6
    # first in first out within each tenant
    for tenant in ("e1", "e2", "f1"):
        mine = [label for label in order if label.startswith(tenant)]
        assert mine == sorted(mine)


@SYNC_ONLY
def test_without_shares_the_rounds_are_the_unweighted_ones(
        limiter: Any, redis_client: redis.Redis) -> None:
    scope = shared()  # no shares: (0, 0), the same as the 3 numbers of before
    tickets = {}
    for label in ("a0", "a1", "a2", "b0", "c0", "b1"):
        ticket = str(uuid.uuid4())
        numbers: tuple[int, ...] = (60_000, *BOUNDS)
        if label != "a1":
            numbers += queue_class(scope, None)
        assert limiter._wait_queue(UPSTREAM, ticket, tenant_key(label[0]), numbers) >= 0
        tickets[ticket] = label
    rounds = {tickets[m.decode().split("|")[2]]: score
              for m, score in redis_client.zrange(QUEUE, 0, -1, withscores=True)}
    assert rounds == {"a0": 1, "a1": 2, "a2": 3, "b0": 1, "c0": 1, "b1": 2}
    assert admission_order(limiter, tickets) == ["a0", "b0", "c0", "a1", "b1", "a2"]
    assert not redis_client.exists(QUEUE_HASH)


@pytest.mark.parametrize("numbers, error", [
    ((1000, 10, 10, 10001, 0), ValueError),    # above 100 %
    ((1000, 10, 10, -1, 0), ValueError),
    ((1000, 10, 10, 6000, 65), ValueError),    # no such class index
    ((1000, 10, 10, 6000, -1), ValueError),
    ((1000, 10, 10, True, 0), TypeError),
    ((1000, 10, 10, 60.0, 0), TypeError),
    ((1000, 10, 10, 6000), TypeError),         # a weight without its class
    ((1000, 10, 10, 6000, 0, 0), TypeError),
])
def test_a_bad_weight_is_refused_before_any_io(make_limiter: LimiterFactory,
                                               numbers: tuple[Any, ...], error: type) -> None:
    url = closed_port_url()
    ticket, tenant = str(uuid.uuid4()), tenant_key("t")
    if make_limiter.loop_factory is None:
        with RateLimiter(url, connect_timeout=0.5, socket_timeout=0.5) as raw:
            with pytest.raises(error):
                raw._wait_queue(UPSTREAM, ticket, tenant, numbers)
    else:  # the asyncio limiter's codec parses its calls (py_request.c) the same way
        native = make_limiter.native(url, connect_timeout=0.5, socket_timeout=0.5)
        with pytest.raises(error):
            native._codec.wait_queue(UPSTREAM, ticket, tenant, numbers)


def test_reserve_with_max_wait_queues_by_the_classes_shares(
        limiter: Any, redis_url: str, redis_client: redis.Redis,
        make_limiter: LimiterFactory) -> None:
    crowd = Waiters(make_limiter, redis_url)
    try:
        scope = Scope(UPSTREAM, windows=[(1, 1)], shared=True, reserved=SHARES)
        assert limiter.reserve("filler", OWN, scopes=[scope], scope_class="enterprise").allowed
        futures = []
        for n, (user, scope_class) in enumerate((("e", "enterprise"), ("e", "enterprise"),
                                                  ("f", "free")), start=1):
            futures.append(crowd.start(user, scope, max_wait=30, scope_class=scope_class))
            wait_for(lambda n=n: queued(redis_client) == n)
        rounds = sorted(int(score) for _, score in
                        redis_client.zrange(QUEUE, 0, -1, withscores=True))
        # weighted: e's second ticket (24024) goes before f's first (36036); unweighted, f's
        # first would go in round 1, before e's second
        assert rounds == [12012, 24024, 36036]
        e1, e2, f = (future.result(30) for future in futures)
        assert all(r.allowed and r.queue_outcome == "queued_then_allowed" for r in (e1, e2, f))
        assert e1.timestamp_ms < e2.timestamp_ms < f.timestamp_ms
        assert queued(redis_client) == 0 and not redis_client.exists(QUEUE_HASH)
    finally:
        crowd.close()


def test_the_plan_sends_the_ticket_class_weight_only_when_the_cap_has_shares() -> None:
    from genai_ratelimit.wait_queue import queued_reserve_plan
    from test_wait_queue import drive, raw_answer

    for scope, scope_class, numbers in (
            (shared(2, 1, reserved=SHARES), "free", (5000, 1000, 100, 2000, 1)),
            (shared(2, 1, reserved=SHARES), None, (5000, 1000, 100, 2000, UNRESERVED_CLASS)),
            (shared(2, 1), None, (5000, 1000, 100))):
        plan = queued_reserve_plan("u", OWN, 1, (), None, [scope], 5, scope_class=scope_class)
        calls, _ = drive(plan, [100.0, raw_answer(False, 700), -1, None])
        assert calls[2][0] == "wait_queue" and calls[2][1][3] == numbers


@pytest.mark.parametrize("dependency_name", ["RateLimit", "TokenRateLimit"])
def test_an_upstreams_reserved_shares_weigh_its_queue_in_fastapi(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        dependency_name: str) -> None:
    """Upstream(reserved=..., max_wait=...): the request's class is its tier. Two tickets of
    an enterprise tenant whose waiter is gone (rounds 12012, 24024) are ahead of a free
    request (36036: unweighted it would be round 1, second); it runs once they expire."""
    import threading

    from fastapi import Depends, FastAPI
    from fastapi.testclient import TestClient

    from genai_ratelimit import fastapi as gr_fastapi

    limiter = make_limiter.native(redis_url)
    budget = getattr(gr_fastapi, dependency_name)(
        limiter, tier_limits={"enterprise": {"per_minute": 100}, "free": {"per_minute": 100}},
        identify=lambda request: (request.headers["x-org"], request.headers["x-tier"]),
        upstream=gr_fastapi.Upstream(UPSTREAM, per_minute=1, reserved=SHARES, max_wait=10))
    app = FastAPI()

    @app.post("/v1/chat/completions", dependencies=[Depends(budget)])
    async def chat() -> dict[str, bool]:
        return {"ok": True}

    scope = shared(reserved=SHARES)
    with RateLimiter(redis_url) as raw:
        for _ in range(2):
            numbers = (1500, *BOUNDS, *queue_class(scope, "enterprise"))
            assert raw._wait_queue(UPSTREAM, str(uuid.uuid4()), tenant_key("ghost"),
                                   numbers) >= 0
    answers: list[Any] = []

    def post() -> None:
        with TestClient(app) as client:
            answers.append(client.post("/v1/chat/completions",
                                       json={"model": "gpt-4o", "max_tokens": 10},
                                       headers={"x-org": "initech", "x-tier": "free"}))

    thread = threading.Thread(target=post)
    thread.start()
    try:
        wait_for(lambda: queued(redis_client) == 3)
        rounds = sorted(int(score) for _, score in
                        redis_client.zrange(QUEUE, 0, -1, withscores=True))
        assert rounds == [12012, 24024, 36036]
    finally:
        thread.join(30)
    assert answers[0].status_code == 200
    assert queued(redis_client) == 0
