"""The command line (`python -m genai_ratelimit`, genai_ratelimit/cli.py), run as a user runs
it: in a subprocess, against the session's real redis-server; its output, exit codes and
errors (a bad URL, a closed port, an unknown tier), and what it leaves in Redis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from genai_ratelimit import RateLimiter
from helpers_core import Monitor, closed_port_url

TIMEOUT = 30


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("REDIS_URL", "GENAI_RATELIMIT_TIERS", "RATE_LIMIT_DISABLED")}
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "genai_ratelimit", *args], capture_output=True,
                          text=True, timeout=TIMEOUT, env=environ, cwd="/")


def run_json(*args: str, env: dict[str, str] | None = None) -> Any:
    done = run(*args, "--json", env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_check_exits_0_while_allowed_and_1_once_refused(redis_url: str, redis_client: redis.Redis,
                                                       user_id: str) -> None:
    codes = [run("--url", redis_url, "check", user_id).returncode for _ in range(6)]
    assert codes == [0, 0, 0, 0, 0, 1]  # the free tier: 5 a minute
    refused = run("--url", redis_url, "check", user_id)
    assert refused.returncode == 1
    assert refused.stdout.startswith("refused by the 60 s window: retry after ")
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 5


def test_check_json_and_tier(redis_url: str, user_id: str) -> None:
    assert run_json("--url", redis_url, "check", user_id, "--tier", "pro", "--cost", "3") == {
        "allowed": True, "remaining": 57, "retry_after_s": 0, "window_seconds": 60}


def test_inspect_shows_each_window_as_redis_holds_it(redis_url: str, redis_client: redis.Redis,
                                                     user_id: str) -> None:
    with RateLimiter(redis_url) as limiter:
        for _ in range(5):
            limiter.check_windows(user_id, [(5, 60), (100, 86400)])
    oldest = int(redis_client.zrange(f"ratelimit:{user_id}:60", 0, 0, withscores=True)[0][1])
    before = redis_client.dump(f"ratelimit:{user_id}:60")
    report = run_json("--url", redis_url, "inspect", user_id)
    assert redis_client.dump(f"ratelimit:{user_id}:60") == before, "inspect writes nothing"
    minute, day, minute_tokens, day_tokens = report["windows"]
    assert (minute["window_seconds"], minute["used"], minute["limit"], minute["allowed"],
            minute["oldest_ms"]) == (60, 5, 5, False, oldest)
    assert 1 <= minute["retry_after_s"] <= 60
    assert (day["used"], day["limit"], day["remaining"], day["retry_after_s"]) == (5, 100, 94, 0)
    assert (minute_tokens["tokens"], minute_tokens["used"], minute_tokens["oldest_ms"]) == (
        True, 0, None)
    assert day_tokens["window_seconds"] == 86400

    table = run("--url", redis_url, "inspect", user_id)
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert lines[0].startswith(f"user {user_id!r}, tier free, Redis time ")
    assert lines[1].split() == ["window", "resource", "used", "limit", "oldest", "entry", "(UTC)",
                                "retry", "after"]
    assert lines[2].split()[:4] == ["60", "s", "requests", "5"]
    assert lines[2].split()[-2:] == [str(minute["retry_after_s"]), "s"]


def test_reset_frees_every_window_or_the_ones_named(redis_url: str, redis_client: redis.Redis,
                                                    user_id: str) -> None:
    for _ in range(5):
        assert run("--url", redis_url, "check", user_id).returncode == 0
    only_minute = run("--url", redis_url, "reset", user_id, "--window", "60")
    assert only_minute.returncode == 0
    assert only_minute.stdout == f"reset {user_id!r} (60 s): 5 entries removed\n"
    assert redis_client.exists(f"ratelimit:{user_id}:60") == 0
    assert redis_client.zcard(f"ratelimit:{user_id}:86400") == 5
    everything = run("--url", redis_url, "reset", user_id)
    assert everything.stdout == f"reset {user_id!r} (every window): 5 entries removed\n"
    assert redis_client.keys(f"ratelimit:{user_id}:*") == []


def test_top_ranks_users_by_their_closest_window_with_scan_only(
        redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    used = {f"{user_id}-a": 1, f"{user_id}-b": 4, f"{user_id}-c": 2, f"{user_id}:d": 5}
    with RateLimiter(redis_url) as limiter:
        for user, n in used.items():
            for _ in range(n):
                limiter.check_windows(user, [(5, 60), (100, 86400)])
    with Monitor(redis_client) as monitor:
        report = run_json("--url", redis_url, "top", "-n", "3")
    assert [(u["user"], u["used"], u["limit"], u["window_seconds"]) for u in report["users"]] == [
        (f"{user_id}:d", 5, 5, 60), (f"{user_id}-b", 4, 5, 60), (f"{user_id}-c", 2, 5, 60)]
    assert report["users"][0]["retry_after_s"] >= 1
    assert report["keys_examined"] == 8
    names = {c.name for c in monitor.from_others()}
    assert "SCAN" in names and "KEYS" not in names


def test_top_stops_after_max_keys(redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    with redis_client.pipeline(transaction=False) as pipe:
        for i in range(500):
            pipe.zadd(f"ratelimit:{user_id}-{i}:60", {"m": 1})
        pipe.execute()
    report = run_json("--url", redis_url, "top", "--max-keys", "50")
    assert 50 <= report["keys_examined"] < 50 + 64
    assert len(report["users"]) == 10


def test_url_from_the_environment_and_a_tiers_file(redis_url: str, tmp_path: Path,
                                                   user_id: str) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text("[free]\nper_minute = 1\nper_day = 2\n"
                     "[gold]\nper_minute = 2\nper_day = 3\n")
    env = {"REDIS_URL": redis_url}
    assert run("--tiers", str(tiers), "check", user_id, "--tier", "gold", env=env).returncode == 0
    assert run("--tiers", str(tiers), "check", user_id, "--tier", "gold", env=env).returncode == 0
    assert run("check", user_id, "--tier", "gold",
               env={**env, "GENAI_RATELIMIT_TIERS": str(tiers)}).returncode == 1
    report = run_json("check", user_id, env=env)  # the default tiers: free allows 5
    assert report["allowed"] is True


def test_a_bad_url_is_a_usage_error(user_id: str) -> None:
    done = run("--url", "http://localhost:6379", "inspect", user_id)
    assert done.returncode == 2
    assert "unsupported scheme 'http'" in done.stderr
    assert done.stdout == ""


def test_an_unreachable_redis_exits_3_within_the_timeout(user_id: str) -> None:
    for command in (["inspect", user_id], ["reset", user_id], ["top"], ["check", user_id]):
        done = run("--url", closed_port_url(), "--timeout", "0.5", *command)
        assert done.returncode == 3, (command, done.stderr)
        assert done.stderr.startswith("genai-ratelimit: Redis unavailable: "), done.stderr


def test_usage_errors_exit_2(redis_url: str, tmp_path: Path, user_id: str) -> None:
    assert run().returncode == 2  # no command
    assert run("--url", redis_url, "inspect").returncode == 2  # no user
    unknown = run("--url", redis_url, "inspect", user_id, "--tier", "gold")
    assert (unknown.returncode, unknown.stderr) == (
        2, "genai-ratelimit: error: unknown tier 'gold': one of enterprise, free, pro\n")
    bad = tmp_path / "tiers.json"
    bad.write_text('{"pro": {"per_minute": 1, "per_day": 1}}')
    done = run("--url", redis_url, "--tiers", str(bad), "check", user_id)
    assert done.returncode == 2 and str(bad) in done.stderr
    assert run("--url", redis_url, "reset", user_id, "--window", "0").returncode == 2


def test_the_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("genai-ratelimit")
    if not script.exists():
        pytest.fail(f"{script} is missing: pyproject.toml's [project.scripts] names it")
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0
    assert "inspect" in done.stdout and "Exit codes" in done.stdout
