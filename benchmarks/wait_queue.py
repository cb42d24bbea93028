"""The wait queue of shared caps (docs/wait-queue.md), measured on a redis-server of its own.

Scenario: a cap of LIMIT requests per second (Scope(shared=True)), full when the waiters
arrive; WAITERS concurrent requests with max_wait=30 s on AsyncRateLimiters (one per
process, PROCESSES processes): half from one tenant ("big"), half from tenants of one request
each. Reported: the 429s, how the cap was used while demand exceeded it, the wake-up latency
(each queued admission's entry time minus the time the capacity it took freed: the entry
LIMIT admissions earlier plus the window; the server's clock on both sides), and fairness
(the turn of each single tenant's request: its admission's index // LIMIT among the queued).

And the cost of the feature on an admission through a cap whose queue is empty: the
commands the script runs (INFO commandstats, per call) and its server time
(usec_per_call), this tree's script against BASE's (assembled from git as setup.py does),
side by side in one run, rounds alternating.

    .venv/bin/python benchmarks/wait_queue.py [--waiters 100] [--limit 10] [--processes 2]
    .venv/bin/python benchmarks/wait_queue.py --cost [--base 2859c33] [--calls 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import re
import statistics
import subprocess
import uuid
from pathlib import Path

import redis

from genai_ratelimit import AsyncRateLimiter, Scope, _native
from genai_ratelimit.testing import ThrowawayRedis

CAP = "provider/model"
ROOT = Path(__file__).resolve().parent.parent


def _waiters(url: str, tenants: list[str], limit: int, out: multiprocessing.Queue) -> None:
    async def run() -> list[tuple[str, bool, str, int, int]]:
        scope = Scope(CAP, windows=[(limit, 1)], shared=True)
        async with AsyncRateLimiter(url) as limiter:
            async def one(tenant: str) -> tuple[str, bool, str, int, int]:
                r = await limiter.reserve(f"user-{uuid.uuid4().hex[:8]}", [(1000, 60)],
                                          scopes=[scope], max_wait=30, tenant=tenant)
                return tenant, r.allowed, r.queue_outcome, r.timestamp_ms, r.waited_ms
            return await asyncio.gather(*(one(t) for t in tenants))
    out.put(asyncio.run(run()))


def scenario(waiters: int, limit: int, processes: int) -> None:
    with ThrowawayRedis() as server:
        client = redis.Redis(unix_socket_path=server.unix_path)
        scope = Scope(CAP, windows=[(limit, 1)], shared=True)

        async def fill() -> list[int]:
            async with AsyncRateLimiter(server.url) as limiter:
                stamps = []
                for _ in range(limit):
                    r = await limiter.reserve("filler", [(1000, 60)], scopes=[scope])
                    assert r.allowed
                    stamps.append(r.timestamp_ms)
                return stamps
        filled = asyncio.run(fill())
        tenants = ["big" if i % 2 == 0 else f"single-{i}" for i in range(waiters)]
        random.Random(1).shuffle(tenants)  # both processes hold some of each
        out: multiprocessing.Queue = multiprocessing.Queue()
        workers = [multiprocessing.Process(target=_waiters,
                                           args=(server.url, tenants[p::processes], limit, out))
                   for p in range(processes)]
        for w in workers:
            w.start()
        results = [row for _ in workers for row in out.get(timeout=120)]
        for w in workers:
            w.join()
        assert client.zcard(f"ratelimit:{CAP}:queue") == 0
    refused = sum(1 for r in results if not r[1])
    queued = {r[3] for r in results if r[2] == "queued_then_allowed"}
    admitted = sorted(r[3] for r in results if r[1])
    # the cap's entries over the run (the fill's and the waiters'), in time order: the k-th
    # took the capacity the (k - limit)-th freed when it left the 1 s window
    entries = sorted([*filled, *admitted])
    latency = [entries[k] - (entries[k - limit] + 1000) for k in range(limit, len(entries))
               if entries[k] in queued]
    # fairness: how many of big's requests were admitted in earlier turns (a turn: the
    # `limit` admissions one second's capacity makes; their order inside a turn is the order
    # the waiters of that instant wake in) while each single tenant's one waited (from its
    # arrival: its admission less its wait)
    bigs = sorted(r[3] for r in results if r[0] == "big" and r[1])
    singles = [r[3] for r in results if r[0] != "big" and r[1]]

    def turn_start(at: int) -> int:
        return admitted[admitted.index(at) // limit * limit]
    passed = [sum(1 for t in bigs if r[3] - r[4] <= t < turn_start(r[3])) for r in results
              if r[0] != "big" and r[1]]
    same_turn = max(sum(1 for t in bigs if turn_start(r[3]) <= t < r[3]) for r in results
                    if r[0] != "big" and r[1])
    span = (max(admitted) - min(filled)) / 1000 + 1  # the windows the run covered, in s
    print(f"cap {limit}/s, {waiters} waiters (max_wait=30 s) in {processes} processes:")
    print(f"  429s: {refused}; admitted {len(admitted)} "
          f"({sum(r[2] == 'queued_then_allowed' for r in results)} after queueing)")
    print(f"  cap use while demand exceeded it: {len(filled) + len(admitted)} admissions in "
          f"{span:.2f} s of windows = {(len(filled) + len(admitted)) / span / limit * 100:.1f} %"
          f" of {limit}/s")
    if latency:
        q = statistics.quantiles(latency, n=100)
        print(f"  wake-up latency (ms, admission - capacity freed, server clock): "
              f"p50 {statistics.median(latency):.0f}, p99 {q[98]:.0f}, max {max(latency)}, "
              f"min {min(latency)} (n={len(latency)})")
    print(f"  fairness: 'big' ({len(bigs)} requests) had at most {max(passed)} admitted in "
          f"earlier turns while a single tenant's one waited (and {same_turn} before it in its "
          f"own turn); the last single tenant was admitted in turn "
          f"{(admitted.index(max(singles))) // limit + 1} of {len(admitted) // limit}")


def base_script(revision: str) -> str:
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{revision}:lua/{path}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
    text = show("sliding_window.lua")
    parts = [show(name.replace("{storage}", "zset"))
             for name in re.findall(r"^-- include: (\S+)$", text, re.MULTILINE)]
    return "".join(p if p.endswith("\n") else p + "\n" for p in parts) + text


def cost(base: str, calls: int, rounds: int) -> None:
    with ThrowawayRedis() as server:
        client = redis.Redis(unix_socket_path=server.unix_path)
        old = client.script_load(base_script(base))
        new = client.script_load(_native.SCRIPT_SOURCE)
        upstream = f"ratelimit:{CAP}:upstream"
        queue = [f"ratelimit:{CAP}:queue", f"ratelimit:{CAP}:queue:h"]
        stats: dict[str, list[tuple[float, dict[str, float]]]] = {"base": [], "this tree": []}
        for r in range(rounds):
            order = [("base", old, []), ("this tree", new, queue)]
            for name, sha, extra in (order if r % 2 == 0 else order[::-1]):
                client.flushall()
                client.config_resetstat()
                for i in range(calls):
                    windows = [f"ratelimit:u{i % 100}:60", f"ratelimit:{CAP}:60:shared"]
                    keys = [*windows, *(f"{w}:w" for w in windows),
                            *(f"{w}:t" for w in windows), upstream, *extra]
                    client.evalsha(sha, len(keys), *keys, str(uuid.uuid4()), "",
                                   60000, 1000000, 1, 60000, 1000000, 1)
                info = client.info("commandstats")
                per_call = {k[len("cmdstat_"):]: v["calls"] / calls for k, v in info.items()
                            if k != "cmdstat_evalsha" and k != "cmdstat_flushall"
                            and k != "cmdstat_config|resetstat"}
                stats[name].append((info["cmdstat_evalsha"]["usec_per_call"], per_call))
        print(f"an admission through a cap with an empty queue, {calls} calls x {rounds} rounds:")
        for name, samples in stats.items():
            usec = statistics.median(s[0] for s in samples)
            commands = samples[-1][1]
            listed = ", ".join(f"{k} {v:g}" for k, v in sorted(commands.items()))
            print(f"  {name:9}: {usec:.2f} us/call (median); commands per call: {listed}")
        ratio = statistics.median(s[0] for s in stats["this tree"]) / statistics.median(
            s[0] for s in stats["base"])
        print(f"  ratio this tree / base: {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--waiters", type=int, default=100)
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--cost", action="store_true")
    parser.add_argument("--base", default="2859c33")
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.cost:
        cost(args.base, args.calls, args.rounds)
    else:
        scenario(args.waiters, args.limit, args.processes)


if __name__ == "__main__":
    main()
