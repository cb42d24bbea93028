"""A real Prometheus (Debian's `prometheus` package) scraping a real gateway: the harness of
tests/test_dashboard.py and of benchmarks/dashboard_pictures.py (which draws docs/ pictures
from the same scrape).

- `PrometheusServer`: `prometheus` on a free loopback port, its own config (written as JSON,
  which YAML reads), TSDB in a temporary directory, the repository's rules file loaded; the
  HTTP API's instant and range queries; every wait bounded by a deadline.
- `GATEWAY_APP`: a FastAPI gateway under uvicorn (2 workers, the metrics directory): a
  TokenRateLimit with tiers, token budgets, in-flight caps and a shared upstream cap, a
  shadow-mode RateLimit (limiter "gateway"), and a fail-open RateLimit on a Redis of its own
  (limiter "embeddings": the test gives it a closed port, the pictures a Redis they stall).
- `Traffic`: the requests that give every dashboard panel something to show (allowed,
  refused by the minute window, by tokens, by the upstream cap and by concurrency, shadow
  would-refuse, fail-open), each counted as it is answered.
- `Dashboard`: dashboards/genai-ratelimit.json read back, its panels' PromQL with Grafana's
  variables replaced as Grafana would.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from helpers_uvicorn import UvicornServer
from redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "dashboards" / "genai-ratelimit.json"
RULES = ROOT / "dashboards" / "genai-ratelimit.rules.yml"
RULES_TEST = ROOT / "dashboards" / "genai-ratelimit.rules.test.yml"

SCRAPE_INTERVAL_S = 1


def binary(name: str) -> str:
    """The path of `prometheus` / `promtool`; a missing one fails (never skips) the test."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is missing: Debian's `prometheus` package has it (make test "
                           "installs it: scripts/ensure-debian-packages.sh prometheus)")
    return path


