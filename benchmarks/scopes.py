#!/usr/bin/env python3
"""Scoped reservations (an upstream cap decided with the user's windows) against
check_windows, side by side in one run.

    .venv/bin/python benchmarks/scopes.py [--rounds N] [--seconds S]

It starts its own redis-server on a free loopback port (nothing else is touched) and runs,
round after round in rotating order, each contender for S seconds (or 20,000 calls) with
the blocking RateLimiter, sequentially on one connection, over 1,000 users:

  check_windows (baseline)     check_windows(user, [(L, 60), (L, 86400)])
  reserve, no scope            reserve(user, the same windows)
  reserve + upstream           reserve(user, the same windows, scopes=[upstream]): the shared
                               upstream's minute window decided in the same script
  reserve + upstream, 2 steps  the same, _two_step_scopes on: the upstream in a step of its
                               own, then the user's windows (two round trips)
  reserve + upstream + route   one script: the user's windows, a route budget, the upstream

and prints, per contender, the medians over the rounds of calls/s, p50 latency and the
server's time per script call (INFO commandstats usec_per_call of EVALSHA), with the ratios
to check_windows of the same round. Quote ratios: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RedisTarget, admin_client, script_stats, timed_loop  # noqa: E402
from genai_ratelimit import RateLimiter, Scope  # noqa: E402

BIG = 10**12  # a limit no run reaches: every call is allowed and logs an entry
USERS = [(f"user_{n}",) for n in range(1000)]
WINDOWS = [(BIG, 60), (BIG, 86400)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.5)
    args = parser.parse_args()

    upstream = Scope("openai/gpt-4o", windows=[(BIG, 60)], shared=True)
    route = Scope("route:/v1/chat/completions", windows=[(BIG, 60)])
    target = RedisTarget.start_own()
    try:
        admin = admin_client(target)
        version = admin.info("server")["redis_version"]
        limiter = RateLimiter(target.url, max_connections=1)
        stepped = RateLimiter(target.url, max_connections=1)
        stepped._two_step_scopes = True

        def as_tuple(reservation: Any) -> tuple[bool]:
            return (reservation.allowed,)

        contenders: dict[str, Callable[[str], Any]] = {
            "check_windows (baseline)": lambda u: limiter.check_windows(u, WINDOWS),
            "reserve, no scope": lambda u: as_tuple(limiter.reserve(u, WINDOWS)),
            "reserve + upstream": lambda u: as_tuple(limiter.reserve(u, WINDOWS,
                                                                     scopes=[upstream])),
            "reserve + upstream, 2 steps": lambda u: as_tuple(stepped.reserve(
                u, WINDOWS, scopes=[upstream])),
            "reserve + upstream + route": lambda u: as_tuple(limiter.reserve(
                u, WINDOWS, scopes=[route, upstream])),
        }
        rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in contenders}
        names = list(contenders)
        for round_index in range(args.rounds):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for name in order:
                before = script_stats(admin)
                sample = timed_loop(contenders[name], USERS, args.seconds, 20_000, 200)
                after = script_stats(admin)
                scripts = after[0] - before[0]
                server = (after[1] - before[1]) / max(1, scripts)
                # Server time per decision (the two-step path runs two scripts per call).
                per_call = server * scripts / max(1, sample.calls + 200)
                rows[name].append((sample.calls_per_s, sample.p50_us, per_call))
        limiter.close()
        stepped.close()
    finally:
        target.close()

    base = rows["check_windows (baseline)"]
    load = os.getloadavg()
    print(f"Redis {version} on loopback (own server), {args.rounds} rounds of {args.seconds} s per "
          f"contender, blocking RateLimiter, one connection, 1,000 users; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs). Medians over "
          "rounds; ratios are per round to check_windows, then the median. Server µs is per "
          "decision (two scripts for the two-step path).\n")
    print("| contender | calls/s | p50 µs | server µs/decision | calls/s vs check_windows | "
          "server µs vs check_windows |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, values in rows.items():
        rate = statistics.median(v[0] for v in values)
        p50 = statistics.median(v[1] for v in values)
        server = statistics.median(v[2] for v in values)
        rate_ratio = statistics.median(v[0] / b[0] for v, b in zip(values, base, strict=True))
        server_ratio = statistics.median(v[2] / b[2] for v, b in zip(values, base, strict=True))
        print(f"| {name} | {rate:,.0f} | {p50:.1f} | {server:.2f} | {rate_ratio:.2f}× | "
              f"{server_ratio:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
