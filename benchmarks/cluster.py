#!/usr/bin/env python3
"""Redis Cluster against a single node, side by side in one run.

    .venv/bin/python benchmarks/cluster.py [--rounds N] [--seconds S]

It starts its own servers on free loopback ports (tests/redis_cluster.py, nothing else is
touched): one redis-server, and a 3-master cluster without replicas (replication would take
CPU from the masters). Round after round, in rotating order, each contender runs for S
seconds:

  async 1 node       AsyncRateLimiter(redis://...): 256 coroutines, pipelined checks
  async 3 masters    AsyncRateLimiter(redis+cluster://...): the same; batches split per node
  sync 1 node        RateLimiter: check() back to back, one thread
  sync cluster       RateLimiter(redis+cluster://...): the same, routed by slot
  sync cluster, one master's users
                     the same with users whose slots one master serves: the routing
                     without the cost of waking three server processes in turn

and prints the medians over the rounds (calls/s, p50 latency for the sync ones), the CPU the
client and the servers used per check, and the cost of the slot lookup: the codec formatting
a check with the hash tag and slot (cluster) and without (single node), per call, against
the sync cluster call's p50. The machine's cores and load are printed with the table: on 2
shared cores three masters cannot run three times faster than one.
"""

from __future__ import annotations

import argparse
import asyncio
import binascii
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the test suite's real server fixtures
from genai_ratelimit import AsyncRateLimiter, RateLimiter, _native  # noqa: E402
from redis_cluster import RedisCluster, redis_cli  # noqa: E402
from redis_server import RedisServer  # noqa: E402

BIG = 10**12  # a limit no run reaches: every check is allowed and logs an entry
USERS = [f"user_{n}" for n in range(10_000)]
IN_FLIGHT = 256


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def server_cpu(ports: list[int]) -> float:
    total = 0.0
    for port in ports:
        for line in redis_cli("-p", str(port), "info", "cpu").splitlines():
            if line.startswith(("used_cpu_sys:", "used_cpu_user:")):
                total += float(line.split(":")[1])
    return total


def run_async(url: str, seconds: float, **options: Any) -> dict[str, float]:
    """Checks/s of IN_FLIGHT coroutines on one AsyncRateLimiter(url, **options)."""
    async def main() -> tuple[int, float]:
        limiter = AsyncRateLimiter(url, max_connections=4, **options)
        calls = 0
        stop = time.perf_counter() + seconds

        async def worker(k: int) -> None:
            nonlocal calls
            i = k
            while time.perf_counter() < stop:
                await limiter.check(USERS[i % len(USERS)], BIG, 60)
                i += IN_FLIGHT
                calls += 1

        await asyncio.gather(*(worker(k) for k in range(16)))  # warm-up: connections, map
        stop = time.perf_counter() + seconds
        started = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(IN_FLIGHT)))
        elapsed = time.perf_counter() - started
        await limiter.aclose()
        return calls, elapsed

    calls, elapsed = asyncio.run(main())
    return {"calls_per_s": calls / elapsed}