class PrometheusServer:
    """One `prometheus` process scraping `targets` every SCRAPE_INTERVAL_S, evaluating the
    rules files given at the same pace."""

    def __init__(self, targets: list[str], rule_files: Sequence[Path] = (), job: str = "gateway",
                 scrape_interval_s: float = SCRAPE_INTERVAL_S) -> None:
        self.binary = binary("prometheus")
        self.directory = Path(tempfile.mkdtemp(prefix="genai-ratelimit-prometheus-"))
        self.config = {
            "global": {"scrape_interval": f"{scrape_interval_s}s",
                       "evaluation_interval": f"{scrape_interval_s}s",
                       "scrape_timeout": f"{scrape_interval_s}s"},
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": [{"job_name": job, "metrics_path": "/metrics",
                                "static_configs": [{"targets": targets}]}],
        }
        self.config_path = self.directory / "prometheus.yml"
        self.config_path.write_text(json.dumps(self.config, indent=2), encoding="utf-8")
        self.log_path = self.directory / "prometheus.log"
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        """Starts it and waits (bounded) until /-/ready answers 200."""
        for _ in range(5):  # the free port may be taken before prometheus binds it
            self.port = free_port()
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    [self.binary, f"--config.file={self.config_path}",
                     f"--storage.tsdb.path={self.directory / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}",
                     "--log.level=warn", "--web.enable-lifecycle"],
                    cwd=self.directory, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    if httpx.get(self.base_url + "/-/ready", timeout=1.0).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)  # readiness polling, bounded by the deadline
            self.stop()
            if "address already in use" not in self.log().lower():
                break
        raise RuntimeError(f"prometheus did not start:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>: the `data` of a successful answer; raises on an error one."""
        response = httpx.get(f"{self.base_url}/api/v1/{path}", params=params, timeout=10.0)
        body = response.json()
        if body.get("status") != "success":
            raise PromQLError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one unlabelled sample) of `expr` now (or `at`)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                        step=f"{step}")
        return list(data["result"])

    def wait_for(self, expr: str, accept: Callable[[list[dict[str, Any]]], bool],
                 timeout: float = 30.0) -> list[dict[str, Any]]:
        """Queries `expr` until `accept(result)` holds or the deadline passes; the last
        result either way (the caller asserts on it, with the answer in the message)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if accept(result) or time.monotonic() >= deadline:
                return result
            time.sleep(0.25)  # the next scrape or rule evaluation, bounded by the deadline

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PromQLError(RuntimeError):
    """Prometheus refused a query (bad_data: a PromQL syntax or type error, ...)."""


# ------------------------------------------------------------------------------ the gateway

GATEWAY_APP = '''
import asyncio
import math
import os

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from genai_ratelimit import AsyncRateLimiter, Budget, PriceTable, Scope
from genai_ratelimit.fastapi import (RateLimit, RateLimitHeadersMiddleware, SpendLevel,
                                     TokenRateLimit, Upstream, record_usage)
from genai_ratelimit.metrics import PrometheusCollector

TIERS = {"free": {"per_minute": 5, "per_day": 1000},
         "pro": {"per_minute": 100, "per_day": 10000}}
TOKENS = {"free": {"per_minute": 3000, "per_day": 100000},
          "pro": {"per_minute": 500000, "per_day": 5000000}}


def identify(request: Request) -> tuple[str, str]:
    return request.headers["x-user"], request.headers.get("x-tier", "free")


TIMEOUT_S = float(os.environ["TIMEOUT_S"])
gateway = AsyncRateLimiter(os.environ["REDIS_URL"], connect_timeout=TIMEOUT_S,
                           socket_timeout=TIMEOUT_S)
embeddings = AsyncRateLimiter(os.environ["EMBEDDINGS_REDIS_URL"], connect_timeout=TIMEOUT_S,
                              socket_timeout=TIMEOUT_S)

chat = TokenRateLimit(limiter=gateway, tier_limits=TIERS, token_limits=TOKENS, identify=identify,
                      namespace="chat", max_in_flight={"free": 2, "pro": 20},
                      upstream=Upstream("openai/gpt-4o", per_minute=int(os.environ["UPSTREAM_RPM"]),
                                        models=("gpt-4o",)),
                      # Money beside the tokens: budgets no traffic exhausts, at two levels.
                      prices=PriceTable.from_mapping({
                          "version": "2026-12-05", "currency": "USD",
                          "models": {"gpt-4o": {"input": 2_500_000, "output": 10_000_000},
                                     "gpt-4o-mini": {"input": 150_000, "output": 600_000}}}),
                      spend_limits={"free": {"monthly_usd": 1000}, "pro": {"monthly_usd": 1000}},
                      spend_levels=[SpendLevel("org", owner_of=lambda request: "acme",
                                               budgets={"monthly_usd": 100_000})])
beta = RateLimit(limiter=gateway, identify=identify, namespace="beta", mode="shadow",
                 tier_limits={"free": {"per_minute": 2, "per_day": 1000},
                              "pro": {"per_minute": 2, "per_day": 1000}})
embed = RateLimit(limiter=embeddings, tier_limits=TIERS, identify=identify, namespace="embed",
                  on_unavailable="allow", unavailable_log_interval=3600)

registry = CollectorRegistry()
registry.register(PrometheusCollector({"gateway": gateway, "embeddings": embeddings},
                                      directory=os.environ["METRICS_DIR"], interval=0.2))
app = FastAPI()
app.add_middleware(RateLimitHeadersMiddleware)


@app.post("/v1/chat/completions", dependencies=[Depends(chat)])
async def chat_completions(request: Request) -> Response:
    body = await request.json()
    completion = max(1, body.get("max_tokens", 16) // 2)  # the model stops halfway: a refund
    prompt = math.ceil(sum(len(m["content"]) for m in body["messages"]) / 4)
    if not body.get("stream"):
        return JSONResponse({"object": "chat.completion", "choices": [],
                             "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                       "total_tokens": prompt + completion}})

    async def chunks():
        yield "data: {}\\n\\n"
        await asyncio.sleep(body.get("hold_s", 0))  # a long generation holds its slot
        await record_usage(request, prompt + completion)
        yield "data: [DONE]\\n\\n"

    return StreamingResponse(chunks(), media_type="text/event-stream")


@app.get("/v1/beta", dependencies=[Depends(beta)])
async def beta_route() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/v1/embeddings", dependencies=[Depends(embed)])
async def embeddings_route() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/v1/budget/{owner}")
async def budget_route(owner: str) -> dict[str, int]:
    # A key's calendar budget with a soft limit at 50 %: a hold of 60 % crosses it once.
    key = Budget(owner, "monthly_usd", 100, level="key", thresholds=(50,))
    hold = await gateway.hold_budgets(key, 60)
    return {"crossed": len(hold.crossed)}


@app.post("/v1/queue/{owner}")
async def queue_route(owner: str) -> dict[str, str]:
    # The wait queue of shared caps, on the limiter (its metrics are the limiter's): a cap of
    # 1 a second, full, lets a request with max_wait wait until its entry leaves, then admits
    # it; a cap of 1 in 2 s, full, refuses one with max_wait=0.5 at once (queue_timeout). The
    # same caps every round (seconds apart: empty again), so that their series have a rate.
    fast = Scope("queue:fast", windows=[(1, 1)], shared=True)
    slow = Scope("queue:slow", windows=[(1, 2)], shared=True)
    own = [(1000, 60)]
    outcomes = []
    for cap, max_wait in ((fast, 5.0), (slow, 0.5)):
        assert (await gateway.reserve(f"{owner}-filler", own, scopes=[cap])).allowed
        waited = await gateway.reserve(owner, own, scopes=[cap], max_wait=max_wait)
        outcomes.append(waited.queue_outcome)
    return {"fast": outcomes[0], "slow": outcomes[1]}


@app.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}
'''


class Gateway:
    """GATEWAY_APP under uvicorn (`workers` processes sharing one metrics directory)."""

    def __init__(self, redis_url: str, embeddings_redis_url: str, *, workers: int = 2,
                 upstream_rpm: int = 30, timeout_s: float = 0.5) -> None:
        self.metrics_dir = Path(tempfile.mkdtemp(prefix="genai-ratelimit-metrics-"))
        self.server = UvicornServer(GATEWAY_APP, {
            "REDIS_URL": redis_url, "EMBEDDINGS_REDIS_URL": embeddings_redis_url,
            "METRICS_DIR": str(self.metrics_dir), "UPSTREAM_RPM": str(upstream_rpm),
            "TIMEOUT_S": str(timeout_s)}, workers=workers)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def start(self) -> None:
        self.server.start()

    def close(self) -> None:
        self.server.close()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def __enter__(self) -> Gateway:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The decisions of one call of the wait-queue route, and the refused among them: a filler
# and a refusal then an admission (the fast cap), a filler and a refusal (the slow one).
QUEUE_DECISIONS, QUEUE_REFUSALS = 5, 2


@dataclass
class Traffic:
    """Sends the gateway's requests and counts the answers: {(route, status, why): n}, `why`
    the 429's X-RateLimit-Window/-Resource/-Scope, or "shadow" for a shadow would-refuse.
    `held` keeps the wall-clock (start, end) of each time a user's in-flight slots were all
    held."""

    base_url: str
    answers: dict[tuple[str, int, str], int] = field(default_factory=dict)
    held: list[tuple[float, float]] = field(default_factory=list)
    # The calls of the wait-queue route (limiter calls only: no FastAPI outcome).
    queued: int = 0

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30.0)

    def count(self, route: str, response: httpx.Response) -> None:
        why = ""
        if response.status_code == 429:
            why = "/".join(response.headers.get(h, "") for h in (
                "x-ratelimit-window", "x-ratelimit-resource", "x-ratelimit-scope"))
        elif response.headers.get("x-ratelimit-shadow"):
            why = "shadow"
        key = (route, response.status_code, why)
        self.answers[key] = self.answers.get(key, 0) + 1

    def total(self, route: str, status: int | None = None, why: str | None = None) -> int:
        return sum(n for (r, s, w), n in self.answers.items()
                   if r == route and status in (None, s) and why in (None, w))

    def decisions(self) -> dict[str, int]:
        """{limiter: decisions made} as the limiter counts them: a request refused for
        concurrency is refused before any window decides it."""
        chat = self.total("chat") + self.total("chat-stream") - self.total("chat", 429, "concurrent//")
        return {"gateway": chat + self.total("beta") + QUEUE_DECISIONS * self.queued,
                "embeddings": self.total("embeddings")}

    def queue(self, owner: str) -> None:
        """One call of the wait-queue route: a wait that ends admitted, one that times out."""
        with self.client() as client:
            response = client.post(f"/v1/queue/{owner}")
        assert response.json() == {"fast": "queued_then_allowed", "slow": "queue_timeout"}, \
            response.text
        self.queued += 1

    def chat(self, client: httpx.Client, user: str, tier: str, max_tokens: int = 100,
             model: str = "gpt-4o-mini") -> int:
        response = client.post("/v1/chat/completions", headers={"x-user": user, "x-tier": tier},
                               json={"model": model, "max_tokens": max_tokens,
                                     "messages": [{"role": "user", "content": "hi" * 20}]})
        self.count("chat", response)
        return response.status_code

    def users(self, prefix: str, tier: str, users: int, each: int, max_tokens: int = 100,
              model: str = "gpt-4o-mini", threads: int = 4) -> None:
        """`users` users of `tier` send `each` chat requests (in parallel across users)."""
        def one(n: int) -> None:
            with self.client() as client:
                for _ in range(each):
                    self.chat(client, f"{prefix}{n}", tier, max_tokens, model)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(users)))

    def budget_crossing(self, owner: str) -> None:
        """One hold of 60 % of a key's budget with a soft limit at 50 %: one crossing."""
        with self.client() as client:
            response = client.post(f"/v1/budget/{owner}")
            assert response.json() == {"crossed": 1}, response.text

    def big_token_requests(self, user: str) -> None:
        """Two 2,500-token estimates of one free user (3,000 a minute): the second refused."""
        with self.client() as client:
            for _ in range(2):
                self.chat(client, user, "free", max_tokens=2500)

    def concurrent_streams(self, user: str, held: int, hold_s: float) -> None:
        """`held` streams of one free user open at once (its cap), then one more request:
        refused (429 concurrent). Each stream ends `hold_s` after its first chunk; `held`
        gets the span when every slot surely was taken: from the last stream's headers to
        the first one's end, less half a second for the server having started earlier."""
        with self.client() as client:
            streams, responses, opened = [], [], []
            try:
                for _ in range(held):
                    stream = client.stream(
                        "POST", "/v1/chat/completions", headers={"x-user": user, "x-tier": "free"},
                        json={"model": "gpt-4o-mini", "max_tokens": 40, "stream": True,
                              "hold_s": hold_s, "messages": [{"role": "user", "content": "long"}]})
                    response = stream.__enter__()
                    opened.append(time.time())
                    streams.append(stream)
                    responses.append(response)
                    self.count("chat-stream", response)
                    assert response.status_code == 200, response.read()
                self.chat(client, user, "free")  # every slot held: 429 concurrent
                self.held.append((opened[-1], opened[0] + hold_s - 0.5))
                for response in responses:
                    response.read()  # to its end: the slot is given back
            finally:
                for stream in streams:
                    stream.__exit__(None, None, None)

    def shadow(self, user: str, each: int) -> None:
        with self.client() as client:
            for _ in range(each):
                self.count("beta", client.get("/v1/beta", headers={"x-user": user}))

    def fail_open(self, user: str, each: int) -> None:
        with self.client() as client:
            for _ in range(each):
                self.count("embeddings", client.post("/v1/embeddings", headers={"x-user": user}))

    def round(self, n: int, hold_s: float = 3.0) -> None:
        """One of each, with users of round `n` (new budgets every round): 4 free users x 7
        (2 refused each by the minute window), a token refusal, a concurrency refusal, 2
        shadow would-refuse, 3 fail-open, and 10 pro users x 5 on the gpt-4o upstream cap
        (it refuses what passes 30 a minute: 20 in the first round, all 50 in the next), a
        budget's soft limit crossed, and two waits in the limiter's wait queues (one
        admitted, one timed out)."""
        self.users(f"r{n}-free-", "free", users=4, each=7)
        self.big_token_requests(f"r{n}-tokens")
        self.budget_crossing(f"r{n}-key")
        self.concurrent_streams(f"r{n}-streamer", held=2, hold_s=hold_s)
        self.shadow(f"r{n}-shadowed", each=4)
        self.fail_open(f"r{n}-offline", each=3)
        self.queue(f"r{n}")
        self.users(f"r{n}-pro-", "pro", users=10, each=5, model="gpt-4o")


