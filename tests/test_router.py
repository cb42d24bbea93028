"""The router (csrc/router.c): the one set of routing rules both limiters drive, with no I/O
in it. Here it is driven by hand, through _native.Router (the asyncio limiter's face of
it), with replies read from a real 6-node cluster (tests/redis_cluster.py) and a real
Sentinel-shaped answer built from that cluster's nodes: what each answer or failure makes a
call do next. The end-to-end behaviour (both limiters on real clusters and sentinels, under
faults) is in test_cluster.py, test_cluster_failover.py and test_sentinel.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from genai_ratelimit import (
    AsyncRateLimiter,
    RateLimiterAuthError,
    RateLimiterError,
    RateLimiterTimeout,
    RateLimiterUnavailable,
    _native,
)

pytestmark = pytest.mark.no_hiredis1(reason="drives the router by hand: no hiredis path")

SEND, READ, WAIT, FAIL = (_native.ROUTE_SEND, _native.ROUTE_READ, _native.ROUTE_WAIT,
                          _native.ROUTE_FAIL)


def engine_error(status: int, detail: str, kind: type[RateLimiterError] = RateLimiterUnavailable
                 ) -> RateLimiterError:
    """An exception as the engine tags it (module.c: _rl_status, _rl_detail)."""
    exc = kind(f"Redis answered {detail}")
    exc._rl_status = status  # type: ignore[attr-defined]
    exc._rl_detail = detail  # type: ignore[attr-defined]
    return exc


def answer_read(router: Any, route: Any, deadline: float, reply: Any) -> tuple[Any, list[Any]]:
    """Runs one read, answering its first question with reply; returns the read and the
    questions it asked."""
    read = router.read(deadline, route)
    asked = [read.step()]
    asked.append(read.step(reply))
    read.end()
    return read, asked


def node_reply(where: int | str, *words: str) -> Any:
    """A command's reply from one node (a port on 127.0.0.1, or a URL), decoded as the
    asyncio limiter decodes it (codec.c's reply_to_python): what aio.py hands the router."""
    url = where if isinstance(where, str) else f"redis://127.0.0.1:{where}/0"

    async def ask() -> Any:
        async with AsyncRateLimiter(url) as limiter:
            return await limiter._command(*words)
    return asyncio.run(ask())


def raw_shards(redis_cluster: Any) -> Any:
    return node_reply(redis_cluster.nodes[0].port, "CLUSTER", "SHARDS")


def test_an_unknown_slot_reads_the_map_then_goes_to_its_master(redis_cluster: Any) -> None:
    seed = redis_cluster.nodes[0].port
    router = _native.Router([("127.0.0.1", seed)])
    route = router.route(1234, time.monotonic() + 2)
    action, deadline, _ = route.next()
    assert action == READ
    read = router.read(deadline, route)
    sentinel, index, words, until = read.step()
    assert (sentinel, router.address(index), words) == (False, ("127.0.0.1", seed),
                                                        (b"CLUSTER", b"SHARDS"))
    assert until <= time.monotonic() + 0.25  # its share, at most RL_ASK_WAIT
    assert read.step(raw_shards(redis_cluster)) is None
    assert read.end() == -1 and read.error() is None
    action, node, asking = route.next()
    assert action == SEND and not asking
    assert router.address(node)[1] == redis_cluster.master_of_slot(1234).port
    assert sorted(router.address(n)[1] for n in router.masters()) == sorted(
        n.port for n in redis_cluster.masters())


def test_a_node_without_cluster_shards_is_asked_cluster_slots(redis_cluster: Any) -> None:
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)])
    read = router.read(time.monotonic() + 2)
    _, index, words, _ = read.step()
    refused = engine_error(_native.STATUS_SERVER, "ERR unknown subcommand 'SHARDS'")
    assert read.step(None, refused)[1:3] == (index, (b"CLUSTER", b"SLOTS"))
    slots = node_reply(redis_cluster.nodes[0].port, "CLUSTER", "SLOTS")
    assert read.step(slots) is None
    read.end()
    assert read.error() is None
    assert router.address(router.destination(1234))[1] == redis_cluster.master_of_slot(1234).port


def test_moved_points_the_slot_at_the_node_named_after_one_read(redis_cluster: Any) -> None:
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)])
    answer_read(router, None, time.monotonic() + 2, raw_shards(redis_cluster))
    route = router.route(1234, time.monotonic() + 2)
    assert route.next()[0] == SEND
    time.sleep(0.11)  # past RL_MOVED_READ_AFTER (100 ms) since the read: a policy's threshold
    moved = engine_error(_native.STATUS_REDIRECT, "MOVED 1234 127.0.0.1:1")
    assert route.failed(moved) is True
    action, deadline, _ = route.next()
    assert action == READ  # the first MOVED after a quiet while reads the map...
    answer_read(router, route, deadline, raw_shards(redis_cluster))
    action, node, asking = route.next()
    assert (action, router.address(node), asking) == (SEND, ("127.0.0.1", 1), False)  # ...then patches


