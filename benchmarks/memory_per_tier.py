#!/usr/bin/env python3
"""Redis memory one budget costs: a free, a pro and an enterprise user with their minute and
day windows filled to the limit by the real limiter, measured with MEMORY USAGE.

    .venv/bin/python benchmarks/memory_per_tier.py [--max-seconds S] [--users N]

It starts its own redis-server on a free loopback port (--save "" --appendonly no, default
settings otherwise, so the sorted-set encodings are Redis's defaults), fills each window with
`RateLimiter.check(user, limit, window)` until the limit (one real entry per allowed check: a
UUID4 member, a millisecond score; exactly what check_windows writes), then prints a Markdown
table: per key its entries, encoding and MEMORY USAGE (SAMPLES 0: every element counted), per
user the sum, and what N users at the limit need. Bounded: at most the sum of the limits
(105,665 checks) and --max-seconds (default 300); nothing is sent anywhere but that server.

A user below the limit costs proportionally less; a key disappears one second after its window
(EXPIRE window + 1), so these are the peaks of a user who spends a whole budget.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import redis  # noqa: E402

from benchlib import RedisTarget, admin_client  # noqa: E402
from genai_ratelimit import TIER_LIMITS, RateLimiter  # noqa: E402

WINDOWS = (("per_minute", 60), ("per_day", 86_400))


def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def fill(limiter: RateLimiter, user: str, limit: int, window: int, deadline: float) -> None:
    """`limit` allowed checks, then one that must be refused (the window is full)."""
    for number in range(limit):
        allowed, remaining, _ = limiter.check(user, limit, window)
        if not allowed or remaining != limit - number - 1:
            raise SystemExit(f"memory_per_tier: check {number + 1} of {limit} for {user} answered "
                             f"allowed={allowed} remaining={remaining}: is something else writing?")
        if number % 1000 == 0 and time.monotonic() > deadline:
            raise SystemExit("memory_per_tier: --max-seconds reached before the windows were full")
    if limiter.check(user, limit, window)[0]:
        raise SystemExit(f"memory_per_tier: {user}'s {window} s window admitted more than {limit}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-seconds", type=float, default=300.0)
    parser.add_argument("--users", type=int, default=10_000,
                        help="the population the last column sizes (default 10,000)")
    parser.add_argument("--storage", choices=("zset", "compact"), default="zset",
                        help="the limiter's storage (compact: one string per window, '<key>:c')")
    args = parser.parse_args()
    deadline = time.monotonic() + args.max_seconds
    target = RedisTarget.start_own()
    try:
        admin = admin_client(target)
        raw = redis.Redis.from_url(target.url)  # bytes: the compact header is binary
        version = admin.info("server")["redis_version"]
        baseline = admin.info("memory")["used_memory"]
        rows: list[list[str]] = []
        started = time.monotonic()
        with RateLimiter(target.url, key_prefix="ratelimit", storage=args.storage) as limiter:
            for tier, budget in TIER_LIMITS.items():
                user = f"{tier}_user"
                total = 0
                for name, window in WINDOWS:
                    limit = budget[name]
                    fill(limiter, user, limit, window, deadline)
                    key = f"ratelimit:{user}:{window}"
                    if args.storage == "compact":
                        key += ":c"
                        value = raw.getrange(key, 0, 50)
                        size = 2 + value[1] + value[2]  # an entry's bytes
                        if value[0] == 3:  # layout 2's short form: the entries end the value
                            start = (27 if value[2] else 13) + 16 * value[3]
                            entries = (raw.strlen(key) - start) // size
                        else:  # the full header: the entries' offsets
                            entries = (int.from_bytes(value[14:18], "big") -
                                       int.from_bytes(value[10:14], "big")) // size
                    else:
                        entries = admin.zcard(key)
                    if entries != limit:
                        raise SystemExit(f"memory_per_tier: {key} holds {entries}, not {limit}")
                    usage = admin.memory_usage(key, samples=0)
                    total += usage
                    rows.append([tier, f"`{key}`", f"{entries:,}", admin.object("encoding", key),
                                 human(usage), f"{usage / entries:,.0f} B"])
                rows.append([tier, "**per user**", "", "", f"**{human(total)}**",
                             f"{args.users:,} users: **{human(total * args.users)}**"])
        used = admin.info("memory")["used_memory"] - baseline
        elapsed = time.monotonic() - started
    finally:
        target.close()

    print(f"Redis {version}, storage={args.storage!r} (default zset encodings); filled by "
          f"RateLimiter.check in {elapsed:.1f} s;"
          f" used_memory grew by {human(used)} for the 6 keys.\n")
    print("| tier | key | entries | encoding | MEMORY USAGE | per entry |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
