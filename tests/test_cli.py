"""The command line (`python -m genai_ratelimit`, genai_ratelimit/cli.py), run as a user runs
it: in a subprocess, against the session's real redis-server; its output, exit codes and
errors (a bad URL, a closed port, an unknown tier), and what it leaves in Redis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import redis

from genai_ratelimit import RateLimiter, Scope
from genai_ratelimit._keyspace import KeyName
from helpers_core import (
    Monitor,
    closed_port_url,
    measured_commands,
    unencoded_password_urls,
    userinfo_shown,
)
from redis_server import RedisServer, free_port

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.not_asan(reason="the command line runs in subprocesses"),
    pytest.mark.no_hiredis1(reason="the command line runs in subprocesses"),
]

TIMEOUT = 30
SECURITY_PAGE = Path(__file__).resolve().parent.parent / "docs" / "security.md"


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
    assert refused.stdout.startswith("refused by the 60 s requests window: retry after ")
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 5


def test_check_json_and_tier(redis_url: str, user_id: str) -> None:
    assert run_json("--url", redis_url, "check", user_id, "--tier", "pro", "--cost", "3") == {
        "allowed": True, "remaining": 57, "retry_after_s": 0, "window_seconds": 60,
        "resource": "requests", "tier": "pro"}


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
    assert lines[1].split() == ["window", "resource", "scope", "used", "limit", "oldest", "entry",
                                "(UTC)", "retry", "after"]
    assert lines[2].split()[:5] == ["60", "s", "requests", "-", "5"]
    retry, unit = lines[2].split()[-2:]  # a second later than the JSON's, at most
    assert unit == "s" and minute["retry_after_s"] - 1 <= int(retry) <= minute["retry_after_s"]


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


def test_reset_of_named_windows_reads_redis_url_when_no_url_is_given(
        redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    # Both storages' keys are reset, so the command opens a limiter of the other storage too:
    # on the URL $REDIS_URL names, like its first one.
    for _ in range(3):
        assert run("--url", redis_url, "check", user_id).returncode == 0
    done = run("reset", user_id, "--window", "60", env={"REDIS_URL": redis_url})
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"reset {user_id!r} (60 s): 3 entries removed\n"
    assert redis_client.zcard(f"ratelimit:{user_id}:86400") == 3


def test_inspect_shows_a_tiers_gcra_bucket_and_any_other_the_user_has(
        tmp_path: Path, redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text("[free]\nper_minute = 6\nper_day = 50\nburst = 2\n", encoding="utf-8")
    with RateLimiter(redis_url) as limiter:
        for _ in range(2):
            assert limiter.check_windows_detailed(user_id, [(50, 86_400)], gcra=(6, 60, 2))[0]
        assert limiter.check_rate(user_id, 1, 3_600, 1)[0] is True
    full_at = [int(redis_client.get(f"ratelimit:{user_id}:{p}:gcra")[:-6]) for p in (60, 3_600)]
    before = redis_client.dump(f"ratelimit:{user_id}:60:gcra")
    report = run_json("--url", redis_url, "--tiers", str(tiers), "inspect", user_id)
    assert redis_client.dump(f"ratelimit:{user_id}:60:gcra") == before, "inspect writes nothing"
    # The minute is the bucket, not a window: only the day is peeked as one.
    assert [(w["window_seconds"], w["used"]) for w in report["windows"] if not w["tokens"]] == [
        (86_400, 2)]
    assert [(b["period_seconds"], b["rate"], b["burst"], b["full_at_ms"])
            for b in report["buckets"]] == [(60, 6, 2, full_at[0]), (3_600, None, None, full_at[1])]
    table = run("--url", redis_url, "--tiers", str(tiers), "inspect", user_id).stdout
    assert "GCRA bucket 60 s (6 per 60 s, burst 2): full again at " in table
    assert "GCRA bucket 3600 s (rate and burst: the app's): full again at " in table


def test_inspect_shows_the_users_calendar_budgets_and_top_ranks_no_org_as_a_user(
        redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    from genai_ratelimit import Budget

    daily = Budget(user_id, "daily:usd", 1_000, "day", "Europe/Paris")
    with RateLimiter(redis_url) as limiter:
        settled = limiter.hold_budgets([Budget("org:acme", "monthly", 10_000), daily], 300)
        limiter.settle_budgets(settled, 250)
        held = limiter.hold_budgets(daily, 100)
    start = held.periods[0].period_start_ms
    key = f"ratelimit:{user_id}:{start}:budget=daily%3Ausd"
    assert redis_client.exists(key)
    report = run_json("--url", redis_url, "inspect", user_id)
    assert report["budgets"] == [{"name": "daily:usd", "key": key, "period_start_ms": start,
                                  "spent": 250, "held": 100, "holds": 1,
                                  "expires_ms": report["budgets"][0]["expires_ms"]}]
    expires = report["budgets"][0]["expires_ms"]
    assert abs(expires - (held.periods[0].period_end_ms + 86_400_000)) < 60_000
    table = run("--url", redis_url, "inspect", user_id).stdout
    assert "budget 'daily:usd' from " in table and "spent 250, held 100 (1 in flight)" in table
    top = run_json("--url", redis_url, "top")  # an org's budget is listed apart, no user
    assert top["users"] == [] and [b["owner"] for b in top["budgets"]] == [user_id, "org:acme"]


def test_top_lists_every_owners_calendar_budgets_by_spent_and_held(
        redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    from genai_ratelimit import Budget

    org = Budget(f"org:{user_id}", "monthly", 10_000, thresholds=(5, 50))
    daily = Budget(user_id, "daily:usd", 1_000, "day", "Europe/Paris")
    with RateLimiter(redis_url) as limiter:
        first = limiter.hold_budgets([org, daily], 600)  # crosses the org's soft limits
        assert first.allowed and first.crossed
        limiter.settle_budgets(first, 550)
        held = limiter.hold_budgets(org, 200)
        limiter.hold_budgets(org, 100)
    org_key = f"ratelimit:org:{user_id}:{held.periods[0].period_start_ms}:budget=monthly"
    assert redis_client.hexists(org_key, "fired_by")  # a soft limit's fields are no hold
    report = run_json("--url", redis_url, "top")
    rows = [(b["owner"], b["name"], b["spent"], b["held"], b["holds"]) for b in report["budgets"]]
    assert rows == [(f"org:{user_id}", "monthly", 550, 300, 2), (user_id, "daily:usd", 550, 0, 0)]
    [org_row, _] = report["budgets"]
    assert org_row["key"] == org_key
    assert org_row["period_start_ms"] == held.periods[0].period_start_ms
    assert org_row["until_ms"] >= held.periods[0].period_end_ms
    assert [b["owner"] for b in run_json("--url", redis_url, "top", "-n", "1")["budgets"]] == [
        f"org:{user_id}"]
    text = run("--url", redis_url, "top").stdout
    assert "calendar budgets, the most used first (limits and periods are the app's" in text
    line = next(row for row in text.splitlines() if row.startswith(f"org:{user_id} "))
    assert line.split()[1:2] + line.split()[3:6] == ["monthly", "550", "300", "2"]
    assert f"org:{user_id}" not in [u["user"] for u in report["users"]]  # no user


def test_top_and_inspect_show_the_providers_view_of_an_upstream_cap(
        redis_url: str, tmp_path: Path, user_id: str) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text(TIERS_WITH_SCOPES)
    gateway_traffic(redis_url, user_id)
    report = run_json("--url", redis_url, "--tiers", str(tiers), "top")
    assert report["upstreams"][0]["provider"] is None  # nobody observed the provider
    assert "'openai/gpt-4o' provider: not observed" in run(
        "--url", redis_url, "--tiers", str(tiers), "top").stdout
    with RateLimiter(redis_url) as limiter:
        seen = limiter.observe_upstream("openai/gpt-4o", 200, {
            "x-ratelimit-limit-requests": "500", "x-ratelimit-remaining-requests": "42",
            "x-ratelimit-reset-requests": "30s", "x-ratelimit-limit-tokens": "90000",
            "x-ratelimit-remaining-tokens": "8000", "x-ratelimit-reset-tokens": "20s"})
    assert seen.closed_until_ms == 0
    report = run_json("--url", redis_url, "--tiers", str(tiers), "top")
    view = report["upstreams"][0]["provider"]
    assert view["key"] == "ratelimit:openai/gpt-4o:upstream"
    assert (view["requests"], view["requests_limit"], view["tokens"], view["tokens_limit"],
            view["closed_until"]) == (42, 500, 8000, 90000, None)
    assert 25_000 < view["requests_reset"] - report["now_ms"] <= 30_000
    assert 15_000 < view["tokens_reset"] - report["now_ms"] <= 20_000
    text = run("--url", redis_url, "--tiers", str(tiers), "top").stdout
    assert "'openai/gpt-4o' provider: requests 42 of 500 left (reset 20" in text
    assert ", tokens 8000 of 90000 left (reset 20" in text and text.count(", open\n") == 1
    with RateLimiter(redis_url) as limiter:
        closed = limiter.observe_upstream("openai/gpt-4o", 429, {"retry-after": "40"})
    inspected = run_json("--url", redis_url, "--tiers", str(tiers), "inspect", user_id,
                         "--upstream", "openai/gpt-4o")
    view = inspected["upstreams"][0]["provider"]
    assert view["closed_until"] == closed.closed_until_ms > inspected["now_ms"]
    text = run("--url", redis_url, "--tiers", str(tiers), "inspect", user_id, "--upstream",
               "openai/gpt-4o").stdout
    until = datetime.fromtimestamp(closed.closed_until_ms / 1000, tz=timezone.utc)
    assert f"CLOSED until {until:%Y-%m-%dT%H:%M:%S}" in text


def test_check_decides_a_tiers_burst_as_the_app_does(tmp_path: Path, redis_url: str,
                                                     user_id: str) -> None:
    tiers = tmp_path / "tiers.json"
    tiers.write_text(json.dumps({"free": {"per_minute": 6, "per_day": 50, "burst": 2}}),
                     encoding="utf-8")
    done = [run("--url", redis_url, "--tiers", str(tiers), "check", user_id, "--json")
            for _ in range(3)]
    assert [d.returncode for d in done] == [0, 0, 1]  # exit 1 once refused
    answers = [json.loads(d.stdout) for d in done]
    assert [(a["allowed"], a["remaining"], a["window_seconds"]) for a in answers] == [
        (True, 1, 60), (True, 0, 60), (False, 0, 60)]
    assert 9 <= answers[2]["retry_after_s"] <= 10


def test_reset_forgets_the_users_gcra_buckets_too(redis_url: str, redis_client: redis.Redis,
                                                  user_id: str) -> None:
    with RateLimiter(redis_url) as limiter:
        assert limiter.check_rate(user_id, 6, 60, 1)[0] is True
        assert limiter.check_windows_detailed(user_id, [(9, 86_400)], gcra=(1, 3_600, 1))[0] is True
        # Another user whose id starts with this one's keeps its bucket.
        assert limiter.check_rate(f"{user_id}:x", 6, 60, 1)[0] is True
        assert limiter.check_rate(user_id, 6, 60, 1)[0] is False
    everything = run("--url", redis_url, "reset", user_id)
    assert everything.stdout == f"reset {user_id!r} (every window): 1 entries removed\n"
    assert redis_client.keys(f"ratelimit:{user_id}:*") == [f"ratelimit:{user_id}:x:60:gcra".encode()]
    with RateLimiter(redis_url) as limiter:
        assert limiter.check_rate(user_id, 6, 60, 1)[0] is True  # the bucket is full again


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


def test_top_bounds_its_scan_calls_by_max_keys(redis_url: str, redis_client: redis.Redis,
                                               user_id: str) -> None:
    """Mostly keys of another prefix (a shared Redis): before, only the limiter's keys
    counted against --max-keys, so the SCAN went through the whole keyspace (issue 24:
    19,271 SCAN calls for --max-keys 1000). Now the calls themselves are bounded."""
    with redis_client.pipeline(transaction=False) as pipe:
        for i in range(3000):
            pipe.set(f"other-app:{user_id}-{i}", "x")
        for i in range(40):
            pipe.zadd(f"ratelimit:{user_id}-{i}:60", {"m": 1})
        pipe.execute()
    with measured_commands(redis_client) as commands:
        report = run_json("--url", redis_url, "top", "--max-keys", "50")
    assert commands["scan"] == report["scan"]["calls"] == report["scan"]["max_calls_per_master"] == 5
    assert report["scan"]["complete"] is False
    assert report["keys_examined"] <= 5 * 20
    done = run("--url", redis_url, "top", "--max-keys", "50")
    assert "5 SCAN calls of COUNT 10 on 1 master, at most 5 per master" in done.stdout
    assert "INCOMPLETE: raise --max-keys" in done.stdout
    with measured_commands(redis_client) as commands:
        report = run_json("--url", redis_url, "top", "--max-keys", "100000")
    assert report["scan"]["complete"] is True and commands["scan"] == report["scan"]["calls"]
    assert len(report["users"]) == 10 and report["keys_examined"] == 40


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


URL_PORT = free_port()


@pytest.mark.parametrize("url", [pytest.param(url, id=name)
                                 for name, url in unencoded_password_urls(URL_PORT)])
def test_no_part_of_an_unencoded_password_is_printed(url: str) -> None:
    # A URL the library refuses exits 2 and says to percent-encode; one it reads (an '@' in
    # the password) exits 3 on the closed port. Through --url (the blocking check, the async
    # inspect) and through $REDIS_URL.
    for args, env in ((["--url", url, "check", "user-1"], None),
                      (["--url", url, "inspect", "user-1"], None),
                      (["top"], {"REDIS_URL": url})):
        done = run("--timeout", "0.5", *args, env=env)
        printed = done.stdout + done.stderr
        assert not userinfo_shown(printed), f"{userinfo_shown(printed)} printed by {args}: {printed}"
        assert done.returncode in (2, 3), (args, done.returncode, printed)
        if done.returncode == 2:
            assert "percent-encoded" in done.stderr, done.stderr


@pytest.mark.parametrize("url", [pytest.param(url, id=name)
                                 for name, url in unencoded_password_urls(URL_PORT)[:2]])
def test_a_misplaced_url_is_not_echoed_by_the_usage_error(url: str) -> None:
    # argparse quotes what it could not place ("unrecognized arguments: ...").
    for args in (["check", "user-1", url], ["top", url], ["check", "user-1", f"--url={url}", url],
                 [f"--colour={url}", "top"]):
        done = run(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert not userinfo_shown(done.stderr), done.stderr
        assert "error:" in done.stderr, done.stderr


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


# ------------------------------------------------------------------ options, every command

def test_options_go_before_or_after_the_command(redis_url: str, tmp_path: Path,
                                                user_id: str) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text("[free]\nper_minute = 1\nper_day = 2\n[gold]\nper_minute = 3\nper_day = 4\n")
    after = run("check", user_id, "--tier", "gold", "--url", redis_url, "--tiers", str(tiers),
                "--json")
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["remaining"] == 2
    before = run("--url", redis_url, "--json", "--tiers", str(tiers), "check", user_id, "--tier",
                 "gold")
    assert json.loads(before.stdout)["remaining"] == 1
    mixed = run("--url", redis_url, "inspect", user_id, "--tiers", str(tiers), "--tier", "gold",
                "--json")
    assert json.loads(mixed.stdout)["windows"][0]["used"] == 2
    assert run("top", "--url", redis_url, "--json").returncode == 0
    assert run("reset", user_id, "--key-prefix", "ratelimit", "--url", redis_url).returncode == 0


def test_every_command_answers_json(redis_url: str, redis_client: redis.Redis,
                                    user_id: str) -> None:
    assert run_json("--url", redis_url, "check", user_id)["allowed"] is True
    assert run_json("--url", redis_url, "inspect", user_id)["windows"][0]["used"] == 1
    assert run_json("--url", redis_url, "top")["users"][0]["user"] == user_id
    assert run_json("--url", redis_url, "reset", user_id) == {"user": user_id, "windows": None,
                                                               "removed": 2}
    assert run_json("--url", redis_url, "reset", user_id, "--window", "60") == {
        "user": user_id, "windows": [60], "removed": 0}


def test_check_tokens_decides_the_token_windows_too(redis_url: str, redis_client: redis.Redis,
                                                    user_id: str) -> None:
    first = run_json("--url", redis_url, "check", user_id, "--tokens", "6000")
    assert (first["allowed"], first["resource"], first["remaining"]) == (True, "requests", 4)
    refused = run("--url", redis_url, "check", user_id, "--tokens", "6000")  # 12,000 > 10,000/min
    assert refused.returncode == 1
    assert refused.stdout.startswith("refused by the 60 s tokens window: retry after ")
    assert redis_client.zcard(f"ratelimit:{user_id}:60:tokens") == 1
    assert redis_client.zcard(f"ratelimit:{user_id}:60") == 1, "a refusal charges nothing"


# ------------------------------------------------------------------------------ inspect

TIERS_WITH_SCOPES = """\
[free]
per_minute = 5
per_day = 100
tokens_per_minute = 10000
tokens_per_day = 100000
max_in_flight = 3

