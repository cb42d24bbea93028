"""The wait queue of in-flight caps (docs/wait-queue.md, "In-flight caps"), measured on a
redis-server of its own.

Scenario: an in-flight cap of LIMIT (acquire on the upstream's name), CLIENTS concurrent
clients from two gateway processes (asyncio, CLIENTS / 2 tasks each, one AsyncRateLimiter
per process): each acquires with max_wait=30, holds the lease 0.5-2 s (random, seeded),
releases it. Gateway A's clients are one tenant ("big"), gateway B's a tenant each.
Reported:
  - 429s: acquires that ended refused (must be 0);
  - cap use while demand exceeded it: the time-integral of the leases held, over LIMIT x
    the time from the first admission to the last queued one;
  - wake-up latency: the time from a release to the admission it made room for, the k-th
    release (time order) matched with the k-th queued admission. The admission's time is
    the server's (its lease's start: expires_at_ms - lease_ms, the script's TIME); the
    release's is the wall clock of this host just before the release is sent (Redis runs
    on this host: TIME reads the same clock), so each figure is an upper bound (it
    includes half the release's round trip);
  - fairness: the "big" tenant's queued admissions before the last single tenant's (one
    turn per round: at most 1);
  - the kill run: gateway A is kill -9'd 2 s in, while its requests wait. Gateway B's waits
    beside those of the normal run, and what is left in Redis once A's leases expired (its
    tickets lapse within wait_queue.TICKET_LIVE_MS): nothing.

    .venv/bin/python benchmarks/inflight_queue.py [--clients 100] [--limit 10] [--runs 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import redis

from genai_ratelimit import AsyncRateLimiter
from genai_ratelimit.testing import ThrowawayRedis

CAP = "openai/gpt-4o"
LEASE_SECONDS = 5  # longer than any hold (2 s): a killed gateway's leases expire after it


def _gateway(url: str, tenants: list[str], limit: int, seed: int, start_at: float,
             out: str) -> None:
    """One gateway process: a task per tenant entry, each acquire, hold, release; one JSON
    line per request appended to `out` as it ends."""

    async def run() -> None:
        async with AsyncRateLimiter(url) as limiter:
            async def one(index: int, tenant: str) -> None:
                hold = random.Random(seed * 1000 + index).uniform(0.5, 2.0)
                asked_ms = time.time() * 1000
                lease = await limiter.acquire(CAP, limit, LEASE_SECONDS, max_wait=30,
                                              tenant=tenant)
                record: dict[str, Any] = {
                    "tenant": tenant, "allowed": lease.allowed, "outcome": lease.queue_outcome,
                    "waited_ms": lease.waited_ms, "asked_ms": asked_ms}
                if lease.allowed:
                    record["admitted_ms"] = lease.expires_at_ms - LEASE_SECONDS * 1000
                    await asyncio.sleep(hold)
                    record["release_sent_ms"] = time.time() * 1000
                    await limiter.release(lease)
                with open(out, "a", encoding="utf-8") as file:
                    file.write(json.dumps(record) + "\n")

            await asyncio.sleep(max(0.0, start_at - time.time()))
            await asyncio.gather(*(one(i, t) for i, t in enumerate(tenants)))

    asyncio.run(run())


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def one_run(clients: int, limit: int, kill: bool, seed: int, workdir: Path) -> dict[str, Any]:
    per = clients // 2
    with ThrowawayRedis() as server:
        client = redis.Redis(unix_socket_path=server.unix_path)
        outs = [workdir / f"a-{seed}-{kill}.jsonl", workdir / f"b-{seed}-{kill}.jsonl"]
        for out in outs:
            out.unlink(missing_ok=True)
        start_at = time.time() + 1.5
        context = multiprocessing.get_context("spawn")
        gateways = [
            context.Process(target=_gateway, args=(server.url, ["big"] * per, limit, seed,
                                                   start_at, str(outs[0]))),
            context.Process(target=_gateway, args=(server.url, [f"solo-{i}" for i in range(per)],
                                                   limit, seed + 1, start_at, str(outs[1]))),
        ]
        for gateway in gateways:
            gateway.start()
        if kill:
            time.sleep(max(0.0, start_at + 2.0 - time.time()))
            assert gateways[0].pid is not None
            os.kill(gateways[0].pid, signal.SIGKILL)
        for gateway in gateways:
            gateway.join(60)
            if gateway.is_alive():
                gateway.kill()
                raise SystemExit("a gateway ran past 60 s")
        a, b = _records(outs[0]), _records(outs[1])
        result: dict[str, Any] = {"b_waits": [r["waited_ms"] for r in b]}
        if kill:
            # what A left: its leases expire after LEASE_SECONDS, its tickets lapse sooner
            time.sleep(LEASE_SECONDS + 0.5)
            left = client.keys(f"ratelimit:{CAP}:leases")
            left += client.keys(f"ratelimit:{CAP}:leases:queue*")
            result.update(b_refused=sum(not r["allowed"] for r in b),
                          leftover=[k.decode() for k in left], b_done=len(b))
            return result
        every = a + b
        result["refused"] = sum(not r["allowed"] for r in every)
        result["requests"] = len(every)
        queued = sorted(r["admitted_ms"] for r in every if r["allowed"] and r["outcome"])
        releases = sorted(r["release_sent_ms"] for r in every if r["allowed"])
        latencies = [adm - rel for adm, rel in zip(queued, releases, strict=False)]
        result["latency"] = latencies
        # cap use while demand exceeded it: from the first admission to the last queued one
        first = min(r["admitted_ms"] for r in every if r["allowed"])
        last = queued[-1] if queued else first
        events = []
        for r in every:
            if r["allowed"]:
                events.append((r["admitted_ms"], 1))
                events.append((r["release_sent_ms"], -1))
        events.sort()
        held, at, area = 0, first, 0.0
        for stamp, step in events:
            stamp = min(max(stamp, first), last)
            area += held * (stamp - at)
            at = stamp
            held += step
        result["use"] = area / (limit * (last - first)) if last > first else 1.0
        # fairness: big's queued admissions before the last single tenant's
        order = sorted((r["admitted_ms"], r["tenant"]) for r in every
                       if r["allowed"] and r["outcome"])
        last_solo = max((i for i, (_, t) in enumerate(order) if t != "big"), default=-1)
        result["big_before_last_solo"] = sum(1 for _, t in order[:last_solo] if t == "big")
        result["solo_turns"] = [i for i, (_, t) in enumerate(order) if t != "big"]
        result["wall_s"] = (max(r["release_sent_ms"] for r in every if r["allowed"])
                            - first) / 1000
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"inflight-queue-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"in-flight cap {args.limit}, {args.clients} clients from 2 gateway processes, "
          f"max_wait=30 s, holds 0.5-2 s\n")
    print("| run | 429s | cap use while demand > cap | wake-up p50 / p90 / p99 / max (ms) "
          "| big's queued admissions before the last single tenant's | wall (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    normal_b: list[float] = []
    pooled: list[float] = []
    for run in range(args.runs):
        started = time.monotonic()
        r = one_run(args.clients, args.limit, False, 7 + 10 * run, workdir)
        lat = r["latency"]
        normal_b += r["b_waits"]
        pooled += lat
        print(f"| {run + 1} | {r['refused']} of {r['requests']} | {100 * r['use']:.1f} % "
              f"| {_percentile(lat, 50):.1f} / {_percentile(lat, 90):.1f} / "
              f"{_percentile(lat, 99):.1f} / {max(lat):.1f} ({len(lat)} wake-ups) "
              f"| {r['big_before_last_solo']} | {r['wall_s']:.1f} "
              f"(run {time.monotonic() - started:.0f} s) |", flush=True)
    if args.runs > 1:
        print(f"| all | | | {_percentile(pooled, 50):.1f} / {_percentile(pooled, 90):.1f} / "
              f"{_percentile(pooled, 99):.1f} / {max(pooled):.1f} ({len(pooled)} wake-ups) "
              f"| | |")
    started = time.monotonic()
    k = one_run(args.clients, args.limit, True, 7, workdir)
    print("\nkill -9 of gateway A (tenant \"big\") 2 s in, while its requests wait:\n")
    print("| | gateway B requests done | B's 429s | B's wait p50 / p90 / max (ms) "
          "| keys left in Redis once A's leases expired |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| normal run(s) | {len(normal_b)} | 0 | {_percentile(normal_b, 50):.0f} / "
          f"{_percentile(normal_b, 90):.0f} / {max(normal_b):.0f} | - |")
    kb = k["b_waits"]
    print(f"| A killed | {k['b_done']} | {k['b_refused']} | {_percentile(kb, 50):.0f} / "
          f"{_percentile(kb, 90):.0f} / {max(kb):.0f} | {k['leftover'] or 'none'} "
          f"(run {time.monotonic() - started:.0f} s) |")


if __name__ == "__main__":
    main()