def test_moveds_in_a_burst_patch_without_a_read_each(redis_cluster: Any) -> None:
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)])
    answer_read(router, None, time.monotonic() + 2, raw_shards(redis_cluster))
    reads = 0
    for slot in range(20):  # well within RL_MOVED_READ_AFTER of the read
        route = router.route(slot, time.monotonic() + 2)
        route.next()
        assert route.failed(engine_error(_native.STATUS_REDIRECT, f"MOVED {slot} 127.0.0.1:2"))
        action, value, _ = route.next()
        if action == READ:
            reads += 1
            answer_read(router, route, value, raw_shards(redis_cluster))
            action, value, _ = route.next()
        assert (action, router.address(value)) == (SEND, ("127.0.0.1", 2))
    assert reads <= 1


def test_ask_sends_once_with_asking_to_the_node_named(redis_cluster: Any) -> None:
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)])
    answer_read(router, None, time.monotonic() + 2, raw_shards(redis_cluster))
    route = router.route(77, time.monotonic() + 2)
    home = route.next()[1]
    assert route.failed(engine_error(_native.STATUS_REDIRECT, "ASK 77 [::1]:7005"))
    action, node, asking = route.next()
    assert (action, router.address(node), asking) == (SEND, ("::1", 7005), True)
    assert route.failed(engine_error(_native.STATUS_IO, "the connection broke"))
    assert route.next()[0] == WAIT
    assert route.next()[0] == READ  # the map again after a dead node
    assert router.destination(77) == home  # ASK changed no map


def test_moved_back_and_forth_gives_up_after_64(redis_cluster: Any) -> None:
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)])
    answer_read(router, None, time.monotonic() + 2, raw_shards(redis_cluster))
    route = router.route(5, time.monotonic() + 5)
    with pytest.raises(RateLimiterUnavailable, match="answered MOVED 64 times to one call"):
        for k in range(200):  # 64 MOVEDs, and the reads some of them ask for
            action, value, _ = route.next()
            if action == READ:
                answer_read(router, route, value, raw_shards(redis_cluster))
                continue
            route.failed(engine_error(_native.STATUS_REDIRECT, f"MOVED 5 127.0.0.1:{3 + k % 2}"))


def test_a_cluster_that_stays_busy_fails_with_its_answer_at_the_deadline(
        redis_cluster: Any) -> None:
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)])
    answer_read(router, None, time.monotonic() + 2, raw_shards(redis_cluster))
    route = router.route(9, time.monotonic() + 0.2)
    busy = engine_error(_native.STATUS_REDIRECT, "TRYAGAIN Multiple keys request during rehashing")
    with pytest.raises(RateLimiterUnavailable, match="answered TRYAGAIN .* until the call's deadline"):
        for _ in range(1000):  # bounded: the deadline ends it within 0.2 s
            action, value, _ = route.next()
            if action == READ:
                read = router.read(value, route)
                read.step()
                read.step(None, engine_error(_native.STATUS_CONNECT, "refused"))
                read.end()
            elif action == WAIT:
                time.sleep(value)
            else:
                assert route.failed(busy)


def test_a_timeout_is_not_retried_and_makes_the_next_call_read_the_map(redis_cluster: Any) -> None:
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)], socket_timeout=1.0)
    answer_read(router, None, time.monotonic() + 2, raw_shards(redis_cluster))
    route = router.route(5, time.monotonic() + 2)
    assert route.next()[0] == SEND
    assert route.failed(RateLimiterTimeout("no answer within 1 s")) is False
    assert router.route(5, time.monotonic() + 2).next()[0] == READ


def test_an_auth_refusal_or_a_plain_error_reply_is_not_sent_elsewhere(redis_cluster: Any) -> None:
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)])
    answer_read(router, None, time.monotonic() + 2, raw_shards(redis_cluster))
    route = router.route(5, time.monotonic() + 2)
    route.next()
    assert route.failed(RateLimiterAuthError("WRONGPASS invalid username-password pair")) is False
    assert route.failed(engine_error(_native.STATUS_SERVER, "READONLY You can't write")) is False


def read_for_an_unknown_slot(router: Any) -> tuple[Any, Any]:
    """A call of slot 5 that the router sends to read the map, and that read, its first
    question asked."""
    route = router.route(5, time.monotonic() + 1)
    action, deadline, _ = route.next()
    assert action == READ
    read = router.read(deadline, route)
    read.step()
    return route, read


