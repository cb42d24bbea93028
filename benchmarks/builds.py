#!/usr/bin/env python3
"""Two builds of the package side by side in one run: the check rows of run.py (sync, and
async at 1 and 64 in flight) for a BASE build and for this one, each beside the raw hiredis
C loop of the same round.

    make bench-builds BASE=<git revision>      # builds BASE into build/bench-base/venv first
    .venv/bin/python benchmarks/builds.py --base PYTHON --this PYTHON [--rounds N] [--seconds S]

Each build runs in its own interpreter (a venv holding it): a worker process per build
(`builds.py --worker URL`) keeps its limiters and answers "run sync|async1|async64" with one
timed sample, so both builds interleave with the raw client round after round, the order
alternating forward / reversed (drift lands on everybody alike). It starts its own
redis-server on a free loopback port; every contender writes under a prefix of its own.

Printed: per contender the medians over rounds of calls/s, p50 and client CPU per call; the
ratio of calls/s to the raw C loop of the same round (sequential for sync and async @1,
pipelined depth 64 for async @64); and this build's calls/s and CPU per call over BASE's,
round by round (then the median and range). On a loaded machine quote CPU per call: calls/s
is then set by the scheduler more than by the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    BENCH_DIR,
    RawClient,
    RedisTarget,
    Sample,
    admin_client,
    async_timed_loop,
    clean_keys,
    load_average,
    timed_loop,
)

BIG = 10**9  # allow-heavy: no call is refused
USERS = [f"user_{n}" for n in range(1000)]
ARGS = [(user, BIG, 60) for user in USERS]
MODES = {"sync": 1, "async1": 1, "async64": 64}  # mode -> calls in flight


# ------------------------------------------------------------------------ the worker

async def async_sample(url: str, prefix: str, in_flight: int, seconds: float, max_calls: int,
                       warmup: int) -> Sample:
    from genai_ratelimit import AsyncRateLimiter

    async with AsyncRateLimiter(url, key_prefix=prefix) as limiter:
        return await async_timed_loop(limiter.check, ARGS, in_flight, seconds, max_calls, warmup)


def worker(url: str) -> int:
    """Serves "run MODE PREFIX SECONDS MAX_CALLS WARMUP" lines with one JSON sample each."""
    import genai_ratelimit
    from genai_ratelimit import RateLimiter

    print(json.dumps({"extension": genai_ratelimit._native.__file__}), flush=True)
    sync_limiters: dict[str, RateLimiter] = {}
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        mode, prefix = words[1], words[2]
        seconds, max_calls, warmup = float(words[3]), int(words[4]), int(words[5])
        if mode == "sync":
            limiter = sync_limiters.get(prefix) or sync_limiters.setdefault(
                prefix, RateLimiter(url, key_prefix=prefix))
            sample = timed_loop(limiter.check, ARGS, seconds, max_calls, warmup)
        else:
            sample = asyncio.run(async_sample(url, prefix, MODES[mode], seconds, max_calls, warmup))
        print(json.dumps({"calls": sample.calls, "elapsed_s": sample.elapsed_s,
                          "p50_us": sample.p50_us, "p99_us": sample.p99_us,
                          "cpu_us_per_call": sample.cpu_us_per_call}), flush=True)
    for limiter in sync_limiters.values():
        limiter.close()
    return 0


class Worker:
    def __init__(self, python: str, url: str) -> None:
        # Absolute paths, run from /: the source tree's genai_ratelimit (no .so) is not on the path.
        command = [os.path.abspath(python), str(Path(__file__).resolve()), "--worker", url]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd="/")
        self.extension = json.loads(self._line())["extension"]

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"benchmarks: worker {self.proc.args} exited ({self.proc.wait(10)})")
        return line

    def run(self, mode: str, prefix: str, seconds: float, max_calls: int, warmup: int) -> Sample:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {mode} {prefix} {seconds} {max_calls} {warmup}\n")
        self.proc.stdin.flush()
        return Sample(**json.loads(self._line()))

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(30)


# ------------------------------------------------------------------------ the driver

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--base", help="the interpreter (venv) holding the BASE build")
    parser.add_argument("--this", default=sys.executable, help="the one holding this build")
    parser.add_argument("--base-name", default="base", help="BASE's name in the table")
    parser.add_argument("--this-name", default="this", help="this build's name in the table")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=0.5, help="per contender per round")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    if not args.base:
        parser.error("--base PYTHON is required")

    build = subprocess.run(["make", "-s", "-C", str(BENCH_DIR)], capture_output=True, text=True)
    if build.returncode != 0:
        print(build.stdout + build.stderr, file=sys.stderr)
        return 1
    load_before = load_average()
    target = RedisTarget.start_own()
    admin = admin_client(target)
    max_calls = int(args.seconds * 200_000)
    warmup = 100
    raw_args = ["--users", str(len(USERS)), "--window", f"60:{BIG}"]
    raws = {
        "raw hiredis C, sequential": RawClient(target, ["--mode", "seq", "--depth", "1", "--prefix",
                                                         "gbench:b0", *raw_args]),
        "raw hiredis C, pipelined depth 64": RawClient(target, ["--mode", "pipe", "--depth", "64",
                                                                 "--prefix", "gbench:b1", *raw_args]),
    }
    workers: dict[str, Worker] = {}
    rows: dict[str, list[Sample]] = {}
    try:
        workers = {args.base_name: Worker(args.base, target.url),
                   args.this_name: Worker(args.this, target.url)}
        for name, w in workers.items():
            print(f"{name}: {w.extension}", file=sys.stderr)
        contenders: list[tuple[str, Any]] = [(name, raw) for name, raw in raws.items()]
        labels = {"sync": "RateLimiter.check", "async1": "AsyncRateLimiter.check @ 1 in flight",
                  "async64": "AsyncRateLimiter.check @ 64 in flight"}
        for mode, label in labels.items():
            for build_name, w in workers.items():
                contenders.append((f"{label} [{build_name}]", (w, mode)))
        names = [name for name, _ in contenders]
        rows = {name: [] for name in names}
        started = time.monotonic()
        for round_index in range(args.rounds):
            order = contenders if round_index % 2 == 0 else contenders[::-1]
            for name, runner in order:
                prefix = f"gbench:b{names.index(name)}"  # each contender's keys, cleaned first
                clean_keys(admin, [prefix], True)
                if isinstance(runner, RawClient):
                    sample = runner.run(args.seconds, max_calls, warmup)
                else:
                    w, mode = runner
                    sample = w.run(mode, prefix, args.seconds, max_calls, warmup)
                rows[name].append(sample)
            print(f"  round {round_index + 1}/{args.rounds} in {time.monotonic() - started:.0f} s",
                  file=sys.stderr)
    finally:
        for w in workers.values():
            w.close()
        for raw in raws.values():
            raw.close()
        admin.close()
        target.close()

    report(rows, args, load_before)
    return 0


def report(rows: dict[str, list[Sample]], args: argparse.Namespace, load_before: str) -> None:
    seq, pipe = rows["raw hiredis C, sequential"], rows["raw hiredis C, pipelined depth 64"]

    def ratio_cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}× ({min(values):.2f}–{max(values):.2f})"

    print(f"{args.rounds} rounds × {args.seconds:g} s per contender, order alternating; "
          f"{load_before} at the start, {load_average()} at the end")
    print()
    print("| contender | calls/s | p50 µs | CPU µs/call | calls/s ÷ raw C loop | "
          f"{args.this_name} ÷ {args.base_name}: calls/s | CPU µs/call |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, samples in rows.items():
        cells = [f"{statistics.median(s.calls_per_s for s in samples):,.0f}",
                 f"{statistics.median(s.p50_us for s in samples):.1f}",
                 f"{statistics.median(s.cpu_us_per_call for s in samples):.1f}"]
        if name.startswith("raw"):
            cells += ["–", "–", "–"]
        else:
            raw = pipe if "@ 64" in name else seq
            cells.append(ratio_cell([s.calls_per_s / r.calls_per_s
                                     for s, r in zip(samples, raw, strict=True)]))
            if name.endswith(f"[{args.this_name}]"):
                base = rows[name.replace(f"[{args.this_name}]", f"[{args.base_name}]")]
                cells.append(ratio_cell([s.calls_per_s / b.calls_per_s
                                         for s, b in zip(samples, base, strict=True)]))
                cells.append(ratio_cell([s.cpu_us_per_call / b.cpu_us_per_call
                                         for s, b in zip(samples, base, strict=True)]))
            else:
                cells += ["–", "–"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
