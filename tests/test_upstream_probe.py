"""The cold start of a cap that follows its provider (docs/upstreams.md, "Cold start"):
`Scope(..., probe=N)` admits at most N requests until the provider's first answer is
observed (lib/upstream.lua), on every limiter kind and both storages; the probes' expiry;
what a plain cap costs; bad input; the FastAPI `Upstream` and the tiers file. The time is
the test's (ManualClock, clock="client") where a timeout must pass: no sleep."""

from __future__ import annotations

import asyncio
import math
import threading
import uuid
from typing import Any

import pytest
import redis
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from genai_ratelimit import Scope, _native
from genai_ratelimit._tiers_config import TierConfigError, scope_sections_of
from genai_ratelimit.fastapi import RateLimit, Upstream
from genai_ratelimit.testing import ManualClock
from helpers_async import LimiterFactory

UPSTREAM = "openai/gpt-4o"
VIEW_KEY = f"ratelimit:{UPSTREAM}:upstream"


def following(probe: int = 1, per_minute: int = 100, timeout: float = 30.0) -> Scope:
    return Scope(UPSTREAM, windows=[(per_minute, 60)], shared=True, probe=probe,
                 probe_timeout_seconds=timeout)


def openai_headers(remaining: int, reset: str = "60s", limit: int = 20) -> dict[str, str]:
    return {"x-ratelimit-limit-requests": str(limit),
            "x-ratelimit-remaining-requests": str(remaining), "x-ratelimit-reset-requests": reset}


