"""The sync suite's contract tests, run again against AsyncRateLimiter: the round trip, keys,
members, scores, honest retry, rejections that write nothing, TTLs, tiers, check_windows,
input validation before any I/O, URL errors, password secrecy, real faults (closed port,
unanswered connect, paused server, garbage, SCRIPT FLUSH, killed server, auth, db, unix
socket), closing, and the kill switch.

Reuse, not copies: every test function of tests/test_limiter_core.py, test_limiter_input.py,
test_limiter_faults.py and test_kill_switch.py is imported here (pytest collects it again in
this module), minus the few listed in NOT_REUSED with the reason. Here:
- the `limiter` and `unreachable_limiter` fixtures are BlockingAsyncLimiter: an
  AsyncRateLimiter whose coroutines are run to completion on one loop kept for the
  limiter's life, so connections are reused between calls as in a service;
- genai_ratelimit.RateLimiter is replaced by BlockingAsyncLimiter for the duration of each
  test, so tests that build their own limiter (`from genai_ratelimit import RateLimiter`
  inside the test, or test_limiter_faults.limiter_for) build an async one;
- each test runs on every loop of loop_factory_params(): asyncio's, and uvloop's when it is
  installed.
Async-only behaviour (concurrency, cancellation, loop lag, several loops, aclose) is in the
other tests/test_async_*.py files."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import genai_ratelimit
import test_kill_switch
import test_limiter_core
import test_limiter_faults
import test_limiter_input
from helpers_async import BlockingAsyncLimiter, LoopFactory, loop_factory  # noqa: F401  (fixture)
from helpers_core import closed_port_url
from test_limiter_faults import password_redis  # noqa: F401  (a fixture the reused tests use)

NOT_REUSED = {
    # No limiter involved: proving them twice proves nothing more.
    "test_script_sha1_is_the_sha1_of_the_lua_file": "no limiter",
    "test_tier_limits_are_the_contracts_budgets": "no limiter",
    "test_exception_hierarchy": "no limiter",
    # fork() with an event loop is not part of the async contract.
    "test_fork_parent_and_child_both_get_correct_answers_on_their_own_connections": "fork",
    "test_fork_child_does_not_close_the_parents_connection": "fork",
    "test_child_forked_below_python_never_reuses_the_parents_socket": "fork",
    # These run the blocking limiter in a subprocess; test_async_kill_switch.py has the
    # async probe.
    "test_kill_switch_warns_exactly_once_per_process": "see test_async_kill_switch.py",
    "test_no_kill_switch_warning_while_it_is_off": "see test_async_kill_switch.py",
}

REUSED_MODULES = (test_limiter_core, test_limiter_input, test_limiter_faults, test_kill_switch)

for _module in REUSED_MODULES:
    for _name, _test in vars(_module).items():
        if _name.startswith("test_") and callable(_test) and _name not in NOT_REUSED:
            assert _name not in globals(), f"two reused tests are named {_name}"
            globals()[_name] = _test


@pytest.fixture(autouse=True)
def _async_limiter_in_place_of_the_blocking_one(monkeypatch: pytest.MonkeyPatch,
                                                loop_factory: LoopFactory) -> None:
    monkeypatch.setattr(BlockingAsyncLimiter, "loop_factory", staticmethod(loop_factory))
    monkeypatch.setattr(genai_ratelimit, "RateLimiter", BlockingAsyncLimiter)


@pytest.fixture
def limiter(redis_url: str, redis_client: object,
            _async_limiter_in_place_of_the_blocking_one: None) -> Iterator[BlockingAsyncLimiter]:
    """An AsyncRateLimiter on the session's Redis, on a clean database."""
    with BlockingAsyncLimiter(redis_url) as rl:
        yield rl


@pytest.fixture
def unreachable_limiter(_async_limiter_in_place_of_the_blocking_one: None) -> Iterator[BlockingAsyncLimiter]:
    """An AsyncRateLimiter on a closed port: any Redis I/O would raise RateLimiterUnavailable."""
    with BlockingAsyncLimiter(closed_port_url(), connect_timeout=0.5, socket_timeout=0.5) as rl:
        yield rl


def test_the_reused_tests_really_use_the_async_limiter(limiter: BlockingAsyncLimiter) -> None:
    from genai_ratelimit import AsyncRateLimiter, RateLimiter

    assert RateLimiter is BlockingAsyncLimiter
    assert type(limiter.inner) is AsyncRateLimiter
    reused = [name for name in globals() if name.startswith("test_")]
    assert len(reused) > 60  # a rename in the sync suite must not silently empty this module
