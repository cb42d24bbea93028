#!/usr/bin/env python3
"""In-flight leases (acquire + release) against the plain check, side by side in one run.

    .venv/bin/python benchmarks/leases.py [--rounds N] [--seconds S]

It starts its own redis-server on a free loopback port (nothing else is touched) and runs,
round after round in rotating order, each contender for S seconds (or 20,000 iterations):

  sync plain check        RateLimiter.check(user, limit, 60): the baseline, one round trip
  sync acquire + release  RateLimiter.acquire(user, limit, 300) then release(lease): what a
                          request under max_in_flight adds (two round trips)
  async plain check       await AsyncRateLimiter.check(...), one coroutine after the other
  async acquire + release await acquire(...) then await release(lease), likewise
  async 64 concurrent ... the same with 64 coroutines at once (pipelined connections):
                          throughput, not latency

(1,000 users, limits no run reaches: every call is allowed.) It prints, per contender, the
medians over the rounds of iterations/s, p50 latency of one iteration, and the server's time
per script call (INFO commandstats over that contender's calls), with the ratio to the
plain check of the same kind and round. Quote ratios: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    RedisTarget,
    admin_client,
    load_average,
    print_ratio_table,
    script_stats,
)
from genai_ratelimit import AsyncRateLimiter, RateLimiter  # noqa: E402

BIG = 10**12
USERS = [f"user_{n}" for n in range(1000)]
CONCURRENCY = 64
MAX_ITERATIONS = 20_000

Row = tuple[float, float, float]  # iterations/s, p50 µs per iteration, server µs per script call


def sync_loop(step: Callable[[str], Any], seconds: float, admin: Any) -> Row:
    for user in USERS[:200]:  # warm-up
        step(user)
    latencies: list[int] = []
    before = script_stats(admin)
    start = time.perf_counter()
    deadline = start + seconds
    n = 0
    while n < MAX_ITERATIONS and time.perf_counter() < deadline:
        t0 = time.perf_counter_ns()
        step(USERS[n % len(USERS)])
        latencies.append(time.perf_counter_ns() - t0)
        n += 1
    elapsed = time.perf_counter() - start
    after = script_stats(admin)
    server = (after[1] - before[1]) / max(1, after[0] - before[0])
    return n / elapsed, statistics.median(latencies) / 1e3, server


async def async_loop(step: Callable[[str], Awaitable[Any]], seconds: float, admin: Any,
                     concurrency: int = 1) -> Row:
    for user in USERS[:200]:
        await step(user)
    latencies: list[int] = []
    before = script_stats(admin)
    start = time.perf_counter()
    deadline = start + seconds
    count = 0

    async def worker(offset: int) -> None:
        nonlocal count
        n = offset
        while count < MAX_ITERATIONS and time.perf_counter() < deadline:
            t0 = time.perf_counter_ns()
            await step(USERS[n % len(USERS)])
            latencies.append(time.perf_counter_ns() - t0)
            count += 1
            n += concurrency

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - start
    after = script_stats(admin)
    server = (after[1] - before[1]) / max(1, after[0] - before[0])
    return count / elapsed, statistics.median(latencies) / 1e3, server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()

    target = RedisTarget.start_own()
    rows: dict[str, list[Row]] = {}
    try:
        admin = admin_client(target)
        version = admin.info("server")["redis_version"]
        sync = RateLimiter(target.url, max_connections=1)

        def sync_check(user: str) -> Any:
            return sync.check(user, BIG, 60)

        def sync_lease(user: str) -> Any:
            return sync.release(sync.acquire(user, BIG, 300))

        async def run_async(kind: str, concurrency: int) -> Row:
            async with AsyncRateLimiter(target.url) as limiter:
                async def check(user: str) -> Any:
                    return await limiter.check(user, BIG, 60)

                async def lease(user: str) -> Any:
                    return await limiter.release(await limiter.acquire(user, BIG, 300))

                return await async_loop(check if kind == "check" else lease, args.seconds, admin,
                                        concurrency)

        contenders: dict[str, Callable[[], Row]] = {
            "sync plain check": lambda: sync_loop(sync_check, args.seconds, admin),
            "sync acquire + release": lambda: sync_loop(sync_lease, args.seconds, admin),
            "async plain check": lambda: asyncio.run(run_async("check", 1)),
            "async acquire + release": lambda: asyncio.run(run_async("lease", 1)),
            f"async plain check, {CONCURRENCY} concurrent": lambda: asyncio.run(
                run_async("check", CONCURRENCY)),
            f"async acquire + release, {CONCURRENCY} concurrent": lambda: asyncio.run(
                run_async("lease", CONCURRENCY)),
        }
        rows = {name: [] for name in contenders}
        names = list(contenders)
        for round_index in range(args.rounds):
            order = names[round_index % len(names):] + names[:round_index % len(names)]
            for name in order:
                rows[name].append(contenders[name]())
                admin.flushdb()
        sync.close()
    finally:
        target.close()

    print(f"Redis {version} on loopback (own server), {args.rounds} rounds of {args.seconds} s per "
          f"contender; {load_average()}. Medians over rounds; ratios are per round to the plain "
          "check of the same kind, then the median. An iteration is one check, or one acquire "
          "and its release.")
    names = list(rows)
    for check, lease in zip(names[::2], names[1::2], strict=True):  # each lease row after its check
        print()
        print_ratio_table({check: rows[check], lease: rows[lease]}, check,
                          [("iterations/s", ",.0f"), ("p50 µs", ".1f"), ("server µs/script call", ".2f")],
                          [(0, "iterations/s vs check"), (1, "p50 vs check")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
