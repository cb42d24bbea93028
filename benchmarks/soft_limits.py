#!/usr/bin/env python3
"""What soft limits cost the budget scripts: the hold and settle scripts before them (read
from git at --baseline, built as setup.py builds them) against the current ones, on one
redis-server, side by side in one run.

    .venv/bin/python benchmarks/soft_limits.py [--baseline REV] [--rounds N] [--calls C]

It starts its own redis-server on a free loopback port and, round after round in rotating
order, runs each contender C times (EVALSHA through redis-py, one connection): a hold of 4
budgets (org -> team -> key -> user, limits 10^12, never refused, never crossing), then a
settle of that hold. Contenders:

  before: hold + settle        the scripts at --baseline (no soft limits)
  now, no thresholds           the current scripts, thresholds 0 (a budget without them)
  now, thresholds (50,80,95)   the current scripts, three thresholds per budget, none crossed

It prints per contender the medians over the rounds of the server's µs per script call
(INFO commandstats usec of EVALSHA over that contender's calls: the hold and the settle
together, per call), with the ratio to the baseline of the same round. The client side is
the same for all three (redis-py), so only the server column says anything.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    RedisTarget,
    admin_client,
    load_average,
    print_ratio_table,
    round_order,
    script_stats,
)
from genai_ratelimit import Budget, _native  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
INCLUDE_LINE = re.compile(r"^-- include: (\S+)$", re.MULTILINE)  # setup.py's rule
BIG = 10**12

def month_bounds() -> tuple[int, int, int, int]:
    """(previous start, start, end, next end) of this month in Paris, as periods.py sends."""
    budget = Budget("x", "x", 1, "month", "Europe/Paris")
    start, end = budget.period_at(time.time_ns() // 1_000_000)
    return budget.period_at(start - 1)[0], start, end, budget.period_at(end)[1]


BOUNDS = month_bounds()


def built_at(revision: str, name: str) -> str:
    """lua/<name> at `revision` with the lua/lib files it includes prepended (setup.py)."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{revision}:lua/{path}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
    text = show(name)
    return "".join(show(include) + "\n" for include in INCLUDE_LINE.findall(text)) + text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="9808dc6", help="the commit before soft limits")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()

    target = RedisTarget.start_own()
    try:
        admin = admin_client(target)
        version = admin.info("server")["redis_version"]
        old_hold = admin.script_load(built_at(args.baseline, "budget_hold.lua"))
        old_settle = admin.script_load(built_at(args.baseline, "budget_settle.lua"))
        new_hold = admin.script_load(_native.BUDGET_HOLD_SOURCE)
        new_settle = admin.script_load(_native.BUDGET_SETTLE_SOURCE)
        owners = [("org:acme", f"team:{n % 10}", f"key:{n}", f"user:{n}") for n in range(1000)]

        def keys(levels: tuple[str, ...], name: str, per: int) -> list[str]:
            starts = BOUNDS[:3] if per == 3 else BOUNDS[1:2]
            return [f"ratelimit:{owner}:{start}:budget={name}" for owner in levels
                    for start in starts]

        def run(name: str, old: bool, packed: int) -> None:
            hold, settle = (old_hold, old_settle) if old else (new_hold, new_settle)
            for i in range(args.calls):
                levels = owners[i % len(owners)]
                hold_id = str(uuid.UUID(int=i + 1))
                argv: list[object] = [hold_id, "", 86_400_000]
                for _ in levels:
                    argv += [BIG, 150_000, *BOUNDS] + ([] if old else [packed])
                admin.evalsha(hold, 12, *keys(levels, name, 3), *argv)
                settle_argv: list[object] = [hold_id]
                for _ in levels:
                    settle_argv += [120_000] if old else [120_000, BIG, packed]
                admin.evalsha(settle, 4, *keys(levels, name, 1), *settle_argv)

        contenders = {
            "before: hold + settle (baseline)": ("before", True, 0),
            "now, no thresholds": ("none", False, 0),
            "now, thresholds (50, 80, 95), none crossed": ("soft", False, 50_080_095),
        }
        rows: dict[str, list[tuple[float]]] = {name: [] for name in contenders}
        for round_index in range(args.rounds):
            for name in round_order(list(contenders), round_index):
                before = script_stats(admin)
                run(*contenders[name])
                after = script_stats(admin)
                rows[name].append(((after[1] - before[1]) / max(1, after[0] - before[0]),))
    finally:
        target.close()

    print(f"\nRedis {version} on loopback (own server), {args.rounds} rounds of {args.calls} "
          f"holds + settles of 4 budgets per contender, EVALSHA via redis-py; "
          f"{load_average()}. Medians over rounds; ratios per round to the baseline.\n")
    print_ratio_table(rows, "before: hold + settle (baseline)", [("server µs/call", ".2f")],
                      [(0, "vs before")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
