"""Hostile input, for every limiter kind (tests/conftest.py) alike: user ids of 1 MiB,
embedded NULs, lone surrogates, str subclasses with an odd __str__, objects that merely look
like strings; limits around 2^31, 2^53 and 2^63; windows of a year, a century, and beyond. Each gives a
correct answer on its own exact key or a clear TypeError/ValueError before any Redis I/O,
never a crash and never a key shared with another user.

"Before any Redis I/O" is proved with a fake server that would never answer (it counts the
connections it accepts): a refused input must not even open a connection.

The key is built from the str's own value (the UTF-8 of what the str object holds), never
from __str__, __repr__ or encode(): a str subclass cannot steer a request onto another
user's key by overriding them. Objects that are not str are refused, whatever __str__ says.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from fake_redis import FakeRedis, Silence
from helpers_core import SORTED_SET_SHAPE, logged_entries

MAX_LIMIT = 2**53 - 1
YEAR = 365 * 24 * 3600
CENTURY = 100 * YEAR


@pytest.fixture
def driver(make_limiter, redis_url: str, redis_client: redis.Redis):
    """A limiter of the kind under test on the session's Redis (clean database), with
    timeouts long enough for ids of a mebibyte."""
    return make_limiter(redis_url, connect_timeout=5.0, socket_timeout=5.0)


@pytest.fixture
def no_io(make_limiter) -> Iterator:
    """A limiter of the kind under test on a fake server that never answers; after the test,
    the fake must not have accepted a single connection."""
    fake = FakeRedis(Silence())
    limiter = make_limiter(fake.url, connect_timeout=0.5, socket_timeout=0.5)
    try:
        yield limiter
        assert fake.accepted == 0, "the refused input reached the network"
    finally:
        limiter.close()
        fake.close()


def key_of(user_id: str, window_seconds: int = 60) -> bytes:
    return b"ratelimit:" + user_id.encode("utf-8") + b":%d" % window_seconds


# ------------------------------------------------------------------------ user ids

@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_user_ids_of_one_mebibyte_work_on_keys_of_their_own(driver, redis_client):
    """Two 1 MiB ids that differ only in their last character: each is allowed once with a
    limit of 1 (a shared key would refuse the second) and each has its exact key."""
    first = "u" * (2**20 - 1) + "a"
    second = "u" * (2**20 - 1) + "b"
    assert driver.check(first, 1, 60) == (True, 0, 0)
    assert driver.check(second, 1, 60) == (True, 0, 0)
    assert driver.check(first, 1, 60)[:2] == (False, 0)
    assert redis_client.exists(key_of(first)) == 1 and redis_client.exists(key_of(second)) == 1
    assert redis_client.dbsize() == 2


NUL_IDS = ["\x00", "\x00\x00", "a", "a\x00", "\x00a", "a\x00b", "a\x00c", "a\x00\x00b"]


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_user_ids_with_embedded_nuls_are_never_cut_at_the_nul(driver, redis_client):
    """A C string would stop at the first NUL and merge these ids; each keeps its own key."""
    for user in NUL_IDS:
        assert driver.check(user, 1, 60) == (True, 0, 0), repr(user)
    assert sorted(redis_client.keys("*")) == sorted(key_of(u) for u in NUL_IDS)


SURROGATES = [
    pytest.param("\ud800", id="lone-high"),
    pytest.param("\udfff", id="lone-low"),
    pytest.param("ok\ud800ok", id="inside"),
    pytest.param("\ud83d\ude00", id="pair-as-two-code-points"),
    pytest.param("x" * 100_000 + "\udc80", id="at-the-end-of-a-long-id"),
]


@pytest.mark.parametrize("user", SURROGATES)
def test_user_id_with_surrogates_raises_a_unicode_error_before_any_io(no_io, user):
    """A str with surrogates has no UTF-8 form; a lossy one ('?', U+FFFD, surrogateescape)
    could give two users one key. It is refused: UnicodeEncodeError, a ValueError."""
    with pytest.raises(UnicodeEncodeError, match="surrogate"):
        no_io.check(user, 10, 60)


class Impostor(str):
    """A str whose every text-producing method claims to be somebody else."""

    def __str__(self) -> str:
        return "victim"

    def __repr__(self) -> str:
        return "'victim'"

    def __format__(self, spec: str) -> str:
        return "victim"

    def encode(self, *args: object, **kwargs: object) -> bytes:  # type: ignore[override]
        return b"victim"


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_str_subclass_is_keyed_by_its_value_not_by_its_str(driver, redis_client):
    assert driver.check(Impostor("attacker"), 1, 60) == (True, 0, 0)
    assert redis_client.keys("*") == [key_of("attacker")]
    assert driver.check("victim", 1, 60) == (True, 0, 0)  # the victim's budget is untouched


class LooksLikeAUser:
    def __str__(self) -> str:
        return "alice"


class IntWithStr(int):
    def __str__(self) -> str:
        return "alice"


@pytest.mark.parametrize("user", [LooksLikeAUser(), IntWithStr(7), b"alice", bytearray(b"alice"),
                                  memoryview(b"alice")],
                         ids=["object-with-str", "int-with-str", "bytes", "bytearray", "memoryview"])
def test_non_str_user_id_is_refused_with_type_error_before_any_io(no_io, user):
    with pytest.raises(TypeError, match="user_id must be a str"):
        no_io.check(user, 10, 60)


# --------------------------------------------------------------------------- limits

def test_max_limit_is_two_to_the_53_minus_one():
    from genai_ratelimit import _native

    assert _native.MAX_LIMIT == MAX_LIMIT


def test_max_limit_is_public():
    import genai_ratelimit

    assert genai_ratelimit.MAX_LIMIT == MAX_LIMIT and "MAX_LIMIT" in genai_ratelimit.__all__


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_max_limit_is_the_largest_limit_cost_and_token_count_accepted(driver, redis_client, user_id):
    from genai_ratelimit import MAX_LIMIT as PUBLIC_MAX_LIMIT

    assert driver.check(user_id, PUBLIC_MAX_LIMIT, 60, cost=PUBLIC_MAX_LIMIT) == (True, 0, 0)
    r = driver.reserve(f"{user_id}-t", [(1, 60)], token_windows=[(PUBLIC_MAX_LIMIT, 60)],
                       tokens=PUBLIC_MAX_LIMIT)
    assert r.allowed and r.remaining_tokens == 0
    assert driver.reconcile(r, PUBLIC_MAX_LIMIT) == 1


@pytest.mark.parametrize("call", ["cost", "tokens", "actual"])
def test_a_cost_or_token_count_past_max_limit_is_refused_before_any_io(no_io, call):
    from genai_ratelimit import MAX_LIMIT as PUBLIC_MAX_LIMIT

    with pytest.raises(ValueError, match=r"at most 9007199254740991"):
        if call == "cost":
            no_io.check("user-1", 10, 60, cost=PUBLIC_MAX_LIMIT + 1)
        elif call == "tokens":
            no_io.reserve("user-1", [(10, 60)], token_windows=[(10, 60)], tokens=PUBLIC_MAX_LIMIT + 1)
        else:
            from genai_ratelimit import Reservation, WindowState
            reservation = Reservation(True, 9, 0, 60, "requests", 0, "user-1", 1, None,
                                      (WindowState(10, 60, "requests", 9),),
                                      "00000000-0000-4000-8000-000000000000", 1)
            no_io.reconcile(reservation, PUBLIC_MAX_LIMIT + 1)


@pytest.mark.parametrize("limit", [2**31 - 1, 2**31, 2**32, MAX_LIMIT - 1, MAX_LIMIT],
                         ids=["2^31-1", "2^31", "2^32", "2^53-2", "2^53-1"])
@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_large_limits_count_exactly(driver, redis_client, user_id, limit):
    """Up to 2^53-1 every count is exact (Lua numbers are doubles): the second request
    leaves exactly limit - 2."""
    assert driver.check(user_id, limit, 60) == (True, limit - 1, 0)
    assert driver.check(user_id, limit, 60) == (True, limit - 2, 0)
    assert logged_entries(redis_client, key_of(user_id)) == 2


@pytest.mark.parametrize("limit", [2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 10**100],
                         ids=["2^53", "2^53+1", "2^63-1", "2^63", "2^64", "2^64+1", "googol"])
def test_limits_beyond_two_to_the_53_raise_value_error_before_any_io(no_io, limit):
    with pytest.raises(ValueError, match=r"limit must be at most 9007199254740991"):
        no_io.check("user-1", limit, 60)


@pytest.mark.parametrize("limit", [-(2**31), -(2**53), -(2**63), -(2**63) - 1, -(2**64)],
                         ids=["-2^31", "-2^53", "-2^63", "-2^63-1", "-2^64"])
def test_huge_negative_limits_raise_value_error_before_any_io(no_io, limit):
    with pytest.raises(ValueError, match=r"limit must be >= 1"):
        no_io.check("user-1", limit, 60)


# -------------------------------------------------------------------------- windows

def test_max_window_is_a_hundred_years():
    from genai_ratelimit import _native

    assert _native.MAX_WINDOW_SECONDS == CENTURY


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
@pytest.mark.parametrize("window_seconds", [YEAR, CENTURY], ids=["1-year", "100-years"])
def test_long_window_counts_and_sets_the_ttl_to_the_window_plus_one_second(
        driver, redis_client, user_id, window_seconds):
    key = key_of(user_id, window_seconds)
    assert driver.check(user_id, 2, window_seconds) == (True, 1, 0)
    asked = time.monotonic()
    assert driver.check(user_id, 2, window_seconds) == (True, 0, 0)
    pttl = redis_client.pttl(key)
    elapsed_ms = (time.monotonic() - asked) * 1000
    assert (window_seconds + 1) * 1000 - elapsed_ms - 5 <= pttl <= (window_seconds + 1) * 1000


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
@pytest.mark.parametrize("window_seconds", [YEAR, CENTURY], ids=["1-year", "100-years"])
def test_long_window_rejection_promises_a_retry_of_the_whole_window(
        driver, user_id, window_seconds):
    assert driver.check(user_id, 1, window_seconds) == (True, 0, 0)
    allowed, remaining, retry_after_s = driver.check(user_id, 1, window_seconds)
    assert (allowed, remaining) == (False, 0)
    assert window_seconds - 2 <= retry_after_s <= window_seconds


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_check_windows_gives_each_long_window_its_own_ttl(driver, redis_client, user_id):
    windows = [(5, 60), (1_000, YEAR), (10_000, CENTURY)]
    assert driver.check_windows(user_id, windows) == (True, 4, 0, 60)
    for _, seconds in windows:
        ttl = redis_client.ttl(key_of(user_id, seconds))
        assert seconds <= ttl <= seconds + 1, (seconds, ttl)


@pytest.mark.parametrize("window_seconds", [CENTURY + 1, 2**53, 2**63, 2**64],
                         ids=["100-years-and-a-second", "2^53", "2^63", "2^64"])
def test_windows_beyond_a_hundred_years_raise_value_error_before_any_io(no_io, window_seconds):
    with pytest.raises(ValueError, match=rf"window_seconds must be at most {CENTURY}"):
        no_io.check("user-1", 10, window_seconds)
