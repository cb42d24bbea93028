"""A real Redis Cluster for the tests: 6 redis-server processes (3 masters, 3 replicas)
with --cluster-enabled yes on free loopback ports, joined by `redis-cli --cluster create`,
stopped by pid. And a Sentinel set: a master, a replica and 3 sentinels. No mocks."""

from __future__ import annotations

import shutil
import subprocess
import time
from typing import Any

from redis_server import RedisServer, free_port

NODE_TIMEOUT_MS = 1000  # cluster-node-timeout: a dead master's replica takes over ~1-2 s later


def redis_cli(*args: str, timeout: float = 30.0) -> str:
    binary = shutil.which("redis-cli")
    if binary is None:
        raise RuntimeError("redis-cli is not installed: run `make test` (it installs redis-server)")
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"redis-cli {' '.join(args)} failed: {done.stdout}{done.stderr}")
    return done.stdout


class _Started:
    """`with X() as x:` starts x, and closes it on the way out (a failed start too)."""

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisCluster(_Started):
    """Six nodes, three of them masters, every slot assigned."""

    def __init__(self, masters: int = 3, replicas_per_master: int = 1) -> None:
        self.nodes = [RedisServer("--cluster-enabled", "yes",
                                  "--cluster-config-file", "nodes.conf",
                                  "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                                  "--cluster-port", str(free_port()),
                                  "--repl-diskless-sync-delay", "0")
                      for _ in range(masters * (1 + replicas_per_master))]
        self.replicas_per_master = replicas_per_master

    @property
    def url(self) -> str:
        seeds = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes[:3])
        return f"redis+cluster://{seeds}/"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        redis_cli("--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                  "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes")
        self.wait_ok()

    def cli(self, node: RedisServer, *args: str) -> str:
        return redis_cli("-p", str(node.port), *args)

    def alive(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says cluster_state:ok, 3 masters serve the slots, every
        live replica is in sync with its master and every node sees the same slot owners."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all("cluster_state:ok" in self.cli(n, "cluster", "info")
                       for n in self.alive()) and len(self.masters()) == 3 and all(
                           self.replica_linked(n) for n in self.alive()) and len(
                           {self.slot_view(n) for n in self.alive()}) == 1:
                    return
            except RuntimeError:
                pass
            time.sleep(0.05)  # polling a condition, bounded by the deadline
        views = {n.port: self.slot_view(n) for n in self.alive()}
        states = {n.port: self.cli(n, "cluster", "info").split()[0] for n in self.alive()}
        raise RuntimeError(f"the cluster did not reach cluster_state:ok: {states}; "
                           f"{len(set(views.values()))} views of the slots: {views}")

    def slot_view(self, node: RedisServer) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """Which node owns which slots, as node sees it (gossip makes every view agree)."""
        view = []
        for line in self.cli(node, "cluster", "nodes").splitlines():
            fields = line.split()
            if len(fields) > 8 and "fail" not in fields[2]:
                view.append((fields[1].split("@")[0], tuple(sorted(fields[8:]))))
        return tuple(sorted(view))

    def replica_linked(self, node: RedisServer) -> bool:
        """A master, or a replica whose first sync is done (it can take over only then)."""
        info = self.cli(node, "info", "replication")
        return "role:master" in info or "master_link_status:up" in info

    def masters(self) -> list[RedisServer]:
        """The live nodes that serve slots now."""
        by_port = self.by_announced_port()
        out = []
        for line in self.cli(self.alive()[0], "cluster", "nodes").splitlines():
            fields = line.split()
            if "master" in fields[2] and "fail" not in fields[2] and len(fields) > 8:
                port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
                if port in by_port:
                    out.append(by_port[port])
        return out

    def by_announced_port(self) -> dict[int, RedisServer]:
        """The live nodes by the port CLUSTER NODES gives them (their own, unless they
        announce another)."""
        return {n.port: n for n in self.alive()}

    def master_of_slot(self, slot: int) -> RedisServer:
        by_port = self.by_announced_port()
        for line in self.cli(self.alive()[0], "cluster", "nodes").splitlines():
            fields = line.split()
            for item in fields[8:]:
                if item.startswith("["):
                    continue  # a migration in progress, not an owned range
                start, _, end = item.partition("-")
                if int(start) <= slot <= int(end or start):
                    return by_port[int(fields[1].split("@")[0].rsplit(":", 1)[1])]
        raise RuntimeError(f"no master serves slot {slot}")

    def owned_slots(self, node: RedisServer) -> list[int]:
        """The slots node serves, as it sees itself."""
        for line in self.cli(node, "cluster", "nodes").splitlines():
            fields = line.split()
            if "myself" in fields[2]:
                slots = []
                for item in fields[8:]:
                    if not item.startswith("["):
                        start, _, end = item.partition("-")
                        slots.extend(range(int(start), int(end or start) + 1))
                return slots
        raise RuntimeError("CLUSTER NODES has no line for the node itself")

    def assign(self, slots: list[int], owner: RedisServer) -> None:
        """Hands empty slots to owner: first to owner itself, whose config epoch is then bumped
        above every other node's (so its claim wins over the old owner's in gossip: the old
        owner must not win a node back before it has heard), then to the other masters
        (CLUSTER SETSLOT ... NODE), the old owner included. Told in another order, a node
        could be won back by the old owner's gossip and the views of the cluster diverge."""
        import redis

        owner_id = self.cli(owner, "cluster", "myid").strip()
        masters = [owner, *(node for node in self.masters() if node is not owner)]

        def tell(nodes: list[RedisServer]) -> None:
            for node in nodes:
                client = redis.Redis(port=node.port)
                try:
                    for slot in slots:
                        client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", owner_id)
                    if node is owner:
                        client.execute_command("CLUSTER", "BUMPEPOCH")
                finally:
                    client.close()

        tell(masters)
        # Under load the old owner's gossip can still win a slot back on a node (even on the
        # new owner) before it has heard of the change, and the views then stay apart (seen
        # in CI: 34 of 60 slots back with the old owner in half the views). Until every
        # master's view has every slot with its new owner: the owner and each master still
        # behind are told again, at most once a second, within a deadline.
        deadline = time.monotonic() + 30
        told = time.monotonic()
        while True:
            behind = [node for node in masters
                      if any(self.owner_id_of(node, slot) != owner_id for slot in slots)]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"slots {slots} did not reach {owner.port} in every view: "
                                   f"{[node.port for node in behind]} still behind")
            if time.monotonic() - told > 1.0:
                tell([owner, *(node for node in behind if node is not owner)])
                told = time.monotonic()
            time.sleep(0.05)  # polling a condition, bounded by the deadline

    def owner_id_of(self, node: RedisServer, slot: int) -> str | None:
        """The id of the node that owns slot, as node sees it (CLUSTER NODES)."""
        for line in self.cli(node, "cluster", "nodes").splitlines():
            fields = line.split()
            for span in fields[8:]:
                if span.startswith("["):  # a migration in progress, not an owner
                    continue
                low, _, high = span.partition("-")
                if int(low) <= slot <= int(high or low):
                    return fields[0]
        return None

    def restart_missing(self) -> None:
        """Restarts the killed nodes (they rejoin from their nodes.conf as replicas)."""
        for node in self.nodes:
            if node.process is None or node.process.poll() is not None:
                node.start(port=node.port)
        self.wait_ok()

    def flush(self) -> None:
        for node in self.masters():
            self.cli(node, "flushall")

    def close(self) -> None:
        for node in self.nodes:
            node.close()