[models."gpt-4o"]
per_minute = 4
tokens_per_minute = 2000

[upstreams."openai/gpt-4o"]
models = ["gpt-4o"]
per_minute = 10
tokens_per_minute = 30000
"""


def gateway_traffic(url: str, user: str, storage: str = "zset") -> tuple[Any, Any]:
    """What a gateway built from the docs leaves in Redis for one user: a reservation of
    requests and tokens with its route's and its model's budgets and the upstream's shared
    cap, reconciled; two requests in flight; the same user in a namespace."""
    upstream = Scope("openai/gpt-4o", windows=[(10, 60)], token_windows=[(30000, 60)],
                     shared=True)
    route = Scope("route:/v1/chat/completions", windows=[(2, 60)])
    model = Scope("model:gpt-4o", windows=[(4, 60)], token_windows=[(2000, 60)])
    limiter = RateLimiter(url, storage=storage)
    with limiter:
        for estimate, actual in ((1500, 900), (800, 700)):
            r = limiter.reserve(user, [(5, 60), (100, 86400)],
                                token_windows=[(10000, 60), (100000, 86400)], tokens=estimate,
                                scopes=[route, model, upstream])
            assert r.allowed
            limiter.reconcile(r, actual)
        leases = limiter.acquire(user, 3), limiter.acquire(user, 3)
        limiter.check_windows(f"ns:images:{user}", [(2, 60)])
    return leases


def test_inspect_shows_tokens_scopes_leases_namespaces_and_an_upstream_cap(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path, user_id: str) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text(TIERS_WITH_SCOPES)
    leases = gateway_traffic(redis_url, user_id)
    before = {k: redis_client.dump(k) for k in redis_client.keys("*")}
    report = run_json("--url", redis_url, "--tiers", str(tiers), "inspect", user_id,
                      "--upstream", "openai/gpt-4o")
    assert {k: redis_client.dump(k) for k in redis_client.keys("*")} == before, "writes nothing"
    own = {(w["window_seconds"], w["resource"]): (w["used"], w["limit"]) for w in report["windows"]}
    assert own == {(60, "requests"): (2, 5), (86400, "requests"): (2, 100),
                   (60, "tokens"): (1600, 10000), (86400, "tokens"): (1600, 100000)}
    scopes = {(w["scope"], w["window_seconds"], w["resource"]): (w["used"], w["limit"])
              for w in report["scopes"]}
    assert scopes == {("model:gpt-4o", 60, "requests"): (2, 4),
                      ("model:gpt-4o", 60, "tokens"): (1600, 2000),
                      ("route:/v1/chat/completions", 60, "requests"): (2, None)}
    route = [w for w in report["scopes"] if w["scope"].startswith("route:")][0]
    assert (route["allowed"], route["retry_after_s"]) == (True, 0)
    assert report["leases"]["held"] == 2 and report["leases"]["max_in_flight"] == 3
    assert sorted(report["leases"]["expires_ms"]) == sorted(lease.expires_at_ms for lease in leases)
    [upstream] = report["upstreams"]
    assert [(w["window_seconds"], w["resource"], w["used"], w["limit"])
            for w in upstream["windows"]] == [(60, "requests", 2, 10), (60, "tokens", 1600, 30000)]
    assert [(n["namespace"], [(w["window_seconds"], w["used"]) for w in n["windows"]])
            for n in report["namespaces"]] == [("images", [(60, 1)])]
    assert report["scan"]["complete"] is True

    text = run("--url", redis_url, "--tiers", str(tiers), "inspect", user_id, "--upstream",
               "openai/gpt-4o")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert any(line.split()[:6] == ["60", "s", "tokens", "model:gpt-4o", "1600", "2000"]
               for line in lines), text.stdout
    assert any(line.split()[:6] == ["60", "s", "requests", "route:/v1/chat/completions", "2", "?"]
               for line in lines), text.stdout
    assert "in flight: 2 (of 3), soonest expiry " in text.stdout
    assert "upstream 'openai/gpt-4o' (shared by every user):" in text.stdout
    assert "namespace 'images': 60 s requests 1 (its budget is the app's: used only)" in text.stdout


def test_inspect_a_full_upstream_cap_says_when_it_frees(redis_url: str, redis_client: redis.Redis,
                                                        tmp_path: Path, user_id: str) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text(TIERS_WITH_SCOPES.replace("per_minute = 10\n", "per_minute = 2\n"))
    gateway_traffic(redis_url, user_id)
    report = run_json("--url", redis_url, "--tiers", str(tiers), "inspect", user_id,
                      "--upstream", "openai/gpt-4o")
    requests = report["upstreams"][0]["windows"][0]
    assert (requests["used"], requests["limit"], requests["allowed"]) == (2, 2, False)
    assert 1 <= requests["retry_after_s"] <= 60
    missing = run("--url", redis_url, "inspect", user_id, "--upstream", "nobody")
    assert (missing.returncode, "no upstream 'nobody'" in missing.stderr) == (2, True)


# ---------------------------------------------------------------------------------- top

def test_top_ranks_by_the_fullest_of_requests_and_tokens_with_each_users_tier(
        redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    tokens, heavy, pro, busy = (f"{user_id}-{n}" for n in ("tokens", "heavy", "pro", "busy"))
    with RateLimiter(redis_url) as limiter:
        for _ in range(3):  # 3 of 5 requests (60%), 9,000 of 10,000 tokens (90%)
            limiter.reserve(tokens, [(5, 60)], token_windows=[(10000, 60)], tokens=3000)
        for _ in range(4):  # 4 of 5 requests (80%)
            limiter.check_windows(busy, [(5, 60), (100, 86400)])
        for _ in range(50):  # 50 of pro's 60 requests (83%): 1000% of free's
            limiter.check_windows(pro, [(60, 60), (5000, 86400)])
        limiter.check(heavy, 5, 60)
    report = run_json("--url", redis_url, "top", "--tier", f"{pro}=pro")
    ranked = [(u["user"], u["tier"], u["window_seconds"], u["resource"], u["used"], u["limit"])
              for u in report["users"]]
    assert ranked == [(tokens, "free", 60, "tokens", 9000, 10000),
                      (pro, "pro", 60, "requests", 50, 60),
                      (busy, "free", 60, "requests", 4, 5),
                      (heavy, "free", 60, "requests", 1, 5)]
    assert [u["tier_from"] for u in report["users"]] == ["default", "named", "default", "default"]
    text = run("--url", redis_url, "top", "--tier", f"{pro}=pro").stdout.splitlines()
    assert text[1].split() == ["user", "kind", "tier", "fullest", "window", "used", "limit", "use",
                               "retry", "after"]
    assert text[2].split()[:8] == [tokens, "user", "free", "60", "s", "tokens", "9000", "10000"]
    assert run("--url", redis_url, "top", "--tier", "gold").returncode == 2


def test_top_separates_namespaces_anonymous_clients_and_upstream_caps(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path, user_id: str) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text(TIERS_WITH_SCOPES)
    gateway_traffic(redis_url, user_id)
    with RateLimiter(redis_url) as limiter:
        limiter.check_windows("ip:203.0.113.7", [(5, 60), (100, 86400)])
        limiter.check_windows("user:ip:10.0.0.1", [(5, 60), (100, 86400)])  # an escaped id
        for _ in range(3):
            limiter.check_windows(f"ns:budget-0123456789ab:{user_id}", [(7, 60)])
    report = run_json("--url", redis_url, "--tiers", str(tiers), "top")
    kinds = {u["user"]: (u["kind"], u["id"]) for u in report["users"]}
    assert kinds == {user_id: ("user", user_id), "ip:203.0.113.7": ("anonymous", "203.0.113.7"),
                     "user:ip:10.0.0.1": ("user", "ip:10.0.0.1")}
    namespaces = {n["namespace"]: [(u["id"], u["used"]) for u in n["users"]]
                  for n in report["namespaces"]}
    assert namespaces == {"budget-0123456789ab": [(user_id, 3)], "images": [(user_id, 1)]}
    [upstream] = report["upstreams"]
    assert upstream["name"] == "openai/gpt-4o"
    assert [(w["window_seconds"], w["resource"], w["used"], w["limit"]) for w in upstream["windows"]] == [
        (60, "requests", 2, 10), (60, "tokens", 1600, 30000)]
    text = run("--url", redis_url, "--tiers", str(tiers), "top").stdout
    assert "namespace 'images' (its budget is the app's: used only; the most used first):" in text
    assert "upstream caps (shared by every user):" in text


def test_top_scans_every_master_of_a_cluster(redis_cluster: Any, user_id: str) -> None:
    users = [f"{user_id}-{n}" for n in range(30)]
    with RateLimiter(redis_cluster.url) as limiter:
        for n, user in enumerate(users):
            for _ in range(1 + n % 5):
                limiter.check_windows(user, [(5, 60), (100, 86400)])
        limiter.reserve(users[0], [(9, 3600)], scopes=[Scope("route:/v1/x", windows=[(3, 60)])])
        limiter.acquire(users[1], 2)
    report = run_json("--url", redis_cluster.url, "top", "-n", "30")
    assert len(report["scan"]["masters"]) == 3 and report["scan"]["complete"] is True
    found = {u["user"]: u["used"] for u in report["users"]}
    assert found == {user: 1 + n % 5 for n, user in enumerate(users)}, "every user, its real use"
    inspected = run_json("--url", redis_cluster.url, "inspect", users[1])
    assert inspected["leases"]["held"] == 1 and inspected["windows"][0]["used"] == 2
    scoped = run_json("--url", redis_cluster.url, "inspect", users[0])
    assert [(w["scope"], w["used"]) for w in scoped["scopes"]] == [("route:/v1/x", 1)]


def test_top_reads_budgets_and_provider_views_on_their_masters_of_a_cluster(
        redis_cluster: Any, user_id: str) -> None:
    from genai_ratelimit import Budget

    caps = [Scope(f"upstream-{n}", windows=[(10, 60)], shared=True) for n in range(6)]
    with RateLimiter(redis_cluster.url) as limiter:
        for n, cap in enumerate(caps):  # six names: several slots, several masters
            assert limiter.reserve(user_id, [(100, 60)], scopes=[cap]).allowed
            limiter.observe_upstream(cap.name, 200, {"x-ratelimit-limit-requests": "50",
                                                     "x-ratelimit-remaining-requests": str(n),
                                                     "x-ratelimit-reset-requests": "30s"})
            limiter.hold_budgets(Budget(f"org-{n}", "monthly", 1_000), 10 * (n + 1))
    report = run_json("--url", redis_cluster.url, "top")
    assert {u["name"]: u["provider"]["requests"] for u in report["upstreams"]} == {
        cap.name: n for n, cap in enumerate(caps)}
    assert all(u["provider"]["key"] == f"ratelimit:{{{u['name']}}}:upstream"
               for u in report["upstreams"])
    assert [(b["owner"], b["held"]) for b in report["budgets"]] == [
        (f"org-{n}", 10 * (n + 1)) for n in reversed(range(6))]


def test_ids_with_control_characters_are_escaped_on_the_terminal(
        redis_url: str, redis_client: redis.Redis, user_id: str) -> None:
    evil = f"{user_id}\x1b[2J\x1b]0;owned\x07\u202eroot\\"
    with RateLimiter(redis_url) as limiter:
        limiter.check_windows(evil, [(5, 60), (100, 86400)])
    escaped = f"{user_id}\\x1b[2J\\x1b]0;owned\\x07\\u202eroot\\\\"
    for command in (["top"], ["inspect", evil], ["reset", evil]):
        done = run("--url", redis_url, *command)
        assert done.returncode == 0, done.stderr
        assert not any(c in done.stdout for c in "\x1b\x07\u202e"), (command, done.stdout)
        assert escaped in done.stdout, (command, done.stdout)
    with RateLimiter(redis_url) as limiter:
        limiter.check(evil, 5, 60)
    assert run_json("--url", redis_url, "top")["users"][0]["user"] == evil  # JSON: exact


def test_identity_of_reads_what_the_fastapi_layer_writes() -> None:
    from genai_ratelimit._keyspace import identity_of
    from genai_ratelimit.fastapi import Anonymous, key_identity

    for user, namespace in [("alice", None), ("ip:1.2.3.4", None), ("user:x", "images"),
                            ("ns:a:b", None), ("a:b:c", "budget-0123456789ab")]:
        identity = identity_of(key_identity(user, namespace))
        assert (identity.user, identity.kind, identity.namespace) == (user, "user", namespace)
    anonymous = identity_of(key_identity(Anonymous("203.0.113.7"), "images"))  # type: ignore[arg-type]
    assert (anonymous.user, anonymous.kind, anonymous.namespace) == ("203.0.113.7", "anonymous",
                                                                      "images")
    # A shadow budget counts under "shadow:<identity>": listed apart, never as a user.
    for user, namespace, shown_in in [("alice", None, "shadow"), ("ip:1.2.3.4", "images", "shadow:images")]:
        identity = identity_of("shadow:" + key_identity(user, namespace))
        assert (identity.user, identity.kind, identity.namespace) == (user, "user", shown_in)
    shadow_anonymous = identity_of("shadow:" + key_identity(Anonymous("203.0.113.7")))  # type: ignore[arg-type]
    assert (shadow_anonymous.user, shadow_anonymous.kind, shadow_anonymous.namespace) == (
        "203.0.113.7", "anonymous", "shadow")


@pytest.mark.parametrize("hash_tag", [False, True], ids=["single", "cluster"])
def test_every_key_kind_is_read_back_from_its_name(hash_tag: bool) -> None:
    """The names csrc/script.c writes (as Redis shows them in a MONITOR of a real run,
    test_top_scans_every_master_of_a_cluster covers the cluster's), read back."""
    from genai_ratelimit._keyspace import parse_key, tagged

    def name(owner: str, suffix: str) -> str:
        return f"ratelimit:{tagged(owner, hash_tag)}:{suffix}"

    user = "a:b{c}%d"
    assert parse_key(name(user, "60"), "ratelimit", hash_tag) == KeyName("window", user, 60)
    assert parse_key(name(user, "86400:tokens:w"), "ratelimit", hash_tag) == KeyName(
        "window", user, 86400, True, weights=True)
    assert parse_key(name("openai/gpt-4o", "60:tokens:shared:w"), "ratelimit", hash_tag) == KeyName(
        "shared", "openai/gpt-4o", 60, True, weights=True)
    assert parse_key(name(user, "60:tokens:scope=model%3Agpt-4o"), "ratelimit",
                     hash_tag) == KeyName("scope", user, 60, True, "model:gpt-4o")
    assert parse_key(name("openai/gpt-4o", "60:shared"), "ratelimit", hash_tag) == KeyName(
        "shared", "openai/gpt-4o", 60)
    assert parse_key(name(user, "leases"), "ratelimit", hash_tag) == KeyName("leases", user)
    # storage="compact": the window's key and ":c"
    assert parse_key(name(user, "60:c"), "ratelimit", hash_tag) == KeyName(
        "window", user, 60, storage="compact")
    assert parse_key(name(user, "60:tokens:scope=model%3Agpt-4o:c"), "ratelimit",
                     hash_tag) == KeyName("scope", user, 60, True, "model:gpt-4o", storage="compact")
    assert parse_key(name("openai/gpt-4o", "60:tokens:shared:c"), "ratelimit", hash_tag) == KeyName(
        "shared", "openai/gpt-4o", 60, True, storage="compact")
    # A GCRA bucket (check_rate, a tier's burst): its period, nothing else.
    assert parse_key(name(user, "60:gcra"), "ratelimit", hash_tag) == KeyName("gcra", user, 60)
    for other in ("ratelimit", "ratelimit:", "other:a:60", name(user, "x"), name(user, "0"),
                  name(user, "60:scope="), "ratelimitx:a:60", name(user, "gcra"),
                  name(user, "0:gcra"), name(user, "60:tokens:gcra"), name(user, "60:gcra:c")):
        assert parse_key(other, "ratelimit", hash_tag) is None, other


@pytest.mark.parametrize("hash_tag", [False, True], ids=["single", "cluster"])
def test_an_owner_is_spelled_as_the_extension_writes_it(hash_tag: bool) -> None:
    """tagged() is csrc/script.c's rl_key_user (_native.key_owner), no second copy: on a
    cluster ids that differ only by escaping keep distinct tags."""
    from genai_ratelimit import _native
    from genai_ratelimit._keyspace import tagged

    owners = ["u", "a}b", "{a}", "100%", "%7B", "%257B", "\u00e9"]
    spelled = [tagged(owner, hash_tag) for owner in owners]
    assert spelled == [_native.key_owner(owner, hash_tag) for owner in owners]
    assert spelled == ([f"{{{o}}}" for o in ["u", "a%7Db", "%7Ba%7D", "100%25", "%257B", "%25257B",
                                             "\u00e9"]] if hash_tag else owners)


@pytest.mark.parametrize("hash_tag", [False, True], ids=["single", "cluster"])
def test_any_name_is_read_whole_or_refused(hash_tag: bool) -> None:
    """_native.read_key over names made of the grammar's pieces, in any order (a bounded,
    seeded run; under make test-asan it also proves the C reader stays in its bytes): each
    is refused (None) or read to parts that spell it again."""
    import random

    from genai_ratelimit import _native

    pieces = [":", "{", "}", "%", "%7B", "%7b", "%7D", "%25", "%3A", "%G", "a", "60", "\u00e9",
              "\udcff"]
    rnd = random.Random(31)

    def junk() -> str:
        return "".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 3)))

    fields = ["60", "0", "007", "tokens", "shared", "leases", "stats", "w", "c", "t", "scope="]
    read = 0
    for _ in range(20_000):
        owner = junk()
        spelled = rnd.choice([owner, _native.key_owner(owner, hash_tag), "{" + owner + "}"])
        chosen = [rnd.choice(fields) for _ in range(rnd.randint(1, 4))]
        chosen = [field + junk() if field == "scope=" or rnd.random() < 0.1 else field for field in chosen]
        name = rnd.choice(["p:", "p", "q:", "p::"]) + spelled + ":" + ":".join(chosen)
        parts = _native.read_key(name, "p", hash_tag)
        if parts is None:
            continue
        read += 1
        kind, owner, seconds, tokens, scope, suffix = parts
        if kind == "leases":
            assert (seconds, tokens, scope, suffix) == (0, False, None, "")
            tail = "leases"
        else:
            scope_field = "" if scope is None else ":scope=" + "".join(
                f"%{ord(c):02X}" if c in "%:{}" else c for c in scope)
            tail = (f"{seconds}{':tokens' if tokens else ''}{':shared' if kind == 'shared' else ''}"
                    f"{scope_field}{':' + suffix if suffix else ''}")
        # A name spelled otherwise (a leading zero, "%7b" left as it is, ...) reads to the same
        # parts as the one the limiter writes: that one is read back to them.
        again = f"p:{_native.key_owner(owner, hash_tag)}:{tail}"
        assert _native.read_key(again, "p", hash_tag) == parts, (name, again)
    assert read > 200  # names of every kind were read, not only refused


