"""Fuzz target: the asyncio limiter's reply decoding (genai_ratelimit._native.Pipeline).

A few Requests of every reply kind made by Codec (fuzz/layout.py KINDS: the sliding
window's check, weighted check, check_windows, check_windows_detailed, reserve, reserve with
scopes; peek; reconcile; reset of windows and a SCAN step; the lease script's acquire,
release and renew) and plain commands (like the AUTH/SELECT handshake) are pushed with
stand-in futures, then the input's reply bytes are fed in chunks. The blocking limiter
decodes with the same hiredis reader and the same rl_script_decode, so this covers its
decoding too (only its socket loop is not exercised).

Input layout: fuzz/layout.py. In structured mode the replies come from a RESP grammar
(replies of every script, shaped right with integers from common.integer_text: the whole
int64 range and beyond, edges of every bound, texts that are no integer; NOSCRIPT, errors,
statuses, bulk strings, nested arrays, nil, huge headers, garbage), so mutations stay near
valid replies.

The oracle (check_result) is the model of what each script can answer (common.py: counts to
MAX_LIMIT, times to MAX_UNIX_MS, a wait to its window or the longest lease plus
MAX_CLOCK_SKEW_MS, the shape of each result). Fails (crash) on: a sanitizer report; an
exception from feed() other than RateLimiterError or a hostile future's own; a future
resolved twice or with a result outside the model; a NOSCRIPT reload that queues anything
but SCRIPT LOAD + the same command; entries left after fail_all.

    python fuzz/fuzz_pipeline.py [libFuzzer flags] [corpus dirs]   (see fuzz/run.py)
"""

from __future__ import annotations

import sys

from common import (
    LONGEST_LEASE_WAIT_MS,
    MAX_LIMIT,
    MAX_UNIX_MS,
    NOW_MS,
    SCRIPT_LOAD_PREFIX,
    SKEW_MS,
    TOLERATED,
    Future,
    HostileError,
    RateLimiterError,
    _native,
    atheris,
    ceil_seconds,
    classify,
    integer_text,
)
from layout import HEADER, KINDS

WINDOW_SECONDS = (1, 60, 3600, 86400)
FLAVOURS = ("plain", "done", "hostile", "reentrant")
RESERVE_TOKEN_LIMIT = 1000
LEASE_SECONDS = 60
ENTRY = "00000000-0000-4000-8000-000000000000"


def resp_int(fdp: atheris.FuzzedDataProvider, *typical: int) -> bytes:
    return b":" + integer_text(fdp, typical) + b"\r\n"


@atheris.instrument_func
def window_reply(fdp: atheris.FuzzedDataProvider, peek: bool) -> bytes:
    """sliding_window.lua's 7 elements (peek.lua's 8), every integer from the model."""
    allowed = resp_int(fdp, 0, 1)
    retry_ms = fdp.PickValueInList([1, 999, 1000, 1001, 60_000, 3_600_000, 60_000 + SKEW_MS])
    head = (allowed + resp_int(fdp, 0, 1, 4, 5, 1000) + resp_int(fdp, 0, ceil_seconds(retry_ms))
            + resp_int(fdp, 1, 2, 3, 4) + resp_int(fdp, NOW_MS, MAX_UNIX_MS))
    each = [resp_int(fdp, 0, 1, 4, 5) for _ in range(fdp.ConsumeIntInRange(0, 6))]
    reply = (head + b"*%d\r\n" % len(each) + b"".join(each) + resp_int(fdp, 0, retry_ms))
    if not peek:
        return b"*7\r\n" + reply
    usage = [resp_int(fdp, 0, 1, 5, MAX_LIMIT) if i % 2 == 0 else resp_int(fdp, -1, NOW_MS)
             for i in range(2 * fdp.ConsumeIntInRange(0, 4))]
    return b"*8\r\n" + reply + b"*%d\r\n" % len(usage) + b"".join(usage)


@atheris.instrument_func
def lease_reply(fdp: atheris.FuzzedDataProvider) -> bytes:
    """lease.lua's {ok, held, retry_ms, expires, now, bound_ms}."""
    return (b"*6\r\n" + resp_int(fdp, 0, 1) + resp_int(fdp, 0, 1, 3, 4)
            + resp_int(fdp, 0, 1, 1000, LONGEST_LEASE_WAIT_MS)
            + resp_int(fdp, 0, NOW_MS + LEASE_SECONDS * 1000) + resp_int(fdp, NOW_MS)
            + resp_int(fdp, 0, 1, 1000, LONGEST_LEASE_WAIT_MS))


