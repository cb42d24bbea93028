#!/usr/bin/env python3
"""A Redis Cluster master and its clients cut off from the majority: what it costs, with and
without min_replicas, both limiters.

    .venv/bin/python benchmarks/failover_partition.py [--runs N] [--users U] [--limit L]

It starts its own cluster (tests/partition.py: 3 masters + 3 replicas, cluster-node-timeout
1000 ms, every connection through loopback proxies that can cut it; nothing else is
touched) and runs the partition scenario of tests/test_partition.py N times per case (sync
and asyncio, min_replicas off and 1): 8 callers (threads, or tasks on one loop) check U users
whose slots one master serves (limit L per hour, socket_timeout 1 s); that master and the
callers are cut off from the other nodes; as soon as the majority has promoted its replica
and the cut-off master answers cluster_state:fail, the partition heals. Then it prints a
markdown table per case:

  over-admission per user   the admissions the limiter answered minus the entries on the
                            final master of the user's slot after the heal: median and max
                            over every user of every run
  unavailable               from the cut until the users' checks were answered again (by
                            the promoted replica, after the heal): median (min-max) over runs
  cut-off side admitted until  the end of the last admission answered after the cut and
                            before the heal (by the cut-off master), after the cut
  replica promoted after    when the replica answered ROLE as a master, after the cut
  checks per user per s     the load's pace in the second before the cut
  load average              os.getloadavg() after the case's runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the test suite's real server fixtures
from helpers_async import LimiterFactory  # noqa: E402
from partition import Partition, PartitionableCluster, run_partition  # noqa: E402
from redis_cluster import NODE_TIMEOUT_MS  # noqa: E402

CASES = [("sync", None), ("asyncio", None), ("sync", 1), ("asyncio", 1)]
REPLICA_TIMEOUT_MS = 100


def checks_per_user_per_s(partition: Partition) -> float:
    """The load's pace in the second before the cut."""
    before = [start for start, *_ in partition.records
              if partition.cut_at - 1.0 <= start < partition.cut_at]
    return len(before) / 1.0 / len(partition.users)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--users", type=int, default=20)
    parser.add_argument("--limit", type=int, default=2000)
    args = parser.parse_args()
    rows = []
    with PartitionableCluster() as cluster:
        for kind, min_replicas in CASES:
            options = ({} if min_replicas is None else
                       {"min_replicas": min_replicas, "replica_timeout_ms": REPLICA_TIMEOUT_MS})
            runs = []
            for run in range(args.runs):
                cluster.wait_ok()
                cluster.flush()
                factory = LimiterFactory(kind)
                try:
                    partition = run_partition(factory, cluster, users=args.users,
                                              limit=args.limit, limiter_options=options)
                finally:
                    factory.close()
                print(f"{kind} min_replicas={min_replicas} run {run + 1}: {partition.summary()}",
                      file=sys.stderr, flush=True)
                runs.append(partition)
            over = [value for p in runs for value in p.over_admission.values()]
            unavailable = [p.unavailable_s for p in runs]
            promoted = [p.promoted_at - p.cut_at for p in runs]
            stopped = [last - p.cut_at for p in runs
                       if (last := p.last_admission_during()) is not None]
            admitted_until = (f"{min(stopped):.2f}-{max(stopped):.2f}" if stopped else "none")
            if stopped and len(stopped) < len(runs):
                admitted_until += f" ({len(runs) - len(stopped)} runs none)"
            pace = [checks_per_user_per_s(p) for p in runs]
            rows.append(
                f"| {kind} | {'off' if min_replicas is None else min_replicas} | {len(runs)} | "
                f"{statistics.median(over):.0f} | {max(over)} | "
                f"{statistics.median(unavailable):.2f} ({min(unavailable):.2f}-"
                f"{max(unavailable):.2f}) | {admitted_until} | "
                f"{min(promoted):.2f}-{max(promoted):.2f} | "
                f"{min(pace):.0f}-{max(pace):.0f} | "
                f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} |")
    print(f"\nPartition: 1 master + the callers cut off from the majority, healed once the "
          f"replica is promoted; cluster-node-timeout {NODE_TIMEOUT_MS} ms, {args.users} users "
          f"on the cut-off master, limit {args.limit} per hour, 8 callers, {os.cpu_count()} "
          f"cores\n")
    print("| limiter | min_replicas | runs | over-admission per user, median | max | "
          "unavailable s, median (min-max) | cut-off side admitted until s | replica promoted "
          "after s | checks per user per s before the cut | load average (1/5/15 min) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
