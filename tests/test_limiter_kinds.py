"""The limiter kinds every limiter test runs against (tests/conftest.py) are what they say:
the "sync" limiter is the blocking RateLimiter; through the blocking adapter, the "asyncio"
and "uvloop" kinds really check with AsyncRateLimiter's coroutines, on a loop of their kind;
the limiters a test builds itself come from make_limiter and are of its kind; a contract test
module builds none behind the factory's back; and pytest collects each limiter test once per
kind, the sync-only ones once."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from genai_ratelimit import AsyncRateLimiter, RateLimiter
from helpers_async import ASYNC_KINDS, BlockingAsyncLimiter, LimiterFactory, limiter_kind_params
from helpers_core import logged_entries

TESTS = Path(__file__).resolve().parent

# The modules whose tests prove the limiter's contract once per kind through the blocking
# interface. A limiter one of their tests built itself, from RateLimiter or AsyncRateLimiter,
# would be of the same kind in every case: they build them with make_limiter.
CONTRACT_MODULES = ["test_limiter_core.py", "test_limiter_input.py", "test_limiter_faults.py",
                    "test_kill_switch.py", "test_hostile_input.py", "test_faults_hostile.py",
                    "test_idempotent_retry.py", "test_tls.py", "test_members.py"]
LIMITER_CLASSES = {"RateLimiter", "AsyncRateLimiter"}


@pytest.mark.limiter_kinds("sync", reason="what the sync kind is")
def test_the_sync_kind_is_the_blocking_limiter(limiter: Any, make_limiter: LimiterFactory) -> None:
    assert type(limiter) is RateLimiter
    assert make_limiter.loop_factory is None and not make_limiter.is_async


@pytest.mark.limiter_kinds(*ASYNC_KINDS, reason="what the async kinds are")
def test_the_async_kinds_check_with_async_rate_limiter_on_a_loop_of_their_kind(
        limiter: Any, limiter_kind: str, monkeypatch: pytest.MonkeyPatch, redis_client: redis.Redis,
        user_id: str) -> None:
    assert type(limiter) is BlockingAsyncLimiter
    inner = limiter.inner
    assert type(inner) is AsyncRateLimiter
    awaited_on: list[asyncio.AbstractEventLoop] = []
    for name in ("check", "check_windows"):
        real = getattr(inner, name)

        async def recording(*args: Any, _real: Any = real) -> Any:
            awaited_on.append(asyncio.get_running_loop())
            return await _real(*args)

        monkeypatch.setattr(inner, name, recording)

    assert limiter.check(user_id, 10, 60) == (True, 9, 0)
    assert limiter.check_windows(user_id, [(10, 60)]) == (True, 8, 0, 60)
    assert logged_entries(redis_client, f"ratelimit:{user_id}:60") == 2
    assert awaited_on == [limiter.loop, limiter.loop]
    assert type(limiter.loop).__module__.split(".")[0] == limiter_kind  # "asyncio" or "uvloop"


EXPECTED_CLASSES = {  # kind: (what make_limiter gives, what make_limiter.native gives)
    "sync": (RateLimiter, RateLimiter),
    "asyncio": (BlockingAsyncLimiter, AsyncRateLimiter),
    "uvloop": (BlockingAsyncLimiter, AsyncRateLimiter),
}


def test_the_limiters_a_test_builds_are_of_its_kind(make_limiter: LimiterFactory, limiter_kind: str,
                                                    redis_url: str) -> None:
    blocking = make_limiter(redis_url, key_prefix="built")
    native = make_limiter.native(redis_url, key_prefix="native")
    assert (type(blocking), type(native)) == EXPECTED_CLASSES[limiter_kind]
    assert (blocking.key_prefix, native.key_prefix) == ("built", "native")


def test_the_factory_closes_every_limiter_it_made(limiter_kind: str, redis_url: str,
                                                  redis_client: redis.Redis, user_id: str) -> None:
    factory = LimiterFactory(limiter_kind)
    used = factory(redis_url)
    assert used.check(user_id, 10, 60) == (True, 9, 0)
    unused = factory(redis_url)
    native = factory.native(redis_url)
    assert not (used.closed or unused.closed or native.closed)
    factory.close()
    assert used.closed and unused.closed and native.closed


def limiter_constructions(path: Path) -> list[str]:
    """Where a module calls RateLimiter(...) or AsyncRateLimiter(...), as a name or an
    attribute (in code: a probe run in a child process is a string, and not counted)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in LIMITER_CLASSES:
                found.append(f"{path.name}:{node.lineno} {name}(...)")
    return found


def test_the_contract_modules_build_every_limiter_through_the_factory() -> None:
    found = [where for module in CONTRACT_MODULES for where in limiter_constructions(TESTS / module)]
    assert found == [], "build these with make_limiter (tests/conftest.py):\n" + "\n".join(found)


def test_a_limiter_test_is_collected_once_per_kind_and_a_sync_only_one_once() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         str(TESTS / "test_limiter_faults.py")],
        # From the tests' folder: run from the checkout's root, `python -m pytest` puts the
        # source tree first on sys.path, whose genai_ratelimit has no built extension.
        cwd=TESTS, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    ids = {line.split("::", 1)[1] for line in completed.stdout.splitlines() if "::" in line}
    kinds = [param.values[0] for param in limiter_kind_params()]
    assert {f"test_script_flush_is_recovered_transparently[{storage}-{kind}]"
            for kind in kinds for storage in ("zset", "compact")} <= ids
    forks = {i for i in ids if i.startswith("test_fork_child_does_not_close_the_parents_connection")}
    assert forks == {f"test_fork_child_does_not_close_the_parents_connection[{storage}-sync]"
                     for storage in ("zset", "compact")}
    assert "test_exception_hierarchy" in ids  # no limiter: collected once, without a kind