@atheris.instrument_func
def reset_reply(fdp: atheris.FuzzedDataProvider) -> bytes:
    """reset.lua's {removed, cursor}: the cursor's text right, too long, or no number."""
    cursor = fdp.PickValueInList([b"0", b"17", b"18446744073709551615", b"18446744073709551616",
                                  b"1" * 21, b"", b"-1", b"12a"])
    return b"*2\r\n" + resp_int(fdp, 0, 3, MAX_LIMIT) + b"$%d\r\n%s\r\n" % (len(cursor), cursor)


@atheris.instrument_func
def resp_item(fdp: atheris.FuzzedDataProvider, depth: int = 0) -> bytes:
    kind = fdp.ConsumeIntInRange(0, 15)
    if kind == 0:
        return window_reply(fdp, peek=False)
    if kind == 1:
        return b"-NOSCRIPT No matching script. Please use EVAL.\r\n"
    if kind in (2, 3):  # an error or a simple string, any text on one line
        line = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 40)).replace(b"\r", b"").replace(b"\n", b"")
        return (b"-" if kind == 2 else b"+") + line + b"\r\n"
    if kind == 4:  # bulk string, its announced length right or wrong
        body = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
        length = len(body) + fdp.ConsumeIntInRange(-2, 2)
        return b"$%d\r\n%s\r\n" % (length, body)
    if kind == 5:  # a bare integer: reconcile's reply, or anything else's
        return resp_int(fdp, 0, 1, 2)
    if kind == 6:
        return b"$-1\r\n" if fdp.ConsumeBool() else b"*-1\r\n"
    if kind == 7 and depth < 4:  # array of anything, count right or wrong
        n = fdp.ConsumeIntInRange(0, 6)
        items = b"".join(resp_item(fdp, depth + 1) for _ in range(n))
        return b"*%d\r\n%s" % (n + fdp.ConsumeIntInRange(-1, 1), items)
    if kind == 8:  # a huge announced length. hiredis callocs 8 bytes per announced element
        # and frees element by element: 2**31 costs seconds per input (tests/test_faults_hostile
        # covers that one); these sizes either fit or fail calloc at once.
        size = fdp.PickValueInList([10**6, 10**7, 2**32 + 1, 2**40, 2**63 - 1, -2, -2**63, 2**64 + 1])
        return (b"*" if fdp.ConsumeBool() else b"$") + b"%d\r\n" % size
    if kind == 9:  # a script's SHA1, as SCRIPT LOAD answers
        sha = fdp.PickValueInList([_native.SCRIPT_SHA1, _native.LEASE_SHA1, _native.PEEK_SHA1,
                                   _native.RESET_SHA1, _native.RECONCILE_SHA1])
        return b"$40\r\n" + sha.encode() + b"\r\n"
    if kind == 10:
        return b"-NOAUTH Authentication required.\r\n"
    if kind == 11:  # a decision with the wrong element types
        return b"*7\r\n:1\r\n$1\r\n5\r\n:0\r\n+1\r\n:0\r\n*0\r\n:0\r\n"
    if kind == 12:
        return window_reply(fdp, peek=True)
    if kind == 13:
        return lease_reply(fdp)
    if kind == 14:
        return reset_reply(fdp)
    return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 16))  # garbage


# ------------------------------------------------------------------------- the oracle

class Expect:
    """What a request's result may be: its kind, its windows' (limit, seconds, is_token),
    and for leases the limit asked."""

    __slots__ = ("kind", "windows", "limit")

    def __init__(self, kind: str, windows: list[tuple[int, int, bool]], limit: int = 0) -> None:
        self.kind, self.windows, self.limit = kind, windows, limit


def fail(what: str, result: object, expect: Expect) -> None:
    raise AssertionError(f"{expect.kind} resolved with {what}: {result!r} "
                         f"(windows {expect.windows}, limit {expect.limit})")


