"""The compact storage's own shape (lua/lib/compact_log.lua): one string per window under the
window's key and ":c", its TTL, its versioned layout, the OOM refusal, the replay table, a
switch of storage, hash tags on a cluster. Its decisions are the suite's, run over both
storages (tests/conftest.py), and test_storage_equivalence.py's."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis

from genai_ratelimit import RateLimiter, RateLimiterUnavailable, _native
from helpers_async import LimiterFactory
from helpers_core import Monitor, logged, server_ms, window_script
from redis_cluster import RedisCluster
from redis_server import RedisServer


@pytest.fixture
def compact(make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> Any:
    """A limiter of the kind under test, storage="compact", on a clean database."""
    return make_limiter(redis_url, storage="compact")


@pytest.mark.storages("compact", reason="the compact storage's own key shape")
def test_a_window_is_one_string_named_by_its_key_and_c(compact: Any, redis_client: redis.Redis,
                                                       user_id: str) -> None:
    compact.check_windows(user_id, [(5, 60), (100, 86400)], cost=2)
    assert sorted(redis_client.keys(f"ratelimit:{user_id}*")) == [
        f"ratelimit:{user_id}:60:c".encode(), f"ratelimit:{user_id}:86400:c".encode()]
    for seconds in (60, 86400):
        key = f"ratelimit:{user_id}:{seconds}:c"
        assert redis_client.type(key) == b"string"
        assert seconds < redis_client.pttl(key) <= seconds * 1000 + 1000
        assert redis_client.getrange(key, 0, 0) == b"\x03"  # layout 2, short form (1 entry)
    assert [cost for _, cost in logged(redis_client, f"ratelimit:{user_id}:60")] == [2]


@pytest.mark.storages("compact", reason="the compact storage's own layout")
def test_a_value_of_an_unknown_layout_version_is_refused_never_misread(
        compact: Any, redis_client: redis.Redis, user_id: str) -> None:
    compact.check(user_id, 5, 60)
    key = f"ratelimit:{user_id}:60:c"
    value = redis_client.get(key)
    redis_client.set(key, b"\x04" + value[1:])
    with pytest.raises(RateLimiterUnavailable, match="unknown compact layout"):
        compact.check(user_id, 5, 60)
    assert redis_client.get(key) == b"\x04" + value[1:]


@pytest.mark.storages("compact", reason="the compact storage's OOM probe")
@pytest.mark.limiter_kinds("sync", reason="the probe is the script's; one driver shows it")
def test_over_maxmemory_the_compact_script_is_refused_before_any_write(
        make_limiter: LimiterFactory) -> None:
    """The trim had an entry to drop: still nothing is written (the probe, SETRANGE key 0 "",
    is refused first)."""
    with RedisServer("--maxmemory", "8mb", "--maxmemory-policy", "noeviction") as server:
        client = redis.Redis.from_url(server.url)
        limiter = make_limiter(server.url, clock="client", storage="compact")
        now = int(time.time() * 1000)
        try:
            _native._set_client_clock(now - 120_000)
            limiter.check("full", 10, 60)
            _native._set_client_clock(now - 1_000)
            limiter.check("full", 10, 60)
            _native._set_client_clock(now)
            for i in range(4000):
                try:
                    client.set(f"ballast:{i}", b"x" * 65536)
                except redis.exceptions.OutOfMemoryError:
                    break
            # Over the limit for sure (the refused SET's own bytes no longer count).
            client.config_set("maxmemory", client.info("memory")["used_memory"] - 65536)
            before = client.get("ratelimit:full:60:c")
            with pytest.raises(RateLimiterUnavailable, match="out of memory"):
                limiter.check("full", 10, 60)
            assert client.get("ratelimit:full:60:c") == before
        finally:
            _native._set_client_clock(None)
            client.close()


def test_switching_storage_starts_a_fresh_window(make_limiter: LimiterFactory, redis_url: str,
                                                 redis_client: redis.Redis, user_id: str,
                                                 storage: str) -> None:
    """The storages keep their windows under different keys: a limiter switched to the other
    storage sees none of the first one's entries, and the first one's stay until they leave
    (or the keys expire)."""
    other = "zset" if storage == "compact" else "compact"
    first = make_limiter(redis_url)
    assert [first.check(user_id, 2, 60)[0] for _ in range(3)] == [True, True, False]
    switched = make_limiter(redis_url, storage=other)
    assert switched.check(user_id, 2, 60) == (True, 1, 0)
    assert first.check(user_id, 2, 60)[0] is False


def test_a_url_names_the_storage(make_limiter: LimiterFactory, redis_url: str,
                                 redis_client: redis.Redis, user_id: str) -> None:
    limiter = make_limiter(f"{redis_url}?storage=compact", storage=None)
    assert limiter.check(user_id, 2, 60) == (True, 1, 0)
    assert redis_client.exists(f"ratelimit:{user_id}:60:c")
    with pytest.raises(ValueError, match="contradicts"):
        make_limiter(f"{redis_url}?storage=compact", storage="zset")
    with pytest.raises(ValueError, match="storage"):
        make_limiter(f"{redis_url}?storage=list")


@pytest.mark.storages("compact", reason="the compact storage's replay table")
def test_a_replay_is_recognised_while_its_id_is_among_the_last_eight(
        redis_client: redis.Redis, user_id: str) -> None:
    """The replay table holds a window's 8 latest admissions: a replay after more than 8
    other admissions of that window is decided again (and counted if allowed)."""
    sha = redis_client.script_load(_native.COMPACT_SOURCE)
    key = f"ratelimit:{user_id}:60:c"
    now = server_ms(redis_client)

    def run(member: str, at: int, replay: bool = False) -> list[Any]:
        argv: list[Any] = [member, at, 60_000, 100, 1] + (["1"] if replay else [])
        return redis_client.evalsha(sha, 1, key, *argv)  # type: ignore[no-any-return]

    first = str(uuid.uuid4())
    assert run(first, now)[:2] == [1, 99]
    for n in range(7):
        run(str(uuid.uuid4()), now + 1 + n)
    replayed = run(first, now + 100, replay=True)
    assert replayed[:2] == [1, 92] and replayed[4] == now  # counted once, its own time
    run(str(uuid.uuid4()), now + 200)  # the ninth: `first` leaves the table
    assert run(first, now + 300, replay=True)[:2] == [1, 90]  # decided again: counted twice
    assert len(logged(redis_client, f"ratelimit:{user_id}:60")) == 10


def test_cluster_keys_carry_the_user_in_a_hash_tag_in_both_storages(
        make_limiter: LimiterFactory, redis_cluster: RedisCluster, storage: str) -> None:
    from redis.cluster import RedisCluster as ClusterClient

    limiter = make_limiter(redis_cluster.url)
    assert limiter.check_windows("user_8421", [(5, 60), (50, 3600)]) == (True, 4, 0, 60)
    reservation = limiter.reserve("user_8421", [(5, 60)], token_windows=[(900, 60)], tokens=30)
    assert limiter.reconcile(reservation, 10) == 1
    suffix = ":c" if storage == "compact" else ""
    inspector = ClusterClient(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        for key in (f"ratelimit:{{user_8421}}:60{suffix}", f"ratelimit:{{user_8421}}:3600{suffix}",
                    f"ratelimit:{{user_8421}}:60:tokens{suffix}"):
            assert inspector.exists(key), key
    finally:
        inspector.close()
    assert limiter.peek("user_8421", [(5, 60)]) == (True, 2, 0, 60)
    assert limiter.reset("user_8421") == 4


@pytest.mark.storages("compact", reason="the compact storage's layout changes")
@pytest.mark.limiter_kinds("sync", reason="the layout is the script's; one driver shows it")
def test_a_window_turns_weighted_and_back_to_plain_when_it_empties(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        user_id: str) -> None:
    limiter: RateLimiter = make_limiter(redis_url, clock="client", storage="compact")
    key = f"ratelimit:{user_id}:1:c"
    now = server_ms(redis_client)
    try:
        for n in range(10):
            _native._set_client_clock(now + n)
            limiter.check(user_id, 100, 1)
        assert redis_client.getrange(key, 2, 2) == b"\x00"  # plain: no running totals
        _native._set_client_clock(now + 20)
        assert limiter.check(user_id, 100, 1, cost=5) == (True, 85, 0)
        assert redis_client.getrange(key, 2, 2) == b"\x06"  # weighted: 6-byte totals
        assert [cost for _, cost in logged(redis_client, f"ratelimit:{user_id}:1")] == [1] * 10 + [5]
        _native._set_client_clock(now + 5_000)
        assert limiter.check(user_id, 100, 1) == (True, 99, 0)
        assert [cost for _, cost in logged(redis_client, f"ratelimit:{user_id}:1")] == [1]
    finally:
        _native._set_client_clock(None)


@pytest.mark.parametrize("url", [
    "redis://h:6379/0?storage=compact", "rediss://h:6380/1?storage=compact",
    "unix:///run/redis.sock?db=2&storage=compact", "redis+cluster://h1:7000,h2:7001/?storage=compact",
    "redis+sentinel://s1:26379,s2:26380/mymaster/0?storage=compact",
])
def test_every_url_form_names_the_storage(url: str) -> None:
    from genai_ratelimit._url import parse_redis_url

    assert parse_redis_url(url).storage == "compact"
    assert parse_redis_url(url.replace("compact", "zset")).storage == "zset"
    assert parse_redis_url(url.split("?")[0]).storage is None
    with pytest.raises(ValueError, match="unknown storage"):
        parse_redis_url(url.replace("compact", "list"))


@pytest.mark.limiter_kinds("sync", reason="the log's order is the script's; one driver shows it")
def test_a_reservation_after_65536_admissions_in_one_millisecond_is_charged_as_in_sorted_sets(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis, user_id: str,
        storage: str) -> None:
    """A compact window gives the entries of one millisecond ties 0 to 65,535 (2 bytes): after
    65,534 admissions in one millisecond, three reservations of that millisecond would take
    65,534, 65,535 and then none is left. The reconcile of the third charges its 50,000
    tokens as the sorted sets do (it once took tie 0 again, logged after 65,535: its
    reconcile found nothing and 49,990 tokens went uncharged)."""
    limiter: RateLimiter = make_limiter(redis_url, clock="client")
    sha, source = window_script(storage)
    redis_client.script_load(source)
    window = f"ratelimit:{user_id}:60"
    keys = [f"{window}:c"] if storage == "compact" else [window, f"{window}:w", f"{window}:t"]
    now = server_ms(redis_client)
    # 65,534 admissions at `now`, pipelined (the limiter's own script, its own arguments).
    for start in range(0, 65_534, 2_000):
        pipe = redis_client.pipeline(transaction=False)
        for _ in range(min(2_000, 65_534 - start)):
            pipe.evalsha(sha, len(keys), *keys, str(uuid.uuid4()), now, 60_000, 10**6, 1)
        assert all(reply[0] == 1 for reply in pipe.execute())
    _native._set_client_clock(now)
    try:
        held = [limiter.reserve(user_id, [(10**6, 60)], token_windows=[(10**6, 60)], tokens=10)
                for _ in range(3)]
        assert [r.allowed for r in held] == [True] * 3
        # Its millisecond has no tie left in the compact window: logged 1 ms later, and named so.
        assert [r.timestamp_ms - now for r in held] == [0, 0, 1 if storage == "compact" else 0]
        assert limiter.reconcile(held[2], 50_000) == 1
        assert limiter.reconcile(held[0], 7) == 1
        tokens = logged(redis_client, f"ratelimit:{user_id}:60:tokens")
        assert sorted(cost for _, cost in tokens) == [7, 10, 50_000]
        assert len(logged(redis_client, f"ratelimit:{user_id}:60")) == 65_537
        # Every entry is still found, and the windows count what the sorted sets count.
        assert limiter.reconcile(held[2], 50_000) == 1
        assert limiter.peek(user_id, [(10**6, 60)], token_windows=[(50_018, 60)], tokens=1) \
            == (True, 0, 0, 60)
        assert limiter.peek(user_id, [(10**6, 60)], token_windows=[(50_017, 60)], tokens=1)[0] \
            is False
    finally:
        _native._set_client_clock(None)


@pytest.mark.limiter_kinds("sync", reason="the log's order is the script's; one driver shows it")
def test_ties_stay_in_order_with_clocks_behind_and_after_a_refund(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis, user_id: str,
        storage: str) -> None:
    """Reservations at times that go back and forth (a tie above those of its millisecond,
    wherever that is in the log), and one at the millisecond of an entry a refund removed:
    every reconcile finds its own entry, and the refund's replay finds none (its tie is not
    given again)."""
    limiter: RateLimiter = make_limiter(redis_url, clock="client")
    now = server_ms(redis_client)
    held = []
    try:
        for offset in (0, 0, 5, 0, 5, 3, 0):
            _native._set_client_clock(now + offset)
            held.append(limiter.reserve(user_id, [(100, 60)], token_windows=[(10**6, 60)],
                                        tokens=1))
        _native._set_client_clock(now + 5)
        assert limiter.reconcile(held[4], 0) == 1  # the last entry of now + 5: removed
        held.append(limiter.reserve(user_id, [(100, 60)], token_windows=[(10**6, 60)], tokens=1))
        assert limiter.reconcile(held[4], 0) == 0  # a replay: nothing else is removed
        # The only entry of its millisecond (the last of the log) removed, then another there.
        # (Token windows only: a request window would keep the entry, and its tie.)
        _native._set_client_clock(now + 9)
        held.append(limiter.reserve(user_id, [], token_windows=[(10**6, 60)], tokens=1))
        assert limiter.reconcile(held[8], 0) == 1
        held.append(limiter.reserve(user_id, [], token_windows=[(10**6, 60)], tokens=1))
        assert limiter.reconcile(held[8], 0) == 0
        for n, reservation in enumerate(held):
            if n not in (4, 8):
                assert limiter.reconcile(reservation, 100 + n) == 1, n
    finally:
        _native._set_client_clock(None)
    assert sorted(logged(redis_client, f"ratelimit:{user_id}:60:tokens")) == sorted(
        (r.timestamp_ms, 100 + n) for n, r in enumerate(held) if n not in (4, 8))


def _layout_1_value(base: int, entries: list[tuple[int, int]], replays: list[tuple[str, int, int]],
                    room: int = 4) -> bytes:
    """A plain window's value in layout 1 (the previous release's, lua/lib/compact_log.lua's
    header: 51 bytes, a replay table of 8 slots, 4-byte times): entries (time, tie) and
    replay slots (request id, time, tie), oldest first."""
    data = 51 + 16 * 8
    packed = b"".join((at - base).to_bytes(4, "big") + tie.to_bytes(2, "big") for at, tie in entries)
    tail = data + len(packed)
    slots = b"".join(bytes.fromhex(member.replace("-", "")[:16]) + at.to_bytes(6, "big") +
                     tie.to_bytes(2, "big") for member, at, tie in replays)
    header = (bytes([1, 4, 0, 8]) + base.to_bytes(6, "big") + data.to_bytes(4, "big") +
              tail.to_bytes(4, "big") + (tail + 6 * room).to_bytes(4, "big") + bytes(14) +
              entries[0][0].to_bytes(6, "big") + entries[-1][0].to_bytes(6, "big") +
              (entries[-1][1] + 1).to_bytes(2, "big") + bytes([len(replays) % 8]))
    return header + slots + bytes(16 * 8 - len(slots)) + packed + bytes(6 * room)


@pytest.mark.storages("compact", reason="the compact storage's layouts")
def test_a_window_of_layout_1_is_read_and_rewritten_as_layout_2(
        redis_client: redis.Redis, user_id: str) -> None:
    """A value written by the previous layout (version 1) is decided on as it is: a peek reads
    it without writing, a replay finds its id in the old table, a refusal whose trim dropped an
    entry and an admission both rewrite it as layout 2, with the same entries."""
    sha = redis_client.script_load(_native.COMPACT_SOURCE)
    peek_sha = redis_client.script_load(_native.COMPACT_PEEK_SOURCE)
    key = f"ratelimit:{user_id}:60:c"
    now = server_ms(redis_client)
    first = str(uuid.uuid4())
    entries = [(now - 70_000, 0), (now - 30_000, 0), (now - 20_000, 0), (now - 20_000, 1),
               (now - 10_000, 0)]
    value = _layout_1_value(now - 120_000, entries, [(first, now - 20_000, 1)])
    redis_client.set(key, value, px=70_000)

    def run(script: str, member: str, at: int, limit: int, replay: bool = False) -> list[Any]:
        argv: list[Any] = [member, at, 60_000, limit, 1] + (["1"] if replay else [])
        return redis_client.evalsha(script, 1, key, *argv)  # type: ignore[no-any-return]

    peeked = run(peek_sha, str(uuid.uuid4()), now, 5)
    assert peeked[:2] == [1, 0] and peeked[7] == [4, now - 30_000]
    assert redis_client.get(key) == value  # read, never written
    replayed = run(sha, first, now, 5, replay=True)
    assert replayed[0] == 1 and replayed[4] == now - 20_000 and replayed[7] == 1
    assert redis_client.get(key)[0] == 2  # the replay's trim dropped the oldest: rewritten
    assert logged(redis_client, f"ratelimit:{user_id}:60") == [(at, 1) for at, _ in entries[1:]]
    refused = run(sha, str(uuid.uuid4()), now, 4)
    assert refused[:2] == [0, 0] and refused[6] == 30_000  # the oldest left 30 s from now
    allowed = run(sha, str(uuid.uuid4()), now, 5)
    assert allowed[:2] == [1, 0] and allowed[7] == 1  # above the ties of its millisecond
    assert redis_client.get(key)[0] == 3  # a short value: layout 2's short form
    assert logged(redis_client, f"ratelimit:{user_id}:60") == [
        (at, 1) for at, _ in entries[1:]] + [(now, 1)]
    assert 0 < redis_client.pttl(key) <= 61_000


@pytest.mark.storages("compact", reason="the compact storage's layouts")
def test_a_small_window_takes_no_more_memory_than_its_sorted_set(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis,
        user_id: str) -> None:
    """Layout 2 keeps a short window exactly its size (no room, a replay slot per admission
    still in the window): MEMORY USAGE at 1, 2 and 10 entries is at most the sorted set's."""
    limiters = {s: make_limiter(redis_url, storage=s) for s in ("zset", "compact")}
    for entries in (1, 2, 10):
        usage = {}
        for storage, limiter in limiters.items():
            user = f"{user_id}{entries}"
            for _ in range(entries):
                assert limiter.check(user, 100, 86400)[0]
            key = f"ratelimit:{user}:86400" + (":c" if storage == "compact" else "")
            usage[storage] = redis_client.memory_usage(key, samples=0)
        assert usage["compact"] <= usage["zset"], (entries, usage)


@pytest.mark.storages("compact", reason="the compact storage's short form")
def test_a_reconcile_of_a_short_window_reads_it_once_and_writes_it_once(
        compact: Any, redis_client: redis.Redis, user_id: str) -> None:
    """The header read takes a short value whole: the search, the entries after the one
    reconciled and the rewrite need no other read (they were five more commands)."""
    key = f"ratelimit:{user_id}:60:tokens:c"
    first = compact.reserve(user_id, [], token_windows=[(10**6, 60)], tokens=300)
    later = [compact.reserve(user_id, [], token_windows=[(10**6, 60)], tokens=50 + n)
             for n in range(3)]
    assert redis_client.getrange(key, 0, 0) == b"\x03"  # the short form
    for actual in (120, 0):
        with Monitor(redis_client) as monitor:
            assert compact.reconcile(first, actual) == 1
        commands = [c.name for c in monitor.from_scripts() if c.name != "TIME"]
        assert commands == ["GETRANGE", "SET"], commands
        assert [cost for _, cost in logged(redis_client, key[:-2])] == \
            [actual] * (actual > 0) + [50, 51, 52]
    assert compact.reconcile(later[1], 9) == 1
    assert [cost for _, cost in logged(redis_client, key[:-2])] == [50, 9, 52]
