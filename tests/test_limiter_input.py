"""Input rules: bad arguments raise TypeError or ValueError before any Redis I/O; odd but
valid user ids work and never share a key; bad URLs are refused with a message naming the
problem; a password never shows in repr() or in an error message.

Every test with a limiter runs once per limiter kind (tests/conftest.py), and builds its
limiters with `make_limiter`; `unreachable_limiter` (a limiter on a closed port) is
conftest's too."""

from __future__ import annotations

import logging
import re

import pytest
import redis

from genai_ratelimit import _native
from genai_ratelimit._url import parse_redis_url
from helpers_async import LimiterFactory
from helpers_core import (
    SORTED_SET_SHAPE,
    PasswordRedisServer,
    closed_port_url,
    logged_entries,
    measured_commands,
    unencoded_password_urls,
    userinfo_shown,
)
from redis_server import free_port

BAD_USER_IDS = [
    pytest.param("", ValueError, id="empty"),
    pytest.param(None, TypeError, id="None"),
    pytest.param(123, TypeError, id="int"),
    pytest.param(b"bytes", TypeError, id="bytes"),
    pytest.param(["user"], TypeError, id="list"),
    pytest.param("\ud800", ValueError, id="lone-surrogate"),  # not encodable as UTF-8
]

BAD_COUNTS = [  # for limit and for window_seconds
    pytest.param(0, (ValueError,), id="zero"),
    pytest.param(-1, (ValueError,), id="negative"),
    pytest.param(1.5, (TypeError,), id="float"),
    pytest.param(10.0, (TypeError,), id="whole-float"),
    pytest.param(True, (TypeError, ValueError), id="True"),
    pytest.param(False, (TypeError, ValueError), id="False"),
    pytest.param("10", (TypeError,), id="str"),
    pytest.param(None, (TypeError,), id="None"),
    pytest.param(10**30, (ValueError,), id="too-big-to-be-exact"),
]


# ------------------------------------------------------------------ bad arguments

@pytest.mark.parametrize("user_id, error", BAD_USER_IDS)
def test_bad_user_id_is_refused_before_any_redis_io(unreachable_limiter, user_id, error):
    with pytest.raises(error):
        unreachable_limiter.check(user_id, 10, 60)


@pytest.mark.parametrize("limit, errors", BAD_COUNTS)
def test_bad_limit_is_refused_before_any_redis_io(unreachable_limiter, limit, errors):
    with pytest.raises(errors):
        unreachable_limiter.check("user-1", limit, 60)


@pytest.mark.parametrize("window_seconds, errors", BAD_COUNTS)
def test_bad_window_is_refused_before_any_redis_io(unreachable_limiter, window_seconds, errors):
    with pytest.raises(errors):
        unreachable_limiter.check("user-1", 10, window_seconds)


def test_bad_arguments_send_no_command_to_a_live_server(limiter, redis_client):
    limiter.check("warm-up", 10, 60)
    with measured_commands(redis_client) as delta:
        for args in [("", 10, 60), (None, 10, 60), ("u", 0, 60), ("u", 10, -1), ("u", True, 60),
                     ("u", 10, 1.5), ("u", "10", 60)]:
            with pytest.raises((TypeError, ValueError)):
                limiter.check(*args)
        for windows in [[], [(0, 60)], [(10,)], "nope"]:
            with pytest.raises((TypeError, ValueError)):
                limiter.check_windows("u", windows)
    assert delta == {}
    assert redis_client.keys("ratelimit:u:*") == []


def test_check_accepts_keyword_arguments(limiter, user_id):
    assert limiter.check(user_id, limit=10, window_seconds=60) == (True, 9, 0)
    assert limiter.check(user_id=user_id, limit=10, window_seconds=60) == (True, 8, 0)
    assert limiter.check_windows(user_id=user_id, windows=[(10, 60)]) == (True, 7, 0, 60)


