"""A Redis Cluster that can be cut in two, and the partition scenario the tests
(tests/test_partition.py) and the benchmark (benchmarks/failover_partition.py) run on it.

The cluster: tests/redis_cluster.py's 3 masters + 3 replicas, every byte between them and to
them crossing loopback proxies (tests/partition_proxy.py, a process of its own). Each node
announces its proxy's ports (cluster-announce-ip 127.0.0.1, cluster-announce-port,
cluster-announce-bus-port) and makes its outgoing connections (cluster bus, replication)
from an address of its own, 127.0.0.(SOURCE_BASE + k) (bind-source-addr), by which the
proxies tell it apart from a client (127.0.0.1, this process). cut(node) puts that node and
the clients on one side and the 5 other nodes, its own replica among them, on the other:
the connections across are aborted, new ones held and never forwarded. heal() forwards
again. The harness itself (redis-cli, the inspection clients) talks to the nodes' own ports,
never cut.

The scenario (run_partition): a load (fault_load.Load) checks users whose slots the cut-off
master serves, through the proxies; the master and the clients are cut off from the
majority; once the majority has promoted the master's replica and the cut-off master has
stopped taking writes (cluster_state:fail), the partition heals; the load goes on until the
users' checks are answered again (by the promoted replica), then the entries of each user
are read from the final master of its slot."""

from __future__ import annotations

import binascii
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from fault_load import Load, Record, allowed_per_user
from helpers_async import LimiterFactory
from helpers_core import logged_entries
from redis_cluster import NODE_TIMEOUT_MS, RedisCluster, redis_cli
from redis_server import RedisServer

SOURCE_BASE = 11  # node k connects from 127.0.0.(11 + k)
NODE_TIMEOUT_S = NODE_TIMEOUT_MS / 1000
PROXY = Path(__file__).resolve().parent / "partition_proxy.py"


def slot_of(user: str) -> int:
    """The hash slot of a user's keys (its tag has no brace or '%' here): CRC16-XMODEM."""
    return binascii.crc_hqx(user.encode(), 0) % 16384


def role_of(node: RedisServer) -> str:
    """"master" or "slave" (ROLE's first word), on the node's own port."""
    return redis_cli("-p", str(node.port), "role", timeout=5).split()[0]


