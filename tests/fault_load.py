"""A bounded load for the fault tests: callers checking users round-robin on one limiter
(threads for the blocking limiter, tasks on one loop for the asyncio one), every decision
recorded as (start, end, outcome, user), outcome True/False or the exception. Stops on
stop() or after max_seconds, whichever comes first. limiter_options are passed on to the
limiter (e.g. min_replicas)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

from genai_ratelimit import RateLimiterError
from helpers_async import LimiterFactory, run_async

Record = tuple[float, float, Any, str]


class Load:
    def __init__(self, make_limiter: LimiterFactory, url: str, users: list[str], *, limit: int,
                 window: int, callers: int = 8, max_seconds: float = 20.0,
                 socket_timeout: float = 1.0,
                 limiter_options: dict[str, Any] | None = None) -> None:
        self.records: list[Record] = []
        self.stopping = threading.Event()
        self.users = users
        self.limit = limit
        self.window = window
        self.callers = callers
        self.max_seconds = max_seconds
        self.socket_timeout = socket_timeout
        self.limiter_options = limiter_options or {}
        self._thread = threading.Thread(target=self._run, args=(make_limiter, url))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join(60)

    def wait_for(self, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.records) < count:
            assert time.monotonic() < deadline, "the load made no progress"
            time.sleep(0.01)  # polling a condition, bounded

    def _turns(self, k: int, until: float) -> Iterator[str]:
        i = k
        while not self.stopping.is_set() and time.monotonic() < until:
            yield self.users[i % len(self.users)]
            i += self.callers

    def _record(self, user: str, start: float, outcome: Any) -> None:
        self.records.append((start, time.monotonic(), outcome, user))

    def _run(self, make_limiter: LimiterFactory, url: str) -> None:
        until = time.monotonic() + self.max_seconds
        if not make_limiter.is_async:
            limiter = make_limiter(url, socket_timeout=self.socket_timeout,
                                   max_connections=self.callers, **self.limiter_options)

            def caller(k: int) -> None:
                for user in self._turns(k, until):
                    start = time.monotonic()
                    try:
                        outcome: Any = limiter.check(user, self.limit, self.window)[0]
                    except RateLimiterError as exc:
                        outcome = exc
                    self._record(user, start, outcome)

            threads = [threading.Thread(target=caller, args=(k,)) for k in range(self.callers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            return
        native = make_limiter.native(url, socket_timeout=self.socket_timeout,
                                     **self.limiter_options)

        async def caller(k: int) -> None:
            for user in self._turns(k, until):
                start = time.monotonic()
                try:
                    outcome: Any = (await native.check(user, self.limit, self.window))[0]
                except RateLimiterError as exc:
                    outcome = exc
                self._record(user, start, outcome)
                await asyncio.sleep(0)

        async def main() -> None:
            await asyncio.gather(*(caller(k) for k in range(self.callers)))
            await native.aclose()

        run_async(main(), make_limiter.loop_factory)


def allowed_per_user(records: list[Record]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _start, _end, outcome, user in records:
        if outcome is True:
            counts[user] = counts.get(user, 0) + 1
    return counts
