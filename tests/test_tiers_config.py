"""Tier budgets from the file named by GENAI_RATELIMIT_TIERS (JSON or TOML): honoured by the
dependency, and a malformed file fails when the dependency is built (at start-up), naming the
file and the problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi import Depends, FastAPI, Request

from genai_ratelimit import TIER_LIMITS, RateLimiter
from genai_ratelimit._tiers_config import (
    TIERS_FILE_ENV,
    TierConfigError,
    load_tier_limits,
    tier_limits_from_env,
    validate_tier_limits,
)
from genai_ratelimit.fastapi import RateLimit

with warnings.catch_warnings():
    # Starlette >= 1.x warns when its TestClient falls back to `httpx` instead of `httpx2`.
    warnings.filterwarnings("ignore", message=r".*httpx2")
    from fastapi.testclient import TestClient

# The tiers file is read by the dependency, whatever limiter it drives: a blocking one here.
# How the dependency drives each kind of limiter is test_fastapi.py's subject.
pytestmark = [
    pytest.mark.limiter_kinds(
        "sync", reason="the tiers file is the dependency's, not the limiter's; every kind of "
                       "limiter behind the dependency is in test_fastapi.py"),
    pytest.mark.not_asan(reason="the tiers file is pure Python; the limiter behind it is test_fastapi.py's,"
                                " which runs under ASan"),
    pytest.mark.no_hiredis1(reason="the tiers file is pure Python: no hiredis path of its own"),
]

GOOD = {
    "free": {"per_minute": 2, "per_day": 50},
    "pro": {"per_minute": 7, "per_day": 500},
}
GOOD_TOML = """\
# budgets for this deployment
[free]
per_minute = 2
per_day = 50

[pro]
per_minute = 7
per_day = 500
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def statuses(dependency: RateLimit, user_id: str, tier: str, count: int) -> list[int]:
    app = FastAPI()

    @app.get("/", dependencies=[Depends(dependency)])
    async def limited(request: Request) -> dict[str, str]:
        return {}

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Any:
        request.state.user_id, request.state.tier = user_id, tier
        return await call_next(request)

    with TestClient(app) as client:
        return [client.get("/").status_code for _ in range(count)]


# --- honoured ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,text", [("tiers.json", json.dumps(GOOD)), ("tiers.toml", GOOD_TOML)])
def test_tiers_file_named_by_the_environment_sets_the_budgets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limiter: RateLimiter, user_id: str,
        name: str, text: str) -> None:
    monkeypatch.setenv(TIERS_FILE_ENV, str(write(tmp_path, name, text)))
    dependency = RateLimit(limiter=limiter)
    assert dependency.tier_limits == GOOD
    assert statuses(dependency, user_id, "free", 3) == [200, 200, 429]
    assert statuses(dependency, user_id + "-pro", "pro", 8) == [200] * 7 + [429]


def test_a_tier_missing_from_the_file_gets_the_files_free_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limiter: RateLimiter, user_id: str) -> None:
    monkeypatch.setenv(TIERS_FILE_ENV, str(write(tmp_path, "tiers.json", json.dumps(GOOD))))
    assert statuses(RateLimit(limiter=limiter), user_id, "enterprise", 3) == [200, 200, 429]


def test_explicit_tier_limits_win_over_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limiter: RateLimiter) -> None:
    monkeypatch.setenv(TIERS_FILE_ENV, str(write(tmp_path, "tiers.json", json.dumps(GOOD))))
    explicit = {"free": {"per_minute": 9, "per_day": 90}}
    assert RateLimit(limiter=limiter, tier_limits=explicit).tier_limits == explicit


@pytest.mark.parametrize("value", [None, "", "   "])
def test_without_the_variable_the_built_in_tiers_apply(
        monkeypatch: pytest.MonkeyPatch, limiter: RateLimiter, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(TIERS_FILE_ENV, raising=False)
    else:
        monkeypatch.setenv(TIERS_FILE_ENV, value)
    assert tier_limits_from_env() is None
    assert RateLimit(limiter=limiter).tier_limits == TIER_LIMITS


def test_the_file_is_read_once_at_start_up_not_per_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limiter: RateLimiter, user_id: str) -> None:
    path = write(tmp_path, "tiers.json", json.dumps(GOOD))
    monkeypatch.setenv(TIERS_FILE_ENV, str(path))
    dependency = RateLimit(limiter=limiter)
    path.write_text("{ broken", encoding="utf-8")  # a later edit cannot break a running service
    assert statuses(dependency, user_id, "free", 3) == [200, 200, 429]