class PartitionableCluster(RedisCluster):
    """RedisCluster behind cuttable proxies (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.sources = [f"127.0.0.{SOURCE_BASE + k}" for k in range(len(self.nodes))]
        self.proxy: subprocess.Popen[str] | None = None
        self.announced: list[tuple[int, int]] = []  # per node: (client port, bus port)

    @property
    def url(self) -> str:
        seeds = ",".join(f"127.0.0.1:{port}" for port, _ in self.announced[:3])
        return f"redis+cluster://{seeds}/"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        self._start_proxy()
        for node, source, (port, bus_port) in zip(self.nodes, self.sources, self.announced,
                                                  strict=True):
            self.cli(node, "config", "set", "cluster-announce-ip", "127.0.0.1",
                     "cluster-announce-port", str(port), "cluster-announce-bus-port",
                     str(bus_port), "bind-source-addr", source)
        # Through the proxies from the first command on: MEET names the announced ports.
        redis_cli("--cluster", "create", *[f"127.0.0.1:{port}" for port, _ in self.announced],
                  "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes")
        self.wait_ok()

    def _start_proxy(self) -> None:
        nodes = [{"port": node.port, "bus_port": bus_port(node), "source": source}
                 for node, source in zip(self.nodes, self.sources, strict=True)]
        # Not under the ASan runtime a sanitized test run preloads: the proxy is plain Python.
        environment = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        self.proxy = subprocess.Popen([sys.executable, str(PROXY), json.dumps(nodes)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, env=environment)
        self.announced = [(port, bus) for port, bus in json.loads(self._answer())]

    def _answer(self) -> str:
        assert self.proxy is not None and self.proxy.stdout is not None
        line = self.proxy.stdout.readline()
        if not line:
            raise RuntimeError(f"the partition proxy exited ({self.proxy.poll()})")
        return line.strip()

    def _command(self, line: str) -> int:
        """Sends the proxy a command; returns how many connections it aborted."""
        assert self.proxy is not None and self.proxy.stdin is not None
        self.proxy.stdin.write(line + "\n")
        self.proxy.stdin.flush()
        answer = self._answer()
        if not answer.startswith("ok "):
            raise RuntimeError(f"the partition proxy answered {answer!r} to {line!r}")
        return int(answer.split()[1])

    def cut(self, node: RedisServer) -> int:
        """Cuts node and the clients off from the other nodes; returns how many
        connections across the cut were aborted."""
        index = self.nodes.index(node)
        return self._command("cut " + json.dumps({"isolated": [index], "clients_isolated": True}))

    def heal(self) -> int:
        return self._command("heal")

    def by_announced_port(self) -> dict[int, RedisServer]:
        return {port: node for node, (port, _) in zip(self.nodes, self.announced, strict=True)
                if node in self.alive()}

    def wait_ok(self, timeout: float = 30.0) -> None:
        """RedisCluster.wait_ok, and every replica replicating through a proxy."""
        super().wait_ok(timeout)
        proxied = {str(port) for port, _ in self.announced}
        deadline = time.monotonic() + timeout
        while not all(self.master_port(node) in proxied for node in self.replicas()):
            if time.monotonic() > deadline:
                raise RuntimeError("a replica replicates from a port that is not a proxy's")
            time.sleep(0.05)  # polling a condition, bounded by the deadline

    def master_port(self, replica: RedisServer) -> str:
        for line in self.cli(replica, "info", "replication").splitlines():
            if line.startswith("master_port:"):
                return line.split(":")[1].strip()
        return ""

    def replicas(self) -> list[RedisServer]:
        return [node for node in self.alive() if role_of(node) == "slave"]

    def replica_of(self, master: RedisServer) -> RedisServer:
        """The node that replicates master (CLUSTER NODES: a line whose master id is its)."""
        master_id = self.cli(master, "cluster", "myid").strip()
        by_port = self.by_announced_port()
        for line in self.cli(master, "cluster", "nodes").splitlines():
            fields = line.split()
            if fields[3] == master_id:
                return by_port[int(fields[1].split("@")[0].rsplit(":", 1)[1])]
        raise RuntimeError(f"no replica of {master.port}")

    def close(self) -> None:
        try:
            if self.proxy is not None and self.proxy.poll() is None:
                self.proxy.terminate()
                try:
                    self.proxy.wait(10)
                except subprocess.TimeoutExpired:
                    self.proxy.kill()
                    self.proxy.wait(10)
        finally:
            if self.proxy is not None:
                for stream in (self.proxy.stdin, self.proxy.stdout):
                    if stream is not None:
                        stream.close()
            super().close()


def bus_port(node: RedisServer) -> int:
    """The node's cluster bus port (RedisCluster gives each one --cluster-port)."""
    return int(node.extra_args[node.extra_args.index("--cluster-port") + 1])


def users_on(cluster: RedisCluster, node: RedisServer, count: int) -> list[str]:
    """count user names whose slots node serves."""
    served = set(cluster.owned_slots(node))
    names = (f"user_{i}" for i in range(1_000_000))
    return [name for name in names if slot_of(name) in served][:count]


@dataclass
class Partition:
    """What one run of the scenario recorded. Times are time.monotonic()."""

    users: list[str]
    records: list[Record]
    cut_at: float  # the proxies had aborted every connection across the cut
    aborted: int  # how many they aborted
    isolated_down_at: float  # the cut-off master answered cluster_state:fail
    promoted_at: float  # its replica answered ROLE as a master
    healed_at: float
    answered_at: float  # the end of the first check of the users answered after the heal
    old_master_role: str  # the cut-off master's ROLE after the heal
    final_masters_are_the_replica: bool  # every user's slot served by the promoted replica
    entries: dict[str, int] = field(default_factory=dict)  # per user, on its final master

    @property
    def admitted(self) -> dict[str, int]:
        return allowed_per_user(self.records)

    @property
    def over_admission(self) -> dict[str, int]:
        """Per user: the admissions the limiter answered minus the entries Redis kept."""
        admitted = self.admitted
        return {user: admitted.get(user, 0) - self.entries.get(user, 0) for user in self.users}

    def during(self) -> list[Record]:
        """The checks that started after the cut and were answered before the heal: only the
        cut-off master could answer them."""
        return [r for r in self.records if self.cut_at < r[0] and r[1] < self.healed_at]

    def last_admission_during(self) -> float | None:
        """When the last admission answered during the partition (by the cut-off master)
        ended."""
        ends = [end for _start, end, outcome, _user in self.during() if outcome is True]
        return max(ends) if ends else None

    @property
    def unavailable_s(self) -> float:
        """From the cut until the users' checks were answered again (promoted replica)."""
        return self.answered_at - self.cut_at

    def summary(self) -> str:
        over = sorted(self.over_admission.values())
        last = self.last_admission_during()
        failed = sum(1 for r in self.records if isinstance(r[2], Exception))
        return (f"over-admission per user: median {over[len(over) // 2]}, max {over[-1]}, "
                f"total {sum(over)} ({sum(self.admitted.values())} admitted, "
                f"{sum(self.entries.values())} kept); cut (aborted {self.aborted}) -> last "
                f"admission on the cut-off side "
                f"{'none' if last is None else f'{last - self.cut_at:.2f} s'}, cluster_state:"
                f"fail {self.isolated_down_at - self.cut_at:.2f} s, replica promoted "
                f"{self.promoted_at - self.cut_at:.2f} s, healed {self.healed_at - self.cut_at:.2f}"
                f" s, answered again {self.unavailable_s:.2f} s (all after the cut); {failed} of "
                f"{len(self.records)} checks failed")


