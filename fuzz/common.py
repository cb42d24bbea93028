"""Shared by the fuzz targets: imports the installed extension (never the source tree),
futures that stand in for asyncio's, and outcome classification that gives atheris's
Python coverage something to steer by (the C code itself is built with gcc, which cannot
emit libFuzzer's coverage; AddressSanitizer and UBSan watch it instead)."""

from __future__ import annotations

import os
import sys

os.environ.pop("RATE_LIMIT_DISABLED", None)
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# `python fuzz/x.py` puts fuzz/ first on sys.path; make sure the repository root is not.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != REPO]

import atheris  # noqa: E402

with atheris.instrument_imports():
    import genai_ratelimit  # noqa: E402,F401
from genai_ratelimit import _native  # noqa: E402
from genai_ratelimit._native import RateLimiterError  # noqa: E402

if os.path.dirname(os.path.dirname(_native.__file__)) == REPO:
    raise SystemExit(f"fuzzing the source tree's {_native.__file__}, not the installed build")

SCRIPT_LOAD_PREFIX = b"*3\r\n$6\r\nSCRIPT\r\n$4\r\nLOAD\r\n"

# Bugs reported and not fixed yet. While listed, the target steps over them (so that it
# keeps looking for others) instead of stopping at the first input that shows them; the
# seed fuzz/corpus/pipeline/non-utf8-error-reply reproduces the first. Delete the entry once
# the C code is fixed: the target then fails if the bug comes back.
#   non-utf8-message: an error reply (or hiredis's protocol error text) that is not valid
#   UTF-8 after "%.240s" truncation makes rl_exception() fail with UnicodeDecodeError:
#   feed() raises that instead of RateLimiterUnavailable, and the popped future is never
#   resolved (its coroutine would wait forever); the blocking check() raises it too.
#   command-reply-type: a push_command reply that is an array holding an error reply makes
#   reply_to_python() fail: feed() raises ValueError("unexpected reply type 6") and the
#   command's future is dropped unresolved (the AUTH/SELECT handshake waits for
#   connect_timeout). Same root as the first: handle_reply() pops the entry, and when the
#   value for resolve() cannot be built the future is never resolved.
#   feed-after-error: once hiredis's reader has reported a protocol error it refuses every
#   later redisReaderFeed(), and Pipeline.feed() maps that refusal to MemoryError (it
#   should raise RateLimiterUnavailable with the reader's error). aio.py aborts the
#   connection after the first error, so only direct users of Pipeline see it.
KNOWN_BUGS: set[str] = set()  # all three fixed; the fuzzer enforces them again
# What feed() may raise while a bug above is listed, besides RateLimiterError.
TOLERATED = ((UnicodeDecodeError,) if "non-utf8-message" in KNOWN_BUGS else ()) + (
    (ValueError,) if "command-reply-type" in KNOWN_BUGS else ()) + (
    (MemoryError,) if "feed-after-error" in KNOWN_BUGS else ())


