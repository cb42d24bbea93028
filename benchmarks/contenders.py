"""The contenders: every row of the main table, in one clearly marked list.

A contender is a name, the workload it runs, and a `setup(ctx)` that returns
`(run, close)`, where `run(duration, max_calls, warmup) -> Sample` measures one round.
run.py runs every available contender once per round, alternating the order (forward, then
reversed) so that drift on a noisy VM lands on everybody alike, and reports medians over rounds
with ratios to the baselines of the same workload (per-round ratios, then their median).

Roles:
  RAW      the raw hiredis C client, sequential: the physical limit of one connection.
  REDISPY  redis-py `register_script` of the same script: the design's way, the thing to beat.
  ASYNC_REDISPY  redis.asyncio at the same concurrency: issue 5's baseline.

HOOK FOR ASYNC CONTENDERS (issue 5): `ASYNC_CONTENDERS` below. Each entry is built for every
concurrency in ASYNC_CONCURRENCY; `AsyncRateLimiter` rows appear by themselves as soon as
`genai_ratelimit.AsyncRateLimiter` exists (guarded with hasattr until then).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchlib import (
    AsyncRedisPyLimiter,
    FourOpLimiter,
    RawClient,
    RedisPyLimiter,
    RedisTarget,
    Sample,
    async_timed_loop,
    limits_storage_uri,
    parser_name,
    redis_py_client,
    timed_loop,
)

BIG = 10**9  # "huge limit": allow-heavy


@dataclass(frozen=True)
class Workload:
    title: str
    users: int
    windows: tuple[tuple[int, int], ...]  # (limit, window_seconds), shortest window first

    def user_ids(self) -> list[str]:
        return [f"user_{u}" for u in range(self.users)]

    def raw_args(self) -> list[str]:
        args = ["--users", str(self.users)]
        for limit, window in self.windows:
            args += ["--window", f"{window}:{limit}"]
        return args


WORKLOADS: dict[str, Workload] = {
    "1u-allow": Workload("1 user, allow-heavy (limit 1e9 / 60 s)", 1, ((BIG, 60),)),
    "1ku-allow": Workload("1,000 users round-robin, allow-heavy (limit 1e9 / 60 s)", 1000, ((BIG, 60),)),
    "1u-reject": Workload("1 user, reject-heavy (limit 1 / 60 s)", 1, ((1, 60),)),
    "1ku-reject": Workload("1,000 users round-robin, reject-heavy (limit 1 / 60 s)", 1000, ((1, 60),)),
    "1ku-2win": Workload("1,000 users, minute + day windows, allow-heavy (check_windows)", 1000,
                         ((BIG, 60), (BIG, 86400))),
}

RAW, REDISPY, ASYNC_REDISPY = "raw", "redispy", "async-redispy"


@dataclass
class Context:
    target: RedisTarget


@dataclass
class Contender:
    name: str
    workload: str
    setup: Callable[[Context, str], tuple[Callable[[float, int, int], Sample], Callable[[], None]]]
    role: str = ""
    concurrency: int = 1           # in-flight calls (async section)
    quick: bool = True             # part of --quick
    needs_package: bool = False    # needs `import genai_ratelimit`
    available: Callable[[], str | None] = field(default=lambda: None)  # reason to skip, or None

    @property
    def key(self) -> str:
        return f"{self.workload}|{self.name}"


def _package_reason() -> str | None:
    try:
        import genai_ratelimit  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means "not measurable yet"
        return f"genai_ratelimit not importable ({type(exc).__name__}: {exc})"
    return None


def _async_package_reason() -> str | None:
    reason = _package_reason()
    if reason:
        return reason
    import genai_ratelimit
    if not hasattr(genai_ratelimit, "AsyncRateLimiter"):
        return "genai_ratelimit.AsyncRateLimiter does not exist yet (issue 5)"
    return None


# --------------------------------------------------------------------------- setups (sync)

def _raw(wl: Workload, mode: str, depth: int):
    def setup(ctx: Context, prefix: str):
        client = RawClient(ctx.target, ["--mode", mode, "--depth", str(depth), "--prefix", prefix,
                                        *wl.raw_args()])
        return client.run, client.close
    return setup


def _package_sync(wl: Workload):
    def setup(ctx: Context, prefix: str):
        from genai_ratelimit import RateLimiter
        limiter = RateLimiter(ctx.target.url, key_prefix=prefix)
        if len(wl.windows) == 1:
            limit, window = wl.windows[0]
            fn, arglist = limiter.check, [(user, limit, window) for user in wl.user_ids()]
        else:
            windows = list(wl.windows)
            fn, arglist = limiter.check_windows, [(user, windows) for user in wl.user_ids()]

        def run(duration: float, max_calls: int, warmup: int) -> Sample:
            return timed_loop(fn, arglist, duration, max_calls, warmup)
        return run, limiter.close
    return setup


def _redispy(wl: Workload, pure_python_parser: bool = False):
    def setup(ctx: Context, prefix: str):
        client = redis_py_client(ctx.target, pure_python_parser)
        limiter = RedisPyLimiter(client, key_prefix=prefix)
        if len(wl.windows) == 1:
            limit, window = wl.windows[0]
            fn, arglist = limiter.check, [(user, limit, window) for user in wl.user_ids()]
        else:
            windows = list(wl.windows)
            fn, arglist = limiter.check_windows, [(user, windows) for user in wl.user_ids()]
        expected = "_RESP2Parser" if pure_python_parser else "_HiredisParser"
        actual = parser_name(client)
        if actual not in (expected, expected.replace("RESP2", "RESP3")):
            raise RuntimeError(f"redis-py parser is {actual}, expected {expected}")

        def run(duration: float, max_calls: int, warmup: int) -> Sample:
            return timed_loop(fn, arglist, duration, max_calls, warmup)
        return run, client.close
    return setup


def _four_op(wl: Workload):
    def setup(ctx: Context, prefix: str):
        client = redis_py_client(ctx.target)
        limiter = FourOpLimiter(client, key_prefix=prefix)
        limit, window = wl.windows[0]
        arglist = [(user, limit, window) for user in wl.user_ids()]

        def run(duration: float, max_calls: int, warmup: int) -> Sample:
            return timed_loop(limiter.check, arglist, duration, max_calls, warmup)
        return run, client.close
    return setup


def _limits(wl: Workload):
    def setup(ctx: Context, prefix: str):
        from limits import RateLimitItemPerMinute
        from limits.storage import storage_from_string
        from limits.strategies import MovingWindowRateLimiter
        limit, window = wl.windows[0]
        assert window == 60, "limits rows use per-minute items"
        storage = storage_from_string(limits_storage_uri(ctx.target), key_prefix=prefix)
        limiter = MovingWindowRateLimiter(storage)
        item = RateLimitItemPerMinute(limit)
        arglist = [(item, user) for user in wl.user_ids()]

        def run(duration: float, max_calls: int, warmup: int) -> Sample:
            return timed_loop(limiter.hit, arglist, duration, max_calls, warmup, verdict="bool")

        def close() -> None:
            storage.get_connection().close()
        return run, close
    return setup


def _limits_reason() -> str | None:
    try:
        import limits  # noqa: F401
    except ImportError:
        return "the limits package is not installed (pip install '.[bench]')"
    return None


# --------------------------------------------------------------------------- setups (async)

def _async_run(coroutine_factory: Callable[[], Any]) -> Sample:
    return asyncio.run(coroutine_factory())


def _async_redispy(wl: Workload, concurrency: int):
    def setup(ctx: Context, prefix: str):
        limit, window = wl.windows[0]
        arglist = [(user, limit, window) for user in wl.user_ids()]

        async def measure(duration: float, max_calls: int, warmup: int) -> Sample:
            import redis.asyncio
            # One connection per in-flight call is how redis.asyncio serves concurrency; its
            # pool refuses more than max_connections, so allow as many as there are coroutines.
            client = redis.asyncio.Redis(**ctx.target.redis_kwargs(), max_connections=max(concurrency, 50))
            try:
                limiter = AsyncRedisPyLimiter(client, key_prefix=prefix)
                return await async_timed_loop(limiter.check, arglist, concurrency, duration,
                                              max_calls, warmup)
            finally:
                await client.aclose()

        def run(duration: float, max_calls: int, warmup: int) -> Sample:
            return _async_run(lambda: measure(duration, max_calls, warmup))
        return run, lambda: None
    return setup


def _async_limits(wl: Workload, concurrency: int):
    def setup(ctx: Context, prefix: str):
        limit, window = wl.windows[0]

        async def measure(duration: float, max_calls: int, warmup: int) -> Sample:
            from limits import RateLimitItemPerMinute
            from limits.aio.strategies import MovingWindowRateLimiter
            from limits.storage import storage_from_string
            # implementation="redispy": limits' async Redis storage on redis.asyncio (its
            # default, coredis, is another client library; redis-py is what this suite pins).
            storage = storage_from_string(limits_storage_uri(ctx.target, asynchronous=True),
                                          key_prefix=prefix, implementation="redispy",
                                          max_connections=max(concurrency, 50))
            limiter = MovingWindowRateLimiter(storage)
            item = RateLimitItemPerMinute(limit)
            arglist = [(item, user) for user in wl.user_ids()]
            try:
                return await async_timed_loop(limiter.hit, arglist, concurrency, duration,
                                              max_calls, warmup, verdict="bool")
            finally:
                await storage.bridge.storage.aclose()

        def run(duration: float, max_calls: int, warmup: int) -> Sample:
            return _async_run(lambda: measure(duration, max_calls, warmup))
        return run, lambda: None
    return setup


def _package_threadpool(wl: Workload, concurrency: int):
    """The sync limiter the way a FastAPI app without the async limiter runs it: each check in a
    worker thread (40 threads, like Starlette's default anyio capacity)."""
    def setup(ctx: Context, prefix: str):
        from genai_ratelimit import RateLimiter
        limiter = RateLimiter(ctx.target.url, key_prefix=prefix)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=40)
        limit, window = wl.windows[0]
        arglist = [(user, limit, window) for user in wl.user_ids()]

        async def measure(duration: float, max_calls: int, warmup: int) -> Sample:
            loop = asyncio.get_running_loop()

            def check(user: str, limit: int, window: int):
                return loop.run_in_executor(pool, limiter.check, user, limit, window)
            return await async_timed_loop(check, arglist, concurrency, duration, max_calls, warmup)

        def run(duration: float, max_calls: int, warmup: int) -> Sample:
            return _async_run(lambda: measure(duration, max_calls, warmup))

        def close() -> None:
            pool.shutdown(wait=True)
            limiter.close()
        return run, close
    return setup