def cluster_state(node: RedisServer) -> str:
    for line in redis_cli("-p", str(node.port), "cluster", "info", timeout=5).splitlines():
        if line.startswith("cluster_state:"):
            return line.split(":")[1].strip()
    return ""


def run_partition(make_limiter: LimiterFactory, cluster: PartitionableCluster, *, users: int,
                  limit: int, window: int = 3600, callers: int = 8,
                  limiter_options: dict[str, Any] | None = None, hold_s: float = 0.0,
                  warmup_s: float = 1.0, timeout: float = 20.0) -> Partition:
    """The scenario of the module's docstring on a healthy cluster; each wait bounded by
    `timeout` seconds. The load runs warmup_s seconds before the cut (connections made, a
    steady pace). The partition lasts until the majority has promoted the replica, the
    cut-off master answers cluster_state:fail and hold_s seconds have passed since the cut.
    Leaves the cluster whole again (the old master a replica)."""
    victim = cluster.masters()[0]
    replica = cluster.replica_of(victim)
    names = users_on(cluster, victim, users)
    with Load(make_limiter, cluster.url, names, limit=limit, window=window, callers=callers,
              max_seconds=4 * timeout, limiter_options=limiter_options) as load:
        started = time.monotonic()
        load.wait_for(20 * callers, timeout)
        time.sleep(max(0.0, started + warmup_s - time.monotonic()))  # a measured pace, no race
        aborted = cluster.cut(victim)
        cut_at = time.monotonic()
        try:
            isolated_down_at = promoted_at = 0.0
            deadline = cut_at + timeout
            while not (isolated_down_at and promoted_at and time.monotonic() > cut_at + hold_s):
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{timeout} s after the cut: the cut-off master's cluster_state is "
                        f"{cluster_state(victim)}, its replica's ROLE {role_of(replica)}")
                if not isolated_down_at and cluster_state(victim) == "fail":
                    isolated_down_at = time.monotonic()
                if not promoted_at and role_of(replica) == "master":
                    promoted_at = time.monotonic()
                time.sleep(0.02)  # polling a condition, bounded by the deadline
        finally:
            cluster.heal()
            healed_at = time.monotonic()
        deadline = healed_at + timeout
        while True:
            answered = [end for start, end, outcome, user in list(load.records)
                        if start > healed_at and not isinstance(outcome, Exception)]
            if answered:
                answered_at = min(answered)
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{timeout} s after the heal no check was answered")
            time.sleep(0.02)  # polling a condition, bounded by the deadline
        cluster.wait_ok()
    entries = {}
    final_masters = set()
    for name in names:
        final = cluster.master_of_slot(slot_of(name))
        final_masters.add(final.port)
        client = redis.Redis(port=final.port)
        try:
            entries[name] = logged_entries(client, f"ratelimit:{{{name}}}:{window}")
        finally:
            client.close()
    return Partition(
        users=names, records=list(load.records), cut_at=cut_at, aborted=aborted,
        isolated_down_at=isolated_down_at, promoted_at=promoted_at, healed_at=healed_at,
        answered_at=answered_at, old_master_role=role_of(victim),
        final_masters_are_the_replica=final_masters == {replica.port}, entries=entries)
