#!/usr/bin/env python3
"""Draws docs/operations-dashboard.png: the panels of dashboards/genai-ratelimit.json, each
query answered by a real Prometheus (Debian's `prometheus`) that scraped a real gateway for
about two minutes.

    make dashboard-pictures      (installs prometheus and matplotlib when missing)
    .venv/bin/python benchmarks/dashboard_pictures.py [--out docs/operations-dashboard.png]

The gateway is tests/helpers_prometheus.py's (FastAPI under uvicorn, 2 workers, one metrics
directory; limiter "gateway": a TokenRateLimit with tiers, token budgets, in-flight caps and
an upstream cap on gpt-4o, and a shadow-mode RateLimit; limiter "embeddings": a fail-open
RateLimit), on one real redis-server that both limiters use. Client threads drive it:

  steady  free users (5 a minute each) and pro users on gpt-4o under the upstream cap,
          requests of random token sizes, long streams of free users (2 in flight at most),
          a shadow-mode route, an embeddings route
  burst   three times the pro traffic: the upstream cap (1,200 a minute) saturates
  stall   Redis stopped (SIGSTOP): the gateway answers 503, embeddings fail open
  steady  Redis back

Prometheus scrapes every second; each panel is its query_range over the run (step 1 s,
$__rate_interval = 10 s), drawn with the panel's title, legend and unit.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers_prometheus import RULES, Dashboard, Gateway, PrometheusServer, Traffic, grafana_expr  # noqa: E402
from redis_server import RedisServer  # noqa: E402

PHASES = [(0.0, "steady"), (35.0, "burst"), (75.0, "Redis stalled"), (90.0, "steady"),
          (125.0, "end")]
RATE_INTERVAL = "10s"
UNITS = {"reqps": ("/ s", 1.0), "ops": ("/ s", 1.0), "percentunit": ("%", 100.0),
         "s": ("ms", 1000.0), "short": ("", 1.0)}


class Load:
    """The client threads; `phase[0]` is read by each loop."""

    def __init__(self, traffic: Traffic) -> None:
        self.traffic = traffic
        self.phase = ["steady"]
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.errors = 0

    def spawn(self, name: str, loop: Any, *args: Any) -> None:
        thread = threading.Thread(target=self.guarded, args=(loop, *args), name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def guarded(self, loop: Any, *args: Any) -> None:
        try:
            loop(*args)
        except Exception:  # noqa: BLE001 - a broken loop must not hang the run: counted
            self.errors += 1
            raise

    def pause(self, seconds: float) -> bool:
        return not self.stop.wait(seconds)

    def free_users(self, index: int) -> None:
        rng = random.Random(index)
        with self.traffic.client() as client:
            n = 0
            while self.pause(rng.uniform(0.1, 0.3)):
                user = f"free-{index}-{n // 7}"  # 7 requests a user: the 6th and 7th refused
                self.traffic.chat(client, user, "free", max_tokens=rng.choice([64, 256, 1200]))
                n += 1

    def pro_users(self, index: int, active_in: set[str]) -> None:
        rng = random.Random(100 + index)
        with self.traffic.client() as client:
            while self.pause(rng.uniform(0.15, 0.25)):
                if self.phase[0] in active_in:
                    self.traffic.chat(client, f"pro-{index}-{rng.randrange(50)}", "pro",
                                      max_tokens=rng.choice([128, 512, 2048]), model="gpt-4o")

    def streamers(self, index: int) -> None:
        rng = random.Random(200 + index)
        n = 0
        while not self.stop.is_set():
            try:
                self.traffic.concurrent_streams(f"streamer-{index}-{n // 2}", held=2,
                                                hold_s=rng.uniform(1.5, 4.0))
            except AssertionError:
                pass  # a stream refused (Redis stalled: 503): counted in traffic.answers
            n += 1
            self.pause(rng.uniform(0.5, 2.0))

    def shadow(self) -> None:
        n = 0
        while self.pause(0.5):
            self.traffic.shadow(f"shadowed-{n}", each=3)
            n += 1

    def embeddings(self) -> None:
        n = 0
        while self.pause(0.2):
            self.traffic.fail_open(f"embedder-{n}", each=1)  # never near its budget
            n += 1

    def start(self) -> None:
        for i in range(4):
            self.spawn(f"free-{i}", self.free_users, i)
        for i in range(3):
            self.spawn(f"pro-{i}", self.pro_users, i, {"steady", "burst", "Redis stalled"})
        for i in range(3, 9):
            self.spawn(f"pro-{i}", self.pro_users, i, {"burst"})
        self.spawn("streamer", self.streamers, 0)
        self.spawn("shadow", self.shadow)
        self.spawn("embeddings", self.embeddings)

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def draw(prometheus: PrometheusServer, start: float, end: float, phases: list[tuple[float, str]],
         out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.gridspec import GridSpec

    panels = [p for p in Dashboard().panels() if p["type"] != "row"]
    rows = sorted({p["gridPos"]["y"] for p in panels})
    fig = plt.figure(figsize=(16, 3.1 * len(rows)))
    grid = GridSpec(len(rows), 24, figure=fig, hspace=0.6, wspace=2.5, top=1 - 0.5 / len(rows),
                    bottom=0.02, left=0.04, right=0.99)
    spans = {name: (at, nxt) for (at, name), (nxt, _) in zip(phases, phases[1:], strict=False)}
    shades = {"burst": "tab:orange", "Redis stalled": "tab:red"}
    drawn = []
    for panel in panels:
        pos = panel["gridPos"]
        ax = fig.add_subplot(grid[rows.index(pos["y"]), pos["x"]:pos["x"] + pos["w"]])
        unit, scale = UNITS[panel["fieldConfig"]["defaults"].get("unit", "short")]
        axis = panel["fieldConfig"]["defaults"]["custom"].get("axisLabel") or unit
        lines = 0
        for target in panel["targets"]:
            expr = grafana_expr(target["expr"], RATE_INTERVAL)
            for series in prometheus.query_range(expr, start, end, 1.0):
                labels = {k: v for k, v in series["metric"].items() if k != "__name__"}
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) * scale for _, v in series["values"]]
                if not any(y == y and y != 0 for y in ys):  # all NaN or 0: nothing to see
                    continue
                ax.plot(xs, ys, linewidth=1.0, label=legend(target["legendFormat"], labels))
                lines += 1
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.set_ylabel(axis, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlim(0, end - start)
        ax.grid(alpha=0.3)
        for name, color in shades.items():
            ax.axvspan(*spans[name], color=color, alpha=0.08, linewidth=0)
        if lines:
            ax.legend(fontsize=6, loc="upper left", ncol=2 if lines > 4 else 1, framealpha=0.6)
        else:
            ax.text(0.5, 0.5, "all zero in this run", ha="center", va="center",
                    transform=ax.transAxes, fontsize=8, alpha=0.6)
        drawn.append(f"{panel['title']}: {lines} series")
    burst, stall = spans["burst"], spans["Redis stalled"]
    fig.suptitle("dashboards/genai-ratelimit.json: each panel's PromQL on a real Prometheus "
                 "that scraped a real gateway (x: seconds since the start)\n"
                 f"orange: a burst of pro traffic on the gpt-4o upstream cap ({burst[0]:.0f}-"
                 f"{burst[1]:.0f} s); red: Redis stopped with SIGSTOP ({stall[0]:.0f}-"
                 f"{stall[1]:.0f} s)", fontsize=11, y=1 - 0.1 / len(rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72, bbox_inches="tight")
    return drawn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "operations-dashboard.png"))
    args = parser.parse_args()
    with RedisServer() as redis, \
            Gateway(redis.url, redis.url, upstream_rpm=1200, timeout_s=0.3) as gateway, \
            PrometheusServer([gateway.target], [RULES]) as prometheus:
        if not prometheus.wait_for('up{job="gateway"} == 1', bool):
            raise SystemExit(f"Prometheus never scraped the gateway:\n{prometheus.log()}")
        traffic = Traffic(gateway.base_url)
        load = Load(traffic)
        start = time.time()
        load.start()
        paused = False
        try:
            for at, name in PHASES[1:]:
                load.stop.wait(max(0.0, start + at - time.time()))
                load.phase[0] = name
                if name == "Redis stalled":
                    redis.pause()
                    paused = True
                elif paused:
                    redis.resume()
                    paused = False
        finally:
            if paused:
                redis.resume()
            load.join()
        end = time.time()
        prometheus.wait_for(f'timestamp(up{{job="gateway"}}) > {end + 1:.3f}', bool)
        drawn = draw(prometheus, start, end, PHASES, Path(args.out))
        totals = {}
        for name in ("lease_acquisitions_total", "lease_releases_total",
                     "connection_errors_total", "decisions_total", "replays_total"):
            for series in prometheus.query(f'genai_ratelimit_{name}{{limiter="gateway"}}'):
                outcome = series["metric"].get("outcome", "")
                totals[f"{name}{'{' + outcome + '}' if outcome else ''}"] = series["value"][1]
    print(f"{args.out}: {end - start:.0f} s, client errors {load.errors}")
    for (route, status, why), n in sorted(traffic.answers.items()):
        print(f"  {route:12} {status} {why or '-':28} {n}")
    for line in drawn:
        print(f"  {line}")
    print("  gateway totals: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
