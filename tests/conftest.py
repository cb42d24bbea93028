"""Shared fixtures: a real redis-server per test session (or the one REDIS_URL names),
a clean database per test, a fresh private server for tests that kill or restart it, and the
kinds of limiter every limiter test runs against.

The kinds: "sync" (the blocking RateLimiter), "asyncio" and "uvloop" (AsyncRateLimiter on
that event loop; uvloop comes with the test extra, see helpers_async.limiter_kind_params).
A test that uses `limiter_kind`, directly or through `make_limiter`, `limiter`,
`unreachable_limiter` or `loop_factory`, runs once per kind. A test that is inherently of
some kinds only says so, with the reason:

    @pytest.mark.limiter_kinds("sync", reason="fork(): ...")

`pytest --limiter-kinds=sync,asyncio` deselects the other kinds' cases (e.g. under
valgrind).

The storages: every test that uses `storage`, directly or through `make_limiter` (and so
`limiter`, `unreachable_limiter`), also runs once per storage, "zset" (sorted sets) and
"compact" (one string per window), with the same decisions expected of both. A test of the
sorted sets' own key shape says so: @pytest.mark.storages("zset", reason="...").

Tests marked `wheel` (tests/test_wheel_install.py) check a built distribution and run only
under `make test-wheel`, which builds it and passes --wheel-dist; elsewhere they are deselected
(and counted as such in pytest's summary)."""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from helpers_async import (
    ASYNC_KINDS,
    LIMITER_KINDS,
    LimiterFactory,
    LoopFactory,
    limiter_kind_params,
    loop_factory_of,
)
from helpers_core import closed_port_url
from redis_cluster import RedisCluster
from redis_server import RedisServer, env_redis_url