def test_the_keys_a_limiter_writes_read_back_to_its_calls(limiter: Any, redis_client: redis.Redis,
                                                          user_id: str, storage: str) -> None:
    """What the limiter wrote in Redis, read with the rule it wrote it with: the window and
    the leases of the call's user; their companions (":leases:stats") are no key of the
    reading."""
    from genai_ratelimit._keyspace import parse_key

    user = f"{user_id}:a{{b}}%7B"
    assert limiter.check(user, 5, 60)[0] is True
    assert limiter.acquire(user, 2).allowed
    names = [key.decode() for key in redis_client.keys("ratelimit:*")]
    read = [parse_key(name, "ratelimit", False) for name in names]
    assert sorted(map(repr, filter(None, read))) == sorted(map(repr, [
        KeyName("window", user, 60, storage=storage), KeyName("leases", user)]))
    assert [name for name, key in zip(names, read, strict=True) if key is None] == \
        [f"ratelimit:{user}:leases:stats"]


# ------------------------------------------------------------------------------- ACL

def documented_acl_line(user: str) -> list[str]:
    lines = [line for line in SECURITY_PAGE.read_text(encoding="utf-8").splitlines()
             if line.startswith(f"ACL SETUSER {user} ")]
    assert len(lines) == 1, f"docs/security.md must hold one ACL line for {user}, found {len(lines)}"
    return lines[0].split()