@atheris.instrument_func
def check_decision(result: object, expect: Expect, allowed: object, remaining: object,
                   retry_s: object, seconds: object, retry_ms: object = None, now: object = None,
                   token: object = False) -> None:
    """A sliding-window decision against the model: the deciding window is one of the
    request's; allow: no wait, fewer left than its limit; refusal: nothing left, a wait of
    1 ms to the window plus the skew, retry_after_s that wait rounded up; a time in range."""
    if type(allowed) is not bool or type(remaining) is not int or type(retry_s) is not int:
        fail("the wrong types", result, expect)
    deciding = [w for w in expect.windows if w[1] == seconds and w[2] == bool(token)]
    if not deciding:
        fail("a window it did not ask for", result, expect)
    limit = max(w[0] for w in deciding)
    longest_wait = seconds * 1000 + SKEW_MS  # type: ignore[operator]
    if allowed:
        if retry_s != 0 or retry_ms not in (None, 0) or not 0 <= remaining < limit:  # type: ignore[operator]
            fail("an allow out of range", result, expect)
    else:
        if remaining != 0 or not 1 <= retry_s <= ceil_seconds(longest_wait):  # type: ignore[operator]
            fail("a refusal out of range", result, expect)
        if retry_ms is not None and (type(retry_ms) is not int or not 1 <= retry_ms <= longest_wait
                                     or retry_s != ceil_seconds(retry_ms)):
            fail("a refusal's wait out of range", result, expect)
    if now is not None and (type(now) is not int or not 0 <= now <= MAX_UNIX_MS):
        fail("a time out of range", result, expect)


@atheris.instrument_func
def check_result(future: Future, expect: Expect | None) -> None:
    if future.state == "exception":
        if not isinstance(future.value, (RateLimiterError, MemoryError)):
            raise AssertionError(f"future failed with {future.value!r}")
        classify(future.value)
        return
    if future.state != "result":
        return
    result = future.value
    if expect is None:  # a plain command: bytes, int, None or a list
        if not (result is None or isinstance(result, (bytes, int, list))):
            raise AssertionError(f"command resolved with {result!r}")
        return
    kind = expect.kind
    if kind in ("check", "weighted"):
        if type(result) is not tuple or len(result) != 3:
            fail("another shape", result, expect)
        check_decision(result, expect, *result, expect.windows[0][1])  # type: ignore[misc]
    elif kind == "windows":
        if type(result) is not tuple or len(result) != 4:
            fail("another shape", result, expect)
        check_decision(result, expect, *result)  # type: ignore[misc]
    elif kind == "detailed":
        if type(result) is not _native.WindowDecision:
            fail("another type", result, expect)
        check_decision(result, expect, *result, result.retry_after_ms,  # type: ignore[misc,attr-defined]
                       result.timestamp_ms)  # type: ignore[attr-defined]
    elif kind in ("reserve", "scopes"):
        if type(result) is not tuple or len(result) != 13 or type(result[7]) is not tuple \
                or len(result[7]) != len(expect.windows):
            fail("another shape", result, expect)
        (allowed, remaining, retry_s, seconds, token, member, now, report, retry_ms, scope, tie,
         slot, share_rule) = result
        check_decision(result, expect, allowed, remaining, retry_s, seconds, retry_ms, now, token)
        if (len(member) == 36) != allowed or type(scope) is not int or tie != 0 or slot is not None:
            fail("a member, scope, tie or slot out of range", result, expect)
        if share_rule != 0:  # no reserved shares are sent here: no share rule can refuse
            fail("a share rule without shares", result, expect)
        for limit, _, _, left, _ in report:
            if left is not None and not 0 <= left <= limit:
                fail("a window's remaining out of range", result, expect)
    elif kind == "peek":
        if type(result) is not tuple or len(result) != 8 or len(result[6]) != len(expect.windows):
            fail("another shape", result, expect)
        allowed, remaining, retry_s, seconds, token, now, usage, retry_ms = result
        check_decision(result, expect, allowed, remaining, retry_s, seconds, retry_ms, now, token)
        for _, _, _, used, oldest in usage:
            if not 0 <= used <= MAX_LIMIT or (oldest is None) != (used == 0) \
                    or (oldest is not None and not 0 <= oldest <= MAX_UNIX_MS):
                fail("a usage out of range", result, expect)
    elif kind == "reconcile":
        if type(result) is not int or not 0 <= result <= len(expect.windows):
            fail("a count out of range", result, expect)
    elif kind in ("reset", "scan"):
        if type(result) is not tuple or len(result) != 2:
            fail("another shape", result, expect)
        removed, cursor = result
        if type(removed) is not int or not 0 <= removed <= MAX_LIMIT or type(cursor) is not str \
                or not 1 <= len(cursor) <= 20 or not cursor.isdigit() or int(cursor) >= 2**64:
            fail("a count or cursor out of range", result, expect)
    elif kind == "acquire":
        # 9 elements since reserved shares of in-flight caps (the rule that refused, last:
        # always 0 here, the harness sends no shares)
        if type(result) is not tuple or len(result) != 9 or type(result[0]) is not bool:
            fail("another shape", result, expect)
        allowed, held, retry_s, retry_ms, lease_id, expires, now, bound, rule = result
        if rule != 0:
            fail("a share rule without shares", result, expect)
        if not 0 <= now <= MAX_UNIX_MS or not 0 <= held <= MAX_LIMIT:
            fail("a time or count out of range", result, expect)
        if allowed and (held < 1 or retry_ms != 0 or retry_s != 0 or len(lease_id) != 36
                        or bound != 0
                        or not now < expires <= now + LEASE_SECONDS * 1000 + SKEW_MS):
            fail("a lease out of range", result, expect)
        # A refusal may come with slots free (held below the limit): tickets of the cap's wait
        # queue are ahead of it (lua/lease.lua, queue_admit_lease), or, with shares, a rule.
        if not allowed and (not 1 <= retry_ms <= bound <= LONGEST_LEASE_WAIT_MS
                            or retry_s != ceil_seconds(retry_ms) or lease_id != "" or expires != 0):
            fail("a refused lease out of range", result, expect)
    elif kind == "release":
        if type(result) is not bool:
            fail("another type", result, expect)
    elif kind == "renew":
        if type(result) is not tuple or len(result) != 2 or type(result[0]) is not bool:
            fail("another shape", result, expect)
        renewed, expires = result
        if (renewed and not 0 < expires <= MAX_UNIX_MS + LEASE_SECONDS * 1000 + SKEW_MS) \
                or (not renewed and expires != 0):
            fail("an expiry out of range", result, expect)


