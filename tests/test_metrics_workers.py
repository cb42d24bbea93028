"""Metrics of an app served by several uvicorn workers (processes): every worker's
PrometheusCollector writes its counters to one directory, and a scrape of whichever worker
answers GET /metrics sums them all. Real uvicorn with 4 workers, real Redis, real HTTP, a
worker killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from helpers_uvicorn import HTTPX_SOCKETS, UvicornServer

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    HTTPX_SOCKETS,
    pytest.mark.not_asan(reason="its limiters run in worker processes of their own"),
    pytest.mark.no_hiredis1(reason="its limiters run in worker processes of their own"),
]

WORKERS = 4
REQUESTS = 240

APP = '''
import os

from fastapi import Depends, FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from genai_ratelimit import AsyncRateLimiter
from genai_ratelimit.fastapi import RateLimit
from genai_ratelimit.metrics import PrometheusCollector

limiter = AsyncRateLimiter(os.environ["REDIS_URL"])
rate_limit = RateLimit(limiter=limiter, namespace="workers",
                       tier_limits={"free": {"per_minute": 1_000_000, "per_day": 1_000_000}})
registry = CollectorRegistry()
registry.register(PrometheusCollector({"api": limiter}, directory=os.environ["METRICS_DIR"],
                                      interval=0.2))
app = FastAPI()


@app.get("/v1/work", dependencies=[Depends(rate_limit)])
async def work() -> dict[str, int]:
    return {"pid": os.getpid()}


@app.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}
'''

ALLOWED = 'genai_ratelimit_decisions_total{limiter="api",outcome="allowed"}'
ROUND_TRIPS = 'genai_ratelimit_redis_latency_seconds_count{limiter="api",op="check_windows_detailed"}'


@pytest.fixture
def served(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> Iterator[tuple[UvicornServer, Path]]:
    directory = tmp_path / "metrics"
    directory.mkdir()
    server = UvicornServer(APP, {"REDIS_URL": redis_url, "METRICS_DIR": str(directory)},
                           workers=WORKERS)
    server.start()
    try:
        yield server, directory
    finally:
        server.close()


# A new connection for every request (no keep-alive), so that any worker may take it.
FRESH = httpx.Limits(max_keepalive_connections=0)


def scrape(base_url: str) -> dict[str, float]:
    """One GET /metrics on a fresh connection (so any worker may answer)."""
    with httpx.Client(limits=FRESH, timeout=10.0) as client:
        response = client.get(base_url + "/metrics")
    assert response.status_code == 200
    samples = {}
    for line in response.text.splitlines():
        if line.startswith("genai_ratelimit_"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def scraped_until(base_url: str, expected: float, timeout: float = 20.0) -> list[float]:
    """Scrapes until the allowed total equals `expected` (each worker writes its file every
    0.2 s): the totals seen on the way, which never exceed it."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen.append(scrape(base_url).get(ALLOWED, 0.0))
        if seen[-1] >= expected:
            break
        time.sleep(0.1)  # polling for the workers' next write, bounded by the deadline
    return seen


def send(client: httpx.Client) -> int:
    response = client.get("/v1/work")
    assert response.status_code == 200, response.text
    return int(response.json()["pid"])


def test_the_scrape_of_any_worker_sums_every_worker(served: tuple[UvicornServer, Path]) -> None:
    server, directory = served
    client = httpx.Client(base_url=server.base_url, limits=FRESH, timeout=10.0)
    with client, ThreadPoolExecutor(8) as pool:
        pids = list(pool.map(lambda _: send(client), range(REQUESTS)))
    served_by = {pid: pids.count(pid) for pid in set(pids)}
    assert len(served_by) >= 2, f"the requests all went to one worker: {served_by}"

    seen = scraped_until(server.base_url, REQUESTS)
    assert seen[-1] == REQUESTS and max(seen) == REQUESTS, seen
    # Whichever worker answers, the same totals: ask a few times on fresh connections.
    totals = [scrape(server.base_url) for _ in range(8)]
    assert {t[ALLOWED] for t in totals} == {REQUESTS}
    assert {t[ROUND_TRIPS] for t in totals} == {REQUESTS}
    files = {json.loads(p.read_text())["pid"]: p for p in directory.glob("genai-ratelimit-*.json")}
    assert set(served_by) <= set(files) and len(files) >= WORKERS
    per_worker = {pid: json.loads(files[pid].read_text())["limiters"]["api"]["allowed"]
                  for pid in served_by}
    assert per_worker == served_by

    # A worker killed without a chance to clean up: what it counted is still in the totals.
    victim = max(served_by, key=lambda pid: served_by[pid])
    os.kill(victim, signal.SIGKILL)
    with httpx.Client(base_url=server.base_url, limits=FRESH, timeout=10.0) as client:
        for _ in range(20):
            send(client)  # the survivors (and a restarted worker) go on
    seen = scraped_until(server.base_url, REQUESTS + 20)
    assert seen[-1] == REQUESTS + 20, seen