@pytest.mark.parametrize("call", [
    pytest.param(lambda rl: rl.check("u", 10), id="missing-window"),
    pytest.param(lambda rl: rl.check("u", 10, 60, 1), id="extra-positional"),
    pytest.param(lambda rl: rl.check("u", limit=10, window=60), id="unknown-keyword"),
    pytest.param(lambda rl: rl.check("u", 10, 60, limit=10), id="given-twice"),
    pytest.param(lambda rl: rl.check_windows("u"), id="windows-missing"),
])
def test_wrong_call_signature_raises_type_error(unreachable_limiter, call):
    with pytest.raises(TypeError):
        call(unreachable_limiter)


def test_repeated_window_length_is_refused(unreachable_limiter):
    # Two budgets for one window length would share one key and count every request twice.
    with pytest.raises(ValueError):
        unreachable_limiter.check_windows("user-1", [(5, 60), (10, 60)])


def test_largest_exact_limit_is_accepted(limiter, user_id):
    biggest = 2**53 - 1
    assert limiter.check(user_id, biggest, 60) == (True, biggest - 1, 0)


@pytest.mark.parametrize("windows, error", [
    pytest.param([], ValueError, id="empty"),
    pytest.param(None, TypeError, id="None"),
    pytest.param([(10,)], (TypeError, ValueError), id="one-element"),
    pytest.param([(10, 60, 1)], (TypeError, ValueError), id="three-elements"),
    pytest.param([10, 60], TypeError, id="flat-numbers"),
    pytest.param(["10", "60"], (TypeError, ValueError), id="strings"),
    pytest.param([("10", 60)], TypeError, id="str-limit"),
    pytest.param([(10, 1.5)], TypeError, id="float-window"),
    pytest.param([(0, 60)], ValueError, id="zero-limit"),
    pytest.param([(10, -60)], ValueError, id="negative-window"),
    pytest.param([(True, 60)], (TypeError, ValueError), id="bool-limit"),
    pytest.param([(5, 60), (None, 86400)], TypeError, id="second-pair-bad"),
], )
def test_bad_windows_are_refused_before_any_redis_io(unreachable_limiter, windows, error):
    with pytest.raises(error):
        unreachable_limiter.check_windows("user-1", windows)


def test_check_windows_bad_user_id_is_refused_before_any_redis_io(unreachable_limiter):
    with pytest.raises(ValueError):
        unreachable_limiter.check_windows("", [(5, 60)])
    with pytest.raises(TypeError):
        unreachable_limiter.check_windows(None, [(5, 60)])


def test_check_windows_accepts_a_tuple_of_pairs(limiter, user_id):
    assert limiter.check_windows(user_id, ((5, 60), (100, 86400))) == (True, 4, 0, 60)


# ---------------------------------------------------------------- odd, valid ids

ODD_IDS = [":", "::", "a:b", "a:60", "{x}", "{user}:1", " ", "  padded  ", "ü日本", "emoji-🚦",
           "\x00", "a\x00b", "line\r\nbreak", "*", "?", "[a]", "\\", '"quoted"', "x" * 1000]


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
@pytest.mark.parametrize("user_id", ODD_IDS, ids=lambda u: repr(u)[:30])
def test_odd_but_valid_user_id_gets_its_own_exact_key(limiter, redis_client, user_id):
    assert limiter.check(user_id, 2, 60) == (True, 1, 0)
    assert limiter.check(user_id, 2, 60) == (True, 0, 0)
    assert limiter.check(user_id, 2, 60)[:2] == (False, 0)
    key = b"ratelimit:" + user_id.encode("utf-8") + b":60"
    assert redis_client.keys("*") == [key]
    assert logged_entries(redis_client, key) == 2


def test_odd_user_ids_never_share_a_key(limiter, redis_client):
    ids = ODD_IDS + ["a", "a:60:60", "a\x00", "a ", "A", "x" * 999]
    windows = (60, 61, 3600)
    for user in ids:
        for window in windows:
            # limit 1: a second request on a shared key would be rejected
            assert limiter.check(user, 1, window) == (True, 0, 0), (user, window)
    assert redis_client.dbsize() == len(ids) * len(windows)


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_user_whose_id_ends_like_a_window_does_not_share_the_key_of_another_window(limiter, redis_client):
    # "a:60" in a 60 s window is ratelimit:a:60:60; "a" in a 60 s window is ratelimit:a:60.
    assert limiter.check("a:60", 1, 60) == (True, 0, 0)
    assert limiter.check("a", 1, 60) == (True, 0, 0)
    assert sorted(redis_client.keys("*")) == [b"ratelimit:a:60", b"ratelimit:a:60:60"]