def _package_async(wl: Workload, concurrency: int):
    def setup(ctx: Context, prefix: str):
        from genai_ratelimit import AsyncRateLimiter  # type: ignore[attr-defined]
        limit, window = wl.windows[0]
        arglist = [(user, limit, window) for user in wl.user_ids()]

        async def measure(duration: float, max_calls: int, warmup: int) -> Sample:
            limiter = AsyncRateLimiter(ctx.target.url, key_prefix=prefix)
            try:
                return await async_timed_loop(limiter.check, arglist, concurrency, duration,
                                              max_calls, warmup)
            finally:
                await limiter.aclose()

        def run(duration: float, max_calls: int, warmup: int) -> Sample:
            return _async_run(lambda: measure(duration, max_calls, warmup))
        return run, lambda: None
    return setup


# =========================================================================== THE LIST
# Sequential contenders, one connection, one call at a time (and the raw pipelined ceiling).

def sync_contenders() -> list[Contender]:
    W = WORKLOADS
    rows: list[Contender] = []
    for key in ("1u-allow", "1ku-allow", "1u-reject", "1ku-reject", "1ku-2win"):
        wl = W[key]
        is_windows = len(wl.windows) > 1
        rows.append(Contender("raw hiredis C, sequential", key, _raw(wl, "seq", 1), role=RAW))
        rows.append(Contender("genai_ratelimit " + ("check_windows" if is_windows else "check"),
                              key, _package_sync(wl), needs_package=True,
                              available=_package_reason))
        rows.append(Contender("redis-py register_script" + (" (2 windows)" if is_windows else ""),
                              key, _redispy(wl), role=REDISPY))
    rows.append(Contender("redis-py register_script, pure-Python parser", "1u-allow",
                          _redispy(W["1u-allow"], pure_python_parser=True)))
    rows.append(Contender("limits MovingWindowRateLimiter.hit", "1u-allow", _limits(W["1u-allow"]),
                          available=_limits_reason))
    rows.append(Contender("limits MovingWindowRateLimiter.hit", "1ku-allow", _limits(W["1ku-allow"]),
                          available=_limits_reason))
    rows.append(Contender("limits MovingWindowRateLimiter.hit", "1u-reject", _limits(W["1u-reject"]),
                          available=_limits_reason))
    rows.append(Contender("original four-op script (redis-py, client time)", "1u-allow",
                          _four_op(W["1u-allow"])))
    rows.append(Contender("original four-op script (redis-py, client time)", "1u-reject",
                          _four_op(W["1u-reject"])))
    rows.append(Contender("raw hiredis C, pipelined depth 16", "1ku-allow", _raw(W["1ku-allow"], "pipe", 16)))
    rows.append(Contender("raw hiredis C, pipelined depth 64", "1ku-allow", _raw(W["1ku-allow"], "pipe", 64)))
    return rows


