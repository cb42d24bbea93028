"""The HTTP floor's decision plan (genai_ratelimit.fastapi._plan), on its own: no Redis, no
HTTP, no event loop. Each case gives a request's facts and the answers the limiter would give,
and checks the calls the plan makes and the outcome it returns. The behaviour suites
(test_fastapi*.py) check the same decisions end to end, through both drivers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from genai_ratelimit import RateLimiterError
from genai_ratelimit.fastapi._plan import (
    Allowed,
    Call,
    Facts,
    Outcome,
    Policy,
    Refused,
    Unavailable,
    plan,
    run,
    run_async,
)
from genai_ratelimit.lease import HINT_WITHOUT_HISTORY_MS, Lease
from genai_ratelimit.reservation import Reservation, Scope, WindowState

NOW = 1_700_000_000_000
MINUTE_DAY = ((5, 60), (100, 86_400))
TOKENS = ((1_000, 60),)
ENFORCE = Policy(clock=lambda: NOW, decide="check_windows_detailed")
SHADOW = Policy(shadow=True, clock=lambda: NOW)
FUSED = Policy(fused=True, clock=lambda: NOW)


def drive(facts: Facts, policy: Policy, answers: Sequence[Any]) -> tuple[list[Call], Outcome]:
    """Runs the plan with `answers` given to its calls in order (an exception is raised into
    it); returns the calls it made and its outcome."""
    calls: list[Call] = []
    steps = plan(facts, policy)
    pending = list(answers)
    try:
        call = next(steps)
        while True:
            calls.append(call)
            answer = pending.pop(0)
            call = steps.throw(answer) if isinstance(answer, BaseException) else steps.send(answer)
    except StopIteration as done:
        assert pending == [], "the plan stopped before asking every call"
        return calls, done.value


def lease(allowed: bool, held: int = 1, retry_after_ms: int = 0, bound_ms: int = 0) -> Lease:
    return Lease(allowed, held, 0, -(-retry_after_ms // 1000), retry_after_ms, "lease-1",
                 NOW + 300_000, "alice", 2, 300, bound_ms)


def reservation(allowed: bool = True, *, windows: tuple[WindowState, ...] = (),
                resource: str = "requests", window_seconds: int = 60, retry_after_ms: int = 0,
                scope: Scope | None = None, held: Lease | None = None) -> Reservation:
    return Reservation(allowed, 0, -(-retry_after_ms // 1000), window_seconds, resource,  # type: ignore[arg-type]
                       retry_after_ms, "alice", 1, 50, windows, "m", NOW - 5, scope, lease=held)


def headers(verdict: Refused) -> dict[str, str]:
    return dict(verdict.contract)


# --- request windows (RateLimit) --------------------------------------------------------------


def test_a_tiers_burst_is_one_detailed_check_with_the_minute_as_gcra() -> None:
    facts = Facts("alice", "free", MINUTE_DAY, gcra=(5, 60, 2))
    calls, out = drive(facts, ENFORCE, [(True, 1, 0, 60)])
    assert calls == [Call("check_windows_detailed", ("alice", ((100, 86_400),)), {"gcra": (5, 60, 2)})]
    assert out.verdicts == [Allowed((WindowState(5, 60, "requests", 1),), NOW)]
    # A refusal by the bucket names the minute, with per_minute as the limit.
    _, out = drive(facts, ENFORCE, [(False, 0, 12, 60)])
    (refused,) = out.verdicts
    assert isinstance(refused, Refused) and refused.retry == (12, 12_000)
    assert headers(refused) == {"X-RateLimit-Limit": "5", "X-RateLimit-Remaining": "0",
                                "X-RateLimit-Window": "minute"}


def test_a_request_budget_is_one_detailed_check_and_an_allowed_verdict() -> None:
    calls, out = drive(Facts("alice", "free", MINUTE_DAY), ENFORCE, [(True, 4, 0, 60)])
    assert calls == [Call("check_windows_detailed", ("alice", MINUTE_DAY), {})]
    assert out.remember == (True, 4, 0, 60) and out.hold is None
    assert out.verdicts == [Allowed((WindowState(5, 60, "requests", 4),), NOW)]


def test_a_refusal_names_the_refusing_window_its_limit_and_the_rounded_up_wait() -> None:
    _, out = drive(Facts("alice", "free", MINUTE_DAY), ENFORCE, [(False, 0, 3_600, 86_400)])
    [verdict] = out.verdicts
    assert isinstance(verdict, Refused)
    assert headers(verdict) == {"X-RateLimit-Limit": "100", "X-RateLimit-Remaining": "0",
                                "X-RateLimit-Window": "day"}
    # A plain 4-tuple carries no exact wait: its seconds in ms, and the policy's clock.
    assert verdict.retry == (3_600, 3_600_000) and verdict.now_ms == NOW
    assert (verdict.outcome, verdict.resource, verdict.window_seconds, verdict.scope) == \
        ("rejected", "requests", 86_400, "user")
    assert verdict.message is not None and "Limit 100" in verdict.message
    assert out.remember == (False, 0, 3_600, 86_400)  # the route's other dependencies reuse it


def test_a_decision_already_counted_on_this_route_asks_nothing() -> None:
    calls, out = drive(Facts("alice", "free", MINUTE_DAY, counted=(True, 2, 0, 60)), ENFORCE, [])
    assert calls == [] and out.remember is None
    assert out.verdicts == [Allowed((WindowState(5, 60, "requests", 2),), NOW)]


def test_redis_unavailable_is_a_verdict_not_an_exception() -> None:
    error = RateLimiterError("connection refused")
    _, out = drive(Facts("alice", "free", MINUTE_DAY), ENFORCE, [error])
    assert out.verdicts == [Unavailable(error)] and out.remember is None


# --- in-flight slots --------------------------------------------------------------------------


def test_a_capped_tier_takes_its_slot_before_the_windows() -> None:
    calls, out = drive(Facts("alice", "free", MINUTE_DAY, cap=2), ENFORCE,
                       [lease(True), (True, 4, 0, 60)])
    assert [c.method for c in calls] == ["acquire", "check_windows_detailed"]
    assert calls[0].args == ("alice", 2, 300)
    assert out.hold is not None and out.hold.allowed


@pytest.mark.parametrize(("hint_ms", "bound_ms", "fixed", "retry"), [
    (2_500, 40_000, None, (3, 2_500)),      # the limiter's hint
    (2_500, 1_200, None, (2, 1_200)),       # never past the soonest lease's expiry
    (90_000, 0, None, (60, 60_000)),        # at most 60 s; no bound: the hint is it
    (2_500, 40_000, 7.0, (7, 7_000)),       # in_flight_retry_after replaces the hint
])
def test_a_refused_slot_is_a_concurrency_429_and_nothing_more_is_asked(
        hint_ms: int, bound_ms: int, fixed: float | None, retry: tuple[int, int]) -> None:
    policy = Policy(in_flight_retry_after=fixed, clock=lambda: NOW)
    calls, out = drive(Facts("alice", "free", MINUTE_DAY, cap=2), policy,
                       [lease(False, 2, hint_ms, bound_ms)])
    assert [c.method for c in calls] == ["acquire"] and out.hold is None
    [verdict] = out.verdicts
    assert isinstance(verdict, Refused) and verdict.retry == retry
    assert headers(verdict) == {"X-RateLimit-Limit": "2", "X-RateLimit-Remaining": "0",
                                "X-RateLimit-Window": "concurrent"}
    assert (verdict.outcome, verdict.resource, verdict.window_seconds) == \
        ("concurrency_rejected", "in_flight", None)


def test_in_shadow_mode_a_refused_slot_is_recorded_and_the_windows_still_decide() -> None:
    calls, out = drive(Facts("shadow:alice", "free", MINUTE_DAY, cap=2), SHADOW,
                       [lease(False, 2, 1_000), (True, 4, 0, 60)])
    assert [c.method for c in calls] == ["acquire", "check_windows"]
    assert [type(v) for v in out.verdicts] == [Refused, Allowed]


def test_a_slot_another_dependency_holds_is_checked_against_this_cap_without_a_call() -> None:
    held = lease(True, held=3)
    calls, out = drive(Facts("alice", "free", MINUTE_DAY, cap=2, held=held), ENFORCE, [])
    assert calls == []
    [verdict] = out.verdicts
    assert isinstance(verdict, Refused) and verdict.outcome == "concurrency_rejected"
    assert verdict.retry == (HINT_WITHOUT_HISTORY_MS // 1000, HINT_WITHOUT_HISTORY_MS)
    # Within the cap: no second slot, the windows decide.
    calls, out = drive(Facts("alice", "free", MINUTE_DAY, cap=3, held=held), ENFORCE, [(True, 1, 0, 60)])
    assert [c.method for c in calls] == ["check_windows_detailed"] and out.hold is None


def test_a_slot_taken_before_redis_failed_is_still_held_for_its_release() -> None:
    error = RateLimiterError("timeout")
    _, out = drive(Facts("alice", "free", MINUTE_DAY, cap=2), ENFORCE, [lease(True), error])
    assert out.hold is not None and out.verdicts == [Unavailable(error)]


# --- tokens and scopes (TokenRateLimit, RateLimit with scopes) --------------------------------


def test_a_token_request_is_one_reserve_with_its_estimate() -> None:
    facts = Facts("alice", "free", MINUTE_DAY, TOKENS, 40)
    states = (WindowState(5, 60, "requests", 4), WindowState(100, 86_400, "requests", 99),
              WindowState(1_000, 60, "tokens", 960))
    calls, out = drive(facts, ENFORCE, [reservation(windows=states)])
    assert calls == [Call("reserve", ("alice", MINUTE_DAY),
                          {"cost": 1, "token_windows": TOKENS, "tokens": 40})]
    [verdict] = out.verdicts
    assert isinstance(verdict, Allowed) and verdict.record and verdict.reservation is not None
    assert verdict.states == (states[0], states[2])  # the tightest of each resource
    assert out.remember == (True, 4, 0, 60)


def test_an_estimate_above_a_token_limit_is_refused_before_anything_is_reserved() -> None:
    calls, out = drive(Facts("alice", "free", MINUTE_DAY, TOKENS, 1_001, cap=2), ENFORCE, [])
    assert calls == []
    [verdict] = out.verdicts
    assert isinstance(verdict, Refused) and verdict.retry is None and verdict.message is None
    assert (verdict.outcome, verdict.requested, verdict.scope) == ("too_large", 1_001, "user")
    assert headers(verdict)["X-RateLimit-Resource"] == "tokens"


def test_a_fused_slot_rides_on_the_reserve_and_its_refusal_comes_first() -> None:
    facts = Facts("alice", "free", MINUTE_DAY, TOKENS, 40, cap=2)
    refused = reservation(False, held=lease(False, 2, 900))
    calls, out = drive(facts, FUSED, [refused])
    assert calls[0].kwargs["in_flight"] == (2, 300)
    assert [v.outcome for v in out.verdicts if isinstance(v, Refused)] == ["concurrency_rejected"]


@pytest.mark.parametrize("upstream", [
    Scope("openai/gpt-4o", windows=[(100, 60)], shared=True, probe=1),
    Scope("openai/gpt-4o", windows=[(100, 60)], shared=True, reserved={"pro": 30}),
], ids=["probe", "shares"])
def test_a_slot_is_not_fused_through_a_cap_whose_reserve_refuses_in_flight(
        upstream: Scope) -> None:
    """reserve(in_flight=...) does not go with a cold-start probe or reserved shares yet
    (ValueError): the tier's slot is then taken apart, as with a limiter that cannot fuse."""
    facts = Facts("alice", "free", MINUTE_DAY, TOKENS, 40, cap=2, scopes=(upstream,))
    calls, out = drive(facts, FUSED, [lease(True), reservation(True)])
    assert [c.method for c in calls] == ["acquire", "reserve"]
    assert "in_flight" not in calls[1].kwargs
    assert out.hold is not None


