"""The kill switch RATE_LIMIT_DISABLED with AsyncRateLimiter: every check allows with the full
budget without touching Redis (test_kill_switch.py proves that for every limiter kind,
through the blocking adapter for the async ones), here on a running loop, and the warning goes out once per
process, however many limiters, async or blocking, see the switch on."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import redis

from helpers_async import LoopFactory, run_async
from helpers_core import closed_port_url, connections_received, logged_entries, measured_commands

# The coroutine API on each event loop: loop_factory is the kind's (tests/conftest.py).
pytestmark = pytest.mark.limiter_kinds(
    "asyncio", "uvloop",
    reason=("the kill switch on a running loop; the blocking interface's tests run for every "
            "kind in test_kill_switch.py"))


# A closed port under the switch (check and check_windows answer, nothing dials): the tests
# with unreachable_limiter in test_kill_switch.py, for every kind.


def test_kill_switch_sends_nothing_and_opens_no_connection(
        monkeypatch: pytest.MonkeyPatch, redis_url: str, redis_client: redis.Redis,
        loop_factory: LoopFactory) -> None:
    from genai_ratelimit import AsyncRateLimiter

    user = f"user-{uuid.uuid4().hex}"

    async def main() -> None:
        async with AsyncRateLimiter(redis_url) as limiter:
            monkeypatch.setenv("RATE_LIMIT_DISABLED", "1")
            connections = connections_received(redis_client)
            with measured_commands(redis_client) as delta:
                results = await asyncio.gather(*(limiter.check(user, 1, 60) for _ in range(100)))
            assert results == [(True, 1, 0)] * 100
            assert connections_received(redis_client) == connections
            monkeypatch.delenv("RATE_LIMIT_DISABLED")
            assert await limiter.check(user, 1, 60) == (True, 0, 0)  # read on every call
        assert delta == {}

    run_async(main(), loop_factory)
    assert logged_entries(redis_client, f"ratelimit:{user}:60") == 1


ASYNC_WARNING_PROBE = textwrap.dedent("""
    import asyncio, json, logging, os, sys

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logging.getLogger("genai_ratelimit").addHandler(Keep(logging.DEBUG))
    from genai_ratelimit import AsyncRateLimiter, RateLimiter

    url = sys.argv[1]
    os.environ["RATE_LIMIT_DISABLED"] = "true"

    async def main():
        first, second = AsyncRateLimiter(url), AsyncRateLimiter(url)
        results = []
        for limiter in (first, second, first):
            for _ in range(5):
                results.append(list(await limiter.check("user-1", 3, 60)))
            results.append(list(await limiter.check_windows("user-1", [(3, 60), (9, 86400)])))
        await first.aclose()
        await second.aclose()
        return results

    results = asyncio.run(main())
    results += [list(RateLimiter(url).check("user-1", 3, 60))]
    results += asyncio.run(main())
    warnings = [(r.name, r.getMessage()) for r in records if r.levelno == logging.WARNING]
    print(json.dumps({"results": results, "warnings": warnings}))
""")


def test_kill_switch_warns_exactly_once_per_process_for_async_and_blocking_limiters(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RATE_LIMIT_DISABLED"}
    completed = subprocess.run(
        [sys.executable, "-W", "error", "-c", ASYNC_WARNING_PROBE, closed_port_url()],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    checks = [r for r in report["results"] if len(r) == 3]
    assert checks == [[True, 3, 0]] * 31
    assert [r for r in report["results"] if len(r) == 4] == [[True, 3, 0, 60]] * 6
    assert len(report["warnings"]) == 1, report["warnings"]
    name, message = report["warnings"][0]
    assert name == "genai_ratelimit" or name.startswith("genai_ratelimit.")
    assert "RATE_LIMIT_DISABLED" in message