def test_the_validated_budgets_are_a_copy(limiter: RateLimiter) -> None:
    budgets = {"free": {"per_minute": 3, "per_day": 30}}
    dependency = RateLimit(limiter=limiter, tier_limits=budgets)
    budgets["free"]["per_minute"] = 1000
    assert dependency.tier_limits["free"]["per_minute"] == 3


# --- malformed: fails when built, naming the file and the problem ----------------------------

MALFORMED = [
    ("syntax.json", '{"free": {"per_minute": 5, "per_day": 100},}', "invalid JSON"),
    ("syntax.toml", "[free]\nper_minute = = 5\n", "invalid TOML"),
    ("empty.json", "", "invalid JSON"),
    ("list.json", "[1, 2]", "expected a table of tiers"),
    ("none.json", "{}", "no tiers defined"),
    ("nofree.json", '{"pro": {"per_minute": 60, "per_day": 5000}}', "'free' tier is required"),
    ("zero.json", '{"free": {"per_minute": 0, "per_day": 100}}', "per_minute must be an integer >= 1"),
    ("negative.toml", "[free]\nper_minute = 5\nper_day = -1\n", "per_day must be an integer >= 1"),
    ("float.json", '{"free": {"per_minute": 5.5, "per_day": 100}}', "per_minute must be an integer >= 1"),
    ("bool.json", '{"free": {"per_minute": true, "per_day": 100}}', "per_minute must be an integer >= 1"),
    ("string.toml", '[free]\nper_minute = "5"\nper_day = 100\n', "per_minute must be an integer >= 1"),
    ("missing.json", '{"free": {"max_in_flight": 5}}',
     "missing a window: give at least one of per_second, per_minute, per_hour, per_day"),
    ("huge.json", '{"free": {"per_minute": 9007199254740992}}', "at most 9007199254740991"),
    ("typo.json", '{"free": {"per_minute": 5, "per_dya": 100, "per_day": 100}}',
     "unknown key(s) ['per_dya']"),
    ("scalar.json", '{"free": 5}', "tier 'free' must be a table"),
    ("order.json", '{"free": {"per_minute": 50, "per_day": 10}}',
     "per_day (10) is smaller than per_minute (50)"),
    ("dup.json", '{"free": {"per_minute": 5, "per_day": 100}, "free": {"per_minute": 500, "per_day": 1000}}',
     "duplicate key 'free'"),
    ("blank.json", '{" ": {"per_minute": 5, "per_day": 100}, "free": {"per_minute": 5, "per_day": 100}}',
     "tier names must be non-empty"),
    ("tiers.yaml", "free: {per_minute: 5, per_day: 100}\n", "use a .json or .toml file"),
    ("burst0.json", '{"free": {"per_minute": 5, "burst": 0}}', "burst must be an integer >= 1"),
    ("burstfloat.toml", "[free]\nper_minute = 5\nburst = 2.5\n", "burst must be an integer >= 1"),
    ("burstbool.json", '{"free": {"per_minute": 5, "burst": true}}', "burst must be an integer >= 1"),
    ("burstalone.json", '{"free": {"per_day": 100, "burst": 3}}',
     "burst applies to per_minute (the minute budget decided as GCRA): give per_minute too"),
]


@pytest.mark.parametrize("name,text,problem", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_tiers_file_fails_when_the_dependency_is_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limiter: RateLimiter,
        name: str, text: str, problem: str) -> None:
    path = write(tmp_path, name, text)
    monkeypatch.setenv(TIERS_FILE_ENV, str(path))
    with pytest.raises(TierConfigError) as caught:
        RateLimit(limiter=limiter)
    message = str(caught.value)
    assert str(path) in message
    assert TIERS_FILE_ENV in message
    assert problem in message