def test_garbage_for_a_map_is_a_read_error_naming_it() -> None:
    router = _native.Router([("127.0.0.1", 1)])
    route, read = read_for_an_unknown_slot(router)
    assert read.step([b"not", b"a", b"map"]) is None
    read.end()
    assert "CLUSTER SHARDS answered a malformed shard" in str(read.error())
    with pytest.raises(RateLimiterUnavailable, match="malformed shard"):
        route.next()  # the call says what the read met, not "no node serves the slot"


def sentinel_master(port: int, epoch: int, flags: bytes = b"master") -> list[bytes]:
    """SENTINEL MASTER's flat map, the fields the router reads."""
    return [b"name", b"mymaster", b"ip", b"127.0.0.1", b"port", str(port).encode(),
            b"flags", flags, b"config-epoch", str(epoch).encode()]


def sentinel_read(router: Any, answers: list[Any], role: Any = None) -> tuple[Any, list[Any]]:
    """One read of the sentinels, each question answered in turn (a reply, or an exception);
    ROLE answered with role. Returns the read and the questions."""
    read = router.read(time.monotonic() + 2)
    questions = [read.step()]
    replies = list(answers)
    while questions[-1] is not None:
        sentinel, _, words, _ = questions[-1]
        answer = replies.pop(0) if sentinel else role
        if isinstance(answer, BaseException):
            questions.append(read.step(None, answer))
        else:
            questions.append(read.step(answer))
    read.end()
    return read, questions[:-1]


def test_the_highest_config_epoch_wins_and_is_checked_with_role(redis_url: str) -> None:
    router = _native.Router([("s1", 26379), ("s2", 26379), ("s3", 26379)],
                            master_name="mymaster")
    role = node_reply(redis_url, "ROLE")  # a real master's answer
    read, questions = sentinel_read(
        router, [sentinel_master(7001, 1), sentinel_master(7002, 2), sentinel_master(7001, 1)],
        role)
    assert [q[2] for q in questions] == [(b"SENTINEL", b"MASTER", b"mymaster")] * 3 + [(b"ROLE",)]
    assert read.error() is None
    assert router.address(router.masters()[0]) == ("127.0.0.1", 7002)  # outvoted by its epoch


def test_a_master_that_answers_role_as_a_replica_is_refused() -> None:
    router = _native.Router([("s1", 26379)], master_name="mymaster")
    read, _ = sentinel_read(router, [sentinel_master(7001, 3)],
                            [b"slave", b"127.0.0.1", 7000, b"connected", 10])
    assert "answers ROLE as a replica" in str(read.error())
    assert router.masters() == []


def test_a_sentinel_that_timed_out_is_asked_last_and_skipped_once_another_answered() -> None:
    router = _native.Router([("s1", 1), ("s2", 2), ("s3", 3)], master_name="mymaster")
    frozen = RateLimiterTimeout("did not answer")
    sentinel_read(router, [frozen, sentinel_master(7001, 1), sentinel_master(7001, 1)],
                  [b"master", 0, []])
    _, questions = sentinel_read(router, [sentinel_master(7001, 1), sentinel_master(7001, 1)])
    assert [router.sentinel(q[1]) for q in questions] == [("s2", 2), ("s3", 3)]


def test_a_failover_under_way_holds_the_calls_until_the_deadline() -> None:
    router = _native.Router([("s1", 1)], master_name="mymaster")
    sentinel_read(router, [sentinel_master(7001, 1, b"master,failover_in_progress")],
                  [b"master", 0, []])
    route = router.route(0, time.monotonic() + 0.15)
    with pytest.raises(RateLimiterUnavailable, match="failover of mymaster is under way"):
        for _ in range(1000):  # bounded: the deadline ends it within 0.15 s
            action, value, _ = route.next()
            assert action != SEND
            if action == WAIT:
                time.sleep(value)
            elif action == READ:
                sentinel_read(router, [sentinel_master(7001, 1, b"master,failover_in_progress")])


def test_readonly_behind_sentinels_asks_them_again() -> None:
    router = _native.Router([("s1", 1)], master_name="mymaster")
    sentinel_read(router, [sentinel_master(7001, 1)], [b"master", 0, []])
    route = router.route(0, time.monotonic() + 2)
    action, node, _ = route.next()
    assert action == SEND
    readonly = engine_error(_native.STATUS_SERVER, "Redis answered the rate-limit script with an "
                            "error: READONLY You can't write against a read only replica.")
    assert route.failed(readonly) is True
    assert route.next()[0] == WAIT
    assert route.next()[0] == READ


def test_a_read_abandoned_mid_way_frees_the_single_flight() -> None:
    router = _native.Router([("127.0.0.1", 1)])
    _, read = read_for_an_unknown_slot(router)
    other = router.route(5, time.monotonic() + 1)
    assert other.next()[0] == WAIT  # one read at a time: the other call waits for it
    del read  # a cancelled task's read, never ended: dropping it ends it
    assert router.route(5, time.monotonic() + 1).next()[0] == READ
