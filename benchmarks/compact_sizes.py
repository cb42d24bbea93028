#!/usr/bin/env python3
"""The compact storage against the sorted sets at every window size, in one run: MEMORY USAGE
of a day window holding N entries and the server time of an allowed plain decision into it.

    .venv/bin/python benchmarks/compact_sizes.py [--sizes 1,2,10,1000,100000]
        [--timed 10,1000,100000] [--rounds 5] [--baseline FILE]

It starts its own redis-server on a free loopback port (--save "" --appendonly no) and
touches nothing else. Every contender is the built check script (`_native.SCRIPT_SOURCE`,
`_native.COMPACT_SOURCE`) called with EVALSHA and the keys and arguments the limiter sends
(one day window, the server's clock); `--baseline FILE` adds another compact script (e.g.
the previous layout's `COMPACT_SOURCE`, saved before an upgrade) as a third column, so a
change is measured before and after side by side.

Memory: per contender, size N and kind (plain: cost 1; weighted: costs cycling 2..50), one
window filled with N allowed calls, then MEMORY USAGE (SAMPLES 0) summed over every key of
the window (zset: the sorted set, its weights and running totals; compact: its string).

Server time: INFO commandstats (EVALSHA usec / calls) over 200 allowed plain calls into
windows of N entries, per contender, in rounds alternating the order. For N <= 100 each call
goes to its own window prefilled with N entries (so every call sees N); above, to one window
of N entries (growing by 200 a batch). Medians over the rounds, and the per-round ratio to
the sorted set, then its median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RedisTarget, admin_client, load_average, script_stats  # noqa: E402
from genai_ratelimit import _native  # noqa: E402

DAY_MS = 86_400_000
LIMIT = 10**12
CALLS = 200


class Contender:
    def __init__(self, name: str, source: str, zset: bool, admin: Any) -> None:
        self.name, self.zset = name, zset
        self.sha = admin.script_load(source)

    def keys(self, window: str) -> list[str]:
        return [window, f"{window}:w", f"{window}:t"] if self.zset else [f"{window}:c"]

    def args(self, cost: int) -> list[Any]:
        return [str(uuid.uuid4()), "", DAY_MS, LIMIT, cost]

    def fill(self, admin: Any, window: str, entries: int, weighted: bool) -> None:
        keys = self.keys(window)
        for start in range(0, entries, 1000):
            pipe = admin.pipeline(transaction=False)
            for n in range(start, min(entries, start + 1000)):
                pipe.evalsha(self.sha, len(keys), *keys, *self.args(2 + n % 49 if weighted else 1))
            for reply in pipe.execute():
                if reply[0] != 1:
                    raise SystemExit(f"compact_sizes: {self.name} refused while filling {window}")

    def memory(self, admin: Any, window: str) -> int:
        return sum(admin.memory_usage(key, samples=0) or 0 for key in self.keys(window))


def memory_rows(admin: Any, contenders: list[Contender], sizes: list[int]) -> list[list[str]]:
    rows = []
    for entries in sizes:
        for weighted in (False, True):
            kind = "weighted" if weighted else "plain"
            measured = []
            for c in contenders:
                window = f"mem:{contenders.index(c)}:{kind}{entries}:86400"
                c.fill(admin, window, entries, weighted)
                measured.append(c.memory(admin, window))
            base = measured[0]
            row = [f"{entries:,}", kind] + [f"{m:,} B ({m / entries:,.1f})" for m in measured]
            row += [f"{m / base:.2f}×" for m in measured[1:]]
            rows.append(row)
        print("  measured", entries, "entries", file=sys.stderr)
    return rows


def server_us(admin: Any, contender: Contender, windows: list[str]) -> float:
    before = script_stats(admin)
    for window in windows:
        keys = contender.keys(window)
        admin.evalsha(contender.sha, len(keys), *keys, *contender.args(1))
    after = script_stats(admin)
    return (after[1] - before[1]) / max(1, after[0] - before[0])


def timing(admin: Any, contenders: list[Contender], sizes: list[int],
           rounds: int) -> dict[int, list[list[float]]]:
    out: dict[int, list[list[float]]] = {n: [] for n in sizes}
    for round_index in range(rounds):
        order = contenders if round_index % 2 == 0 else list(reversed(contenders))
        for n in sizes:
            measured = {}
            for c in order:
                if n <= 100:
                    windows = [f"t:{contenders.index(c)}:r{round_index}:n{n}:{j}:86400" for j in range(CALLS)]
                    for window in windows:
                        c.fill(admin, window, n, False)
                else:
                    window = f"t:{contenders.index(c)}:big{n}:86400"
                    if round_index == 0:
                        c.fill(admin, window, n, False)
                    windows = [window] * CALLS
                measured[c.name] = server_us(admin, c, windows)
            out[n].append([measured[c.name] for c in contenders])
        print("  round", round_index + 1, file=sys.stderr)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,2,10,1000,100000")
    parser.add_argument("--timed", default="10,1000,100000")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another compact check script (e.g. the previous layout's)")
    args = parser.parse_args()
    target = RedisTarget.start_own()
    try:
        admin = admin_client(target)
        version = admin.info("server")["redis_version"]
        contenders = [Contender("zset", _native.SCRIPT_SOURCE, True, admin)]
        if args.baseline:
            contenders.append(Contender("compact-before", args.baseline.read_text(), False, admin))
        contenders.append(Contender("compact", _native.COMPACT_SOURCE, False, admin))
        started = time.monotonic()
        memory = memory_rows(admin, contenders, [int(s) for s in args.sizes.split(",")])
        timed = timing(admin, contenders, [int(s) for s in args.timed.split(",")], args.rounds)
        took = time.monotonic() - started
    finally:
        target.close()
    names = [c.name for c in contenders]
    print(f"Redis {version} on loopback (own server), one run of {took:.0f} s; {load_average()}.\n")
    print("MEMORY USAGE of a day window of N entries, every key of it (SAMPLES 0; bytes, and "
          "per entry), and the ratio to the sorted set:\n")
    print("| entries | kind | " + " | ".join(names) + " | " +
          " | ".join(f"{n} / zset" for n in names[1:]) + " |")
    print("| ---: | --- |" + " ---: |" * (2 * len(names) - 1))
    for row in memory:
        print("| " + " | ".join(row) + " |")
    print(f"\nServer µs per allowed plain decision (INFO commandstats, {CALLS} calls per "
          f"contender and size, {args.rounds} rounds alternating; medians, ratio per round):\n")
    print("| entries | " + " | ".join(f"{n} µs" for n in names) + " | " +
          " | ".join(f"{n} / zset" for n in names[1:]) + " |")
    print("| ---: |" + " ---: |" * (2 * len(names) - 1))
    for n, values in timed.items():
        cells = [f"{statistics.median(v[j] for v in values):.2f}" for j in range(len(names))]
        cells += [f"{statistics.median(v[j] / v[0] for v in values):.2f}×"
                  for j in range(1, len(names))]
        print(f"| {n:,} | " + " | ".join(cells) + " |")
    print(f"\n(compact script sha {_native.COMPACT_SHA1[:12]}, zset {_native.SCRIPT_SHA1[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
