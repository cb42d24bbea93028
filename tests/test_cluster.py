"""Redis Cluster: redis+cluster:// URLs, hash-tagged keys, exact decisions across the nodes
of a real 6-node cluster (tests/redis_cluster.py), MOVED and ASK followed, on every kind of
limiter. The failover and resharding tests are in test_cluster_failover.py."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from redis.cluster import RedisCluster as ClusterClient

from genai_ratelimit import RateLimiter, RateLimiterUnavailable
from genai_ratelimit._url import parse_redis_url
from helpers_async import LimiterFactory, run_async
from helpers_core import closed_port_url


def keyslot(cluster: Any, key: str) -> int:
    return int(cluster.cli(cluster.nodes[0], "cluster", "keyslot", key).strip())


def users_over_all_slots(cluster: Any, count: int) -> list[str]:
    """count user ids whose slots fall in every master's ranges (checked, not assumed)."""
    users = [f"user_{i}" for i in range(count)]
    owners = {cluster.master_of_slot(keyslot(cluster, f"{{{u}}}")).port for u in users[::max(1, count // 30)]}
    assert len(owners) == 3
    return users


@pytest.fixture
def inspector(redis_cluster: Any) -> Any:
    client = ClusterClient(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        yield client
    finally:
        client.close()


# ------------------------------------------------------------------- URLs

def test_cluster_url_names_the_seed_nodes() -> None:
    options = parse_redis_url("redis+cluster://:s3cret@127.0.0.1:7000,[::1]:7001,h/")
    assert options.mode == "cluster"
    assert options.nodes == (("127.0.0.1", 7000), ("::1", 7001), ("h", 6379))
    assert "s3cret" not in repr(options) and "s3cret" not in options.describe()
    assert options.describe() == "redis+cluster://127.0.0.1:7000,[::1]:7001,h:6379/"


def test_tls_cluster_url_takes_the_ssl_parameters() -> None:
    options = parse_redis_url("rediss+cluster://a:1,b:2/?ssl_cert_reqs=none")
    assert options.tls and options.tls_trust() is None


def test_sentinel_url_names_the_master_and_db() -> None:
    options = parse_redis_url("redis+sentinel://:pw@s1,s2:26380/mymaster/2")
    assert options.mode == "sentinel"
    assert options.nodes == (("s1", 26379), ("s2", 26380))
    assert options.master_name == "mymaster" and options.db == 2


@pytest.mark.parametrize(("url", "problem"), [
    ("redis+cluster:///", "at least one host"),
    ("redis+cluster://a:1,,b:2/", "empty host"),
    ("redis+cluster://a:99999/", "port"),
    ("redis+cluster://a:1/3", "database 0 only"),
    ("redis+cluster://a:1/?foo=1", "unknown query parameter"),
    ("redis+cluster://a:1/?ssl_cert_reqs=none", "rediss://"),
    ("redis+sentinel://a:1/", "master's name"),
    ("redis+sentinel://a:1/m/x", "non-negative integer"),
])
def test_malformed_cluster_and_sentinel_urls_raise_value_error(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_redis_url(url)


def test_a_password_never_shows_in_a_cluster_url_error() -> None:
    with pytest.raises(ValueError) as caught:
        parse_redis_url("redis+cluster://:hunter2@a:1,b:x/")
    assert "hunter2" not in str(caught.value)


def test_cluster_key_prefix_with_a_brace_is_refused(make_limiter: LimiterFactory) -> None:
    with pytest.raises(ValueError, match="key_prefix"):
        make_limiter("redis+cluster://127.0.0.1:1/", key_prefix="rl{x}")


# ------------------------------------------------------------------- keys

def test_cluster_keys_carry_the_user_id_in_a_hash_tag(make_limiter: LimiterFactory,
                                                      redis_cluster: Any, inspector: Any) -> None:
    limiter = make_limiter(redis_cluster.url)
    assert limiter.check_windows("user_8421", [(5, 60), (50, 3600)])[0]
    assert inspector.exists("ratelimit:{user_8421}:60", "ratelimit:{user_8421}:3600") == 2
    assert inspector.zcard("ratelimit:{user_8421}:60") == 1


@pytest.mark.parametrize("tricky", ["a}b", "{a}", "a%7Db", "%", "}", "{", "a{b}c}"])
def test_user_ids_with_braces_get_their_own_tag_and_slot(make_limiter: LimiterFactory,
                                                         redis_cluster: Any, inspector: Any,
                                                         tricky: str) -> None:
    limiter = make_limiter(redis_cluster.url)
    encoded = tricky.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    assert limiter.check(tricky, 2, 60) == (True, 1, 0)
    key = f"ratelimit:{{{encoded}}}:60"
    assert inspector.zcard(key) == 1
    assert keyslot(redis_cluster, key) == keyslot(redis_cluster, encoded)


def test_ids_that_differ_only_by_escaping_never_share_a_key(make_limiter: LimiterFactory,
                                                           redis_cluster: Any) -> None:
    limiter = make_limiter(redis_cluster.url)
    ids = ["a}b", "a%7Db", "a", "a}", "{a}", "%7Ba%7D", "a%"]
    assert [limiter.check(u, 1, 60)[0] for u in ids] == [True] * len(ids)
    assert [limiter.check(u, 1, 60)[0] for u in ids] == [False] * len(ids)


# ------------------------------------------------------------------- decisions

def test_check_windows_on_a_cluster_never_raises_crossslot(make_limiter: LimiterFactory,
                                                           redis_cluster: Any) -> None:
    limiter = make_limiter(redis_cluster.url)
    users = users_over_all_slots(redis_cluster, 300)
    windows = [(2, 1), (3, 60), (4, 3600), (5, 86400)]
    for user in users:
        assert limiter.check_windows(user, windows)[0]
        assert limiter.check_windows(user, windows, cost=1)[0]
        assert limiter.check_windows(user, windows) == (False, 0, 1, 1)


def test_reserve_and_reconcile_work_on_a_cluster(make_limiter: LimiterFactory,
                                                 redis_cluster: Any) -> None:
    limiter = make_limiter(redis_cluster.url)
    reservation = limiter.reserve("user_1", [(10, 60)], token_windows=[(1000, 60)], tokens=500)
    assert reservation.allowed
    assert limiter.reconcile(reservation, 100) == 1


USERS = 1000
CALLERS = 20
LIMIT = 10


def test_exact_across_nodes_with_concurrent_callers(make_limiter: LimiterFactory,
                                                    redis_cluster: Any) -> None:
    """1,000 users over every master, 20 concurrent callers each asking for every user
    with limit 10: exactly 10 allowed per user."""
    users = users_over_all_slots(redis_cluster, USERS)
    allowed = {user: 0 for user in users}
    lock = threading.Lock()
    if not make_limiter.is_async:
        limiter = make_limiter(redis_cluster.url, max_connections=CALLERS)

        def caller(offset: int) -> None:
            for i in range(USERS):
                user = users[(i + offset * 50) % USERS]
                if limiter.check(user, LIMIT, 60)[0]:
                    with lock:
                        allowed[user] += 1

        with ThreadPoolExecutor(CALLERS) as pool:
            list(pool.map(caller, range(CALLERS)))
    else:
        native = make_limiter.native(redis_cluster.url)

        async def caller(offset: int) -> None:
            for i in range(USERS):
                user = users[(i + offset * 50) % USERS]
                if (await native.check(user, LIMIT, 60))[0]:
                    allowed[user] += 1

        async def main() -> None:
            await asyncio.gather(*(caller(k) for k in range(CALLERS)))
            await native.aclose()

        run_async(main(), make_limiter.loop_factory)
    assert set(allowed.values()) == {LIMIT}


def test_moved_is_followed_after_a_slot_changes_owner(make_limiter: LimiterFactory,
                                                     redis_cluster: Any, inspector: Any) -> None:
    """The limiter learnt the map; then a slot (empty) is handed to another master by
    CLUSTER SETSLOT: the next check meets MOVED, reads the map again and is answered."""
    limiter = make_limiter(redis_cluster.url)
    user = "user_moved"
    slot = keyslot(redis_cluster, user)
    assert limiter.check(user, 5, 60) == (True, 4, 0)
    inspector.delete(f"ratelimit:{{{user}}}:60")
    source = redis_cluster.master_of_slot(slot)
    target = next(n for n in redis_cluster.masters() if n is not source)
    redis_cluster.assign([slot], target)
    try:  # (the slot stays with its new owner: handing it straight back races the gossip)
        assert limiter.check(user, 5, 60) == (True, 4, 0)
        assert redis_cluster.master_of_slot(slot) is target
    finally:
        redis_cluster.flush()
        redis_cluster.wait_ok()


def asking_calls(cluster: Any, node: Any) -> int:
    for line in cluster.cli(node, "info", "commandstats").splitlines():
        if line.startswith("cmdstat_asking:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


def test_ask_is_followed_while_a_slot_migrates(make_limiter: LimiterFactory,
                                               redis_cluster: Any) -> None:
    """A slot marked migrating on its owner and importing on another, the user's keys on
    neither: the owner answers ASK, the limiter sends ASKING and the script to the importing
    node, which answers TRYAGAIN (a multi-key script mid-migration); the limiter keeps
    trying within its deadline, and once the migration completes the decision is made on
    the new owner."""
    limiter = make_limiter(redis_cluster.url, socket_timeout=10.0)
    user = "user_ask"
    slot = keyslot(redis_cluster, user)
    assert limiter.check("warm-up", 5, 60)[0]  # the map is known before the migration
    source = redis_cluster.master_of_slot(slot)
    target = next(n for n in redis_cluster.masters() if n is not source)
    source_id = redis_cluster.cli(source, "cluster", "myid").strip()
    target_id = redis_cluster.cli(target, "cluster", "myid").strip()
    redis_cluster.cli(target, "cluster", "setslot", str(slot), "importing", source_id)
    redis_cluster.cli(source, "cluster", "setslot", str(slot), "migrating", target_id)
    asked_before = asking_calls(redis_cluster, target)
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(limiter.check(user, 2, 60)))
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while asking_calls(redis_cluster, target) == asked_before:
            assert time.monotonic() < deadline, "the limiter never sent ASKING"
            time.sleep(0.01)  # polling a condition, bounded
        redis_cluster.assign([slot], target)  # the migration completes
        worker.join(10)
        assert result == [(True, 1, 0)]
        assert redis_cluster.master_of_slot(slot) is target
    finally:
        worker.join(10)
        redis_cluster.flush()
        redis_cluster.assign([slot], target)  # done, or undone (marks cleared) after a failure
        redis_cluster.wait_ok()


def test_a_single_node_url_on_a_cluster_node_says_to_use_the_cluster_url(
        make_limiter: LimiterFactory, redis_cluster: Any) -> None:
    node = redis_cluster.masters()[0]
    limiter = make_limiter(f"redis://127.0.0.1:{node.port}/0")
    failures = 0
    for i in range(20):  # the keys of one check are in several slots, mostly elsewhere
        with pytest.raises(RateLimiterUnavailable, match=r"(MOVED|CROSSSLOT).*redis\+cluster://"):
            limiter.check(f"user_{i}", 5, 60)
        failures += 1
    assert failures == 20


def test_an_unreachable_cluster_is_unavailable_within_the_timeouts(
        make_limiter: LimiterFactory) -> None:
    port = closed_port_url().rsplit(":", 1)[1].split("/")[0]
    limiter = make_limiter(f"redis+cluster://127.0.0.1:{port}/", connect_timeout=0.3,
                           socket_timeout=0.3)
    with pytest.raises(RateLimiterUnavailable):
        limiter.check("user_1", 5, 60)


def test_a_cluster_limiter_closes_every_node(make_limiter: LimiterFactory,
                                             redis_cluster: Any) -> None:
    limiter = make_limiter(redis_cluster.url)
    for i in range(30):
        limiter.check(f"user_{i}", 5, 60)
    limiter.close()
    assert limiter.closed
    with pytest.raises(Exception, match="closed"):
        limiter.check("user_1", 5, 60)


def test_a_cluster_limiter_works_in_a_fork_child(redis_cluster: Any) -> None:
    import os

    limiter = RateLimiter(redis_cluster.url)
    assert limiter.check("user_fork", 3, 60)[0]
    pid = os.fork()
    if pid == 0:  # the child: its own connections to every node
        code = 0 if limiter.check("user_fork", 3, 60) == (True, 1, 0) else 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert limiter.check("user_fork", 3, 60) == (True, 0, 0)
    limiter.close()


def test_script_is_loaded_on_each_node_after_script_flush(make_limiter: LimiterFactory,
                                                          redis_cluster: Any) -> None:
    limiter = make_limiter(redis_cluster.url)
    users = users_over_all_slots(redis_cluster, 100)
    for user in users:
        assert limiter.check(user, 2, 60)[0]
    for node in redis_cluster.masters():
        redis_cluster.cli(node, "script", "flush")
    for user in users:
        assert limiter.check(user, 2, 60) == (True, 0, 0)


def test_the_docs_cluster_example_runs(redis_cluster: Any, inspector: Any,
                                         tmp_path: Any) -> None:
    """docs/redis.md "Redis Cluster and Sentinel": its example, with its seed URL pointed at
    this session's cluster, runs as written in a fresh interpreter."""
    import subprocess
    import sys

    from helpers_docs import DOCS, python_blocks

    blocks = python_blocks("## Redis Cluster and Sentinel", DOCS / "redis.md")
    assert len(blocks) == 1
    example_url = "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002/"
    assert example_url in blocks[0]
    script = tmp_path / "example.py"
    script.write_text(blocks[0].replace(example_url, redis_cluster.url), encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert inspector.zcard("ratelimit:{user_8421}:60") == 2


def test_a_fragmented_slot_map_is_read(make_limiter: LimiterFactory, redis_cluster: Any) -> None:
    """After many partial reshardings a master owns many small ranges: here 60 single
    slots handed from one master to another make both hold about 60 ranges (CLUSTER SHARDS
    answers arrays of over 120 numbers, CLUSTER SLOTS over 120 entries). A fresh limiter
    reads that map and decides on every master."""
    source = redis_cluster.master_of_slot(0)
    target = next(n for n in redis_cluster.masters() if n is not source)
    moved = redis_cluster.owned_slots(source)[7::50][:60]
    assert len(moved) == 60
    try:  # (the slots stay with their new owner: handing them straight back races the gossip)
        redis_cluster.assign(moved, target)
        limiter = make_limiter(redis_cluster.url)
        for user in users_over_all_slots(redis_cluster, 300):
            assert limiter.check(user, 1, 60) == (True, 0, 0)
    finally:
        redis_cluster.flush()
        redis_cluster.wait_ok()


def test_every_key_kind_carries_the_hash_tag(make_limiter: LimiterFactory, redis_cluster: Any,
                                             inspector: Any) -> None:
    """Leases, peek, reset, a user's scope and a shared scope on a cluster: every key of the
    user is in the user's slot (never CROSSSLOT); a shared scope's keys carry the scope's
    name as their tag and are decided in a step of their own."""
    from genai_ratelimit import Scope

    limiter = make_limiter(redis_cluster.url)
    lease = limiter.acquire("user_kinds", 2, 60)
    assert lease.allowed
    assert inspector.exists("ratelimit:{user_kinds}:leases") == 1
    assert limiter.release(lease)
    reservation = limiter.reserve("user_kinds", [(5, 60)], scopes=[
        Scope("route", [(3, 60)]), Scope("openai", [(100, 60)], shared=True)])
    assert reservation.allowed
    assert inspector.zcard("ratelimit:{user_kinds}:60") == 1
    assert inspector.zcard("ratelimit:{user_kinds}:60:scope=route") == 1
    assert inspector.zcard("ratelimit:{openai}:60:shared") == 1
    assert limiter.peek("user_kinds", [(5, 60)])[:2] == (True, 3)
    assert limiter.reset("user_kinds") >= 2
    assert inspector.exists("ratelimit:{user_kinds}:60", "ratelimit:{user_kinds}:60:scope=route",
                            ) == 0
    assert inspector.zcard("ratelimit:{openai}:60:shared") == 1  # a shared cap is never reset