def test_a_token_refusal_reports_both_resources_in_the_provider_family() -> None:
    facts = Facts("alice", "free", MINUTE_DAY, TOKENS, 40)
    refused = reservation(False, resource="tokens", retry_after_ms=1_500,
                          windows=(WindowState(5, 60, "requests", 4),
                                   WindowState(1_000, 60, "tokens", None)))
    _, out = drive(facts, ENFORCE, [refused])
    [verdict] = out.verdicts
    assert isinstance(verdict, Refused) and verdict.family is not None
    assert [(f.resource, f.limit, f.remaining) for f in verdict.family] == \
        [("requests", 5, 4), ("tokens", 1_000, 0)]
    assert verdict.message is not None and "Requested 40" in verdict.message


def test_an_upstream_refusal_says_it_is_not_the_users_limit_and_carries_no_family() -> None:
    upstream = Scope("openai/gpt-4o", windows=[(100, 60)], shared=True)
    refused = reservation(False, scope=upstream, retry_after_ms=2_000,
                          windows=(WindowState(100, 60, "requests", 0, upstream),))
    calls, out = drive(Facts("alice", "free", MINUTE_DAY, scopes=(upstream,)), ENFORCE, [refused])
    assert calls == [Call("reserve", ("alice", MINUTE_DAY), {"scopes": (upstream,)})]
    [verdict] = out.verdicts
    assert isinstance(verdict, Refused) and verdict.family is None and verdict.ietf is None
    assert headers(verdict)["X-RateLimit-Scope"] == "upstream"
    assert verdict.message is not None and "not your own rate limit" in verdict.message


