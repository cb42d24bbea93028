"""The router (csrc/router.c): the one set of routing rules both limiters drive, with no I/O
in it. Here it is driven by hand, through _native.Router (the asyncio limiter's face of
it), with replies read from a real 6-node cluster (tests/redis_cluster.py) and a real
Sentinel-shaped answer built from that cluster's nodes: what each answer or failure makes a
call do next. Replies reach the router the way the asyncio limiter hands them over: as RESP bytes fed to
a Pipeline, which parses them with hiredis and gives the redisReply to the read that asked
(Pipeline.push_question); failures the driver meets itself are named by their status
(Route.failed, RouteRead.failed). The end-to-end behaviour (both limiters on real clusters
and sentinels, under faults) is in test_cluster.py, test_cluster_failover.py and
test_sentinel.py."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from typing import Any

import pytest

from genai_ratelimit import (
    AsyncRateLimiter,
    RateLimiterAuthError,
    RateLimiterTimeout,
    RateLimiterUnavailable,
    _native,
)

pytestmark = pytest.mark.no_hiredis1(reason="drives the router by hand: no hiredis path")

SEND, READ, WAIT, FAIL = (_native.ROUTE_SEND, _native.ROUTE_READ, _native.ROUTE_WAIT,
                          _native.ROUTE_FAIL)


class ErrorReply(bytes):
    """An error reply's text ("-..." on the wire)."""


def resp(value: Any) -> bytes:
    """value as a Redis server writes it: bytes as a bulk string, int, None as a nil, a
    list as an array, an ErrorReply as an error."""
    if isinstance(value, ErrorReply):
        return b"-" + bytes(value) + b"\r\n"
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if isinstance(value, int):
        return b":%d\r\n" % value
    assert isinstance(value, list)
    return b"*%d\r\n" % len(value) + b"".join(resp(item) for item in value)


def words_of(command: bytes) -> tuple[bytes, ...]:
    """The words of one RESP command (an array of bulk strings)."""
    lines = command.split(b"\r\n")
    assert lines[0].startswith(b"*")
    return tuple(lines[2 + 2 * i] for i in range(int(lines[0][1:])))


def answer(read: Any, reply: Any) -> tuple[bytes, ...]:
    """Asks read's question on a Pipeline, as aio.py does, and feeds it reply's RESP bytes:
    the Pipeline parses them and hands the redisReply to the read. Returns the words the
    question went out as."""
    pipeline = _native.Pipeline(5.0)
    future: Future[Any] = Future()
    pipeline.push_question(future, read)
    sent = pipeline.take()
    assert sent is not None
    pipeline.feed(resp(reply))
    assert future.result(timeout=0) is None  # the read took it
    return words_of(bytes(sent))


def answer_read(router: Any, route: Any, deadline: float, reply: Any) -> tuple[Any, list[Any]]:
    """Runs one read, answering its first question with reply; returns the read and the
    questions it asked."""
    read = router.read(deadline, route)
    asked = [read.question()]
    answer(read, reply)
    asked.append(read.question())
    read.end()
    return read, asked


def node_reply(where: int | str, *words: str) -> Any:
    """A command's reply from one node (a port on 127.0.0.1, or a URL), decoded (bytes, int,
    None, lists), to be written back as RESP (resp()) for a Pipeline."""
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
    sentinel, index, until = read.question()
    assert (sentinel, router.address(index)) == (False, ("127.0.0.1", seed))
    assert until <= time.monotonic() + 0.25  # its share, at most RL_ASK_WAIT
    assert answer(read, raw_shards(redis_cluster)) == (b"CLUSTER", b"SHARDS")
    assert read.question() is None
    assert read.end() == -1 and read.error() is None
    action, node, asking = route.next()
    assert action == SEND and not asking
    assert router.address(node)[1] == redis_cluster.master_of_slot(1234).port
    assert sorted(router.address(n)[1] for n in router.masters()) == sorted(
        n.port for n in redis_cluster.masters())


