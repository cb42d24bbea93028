#!/usr/bin/env python3
"""Weighted checks and reservations against the plain check, side by side in one run.

    .venv/bin/python benchmarks/weighted.py [--rounds N] [--seconds S]

It starts its own redis-server on a free loopback port (nothing else is touched) and runs,
round after round in rotating order, each contender for S seconds (or 20,000 calls) with
the blocking RateLimiter, sequentially on one connection:

  plain check          check(user, limit, 60): the baseline (cost 1; 1,000 users)
  weighted check       check(user, limit, 60, cost=7): the same users' weighted twin
  empty window         check_windows on a fresh user every call, cost 7: the window is empty
  100,000-entry window check(user, ..., cost=7) on a day window pre-filled with 100,000
                       weighted entries (costs 2..50): the running total is read, never summed
                       (allowed: it grows by the calls it admits)
  refused check        check_windows on another such window with a limit of half its total:
                       refused, and the entry whose leaving frees enough is in the middle
  refused reserve      reserve(..., token_windows=[(half, 86400)], tokens=500) on a token
                       window of 100,000 such entries: refused the same way
  peek                 peek with the refused check's arguments (read-only, refused)
  reserve              reserve(user, [(L, 60)], token_windows=[(T, 60)], tokens=500)
  reconcile            reconcile(that reservation, 321): one per reserve, alternating

and prints, per contender, the medians over the rounds of calls/s, p50 latency, and the
server's time per script call (INFO commandstats usec_per_call of EVALSHA over that
contender's calls), with the ratio to the plain check of the same round. Quote ratios: the
machine is shared.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    RedisTarget,
    admin_client,
    load_average,
    print_ratio_table,
    script_stats,
    timed_loop,
)
from genai_ratelimit import RateLimiter  # noqa: E402

BIG = 10**12  # a limit no run reaches: every call is allowed and logs an entry
USERS = [f"user_{n}" for n in range(1000)]


def prefill(admin: Any, key: str, entries: int) -> int:
    """`entries` live weighted entries in a day window, as the first versions of the script
    logged them: members in the sorted set, their costs and the total in the weights hash
    (the script indexes them when it first needs to). Returns their total cost."""
    now = int(time.time() * 1000)
    rng = random.Random(9)
    total_extra = 0
    for start in range(0, entries, 10_000):
        members: dict[str, int] = {}
        costs: dict[str, int] = {}
        for n in range(start, min(entries, start + 10_000)):
            member = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            members[member] = now - 3_600_000 + n
            costs[member] = cost = rng.randint(2, 50)
            total_extra += cost - 1
        admin.zadd(key, members)
        admin.hset(f"{key}:w", mapping=costs)
    admin.hset(f"{key}:w", "", total_extra)
    admin.expire(key, 86_401)
    admin.expire(f"{key}:w", 86_401)
    return entries + total_extra


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--entries", type=int, default=100_000)
    args = parser.parse_args()

    target = RedisTarget.start_own()
    try:
        admin = admin_client(target)
        version = admin.info("server")["redis_version"]
        prefill(admin, "ratelimit:whale:86400", args.entries)
        half = prefill(admin, "ratelimit:shark:86400", args.entries) // 2
        half_tokens = prefill(admin, "ratelimit:shark:86400:tokens", args.entries) // 2
        # A long timeout: the first refusal on a prefilled window builds its running totals
        # (the warm-up calls absorb it).
        limiter = RateLimiter(target.url, max_connections=1, socket_timeout=30)
        fresh = iter(range(10**9))
        held: list[Any] = []

        def reserve(user: str) -> Any:
            reservation = limiter.reserve(user, [(BIG, 60)], token_windows=[(BIG, 60)], tokens=500)
            held.append(reservation)
            return reservation

        def reconcile(_: str) -> int:
            return limiter.reconcile(held.pop(), 321)

        contenders: dict[str, tuple[Callable[..., Any], list[tuple[Any, ...]], str]] = {
            "plain check (baseline)": (limiter.check, [(u, BIG, 60) for u in USERS], "index0"),
            "weighted check, cost=7": (lambda u: limiter.check(u, BIG, 60, cost=7),
                                       [(u,) for u in USERS], "index0"),
            "weighted check, empty window": (
                lambda _: limiter.check_windows(f"fresh_{next(fresh)}", [(BIG, 86400)], cost=7),
                [("",)], "index0"),
            f"weighted check, {args.entries:,}-entry window": (
                lambda _: limiter.check_windows("whale", [(BIG, 86400)], cost=7),
                [("",)], "index0"),
            f"refused check, {args.entries:,}-entry window": (
                lambda _: limiter.check_windows("shark", [(half, 86400)], cost=7),
                [("",)], "index0"),
            f"refused reserve (tokens), {args.entries:,}-entry window": (
                lambda _: (limiter.reserve("shark", token_windows=[(half_tokens, 86400)],
                                           tokens=500).allowed,),
                [("",)], "index0"),
            f"peek (refused), {args.entries:,}-entry window": (
                lambda _: limiter.peek("shark", [(half, 86400)], cost=7), [("",)], "index0"),
        }
        rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in contenders}
        rows["reserve (requests + tokens)"] = []
        rows["reconcile"] = []
        names = list(contenders)
        for round_index in range(args.rounds):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for name in order:
                fn, arglist, verdict = contenders[name]
                before = script_stats(admin)
                # A few warm-up calls on the big windows: a refusal there may take 100 ms.
                warmup = 5 if "entry window" in name else 200
                sample = timed_loop(fn, arglist, args.seconds, 20_000, warmup, verdict)
                after = script_stats(admin)
                server = (after[1] - before[1]) / max(1, after[0] - before[0])
                rows[name].append((sample.calls_per_s, sample.p50_us, server))
            # reserve then reconcile, alternating, each timed on its own.
            reserve_latency: list[float] = []
            reconcile_latency: list[float] = []
            calls = 0
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline and calls < 10_000:
                user = USERS[calls % len(USERS)]
                t0 = time.perf_counter_ns()
                reserve(user)
                t1 = time.perf_counter_ns()
                reconcile(user)
                t2 = time.perf_counter_ns()
                reserve_latency.append((t1 - t0) / 1e3)
                reconcile_latency.append((t2 - t1) / 1e3)
                calls += 1
            per_reserve = statistics.median(reserve_latency)
            per_reconcile = statistics.median(reconcile_latency)
            # Server time of each script: measured on 200 calls of each, separately.
            before = script_stats(admin)
            for n in range(200):
                reserve(USERS[n])
            mid = script_stats(admin)
            for n in range(200):
                reconcile(USERS[n])
            after = script_stats(admin)
            server_reserve = (mid[1] - before[1]) / max(1, mid[0] - before[0])
            server_reconcile = (after[1] - mid[1]) / max(1, after[0] - mid[0])
            rows["reserve (requests + tokens)"].append((1e6 / per_reserve, per_reserve,
                                                        server_reserve))
            rows["reconcile"].append((1e6 / per_reconcile, per_reconcile, server_reconcile))
        limiter.close()
    finally:
        target.close()

    print(f"Redis {version} on loopback (own server), {args.rounds} rounds of {args.seconds} s per "
          f"contender, blocking RateLimiter, one connection; {load_average()}. Medians over "
          "rounds; ratios are per round to the plain check, then the median. reserve/reconcile "
          "calls/s is 1 / p50 (they alternate).\n")
    print_ratio_table(rows, "plain check (baseline)",
                      [("calls/s", ",.0f"), ("p50 µs", ".1f"), ("server µs/call", ".2f")],
                      [(0, "calls/s vs plain"), (2, "server µs vs plain")])
    allowed = f"weighted check, {args.entries:,}-entry window"
    print(f"\nServer µs per call against the allowed check on a {args.entries:,}-entry window "
          "(median over rounds of the per-round ratio):\n")
    print_ratio_table({name: [(v[2],) for v in rows[name]] for name in rows if "entry window" in name},
                      allowed, [("server µs/call", ".2f")], [(0, "server µs vs allowed")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