def test_scopes_with_the_windows_already_counted_reserve_the_scopes_only() -> None:
    route = Scope("route:/v1/x", windows=[(2, 60)])
    calls, out = drive(Facts("alice", "free", MINUTE_DAY, scopes=(route,), counted=(True, 3, 0, 60)),
                       ENFORCE, [reservation(windows=(WindowState(2, 60, "requests", 1, route),))])
    assert calls[0].args == ("alice", ())
    assert out.verdicts == [Allowed((WindowState(5, 60, "requests", 3),), NOW)]



def test_only_a_decision_the_route_shares_is_counted_once_in_shadow_mode() -> None:
    # check_windows' decision is remembered for the route's other dependencies: its id names it.
    _, out = drive(Facts("shadow:alice", "free", MINUTE_DAY), SHADOW, [(False, 0, 30, 60)])
    [verdict] = out.verdicts
    assert isinstance(verdict, Refused) and out.remember is not None
    assert verdict.once == id(out.remember)
    # A scope reserve refused by the user's own windows makes a decision no one keeps: once
    # it is gone its id may name another dependency's, so it is counted every time.
    route = Scope("route:/v1/x", windows=[(2, 60)])
    refused = reservation(False, retry_after_ms=30_000, windows=(WindowState(5, 60, "requests", 0),))
    _, out = drive(Facts("shadow:alice", "free", MINUTE_DAY, scopes=(route,)), SHADOW, [refused])
    [verdict] = out.verdicts
    assert isinstance(verdict, Refused) and verdict.once is None and out.remember is None