def test_a_node_without_cluster_shards_is_asked_cluster_slots(redis_cluster: Any) -> None:
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)])
    read = router.read(time.monotonic() + 2)
    _, index, _ = read.question()
    refused = ErrorReply(b"ERR unknown subcommand 'SHARDS'")
    assert answer(read, refused) == (b"CLUSTER", b"SHARDS")
    assert read.question()[1] == index  # the same node, asked again...
    slots = node_reply(redis_cluster.nodes[0].port, "CLUSTER", "SLOTS")
    assert answer(read, slots) == (b"CLUSTER", b"SLOTS")  # ...CLUSTER SLOTS
    assert read.question() is None
    read.end()
    assert read.error() is None
    assert router.address(router.destination(1234))[1] == redis_cluster.master_of_slot(1234).port


def test_moved_points_the_slot_at_the_node_named_after_one_read(redis_cluster: Any) -> None:
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)])
    answer_read(router, None, time.monotonic() + 2, raw_shards(redis_cluster))
    route = router.route(1234, time.monotonic() + 2)
    assert route.next()[0] == SEND
    time.sleep(0.11)  # past RL_MOVED_READ_AFTER (100 ms) since the read: a policy's threshold
    moved = RateLimiterUnavailable("MOVED 1234 127.0.0.1:1")
    assert route.failed(_native.STATUS_REDIRECT, moved) is True
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
        assert route.failed(_native.STATUS_REDIRECT,
                            RateLimiterUnavailable(f"MOVED {slot} 127.0.0.1:2"))
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
    assert route.failed(_native.STATUS_REDIRECT, RateLimiterUnavailable("ASK 77 [::1]:7005"))
    action, node, asking = route.next()
    assert (action, router.address(node), asking) == (SEND, ("::1", 7005), True)
    assert route.failed(_native.STATUS_IO, RateLimiterUnavailable("the connection broke"))
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
            route.failed(_native.STATUS_REDIRECT,
                         RateLimiterUnavailable(f"MOVED 5 127.0.0.1:{3 + k % 2}"))


def test_a_cluster_that_stays_busy_fails_with_its_answer_at_the_deadline(
        redis_cluster: Any) -> None:
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)])
    answer_read(router, None, time.monotonic() + 2, raw_shards(redis_cluster))
    route = router.route(9, time.monotonic() + 0.2)
    busy = RateLimiterUnavailable("TRYAGAIN Multiple keys request during rehashing")
    with pytest.raises(RateLimiterUnavailable, match="answered TRYAGAIN .* until the call's deadline"):
        for _ in range(1000):  # bounded: the deadline ends it within 0.2 s
            action, value, _ = route.next()
            if action == READ:
                read = router.read(value, route)
                while read.question() is not None:  # every node refuses
                    read.failed(_native.STATUS_CONNECT, RateLimiterUnavailable("refused"))
                read.end()
            elif action == WAIT:
                time.sleep(value)
            else:
                assert route.failed(_native.STATUS_REDIRECT, busy)


def test_a_timeout_is_not_retried_and_makes_the_next_call_read_the_map(redis_cluster: Any) -> None:
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)], socket_timeout=1.0)
    answer_read(router, None, time.monotonic() + 2, raw_shards(redis_cluster))
    route = router.route(5, time.monotonic() + 2)
    assert route.next()[0] == SEND
    assert route.failed(_native.STATUS_TIMEOUT, RateLimiterTimeout("no answer within 1 s")) is False
    assert router.route(5, time.monotonic() + 2).next()[0] == READ


def test_an_auth_refusal_or_a_plain_error_reply_is_not_sent_elsewhere(redis_cluster: Any) -> None:
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)])
    answer_read(router, None, time.monotonic() + 2, raw_shards(redis_cluster))
    route = router.route(5, time.monotonic() + 2)
    route.next()
    refused = RateLimiterAuthError("WRONGPASS invalid username-password pair")
    assert route.failed(_native.STATUS_AUTH, refused) is False
    readonly = RateLimiterUnavailable("READONLY You can't write")
    assert route.failed(_native.STATUS_SERVER, readonly) is False


def read_for_an_unknown_slot(router: Any) -> tuple[Any, Any]:
    """A call of slot 5 that the router sends to read the map, and that read, its first
    question asked."""
    route = router.route(5, time.monotonic() + 1)
    action, deadline, _ = route.next()
    assert action == READ
    read = router.read(deadline, route)
    read.question()
    return route, read


