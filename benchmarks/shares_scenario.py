"""Reserved shares under load (issue 34 item 2, docs/upstreams.md "Reserved shares"): three
tiers hammering one shared cap of 10 requests per second from two processes.

    .venv/bin/python benchmarks/shares_scenario.py [--seconds 6] [--threads 3]
        [--storage zset|compact]

- the cap: Scope("provider", windows=[(10, 1)], shared=True, reserved={"enterprise": 30},
  ceilings={"free": (50, 80)}): enterprise keeps 3 of 10, free at most 5 once the cap is
  above 8; pro has no share (reserved 0: tracked, no reserve).
- the gateway: two processes, each `--threads` threads per tier, each thread reserving in a
  loop (a user of its own per request, so only the cap decides).
- the sampler (this process): every millisecond or so, one Lua script reads, at the server's
  time, each class's live use (its class log's entries in the last second) and the cap's.

Phase 1, every tier hammering: at every sample the classes other than enterprise hold at
most 10 - max(enterprise, 3) (enterprise's reserve kept), and free holds at most 5 whenever
the cap is above 8 once its first window has passed (before it, free may have come in
below the saturation level). Phase 2, no enterprise traffic: the shares are work-conserving
(a reserve binds only while its class is active), so free and pro share all 10, free at
most 5 above 8 (pro is active); phase 3, free alone: the whole cap.
Prints the samples' counts and the admissions per tier."""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time
from collections import Counter
from typing import Any

import redis

from genai_ratelimit import RateLimiter, Scope
from genai_ratelimit.testing import ThrowawayRedis

CAP = "provider"
TIERS = ("enterprise", "free", "pro")
SAMPLE = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = redis.call('ZCOUNT', key, '(' .. (now_ms - 1000), '+inf')
end
return out
"""


def scope() -> Scope:
    return Scope(CAP, windows=[(10, 1)], shared=True, reserved={"enterprise": 30, "pro": 0},
                 ceilings={"free": (50, 80)})


def gateway(url: str, storage: str, tiers: tuple[str, ...], threads: int, start: float,
            until: float, counts: Any) -> None:
    limiter = RateLimiter(url, storage=storage)
    time.sleep(max(0.0, start - time.time()))
    cap = scope()
    local: Counter[str] = Counter()
    lock = threading.Lock()

    def hammer(tier: str, n: int) -> None:
        i = 0
        while time.time() < until:
            i += 1
            r = limiter.reserve(f"{tier}-{n}-{i}-{time.time_ns()}", [(1000, 60)], scopes=[cap],
                                scope_class=tier)
            with lock:
                local[(tier, r.allowed, r.share_refusal.rule if r.share_refusal else "")] += 1

    workers = [threading.Thread(target=hammer, args=(t, n)) for t in tiers for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    limiter.close()
    counts.put(dict(local))


def phase(url: str, storage: str, tiers: tuple[str, ...], seconds: float, threads: int
          ) -> tuple[list[list[int]], Counter[Any], float]:
    client = redis.Redis.from_url(url)
    client.flushdb()
    suffix = ":c" if storage == "compact" else ""
    keys = [f"ratelimit:{CAP}:1:shared{suffix}:class={t}" for t in TIERS]
    context = multiprocessing.get_context("spawn")
    counts = context.Queue()
    start = time.time() + 2.0  # the processes' start-up
    until = start + seconds
    processes = [context.Process(target=gateway,
                                 args=(url, storage, tiers, threads, start, until, counts))
                 for _ in range(2)]
    for p in processes:
        p.start()
    samples: list[list[int]] = []
    while time.time() < start:
        time.sleep(0.01)
    while time.time() < until:
        samples.append([*client.eval(SAMPLE, len(keys), *keys), time.time() - start])
    total: Counter[Any] = Counter()
    for _ in processes:
        total.update(counts.get())
    for p in processes:
        p.join()
    client.close()
    return samples, total, start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("--storage", default="zset", choices=("zset", "compact"))
    args = parser.parse_args()
    with ThrowawayRedis() as server:
        url = server.url
        samples, total, _ = phase(url, args.storage, TIERS, args.seconds, args.threads)
        print(f"phase 1: 3 tiers x {args.threads} threads x 2 processes, {args.seconds:g} s, "
              f"cap 10/s, storage {args.storage}: {len(samples)} samples")
        reserve_broken = sum(1 for e, f, p, _ in samples if f + p > 10 - max(e, 3))
        saturated = [(e, f, p) for e, f, p, t in samples if e + f + p > 8 and t > 1.0]
        ceiling_broken = sum(1 for e, f, p in saturated if f > 5)
        held = sum(1 for e, f, p, _ in samples if e >= 3)
        print(f"  samples with free + pro > 10 - max(enterprise, 3): {reserve_broken}")
        print(f"  samples after the first second with the cap above 8: {len(saturated)}, "
              f"of which free above 5: {ceiling_broken}")
        print(f"  samples with enterprise using >= 3 itself: {held} of {len(samples)}; "
              f"min/max enterprise {min(s[0] for s in samples)}/{max(s[0] for s in samples)}, "
              f"free {min(s[1] for s in samples)}/{max(s[1] for s in samples)}, "
              f"pro {min(s[2] for s in samples)}/{max(s[2] for s in samples)}")
        for tier in TIERS:
            allowed = total[(tier, True, "")]
            print(f"  {tier}: {allowed} admitted ({allowed / args.seconds:.1f}/s), refused "
                  f"{total[(tier, False, '')]} by the cap, "
                  f"{total[(tier, False, 'reserve')]} by a reserve, "
                  f"{total[(tier, False, 'ceiling')]} by the ceiling")
        samples, total, _ = phase(url, args.storage, ("free", "pro"), args.seconds, args.threads)
        print(f"phase 2: no enterprise traffic ({len(samples)} samples)")
        print(f"  max free + pro: {max(f + p for _, f, p, _ in samples)} (no reserve binds), "
              f"max free {max(f for _, f, _, _ in samples)}, "
              f"samples above 7: {sum(1 for _, f, p, _ in samples if f + p > 7)}, "
              f"after the first second with the cap above 8 and free above 5: "
              f"{sum(1 for _, f, p, t in samples if f + p > 8 and f > 5 and t > 1.0)}")
        for tier in ("free", "pro"):
            allowed = total[(tier, True, "")]
            print(f"  {tier}: {allowed} admitted ({allowed / args.seconds:.1f}/s), "
                  f"{total[(tier, False, 'reserve')]} refused by enterprise's reserve, "
                  f"{total[(tier, False, 'ceiling')]} by the ceiling")
        samples, total, _ = phase(url, args.storage, ("free",), args.seconds, args.threads)
        print(f"phase 3: free alone: max free {max(f for _, f, _, _ in samples)}, admitted "
              f"{total[('free', True, '')] / args.seconds:.1f}/s")


if __name__ == "__main__":
    main()