def test_a_cold_cap_admits_its_probe_and_refuses_the_rest_with_a_short_wait(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    a, b = make_limiter(redis_url), make_limiter(redis_url)
    answers = [limiter.reserve(f"t{i}", [(50, 60)], scopes=[following(2)])
               for i, limiter in enumerate((a, b, a, b))]
    assert [r.allowed for r in answers] == [True, True, False, False]
    for refused in answers[2:]:
        assert refused.scope == following(2)
        assert 0 < refused.retry_after_ms <= 1000 and refused.retry_after_s == 1
        assert refused.member == ""  # nothing logged: no tenant charged
    assert redis_client.exists("ratelimit:t2:60", "ratelimit:t3:60",
                               "ratelimit:t2:60:c", "ratelimit:t3:60:c") == 0


def test_the_first_observation_opens_the_cap_to_what_the_provider_has_left(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    limiter = make_limiter(redis_url)
    assert limiter.reserve("probe", [(50, 60)], scopes=[following()]).allowed
    assert not limiter.reserve("t0", [(50, 60)], scopes=[following()]).allowed
    limiter.observe_upstream(UPSTREAM, 200, openai_headers(5))  # the probe's own answer
    answers = [limiter.reserve(f"t{i}", [(50, 60)], scopes=[following()]) for i in range(7)]
    assert [r.allowed for r in answers] == [True] * 5 + [False, False]
    assert answers[-1].retry_after_s == 60  # now the provider's reset, not the probe's wait


def test_a_silent_success_ends_the_cold_start(make_limiter: LimiterFactory,
                                              redis_url: str, redis_client: redis.Redis) -> None:
    limiter = make_limiter(redis_url)
    assert limiter.reserve("probe", [(50, 60)], scopes=[following()]).allowed
    limiter.observe_upstream(UPSTREAM, 200, {"content-type": "application/json"})
    assert all(limiter.reserve(f"t{i}", [(50, 60)], scopes=[following()]).allowed
               for i in range(10))


def test_a_probe_whose_answer_never_comes_frees_after_its_timeout(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    with ManualClock() as clock:
        limiter = make_limiter(redis_url, clock="client")
        assert limiter.reserve("lost", [(50, 60)], scopes=[following(timeout=5)]).allowed
        clock.advance(4.5)
        refused = limiter.reserve("t0", [(50, 60)], scopes=[following(timeout=5)])
        assert not refused.allowed and refused.retry_after_ms == 500  # until the timeout
        clock.advance(0.5)  # the probe stops counting: a new round, one probe again
        assert [limiter.reserve(f"t{i}", [(50, 60)], scopes=[following(timeout=5)]).allowed
                for i in range(1, 4)] == [True, False, False]
    assert redis_client.pttl(VIEW_KEY) > 0  # the probes' key expires by itself


def test_the_limit_stays_known_after_the_reset_no_probe_again(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    with ManualClock() as clock:
        limiter = make_limiter(redis_url, clock="client")
        assert limiter.reserve("probe", [(500, 60)], scopes=[following()]).allowed
        limiter.observe_upstream(UPSTREAM, 200, openai_headers(0, "10s", limit=20),
                                 max_close_seconds=60)
        assert not limiter.reserve("t", [(500, 60)], scopes=[following()]).allowed
        clock.advance(10)  # the reset: the provider's limit again, not a cold cap's probe
        answers = [limiter.reserve(f"t{i}", [(500, 60)], scopes=[following()])
                   for i in range(21)]
        assert [r.allowed for r in answers] == [True] * 20 + [False]


@pytest.mark.parametrize("probe", [1, 3])
def test_the_probe_is_exact_under_concurrency(make_limiter: LimiterFactory, redis_url: str,
                                              redis_client: redis.Redis, probe: int) -> None:
    scope = following(probe)
    if make_limiter.is_async:
        native = make_limiter.native(redis_url)

        async def burst() -> list[Any]:
            return list(await asyncio.gather(*(native.reserve(f"t{i}", [(50, 60)],
                                                              scopes=[scope])
                                               for i in range(40))))

        assert make_limiter.loop_factory is not None
        loop = make_limiter.loop_factory()
        try:
            answers = loop.run_until_complete(burst())
        finally:
            loop.run_until_complete(native.aclose())
            loop.close()
    else:
        limiters = [make_limiter(redis_url) for _ in range(2)]
        answers = []
        lock = threading.Lock()
        start = threading.Barrier(8)

        def client(number: int) -> None:
            start.wait()
            for i in range(5):
                answer = limiters[number % 2].reserve(f"t{number}-{i}", [(50, 60)],
                                                      scopes=[scope])
                with lock:
                    answers.append(answer)

        threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(answers) == 40
    assert sum(r.allowed for r in answers) == probe


def test_a_lying_header_never_opens_more_than_the_operators_cap(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    limiter = make_limiter(redis_url)
    scope = following(per_minute=3)
    assert limiter.reserve("probe", [(50, 60)], scopes=[scope]).allowed
    limiter.observe_upstream(UPSTREAM, 200, openai_headers(10 ** 6, limit=10 ** 6))
    answers = [limiter.reserve(f"t{i}", [(50, 60)], scopes=[scope]) for i in range(4)]
    assert [r.allowed for r in answers] == [True, True, False, False]  # 3 in all
    assert answers[-1].retry_after_s > 1  # the cap's own window refused


def test_a_cap_without_probe_is_not_cold(make_limiter: LimiterFactory, redis_url: str,
                                         redis_client: redis.Redis) -> None:
    limiter = make_limiter(redis_url)
    plain = Scope(UPSTREAM, windows=[(100, 60)], shared=True)
    assert all(limiter.reserve(f"t{i}", [(50, 60)], scopes=[plain]).allowed for i in range(5))


@pytest.mark.limiter_kinds("sync", reason="counts the server's commands of one decision path")
def test_the_probe_costs_a_plain_cap_nothing_and_a_cold_cap_a_few_writes(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    limiter = make_limiter(redis_url)
    plain = Scope("plain", windows=[(100, 60)], shared=True)
    limiter.reserve("warm", [(50, 60)], scopes=[plain])  # the script loaded
    redis_client.config_resetstat()
    for i in range(5):
        assert limiter.reserve(f"t{i}", [(50, 60)], scopes=[plain]).allowed
    stats = redis_client.info("commandstats")
    assert stats["cmdstat_exists"]["calls"] == 5 + 5  # the view's and the queue's, as before
    assert not {"cmdstat_hmget", "cmdstat_hincrby", "cmdstat_hset"} & set(stats)
    redis_client.config_resetstat()
    assert limiter.reserve("probe", [(50, 60)], scopes=[following()]).allowed
    stats = redis_client.info("commandstats")
    assert stats["cmdstat_hset"]["calls"] == 2  # the probe, and the request on its way
    assert stats["cmdstat_pexpire"]["calls"] >= 1


def test_a_probe_with_in_flight_is_refused_before_any_io(unreachable_limiter: Any) -> None:
    with pytest.raises(ValueError, match="in_flight"):
        unreachable_limiter.reserve("t", [(5, 60)], scopes=[following()], in_flight=(2, 60))


def test_peek_ignores_the_probe(make_limiter: LimiterFactory, redis_url: str,
                                redis_client: redis.Redis) -> None:
    limiter = make_limiter(redis_url)
    assert limiter.peek("t", [(5, 60)], scopes=[following()])[0]
    assert redis_client.keys("*") == []


@pytest.mark.parametrize(("options", "error"), [
    ({"probe": -1}, ValueError), ({"probe": 1001}, ValueError), ({"probe": True}, TypeError),
    ({"probe": 1.0}, TypeError), ({"probe": "1"}, TypeError),
    ({"probe": 1, "probe_timeout_seconds": 0}, ValueError),
    ({"probe": 1, "probe_timeout_seconds": -5}, ValueError),
    ({"probe": 1, "probe_timeout_seconds": math.nan}, ValueError),
    ({"probe": 1, "probe_timeout_seconds": math.inf}, ValueError),
    ({"probe": 1, "probe_timeout_seconds": 86401}, ValueError),
    ({"probe": 1, "probe_timeout_seconds": "30"}, TypeError),
])
def test_bad_probe_options_are_refused(options: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        Scope(UPSTREAM, windows=[(10, 60)], shared=True, **options)
    with pytest.raises(error):
        Upstream(UPSTREAM, per_minute=10, **options)


def test_a_probe_needs_a_shared_scope() -> None:
    with pytest.raises(ValueError, match="shared"):
        Scope("model:x", windows=[(10, 60)], probe=1)


@pytest.mark.limiter_kinds("sync", reason="the blocking limiter's C call (the codec's "
                                         "parses the same arguments in csrc/py_request.c)")
def test_a_bad_probe_spec_is_refused_by_the_c_layer(unreachable_limiter: Any) -> None:
    for spec, error in [(7, TypeError), ("S 1", ValueError), ("P", ValueError)]:
        with pytest.raises(error):
            unreachable_limiter._reserve("t", ((5, 60),), probe=spec)


# --------------------------------------------------------------------------- FastAPI


@pytest.mark.no_hiredis1(reason="FastAPI over TestClient drives the codec and pipeline the async "
                                "tests drive on hiredis 1.x")
def test_an_upstream_with_probe_refuses_a_cold_burst_but_its_probe(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    upstream = Upstream(UPSTREAM, per_minute=100, probe=1, probe_timeout_seconds=10)
    scope = upstream.scope()
    assert scope is not None and scope.probe == 1 and scope.probe_timeout_seconds == 10
    limit = RateLimit(limiter=make_limiter.native(redis_url), upstream=upstream,
                      identify=lambda request: (request.headers["x-user"], "pro"))
    app = FastAPI()

    @app.post("/v1/chat/completions", dependencies=[Depends(limit)])
    async def chat() -> dict[str, bool]:
        return {"ok": True}

    with TestClient(app) as client:
        answers = [client.post("/v1/chat/completions", headers={"x-user": f"u{i}"})
                   for i in range(3)]
    assert [a.status_code for a in answers] == [200, 429, 429]
    assert answers[1].headers["retry-after"] == "1"
    assert answers[1].headers["x-ratelimit-scope"] == "upstream"


def test_the_tiers_file_takes_an_upstreams_probe() -> None:
    _, upstreams = scope_sections_of({"upstreams": {UPSTREAM: {
        "per_minute": 500, "probe": 2, "probe_timeout_seconds": 20}}}, "tiers.toml")
    budget, _, options = upstreams[UPSTREAM]
    assert budget == {"per_minute": 500}
    assert options["probe"] == 2 and options["probe_timeout_seconds"] == 20
    for bad in ({"probe": -1}, {"probe": "x"}, {"probe": 1, "probe_timeout_seconds": 0}):
        with pytest.raises(TierConfigError):
            scope_sections_of({"upstreams": {UPSTREAM: {"per_minute": 5, **bad}}}, "tiers.toml")


def test_with_max_wait_a_refused_request_waits_for_the_probes_round(
        make_limiter: LimiterFactory, redis_url: str, redis_client: redis.Redis) -> None:
    """The probe's answer never comes: the waiter is woken at the refusals' named times
    (at most a second apart) and admitted as the next round's probe, after the timeout."""
    a, b = make_limiter(redis_url), make_limiter(redis_url)
    scope = following(timeout=1.5)
    assert a.reserve("lost", [(50, 60)], scopes=[scope]).allowed
    waited = b.reserve("waiter", [(50, 60)], scopes=[scope], max_wait=5)
    assert waited.allowed and waited.queue_outcome == "queued_then_allowed"
    assert 1000 <= waited.waited_ms < 5000


@pytest.mark.parametrize("shares", [False, True])
def test_a_replay_after_the_probe_spec_counts_the_probe_once(redis_client: redis.Redis,
                                                             shares: bool) -> None:
    """The script's tail: [shares] probe ["1"]: the replay marker is still read, and a
    replayed probe is allowed again without a second probe counted."""
    sha = redis_client.script_load(_native.SCRIPT_SOURCE)
    windows = ["ratelimit:t:60", f"ratelimit:{UPSTREAM}:60:shared"]
    keys = windows + [f"{w}:w" for w in windows] + [f"{w}:t" for w in windows]
    keys += [VIEW_KEY, f"ratelimit:{UPSTREAM}:queue", f"ratelimit:{UPSTREAM}:queue:h"]
    spec = ["S 1 0 1 pro 1 60000 requests 0 100 100"] if shares else []
    member = str(uuid.uuid4())

    def call(who: str, *tail: str) -> Any:
        return redis_client.evalsha(sha, len(keys), *keys, who, "", 60_000, 50, 1,
                                    60_000, 100, 1, *spec, "P 1 30000", *tail)

    assert call(member)[0] == 1
    assert call(member, "1")[0] == 1  # the replay: allowed again, nothing more counted
    assert int(redis_client.hget(VIEW_KEY, "probe_out")) == 1
    assert call(str(uuid.uuid4()))[0] == 0  # the probe is out: the next one waits
