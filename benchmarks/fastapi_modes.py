#!/usr/bin/env python3
"""What shadow mode and the IETF headers cost per request, side by side in one run.

    .venv/bin/python benchmarks/fastapi_modes.py [--rounds N] [--seconds S]

It starts its own redis-server on a free loopback port and drives a FastAPI app in this
process (the ASGI callable itself, no HTTP server, no client library: what is measured is
the middleware, FastAPI and the dependency), one request at a time, with an AsyncRateLimiter
on one event loop. Contenders, in rotating order, each for S seconds (or 5,000 requests):

  contract, allowed (baseline)   RateLimit(), a budget no run reaches: every request allowed
  ietf, allowed                  the same with headers="ietf" (HMAC partition key, two fields)
  shadow, allowed                mode="shadow": the allowed path, which shadow mode leaves as is
  contract, 429                  a budget of 1 a minute, spent: every request refused
  ietf, 429                      the same with headers="ietf"
  shadow, would-refuse           that budget in mode="shadow": every request let through

and prints the medians over the rounds of requests/s and p50 latency, with the ratio to the
baseline of the same round. Quote ratios: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastapi import Depends, FastAPI  # noqa: E402

from benchlib import RedisTarget, load_average, print_ratio_table, round_order  # noqa: E402
from genai_ratelimit import AsyncRateLimiter  # noqa: E402
from genai_ratelimit.fastapi import RateLimit, RateLimitHeadersMiddleware  # noqa: E402

BIG = {"free": {"per_minute": 10**12, "per_day": 10**12}}
SPENT = {"free": {"per_minute": 1, "per_day": 10**12}}


def build(dependency: RateLimit) -> FastAPI:
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)

    @app.post("/v1/chat/completions", dependencies=[Depends(dependency)])
    async def chat() -> dict[str, Any]:
        return {"choices": []}

    return app


async def call(app: FastAPI) -> int:
    """One POST through the ASGI callable; returns the status."""
    status = 0

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "client": ("203.0.113.7", 50000),
             "server": ("testserver", 80), "headers": [(b"content-type", b"application/json")]}
    await app(scope, receive, send)
    return status


async def timed(app: FastAPI, expect: int, seconds: float) -> tuple[float, float]:
    """(requests/s, p50 µs) over `seconds` or 5,000 requests, after 100 warm-up ones."""
    for _ in range(100):
        assert await call(app) == expect
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(latencies) < 5_000:
        start = time.perf_counter_ns()
        status = await call(app)
        latencies.append((time.perf_counter_ns() - start) / 1e3)
        assert status == expect, status
    return 1e6 / statistics.mean(latencies), statistics.median(latencies)


async def run(url: str, rounds: int, seconds: float) -> dict[str, list[tuple[float, float]]]:
    limiter = AsyncRateLimiter(url)
    secret = "bench"
    contenders: dict[str, tuple[FastAPI, int]] = {
        "contract, allowed (baseline)": (build(RateLimit(limiter, BIG, namespace="a")), 200),
        "ietf, allowed": (build(RateLimit(limiter, BIG, namespace="b", headers="ietf",
                                          partition_key_secret=secret)), 200),
        "shadow, allowed": (build(RateLimit(limiter, BIG, namespace="c", mode="shadow")), 200),
        "contract, 429": (build(RateLimit(limiter, SPENT, namespace="d")), 429),
        "ietf, 429": (build(RateLimit(limiter, SPENT, namespace="e", headers="ietf",
                                      partition_key_secret=secret)), 429),
        "shadow, would-refuse": (build(RateLimit(limiter, SPENT, namespace="f", mode="shadow",
                                                 shadow_log_interval=3600)), 200),
    }
    for name, (app, expect) in contenders.items():
        if expect == 429 or "would-refuse" in name:
            await call(app)  # spends the budget of 1
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_index in range(rounds):
        for name in round_order(names, round_index):
            app, expect = contenders[name]
            rows[name].append(await timed(app, expect, seconds))
    await limiter.aclose()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    logging.getLogger("genai_ratelimit").setLevel(logging.ERROR)  # the shadow warning, once
    target = RedisTarget.start_own()
    try:
        rows = asyncio.run(run(target.url, args.rounds, args.seconds))
    finally:
        target.close()
    print(f"FastAPI app in process (ASGI callable), AsyncRateLimiter on loopback Redis (own "
          f"server), one request at a time; {args.rounds} rounds of {args.seconds} s per contender; "
          f"{load_average()}. Medians over rounds; ratios per round to the baseline, then the "
          "median.\n")
    print_ratio_table(rows, "contract, allowed (baseline)", [("requests/s", ",.0f"), ("p50 µs", ".0f")],
                      [(0, "requests/s vs baseline"), (1, "p50 vs baseline")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