def acl_url(server: RedisServer, words: list[str]) -> str:
    admin = redis.Redis.from_url(server.url)
    try:
        admin.execute_command(*[">secret" if w == ">CHANGE-ME" else w for w in words])  # type: ignore[no-untyped-call]
    finally:
        admin.close()
    return f"redis://{words[2]}:secret@127.0.0.1:{server.port}/0"


def test_the_operators_acl_line_runs_every_command_and_the_apps_names_what_it_lacks(
        private_redis: RedisServer, user_id: str) -> None:
    operator = acl_url(private_redis, documented_acl_line("ratelimit-operator"))
    app = acl_url(private_redis, documented_acl_line("ratelimiter"))
    with RateLimiter(app) as limiter:
        limiter.acquire(user_id, 2)
    for command in (["check", user_id], ["inspect", user_id], ["top"], ["reset", user_id],
                    ["reset", user_id, "--window", "60"], ["check", user_id, "--tokens", "9"]):
        done = run("--url", operator, *command)
        assert done.returncode == 0, (command, done.stderr)
    assert run("--url", app, "check", user_id).returncode == 0
    for command, refused in ((["top"], "scan"), (["inspect", user_id], "scan"),
                             (["reset", user_id, "--window", "60"], "del"),
                             (["reset", user_id], "scan")):
        done = run("--url", app, *command)
        assert done.returncode == 2, (command, done.stderr)
        assert done.stderr.startswith(f"genai-ratelimit: error: the Redis ACL user may not run "
                                      f"'{refused}', which {command[0]} needs"), done.stderr