def run_sync(url: str, seconds: float, users: list[str] = USERS, **options: Any
             ) -> dict[str, float]:
    """Checks/s and p50 of check() back to back on one RateLimiter(url, **options)."""
    limiter = RateLimiter(url, **options)
    for user in users[:100]:
        limiter.check(user, BIG, 60)
    latencies = []
    clock = time.perf_counter_ns
    stop = time.perf_counter() + seconds
    started = time.perf_counter()
    i = 0
    while time.perf_counter() < stop:
        t0 = clock()
        limiter.check(users[i % len(users)], BIG, 60)
        latencies.append(clock() - t0)
        i += 1
    elapsed = time.perf_counter() - started
    limiter.close()
    latencies.sort()
    return {"calls_per_s": len(latencies) / elapsed, "p50_us": latencies[len(latencies) // 2] / 1e3}


# A contender: what runs it (a sample of calls_per_s, maybe p50_us) and the server ports
# whose CPU it costs.
Contender = tuple[Callable[[], dict[str, float]], list[int]]


def run_rounds(contenders: dict[str, Contender], rounds: int, seconds: float,
               between: Callable[[], None],
               before: Callable[[list[int]], Callable[[dict[str, float]], None]] | None = None,
               ) -> dict[str, list[dict[str, float]]]:
    """Every contender once per round, in an order rotated each round (a burst of load hits
    them alike), each sample with the client's and the servers' CPU per call. between():
    after each run (empty the servers). before(ports): before each run; what it returns is
    called with the sample after it (more columns)."""
    results: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_number in range(rounds):
        order = names[round_number % len(names):] + names[:round_number % len(names)]
        for name in order:
            run, ports = contenders[name]
            client0, server0 = cpu_seconds(), server_cpu(ports)
            after = before(ports) if before is not None else None
            sample = run()
            calls = sample["calls_per_s"] * seconds
            sample["client_cpu_us"] = (cpu_seconds() - client0) / calls * 1e6
            sample["server_cpu_us"] = (server_cpu(ports) - server0) / calls * 1e6
            if after is not None:
                after(sample)
            results[name].append(sample)
            between()
    return results


def codec_cost_ns(hash_tag: bool, calls: int = 200_000) -> float:
    """ns per Codec.check: validation, member, keys (+ hash tag and slot), EVALSHA bytes."""
    codec = _native.Codec("ratelimit", hash_tag=hash_tag)
    check = codec.check
    started = time.perf_counter_ns()
    for i in range(calls):
        check(USERS[i % len(USERS)], BIG, 60)
    return (time.perf_counter_ns() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()

    single = RedisServer("--save", "", "--appendonly", "no")
    cluster = RedisCluster(masters=3, replicas_per_master=0)
    single.start()
    cluster.start()
    try:
        cluster_ports = [n.port for n in cluster.nodes]
        owned = set(cluster.owned_slots(cluster.master_of_slot(0)))
        one_master = [u for u in USERS if binascii.crc_hqx(u.encode(), 0) % 16384 in owned]
        contenders: dict[str, Contender] = {
            "async 1 node": (lambda: run_async(single.url, args.seconds), [single.port]),
            "async 3 masters": (lambda: run_async(cluster.url, args.seconds), cluster_ports),
            "sync 1 node": (lambda: run_sync(single.url, args.seconds), [single.port]),
            "sync cluster": (lambda: run_sync(cluster.url, args.seconds), cluster_ports),
            "sync cluster, 1 master": (lambda: run_sync(cluster.url, args.seconds, one_master),
                                       cluster_ports),
        }
        names = list(contenders)
        load_before = os.getloadavg()

        def flush() -> None:
            redis_cli("-p", str(single.port), "flushall")
            cluster.flush()

        results = run_rounds(contenders, args.rounds, args.seconds, flush)
        plain, tagged = [], []
        for _ in range(5):  # alternating, so that a burst of load hits both alike
            plain.append(codec_cost_ns(False))
            tagged.append(codec_cost_ns(True))
        codec_plain, codec_tagged = statistics.median(plain), statistics.median(tagged)
        load_after = os.getloadavg()
    finally:
        cluster.close()
        single.close()

    def median(name: str, key: str) -> float:
        return statistics.median(s[key] for s in results[name] if key in s)

    print(f"\n{os.cpu_count()} cores; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after; {args.rounds} rounds of {args.seconds:g} s; medians\n")
    print(f"{'contender':<24}{'checks/s':>11}{'ratio':>8}{'p50 us':>9}"
          f"{'client CPU us':>15}{'server CPU us':>15}")
    for name in names:
        base = "async 1 node" if name.startswith("async") else "sync 1 node"
        ratio = median(name, "calls_per_s") / median(base, "calls_per_s")
        p50 = f"{median(name, 'p50_us'):.1f}" if name.startswith("sync") else "-"
        print(f"{name:<24}{median(name, 'calls_per_s'):>11.0f}{ratio:>8.2f}{p50:>9}"
              f"{median(name, 'client_cpu_us'):>15.1f}{median(name, 'server_cpu_us'):>15.1f}")
    extra = codec_tagged - codec_plain
    share = extra / (median("sync cluster", "p50_us") * 1e3) * 100
    print(f"\nslot lookup: Codec.check {codec_plain:.0f} ns single-node, {codec_tagged:.0f} ns "
          f"with hash tag + CRC16 slot: +{extra:.0f} ns = {share:.2f}% of a sync cluster "
          f"call's p50")


if __name__ == "__main__":
    main()