# ---------------------------------------------------------------------- URLs

@pytest.mark.parametrize("url, named", [
    pytest.param("", "empty", id="empty"),
    pytest.param("   ", "empty", id="blank"),
    pytest.param("http://x", "scheme", id="http"),
    pytest.param("redis-x://h", "scheme", id="unknown-scheme"),
    pytest.param("localhost:6379", "scheme", id="no-scheme"),
    pytest.param("redis://h:99999", "port", id="port-too-big"),
    pytest.param("redis://h:0", "port", id="port-zero"),
    pytest.param("redis://h:abc", "port", id="port-not-a-number"),
    pytest.param("redis://", "host", id="no-host"),
    pytest.param("redis://h/notadb", "database", id="db-not-a-number"),
    pytest.param("rediss://h?ssl_cert_reqs=bogus", "ssl_cert_reqs", id="ssl-cert-reqs"),
    pytest.param("redis://h?ssl_cert_reqs=none", "rediss", id="ssl-without-tls"),
    pytest.param("redis://h?colour=blue", "colour", id="unknown-parameter"),
    pytest.param("unix://", "path", id="unix-without-path"),
])
def test_bad_url_raises_value_error_naming_the_problem(make_limiter, url, named):
    with pytest.raises(ValueError, match=f"(?i){named}"):
        make_limiter(url)


def test_non_string_url_raises_type_error(make_limiter):
    with pytest.raises(TypeError):
        make_limiter(b"redis://localhost")