# ------------------------------------------------------------------------ requests

def make_request(codec, kind: str, i: int, windows: tuple[int, ...]):
    """The Request of kind `kind` (the i-th of the input) and what its result may be."""
    user, limit = f"user-{i}", 5 + i
    pairs = [(limit, s) for s in windows]
    plain = [(limit, s, False) for s in windows]
    if kind == "check":
        return codec.check(user, limit, windows[0]), Expect(kind, plain[:1])
    if kind == "weighted":
        return (codec.check(user, limit, windows[0], cost=min(3, limit)),
                Expect(kind, plain[:1]))
    if kind == "windows":
        return codec.check_windows(user, pairs), Expect(kind, plain)
    if kind == "detailed":
        return codec.check_windows_detailed(user, pairs), Expect(kind, plain)
    if kind == "reserve":
        token = [(RESERVE_TOKEN_LIMIT, windows[0], True)]
        return (codec.reserve(user, pairs, token_windows=[(RESERVE_TOKEN_LIMIT, windows[0])],
                              tokens=7), Expect(kind, sorted(plain + token, key=lambda w: w[2])))
    if kind == "scopes":
        scope = ("route:fz", False, ((limit, windows[0]),), ())
        return (codec.reserve(user, pairs[:1], scopes=(scope,)),
                Expect(kind, plain[:1] + plain[:1]))
    if kind == "reconcile":
        return (codec.reconcile(user, pairs, ENTRY, NOW_MS, i, tokens=bool(i & 1)),
                Expect(kind, plain))
    if kind == "peek":
        return codec.peek(user, pairs), Expect(kind, plain)
    if kind == "reset":
        return codec.reset(user, pairs), Expect(kind, plain)
    if kind == "scan":
        return codec.reset(user, cursor=str(i)), Expect(kind, [])
    if kind == "acquire":
        return codec.acquire(user, 3, LEASE_SECONDS), Expect(kind, [], 3)
    if kind == "release":
        return codec.release(user, ENTRY), Expect(kind, [])
    return codec.renew(user, ENTRY, LEASE_SECONDS), Expect(kind, [])