# ----------------------------------------------------------------------------- the dashboard

@dataclass(frozen=True)
class Target:
    panel: str
    ref_id: str
    expr: str  # as written in the dashboard (Grafana's variables in it)
    legend: str


class Dashboard:
    """dashboards/genai-ratelimit.json, read back."""

    def __init__(self, path: Path = DASHBOARD) -> None:
        self.path = path
        self.model = json.loads(path.read_text(encoding="utf-8"))

    def panels(self) -> Iterator[dict[str, Any]]:
        for panel in self.model["panels"]:
            yield panel
            yield from panel.get("panels", [])  # a collapsed row's

    def targets(self) -> list[Target]:
        out = []
        for panel in self.panels():
            for target in panel.get("targets", []):
                out.append(Target(panel["title"], target["refId"], target["expr"],
                                  target.get("legendFormat", "")))
        return out

    def variables(self) -> dict[str, dict[str, Any]]:
        return {v["name"]: v for v in self.model.get("templating", {}).get("list", [])}


def grafana_expr(expr: str, rate_interval: str = "30s", values: dict[str, str] | None = None) -> str:
    """`expr` as Grafana sends it: $__rate_interval and $__interval by `rate_interval`, a
    multi-value variable with "All" selected (${var} / $var in a =~ matcher) by `.+`, or by
    `values[var]` (a regex) when given."""
    values = values or {}
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__interval", rate_interval)
    expr = expr.replace("$__range", "1h")

    def variable(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return values.get(name, ".+")

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", variable, expr)
