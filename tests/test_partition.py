"""A network partition in a Redis Cluster under load: one master and the clients that talk
to it cut off from the majority (the other masters and every replica, its own among them,
which the majority promotes), then healed (tests/partition.py: loopback proxies the nodes
announce). The cut-off master admits until cluster-node-timeout, and Redis discards what it
took when it rejoins as a replica: admissions lost, each a free extra request. With
min_replicas=1 an admission no replica acknowledged is not an admission, and the loss is
bounded. The over-admission is read back from Redis after the heal (the entries of each
user on the final master of its slot); the figures are printed (-s), and measured over
several runs by benchmarks/failover_partition.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from genai_ratelimit import RateLimiterUnavailable
from helpers_async import LimiterFactory
from partition import NODE_TIMEOUT_S, PartitionableCluster, run_partition

pytestmark = [
    pytest.mark.slow,
    pytest.mark.limiter_kinds(
        "sync", "asyncio", reason="uvloop drives the same asyncio code; each partition costs "
                                  "seconds"),
    pytest.mark.storages(
        "zset", reason="what a partition loses is the writes Redis discards, whatever their "
                       "shape; each partition costs seconds"),
]

LIMIT = 2000  # the limit, per user and hour (a user that reaches it changes no figure)
USERS = 20
# The cut-off master stops taking writes (cluster_state:fail) once it has missed the
# majority's answers for cluster-node-timeout, and its cron (every 100 ms) has seen it: within
# this much more on a loaded 2-core machine (1.1 s after the cut was seen here).
STOP_BOUND_S = 1.5
# An admission answered before it said so may be recorded this much later (threads, the loop).
IN_FLIGHT_S = 0.5
# The partition lasts this much longer than the cut-off side could admit, to see it stopped.
HOLD_MARGIN_S = 0.5
HOLD_S = NODE_TIMEOUT_S + STOP_BOUND_S + IN_FLIGHT_S + HOLD_MARGIN_S
KILL_BOUND = 2  # what a kill -9 costs per user: the checks in flight


@pytest.fixture(scope="module")
def own_cluster() -> Iterator[PartitionableCluster]:
    with PartitionableCluster() as cluster:  # not the session's: it gets cut
        yield cluster


@pytest.fixture
def cluster(own_cluster: PartitionableCluster) -> PartitionableCluster:
    own_cluster.wait_ok()
    own_cluster.flush()
    return own_cluster


def test_a_cut_off_master_admits_until_node_timeout_and_loses_it_at_heal(
        make_limiter: LimiterFactory, cluster: PartitionableCluster) -> None:
    partition = run_partition(make_limiter, cluster, users=USERS, limit=LIMIT, hold_s=HOLD_S)
    print(f"\nwithout min_replicas: {partition.summary()}")
    # The partition happened: the majority promoted the replica, the old master rejoined as
    # its replica, and what it took while cut off is gone.
    assert partition.final_masters_are_the_replica and partition.old_master_role == "slave"
    assert sum(partition.over_admission.values()) > 0, partition.summary()
    # The cut-off side admitted after the cut, and stopped within node-timeout: the master
    # refuses writes once it says cluster_state:fail, and the partition lasted longer.
    last = partition.last_admission_during()
    assert last is not None, partition.summary()
    assert partition.isolated_down_at - partition.cut_at <= NODE_TIMEOUT_S + STOP_BOUND_S, \
        partition.summary()
    assert last <= partition.isolated_down_at + IN_FLIGHT_S, partition.summary()


def test_with_min_replicas_the_cut_off_side_admits_nothing_that_is_lost(
        make_limiter: LimiterFactory, cluster: PartitionableCluster) -> None:
    partition = run_partition(make_limiter, cluster, users=USERS, limit=LIMIT,
                              limiter_options={"min_replicas": 1, "replica_timeout_ms": 100},
                              hold_s=HOLD_S)
    print(f"\nmin_replicas=1: {partition.summary()}")
    assert partition.final_masters_are_the_replica and partition.old_master_role == "slave"
    over = partition.over_admission
    assert max(over.values()) <= KILL_BOUND, (over, partition.summary())
    # Not one check answered by the cut-off master after the cut was an admission: its
    # writes reached no replica, and the calls said so.
    during = partition.during()
    assert not [r for r in during if r[2] is True], partition.summary()
    unreplicated = [r for r in during if isinstance(r[2], RateLimiterUnavailable)
                    and "not replicated" in str(r[2])]
    assert unreplicated, [r[2] for r in during[:5]]
