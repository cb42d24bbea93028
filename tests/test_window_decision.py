"""check_windows_detailed answers a WindowDecision: check_windows' 4-tuple (unpacking,
indexing, equality, slicing) with names, plus the exact wait in ms and the decision's time, on
both limiters (the `limiter` fixture runs each test once per kind), the kill switch included.
check_windows itself keeps answering a plain tuple (the contract)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import redis

from genai_ratelimit import WindowDecision
from helpers_core import SORTED_SET_SHAPE

WINDOWS = [(2, 60), (100, 86_400)]


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_an_allowed_decision_is_the_contract_tuple_with_names(limiter: Any, user_id: str,
                                                               redis_client: redis.Redis) -> None:
    decision = limiter.check_windows_detailed(user_id, WINDOWS)
    assert type(decision) is WindowDecision and isinstance(decision, tuple)
    assert decision == (True, 1, 0, 60) and len(decision) == 4
    allowed, remaining, retry_after_s, window_seconds = decision
    assert (allowed, remaining, retry_after_s, window_seconds) == (
        decision.allowed, decision.remaining, decision.retry_after_s, decision.window_seconds)
    assert decision[:3] == (True, 1, 0) and type(decision[:3]) is tuple
    assert decision.retry_after_ms == 0
    # The time the script decided at is the score of the entry it logged.
    (_member, score), = redis_client.zrange(f"ratelimit:{user_id}:60", 0, -1, withscores=True)
    assert decision.timestamp_ms == int(score)


def test_a_refusal_carries_the_exact_wait_behind_the_rounded_one(
        limiter: Any, user_id: str, redis_client: redis.Redis) -> None:
    first = limiter.check_windows_detailed(user_id, WINDOWS)
    limiter.check_windows_detailed(user_id, WINDOWS)
    refused = limiter.check_windows_detailed(user_id, WINDOWS)
    assert refused[:2] == (False, 0) and refused.window_seconds == 60
    # The oldest entry leaves the minute window 60 s after it was logged.
    assert refused.retry_after_ms == first.timestamp_ms + 60_000 - refused.timestamp_ms
    assert 0 < refused.retry_after_ms <= 60_000
    assert refused.retry_after_s == max(1, -(-refused.retry_after_ms // 1000))


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_it_is_check_windows_answer_and_check_windows_stays_a_plain_tuple(
        limiter: Any, user_id: str, redis_client: redis.Redis) -> None:
    plain = limiter.check_windows(user_id, WINDOWS)
    detailed = limiter.check_windows_detailed(f"{user_id}-b", WINDOWS)
    assert type(plain) is tuple and plain == detailed == (True, 1, 0, 60)
    # The same command: one entry in each window of each user, nothing else.
    assert sorted(redis_client.keys("*")) == sorted(
        f"ratelimit:{u}:{w}".encode() for u in (user_id, f"{user_id}-b") for w in (60, 86_400))


def test_it_validates_like_check_windows(limiter: Any, user_id: str) -> None:
    with pytest.raises(ValueError, match="window_seconds 60 appears twice"):
        limiter.check_windows_detailed(user_id, [(1, 60), (2, 60)])
    with pytest.raises(TypeError, match="check_windows_detailed"):
        limiter.check_windows_detailed(user_id)


def test_the_kill_switch_answers_a_window_decision_too(
        limiter: Any, user_id: str, monkeypatch: pytest.MonkeyPatch,
        redis_client: redis.Redis) -> None:
    monkeypatch.setenv("RATE_LIMIT_DISABLED", "true")
    decision = limiter.check_windows_detailed(user_id, WINDOWS)
    assert type(decision) is WindowDecision
    assert decision == (True, 2, 0, 60) and decision.retry_after_ms == 0
    assert decision.timestamp_ms > 0
    assert redis_client.keys("*") == []


def test_a_decision_pickles_and_prints_as_its_tuple(limiter: Any, user_id: str) -> None:
    decision = limiter.check_windows_detailed(user_id, WINDOWS)
    again = pickle.loads(pickle.dumps(decision))
    assert again == decision and again.timestamp_ms == decision.timestamp_ms
    assert repr(decision) == ("genai_ratelimit._native.WindowDecision(allowed=True, remaining=1, "
                              "retry_after_s=0, window_seconds=60)")


def test_the_attributes_are_read_only(limiter: Any, user_id: str) -> None:
    decision = limiter.check_windows_detailed(user_id, WINDOWS)
    with pytest.raises(AttributeError):
        decision.retry_after_ms = 5
