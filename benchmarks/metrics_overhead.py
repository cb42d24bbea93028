#!/usr/bin/env python3
"""What the metrics cost a check: the same limiter with metrics on and off, side by side in
one run.

    .venv/bin/python benchmarks/metrics_overhead.py [--rounds N] [--seconds S]

It starts its own redis-server on a free loopback port (nothing else is touched) and runs,
round after round, each pair (off, on) back to back, in turns off-first and on-first, each
contender for S seconds (or 20,000 calls):

  sync, metrics off     RateLimiter(metrics=False).check(user, limit, 60), one connection
  sync, metrics on      RateLimiter().check(...): the counters, two clock reads, a bucket
  async, metrics off    AsyncRateLimiter(metrics=False): 64 concurrent checks per gather
  async, metrics on     AsyncRateLimiter(): the same

and prints, per contender, the medians over the rounds of calls/s, p50 latency and client
CPU per call, with the ratio of "on" to "off" of the same round (then the median of those).
The goal of issue 12: no more than 3% per check. Quote ratios: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RedisTarget, admin_client, timed_loop  # noqa: E402
from genai_ratelimit import AsyncRateLimiter, RateLimiter  # noqa: E402

BIG = 10**12  # a limit no run reaches: every call is allowed
USERS = [f"user_{n}" for n in range(1000)]
BATCH = 64


def async_rate(limiter: AsyncRateLimiter, seconds: float, max_calls: int) -> tuple[float, float, float]:
    """(calls/s, p50 µs per batch / BATCH, client CPU µs per call) of gathered batches."""
    async def run() -> tuple[float, float, float]:
        for _ in range(5):  # warm-up: the connection and the script
            await asyncio.gather(*(limiter.check(u, BIG, 60) for u in USERS[:BATCH]))
        batches: list[float] = []
        calls = 0
        cpu0 = time.process_time()
        start = time.perf_counter()
        deadline = start + seconds
        while time.perf_counter() < deadline and calls < max_calls:
            t0 = time.perf_counter_ns()
            users = USERS[calls % len(USERS):][:BATCH]
            await asyncio.gather(*(limiter.check(u, BIG, 60) for u in users))
            batches.append((time.perf_counter_ns() - t0) / 1e3 / len(users))
            calls += len(users)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu0
        return calls / elapsed, statistics.median(batches), cpu / calls * 1e6

    return asyncio.run(run())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()

    target = RedisTarget.start_own()
    rows: dict[str, list[tuple[float, float, float]]] = {}
    try:
        version = admin_client(target).info("server")["redis_version"]
        sync_off = RateLimiter(target.url, max_connections=1, metrics=False)
        sync_on = RateLimiter(target.url, max_connections=1)
        async_off = AsyncRateLimiter(target.url, max_connections=1, metrics=False)
        async_on = AsyncRateLimiter(target.url, max_connections=1)

        def sync(limiter: RateLimiter) -> Callable[[], tuple[float, float, float]]:
            def measure() -> tuple[float, float, float]:
                s = timed_loop(limiter.check, [(u, BIG, 60) for u in USERS], args.seconds,
                               20_000, 200, "index0")
                return s.calls_per_s, s.p50_us, s.cpu_us_per_call
            return measure

        contenders: dict[str, Callable[[], tuple[float, float, float]]] = {
            "sync, metrics off": sync(sync_off),
            "sync, metrics on": sync(sync_on),
            "async, metrics off": lambda: async_rate(async_off, args.seconds, 20_000),
            "async, metrics on": lambda: async_rate(async_on, args.seconds, 20_000),
        }
        rows = {name: [] for name in contenders}
        for round_index in range(args.rounds):
            # Each pair back to back, off then on or on then off by turns: what one round
            # compares ran under the same load.
            for kind in ("sync", "async"):
                pair = [f"{kind}, metrics off", f"{kind}, metrics on"]
                for name in pair if round_index % 2 == 0 else pair[::-1]:
                    rows[name].append(contenders[name]())
        counted = sync_on.metrics()
        assert counted["allowed"] == counted["latency_count"] > 0, counted
        assert sync_off.metrics()["allowed"] == 0
        sync_off.close()
        sync_on.close()
    finally:
        target.close()

    load = os.getloadavg()
    print(f"Redis {version} on loopback (own server), {args.rounds} rounds of {args.seconds} s "
          f"per contender, one connection each; async: batches of {BATCH} gathered checks; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs). "
          "Medians over rounds; ratios are on/off of the same round, then the median.\n")
    print("| contender | calls/s | p50 µs/call | client CPU µs/call | calls/s on/off | "
          "CPU on/off |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, values in rows.items():
        off: list[Any] = rows[name[:-len("on")] + "off"] if name.endswith(" on") else values
        rate = statistics.median(v[0] for v in values)
        p50 = statistics.median(v[1] for v in values)
        cpu = statistics.median(v[2] for v in values)
        rate_ratio = statistics.median(v[0] / b[0] for v, b in zip(values, off, strict=True))
        cpu_ratio = statistics.median(v[2] / b[2] for v, b in zip(values, off, strict=True))
        print(f"| {name} | {rate:,.0f} | {p50:.1f} | {cpu:.1f} | {rate_ratio:.3f}× | "
              f"{cpu_ratio:.3f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