def test_garbage_for_a_map_is_a_read_error_naming_it() -> None:
    router = _native.Router([("127.0.0.1", 1)])
    route, read = read_for_an_unknown_slot(router)
    answer(read, [b"not", b"a", b"map"])
    assert read.question() is None
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
    questions = []
    replies = list(answers)
    while (question := read.question()) is not None:
        sentinel = question[0]
        reply = replies.pop(0) if sentinel else role
        if isinstance(reply, BaseException):
            read.failed(_native.STATUS_TIMEOUT, reply)
            questions.append((*question, None))
        else:
            questions.append((*question, answer(read, reply)))
    read.end()
    return read, questions


def test_the_highest_config_epoch_wins_and_is_checked_with_role(redis_url: str) -> None:
    router = _native.Router([("s1", 26379), ("s2", 26379), ("s3", 26379)],
                            master_name="mymaster")
    role = node_reply(redis_url, "ROLE")  # a real master's answer
    read, questions = sentinel_read(
        router, [sentinel_master(7001, 1), sentinel_master(7002, 2), sentinel_master(7001, 1)],
        role)
    assert [q[3] for q in questions] == [(b"SENTINEL", b"MASTER", b"mymaster")] * 3 + [(b"ROLE",)]
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
    # The demoted master's refusal, as the engine reads it from a real reply: the Pipeline
    # hands the routed decision's failure to its route, in C.
    request = _native.Codec("rl").check("user_readonly", 5, 60)
    request.route = route
    pipeline = _native.Pipeline(5.0)
    future: Future[Any] = Future()
    pipeline.push(future, request)
    pipeline.take()
    pipeline.feed(b"-READONLY You can't write against a read only replica.\r\n")
    with pytest.raises(RateLimiterUnavailable, match="READONLY"):
        future.result(timeout=0)
    assert route.go_on is True
    assert route.next()[0] == WAIT
    assert route.next()[0] == READ


def test_a_moved_answered_to_a_routed_request_reaches_its_route_in_c(redis_cluster: Any) -> None:
    """The engine's redirect goes from the Pipeline to the route with no Python in between;
    the call asks next() again and is sent to the node MOVED named."""
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)])
    answer_read(router, None, time.monotonic() + 2, raw_shards(redis_cluster))
    request = _native.Codec("rl", hash_tag=True).check("user_moved", 5, 60)
    route = router.route(request.slot, time.monotonic() + 2)
    request.route = route
    assert route.next()[0] == SEND and route.go_on is False
    pipeline = _native.Pipeline(5.0)
    future: Future[Any] = Future()
    pipeline.push(future, request)
    pipeline.take()
    pipeline.feed(b"-MOVED %d 127.0.0.1:1\r\n" % request.slot)
    with pytest.raises(RateLimiterUnavailable, match="MOVED"):
        future.result(timeout=0)
    assert route.go_on is True
    action, node, asking = route.next()  # within RL_MOVED_READ_AFTER of the read: patched
    assert (action, router.address(node), asking) == (SEND, ("127.0.0.1", 1), False)
    assert route.go_on is False  # a new try


def test_a_routed_request_cut_off_by_a_timeout_is_not_sent_elsewhere(redis_cluster: Any) -> None:
    """A failure the driver names (fail_all's status) reaches the route of each pending
    routed request: a timeout is never retried (the decision may have run)."""
    router = _native.Router([("127.0.0.1", redis_cluster.nodes[0].port)])
    answer_read(router, None, time.monotonic() + 2, raw_shards(redis_cluster))
    request = _native.Codec("rl", hash_tag=True).check("user_frozen", 5, 60)
    route = router.route(request.slot, time.monotonic() + 2)
    request.route = route
    route.next()
    pipeline = _native.Pipeline(5.0)
    future: Future[Any] = Future()
    pipeline.push(future, request)
    pipeline.take()
    frozen = RateLimiterTimeout("Redis did not answer within 1 s (socket_timeout)")
    pipeline.fail_all(frozen, _native.STATUS_TIMEOUT)
    assert future.exception(timeout=0) is frozen
    assert route.go_on is False


def test_a_read_abandoned_mid_way_frees_the_single_flight() -> None:
    router = _native.Router([("127.0.0.1", 1)])
    _, read = read_for_an_unknown_slot(router)
    other = router.route(5, time.monotonic() + 1)
    assert other.next()[0] == WAIT  # one read at a time: the other call waits for it
    del read  # a cancelled task's read, never ended: dropping it ends it
    assert router.route(5, time.monotonic() + 1).next()[0] == READ
