"""Caps that follow the provider (issue 34 item 1, docs/upstreams.md): how many 429s the
provider answers, with and without the gateway handing it the provider's headers.

    .venv/bin/python benchmarks/provider_follow.py [--requests 300] [--clients 30]
        [--latency-ms 100] [--families openai,anthropic] [--modes off,observe,probe]
        [--probe 1] [--max-wait 0]

- the provider: a real HTTP server in a process of its own (uvicorn), with a hidden limit of
  20 requests per 60 s (a sliding log); it answers 200 with its family's headers (OpenAI:
  `x-ratelimit-{limit,remaining,reset}-requests`, the reset a Go duration until the limit is
  back to its initial state; Anthropic: `anthropic-ratelimit-requests-*`, the reset an RFC
  3339 time) after `--latency-ms`, and 429 with `retry-after` (until its oldest request
  leaves) once the limit is reached; GET /report counts what it answered.
- the gateway: two processes, `--clients` threads between them, each thread sending its
  share of `--requests` one after the other: `reserve` through a shared cap the operator
  typed as 100 per minute (a `RateLimiter` on one redis-server), then, when admitted, the
  request to the provider; with the feature, `observe_upstream(...)` with its answer (the
  one line a route that does not use forward_to_upstream adds).
- modes: `off` (no observation), `observe` (observe_upstream, the cap without a probe: a
  cold burst is sent before any answer), `probe` (observe_upstream and
  `Scope(..., probe=--probe)`: until the first answer is observed the cap admits the probe
  only). `--max-wait S`: a request the cap refuses waits up to S seconds in its wait queue
  (`reserve(..., max_wait=S)`) instead of being dropped.

Prints, per header family and mode, the provider's 200s and 429s and the gateway's own
refusals (which never reach the provider)."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from genai_ratelimit import RateLimiter, Scope
from genai_ratelimit.testing import ThrowawayRedis

HIDDEN_LIMIT, HIDDEN_WINDOW_S, TYPED_CAP = 20, 60, 100
UPSTREAM = "provider/model"

PROVIDER = textwrap.dedent('''
    import asyncio, json, math, os, time
    from collections import deque
    from datetime import datetime, timezone

    LIMIT, WINDOW = int(os.environ["HIDDEN_LIMIT"]), float(os.environ["HIDDEN_WINDOW_S"])
    FAMILY, LATENCY = os.environ["FAMILY"], float(os.environ["LATENCY_MS"]) / 1000
    log, counts = deque(), {"200": 0, "429": 0}

    def duration(seconds):
        ms = max(0, math.ceil(seconds * 1000))
        minutes, rest = divmod(ms, 60000)
        return f"{minutes}m{rest / 1000:g}s" if minutes else f"{rest / 1000:g}s"

    def headers(now):
        remaining = LIMIT - len(log)
        full_in = (log[-1] + WINDOW - now) if log else 0.0  # back to its initial state
        if FAMILY == "openai":
            return [(b"x-ratelimit-limit-requests", str(LIMIT).encode()),
                    (b"x-ratelimit-remaining-requests", str(remaining).encode()),
                    (b"x-ratelimit-reset-requests", duration(full_in).encode())]
        reset = datetime.fromtimestamp(math.ceil(now + full_in), timezone.utc)
        return [(b"anthropic-ratelimit-requests-limit", str(LIMIT).encode()),
                (b"anthropic-ratelimit-requests-remaining", str(remaining).encode()),
                (b"anthropic-ratelimit-requests-reset", reset.isoformat().encode())]

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        if scope["path"] == "/report":
            body, status, extra = json.dumps(counts).encode(), 200, []
        else:
            now = time.time()
            while log and log[0] <= now - WINDOW:
                log.popleft()
            if len(log) >= LIMIT:
                wait = math.ceil(log[0] + WINDOW - now)
                counts["429"] += 1
                status, extra = 429, [(b"retry-after", str(max(1, wait)).encode()), *headers(now)]
            else:
                log.append(now)
                counts["200"] += 1
                await asyncio.sleep(LATENCY)
                status, extra = 200, headers(time.time())
            body = b"{}"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), *extra]})
        await send({"type": "http.response.body", "body": body})
''')


def start_provider(family: str, latency_ms: float, window_s: float, port: int, workdir: Path
                   ) -> subprocess.Popen[bytes]:
    (workdir / "provider_app.py").write_text(PROVIDER, encoding="utf-8")
    env = {**os.environ, "HIDDEN_LIMIT": str(HIDDEN_LIMIT), "HIDDEN_WINDOW_S": str(window_s),
           "FAMILY": family, "LATENCY_MS": str(latency_ms)}
    process = subprocess.Popen([sys.executable, "-m", "uvicorn", "provider_app:app", "--port",
                                str(port), "--log-level", "warning", "--no-access-log"],
                               cwd=workdir, env=env)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/report", timeout=0.5)
            return process
        except httpx.TransportError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("the fake provider did not start")


def gateway(redis_url: str, base_url: str, threads: int, per_thread: int, mode: str,
            start_at: float, spread_s: float, offset: int, results: Any, probe: int,
            max_wait: float) -> None:
    """One gateway process: `threads` clients, each sending `per_thread` requests, the
    clients' requests spread evenly over `spread_s` seconds (0: each as soon as it can)."""
    limiter = RateLimiter(redis_url)
    follow = mode != "off"
    cap = Scope(UPSTREAM, windows=[(TYPED_CAP, 60)], shared=True,
                probe=probe if mode == "probe" else 0)
    waiting = {"max_wait": max_wait} if max_wait else {}
    counts = {"gateway_429": 0, "sent": 0}
    lock = threading.Lock()

    def client(number: int) -> None:
        with httpx.Client(base_url=base_url, timeout=30) as http:
            while time.time() < start_at:
                time.sleep(0.001)
            step = spread_s / per_thread
            for i in range(per_thread):
                due = start_at + i * step + (offset + number) * step / (2 * threads)
                while spread_s and time.time() < due:
                    time.sleep(min(0.01, max(0.0, due - time.time())))
                reservation = limiter.reserve(f"tenant-{os.getpid()}-{number}", [(1000, 60)],
                                              scopes=[cap], **waiting)
                if not reservation.allowed:
                    with lock:
                        counts["gateway_429"] += 1
                    continue
                answer = http.post("/v1/chat/completions", json={"n": i})
                with lock:
                    counts["sent"] += 1
                if follow:
                    limiter.observe_upstream(UPSTREAM, answer.status_code, answer.headers)

    workers = [threading.Thread(target=client, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    limiter.close()
    results.put(counts)


def scenario(redis_url: str, family: str, mode: str, requests: int, clients: int,
             latency_ms: float, window_s: float, spread_s: float, port: int, workdir: Path,
             probe: int, max_wait: float) -> dict[str, Any]:
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    provider = start_provider(family, latency_ms, window_s, port, workdir)
    try:
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        start_at = time.time() + 1.5
        per_process = clients // 2
        processes = [context.Process(target=gateway, args=(
            redis_url, f"http://127.0.0.1:{port}", per_process, requests // clients, mode,
            start_at, spread_s, index * per_process, results, probe, max_wait))
            for index in range(2)]
        for process in processes:
            process.start()
        totals = {"gateway_429": 0, "sent": 0}
        for _ in processes:
            for key, value in results.get(timeout=600).items():
                totals[key] += value
        for process in processes:
            process.join()
        seconds = time.time() - start_at
        report = httpx.get(f"http://127.0.0.1:{port}/report").json()
    finally:
        provider.terminate()
        provider.wait()
    return {"family": family, "mode": mode, "provider_200": report["200"],
            "provider_429": report["429"], "gateway_429": totals["gateway_429"],
            "sent": totals["sent"], "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--clients", type=int, default=30)
    parser.add_argument("--latency-ms", type=float, default=100.0)
    parser.add_argument("--families", default="openai,anthropic")
    parser.add_argument("--window-s", type=float, default=HIDDEN_WINDOW_S,
                        help="the provider's hidden window (its limit: 20 per window)")
    parser.add_argument("--spread-s", type=float, default=0.0,
                        help="spread the requests evenly over this many seconds (0: a burst)")
    parser.add_argument("--modes", default="off,observe,probe")
    parser.add_argument("--probe", type=int, default=1, help="the probe of mode `probe`")
    parser.add_argument("--max-wait", type=float, default=0.0,
                        help="a refused request waits up to this many seconds (0: dropped)")
    args = parser.parse_args()
    import tempfile

    from benchlib import free_port

    rows = []
    with ThrowawayRedis() as server, tempfile.TemporaryDirectory() as workdir:
        for family in args.families.split(","):
            for mode in args.modes.split(","):
                rows.append(scenario(server.url, family, mode, args.requests, args.clients,
                                     args.latency_ms, args.window_s, args.spread_s, free_port(),
                                     Path(workdir), args.probe, args.max_wait))
    print(f"\nhidden provider limit {HIDDEN_LIMIT} per {args.window_s:g} s, typed cap {TYPED_CAP} "
          f"per minute, {args.requests} requests from {args.clients} clients in 2 gateway "
          f"processes ({'a burst' if not args.spread_s else f'spread over {args.spread_s:g} s'}), "
          f"provider latency {args.latency_ms:g} ms, probe {args.probe}, max_wait "
          f"{args.max_wait:g} s\n")
    print("| headers | mode | provider 200 | provider 429 | gateway 429 (never sent) | seconds |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['family']} | {row['mode']} | {row['provider_200']} | "
              f"{row['provider_429']} | {row['gateway_429']} | {row['seconds']:.1f} |")


if __name__ == "__main__":
    main()