@pytest.mark.parametrize("kwargs, error", [
    pytest.param({"clock": "local"}, ValueError, id="clock"),
    pytest.param({"key_prefix": ""}, ValueError, id="empty-prefix"),
    pytest.param({"key_prefix": None}, TypeError, id="None-prefix"),
    pytest.param({"connect_timeout": 0}, ValueError, id="zero-connect-timeout"),
    pytest.param({"socket_timeout": -1}, ValueError, id="negative-socket-timeout"),
    pytest.param({"socket_timeout": float("nan")}, ValueError, id="nan-socket-timeout"),
    pytest.param({"socket_timeout": "1"}, TypeError, id="str-socket-timeout"),
    pytest.param({"max_connections": 0}, ValueError, id="zero-connections"),
    pytest.param({"max_connections": 2.0}, TypeError, id="float-connections"),
    pytest.param({"max_connections": 4097}, ValueError, id="too-many-connections"),
    pytest.param({"min_replicas": 86_400_001}, ValueError, id="too-many-replicas"),
    pytest.param({"replica_timeout_ms": 86_400_001}, ValueError, id="too-long-replica-timeout"),
    pytest.param({"min_replicas": 1.0}, TypeError, id="float-replicas"),
    pytest.param({"storage": "lists"}, ValueError, id="storage"),
])
def test_bad_constructor_option_is_refused(make_limiter, redis_url, kwargs, error):
    with pytest.raises(error):
        make_limiter(redis_url, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    pytest.param({"max_connections": 4097}, "max_connections must be between 1 and 4096, got 4097",
                 id="connections"),
    pytest.param({"min_replicas": 86_400_001},
                 "min_replicas must be between 0 and 86400000, got 86400001", id="replicas"),
    pytest.param({"replica_timeout_ms": 0}, "replica_timeout_ms must be between 1 and 86400000, "
                 "got 0", id="replica-timeout"),
    pytest.param({"socket_timeout": 0.0}, "socket_timeout must be a positive number of seconds",
                 id="timeout"),
])
def test_the_c_limiter_refuses_what_the_constructors_refuse(kwargs, message):
    """One copy of the options' rules (py_request.c): the extension's own type, made without the
    Python constructor, refuses the same values with the same message."""
    options = {"host": "127.0.0.1", "port": 1, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        _native.Limiter(**options)


@pytest.mark.storages("zset", reason=SORTED_SET_SHAPE)
def test_url_defaults_to_the_redis_url_environment_variable(make_limiter, monkeypatch, private_redis):
    monkeypatch.setenv("REDIS_URL", private_redis.url)
    with make_limiter(connect_timeout=0.5, socket_timeout=0.5) as limiter:
        assert limiter.check("env-user", 10, 60) == (True, 9, 0)
    client = redis.Redis(port=private_redis.port)
    try:
        assert client.keys("*") == [b"ratelimit:env-user:60"]
    finally:
        client.close()


def test_url_defaults_to_localhost_6379_db_0(make_limiter, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    with make_limiter() as limiter:  # connecting is lazy: nothing is dialled here
        assert limiter.url == "redis://localhost:6379/0"


# ------------------------------------------------------------------ secrecy

SECRET = "sekret-Pa55word"


@pytest.mark.parametrize("url", [
    f"redis://:{SECRET}@127.0.0.1:6379/0",
    f"redis://alice:{SECRET}@127.0.0.1:6379/2",
    f"rediss://:{SECRET}@127.0.0.1:6380/0?ssl_cert_reqs=none",
    f"unix:///tmp/redis.sock?db=1&password={SECRET}",
])
def test_password_is_not_in_repr_or_url(make_limiter, url):
    with make_limiter(url) as limiter:
        assert SECRET not in repr(limiter)
        assert SECRET not in str(limiter)
        assert SECRET not in limiter.url


@pytest.mark.parametrize("url", [
    f"redis://:{SECRET}@h:99999",
    f"rediss://:{SECRET}@h?ssl_cert_reqs=bogus",
    f"http://:{SECRET}@h",
    f"redis://:{SECRET}@h/notadb",
])
def test_password_is_not_in_url_error_messages(make_limiter, url):
    with pytest.raises(ValueError) as info:
        make_limiter(url)
    assert SECRET not in str(info.value) and SECRET not in repr(info.value)


def test_password_is_not_in_authentication_errors_or_logs(make_limiter, caplog):
    from genai_ratelimit import RateLimiterError

    caplog.set_level(logging.DEBUG)
    with PasswordRedisServer("the-right-one") as server:
        for url in (f"redis://:{SECRET}@127.0.0.1:{server.port}/0",
                    f"redis://alice:{SECRET}@127.0.0.1:{server.port}/0"):
            with make_limiter(url, connect_timeout=0.5, socket_timeout=0.5) as limiter:
                with pytest.raises(RateLimiterError) as info:
                    limiter.check("user-1", 10, 60)
            chain = []
            error: BaseException | None = info.value
            while error is not None:
                chain.append(f"{error!s} {error!r}")
                error = error.__cause__ or error.__context__
            assert SECRET not in " ".join(chain)
            assert "auth" in str(info.value).lower()
    assert SECRET not in caplog.text


def test_password_is_not_in_unavailable_errors(make_limiter):
    from genai_ratelimit import RateLimiterUnavailable

    url = closed_port_url().replace("redis://", f"redis://:{SECRET}@")
    with make_limiter(url, connect_timeout=0.5, socket_timeout=0.5) as limiter:
        with pytest.raises(RateLimiterUnavailable) as info:
            limiter.check("user-1", 10, 60)
    assert SECRET not in str(info.value) and SECRET not in repr(info.value)


# A password holding an unencoded '/', '?', '#', '&' or '@': whatever the parser makes of the
# URL, no message shows any part of the user name or password, and a refusal says how to
# write it. Every URL form, every limiter kind: built, then one check on a closed port.
URL_PORT = free_port()


@pytest.mark.parametrize("url", [pytest.param(url, id=name)
                                 for name, url in unencoded_password_urls(URL_PORT)])
def test_no_part_of_an_unencoded_password_is_in_any_error(make_limiter, url):
    from genai_ratelimit import RateLimiterError

    try:
        limiter = make_limiter(url, connect_timeout=0.5, socket_timeout=0.5)
        with pytest.raises(RateLimiterError) as info:
            limiter.check("user-1", 10, 60)
        error: BaseException = info.value
        shown = f"{error!s} {error!r} {limiter!r} {limiter.url}"
    except ValueError as refused:
        shown = f"{refused!s} {refused!r}"
        assert not userinfo_shown(shown), f"{userinfo_shown(shown)} shown in: {shown}"
        assert "percent-encoded" in str(refused), str(refused)
    else:
        assert not userinfo_shown(shown), f"{userinfo_shown(shown)} shown in: {shown}"


@pytest.mark.parametrize("url", [pytest.param(url, id=name)
                                 for name, url in unencoded_password_urls(URL_PORT)])
def test_parse_redis_url_never_shows_an_unencoded_password(url):
    try:
        options = parse_redis_url(url)
    except ValueError as error:
        assert not userinfo_shown(f"{error!s} {error!r}"), str(error)
        assert "percent-encoded" in str(error), str(error)
    else:  # an '@' in the password, the rest well formed: read whole, shown nowhere
        assert options.password is not None and "@" in options.password
        shown = f"{options!r} {options.describe()}"
        assert not userinfo_shown(shown), shown


@pytest.mark.parametrize("url, password", [
    pytest.param("redis://:Pa55%2Fw0rd@h:1/0", "Pa55/w0rd", id="slash"),
    pytest.param("redis://uZer7:Secret9%40x9q@h:1/0", "Secret9@x9q", id="at"),
    pytest.param("redis://uZer7:Pa55%3Fw0rd%23x9q@h:1/0", "Pa55?w0rd#x9q", id="question-hash"),
    pytest.param("redis+sentinel://:Pa55%2Fw0rd@h:1/mymaster", "Pa55/w0rd", id="sentinel"),
    pytest.param("unix://:Pa55%2Fw0rd@/run/redis.sock", "Pa55/w0rd", id="unix"),
    pytest.param("unix:///run/redis.sock?password=Pa55%26w0rd", "Pa55&w0rd", id="unix-query"),
])
def test_a_percent_encoded_password_is_read_whole(url, password):
    assert parse_redis_url(url).password == password


# ------------------------------------------------------------------ timeouts over one day
# connect_timeout and socket_timeout above one day (86400 s) are refused, by the Python
# limiters and by the C types, instead of overflowing a cast to milliseconds.

REFUSED_BEFORE_STORAGE = "refused when the limiter is built, before any storage is reached"
TIMEOUT_NAMES = ["connect_timeout", "socket_timeout"]
OVER_ONE_DAY = [1e12, 1e300, 86400.5]


@pytest.mark.parametrize("value", OVER_ONE_DAY)
@pytest.mark.parametrize("name", TIMEOUT_NAMES)
@pytest.mark.storages("zset", reason=REFUSED_BEFORE_STORAGE)
def test_timeout_over_one_day_is_refused_naming_the_parameter_and_the_bound(
        make_limiter: LimiterFactory, name: str, value: float) -> None:
    with pytest.raises(ValueError) as info:
        make_limiter.native("redis://127.0.0.1:6379/0", **{name: value})
    assert name in str(info.value) and "86400" in str(info.value), str(info.value)


@pytest.mark.parametrize("name", TIMEOUT_NAMES)
@pytest.mark.storages("zset", reason=REFUSED_BEFORE_STORAGE)
def test_timeout_of_exactly_one_day_is_accepted(make_limiter: LimiterFactory, name: str) -> None:
    make_limiter.native("redis://127.0.0.1:6379/0", **{name: 86400})  # nothing is sent


@pytest.mark.parametrize("value", OVER_ONE_DAY)
@pytest.mark.parametrize("name", TIMEOUT_NAMES)
def test_native_limiter_refuses_a_timeout_over_one_day(name: str, value: float) -> None:
    from genai_ratelimit import _native

    with pytest.raises(ValueError):
        _native.Limiter(host="127.0.0.1", **{name: value})


@pytest.mark.parametrize("value", OVER_ONE_DAY)
def test_native_pipeline_refuses_a_timeout_over_one_day(value: float) -> None:
    from genai_ratelimit import _native

    with pytest.raises(ValueError):
        _native.Pipeline(value)


def test_native_types_accept_a_timeout_of_exactly_one_day() -> None:
    from genai_ratelimit import _native

    limiter = _native.Limiter(host="127.0.0.1", connect_timeout=86400, socket_timeout=86400)
    limiter.close()
    _native.Pipeline(86400)
