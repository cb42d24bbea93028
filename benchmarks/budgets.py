#!/usr/bin/env python3
"""Calendar budgets (hold_budgets / settle_budgets) against the sliding-window check and a
reserve of requests + tokens, side by side in one run.

    .venv/bin/python benchmarks/budgets.py [--rounds N] [--seconds S]

It starts its own redis-server on a free loopback port (nothing else is touched) and runs,
round after round in rotating order, each contender for S seconds (or 20,000 calls) with
the blocking RateLimiter, sequentially on one connection, over 1,000 users:

  zset check                    check(user, BIG, 60): the baseline
  reserve, requests + tokens    reserve(user, [(BIG, 60), (BIG, 86400)], token_windows=
                                [(BIG, 60), (BIG, 86400)], tokens=500): a token dependency's
                                admission today
  hold, 1 budget                hold_budgets(the user's monthly budget, 1)
  hold, 4 levels                org -> team -> key -> user, one monthly budget each
  hold, 4 levels, soft limits   the same with thresholds=(50, 80, 95) on each budget (none
                                crossed: the cost every admission pays for them)
  hold, 4 levels x 3 units      requests, tokens and money at each of the 4 levels (12
                                budgets: per-budget amounts), one script
  hold + settle, 4 levels       a hold, then its settle: two scripts per admission

and prints, per contender, the medians over the rounds of calls/s, p50 latency (of the
whole Python call: the period arithmetic included) and the server's time per script call
(INFO commandstats usec of EVALSHA over that contender's calls), with the ratio to the
zset check of the same round. Holds are never settled except in the last contender: their
hashes grow one field per hold, as with many requests in flight. Quote ratios: the machine
is shared.
"""

from __future__ import annotations

import argparse
import sys
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
from genai_ratelimit import Budget, RateLimiter  # noqa: E402

BIG = 10**12
USERS = [f"user_{n}" for n in range(1000)]
BASELINE = "zset check, allowed (baseline)"


def levels(user: str, units: tuple[str, ...],
           thresholds: tuple[int, ...] = ()) -> list[Budget]:
    owners = ("org:acme", f"team:{hash(user) % 10}", f"key:{user}", user)
    return [Budget(owner, unit, BIG, "month", "Europe/Paris", thresholds=thresholds)
            for owner in owners for unit in units]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()

    target = RedisTarget.start_own()
    try:
        admin = admin_client(target)
        version = admin.info("server")["redis_version"]
        limiter = RateLimiter(target.url, max_connections=1)
        one = {u: [Budget(u, "monthly", BIG, "month", "Europe/Paris")] for u in USERS}
        four = {u: levels(u, ("monthly_usd",)) for u in USERS}
        soft = {u: levels(u, ("soft_usd",), (50, 80, 95)) for u in USERS}
        twelve = {u: levels(u, ("requests", "tokens", "usd")) for u in USERS}
        mixed = (1, 500, 150_000) * 4  # a request, 500 tokens, $0.15 in micro-USD

        def hold_settle(budgets: list[Budget]) -> Any:
            hold = limiter.hold_budgets(budgets, 150_000)
            limiter.settle_budgets(hold, 120_000)
            return hold

        def reserve(user: str) -> Any:
            return limiter.reserve(user, [(BIG, 60), (BIG, 86400)],
                                   token_windows=[(BIG, 60), (BIG, 86400)], tokens=500)

        contenders: dict[str, tuple[Callable[..., Any], list[tuple[Any, ...]], str]] = {
            BASELINE: (limiter.check, [(u, BIG, 60) for u in USERS], "index0"),
            "reserve, requests + tokens (2 + 2 windows)": (
                reserve, [(u,) for u in USERS], "allowed"),
            "hold, 1 budget": (limiter.hold_budgets, [(one[u], 1) for u in USERS], "allowed"),
            "hold, 4 levels": (
                limiter.hold_budgets, [(four[u], 150_000) for u in USERS], "allowed"),
            "hold, 4 levels, soft limits (50, 80, 95)": (
                limiter.hold_budgets, [(soft[u], 150_000) for u in USERS], "allowed"),
            "hold, 4 levels x 3 units (12 budgets)": (
                limiter.hold_budgets, [(twelve[u], mixed) for u in USERS], "allowed"),
            "hold + settle, 4 levels (2 scripts)": (
                hold_settle, [(four[u],) for u in USERS], "allowed"),
        }
        rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in contenders}
        names = list(contenders)
        for round_index in range(args.rounds):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for name in order:
                fn, arglist, verdict = contenders[name]
                if verdict == "allowed":
                    def call(*a: Any, _fn: Callable[..., Any] = fn) -> bool:
                        return bool(_fn(*a).allowed)
                    fn, verdict = call, "bool"
                before = script_stats(admin)
                sample = timed_loop(fn, arglist, args.seconds, 20_000, 200, verdict)
                after = script_stats(admin)
                server = (after[1] - before[1]) / max(1, after[0] - before[0])
                rows[name].append((sample.calls_per_s, sample.p50_us, server))
        limiter.close()
    finally:
        target.close()

    print(f"\nRedis {version} on loopback (own server), {args.rounds} rounds of {args.seconds} s "
          f"per contender, blocking RateLimiter, one connection, 1,000 users; {load_average()}. "
          "Medians over rounds; ratios are per round to the zset check, then the median. "
          "Server µs are per script call (hold + settle: the mean of the two).\n")
    print_ratio_table(rows, BASELINE,
                      [("calls/s", ",.0f"), ("p50 µs", ".1f"), ("server µs/call", ".2f")],
                      [(0, "calls/s vs zset"), (2, "server µs vs zset")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
