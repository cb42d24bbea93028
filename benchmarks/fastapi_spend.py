#!/usr/bin/env python3
"""What money budgets cost a TokenRateLimit request, side by side in one run.

    .venv/bin/python benchmarks/fastapi_spend.py [--rounds N] [--seconds S]

It starts its own redis-server on a free loopback port and drives a FastAPI app in this
process (the ASGI callable itself, no HTTP server), one request at a time, with an
AsyncRateLimiter on one event loop. Each request is a chat completion whose JSON answer
reports its usage, so each allowed request is reserved, then reconciled (and, with prices,
held, then settled). Contenders, in rotating order, each for S seconds (or 5,000 requests):

  tokens, no prices (baseline)   TokenRateLimit(): reserve + reconcile (2 scripts)
  prices, key budget             + prices and one daily budget: + hold + settle (4 scripts)
  prices, 4 levels               + org, team and user levels: 4 budgets in the hold and settle
  prices, refused by budget      a budget spent: reserve + hold (refused) + 2 refunds, the 429

and prints the medians over the rounds of requests/s and p50 latency, with the ratio to the
baseline of the same round. Quote ratios: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastapi import Depends, FastAPI  # noqa: E402

from benchlib import RedisTarget, load_average, print_ratio_table, round_order  # noqa: E402
from genai_ratelimit import AsyncRateLimiter, PriceTable  # noqa: E402
from genai_ratelimit.fastapi import (  # noqa: E402
    RateLimitHeadersMiddleware,
    SpendLevel,
    TokenRateLimit,
)

BIG = {"free": {"per_minute": 10**12, "per_day": 10**12}}
PRICES = PriceTable.from_mapping({"version": "bench", "currency": "USD",
                                  "models": {"m": {"input": 2_500_000, "output": 10_000_000}}})
BODY = json.dumps({"model": "m", "max_tokens": 100,
                   "messages": [{"role": "user", "content": "hello there"}]}).encode()


def build(dependency: TokenRateLimit) -> FastAPI:
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)

    @app.post("/v1/chat/completions", dependencies=[Depends(dependency)])
    async def chat() -> dict[str, Any]:
        return {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 40,
                                         "total_tokens": 43}}

    return app


async def call(app: FastAPI) -> int:
    """One POST through the ASGI callable; returns the status."""
    status = 0

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": BODY, "more_body": False}

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


def levels() -> list[SpendLevel]:
    return [SpendLevel(level, owner_of=lambda request, level=level: f"{level}-1",  # type: ignore[misc]
                       budgets={"monthly_usd": 10**9}) for level in ("org", "team", "user")]


async def run(url: str, rounds: int, seconds: float) -> dict[str, list[tuple[float, float]]]:
    limiter = AsyncRateLimiter(url)

    def dependency(namespace: str, **options: Any) -> TokenRateLimit:
        return TokenRateLimit(limiter, BIG, namespace=namespace, token_limits=BIG, **options)

    contenders: dict[str, tuple[FastAPI, int]] = {
        "tokens, no prices (baseline)": (build(dependency("a")), 200),
        "prices, key budget": (build(dependency(
            "b", prices=PRICES, spend_limits={"free": {"daily_usd": 10**9}})), 200),
        "prices, 4 levels": (build(dependency(
            "c", prices=PRICES, spend_limits={"free": {"daily_usd": 10**9}},
            spend_levels=levels())), 200),
        "prices, refused by budget": (build(dependency(
            "d", prices=PRICES, spend_limits={"free": {"daily_usd": "0.0011"}})), 429),
    }
    await call(contenders["prices, refused by budget"][0])  # spends that budget
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
    logging.getLogger("genai_ratelimit").setLevel(logging.ERROR)
    target = RedisTarget.start_own()
    try:
        rows = asyncio.run(run(target.url, args.rounds, args.seconds))
    finally:
        target.close()
    print(f"FastAPI app in process (ASGI callable), AsyncRateLimiter on loopback Redis (own "
          f"server), one request at a time; {args.rounds} rounds of {args.seconds} s per contender; "
          f"{load_average()}. Medians over rounds; ratios per round to the baseline, then the "
          "median.\n")
    print_ratio_table(rows, "tokens, no prices (baseline)", [("requests/s", ",.0f"), ("p50 µs", ".0f")],
                      [(0, "requests/s vs baseline"), (1, "p50 vs baseline")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
