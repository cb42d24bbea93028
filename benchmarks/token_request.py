#!/usr/bin/env python3
"""The capped token request, two builds side by side in one run: the Redis commands and the
server time of reserve(in_flight) + reconcile(release), against a minute+day check_windows.

    make bench-token-request BASE=<git revision>   # builds BASE into build/bench-builds first
    .venv/bin/python benchmarks/token_request.py --base PYTHON [--this PYTHON] [--rounds N]
                                                 [--requests N]

The request is what a gateway in front of an upstream model sends per completion:

    reserve(user, [(60, 60), (1000, 86400)],
            token_windows=[(100000, 60), (1000000, 86400)], tokens=1200,
            scopes=[Scope("openai/gpt-4o", windows=[(500, 60)], token_windows=[(400000, 60)],
                          shared=True),
                    Scope("model:gpt-4o", windows=[(60, 60)], token_windows=[(100000, 60)])],
            in_flight=(8, 60))
    reconcile(reservation, actual, release=True)       # actual: 200..1500, seeded

(8 windows, 4 of them weighted, an in-flight slot; 20 users in turn; every request allowed.)
Each build runs in its own interpreter (a venv holding it): one worker process per sample
(`token_request.py --worker ...`, one for the requests, one for N minute+day checks for
the ratio) warms its own keys up, then runs N calls between the driver's CONFIG RESETSTAT
and its INFO commandstats: the commands the scripts ran per call and the EVALSHA µs per
call (the base venv needs nothing but the package). Builds and storages interleave round
after round (order alternating); it starts its own redis-server on a free loopback port,
each sample under a prefix of its own.

Printed: per storage and build, the medians over rounds (and their range) of commands per
request, server µs per request, server µs per minute+day check, and the ratio of the two
(the issue's target: <= 2.5x), then this build over BASE.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RedisTarget, admin_client, load_average, round_order  # noqa: E402

STORAGES = ("zset", "compact")
USERS = 20
WARM_UP = 60


def _commands(admin: Any) -> tuple[int, float]:
    """(commands run by the scripts: every command but EVALSHA and the driver's own, EVALSHA
    µs) since the last CONFIG RESETSTAT."""
    stats = admin.info("commandstats")
    commands, usec = 0, 0.0
    for name, value in stats.items():
        command = name[len("cmdstat_"):]
        if command in ("evalsha", "eval"):
            usec += float(value["usec"])
        elif not command.startswith(("config", "info", "script", "hello", "client", "ping",
                                     "select", "flushdb")):
            commands += int(value["calls"])
    return commands, usec


def worker(url: str, storage: str, prefix: str, requests: int, kind: str) -> None:
    """One sample, driven over stdin/stdout (the driver reads the server's statistics, so
    a build's venv needs nothing but the package): warms its keys up, says "ready", runs
    `requests` token requests (kind "token") or minute+day checks (kind "check") when told
    "go", then says "done"."""
    from genai_ratelimit import RateLimiter
    from genai_ratelimit.reservation import Scope

    limiter = RateLimiter(url, storage=storage, key_prefix=prefix)
    upstream = Scope("openai/gpt-4o", windows=[(500, 60)], token_windows=[(400000, 60)],
                     shared=True)
    model = Scope("model:gpt-4o", windows=[(60, 60)], token_windows=[(100000, 60)])
    actual = random.Random(7)

    def token_request(n: int) -> None:
        reservation = limiter.reserve(
            f"u{n % USERS}", [(60, 60), (1000, 86400)],
            token_windows=[(100000, 60), (1000000, 86400)], tokens=1200,
            scopes=[upstream, model], in_flight=(8, 60))
        assert reservation.allowed, reservation
        limiter.reconcile(reservation, actual.randint(200, 1500), release=True)

    def check(n: int) -> None:
        assert limiter.check_windows(f"c{n % USERS}", [(10**9, 60), (10**9, 86400)])[0]

    step = token_request if kind == "token" else check
    for n in range(WARM_UP):
        step(n)
    print("ready", flush=True)
    sys.stdin.readline()
    for n in range(requests):
        step(WARM_UP + n)
    limiter.close()
    print("done", flush=True)


def sample(python: str, admin: Any, url: str, storage: str, prefix: str,
           requests: int) -> dict[str, float]:
    """{"commands", "usec", "check_commands", "check_usec"} per call, from one worker per
    kind."""
    out: dict[str, float] = {}
    for kind, name in (("token", ""), ("check", "check_")):
        with subprocess.Popen([python, __file__, "--worker", url, "--storage", storage,
                               "--prefix", f"{prefix}{kind[0]}", "--requests", str(requests),
                               "--kind", kind],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as process:
            assert process.stdin is not None and process.stdout is not None
            if process.stdout.readline().strip() != "ready":
                raise SystemExit(f"token_request: the {python} worker failed")
            admin.config_resetstat()
            process.stdin.write("go\n")
            process.stdin.flush()
            if process.stdout.readline().strip() != "done":
                raise SystemExit(f"token_request: the {python} worker failed")
            commands, usec = _commands(admin)
        out[name + "commands"] = commands / requests
        out[name + "usec"] = usec / requests
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the python of a venv holding the BASE build")
    parser.add_argument("--base-name", default="base")
    parser.add_argument("--this", default=sys.executable,
                        help="the python of a venv holding this build (default: this one)")
    parser.add_argument("--this-name", default="this tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--worker")
    parser.add_argument("--storage", default="zset")
    parser.add_argument("--prefix", default="bench")
    parser.add_argument("--kind", default="token")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.storage, args.prefix, args.requests, args.kind)
        return

    builds = {args.this_name: args.this}
    if args.base:
        builds = {args.base_name: args.base, **builds}
    target = RedisTarget.start_own()
    try:
        admin = admin_client(target)
        contenders = [(build, storage) for build in builds for storage in STORAGES]
        results: dict[tuple[str, str], list[dict[str, float]]] = {c: [] for c in contenders}
        names = [f"{build}|{storage}" for build, storage in contenders]
        for number in range(args.rounds):
            for name in round_order(names, number):
                build, storage = name.split("|")
                admin.flushdb()
                prefix = f"r{number}{storage[0]}{len(results[(build, storage)])}"
                results[(build, storage)].append(
                    sample(builds[build], admin, target.url, storage, prefix, args.requests))
            print(f"round {number + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        target.close()

    def median(values: list[float]) -> str:
        return f"{statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})"

    print(f"capped token request (reserve in_flight + reconcile release, 8 windows), "
          f"{args.requests} requests per sample, medians of {args.rounds} rounds (range); "
          f"{load_average()}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'storage':8} {'build':12} {'commands/request':>18} {'server µs/request':>22} "
          f"{'µs/min+day check':>22} {'ratio':>6}")
    for storage in STORAGES:
        for build in builds:
            rows = results[(build, storage)]
            ratios = [row["usec"] / row["check_usec"] for row in rows]
            print(f"{storage:8} {build:12} {median([r['commands'] for r in rows]):>18} "
                  f"{median([r['usec'] for r in rows]):>22} "
                  f"{median([r['check_usec'] for r in rows]):>22} "
                  f"{statistics.median(ratios):5.2f}x")
        if args.base:
            base, this = (results[(name, storage)] for name in builds)
            usec = [t["usec"] / b["usec"] for b, t in zip(base, this, strict=True)]
            commands = statistics.median(t["commands"] for t in this) / statistics.median(
                b["commands"] for b in base)
            print(f"{storage:8} {'this/base':12} {commands:17.2f}x "
                  f"{statistics.median(usec):6.2f}x ({min(usec):.2f}-{max(usec):.2f}) per round")


if __name__ == "__main__":
    main()