# The kill switch must never leak in from the developer's shell.
os.environ.pop("RATE_LIMIT_DISABLED", None)
# Nor may a tiers file named in the shell change the budgets the tests expect.
os.environ.pop("GENAI_RATELIMIT_TIERS", None)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The URL of the session's Redis: REDIS_URL when set (e.g. Redis in Docker), else a
    redis-server this session starts on a free loopback port."""
    external = env_redis_url()
    if external:
        yield external
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def redis_cluster_session() -> Iterator[RedisCluster]:
    """A real 6-node Redis Cluster (3 masters, 3 replicas) on free loopback ports, started
    once per session (about 2 s) and stopped by pid. Tests must not kill its nodes: the
    failover tests start clusters of their own."""
    with RedisCluster() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster(redis_cluster_session: RedisCluster) -> RedisCluster:
    """The session's cluster, every master flushed before the test."""
    redis_cluster_session.flush()
    return redis_cluster_session


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """An inspection client (redis-py) on a database flushed before the test."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.script_flush()
    try:
        yield client
    finally:
        client.close()


# ------------------------------------------------------------------ limiter kinds

KINDS_MARKER = "limiter_kinds"
STORAGES_MARKER = "storages"
STORAGES = ("zset", "compact")
# Modules whose tests read the sorted sets themselves and that other work is reshaping now
# (the FastAPI layer's rewrite, the cluster and Sentinel router, the command line and
# metrics): they join the compact storage once they read the windows
# through tests/helpers_core.py's logged / logged_entries (their decisions are the ones
# test_storage_equivalence.py compares; the compact storage's cluster keys are in
# test_compact.py). test_reply_bounds scripts its server's replies in the sorted-set
# scripts' shape (the compact decision answers an 8th element, its tie).
ZSET_ONLY_MODULES = ("test_fastapi", "test_cluster", "test_sentinel", "test_cli", "test_metrics",
                     "test_tiers_config", "test_reply_bounds")
WHEEL_MARKER = "wheel"
# The tests make test-asan / make test-hiredis1 leave out (pyproject.toml registers them).
BUILD_MARKERS = ("not_asan", "no_hiredis1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--limiter-kinds", default=",".join(LIMITER_KINDS), metavar="KINDS",
        help=f"comma-separated limiter kinds to run ({', '.join(LIMITER_KINDS)}); the cases "
             "of the others are deselected")
    # `make test-wheel` (tests/test_wheel_install.py): the built distribution and what its
    # tests need, all made by the make target. Without --wheel-dist those tests are deselected.
    parser.addoption("--wheel-dist", metavar="DIR",
                     help="the directory holding the manylinux wheel and the sdist to test")
    parser.addoption("--debian-root", metavar="DIR", help="the root of scripts/debian-root.sh")
    parser.addoption("--arm64-root", metavar="DIR",
                     help="the arm64 root of `ARCH=arm64 scripts/debian-root.sh` (qemu-user-static), "
                          "where the aarch64 wheel of --wheel-dist is checked")
    parser.addoption("--wheelhouse", metavar="DIR",
                     help="wheels of setuptools, wheel and examples/requirements.txt, for --no-index")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{KINDS_MARKER}(*kinds, reason): the limiter kinds this test runs against "
                   f"(default: all of {', '.join(LIMITER_KINDS)}), and why only those")
    config.addinivalue_line(
        "markers", f"{STORAGES_MARKER}(*storages, reason): the storages this test runs against "
                   f"(default: all of {', '.join(STORAGES)}), and why only those")
    config.addinivalue_line(
        "markers", f"{WHEEL_MARKER}: tests of the built wheel and sdist in a Debian root "
                   "(make test-wheel); deselected unless --wheel-dist is given")


def marked(metafunc: pytest.Metafunc, name: str, default: tuple[str, ...]) -> tuple[str, ...]:
    """The values a test's `name` marker names (it must say why), else `default`."""
    marker = metafunc.definition.get_closest_marker(name)
    if marker is None:
        return default
    if not marker.kwargs.get("reason"):
        pytest.fail(f"{metafunc.definition.nodeid}: {name}({', '.join(marker.args)}) needs a "
                    "reason=... saying why the others do not apply", pytrace=False)
    return tuple(marker.args)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One case per limiter kind for every test that depends on limiter_kind, and one per
    storage for every test that depends on storage."""
    if "storage" in metafunc.fixturenames:
        zset_only = metafunc.module.__name__.startswith(ZSET_ONLY_MODULES)
        storages = marked(metafunc, STORAGES_MARKER, ("zset",) if zset_only else STORAGES)
        metafunc.parametrize("storage", storages, indirect=True)
    if "limiter_kind" not in metafunc.fixturenames:
        return
    kinds = marked(metafunc, KINDS_MARKER, LIMITER_KINDS)
    if "loop_factory" in metafunc.fixturenames and not set(kinds) <= set(ASYNC_KINDS):
        pytest.fail(f"{metafunc.definition.nodeid} takes loop_factory, which only the async "
                    f"kinds have: mark it {KINDS_MARKER}({', '.join(map(repr, ASYNC_KINDS))}, "
                    "reason=...)", pytrace=False)
    metafunc.parametrize("limiter_kind", limiter_kind_params(kinds), indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = {kind.strip() for kind in config.getoption("--limiter-kinds").split(",")}
    unknown = selected - set(LIMITER_KINDS)
    if unknown:
        raise pytest.UsageError(f"--limiter-kinds: unknown kind(s) {', '.join(sorted(unknown))}")
    for item in items:
        for marker in item.iter_markers():
            if marker.name in BUILD_MARKERS and not marker.kwargs.get("reason"):
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{marker.name} needs a "
                                        "reason=... saying why that build leaves it out")
    kept, deselected = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        kind = callspec.params.get("limiter_kind") if callspec is not None else None
        other_kind = kind is not None and kind not in selected
        wheel_test = item.get_closest_marker(WHEEL_MARKER) is not None
        if other_kind or (wheel_test and not config.getoption("--wheel-dist")):
            deselected.append(item)
        else:
            kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.fixture
def limiter_kind(request: pytest.FixtureRequest) -> str:
    """The kind of limiter under test: "sync", "asyncio" or "uvloop" (parametrised by
    pytest_generate_tests). Fails the uvloop case when GENAI_RATELIMIT_REQUIRE_UVLOOP=1
    kept it although uvloop cannot be imported."""
    kind: str = request.param
    loop_factory_of(kind)
    return kind


@pytest.fixture
def storage(request: pytest.FixtureRequest) -> str:
    """The storage under test: "zset" or "compact" (parametrised by pytest_generate_tests)."""
    return str(request.param)


@pytest.fixture
def make_limiter(limiter_kind: str, storage: str) -> Iterator[LimiterFactory]:
    """make_limiter(url, **options): a limiter of the kind under test with the blocking
    interface (RateLimiter, or the blocking adapter over an AsyncRateLimiter on a loop of the
    kind); make_limiter.native(url, **options): the RateLimiter or AsyncRateLimiter itself.
    Everything it made is closed after the test. See helpers_async.LimiterFactory."""
    factory = LimiterFactory(limiter_kind, storage)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def loop_factory(limiter_kind: str) -> LoopFactory:
    """The event loop factory of an async kind, for tests that drive AsyncRateLimiter's
    coroutines themselves (they are marked limiter_kinds("asyncio", "uvloop", ...))."""
    factory = loop_factory_of(limiter_kind)
    assert factory is not None, "pytest_generate_tests keeps the sync kind away from loop_factory"
    return factory


@pytest.fixture
def limiter(make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis):
    """A limiter of the kind under test on the session's Redis, on a clean database, with
    the blocking interface."""
    return make_limiter(redis_url)


@pytest.fixture
def unreachable_limiter(make_limiter: LimiterFactory):
    """A limiter of the kind under test on a closed port: any Redis I/O would raise
    RateLimiterUnavailable, so an input error raised instead proves the input was checked
    first, and an answer proves nothing reached for Redis."""
    return make_limiter(closed_port_url(), connect_timeout=0.5, socket_timeout=0.5)


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server owned by this one test, to stop, kill, pause or restart at will."""
    with RedisServer() as server:
        yield server


_counter = itertools.count()


@pytest.fixture
def user_id() -> str:
    """A user id no other test uses."""
    return f"user-{uuid.uuid4().hex[:12]}-{next(_counter)}"


@pytest.fixture(autouse=True)
def _no_kill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RATE_LIMIT_DISABLED", raising=False)
