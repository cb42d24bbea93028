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
(`token_request.py --worker ...`) runs N requests (and N minute+day checks for the ratio)
after a warm-up of its own keys, between two INFO commandstats readings (CONFIG RESETSTAT
first), and prints the commands the scripts ran per request and the EVALSHA µs per
request. Builds and storages interleave round after round (order alternating); it starts
its own redis-server on a free loopback port, each sample under a prefix of its own.

Printed: per storage and build, the medians over rounds (and their range) of commands per
request, server µs per request, server µs per minute+day check, and the ratio of the two
(the issue's target: <= 2.5x), then this build over BASE.
"""

from __future__ import annotations

import argparse
import json
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
    """(commands run by scripts and clients other than EVALSHA / CONFIG / INFO, EVALSHA µs)."""
    stats = admin.info("commandstats")
    commands, usec = 0, 0.0
    for name, value in stats.items():
        command = name[len("cmdstat_"):]
        if command in ("evalsha", "eval"):
            usec += float(value["usec"])
        elif not command.startswith(("config", "info", "script", "hello", "client", "ping",
                                     "select", "flushdb", "scan", "unlink")):
            commands += int(value["calls"])
    return commands, usec


def worker(url: str, storage: str, prefix: str, requests: int) -> None:
    """One sample: prints {"commands", "usec", "check_commands", "check_usec"} per call."""
    import redis

    from genai_ratelimit import RateLimiter
    from genai_ratelimit.reservation import Scope

    admin = redis.Redis.from_url(url, decode_responses=True)
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

    out: dict[str, float] = {}
    for name, step in (("", token_request), ("check_", check)):
        for n in range(WARM_UP):
            step(n)
        admin.config_resetstat()
        for n in range(requests):
            step(WARM_UP + n)
        commands, usec = _commands(admin)
        out[name + "commands"] = commands / requests
        out[name + "usec"] = usec / requests
    limiter.close()
    print(json.dumps(out))


def sample(python: str, url: str, storage: str, prefix: str, requests: int) -> dict[str, float]:
    done = subprocess.run([python, __file__, "--worker", url, "--storage", storage, "--prefix",
                           prefix, "--requests", str(requests)],
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


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
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.storage, args.prefix, args.requests)
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
                    sample(builds[build], target.url, storage, prefix, args.requests))
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
