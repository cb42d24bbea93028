"""Reserved shares of an in-flight cap under load (issue 34 item 2, "Shares"; docs/upstreams.md,
"Shares of an in-flight cap"): three tiers hammering one cap of 10 streams in flight from two
processes.

    .venv/bin/python benchmarks/shares_in_flight.py [--seconds 8] [--threads 4]

- the cap: acquire("provider", 10, LEASE_SECONDS, shares=Shares(reserved={"enterprise": 30,
  "pro": 0}, ceilings={"free": (50, 80)}), share_class=tier): enterprise keeps 3 of 10 while
  it is active, free at most 5 once the cap holds more than 8 while another class is active;
  pro has no share (reserved 0: tracked, so that it counts as active).
- the gateway: two processes, each `--threads` threads per tier (in phases of fewer tiers,
  as many threads in all, shared by those tiers); a thread takes a slot, holds
  it for a stream of 50-300 ms (uniform), releases it and asks again at once; a refused thread
  asks again after 5 ms (hammering).
- the sampler (this process): back to back, one Lua script reads, at the server's time, each
  class's live leases (its class set's entries expiring after now) and the cap's.

Phase 1, every tier: at every sample, free + pro hold at most 10 - max(enterprise, 3)
(enterprise's reserve is never taken), enterprise holds at least min(its demand, 3) =
3 but for the instants between one of its streams ending and the next starting (counted),
and free holds at most 5 whenever the cap holds more than 8. Phase 2, free and pro (no
enterprise): no reserve binds, free's ceiling does (pro is active). Phase 3, free alone: the
whole cap. Each phase starts on a flushed database (no activity left from the one before).
Bounded: 3 phases of --seconds (default 8) plus the processes' start-up, under 40 s."""

from __future__ import annotations

import argparse
import multiprocessing
import random
import threading
import time
from collections import Counter
from typing import Any

import redis

from genai_ratelimit import RateLimiter, Shares
from genai_ratelimit.testing import ThrowawayRedis

CAP = "provider"
LIMIT = 10
LEASE_SECONDS = 5
TIERS = ("enterprise", "free", "pro")
SHARES = Shares(reserved={"enterprise": 30, "pro": 0}, ceilings={"free": (50, 80)})
SAMPLE = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = redis.call('ZCOUNT', key, '(' .. now_ms, '+inf')
end
return out
"""


def gateway(url: str, tiers: tuple[str, ...], threads: int, start: float, until: float,
            counts: Any) -> None:
    limiter = RateLimiter(url)
    time.sleep(max(0.0, start - time.time()))
    local: Counter[Any] = Counter()
    lock = threading.Lock()

    def hammer(tier: str, seed: int) -> None:
        chance = random.Random(seed)
        while time.time() < until:
            lease = limiter.acquire(CAP, LIMIT, LEASE_SECONDS, shares=SHARES, share_class=tier)
            rule = lease.share_refusal.rule if lease.share_refusal else ""
            with lock:
                local[(tier, lease.allowed, rule)] += 1
            if lease.allowed:
                time.sleep(chance.uniform(0.05, 0.3))
                limiter.release(lease)
            else:
                time.sleep(0.005)

    workers = [threading.Thread(target=hammer, args=(tier, hash((tier, n, time.time_ns()))))
               for tier in tiers for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    limiter.close()
    counts.put(dict(local))


def phase(url: str, tiers: tuple[str, ...], seconds: float, threads: int
          ) -> tuple[list[list[int]], Counter[Any]]:
    """One phase; every phase runs as many threads in all (3 x threads per process), shared
    by its tiers, so that the demand is the same."""
    threads = threads * len(TIERS) // len(tiers)
    client = redis.Redis.from_url(url)
    client.flushdb()
    keys = [f"ratelimit:{CAP}:leases:class={tier}" for tier in TIERS]
    keys.append(f"ratelimit:{CAP}:leases")
    context = multiprocessing.get_context("spawn")
    counts = context.Queue()
    start = time.time() + 2.0  # the processes' start-up
    until = start + seconds
    processes = [context.Process(target=gateway, args=(url, tiers, threads, start, until, counts))
                 for _ in range(2)]
    for process in processes:
        process.start()
    samples: list[list[int]] = []
    while time.time() < start + 0.5:  # the first streams taken
        time.sleep(0.01)
    while time.time() < until - 0.1:
        samples.append(list(client.eval(SAMPLE, len(keys), *keys)))
    total: Counter[Any] = Counter()
    for _ in processes:
        total.update(counts.get())
    for process in processes:
        process.join()
    client.close()
    return samples, total


def admissions(total: Counter[Any], tiers: tuple[str, ...], seconds: float) -> str:
    parts = []
    for tier in tiers:
        parts.append(f"{tier} {total[(tier, True, '')] / seconds:.1f}/s (refused: "
                     f"{total[(tier, False, '')]} cap, {total[(tier, False, 'reserve')]} "
                     f"reserve, {total[(tier, False, 'ceiling')]} ceiling)")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    with ThrowawayRedis() as server:
        samples, total = phase(server.url, TIERS, args.seconds, args.threads)
        print(f"phase 1: 3 tiers x {args.threads} threads x 2 processes, {args.seconds:g} s, "
              f"cap {LIMIT} in flight: {len(samples)} samples")
        over_limit = sum(1 for *_, cap in samples if cap > LIMIT)
        reserve_taken = sum(1 for e, f, p, _ in samples if f + p > LIMIT - max(e, 3))
        below = [(e, f, p, cap) for e, f, p, cap in samples if e < 3]
        saturated = [(e, f, p) for e, f, p, cap in samples if cap > 8]
        ceiling_broken = sum(1 for e, f, p in saturated if f > 5)
        print(f"  cap above {LIMIT}: {over_limit}; free + pro > 10 - max(enterprise, 3): "
              f"{reserve_taken}")
        print(f"  enterprise below 3: {len(below)} samples (min {min(s[0] for s in samples)}), "
              f"in which the others held at most {max((f + p for _, f, p, _ in below), default=0)}")
        print(f"  cap above 8: {len(saturated)} samples, free above 5 in {ceiling_broken}; "
              f"max free {max(s[1] for s in samples)}, max pro {max(s[2] for s in samples)}")
        print(f"  {admissions(total, TIERS, args.seconds)}")
        samples, total = phase(server.url, ("free", "pro"), args.seconds, args.threads)
        saturated = [(e, f, p) for e, f, p, cap in samples if cap > 8]
        print(f"phase 2: free and pro ({len(samples)} samples): max free {max(s[1] for s in samples)}, "
              f"max cap {max(s[3] for s in samples)}, cap above 8 in {len(saturated)}, free above 5 "
              f"there in {sum(1 for _, f, _ in saturated if f > 5)}")
        print(f"  {admissions(total, ('free', 'pro'), args.seconds)}")
        samples, total = phase(server.url, ("free",), args.seconds, args.threads)
        print(f"phase 3: free alone ({len(samples)} samples): max free {max(s[1] for s in samples)}, "
              f"samples with all {LIMIT} held {sum(1 for s in samples if s[1] == LIMIT)}")
        print(f"  {admissions(total, ('free',), args.seconds)}")


if __name__ == "__main__":
    main()