# ------------------------------------------------------------------ the integer model
#
# A reply's integers: what the scripts can answer (the bounds of csrc/native.h, read from
# the module) and everything a server could send instead. RESP integers cover the whole of
# int64 and beyond: hiredis refuses a text that is not a signed 64-bit decimal ("Bad integer
# value": more than 19 digits, overflowing, leading zeros, '+', empty), so only values in
# int64 ever reach the decoder, which holds each to its bounds before any arithmetic.
LLONG_MIN, LLONG_MAX = -(2**63), 2**63 - 1
MAX_LIMIT = _native.MAX_LIMIT
MAX_UNIX_MS = _native.MAX_UNIX_MS
SKEW_MS = _native.MAX_CLOCK_SKEW_MS
LONGEST_LEASE_WAIT_MS = _native.MAX_WINDOW_SECONDS * 1000 + SKEW_MS
NOW_MS = 1_767_225_600_000  # 2026-01-01, the time of a plausible reply
# Values at and around every bound the decoder holds integers to, and the edges of the
# types they pass through (Lua's doubles, int32, int64, uint64).
EDGES = (0, 1, 999, 1000, 60_000, 3_600_000, SKEW_MS, 60_000 + SKEW_MS, 3_600_000 + SKEW_MS,
         86_400_000 + SKEW_MS, LONGEST_LEASE_WAIT_MS, MAX_LIMIT, MAX_UNIX_MS, NOW_MS, 2**31,
         2**32, 2**53, 2**62, LLONG_MAX // 1000, LLONG_MAX, 2**64 - 1)
MALFORMED_INTEGERS = (b"", b"-", b"+5", b"007", b"-0", b"00", b" 5", b"5 ", b"1e3", b"0x10",
                      b"1.5", b"\xd9\xa1", b"9" * 19, b"9" * 20, b"-" + b"9" * 20,
                      b"18446744073709551616", b"-9223372036854775809", b"9223372036854775808")


@atheris.instrument_func
def integer_text(fdp: atheris.FuzzedDataProvider, typical: tuple[int, ...] = ()) -> bytes:
    """The text of a RESP integer (":<text>\r\n" is the caller's): half the time one of
    `typical` (values a well-formed reply holds, so that mutations stay near valid
    replies), else anything: an edge +-2, a small number, any int64, a number beyond int64
    (20 to 40 digits, either sign), a plausible time, or a text that is no integer."""
    if typical and fdp.ConsumeBool():
        return b"%d" % fdp.PickValueInList(list(typical))
    kind = fdp.ConsumeIntInRange(0, 6)
    if kind == 0:
        sign = -1 if fdp.ConsumeBool() else 1
        return b"%d" % (sign * fdp.PickValueInList(list(EDGES)) + fdp.ConsumeIntInRange(-2, 2))
    if kind == 1:
        return b"%d" % fdp.ConsumeIntInRange(-3, 3)
    if kind == 2:
        return b"%d" % fdp.ConsumeIntInRange(LLONG_MIN, LLONG_MAX)
    if kind == 3:
        value = fdp.ConsumeIntInRange(2**63, 10**40 - 1)
        return b"%d" % (-value if fdp.ConsumeBool() else value)
    if kind == 4:
        return b"%d" % (NOW_MS + fdp.ConsumeIntInRange(-10**7, 10**7))
    if kind == 5:
        return fdp.PickValueInList(list(MALFORMED_INTEGERS))
    return b"%d" % fdp.ConsumeInt(9)  # +-2**71


def ceil_seconds(ms: int) -> int:
    return -(-ms // 1000)


class HostileError(Exception):
    """Raised by a hostile future's set_result/set_exception: must propagate out of feed()."""


class Future:
    """What Pipeline needs of a future: done(), set_result(), set_exception().
    flavour: "plain"; "done" (already cancelled: the reply must be read and dropped);
    "hostile" (set_* raises); "reentrant" (set_* calls back into the pipeline)."""

    __slots__ = ("flavour", "state", "value", "pipeline", "calls")

    def __init__(self, flavour: str = "plain", pipeline=None) -> None:
        self.flavour = flavour
        self.state = "cancelled" if flavour == "done" else "pending"
        self.value = None
        self.pipeline = pipeline
        self.calls = 0

    def done(self) -> bool:
        return self.state != "pending"

    def _set(self, state: str, value) -> None:
        self.calls += 1
        if self.state != "pending":
            raise AssertionError(f"a future was resolved twice ({self.state}, then {state})")
        self.state, self.value = state, value
        if self.flavour == "hostile":
            raise HostileError("set_* raised")
        if self.flavour == "reentrant" and self.pipeline is not None:
            pipeline, self.pipeline = self.pipeline, None
            try:
                pipeline.feed(b"+OK\r\n")
            except (RateLimiterError, *TOLERATED):
                pass
            pipeline.fail_all(RateLimiterError("closed from a callback"), _native.STATUS_CLOSED)

    def set_result(self, value) -> None:
        self._set("result", value)

    def set_exception(self, exc) -> None:
        self._set("exception", exc)


@atheris.instrument_func
def classify(exc: BaseException) -> int:
    """Branches per kind of error message, so new kinds of outcome count as new coverage."""
    text = str(exc)
    if "malformed" in text:
        return 1
    if "nobody asked" in text:
        return 2
    if "not a rate-limit decision" in text:
        return 3
    if "out of range" in text:
        return 4
    if "element" in text:
        return 5
    if "another length" in text:
        return 6
    if "answered an error" in text or "with an error" in text:
        return 7
    if "authentication" in text:
        return 8
    if "without completing" in text:
        return 9
    if "unexpected reply" in text:
        return 10
    if "closed" in text:
        return 11
    return 0
