#!/usr/bin/env python3
"""The two storages side by side in one run: Redis memory per logged request and server time
per decision, with the `limits` library's moving window beside them.

    .venv/bin/python benchmarks/storages.py [--sizes 10,128,129,1000,100000] [--rounds N]

It starts its own redis-server on a free loopback port (--save "" --appendonly no, default
settings otherwise) and touches nothing else.

Memory: for each storage and size N, one day window filled with N entries by the real
limiter (`check` with cost 1: plain; `check(..., cost=c)` with c cycling 2..50: weighted),
then MEMORY USAGE (SAMPLES 0) of every key the window has (zset: the sorted set, its weights
and running totals; compact: its one string), divided by N. `limits` (MovingWindowRateLimiter,
`hit` N times on a per-day item) is measured the same way on its own key.

Server time: INFO commandstats (EVALSHA usec / calls) over a batch of calls of one kind, per
storage, in rounds alternating the storages: an allowed check on a window of 1,000 entries,
a refused one (limit reached), an allowed check whose trim drops one entry (a full window
sliding), and a refused weighted check on a 100,000-entry weighted window whose freeing
entry is in the middle. Medians over the rounds; the ratio compact / zset per round, then
its median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RedisTarget, admin_client, limits_storage_uri, load_average, script_stats  # noqa: E402
from genai_ratelimit import RateLimiter, _native  # noqa: E402

STORAGES = ("zset", "compact")
DAY = 86_400


def window_keys(admin: Any, prefix: str, user: str) -> list[str]:
    return [key if isinstance(key, str) else key.decode()
            for key in admin.scan_iter(f"{prefix}:{user}:*", count=1000)]


def memory_of(admin: Any, keys: list[str]) -> int:
    return sum(admin.memory_usage(key, samples=0) or 0 for key in keys)


def fill(limiter: RateLimiter, user: str, entries: int, weighted: bool) -> None:
    for n in range(entries):
        allowed = limiter.check(user, 10**12, DAY, cost=2 + n % 49 if weighted else 1)[0]
        if not allowed:
            raise SystemExit(f"storages: {user} was refused after {n} entries")


def memory_rows(target: RedisTarget, admin: Any, sizes: list[int]) -> list[list[str]]:
    rows = []
    limiters = {s: RateLimiter(target.url, storage=s, key_prefix=f"mem-{s}") for s in STORAGES}
    try:
        for entries in sizes:
            row = [f"{entries:,}"]
            for weighted in (False, True):
                for storage in STORAGES:
                    user = f"{'w' if weighted else 'p'}{entries}"
                    fill(limiters[storage], user, entries, weighted)
                    keys = window_keys(admin, f"mem-{storage}", user)
                    row.append(f"{memory_of(admin, keys) / entries:,.1f}")
            row.append(f"{limits_bytes(target, admin, entries):,.1f}")
            rows.append(row)
            print("  measured", entries, "entries", file=sys.stderr)
    finally:
        for limiter in limiters.values():
            limiter.close()
    return rows


def limits_bytes(target: RedisTarget, admin: Any, entries: int) -> float:
    """Bytes per entry of `limits`' moving window (a Redis list of timestamps)."""
    from limits import RateLimitItemPerDay
    from limits.storage import storage_from_string
    from limits.strategies import MovingWindowRateLimiter

    storage = storage_from_string(limits_storage_uri(target))
    limiter = MovingWindowRateLimiter(storage)
    item = RateLimitItemPerDay(entries)
    user = f"limits-{entries}"
    before = set(admin.keys("*"))
    for _ in range(entries):
        limiter.hit(item, user)
    keys = [k if isinstance(k, str) else k.decode() for k in set(admin.keys("*")) - before]
    return memory_of(admin, keys) / entries


def server_us(admin: Any, call: Any, count: int) -> float:
    before = script_stats(admin)
    for _ in range(count):
        call()
    after = script_stats(admin)
    return (after[1] - before[1]) / max(1, after[0] - before[0])


def timing_rows(target: RedisTarget, admin: Any, rounds: int,
                big: int) -> dict[str, list[tuple[float, float]]]:
    limiters = {s: RateLimiter(target.url, storage=s, key_prefix=f"time-{s}", max_connections=1)
                for s in STORAGES}
    half: dict[str, int] = {}
    for storage, limiter in limiters.items():
        fill(limiter, "thousand", 1000, False)
        fill(limiter, "full", 1000, False)
        fill(limiter, "whale", big, True)
        half[storage] = sum(2 + n % 49 for n in range(big)) // 2
        print("  filled", storage, file=sys.stderr)
    kinds = {
        "allow (1,000 entries)": lambda lim, s: lim.check("thousand", 10**12, DAY),
        "reject (limit reached)": lambda lim, s: lim.check("full", 1000, DAY),
        "allow with a trim (2 s window, sliding)": lambda lim, s: lim.check("slide", 10**6, 2),
        f"weighted refusal ({big:,} entries)":
            lambda lim, s: lim.check("whale", half[s], DAY, cost=7),
    }
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in kinds}
    for round_index in range(rounds):
        order = STORAGES if round_index % 2 == 0 else tuple(reversed(STORAGES))
        for name, kind in kinds.items():
            measured = {}
            for storage in order:
                limiter = limiters[storage]
                measured[storage] = server_us(
                    admin, lambda k=kind, lim=limiter, s=storage: k(lim, s), 300)
            rows[name].append((measured["zset"], measured["compact"]))
    for limiter in limiters.values():
        limiter.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,128,129,1000,100000")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--big", type=int, default=100_000)
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    target = RedisTarget.start_own()
    try:
        admin = admin_client(target)
        version = admin.info("server")["redis_version"]
        started = time.monotonic()
        memory = memory_rows(target, admin, sizes)
        timing = timing_rows(target, admin, args.rounds, args.big)
        took = time.monotonic() - started
    finally:
        target.close()
    print(f"Redis {version} on loopback (own server), one run of {took:.0f} s; {load_average()}.\n")
    print("MEMORY USAGE per logged request (bytes; a day window holding N entries, every key "
          "of it, SAMPLES 0):\n")
    print("| entries | zset plain | compact plain | zset weighted | compact weighted | "
          "`limits` moving window |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in memory:
        print("| " + " | ".join(row) + " |")
    print(f"\nServer µs per decision (INFO commandstats, 300 calls per storage and kind, "
          f"{args.rounds} rounds alternating; medians):\n")
    print("| decision | zset µs | compact µs | compact / zset |")
    print("| --- | ---: | ---: | ---: |")
    for name, values in timing.items():
        zset = statistics.median(v[0] for v in values)
        compact = statistics.median(v[1] for v in values)
        ratio = statistics.median(v[1] / v[0] for v in values)
        print(f"| {name} | {zset:.2f} | {compact:.2f} | {ratio:.2f}× |")
    print(f"\n(compact script sha {_native.COMPACT_SHA1[:12]}, zset {_native.SCRIPT_SHA1[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
