"""AsyncRateLimiter input rules on a running loop: a bad argument raises TypeError or
ValueError before any Redis I/O, not even a connect (test_limiter_input.py proves the full
matrix of bad values for every limiter kind, through the blocking adapter for the async
ones)."""

from __future__ import annotations

import pytest
import redis

from helpers_async import LoopFactory, run_async
from helpers_core import connections_received

# The coroutine API on each event loop: loop_factory is the kind's (tests/conftest.py).
pytestmark = pytest.mark.limiter_kinds(
    "asyncio", "uvloop",
    reason=("argument errors raised on a running loop; the full matrix runs for every kind in "
            "test_limiter_input.py"))

BAD_CALLS = [
    pytest.param("check", ("", 10, 60), ValueError, id="empty-user"),
    pytest.param("check", (None, 10, 60), TypeError, id="None-user"),
    pytest.param("check", ("u", 0, 60), ValueError, id="zero-limit"),
    pytest.param("check", ("u", True, 60), (TypeError, ValueError), id="bool-limit"),
    pytest.param("check", ("u", 10, 1.5), TypeError, id="float-window"),
    pytest.param("check", ("u", 10, 10**30), ValueError, id="huge-window"),
    pytest.param("check_windows", ("u", []), ValueError, id="no-windows"),
    pytest.param("check_windows", ("u", [(10,)]), (TypeError, ValueError), id="one-element-pair"),
    pytest.param("check_windows", ("u", "nope"), (TypeError, ValueError), id="str-windows"),
]


@pytest.mark.parametrize("method, args, error", BAD_CALLS)
def test_bad_arguments_raise_before_the_first_connect(
        redis_url: str, redis_client: redis.Redis, loop_factory: LoopFactory,
        method: str, args: tuple, error: type[Exception]) -> None:
    from genai_ratelimit import AsyncRateLimiter

    async def main() -> None:
        async with AsyncRateLimiter(redis_url) as limiter:
            before = connections_received(redis_client)
            with pytest.raises(error):
                await getattr(limiter, method)(*args)
            assert connections_received(redis_client) == before  # not even dialled
        assert redis_client.keys("*") == []

    run_async(main(), loop_factory)
