#!/usr/bin/env python3
"""GCRA (check_rate) against the sliding-window check, side by side in one run.

    .venv/bin/python benchmarks/gcra.py [--rounds N] [--seconds S]

It starts its own redis-server on a free loopback port (nothing else is touched) and runs,
round after round in rotating order, each contender for S seconds (or 20,000 calls) with
the blocking RateLimiter, sequentially on one connection, over 1,000 users:

  zset check                check(user, BIG, 60): the baseline, allowed (the window grows)
  zset check, 60/min        check(user, 60, 60): a tier's minute, mostly refused once warm
  compact check             the baseline on storage="compact"
  GCRA allowed, whole ms    check_rate(user, 1000, 1, 1000): T = 1 ms, always allowed, the
                            TAT written as an integer
  GCRA allowed, fraction    check_rate(user, 999, 7, 100,000): T is no whole ms (scale
                            999), the TAT written as one integer with its remainder
  GCRA allowed, string      check_rate(user, 1,000,003, 60, 1,000,000): scale 1,000,003,
                            the TAT written as "<ms>:<remainder>:<scale>"
  GCRA refused              check_rate(user, 1, 3600, 1): refused (a GET, no write)
  empty EVALSHA             `return {1}`: the floor of any script decision

and prints, per contender, the medians over the rounds of calls/s, p50 latency and the
server's time per script call (INFO commandstats usec of EVALSHA over that contender's
calls), with the ratio to the zset check of the same round. Then MEMORY USAGE of one key
of each kind for one user. Quote ratios: the machine is shared.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    EMPTY_SCRIPT,
    RedisTarget,
    admin_client,
    load_average,
    print_ratio_table,
    script_stats,
    timed_loop,
)
from genai_ratelimit import RateLimiter  # noqa: E402

BIG = 10**12  # a limit no run reaches: every check is allowed and logs an entry
USERS = [f"user_{n}" for n in range(1000)]
BASELINE = "zset check, allowed (baseline)"


def memory_table(admin: Any, limiter: RateLimiter, compact: RateLimiter) -> None:
    """MEMORY USAGE of one fresh key of each kind, for the user id "user_8421"."""
    user = "user_8421"
    limiter.check(user, 10, 60)
    compact.check(user, 10, 60)
    limiter.check_rate(user, 600, 60, 10)          # T = 100 ms: scale 1
    limiter.check_rate(user, 7, 3600, 10)          # T = 3,600,000 / 7 ms: scale 7
    limiter.check_rate(user, 1_000_003, 86400, 10)  # scale 1,000,003: the string form
    rows = [
        ("sorted set, 1 entry", f"ratelimit:{user}:60"),
        ("compact, 1 entry", f"ratelimit:{user}:60:c"),
        ("GCRA, T whole ms (integer)", f"ratelimit:{user}:60:gcra"),
        ("GCRA, T a fraction, scale 7 (integer)", f"ratelimit:{user}:3600:gcra"),
        ("GCRA, scale 1,000,003 (string)", f"ratelimit:{user}:86400:gcra"),
    ]
    print("\nMEMORY USAGE of one key (bytes), user id \"user_8421\":\n")
    print("| key | name | value | bytes |")
    print("| --- | --- | --- | ---: |")
    for what, key in rows:
        kind = admin.type(key)
        value = admin.get(key) if kind == "string" and "gcra" in key else f"({kind})"
        print(f"| {what} | `{key}` | `{value}` | {admin.memory_usage(key, samples=0)} |")


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
        compact = RateLimiter(target.url, max_connections=1, storage="compact")
        empty_sha = admin.script_load(EMPTY_SCRIPT)
        for user in USERS:  # the refused contender's users hold a full bucket
            limiter.check_rate(user, 1, 3600, 1)

        def empty(_: str) -> Any:
            return admin.evalsha(empty_sha, 0)

        contenders: dict[str, tuple[Callable[..., Any], list[tuple[Any, ...]]]] = {
            BASELINE: (limiter.check, [(u, BIG, 60) for u in USERS]),
            "zset check, 60/min": (limiter.check, [(u, 60, 60) for u in USERS]),
            "compact check, allowed": (compact.check, [(u, BIG, 60) for u in USERS]),
            "GCRA allowed, T whole ms": (
                limiter.check_rate, [(u, 1000, 1, 1000) for u in USERS]),
            "GCRA allowed, T a fraction": (
                limiter.check_rate, [(u, 999, 7, 100_000) for u in USERS]),
            "GCRA allowed, string form": (
                limiter.check_rate, [(u, 1_000_003, 60, 1_000_000) for u in USERS]),
            "GCRA refused": (limiter.check_rate, [(u, 1, 3600, 1) for u in USERS]),
            "empty EVALSHA (redis-py)": (empty, [("",)]),
        }
        rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in contenders}
        names = list(contenders)
        for round_index in range(args.rounds):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for name in order:
                fn, arglist = contenders[name]
                before = script_stats(admin)
                sample = timed_loop(fn, arglist, args.seconds, 20_000, 200,
                                    "bool" if name.startswith("empty") else "index0")
                after = script_stats(admin)
                server = (after[1] - before[1]) / max(1, after[0] - before[0])
                rows[name].append((sample.calls_per_s, sample.p50_us, server))
        admin.flushdb()
        memory_table(admin, limiter, compact)
        limiter.close()
        compact.close()
    finally:
        target.close()

    print(f"\nRedis {version} on loopback (own server), {args.rounds} rounds of {args.seconds} s "
          f"per contender, blocking RateLimiter, one connection, 1,000 users; {load_average()}. "
          "Medians over rounds; ratios are per round to the zset check, then the median. The "
          "empty EVALSHA goes through redis-py (its client side is not comparable; its server "
          "time is).\n")
    print_ratio_table(rows, BASELINE,
                      [("calls/s", ",.0f"), ("p50 µs", ".1f"), ("server µs/call", ".2f")],
                      [(0, "calls/s vs zset"), (2, "server µs vs zset")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