# HOOK: concurrent contenders (issue 5). Add a factory here: (workload, concurrency) -> setup.
ASYNC_CONCURRENCY = (1, 16, 64, 256)
ASYNC_CONCURRENCY_QUICK = (1, 64)
ASYNC_WORKLOAD = "1ku-allow"
ASYNC_CONTENDERS: list[tuple[str, Callable[[Workload, int], Any], str, Callable[[], str | None]]] = [
    # (row name, setup factory, role, availability)
    ("redis.asyncio register_script", _async_redispy, ASYNC_REDISPY, lambda: None),
    ("limits aio MovingWindowRateLimiter.hit (redis.asyncio)", _async_limits, "", _limits_reason),
    ("genai_ratelimit RateLimiter.check in a threadpool (40 threads)", _package_threadpool, "",
     _package_reason),
    ("genai_ratelimit AsyncRateLimiter.check", _package_async, "", _async_package_reason),
]


def async_contenders(quick: bool) -> list[Contender]:
    rows = []
    wl = WORKLOADS[ASYNC_WORKLOAD]
    for concurrency in ASYNC_CONCURRENCY:
        for name, factory, role, available in ASYNC_CONTENDERS:
            rows.append(Contender(f"{name} @ {concurrency} in flight", f"async-{concurrency}",
                                  factory(wl, concurrency), role=role, concurrency=concurrency,
                                  quick=concurrency in ASYNC_CONCURRENCY_QUICK,
                                  needs_package="genai_ratelimit" in name, available=available))
    return rows


def all_contenders(quick: bool) -> list[Contender]:
    rows = sync_contenders() + async_contenders(quick)
    return [row for row in rows if row.quick or not quick]
