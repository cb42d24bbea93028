"""Members are fresh UUID4s: distinct across calls, threads and fork() (a child never
replays its parent's randomness, since the page of random bytes is wiped in a child).
Canonical and distinct members are proved for every limiter kind (tests/conftest.py); fork()
and threads sharing one limiter are the blocking limiter's."""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import redis

from genai_ratelimit import RateLimiter
from helpers_core import SORTED_SET_SHAPE, logged_entries


def _members(client: redis.Redis, key: str) -> list[str]:
    return [m.decode() for m in client.zrange(key, 0, -1)]


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_members_are_canonical_uuid4_and_distinct(limiter, redis_client: redis.Redis, user_id: str) -> None:
    for _ in range(600):  # more than one page of randomness (255 ids)
        assert limiter.check(user_id, 10_000, 60)[0]
    members = _members(redis_client, f"ratelimit:{user_id}:60")
    assert len(members) == 600
    for member in members:
        parsed = uuid.UUID(member)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
        assert str(parsed) == member


@pytest.mark.limiter_kinds("sync", reason="fork(): a child of a process using the blocking limiter")
def test_fork_child_never_repeats_the_parents_members(limiter: RateLimiter,
                                                      redis_client: redis.Redis,
                                                      user_id: str) -> None:
    assert limiter.check(user_id, 10_000, 60)[0]  # the parent's page of randomness is filled
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            for _ in range(50):
                if not limiter.check(user_id, 10_000, 60)[0]:
                    code = 1
        except BaseException:
            code = 2
        os._exit(code)
    for _ in range(50):
        assert limiter.check(user_id, 10_000, 60)[0]
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # Equal members would collapse into one sorted-set entry.
    assert logged_entries(redis_client, f"ratelimit:{user_id}:60") == 101


@pytest.mark.limiter_kinds("sync", reason="threads sharing one blocking limiter; the async "
                                           "limiter's calls from several loops are in "
                                           "test_async_lifecycle.py")
def test_threads_get_distinct_members(limiter: RateLimiter, redis_client: redis.Redis,
                                      user_id: str) -> None:
    def work() -> None:
        for _ in range(200):
            limiter.check(user_id, 100_000, 60)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert logged_entries(redis_client, f"ratelimit:{user_id}:60") == 1600