# ------------------------------------------------------------------------------ storages

@pytest.mark.parametrize("query", ["", "?storage=zset", "?storage=compact"])
def test_each_key_is_read_with_the_storage_its_name_says_whatever_the_url(
        redis_url: str, redis_client: redis.Redis, user_id: str, query: str) -> None:
    """alice's app limits with storage="compact" (its keys end in ":c"), bob's with sorted
    sets: top, inspect and reset read each key with the storage its name says, whatever the
    URL names (top once showed "0 shown" over the keys it found, inspect said used 0)."""
    alice, bob = f"{user_id}-alice", f"{user_id}-bob"
    with RateLimiter(redis_url, storage="compact") as limiter:
        for _ in range(4):
            limiter.check_windows(alice, [(5, 60), (100, 86400)])
    with RateLimiter(redis_url) as limiter:
        limiter.check_windows(bob, [(5, 60), (100, 86400)])
    url = redis_url + query
    top = run_json("--url", url, "top")
    assert [(u["user"], u["used"], u["limit"], u["storage"]) for u in top["users"]] == [
        (alice, 4, 5, "compact"), (bob, 1, 5, "zset")]
    assert "(2 shown; default tier free)" in run("--url", url, "top").stdout
    report = run_json("--url", url, "inspect", alice)
    assert [(w["window_seconds"], w["resource"], w["used"], w["storage"])
            for w in report["windows"]] == [(60, "requests", 4, "compact"),
                                            (86400, "requests", 4, "compact"),
                                            (60, "tokens", 0, "compact"),
                                            (86400, "tokens", 0, "compact")]
    lines = run("--url", url, "inspect", alice).stdout.splitlines()
    assert lines[2].split()[:5] == ["60", "s", "requests", "-", "4"]
    assert run_json("--url", url, "inspect", bob)["windows"][0]["used"] == 1
    done = run("--url", url, "reset", alice, "--window", "60")
    assert done.stdout == f"reset {alice!r} (60 s): 4 entries removed\n", done.stderr
    assert redis_client.exists(f"ratelimit:{alice}:60:c") == 0
    assert redis_client.exists(f"ratelimit:{alice}:86400:c") == 1


