#!/usr/bin/env python3
"""What a spend hierarchy costs on a Redis Cluster, side by side with one node, in one run.

    .venv/bin/python benchmarks/budget_cluster.py [--rounds N] [--calls C]

It starts its own servers on free loopback ports (tests/redis_server.py,
tests/redis_cluster.py; nothing else is touched): one redis-server, and a 3-master cluster
without replicas. Round after round, in rotating order (benchlib.round_order), each
contender makes C hold + settle pairs back to back with a blocking RateLimiter, over 4
budgets (org -> team -> key -> user, limits no run reaches), and the p50 of one pair is
taken:

  1 node, 4 owners              one script holds the 4 owners, one settles them (baseline)
  cluster, 1 owner              the 4 budgets of one owner: one slot, one script each way
  cluster, 4 owners             the hierarchy held owner by owner: 4 holds, 4 settles
  cluster, 4 owners, refused    the user (last) refuses: 4 holds and 3 give-backs, no settle

Medians over rounds; ratios to the baseline per round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the test suite's real server fixtures
from benchlib import load_average, print_ratio_table, round_order  # noqa: E402
from genai_ratelimit import Budget, RateLimiter  # noqa: E402
from redis_cluster import RedisCluster  # noqa: E402
from redis_server import RedisServer  # noqa: E402

BIG = 10**12


def hierarchy(run: int) -> list[Budget]:
    return [Budget(f"org:{run}", "monthly_usd", BIG, level="org"),
            Budget(f"team:{run}", "monthly_usd", BIG, level="team"),
            Budget(f"key:{run}", "daily_usd", BIG, "day", level="key"),
            Budget(f"user:{run}", "daily_usd", BIG, "day", level="user")]


def one_owner(run: int) -> list[Budget]:
    return [Budget(f"org:{run}", name, BIG, period)
            for name, period in (("monthly_usd", "month"), ("weekly_usd", "week"),
                                 ("daily_usd", "day"), ("daily_tokens", "day"))]


def pair(limiter: RateLimiter, budgets: list[Budget]) -> Callable[[], None]:
    def once() -> None:
        hold = limiter.hold_budgets(budgets, 150)
        assert hold.allowed
        assert limiter.settle_budgets(hold, 120) == len(budgets)
    return once


def refused(limiter: RateLimiter, budgets: list[Budget]) -> Callable[[], None]:
    tight = [*budgets[:3], Budget(budgets[3].owner, "tiny", 100, "day", level="user")]

    def once() -> None:
        assert limiter.hold_budgets(tight, 150).reason == "permanent"
    return once


def p50_us(fn: Callable[[], None], calls: int) -> float:
    for _ in range(50):
        fn()  # warm: connections, the scripts loaded, the slot map
    times = []
    for _ in range(calls):
        started = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - started)
    return statistics.median(times) / 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    with RedisServer() as node, RedisCluster(masters=3, replicas_per_master=0) as cluster:
        single = RateLimiter(node.url)
        clustered = RateLimiter(cluster.url)
        contenders: dict[str, Callable[[int], Callable[[], None]]] = {
            "1 node, 4 owners (baseline)": lambda r: pair(single, hierarchy(r)),
            "cluster, 1 owner": lambda r: pair(clustered, one_owner(r)),
            "cluster, 4 owners": lambda r: pair(clustered, hierarchy(r)),
            "cluster, 4 owners, refused by the last": lambda r: refused(clustered, hierarchy(r)),
        }
        rows: dict[str, list[tuple[float, ...]]] = {name: [] for name in contenders}
        for index in range(args.rounds):
            for name in round_order(list(contenders), index):
                rows[name].append((p50_us(contenders[name](index), args.calls),))
    print(f"Redis on loopback, {args.rounds} rounds of {args.calls} calls per contender, "
          f"blocking RateLimiter; {load_average()}.\n")
    print_ratio_table(rows, "1 node, 4 owners (baseline)", [("p50 µs per call", ".0f")],
                      [(0, "vs 1 node")])


if __name__ == "__main__":
    main()
