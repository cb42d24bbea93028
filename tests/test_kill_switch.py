"""The kill switch RATE_LIMIT_DISABLED: read on every call; when on, every check allows with
the full budget and nothing reaches Redis; one warning per process on the genai_ratelimit
logger so it cannot stay on unnoticed.

Every test with a limiter runs once per limiter kind (tests/conftest.py); the warning is
probed here in a process running the blocking limiter, and in test_async_kill_switch.py in
one running async and blocking limiters together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers_core import closed_port_url, logged_entries, measured_commands

ON_SPELLINGS = ["true", "1", "yes", "on", "TRUE", "True", "tRuE", "YES", "Yes", "ON", "On", "oN"]
OFF_SPELLINGS = ["", "0", "false", "False", "no", "off", "OFF", "disabled", "2", "y", "t", "enable"]


@pytest.mark.parametrize("value", ON_SPELLINGS)
def test_kill_switch_allows_with_the_full_budget_without_contacting_redis(
        monkeypatch, unreachable_limiter, value):
    """A closed port: any attempt to connect would raise RateLimiterUnavailable."""
    monkeypatch.setenv("RATE_LIMIT_DISABLED", value)
    for _ in range(3):
        assert unreachable_limiter.check("user-1", 7, 60) == (True, 7, 0)
        assert unreachable_limiter.check_windows("user-1", [(100, 86400), (5, 60)]) == (True, 5, 0, 60)


@pytest.mark.parametrize("value", ["true", "1", "YES", "On"])
def test_kill_switch_sends_nothing_to_a_live_server(monkeypatch, limiter, redis_client, value):
    limiter.check("warm-up", 10, 60)
    monkeypatch.setenv("RATE_LIMIT_DISABLED", value)
    with measured_commands(redis_client) as delta:
        for _ in range(20):
            assert limiter.check("user-1", 1, 60) == (True, 1, 0)
            assert limiter.check_windows("user-1", [(1, 60), (5, 86400)])[:3] == (True, 1, 0)
    assert delta == {}
    assert redis_client.keys("ratelimit:user-1:*") == []


def test_kill_switch_check_windows_reports_the_smallest_budget(monkeypatch, unreachable_limiter):
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "true")
    assert unreachable_limiter.check_windows("user-1", [(5, 60), (100, 86400)]) == (True, 5, 0, 60)
    assert unreachable_limiter.check_windows("user-1", [(100, 86400), (5, 60)]) == (True, 5, 0, 60)
    assert unreachable_limiter.check_windows("user-1", [(100, 60), (5, 86400)]) == (True, 5, 0, 86400)
    assert unreachable_limiter.check_windows("user-1", [(5, 3600), (5, 60)]) == (True, 5, 0, 60)


@pytest.mark.parametrize("value", OFF_SPELLINGS)
def test_other_values_leave_limiting_on(monkeypatch, limiter, redis_client, value, user_id):
    monkeypatch.setenv("RATE_LIMIT_DISABLED", value)
    assert limiter.check(user_id, 1, 60) == (True, 0, 0)
    assert limiter.check(user_id, 1, 60)[:2] == (False, 0)
    assert logged_entries(redis_client, f"ratelimit:{user_id}:60") == 1


def test_turning_the_kill_switch_off_at_runtime_resumes_limiting(monkeypatch, limiter, redis_client, user_id):
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "true")
    for _ in range(5):
        assert limiter.check(user_id, 1, 60) == (True, 1, 0)
    monkeypatch.delenv("RATE_LIMIT_DISABLED")
    assert limiter.check(user_id, 1, 60) == (True, 0, 0)
    assert limiter.check(user_id, 1, 60)[:2] == (False, 0)
    assert logged_entries(redis_client, f"ratelimit:{user_id}:60") == 1


def test_turning_the_kill_switch_on_at_runtime_stops_limiting(monkeypatch, limiter, user_id):
    assert limiter.check(user_id, 1, 60) == (True, 0, 0)
    assert limiter.check(user_id, 1, 60)[0] is False
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "on")
    assert limiter.check(user_id, 1, 60) == (True, 1, 0)


# ------------------------------------------- the warning, in a process of its own
# These probes run the blocking RateLimiter in a child process, whatever the kind: they take
# no limiter fixture. test_async_kill_switch.py has the probe with async limiters.

WARNING_PROBE = textwrap.dedent("""
    import json, logging, os, sys

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logging.getLogger("genai_ratelimit").addHandler(Keep(logging.DEBUG))
    from genai_ratelimit import RateLimiter

    url, switch = sys.argv[1], sys.argv[2]
    first, second = RateLimiter(url, connect_timeout=0.5), RateLimiter(url, connect_timeout=0.5)
    if switch:
        os.environ["RATE_LIMIT_DISABLED"] = switch
    results = []
    for limiter in (first, second, first):
        for _ in range(5):
            try:
                results.append(list(limiter.check("user-1", 3, 60)))
            except Exception as exc:
                results.append(type(exc).__name__)
        results.append(list(limiter.check_windows("user-1", [(3, 60), (9, 86400)]))
                       if switch else None)
    warnings = [(r.name, r.getMessage()) for r in records if r.levelno == logging.WARNING]
    print(json.dumps({"results": results, "warnings": warnings,
                      "other": [(r.levelname, r.getMessage()) for r in records
                                if r.levelno != logging.WARNING]}))