def TestOneInput(data: bytes) -> None:
    if len(data) < HEADER:
        return
    head, options, first, rest = data[0], data[1], data[2], data[HEADER:]
    requests = head & 7
    structured = bool(head & 8)
    commands = (head >> 4) & 3
    some_done = bool(head & 64)
    hostile = bool(head & 128)
    nwindows = (options & 3) + 1
    client_clock = bool(options & 4)
    chunk = options >> 3

    codec = _native.Codec("fz", client_clock=client_clock)
    pipeline = _native.Pipeline(30.0)
    pushed: list[tuple[Future, Expect | None]] = []
    commands_sent: set[bytes] = set()
    if chunk & 1:
        # The engine's handshake first (AUTH + SELECT, as aio.py queues it): its future is
        # resolved with None, or fails like the connection.
        future = Future("plain", pipeline)
        if pipeline.handshake(future, username="fz", password="pw", db=3, ping=True) is not True:
            raise AssertionError("a handshake with a password queued nothing")
        pushed.append((future, None))
    windows = WINDOW_SECONDS[:nwindows]
    for i in range(max(requests, commands)):
        flavour = "plain"
        if some_done and i % 3 == 1:
            flavour = "done"
        elif hostile and i % 3 == 2:
            flavour = FLAVOURS[2 + (i // 3) % 2]
        if i < commands:
            future = Future(flavour, pipeline)
            pipeline.push_command(future, "SELECT", str(i))
            pushed.append((future, None))
        if i < requests:
            future = Future(flavour, pipeline)
            request, expect = make_request(codec, KINDS[(first + i) % len(KINDS)], i, windows)
            commands_sent.add(request.command)
            pipeline.push(future, request)
            pushed.append((future, expect))
    pipeline.take()

    if structured:
        fdp = atheris.FuzzedDataProvider(rest)
        stream = b"".join(resp_item(fdp) for _ in range(fdp.ConsumeIntInRange(0, 12)))
    else:
        stream = rest

    tainted = False
    step = chunk or len(stream) or 1
    for start in range(0, len(stream), step):
        try:
            wrote = pipeline.feed(stream[start:start + step])
        except RateLimiterError as exc:
            classify(exc)
            break  # aio.py drops such a connection
        except HostileError:
            continue  # the future's own error; the pipeline must stay usable
        except TOLERATED as exc:
            if isinstance(exc, ValueError) and not isinstance(exc, UnicodeDecodeError) \
                    and "which this client does not decode" not in str(exc):
                raise
            if isinstance(exc, MemoryError) and start == 0:
                raise  # only a reader already in error refuses bytes: never the first feed
            tainted = True  # the future of that reply was dropped unresolved
            break
        if type(wrote) is not bool:
            raise AssertionError(f"feed() returned {wrote!r}")
        if wrote:
            queued = pipeline.take()
            if not queued.startswith(SCRIPT_LOAD_PREFIX) or not any(
                    queued.endswith(c) for c in commands_sent):
                raise AssertionError(f"NOSCRIPT queued {queued[:80]!r}...")

    pending = pipeline.pending
    if pending < 0 or pending > 3 * len(pushed):
        raise AssertionError(f"pending is {pending}")
    if pipeline.oldest_deadline() is None and pending:
        raise AssertionError("entries pending without a deadline")
    replayed: list[object] = []
    try:
        if chunk & 2:
            # The connection broke: the engine's replay rule picks the decisions to send
            # again (each once, marked); everything else fails.
            replayed = pipeline.take_replays(RateLimiterError("connection lost"))
            for future, request in replayed:
                if request.command not in commands_sent or not request.replayed or future.done():
                    raise AssertionError(f"take_replays handed out {future!r}, {request!r}")
        else:
            pipeline.fail_all(RateLimiterError("connection closed"), _native.STATUS_CLOSED)
    except HostileError:
        pass
    if pipeline.pending != 0:
        # a hostile future's error stops nothing: fail_all drains every entry regardless
        raise AssertionError(f"{pipeline.pending} entries left after fail_all")
    replayed_futures = {id(future) for future, _ in replayed}
    # After a future's set_exception raised, fail_all drops the rest without failing them
    # (reported: their awaiters would wait forever); so only check when none raised.
    any_hostile = tainted or any(f.flavour in ("hostile", "reentrant") for f, _ in pushed)
    for future, expect in pushed:
        if future.flavour == "plain" and not future.done() and not any_hostile \
                and id(future) not in replayed_futures:
            raise AssertionError("a pending future was not failed by fail_all")
        if future.calls > 1:
            raise AssertionError("a future was resolved twice")
        check_result(future, expect)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
