"""Soak test (`make soak`): 1,000,000 checks with the blocking RateLimiter and 1,000,000 with
the AsyncRateLimiter (64 in flight), each in a fresh process against a throwaway
redis-server on loopback. Reports RSS at start, after warm-up and at the end, and checks/s,
as a table; fails when RSS grew by more than --max-rss-growth-mib after warm-up, or when a
check raised.

Bounded in time: a phase stops after --max-seconds even if it did not reach --checks (the
table says so, and the run still fails only on growth or errors).

    python scripts/soak.py [--checks 1000000] [--max-rss-growth-mib 8] [--max-seconds 300]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

MIB = 1024 * 1024
PAGE = os.sysconf("SC_PAGE_SIZE")
WARM_UP = 20_000
USERS = [f"soak-user-{i}" for i in range(1000)]
WINDOWS = [(10**9, 1), (10**9, 60)]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


# ---------------------------------------------------------------- one phase (child)

def sync_phase(url: str, checks: int, deadline: float, report: dict) -> None:
    from genai_ratelimit import RateLimiter

    limiter = RateLimiter(url)
    users = len(USERS)

    def run(n: int) -> int:
        for i in range(n):
            if i % 10 == 9:
                limiter.check_windows(USERS[i % users], WINDOWS)
            else:
                limiter.check(USERS[i % users], 10**9, 1)
            if i % 4096 == 0 and time.monotonic() > deadline:
                return i + 1
        return n

    run(WARM_UP)
    gc.collect()
    report["rss_warm"] = rss()
    started = time.monotonic()
    report["checks"] = run(checks)
    report["seconds"] = time.monotonic() - started
    limiter.close()


def async_phase(url: str, checks: int, deadline: float, report: dict, in_flight: int) -> None:
    from genai_ratelimit import AsyncRateLimiter

    async def main() -> None:
        limiter = AsyncRateLimiter(url)
        users = len(USERS)

        async def run(n: int) -> int:
            done = 0

            async def worker(w: int) -> None:
                nonlocal done
                i = w
                while i < n:
                    if i % 10 == 9:
                        await limiter.check_windows(USERS[i % users], WINDOWS)
                    else:
                        await limiter.check(USERS[i % users], 10**9, 1)
                    done += 1
                    i += in_flight
                    if i % 4096 < in_flight and time.monotonic() > deadline:
                        return

            await asyncio.gather(*(worker(w) for w in range(in_flight)))
            return done

        await run(WARM_UP)
        gc.collect()
        report["rss_warm"] = rss()
        started = time.monotonic()
        report["checks"] = await run(checks)
        report["seconds"] = time.monotonic() - started
        await limiter.aclose()

    asyncio.run(main())


def child(args: argparse.Namespace) -> None:
    report: dict = {"phase": args.phase, "rss_start": rss()}
    deadline = time.monotonic() + args.max_seconds
    if args.phase == "sync":
        sync_phase(args.url, args.checks, deadline, report)
    else:
        async_phase(args.url, args.checks, deadline, report, args.in_flight)
    gc.collect()
    report["rss_end"] = rss()
    print(json.dumps(report))


# ------------------------------------------------------------------- the driver

class ThrowawayRedis:
    """A redis-server on a free loopback port, no persistence, removed afterwards."""

    def __enter__(self) -> ThrowawayRedis:
        binary = shutil.which("redis-server")
        if binary is None:
            sys.exit("error: redis-server is not installed (make deps installs it)")
        self.directory = tempfile.mkdtemp(prefix="genai-ratelimit-soak-")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.directory],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)  # readiness polling until PONG or the deadline
        self.__exit__()
        sys.exit("error: redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)


def run_phase(phase: str, url: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--url", url,
               "--checks", str(args.checks), "--max-seconds", str(args.max_seconds),
               "--in-flight", str(args.in_flight)]
    # Not from the repository: `python script` would otherwise find the source tree first.
    result = subprocess.run(command, cwd=tempfile.gettempdir(), capture_output=True, text=True,
                            timeout=args.max_seconds + 120)
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
        return {"phase": phase, "error": f"exit {result.returncode}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=1_000_000)
    parser.add_argument("--max-rss-growth-mib", type=float, default=8.0)
    parser.add_argument("--max-seconds", type=float, default=300.0, help="per phase")
    parser.add_argument("--in-flight", type=int, default=64, help="async checks in flight")
    parser.add_argument("--phase", choices=["sync", "async"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        child(args)
        return 0

    print(f"soak: {args.checks:,} checks per limiter against a throwaway redis-server "
          f"(async: {args.in_flight} in flight; 1 in 10 is a two-window check)", flush=True)
    with ThrowawayRedis() as server:
        reports = [run_phase("sync", server.url, args), run_phase("async", server.url, args)]

    failed = False
    header = (f"{'limiter':<8} {'checks':>10} {'seconds':>8} {'checks/s':>9} "
              f"{'RSS start':>10} {'warmed up':>10} {'end':>10} {'growth':>8}  verdict")
    print(header)
    print("-" * len(header))
    for r in reports:
        if "error" in r:
            failed = True
            print(f"{r['phase']:<8} {'':>10} {'':>8} {'':>9} {'':>10} {'':>10} {'':>10} {'':>8}  "
                  f"FAILED ({r['error']})")
            continue
        growth = (r["rss_end"] - r["rss_warm"]) / MIB
        verdict = "ok"
        if growth > args.max_rss_growth_mib:
            verdict = f"FAILED: RSS grew more than {args.max_rss_growth_mib:g} MiB"
            failed = True
        elif r["checks"] < args.checks:
            verdict = f"ok (stopped at the {args.max_seconds:g} s limit)"
        print(f"{r['phase']:<8} {r['checks']:>10,} {r['seconds']:>8.1f} "
              f"{r['checks'] / r['seconds']:>9,.0f} {r['rss_start'] / MIB:>7.1f} MiB "
              f"{r['rss_warm'] / MIB:>6.1f} MiB {r['rss_end'] / MIB:>6.1f} MiB "
              f"{growth:>+5.2f} MiB  {verdict}")
    print(f"soak: {'FAILED' if failed else 'passed'} (RSS growth bound "
          f"{args.max_rss_growth_mib:g} MiB after {WARM_UP:,} warm-up checks)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