# --- the blocking driver ----------------------------------------------------------------------


class Recorder:
    """A limiter that answers from a script and records what it was asked."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def method(*args: Any, **kwargs: Any) -> Any:
            self.asked.append(name)
            answer = self.answers.pop(0)
            if isinstance(answer, BaseException):
                raise answer
            return answer
        return method


def test_the_blocking_driver_moves_calls_and_throws_limiter_errors_into_the_plan() -> None:
    error = RateLimiterError("down")
    limiter = Recorder(lease(True), error)
    out = run(plan(Facts("alice", "free", MINUTE_DAY, cap=2), ENFORCE), limiter)
    assert limiter.asked == ["acquire", "check_windows_detailed"]
    assert out.hold is not None and out.verdicts == [Unavailable(error)]


def test_the_blocking_driver_lets_other_exceptions_through() -> None:
    with pytest.raises(ZeroDivisionError):
        run(plan(Facts("alice", "free", MINUTE_DAY), ENFORCE), Recorder(ZeroDivisionError()))


def test_the_asyncio_driver_awaits_each_call_or_offloads_a_blocking_limiter() -> None:
    class Awaited(Recorder):
        def __getattr__(self, name: str) -> Any:
            method = super().__getattr__(name)

            async def awaited(*args: Any, **kwargs: Any) -> Any:
                return method(*args, **kwargs)
            return awaited

    offloaded: list[str] = []

    async def offload(function: Any) -> Any:
        offloaded.append(function.func.__name__)
        return function()

    async def both() -> tuple[Outcome, Outcome]:
        facts = Facts("alice", "free", MINUTE_DAY, cap=2)
        awaited = await run_async(plan(facts, ENFORCE), Awaited(lease(True), (True, 3, 0, 60)))
        blocking = await run_async(plan(facts, ENFORCE), Recorder(lease(True), RateLimiterError("x")),
                                   offload)
        return awaited, blocking

    awaited, blocking = asyncio.run(both())
    assert awaited.hold is not None and isinstance(awaited.verdicts[0], Allowed)
    assert offloaded == ["method", "method"] and isinstance(blocking.verdicts[0], Unavailable)


# --- money (TokenRateLimit with prices) --------------------------------------------------------

def _spend_facts(cap: int | None = None) -> Facts:
    from genai_ratelimit import Budget, PriceTable
    from genai_ratelimit.fastapi._spend import SpendFacts
    table = PriceTable.from_mapping({"version": "t", "currency": "USD",
                                     "models": {"m": {"input": 1, "output": 1}}})
    spend = SpendFacts((Budget("alice", "daily_usd", 100, "day", level="key"),), 82, 86_400, "m", table)
    return Facts("alice", "free", MINUTE_DAY, TOKENS, 40, cap=cap, spend=spend)


def _hold(facts: Facts, allowed: bool, reason: str | None = None) -> Any:
    from genai_ratelimit.periods import BudgetHold, BudgetPeriod
    assert facts.spend is not None
    period = BudgetPeriod(facts.spend.budgets[0], 82, 18 if allowed else 0, NOW - 1_000, NOW + 1_000)
    return BudgetHold(allowed, "h-1" if allowed else "", (period,), NOW,
                      None if allowed else 0, reason)  # type: ignore[arg-type]


STATES = (WindowState(5, 60, "requests", 4), WindowState(1_000, 60, "tokens", 960))


def test_the_money_is_held_after_the_tokens_and_kept_in_the_verdict() -> None:
    facts = _spend_facts()
    hold = _hold(facts, True)
    calls, out = drive(facts, ENFORCE, [reservation(windows=STATES), hold])
    assert [call.method for call in calls] == ["reserve", "hold_budgets"]
    assert calls[1] == Call("hold_budgets", (facts.spend.budgets, 82),  # type: ignore[union-attr]
                            {"hold_seconds": 86_400})
    [verdict] = out.verdicts
    assert isinstance(verdict, Allowed) and verdict.spend is not None and verdict.spend.hold is hold


@pytest.mark.parametrize("fused", [True, False])
def test_a_refusal_by_a_budget_gives_the_reservation_and_the_slot_back(fused: bool) -> None:
    facts = _spend_facts(cap=2)
    policy = FUSED if fused else ENFORCE
    reserved = reservation(windows=STATES, held=lease(True) if fused else None)
    answers: list[Any] = [] if fused else [lease(True)]
    answers += [reserved, _hold(facts, False, "until_reset"), 1, 1]
    if not fused:
        answers.append(True)
    calls, out = drive(facts, policy, answers)
    methods = [call.method for call in calls]
    assert methods == [*([] if fused else ["acquire"]), "reserve", "hold_budgets", "reconcile",
                       "reconcile", *([] if fused else ["release"])]
    refund_tokens, refund_requests = [c for c in calls if c.method == "reconcile"]
    assert refund_tokens.args == (reserved, 0)
    assert refund_tokens.kwargs == ({"release": True} if fused else {})
    assert refund_requests.args[1] == 0
    assert {w.resource for w in refund_requests.args[0].windows} == {"requests"}
    assert refund_requests.args[0].lease is None and refund_requests.args[0].tokens is None
    assert ("release" in methods) is (not fused)
    assert out.hold is None and out.remember is None
    [verdict] = out.verdicts
    assert isinstance(verdict, Refused) and verdict.resource == "spend" and verdict.spend is not None
    assert verdict.spend[0].reason == "until_reset"


def test_a_hold_redis_cannot_answer_gives_the_reservation_back_and_is_unavailable() -> None:
    facts = _spend_facts()
    error = RateLimiterError("down")
    calls, out = drive(facts, ENFORCE, [reservation(windows=STATES), error, error, error])
    assert [call.method for call in calls] == ["reserve", "hold_budgets", "reconcile", "reconcile"]
    [verdict] = out.verdicts
    assert isinstance(verdict, Unavailable) and verdict.error is error