def test_compact_scopes_upstreams_and_namespaces_are_read_with_their_storage(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path, user_id: str) -> None:
    """The gateway's traffic logged with storage="compact", read through a URL that names no
    storage: the user's scopes, the upstream's cap and the namespace as the sorted sets'."""
    tiers = tmp_path / "tiers.toml"
    tiers.write_text(TIERS_WITH_SCOPES)
    gateway_traffic(redis_url, user_id, storage="compact")
    report = run_json("--url", redis_url, "--tiers", str(tiers), "inspect", user_id,
                      "--upstream", "openai/gpt-4o")
    own = {(w["window_seconds"], w["resource"]): (w["used"], w["limit"]) for w in report["windows"]}
    assert own == {(60, "requests"): (2, 5), (86400, "requests"): (2, 100),
                   (60, "tokens"): (1600, 10000), (86400, "tokens"): (1600, 100000)}
    scopes = {(w["scope"], w["window_seconds"], w["resource"]): (w["used"], w["limit"])
              for w in report["scopes"]}
    assert scopes == {("model:gpt-4o", 60, "requests"): (2, 4),
                      ("model:gpt-4o", 60, "tokens"): (1600, 2000),
                      ("route:/v1/chat/completions", 60, "requests"): (2, None)}
    [upstream] = report["upstreams"]
    assert [(w["window_seconds"], w["resource"], w["used"], w["limit"])
            for w in upstream["windows"]] == [(60, "requests", 2, 10), (60, "tokens", 1600, 30000)]
    assert [(n["namespace"], [(w["window_seconds"], w["used"]) for w in n["windows"]])
            for n in report["namespaces"]] == [("images", [(60, 1)])]
    top = run_json("--url", redis_url, "--tiers", str(tiers), "top")
    assert [(u["user"], u["used"], u["storage"]) for u in top["users"]] == [(user_id, 2, "compact")]
    assert {n["namespace"]: [(u["id"], u["used"]) for u in n["users"]]
            for n in top["namespaces"]} == {"images": [(user_id, 1)]}
    assert [(w["window_seconds"], w["resource"], w["used"])
            for w in top["upstreams"][0]["windows"]] == [(60, "requests", 2), (60, "tokens", 1600)]


def test_a_window_held_in_both_storages_shows_each(redis_url: str, user_id: str) -> None:
    """A switch of storage leaves a window's entries in both until they leave: inspect
    shows each storage's row, named."""
    for storage, times in (("zset", 1), ("compact", 3)):
        with RateLimiter(redis_url, storage=storage) as limiter:
            for _ in range(times):
                limiter.check(user_id, 5, 60)
    report = run_json("--url", redis_url, "inspect", user_id)
    assert [(w["window_seconds"], w["resource"], w["used"], w["storage"])
            for w in report["windows"]][:3] == [(60, "requests", 1, "zset"),
                                                (60, "requests", 3, "compact"),
                                                (86400, "requests", 0, "zset")]
    lines = run("--url", redis_url, "inspect", user_id).stdout.splitlines()
    assert lines[2].split()[:7] == ["60", "s", "(zset)", "requests", "-", "1", "5"]
    assert lines[3].split()[:7] == ["60", "s", "(compact)", "requests", "-", "3", "5"]
