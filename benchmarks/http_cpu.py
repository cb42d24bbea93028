#!/usr/bin/env python3
"""The FastAPI layer's own CPU per request: a limited route against the same route unlimited.

    .venv/bin/python benchmarks/http_cpu.py [--rounds N] [--requests R]

It starts its own redis-server on a free loopback port and drives FastAPI apps in this process
(the ASGI callable itself: no HTTP server, no client library), one request at a time on one
event loop with an AsyncRateLimiter. What is measured is this process's CPU time per request
(`time.process_time_ns`: user + system of every thread here; Redis's own work is in another
process and is not counted), so a loaded machine changes the figures less than wall time would.
Contenders, in rotating order, each for R requests per round after 200 warm-up ones:

  unlimited (baseline)        the same handler behind RateLimitHeadersMiddleware, no dependency
  no-op Depends (reference)   an async dependency taking (request, response) that does nothing:
                              FastAPI's own price of a dependency
  limiter call alone          `await limiter.check_windows_detailed(...)` in a loop, no HTTP: the
                              Redis round trip's CPU on this side (the floor under any route)
  minute+day, zset            Depends(RateLimit(...)), a budget no run reaches: every request allowed
  minute+day, no I/O          the same on a limiter whose check_windows_detailed answers a decision
                              it keeps (made by Redis once, before the run) without a round trip:
                              the package's own Python in a route, without the noise of the I/O
  minute+day, compact         the same on AsyncRateLimiter(storage="compact")
  minute+day, 429             a budget of 1 a minute, spent: every request refused
  token route, capped         TokenRateLimit with max_in_flight and a model budget (reserve with
                              the slot and a scope; usage reported by the response, reconciled
                              and released by the middleware)

Medians over the rounds of µs of CPU per request, and per round the ratio to the baseline of
the same round, then the median. Quote ratios: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastapi import Depends, FastAPI, Request, Response  # noqa: E402

from benchlib import RedisTarget, load_average, print_ratio_table, round_order  # noqa: E402
from genai_ratelimit import AsyncRateLimiter  # noqa: E402
from genai_ratelimit.fastapi import RateLimit, RateLimitHeadersMiddleware, TokenRateLimit  # noqa: E402

BIG = {"free": {"per_minute": 10**12, "per_day": 10**12}}
BIG_TOKENS = {"free": {"per_minute": 10**12, "per_day": 10**12}}
SPENT = {"free": {"per_minute": 1, "per_day": 10**12}}
BODY = json.dumps({"model": "gpt-4o", "max_tokens": 50,
                   "messages": [{"role": "user", "content": "Hello there"}]}).encode()
REPLY = {"id": "c", "object": "chat.completion", "choices": [],
         "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}


def build(dependency: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(RateLimitHeadersMiddleware)
    dependencies = [] if dependency is None else [Depends(dependency)]

    @app.post("/v1/chat/completions", dependencies=dependencies)
    async def chat() -> dict[str, Any]:
        return REPLY

    return app


async def call(app: FastAPI) -> int:
    """One POST through the ASGI callable; returns the status."""
    status = 0
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)  # the client stays: no disconnect
        sent = True
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "client": ("203.0.113.7", 50000),
             "server": ("testserver", 80), "headers": [(b"content-type", b"application/json"),
                                                       (b"content-length", str(len(BODY)).encode())]}
    await app(scope, receive, send)
    return status


async def noop(request: Request, response: Response) -> None:
    """A dependency that does nothing, with the parameters RateLimit takes."""


async def cpu_per_call(limiter: AsyncRateLimiter, requests: int) -> tuple[float]:
    """µs of CPU per limiter call alone, after 200 warm-up ones."""
    windows = ((10**12, 60), (10**12, 86_400))
    for _ in range(200):
        await limiter.check_windows_detailed("alone", windows)
    start = time.process_time_ns()
    for _ in range(requests):
        await limiter.check_windows_detailed("alone", windows)
    return ((time.process_time_ns() - start) / requests / 1e3,)


async def cpu_per_request(app: FastAPI, expect: int, requests: int) -> tuple[float]:
    """µs of this process's CPU per request over `requests` requests, after 200 warm-up ones."""
    for _ in range(200):
        assert await call(app) == expect
    start = time.process_time_ns()
    for _ in range(requests):
        status = await call(app)
        assert status == expect, status
    return ((time.process_time_ns() - start) / requests / 1e3,)


async def run(url: str, rounds: int, requests: int) -> dict[str, list[tuple[float]]]:
    limiter = AsyncRateLimiter(url)
    compact = AsyncRateLimiter(url, storage="compact")
    in_memory = AsyncRateLimiter(url)
    kept = await in_memory.check_windows_detailed("kept", ((10**12, 60), (10**12, 86_400)))

    async def answer_kept(user_id: str, windows: Any, *, cost: int = 1) -> Any:
        return kept

    in_memory.check_windows_detailed = answer_kept  # type: ignore[method-assign]
    contenders: dict[str, tuple[FastAPI | None, int]] = {
        "unlimited (baseline)": (build(None), 200),
        "no-op Depends (reference)": (build(noop), 200),
        "limiter call alone": (None, 0),
        "minute+day, zset": (build(RateLimit(limiter, BIG, namespace="a")), 200),
        "minute+day, no I/O": (build(RateLimit(in_memory, BIG, namespace="e")), 200),
        "minute+day, compact": (build(RateLimit(compact, BIG, namespace="b")), 200),
        "minute+day, 429": (build(RateLimit(limiter, SPENT, namespace="c")), 429),
        "token route, capped": (build(TokenRateLimit(
            limiter, BIG, namespace="d", token_limits=BIG_TOKENS, max_in_flight={"free": 10**6},
            model_limits={"gpt-4o": {"per_minute": 10**12, "tokens_per_minute": 10**12}})), 200),
    }
    spent = contenders["minute+day, 429"][0]
    assert spent is not None
    await call(spent)  # spends the budget of 1
    rows: dict[str, list[tuple[float]]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_index in range(rounds):
        for name in round_order(names, round_index):
            app, expect = contenders[name]
            rows[name].append(await cpu_per_request(app, expect, requests) if app is not None
                              else await cpu_per_call(limiter, requests))
    await limiter.aclose()
    await compact.aclose()
    await in_memory.aclose()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=2_000)
    args = parser.parse_args()
    logging.getLogger("genai_ratelimit").setLevel(logging.ERROR)
    target = RedisTarget.start_own()
    try:
        rows = asyncio.run(run(target.url, args.rounds, args.requests))
    finally:
        target.close()
    print(f"FastAPI app in process (ASGI callable), AsyncRateLimiter on loopback Redis (own "
          f"server), one request at a time; {args.rounds} rounds of {args.requests} requests per "
          f"contender; {load_average()}. This process's CPU per request (Redis not counted); "
          "medians over rounds; ratios per round to the baseline, then the median.\n")
    print_ratio_table(rows, "unlimited (baseline)", [("CPU µs/request", ",.1f")],
                      [(0, "vs unlimited")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