class RedisSentinelSet(_Started):
    """A master, a replica and 3 sentinels (redis-server --sentinel) watching it under the
    name "mymaster", on free loopback ports; stopped by pid."""

    NAME = "mymaster"
    DOWN_AFTER_MS = 1000

    def __init__(self) -> None:
        # No diskless-sync delay: a replica (a demoted master too) is in sync at once.
        self.master = RedisServer("--repl-diskless-sync-delay", "0")
        self.replica = RedisServer("--repl-diskless-sync-delay", "0")
        self.sentinels = [RedisServer() for _ in range(3)]  # their directories hold the configs

    @property
    def data_nodes(self) -> list[RedisServer]:
        return [self.master, self.replica]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.NAME}/0"

    def start(self) -> None:
        self.master.start()
        self.replica.extra_args += ["--replicaof", "127.0.0.1", str(self.master.port)]
        self.replica.start()
        for sentinel in self.sentinels:
            sentinel.port = free_port()
            config = sentinel.directory / "sentinel.conf"
            config.write_text(
                f"port {sentinel.port}\nbind 127.0.0.1\ndir {sentinel.directory}\n"
                f"logfile {sentinel.directory / 'sentinel.log'}\n"
                f"sentinel monitor {self.NAME} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {self.NAME} {self.DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {self.NAME} 10000\n")
            sentinel.process = subprocess.Popen(
                [sentinel.binary, str(config), "--sentinel"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready()

    def master_port(self) -> int:
        """The master's port as the first live sentinel says it."""
        for sentinel in self.sentinels:
            try:
                out = redis_cli("-p", str(sentinel.port), "sentinel",
                                "get-master-addr-by-name", self.NAME).split()
                return int(out[1])
            except (RuntimeError, IndexError, ValueError):
                continue
        raise RuntimeError("no sentinel answered")

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until every sentinel sees the master, the replica and the 2 other sentinels, and
        the replica is in sync (a failover that needed a second election included)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ready = all(
                    "num-other-sentinels\n2" in redis_cli("-p", str(s.port), "sentinel",
                                                          "master", self.NAME)
                    for s in self.sentinels)
                master = self.node_at(self.master_port())
                replicas = [n for n in self.data_nodes if n is not master and n.process]
                known = all(self.knows_a_good_replica(s) for s in self.sentinels)
                if ready and known and all("master_link_status:up" in redis_cli(
                        "-p", str(n.port), "info", "replication") for n in replicas):
                    return
            except RuntimeError:
                pass
            time.sleep(0.05)  # polling a condition, bounded by the deadline
        raise RuntimeError("the sentinels did not get ready")

    def knows_a_good_replica(self, sentinel: RedisServer) -> bool:
        """The sentinel lists a replica it could promote (flags "slave", link ok)."""
        out = redis_cli("-p", str(sentinel.port), "sentinel", "replicas", self.NAME).split("\n")
        fields = dict(zip(out[::2], out[1::2], strict=False))
        return fields.get("flags") == "slave" and fields.get("master-link-status") == "ok"

    def fail_over(self, timeout: float = 15.0) -> None:
        """SENTINEL FAILOVER, sent again while a sentinel answers that it cannot yet
        (NOGOODSLAVE, INPROGRESS), bounded."""
        deadline = time.monotonic() + timeout
        while True:
            answer = redis_cli("-p", str(self.sentinels[0].port), "sentinel", "failover",
                               self.NAME).strip()
            if answer == "OK":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"SENTINEL FAILOVER kept answering {answer}")
            time.sleep(0.1)  # polling a condition, bounded

    def node_at(self, port: int) -> RedisServer:
        return next(n for n in self.data_nodes if n.port == port)

    def close(self) -> None:
        for node in [*self.sentinels, *self.data_nodes]:
            node.close()