def test_missing_tiers_file_fails_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            limiter: RateLimiter) -> None:
    path = tmp_path / "nowhere.toml"
    monkeypatch.setenv(TIERS_FILE_ENV, str(path))
    with pytest.raises(TierConfigError, match="file not found") as caught:
        RateLimit(limiter=limiter)
    assert str(path) in str(caught.value)


def test_tier_config_error_is_a_value_error() -> None:
    assert issubclass(TierConfigError, ValueError)


def test_load_tier_limits_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "tiers.json", '{"free": {"per_minute": 0, "per_day": 1}}')
    with pytest.raises(TierConfigError, match=r"^" + str(path).replace(".", r"\.") + ": tier 'free'"):
        load_tier_limits(path)
    assert load_tier_limits(write(tmp_path, "ok.toml", GOOD_TOML)) == GOOD


def test_validate_tier_limits_accepts_the_built_in_tiers() -> None:
    assert validate_tier_limits(TIER_LIMITS) == TIER_LIMITS


def test_malformed_tiers_file_is_never_read_at_import_but_stops_the_ready_dependency(
        tmp_path: Path) -> None:
    """Importing genai_ratelimit.fastapi reads no configuration (the ready `rate_limit` is
    built when first named): a broken file fails there, at start-up, saying why, and never
    at import (a tool that merely imports the package keeps working)."""
    path = write(tmp_path, "tiers.toml", "[free]\nper_minute = 0\n")
    env = {**os.environ, TIERS_FILE_ENV: str(path)}
    imported = subprocess.run([sys.executable, "-c", "import genai_ratelimit.fastapi"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert imported.returncode == 0, imported.stderr
    named = subprocess.run(
        [sys.executable, "-c", "from genai_ratelimit.fastapi import rate_limit"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert named.returncode != 0
    assert "TierConfigError" in named.stderr
    assert f"{TIERS_FILE_ENV}={path}: tier 'free':" in named.stderr


def test_file_budgets_use_the_same_keys_as_built_in_tiers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limiter: RateLimiter, user_id: str,
        redis_client: redis.Redis) -> None:
    monkeypatch.setenv(TIERS_FILE_ENV, str(write(tmp_path, "tiers.json", json.dumps(GOOD))))
    statuses(RateLimit(limiter=limiter), user_id, "pro", 1)
    assert sorted(redis_client.keys("*")) == [f"ratelimit:{user_id}:60".encode(),
                                              f"ratelimit:{user_id}:86400".encode()]


# --- token budgets (TIER_TOKEN_LIMITS and the file's tokens_per_* keys) ----------------------

WITH_TOKENS = {
    "free": {"per_minute": 2, "per_day": 50, "tokens_per_minute": 300, "tokens_per_day": 3_000},
    "pro": {"per_minute": 7, "per_day": 500},
    "team": {"per_minute": 9, "per_day": 900},
}


def test_token_tier_defaults_are_valid_and_exported() -> None:
    from genai_ratelimit import TIER_TOKEN_LIMITS
    from genai_ratelimit._tiers_config import validate_token_limits

    assert validate_token_limits(TIER_TOKEN_LIMITS) == TIER_TOKEN_LIMITS
    assert set(TIER_TOKEN_LIMITS) == set(TIER_LIMITS)
    assert TIER_TOKEN_LIMITS["free"] == {"per_minute": 10_000, "per_day": 100_000}


def test_token_keys_in_the_file_leave_the_request_budgets_as_they_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limiter: RateLimiter) -> None:
    monkeypatch.setenv(TIERS_FILE_ENV, str(write(tmp_path, "tiers.json", json.dumps(WITH_TOKENS))))
    assert RateLimit(limiter=limiter).tier_limits == {
        tier: {"per_minute": budget["per_minute"], "per_day": budget["per_day"]}
        for tier, budget in WITH_TOKENS.items()}


def test_token_budgets_of_the_file_and_the_fallbacks_of_the_tiers_without_them(
        tmp_path: Path) -> None:
    from genai_ratelimit import TIER_TOKEN_LIMITS
    from genai_ratelimit._tiers_config import tier_token_limits_from_env

    toml = ("[free]\nper_minute = 2\nper_day = 50\ntokens_per_minute = 300\ntokens_per_day = 3000\n"
            "[pro]\nper_minute = 7\nper_day = 500\n[team]\nper_minute = 9\nper_day = 900\n")
    for path in (write(tmp_path, "tiers.json", json.dumps(WITH_TOKENS)), write(tmp_path, "tiers.toml", toml)):
        assert tier_token_limits_from_env({TIERS_FILE_ENV: str(path)}) == {
            "free": {"per_minute": 300, "per_day": 3_000},   # its own
            "pro": TIER_TOKEN_LIMITS["pro"],                 # the built-in tier of that name
            "team": {"per_minute": 300, "per_day": 3_000},   # unknown name: the file's free
        }
    assert tier_token_limits_from_env({}) is None
    without = write(tmp_path, "plain.json", json.dumps(GOOD))
    assert tier_token_limits_from_env({TIERS_FILE_ENV: str(without)}) == {
        "free": TIER_TOKEN_LIMITS["free"], "pro": TIER_TOKEN_LIMITS["pro"]}


TOKEN_MALFORMED = [
    ('{"free": {"per_minute": 5, "per_day": 100, "tokens_per_minute": 0, "tokens_per_day": 10}}',
     "tokens_per_minute must be an integer >= 1, got 0"),
    ('{"free": {"per_minute": 5, "per_day": 100, "tokens_per_minute": 10, "tokens_per_day": 1.5}}',
     "tokens_per_day must be an integer >= 1, got float 1.5"),
    ('{"free": {"per_minute": 5, "per_day": 100, "tokens_per_minute": true, "tokens_per_day": 10}}',
     "tokens_per_minute must be an integer >= 1, got bool True"),
    ('{"free": {"per_minute": 5, "per_day": 100, "tokens_per_minute": 500, "tokens_per_day": 10}}',
     "tokens_per_day (10) is smaller than tokens_per_minute (500)"),
    ('{"free": {"per_minute": 5, "per_day": 100, "tokens_per_hour": 500, "tokens_per_day": 400}}',
     "tokens_per_day (400) is smaller than tokens_per_hour (500)"),
    ('{"free": {"per_minute": 5, "per_day": 100, "tokens_per_minut": 5, "tokens_per_day": 500}}',
     "unknown key(s) ['tokens_per_minut']"),
]


@pytest.mark.parametrize("text,problem", TOKEN_MALFORMED, ids=[f"t{i}" for i in range(len(TOKEN_MALFORMED))])
def test_malformed_token_keys_fail_when_the_dependency_is_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limiter: RateLimiter,
        text: str, problem: str) -> None:
    path = write(tmp_path, "tiers.json", text)
    monkeypatch.setenv(TIERS_FILE_ENV, str(path))
    with pytest.raises(TierConfigError) as caught:
        RateLimit(limiter=limiter)
    assert str(path) in str(caught.value)
    assert problem in str(caught.value)


@pytest.mark.parametrize("budgets,problem", [
    ({"pro": {"per_minute": 5, "per_day": 10}}, "'free' tier is required"),
    ({"free": {"per_minute": 5, "per_day": 10, "tokens_per_minute": 5, "tokens_per_day": 5}},
     "unknown key(s) ['tokens_per_day', 'tokens_per_minute']"),
    ({"free": {"per_minute": 50, "per_day": 10}}, "per_day (10) is smaller than per_minute (50)"),
    ({"free": {"per_minute": 0, "per_day": 10}}, "per_minute must be an integer >= 1"),
])
def test_token_limits_are_validated_as_strictly_as_tier_limits(budgets: Any, problem: str) -> None:
    from genai_ratelimit._tiers_config import validate_token_limits

    with pytest.raises(TierConfigError) as caught:
        validate_token_limits(budgets)
    assert problem in str(caught.value)


# --- the [models] and [upstreams] sections ---------------------------------------------------

def test_scope_sections_are_read_and_are_not_tiers() -> None:
    from genai_ratelimit._tiers_config import scope_sections_of

    data = {"free": {"per_minute": 5, "per_day": 100},
            "models": {"gpt-4o": {"per_minute": 2, "tokens_per_minute": 900}},
            "upstreams": {"openai/gpt-4o": {"models": ["gpt-4o"], "per_minute": 30}}}
    assert validate_tier_limits(data) == {"free": {"per_minute": 5, "per_day": 100}}
    assert scope_sections_of(data, "f") == (
        {"gpt-4o": {"per_minute": 2, "tokens_per_minute": 900}},
        {"openai/gpt-4o": ({"per_minute": 30}, ("gpt-4o",), {})})


def test_an_upstream_section_takes_its_wait_queue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  limiter: RateLimiter) -> None:
    """[upstreams."name"] max_wait, max_queue, max_queue_per_tenant: the Upstream's."""
    monkeypatch.setenv(TIERS_FILE_ENV, str(write(tmp_path, "tiers.toml", (
        "[free]\nper_minute = 5\n\n[upstreams.\"openai/gpt-4o\"]\nper_minute = 30\n"
        "in_flight = 4\nmax_wait = 2.5\nmax_queue = 50\nmax_queue_per_tenant = 5\n"))))
    dependency = RateLimit(limiter=limiter)
    [upstream] = dependency._scopes.upstreams
    assert (upstream.in_flight, upstream.max_wait, upstream.max_queue,
            upstream.max_queue_per_tenant) == (4, 2.5, 50, 5)


