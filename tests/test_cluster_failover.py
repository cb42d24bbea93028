"""Redis Cluster faults under load, on a cluster of this module's own (the session's stays
whole): a master killed with SIGKILL (its replica takes over), and slots resharded with
`redis-cli --cluster reshard`. Real processes, real failovers; every load loop is bounded in
count and time."""

from __future__ import annotations

import binascii
import signal
import time
from collections.abc import Iterator

import pytest
from redis.cluster import RedisCluster as ClusterClient

from fault_load import Load, allowed_per_user
from helpers_async import LimiterFactory
from redis_cluster import RedisCluster, redis_cli

pytestmark = [pytest.mark.slow, pytest.mark.limiter_kinds(
    "sync", "asyncio", reason="uvloop drives the same asyncio code; each failover costs seconds")]

LIMIT = 20
CALLERS = 8
SOCKET_TIMEOUT = 1.0


def slot_of(user: str) -> int:
    """The hash slot of a user's keys (its tag has no brace or '%' here): CRC16-XMODEM."""
    return binascii.crc_hqx(user.encode(), 0) % 16384


@pytest.fixture(scope="module")
def own_cluster() -> Iterator[RedisCluster]:
    with RedisCluster() as cluster:  # not the session's: its nodes get killed
        yield cluster


@pytest.fixture
def cluster(own_cluster: RedisCluster) -> RedisCluster:
    own_cluster.restart_missing()
    own_cluster.flush()
    return own_cluster


def load_of(make_limiter: LimiterFactory, url: str, users: list[str]) -> Load:
    """CALLERS callers checking users round-robin, limit LIMIT per minute, every decision
    recorded (fault_load.Load)."""
    return Load(make_limiter, url, users, limit=LIMIT, window=60, callers=CALLERS,
                socket_timeout=SOCKET_TIMEOUT)


def test_a_killed_master_fails_only_the_checks_of_the_failover_time(
        make_limiter: LimiterFactory, cluster: RedisCluster) -> None:
    users = [f"user_{i}" for i in range(600)]
    victim = cluster.master_of_slot(slot_of(users[0]))
    with load_of(make_limiter, cluster.url, users) as load:
        load.wait_for(300)
        killed_at = time.monotonic()
        victim.kill()  # SIGKILL: no goodbye on any connection
        cluster.wait_ok()  # a replica was promoted; the cluster serves every slot again
        recovered_at = time.monotonic()
        count_at_recovery = len(load.records)
        load.wait_for(count_at_recovery + 600)
    failures = [r for r in load.records if isinstance(r[2], Exception)]
    # Failures only for checks that ran while the failover was under way.
    assert all(killed_at - SOCKET_TIMEOUT <= start <= recovered_at for start, *_ in failures), \
        failures[:3]
    after = [r for r in load.records if r[0] > recovered_at]
    assert after and not [r for r in after if isinstance(r[2], Exception)]
    print(f"\nfailover {recovered_at - killed_at:.2f} s, {len(failures)} of "
          f"{len(load.records)} checks failed")
    # No user ever holds more than its limit, and the rest of its budget is exact.
    client = ClusterClient(host="127.0.0.1", port=cluster.alive()[0].port)
    try:
        probe = make_limiter(cluster.url)
        for user in users[:200]:
            held = client.zcard(f"ratelimit:{{{user}}}:60")
            assert held <= LIMIT
            more = 0
            while probe.check(user, LIMIT, 60)[0]:
                more += 1
                assert more <= LIMIT
            assert held + more == LIMIT
    finally:
        client.close()


def test_resharding_under_load_answers_every_check_exactly(
        make_limiter: LimiterFactory, cluster: RedisCluster) -> None:
    """Slots move between masters (redis-cli --cluster reshard: MIGRATE, ASK, TRYAGAIN,
    MOVED) while the checks run: every check is answered, and every user gets exactly its
    limit."""
    source = cluster.master_of_slot(0)
    target = next(n for n in cluster.masters() if n is not source)
    moving = 200  # reshard moves the source's lowest slots first
    users = [u for u in (f"user_{i}" for i in range(200_000)) if slot_of(u) < moving][:150]
    users += [f"other_{i}" for i in range(150)]
    source_id = cluster.cli(source, "cluster", "myid").strip()
    target_id = cluster.cli(target, "cluster", "myid").strip()
    with load_of(make_limiter, cluster.url, users) as load:
        load.wait_for(200)
        redis_cli("--cluster", "reshard", f"127.0.0.1:{source.port}", "--cluster-from",
                  source_id, "--cluster-to", target_id, "--cluster-slots", str(moving),
                  "--cluster-yes", "--cluster-pipeline", "10", timeout=60)
        cluster.wait_ok()
        load.wait_for(len(users) * (LIMIT + 3))
    errors = [r for r in load.records if isinstance(r[2], Exception)]
    assert not errors, errors[:3]
    assert cluster.master_of_slot(0) is target
    counts = allowed_per_user(load.records)
    assert set(counts.values()) == {LIMIT}
    # Give the slots back, for the next test.
    redis_cli("--cluster", "reshard", f"127.0.0.1:{target.port}", "--cluster-from", target_id,
              "--cluster-to", source_id, "--cluster-slots", str(moving), "--cluster-yes",
              timeout=60)
    cluster.wait_ok()


def role_of(port: int) -> str:
    return redis_cli("-p", str(port), "role", timeout=5).split()[0]


def test_a_frozen_master_is_left_within_a_second_of_its_replicas_promotion(
        make_limiter: LimiterFactory, cluster: RedisCluster) -> None:
    """SIGSTOP on a master under load: the checks of its slots time out until its replica
    is promoted (cluster-node-timeout), then resume within a second, though the frozen
    node never closes a connection (a timeout makes the map be read again)."""
    users = [f"user_{i}" for i in range(600)]
    victim = cluster.master_of_slot(slot_of(users[0]))
    victim_id = cluster.cli(victim, "cluster", "myid").strip()
    replica = next(n for n in cluster.alive() if n is not victim and victim_id in
                   cluster.cli(n, "cluster", "nodes").split("myself")[1].splitlines()[0])
    served = set(cluster.owned_slots(victim))
    frozen_users = {u for u in users if slot_of(u) in served}
    assert victim.process is not None
    with load_of(make_limiter, cluster.url, users) as load:
        load.wait_for(300)
        stopped_at = time.monotonic()
        victim.process.send_signal(signal.SIGSTOP)
        try:
            while role_of(replica.port) != "master":
                assert time.monotonic() - stopped_at < 15, "the replica was never promoted"
                time.sleep(0.02)  # polling a condition, bounded
            promoted_at = time.monotonic()
            resumed_at = None
            while resumed_at is None:
                assert time.monotonic() - promoted_at < 10, "the frozen master's slots never came back"
                done = [end for start, end, outcome, user in list(load.records)
                        if user in frozen_users and outcome is True and start > stopped_at]
                resumed_at = min(done) if done else None
                time.sleep(0.02)  # polling a condition, bounded
        finally:
            victim.process.send_signal(signal.SIGCONT)
    print(f"\nfrozen master: promoted {promoted_at - stopped_at:.2f} s after SIGSTOP, its slots "
          f"answered again {resumed_at - promoted_at:.2f} s after the promotion")
    assert resumed_at - promoted_at <= 1.0
