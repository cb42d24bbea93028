#!/usr/bin/env python3
"""Draws docs/metrics-dashboard.png from a real run: what a dashboard fed by the limiter's
metrics shows over a burst, a Redis stall and the recovery.

    make metrics-dashboard            (installs the bench extra, matplotlib included)
    .venv/bin/python benchmarks/metrics_dashboard.py [--out docs/metrics-dashboard.png]

It starts its own redis-server on a free loopback port and drives one blocking RateLimiter
(the free tier's windows, 5 a minute and 100 a day, for 8,000 users) from client threads:

  0 - 3 s    a trickle: 4 threads, each pausing 20 ms between checks
  3 - 7 s    a burst: 40 threads, no pause (most users run out of their minute budget)
  7 - 8 s    Redis stalls (SIGSTOP): checks time out (socket_timeout 0.2 s): unavailable
  8 - 11 s   Redis is back (SIGCONT): the trickle again

Every 100 ms it reads `limiter.metrics()` (the same counters /metrics exports) and plots the
rates of change: decisions per second by outcome (refusals by window), connection errors, and
the Redis round-trip latency (p50 and p99 estimated from the histogram's buckets).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import RedisTarget  # noqa: E402
from genai_ratelimit import RateLimiter, RateLimiterError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WINDOWS = [(5, 60), (100, 86400)]
USERS = [f"user_{n}" for n in range(8000)]
PHASES = [(0.0, "trickle"), (3.0, "burst"), (7.0, "stall"), (8.0, "trickle"), (11.0, "end")]
SAMPLE_S = 0.1


def quantile(buckets: list[tuple[float | None, int]], q: float) -> float | None:
    """The upper bound of the bucket holding the q-quantile of an interval's round trips."""
    total = sum(n for _, n in buckets)
    if total == 0:
        return None
    seen = 0
    for bound, n in buckets:
        seen += n
        if seen >= q * total:
            return bound if bound is not None else 10.0
    return None


def drive(limiter: RateLimiter, stop: threading.Event, phase: list[str], index: int) -> None:
    n = index * 200  # each thread walks users of its own, in turn
    while not stop.is_set():
        current = phase[0]
        active = 40 if current in ("burst", "stall") else 4
        if index >= active:
            time.sleep(0.02)
            continue
        try:
            limiter.check_windows(USERS[n % len(USERS)], WINDOWS)
        except RateLimiterError:
            pass
        n += 1
        if current != "burst":
            time.sleep(0.02)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "metrics-dashboard.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = RedisTarget.start_own()
    samples: list[tuple[float, Any]] = []
    try:
        assert target.process is not None
        limiter = RateLimiter(target.url, socket_timeout=0.2, connect_timeout=0.2,
                              max_connections=40)
        stop = threading.Event()
        phase = ["trickle"]
        threads = [threading.Thread(target=drive, args=(limiter, stop, phase, i), daemon=True)
                   for i in range(40)]
        start = time.monotonic()
        for t in threads:
            t.start()
        stopped = False
        while True:
            now = time.monotonic() - start
            current = [name for at, name in PHASES if now >= at][-1]
            if current == "end":
                break
            phase[0] = current
            if current == "stall" and not stopped:
                os.kill(target.process.pid, signal.SIGSTOP)
                stopped = True
            if current == "trickle" and stopped:
                os.kill(target.process.pid, signal.SIGCONT)
                stopped = False
            samples.append((now, limiter.metrics()))
            time.sleep(SAMPLE_S - (time.monotonic() - start - now) % SAMPLE_S)
        stop.set()
        for t in threads:
            t.join(5)
        limiter.close()
    finally:
        if target.process is not None:
            os.kill(target.process.pid, signal.SIGCONT)
        target.close()

    times, rates = [], {"allowed": [], "refused, 60 s window": [], "refused, 86400 s window": [],
                        "unavailable": [], "connection errors": []}
    p50, p99 = [], []
    for (t0, a), (t1, b) in zip(samples, samples[1:], strict=False):
        dt = t1 - t0
        times.append(t1)
        rates["allowed"].append((b["allowed"] - a["allowed"]) / dt)
        for window in ("60", "86400"):
            before = a["rejected_by_window"].get(window, 0)
            rates[f"refused, {window} s window"].append(
                (b["rejected_by_window"].get(window, 0) - before) / dt)
        rates["unavailable"].append((b["unavailable"] - a["unavailable"]) / dt)
        rates["connection errors"].append((b["connection_errors"] - a["connection_errors"]) / dt)
        interval = [(bound, nb - na) for (bound, nb), (_, na)
                    in zip(b["latency_buckets"], a["latency_buckets"], strict=True)]
        p50.append(quantile(interval, 0.5))
        p99.append(quantile(interval, 0.99))

    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 8.5), sharex=True)
    for name, color in [("allowed", "tab:green"), ("refused, 60 s window", "tab:orange"),
                        ("refused, 86400 s window", "tab:red"), ("unavailable", "tab:purple")]:
        top.plot(times, rates[name], label=name, color=color)
    top.set_yscale("symlog", linthresh=10)
    top.set_ylabel("decisions / s")
    top.set_title("genai-ratelimit: limiter.metrics() over a burst and a Redis stall (real run)")
    top.legend(loc="upper right", fontsize=8)
    middle.plot(times, rates["connection errors"], color="tab:brown", label="connection errors")
    middle.set_yscale("symlog", linthresh=10)
    middle.set_ylabel("errors / s")
    middle.legend(loc="upper right", fontsize=8)
    bottom.step(times, [v * 1e3 if v is not None else float("nan") for v in p50], where="post",
                label="p50 (bucket bound)", color="tab:blue")
    bottom.step(times, [v * 1e3 if v is not None else float("nan") for v in p99], where="post",
                label="p99 (bucket bound)", color="tab:gray")
    bottom.set_yscale("log")
    bottom.set_ylabel("Redis round trip, ms")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper right", fontsize=8)
    for ax in (top, middle, bottom):
        for at, _ in PHASES[1:-1]:
            ax.axvline(at, color="black", alpha=0.2, linestyle="--")
        ax.grid(alpha=0.3)
    for at, name in PHASES[:-1]:
        top.annotate(name, (at + 0.05, 0.92), xycoords=("data", "axes fraction"), fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    last = samples[-1][1]
    print(f"{args.out}: {len(samples)} samples; totals: allowed {last['allowed']}, rejected "
          f"{last['rejected_by_window']}, unavailable {last['unavailable']}, connection errors "
          f"{last['connection_errors']}, round trips {last['latency_count']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