@pytest.mark.parametrize("section, problem", [
    ({"models": []}, "must be a table"),
    ({"models": {"gpt-4o": {"per_hour": 3}}}, "unknown key"),
    ({"models": {"gpt-4o": {}}}, "at least one"),
    ({"models": {"gpt-4o": {"per_minute": 0}}}, "integer >= 1"),
    ({"models": {"": {"per_minute": 1}}}, "non-empty"),
    ({"upstreams": {"u": {"per_minute": 1, "models": [""]}}}, "list of model names"),
    ({"upstreams": {"u": {"per_minute": True}}}, "integer >= 1"),
    ({"upstreams": {"u": {"per_minute": 9, "reserved": {"a": 60, "b": 50}}}},
     "upstream 'u': reserved shares sum to 110 %"),
    ({"upstreams": {"u": {"per_minute": 9, "ceilings": {"free": [50, 101]}}}},
     r"ceilings\['free'\] saturation must be in \(0, 100\]"),
    ({"upstreams": {"u": {"per_minute": 9, "reserved": {"pro": 2.5}}}}, "float is never exact"),
    ({"upstreams": {"u": {"per_minute": 9, "max_wait": 0}}}, "max_wait must be > 0"),
    ({"upstreams": {"u": {"per_minute": 9, "max_wait": 86400}}}, "max_wait must be > 0"),
    ({"upstreams": {"u": {"per_minute": 9, "max_wait": "5"}}}, "max_wait must be a number"),
    ({"upstreams": {"u": {"per_minute": 9, "max_wait": 5, "max_queue": 0}}},
     "max_queue must be 1 to"),
    ({"upstreams": {"u": {"per_minute": 9, "max_queue_per_tenant": True}}},
     "max_queue_per_tenant must be an int"),
])
def test_malformed_scope_sections_fail_when_the_file_is_read(
        tmp_path: Path, section: dict[str, Any], problem: str) -> None:
    tiers = tmp_path / "tiers.json"
    tiers.write_text(json.dumps({"free": {"per_minute": 5, "per_day": 100}, **section}))
    with pytest.raises(TierConfigError, match=problem) as caught:
        load_tier_limits(tiers)
    assert str(tiers) in str(caught.value)


# --- burst: the minute budget as GCRA (docs/gcra.md) -----------------------------------------


@pytest.mark.parametrize("name,text", [
    ("tiers.json", json.dumps({"free": {"per_minute": 6, "per_day": 50, "burst": 2}})),
    ("tiers.toml", "[free]\nper_minute = 6\nper_day = 50\nburst = 2\n"),
])
def test_a_tiers_files_burst_spaces_the_minute_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limiter: RateLimiter, user_id: str,
        name: str, text: str) -> None:
    monkeypatch.setenv(TIERS_FILE_ENV, str(write(tmp_path, name, text)))
    dependency = RateLimit(limiter=limiter)
    assert dependency.tier_limits == {"free": {"per_minute": 6, "per_day": 50, "burst": 2}}
    # 6 a minute would admit 6 at once as a log; as GCRA, 2 at once, then one per 10 s.
    assert statuses(dependency, user_id, "free", 3) == [200, 200, 429]
