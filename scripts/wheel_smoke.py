"""The smoke test of a built wheel: cibuildwheel's test-command (pyproject.toml), run in an
environment that holds the installed wheel and not the source tree, on the machine that
built it; tests/test_release.py runs it on this machine's wheel too.

It imports the extension from where pip put it, starts a throwaway redis-server (on PATH:
the release workflow installs one) and decides with both limiters over a unix socket, on the
server's clock and on a manual one: the C extension, its bundled hiredis and the scripts
work together. Prints one line; exits non-zero on any failure."""

from __future__ import annotations

import asyncio
import platform
import sys
from pathlib import Path

import genai_ratelimit
from genai_ratelimit import AsyncRateLimiter, RateLimiter
from genai_ratelimit.testing import ManualClock, ThrowawayRedis


def check_sync(url: str, clock: ManualClock) -> None:
    with RateLimiter(url) as limiter:
        assert [limiter.check("smoke-server", 2, 60) for _ in range(3)] == [
            (True, 1, 0), (True, 0, 0), (False, 0, 60)]
    with RateLimiter(url, clock="client") as limiter:
        assert limiter.check("smoke-client", 1, 60) == (True, 0, 0)
        assert limiter.check("smoke-client", 1, 60) == (False, 0, 60)
        clock.advance(60)
        assert limiter.check("smoke-client", 1, 60) == (True, 0, 0)


async def check_async(url: str) -> None:
    async with AsyncRateLimiter(url) as limiter:
        answers = await asyncio.gather(*(limiter.check("smoke-async", 2, 60) for _ in range(3)))
        assert sorted(answers) == [(False, 0, 60), (True, 0, 0), (True, 1, 0)], answers


def main() -> None:
    source = Path(__file__).resolve().parent.parent / "genai_ratelimit"
    installed = Path(genai_ratelimit.__file__).resolve().parent
    assert installed != source, f"{installed} is the source tree, not the installed wheel"
    with ThrowawayRedis() as redis, ManualClock() as clock:
        check_sync(redis.url, clock)
        asyncio.run(check_async(redis.url))
    print(f"genai-ratelimit {genai_ratelimit.__version__} from {installed}: sync, asyncio and the "
          f"manual clock decide on {platform.system()} {platform.machine()}, "
          f"Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
