#!/usr/bin/env python3
"""What replicas, a cluster and min_replicas cost a check, side by side in one run.

    .venv/bin/python benchmarks/replicas.py [--rounds N] [--seconds S]

It starts its own servers on free loopback ports (tests/redis_server.py and
tests/redis_cluster.py, nothing else is touched): one master with one replica, and a
3-master cluster with a replica each. Round after round, in rotating order, each contender
runs for S seconds (benchmarks/cluster.py's runners: sync check() back to back on one
thread, async 256 coroutines pipelined), every check allowed (it writes, so WAIT has
something to wait for):

  sync 1 node + replica                 RateLimiter(redis://master)
  sync 1 node + replica, min_replicas=1 the same with WAIT in the admission's write
  sync cluster 3+3                      RateLimiter(redis+cluster://...)
  sync cluster 3+3, one master's users  the routing without waking three masters in turn
  sync cluster 3+3, min_replicas=1
  async 1 node + replica, and with min_replicas=1

and prints the medians (checks/s, p50 for the sync ones, the client's and the servers' CPU
per check, the servers' own µs per EVALSHA from INFO commandstats) and each row's ratio to
the plain single node of its kind. The machine's cores and load are printed with the table.
"""

from __future__ import annotations

import argparse
import binascii
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from cluster import USERS, Contender, run_async, run_rounds, run_sync
from redis_cluster import RedisCluster, redis_cli
from redis_server import RedisServer

REPLICATED: dict[str, Any] = {"min_replicas": 1, "replica_timeout_ms": 1000}


def evalsha_us(ports: list[int]) -> tuple[float, int]:
    """INFO commandstats over ports: (total µs spent in EVALSHA, calls)."""
    usec, calls = 0.0, 0
    for port in ports:
        for line in redis_cli("-p", str(port), "info", "commandstats").splitlines():
            if line.startswith("cmdstat_evalsha:"):
                fields = dict(item.split("=") for item in line.split(":", 1)[1].split(","))
                usec += float(fields["usec"])
                calls += int(fields["calls"])
    return usec, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()

    master = RedisServer("--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0")
    replica = RedisServer("--save", "", "--appendonly", "no")
    cluster = RedisCluster(masters=3, replicas_per_master=1)
    master.start()
    replica.extra_args += ["--replicaof", "127.0.0.1", str(master.port)]
    replica.start()
    cluster.start()
    try:
        deadline = time.monotonic() + 30
        while "master_link_status:up" not in redis_cli("-p", str(replica.port), "info",
                                                      "replication"):
            assert time.monotonic() < deadline, "the replica never synced"
            time.sleep(0.05)  # polling a condition, bounded
        pair_ports = [master.port, replica.port]
        cluster_ports = [n.port for n in cluster.nodes]
        owned = set(cluster.owned_slots(cluster.master_of_slot(0)))
        one_master = [u for u in USERS if binascii.crc_hqx(u.encode(), 0) % 16384 in owned]
        seconds = args.seconds
        contenders: dict[str, Contender] = {
            "sync 1 node + replica": (lambda: run_sync(master.url, seconds), pair_ports),
            "sync 1 node + replica, min_replicas=1": (
                lambda: run_sync(master.url, seconds, **REPLICATED), pair_ports),
            "sync cluster 3+3": (lambda: run_sync(cluster.url, seconds), cluster_ports),
            "sync cluster 3+3, one master's users": (
                lambda: run_sync(cluster.url, seconds, one_master), cluster_ports),
            "sync cluster 3+3, min_replicas=1": (
                lambda: run_sync(cluster.url, seconds, **REPLICATED), cluster_ports),
            "async 1 node + replica": (lambda: run_async(master.url, seconds), pair_ports),
            "async 1 node + replica, min_replicas=1": (
                lambda: run_async(master.url, seconds, **REPLICATED), pair_ports),
        }
        names = list(contenders)
        load_before = os.getloadavg()

        def flush() -> None:
            redis_cli("-p", str(master.port), "flushall")
            cluster.flush()

        def server_time(ports: list[int]) -> Callable[[dict[str, float]], None]:
            usec0, evals0 = evalsha_us(ports)

            def after(sample: dict[str, float]) -> None:
                usec1, evals1 = evalsha_us(ports)
                sample["evalsha_us"] = (usec1 - usec0) / max(1, evals1 - evals0)
            return after

        results = run_rounds(contenders, args.rounds, seconds, flush, server_time)
        load_after = os.getloadavg()
    finally:
        cluster.close()
        replica.close()
        master.close()

    def median(name: str, key: str) -> float:
        return statistics.median(s[key] for s in results[name] if key in s)

    print(f"\n{os.cpu_count()} cores; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after; {args.rounds} rounds of {seconds:g} s; medians\n")
    print("| contender | checks/s | ratio | p50 µs | p50 ratio | client CPU µs "
          "| servers' CPU µs | EVALSHA µs (server) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        base = "async 1 node + replica" if name.startswith("async") else "sync 1 node + replica"
        ratio = median(name, "calls_per_s") / median(base, "calls_per_s")
        if name.startswith("sync"):
            p50 = f"{median(name, 'p50_us'):.1f}"
            p50_ratio = f"{median(name, 'p50_us') / median(base, 'p50_us'):.2f}×"
        else:
            p50 = p50_ratio = "-"
        print(f"| {name} | {median(name, 'calls_per_s'):.0f} | {ratio:.2f}× | {p50} "
              f"| {p50_ratio} | {median(name, 'client_cpu_us'):.1f} "
              f"| {median(name, 'server_cpu_us'):.1f} | {median(name, 'evalsha_us'):.1f} |")


if __name__ == "__main__":
    main()
