"""The package's pytest plugin (genai_ratelimit.pytest_plugin, docs/testing.md), as a user
meets it: test files of a user's project run by pytest in a subprocess (pytester), where the
plugin is there because the package is installed (its pytest11 entry point), nothing else. The
examples of docs/testing.md are those files. Then the fixtures used here directly, on this
suite's side (the plugin is active in this suite too, beside tests/conftest.py), and the
ManualClock's rules.

Every inner run starts its own throwaway redis-server, or uses the one REDIS_URL names."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import re
from pathlib import Path

import pytest
import redis

from genai_ratelimit import RateLimiter
from genai_ratelimit.testing import LimiterFactory, ManualClock, ThrowawayRedis
from helpers_docs import DOCS, code_blocks

pytest_plugins = ["pytester"]

pytestmark = [
    pytest.mark.not_asan(reason="the user's test files run in pytest subprocesses"),
    pytest.mark.no_hiredis1(reason="the user's test files run in pytest subprocesses"),
]

TESTING_PAGE = DOCS / "testing.md"
STRICT_INI = "[pytest]\nfilterwarnings =\n    error\n    ignore:.*httpx2:UserWarning\n"


@pytest.fixture
def user_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A user's project: pytest with warnings as errors, plugins autoloaded (the entry point
    is the only way ours arrives), no REDIS_URL unless the test sets one."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    pytester.makefile(".ini", pytest=STRICT_INI)
    return pytester


def run(project: pytest.Pytester, *args: str) -> pytest.RunResult:
    return project.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider", *args,
                                        timeout=120)


def user_files_of_the_docs() -> dict[str, str]:
    """The test files docs/testing.md shows, by the file name of their first line."""
    files = {}
    for block in code_blocks(TESTING_PAGE):
        if block.language == "python" and block.tested_by is not None:
            match = re.match(r"# tests/(test_\w+\.py)\n", block.code)
            assert match, f"{block.name}: a test file's block starts with its name"
            assert block.tested_by == "tests/test_pytest_plugin.py"
            files[match.group(1)] = block.code
    return files


def test_the_plugin_is_registered_by_its_entry_point() -> None:
    [entry] = [entry for entry in importlib.metadata.entry_points(group="pytest11")
               if entry.name == "genai_ratelimit"]
    assert entry.value == "genai_ratelimit.pytest_plugin"
    assert entry.dist is not None and entry.dist.name == "genai-ratelimit"


def test_the_fixtures_are_listed_in_a_user_s_project(user_project: pytest.Pytester) -> None:
    user_project.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    output = run(user_project, "--fixtures").stdout.str()
    for name in ("ratelimit_factory", "ratelimit_clock", "ratelimit_redis_url", "ratelimit_redis_server"):
        assert re.search(rf"^{name}( \[session scope\])? -- .*genai_ratelimit", output, re.MULTILINE), name


def test_with_autoloading_off_the_plugin_loads_by_name(user_project: pytest.Pytester,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    user_project.makepyfile(test_one="""
        def test_one(ratelimit_factory):
            assert ratelimit_factory.rate_limiter().check("u", 1, 60) == (True, 0, 0)
        """)
    run(user_project).assert_outcomes(errors=1)  # fixture 'ratelimit_factory' not found
    run(user_project, "-p", "genai_ratelimit.pytest_plugin").assert_outcomes(passed=1)


def test_the_docs_test_files_pass_sync_async_and_fastapi(user_project: pytest.Pytester) -> None:
    files = user_files_of_the_docs()
    assert set(files) == {"test_quota.py", "test_quota_async.py", "test_app.py"}
    user_project.makepyfile(**{name.removesuffix(".py"): code for name, code in files.items()})
    result = run(user_project, "-v")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*test_quota_async.py::test_the_async_limiter_reopens_too*PASSED*"])


def test_a_frozen_clock_really_decides(user_project: pytest.Pytester) -> None:
    """The docs' tests pass because the clock moved, not by luck: without advance() the same
    check is refused, sync and async."""
    user_project.makepyfile(test_frozen="""
        import asyncio

        def test_sync(ratelimit_factory, ratelimit_clock):
            limiter = ratelimit_factory.rate_limiter()
            assert limiter.check("u", 1, 60)[0]
            ratelimit_clock.advance(59.999)
            assert limiter.check("u", 1, 60) == (False, 0, 1)

        def test_async(ratelimit_factory, ratelimit_clock):
            async def main():
                limiter = ratelimit_factory.async_rate_limiter()
                first = await limiter.check("u", 1, 60)
                ratelimit_clock.set(ratelimit_clock.now_ms - 3_600_000)  # an hour back
                return first, await limiter.check("u", 1, 60)
            assert asyncio.run(main()) == ((True, 0, 0), (False, 0, 3660))
        """)
    run(user_project).assert_outcomes(passed=2)


def test_one_server_per_session_flushed_before_each_test_and_stopped_by_its_pid(
        user_project: pytest.Pytester, tmp_path: Path) -> None:
    seen = tmp_path / "seen.txt"
    user_project.makepyfile(test_server=f"""
        import pytest

        @pytest.mark.parametrize("n", range(3))
        def test_fresh(ratelimit_factory, ratelimit_redis_server, n):
            with open({str(seen)!r}, "a") as out:
                out.write(f"{{ratelimit_redis_server.pid}} {{ratelimit_redis_server.directory}}\\n")
            assert ratelimit_factory.url == ratelimit_redis_server.url
            assert ratelimit_factory.key_prefix == "ratelimit"
            limiter = ratelimit_factory.rate_limiter()
            assert limiter.check("same-user", 1, 86400) == (True, 0, 0)
        """)
    run(user_project).assert_outcomes(passed=3)
    lines = set(seen.read_text().splitlines())
    assert len(lines) == 1, lines  # one server for the session
    pid_text, directory = lines.pop().split(" ", 1)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_text), 0)
    assert not Path(directory).exists()


def test_without_redis_a_test_fails_saying_what_to_install(user_project: pytest.Pytester,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server there; pytest runs by full path
    user_project.makepyfile(test_needs="def test_needs(ratelimit_factory):\n    pass\n")
    result = run(user_project)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([
        "*genai-ratelimit's pytest plugin: redis-server is not on PATH: install "
        "Redis (apt-get install redis-server, brew install redis) or set REDIS_URL*"])


def test_ratelimit_missing_redis_skip_skips_instead(user_project: pytest.Pytester,
                                                    monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    user_project.makefile(".ini", pytest=STRICT_INI + "ratelimit_missing_redis = skip\n")
    user_project.makepyfile(test_needs="def test_needs(ratelimit_factory):\n    pass\n")
    result = run(user_project, "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*redis-server is not on PATH*"])


def test_on_redis_url_nothing_is_flushed_and_each_test_has_its_own_prefix(
        user_project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        redis_url: str, redis_client: redis.Redis) -> None:
    redis_client.set("not-the-tests", "kept")
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("PATH", str(tmp_path))  # and no server could be started
    user_project.makepyfile(test_shared=f"""
        import pytest

        @pytest.mark.parametrize("n", range(2))
        def test_own_prefix(ratelimit_factory, ratelimit_redis_url, n):
            assert ratelimit_redis_url == {redis_url!r}
            assert ratelimit_factory.key_prefix.startswith("ratelimit-test-")
            limiter = ratelimit_factory.rate_limiter()
            assert limiter.check("same-user", 1, 60) == (True, 0, 0)
        """)
    run(user_project).assert_outcomes(passed=2)
    assert redis_client.get("not-the-tests") == b"kept"
    prefixes = {key.decode().split(":")[0] for key in redis_client.scan_iter("ratelimit-test-*")}
    assert len(prefixes) == 2, prefixes


def test_the_clock_is_given_back_after_the_test(user_project: pytest.Pytester) -> None:
    user_project.makepyfile(test_clock="""
        import time

        def test_a_moved_clock(ratelimit_clock):
            ratelimit_clock.set(978_307_200_000)  # 2001

        def test_a_later_test_decides_now(ratelimit_factory):
            limiter = ratelimit_factory.rate_limiter()
            reservation = limiter.reserve("u", [(5, 60)])
            assert abs(reservation.timestamp_ms - time.time() * 1000) < 60_000
        """)
    run(user_project).assert_outcomes(passed=2)


# --- the fixtures used right here (this suite has the plugin too) -----------------------------


def test_the_plugin_s_limiters_follow_its_clock_here(ratelimit_factory: LimiterFactory,
                                                     ratelimit_clock: ManualClock, user_id: str) -> None:
    limiter = ratelimit_factory.rate_limiter()
    assert [limiter.check(user_id, 2, 10)[0] for _ in range(3)] == [True, True, False]
    ratelimit_clock.advance(9.5)
    assert limiter.check(user_id, 2, 10) == (False, 0, 1)
    ratelimit_clock.advance(0.5)

    async def main() -> tuple[bool, int, int]:
        async with ratelimit_factory.async_rate_limiter() as async_limiter:
            return await async_limiter.check(user_id, 2, 10)

    # Both entries (of one frozen millisecond) left the window together: 1 of 2 used now.
    assert asyncio.run(main()) == (True, 1, 0)  # the same window, seen by the asyncio limiter


def test_a_server_clock_limiter_is_not_moved(ratelimit_factory: LimiterFactory,
                                             ratelimit_clock: ManualClock, user_id: str) -> None:
    limiter = ratelimit_factory.rate_limiter(clock="server")
    assert limiter.check(user_id, 1, 60) == (True, 0, 0)
    ratelimit_clock.advance(3600)
    assert limiter.check(user_id, 1, 60)[0] is False


def test_one_manual_clock_runs_at_a_time(ratelimit_clock: ManualClock) -> None:
    other = ManualClock()
    with pytest.raises(RuntimeError, match="another ManualClock is running"):
        other.start()
    assert ratelimit_clock.running and not other.running
    other.stop()  # not running: harmless
    assert ratelimit_clock.running


@pytest.mark.parametrize(("call", "error"), [
    (lambda: ManualClock(0), ValueError),
    (lambda: ManualClock(1.5), TypeError),  # type: ignore[arg-type]
    (lambda: ManualClock(True), TypeError),
    (lambda: ManualClock(10**18), ValueError),
    (lambda: ManualClock(1_000).advance(-1), ValueError),
    (lambda: ManualClock(1_000).advance("1"), TypeError),  # type: ignore[arg-type]
])
def test_the_manual_clock_checks_its_input(call: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        call()  # type: ignore[operator]


def test_a_throwaway_redis_is_reachable_only_by_its_socket() -> None:
    with ThrowawayRedis() as server:
        assert server.url.startswith("unix://") and server.pid is not None
        limiter = RateLimiter(server.url)
        try:
            assert limiter.check("u", 1, 60) == (True, 0, 0)
            server.flushdb()
            assert limiter.check("u", 1, 60) == (True, 0, 0)
        finally:
            limiter.close()
        client = redis.Redis(unix_socket_path=server.unix_path)
        try:
            assert client.config_get("port") == {"port": "0"}
        finally:
            client.close()
        pid = server.pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