""")


def run_probe(tmp_path, switch: str) -> dict:
    """Runs the probe in a fresh interpreter (outside the source tree, so it imports the
    installed package) with warnings as errors, on a closed port."""
    env = {k: v for k, v in os.environ.items() if k != "RATE_LIMIT_DISABLED"}
    completed = subprocess.run(
        [sys.executable, "-W", "error", "-c", WARNING_PROBE, closed_port_url(), switch],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_kill_switch_warns_exactly_once_per_process(tmp_path):
    report = run_probe(tmp_path, "true")
    assert [r for r in report["results"] if r is not None and len(r) == 3] == [[True, 3, 0]] * 15
    assert len(report["warnings"]) == 1, report["warnings"]
    name, message = report["warnings"][0]
    assert name == "genai_ratelimit" or name.startswith("genai_ratelimit.")
    assert "RATE_LIMIT_DISABLED" in message


def test_no_kill_switch_warning_while_it_is_off(tmp_path):
    report = run_probe(tmp_path, "")
    assert set(map(str, report["results"])) <= {"RateLimiterUnavailable", "RateLimiterTimeout", "None"}
    assert report["warnings"] == []


# ------------------------------ what Redis already holds: given back whatever the switch says
# The switch stops new decisions only. A release, renew, reconcile (release=True included)
# or reset of something Redis holds always reaches Redis: skipped, it would leave the slot
# or the entries held, and the user refused once the switch goes off again.


def test_a_release_while_the_switch_is_on_frees_the_slot(monkeypatch, limiter, redis_client, user_id):
    lease = limiter.acquire(user_id, 1, 300)
    assert lease.allowed and lease.lease_id
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "true")
    assert limiter.release(lease) is True, "the release did not reach Redis"
    assert redis_client.pttl(f"ratelimit:{user_id}:leases") == -2, "the slot is still held"
    monkeypatch.delenv("RATE_LIMIT_DISABLED")
    after = limiter.acquire(user_id, 1, 300)
    assert (after.allowed, after.retry_after_s) == (True, 0)
    limiter.release(after)


def test_a_renew_while_the_switch_is_on_extends_the_lease_in_redis(
        monkeypatch, limiter, redis_client, user_id):
    lease = limiter.acquire(user_id, 1, 30)
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "true")
    assert limiter.renew(lease, 600) is True
    assert redis_client.pttl(f"ratelimit:{user_id}:leases") > 500_000, "the renew did not reach Redis"
    monkeypatch.delenv("RATE_LIMIT_DISABLED")
    limiter.release(lease)
    # A lease Redis no longer holds is not renewed, switch on or off: its slot may be taken.
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "true")
    assert limiter.renew(lease, 600) is False


def test_a_reconcile_while_the_switch_is_on_refunds_in_redis(monkeypatch, limiter, redis_client, user_id):
    reservation = limiter.reserve(user_id, [(5, 60)], cost=5)
    assert reservation.allowed and limiter.check(user_id, 5, 60)[0] is False
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "true")
    assert limiter.reconcile(reservation, 0) == 1, "the reconcile did not reach Redis"
    monkeypatch.delenv("RATE_LIMIT_DISABLED")
    assert logged_entries(redis_client, f"ratelimit:{user_id}:60") == 0
    assert limiter.check(user_id, 5, 60) == (True, 4, 0)


def test_a_reconcile_with_release_while_the_switch_is_on_frees_the_slot(
        monkeypatch, limiter, redis_client, user_id):
    reservation = limiter.reserve(user_id, [(10, 60)], in_flight=(1, 300))
    assert reservation.allowed and reservation.lease is not None and reservation.lease.lease_id
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "true")
    assert limiter.reconcile(reservation, 1, release=True) == 1
    assert redis_client.pttl(f"ratelimit:{user_id}:leases") == -2, "the slot is still held"
    monkeypatch.delenv("RATE_LIMIT_DISABLED")
    after = limiter.reserve(user_id, [(10, 60)], in_flight=(1, 300))
    assert after.allowed and after.lease is not None and after.lease.allowed
    limiter.reconcile(after, 1, release=True)


@pytest.mark.parametrize("every_window", [False, True], ids=["named-windows", "every-window"])
def test_a_reset_while_the_switch_is_on_forgets_the_entries(
        monkeypatch, limiter, redis_client, user_id, every_window):
    assert limiter.check(user_id, 1, 60) == (True, 0, 0)
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "true")
    removed = limiter.reset(user_id) if every_window else limiter.reset(user_id, [(1, 60)])
    assert removed == 1, "the reset did not reach Redis"
    monkeypatch.delenv("RATE_LIMIT_DISABLED")
    assert limiter.check(user_id, 1, 60) == (True, 0, 0)


def test_what_the_switch_granted_is_given_back_without_redis(monkeypatch, unreachable_limiter):
    # Granted by the switch, nothing is held: its release, renew and reconcile send nothing.
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "true")
    lease = unreachable_limiter.acquire("user-1", 1, 30)
    assert lease.allowed and lease.lease_id == ""
    assert unreachable_limiter.renew(lease) is True
    assert unreachable_limiter.release(lease) is False
    reservation = unreachable_limiter.reserve("user-1", [(5, 60)], in_flight=(1, 30))
    assert reservation.allowed and reservation.member == ""
    assert unreachable_limiter.reconcile(reservation, 0, release=True) == 0
