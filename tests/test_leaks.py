"""Leak tests: many checks in a child process, whose resident memory (RSS, from
/proc/self/statm) must stay flat once warmed up. A leak of even one small object per check
shows here: 200,000 checks x 32 bytes is 6 MiB, above the bound.

Each test runs in a fresh interpreter so that nothing the test session allocated (pytest,
other tests' objects) moves the numbers. The limiter of each kind (tests/conftest.py: the
blocking one, the async one on asyncio's loop and on uvloop's) runs against the session's
Redis; the error paths (closed port, invalid arguments, server error replies,
garbage fed to the async pipeline) need no working Redis for most of their calls.

Marked slow (each takes several seconds): `make test` runs them, `make test-fast` does not.
Under AddressSanitizer (make test-asan) RSS measures ASan's quarantine, not our memory, so
they are skipped there; `make soak` is the long version of the same measurement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from redis_server import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                       reason="RSS under AddressSanitizer measures its quarantine, not leaks"),
]

MIB = 1024 * 1024
RSS_GROWTH_BOUND = 4 * MIB
CHECKS = 200_000
ERROR_CALLS = 50_000
IN_FLIGHT = 64

CHILD = textwrap.dedent('''
    import asyncio, gc, json, os, sys, time

    PAGE = os.sysconf("SC_PAGE_SIZE")

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def measure(run, warm_up, count):
        """Runs `warm_up` calls, then `count` more; RSS after each phase, after a collection."""
        run(warm_up)
        gc.collect()
        before = rss()
        started = time.monotonic()
        run(count)
        seconds = time.monotonic() - started
        gc.collect()
        print(json.dumps({"before": before, "after": rss(), "calls": count, "seconds": seconds}))
        print(f"{mode}: {count:,} calls in {seconds:.1f} s, RSS {before / 2**20:.1f} -> "
              f"{rss() / 2**20:.1f} MiB", file=sys.stderr)

    import genai_ratelimit
    from genai_ratelimit import AsyncRateLimiter, RateLimiter, RateLimiterError, _native

    mode, url, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    USERS = [f"leak-user-{i}" for i in range(97)]

    def sync_checks(n):
        limiter = RateLimiter(url)
        for i in range(n):
            user = USERS[i % len(USERS)]
            if i % 4 == 3:
                allowed, _, _, _ = limiter.check_windows(user, [(10**9, 1), (10**9, 3600)])
            elif i % 16 == 5:
                allowed, _, _ = limiter.check("leak-full", 1, 3600)  # rejected after the first
            else:
                allowed, _, _ = limiter.check(user, 10**9, 1)
        limiter.close()

    def run_on_a_new_loop(coroutine):
        if mode == "uvloop":
            import uvloop
            loop = uvloop.new_event_loop()
        else:
            loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(coroutine)
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def async_checks(n):
        async def main():
            limiter = AsyncRateLimiter(url)
            per_worker = n // IN_FLIGHT

            async def worker(w):
                for i in range(per_worker):
                    user = USERS[(w * per_worker + i) % len(USERS)]
                    if i % 4 == 3:
                        await limiter.check_windows(user, [(10**9, 1), (10**9, 3600)])
                    elif i % 16 == 5:
                        await limiter.check("leak-full", 1, 3600)
                    else:
                        await limiter.check(user, 10**9, 1)

            await asyncio.gather(*(worker(w) for w in range(IN_FLIGHT)))
            await limiter.aclose()
        run_on_a_new_loop(main())

    IN_FLIGHT = int(os.environ.get("LEAK_IN_FLIGHT", "64"))

    def expect(error, call, *args):
        try:
            call(*args)
        except error:
            return
        raise AssertionError(f"{call} did not raise {error.__name__}")

    def error_paths(n):
        closed = RateLimiter(os.environ["LEAK_CLOSED_URL"], connect_timeout=0.5)
        limiter = RateLimiter(url)
        codec = _native.Codec("leak")
        loop = asyncio.new_event_loop()
        request = codec.check("leak-user", 5, 60)
        for i in range(n):
            step = i % 10
            if step == 0:
                expect(genai_ratelimit.RateLimiterUnavailable, closed.check, "leak-user", 5, 60)
            elif step == 1:
                expect(ValueError, limiter.check, "", 5, 60)
            elif step == 2:
                expect(TypeError, limiter.check, 12345, 5, 60)
            elif step == 3:
                expect(ValueError, limiter.check, "bad-\\udc80-surrogate", 5, 60)
            elif step == 4:
                expect(ValueError, limiter.check_windows, "leak-user", [(1, 60), (2, 60)])
            elif step == 5:
                expect(ValueError, codec.check, "leak-user", 2**80, 60)
            elif step == 6:
                expect(TypeError, codec.check_windows, "leak-user", [(1, 60, 3)])
            elif step == 7:
                # The script fails on a key of the wrong type: an error reply from Redis.
                expect(genai_ratelimit.RateLimiterUnavailable, limiter.check, "leak-wrongtype", 5, 60)
            else:
                # Garbage and wrong-type replies fed to the async pipeline.
                pipeline = _native.Pipeline(1.0)
                future = loop.create_future()
                pipeline.push(future, request)
                pipeline.take()
                garbage = b"!garbage\\r\\n" if step == 8 else b"*2\\r\\n:1\\r\\n$3\\r\\nabc\\r\\n"
                expect(RateLimiterError, pipeline.feed, garbage)
                pipeline.fail_all(RateLimiterError("closed"), _native.STATUS_CLOSED)
                if future.done():
                    future.exception()
        loop.close()
        limiter.close()
        closed.close()

    if mode == "sync":
        measure(sync_checks, 20_000, count)
    elif mode in ("asyncio", "uvloop"):
        measure(async_checks, 20_000, count)
    elif mode == "errors":
        measure(error_paths, 10_000, count)
    else:
        raise SystemExit(f"unknown mode {mode}")
''')


def run_child(mode: str, url: str, count: int, cwd: Path, **env: str) -> dict[str, float]:
    """Runs CHILD in a fresh interpreter. Its working directory is not the repository, so
    `python -c` imports the installed package, not the source tree."""
    child_env = {**os.environ, **env}
    result = subprocess.run([sys.executable, "-c", CHILD, mode, url, str(count)], cwd=cwd,
                            env=child_env, capture_output=True, text=True, timeout=180)
    if result.returncode != 0:
        pytest.fail(f"the {mode} child failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_flat(report: dict[str, float]) -> None:
    growth = report["after"] - report["before"]
    assert growth < RSS_GROWTH_BOUND, (
        f"RSS grew by {growth / MIB:.2f} MiB over {report['calls']:,} calls after warm-up "
        f"({report['before'] / MIB:.1f} -> {report['after'] / MIB:.1f} MiB): a leak")


def test_checks_do_not_grow_memory(limiter_kind, redis_url, redis_client, tmp_path):
    """CHECKS checks by a limiter of the kind (the child runs that kind itself: the mode is
    the kind); the async kinds keep IN_FLIGHT checks in flight on one loop."""
    assert_flat(run_child(limiter_kind, redis_url, CHECKS, tmp_path, LEAK_IN_FLIGHT=str(IN_FLIGHT)))


def test_error_paths_do_not_grow_memory(redis_url, redis_client, tmp_path):
    """Refused connections, invalid arguments, error replies from Redis and garbage fed to
    the async pipeline: every exception path frees what it allocated."""
    redis_client.set("ratelimit:leak-wrongtype:60", "a string, not a sorted set")
    closed_url = f"redis://127.0.0.1:{free_port()}/0"
    assert_flat(run_child("errors", redis_url, ERROR_CALLS, tmp_path, LEAK_CLOSED_URL=closed_url))
