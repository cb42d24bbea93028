"""Fuzz target: the asyncio limiter's reply decoding (genai_ratelimit._native.Pipeline).

A few Requests made by Codec (and plain commands, like the AUTH/SELECT handshake) are
pushed with stand-in futures, then the input's reply bytes are fed in chunks. The blocking
limiter decodes with the same hiredis reader and the same rl_script_decode, so this covers
its decoding too (only its socket loop is not exercised).

Input layout (so that seeds in fuzz/corpus/pipeline/ stay readable):
  byte 0  bits 0-2 decisions (0-7), bit 3 structured mode, bits 4-5 commands (0-3),
          bit 6 some futures already done (cancelled), bit 7 hostile/reentrant futures
  byte 1  bits 0-1 windows per decision - 1, bit 2 client clock, bits 3-7 chunk size
          (0: one feed)
  rest    raw mode: the bytes the "server" sends. Structured mode: choices for a RESP
          grammar (valid decisions, NOSCRIPT, errors, statuses, bulk strings, nested
          arrays, nil, huge headers, garbage), so mutations stay near valid replies.

Fails (crash) on: a sanitizer report; an exception from feed() other than RateLimiterError
or a hostile future's own; a future resolved twice or with a malformed result; a NOSCRIPT
reload that queues anything but SCRIPT LOAD + the same command; entries left after fail_all.

    python fuzz/fuzz_pipeline.py [libFuzzer flags] [corpus dirs]   (see fuzz/run.py)
"""

from __future__ import annotations

import sys

from common import (
    KNOWN_BUGS,
    SCRIPT_LOAD_PREFIX,
    TOLERATED,
    Future,
    HostileError,
    RateLimiterError,
    _native,
    atheris,
    classify,
)

WINDOW_SECONDS = (1, 60, 3600, 86400)


FLAVOURS = ("plain", "done", "hostile", "reentrant")


@atheris.instrument_func
def resp_item(fdp: atheris.FuzzedDataProvider, depth: int = 0) -> bytes:
    kind = fdp.ConsumeIntInRange(0, 12)
    if kind == 0:  # a well-formed decision, values in and out of range
        values = [fdp.ConsumeIntInRange(-2, 3), fdp.ConsumeIntInRange(-2, 2**62),
                  fdp.ConsumeIntInRange(-2, 2**62), fdp.ConsumeIntInRange(-1, 5),
                  fdp.ConsumeIntInRange(-2, 2**62)]
        each = [fdp.ConsumeIntInRange(-2, 2**62) for _ in range(fdp.ConsumeIntInRange(0, 6))]
        return (b"*7\r\n" + b"".join(b":%d\r\n" % v for v in values)
                + b"*%d\r\n" % len(each) + b"".join(b":%d\r\n" % v for v in each)
                + b":%d\r\n" % fdp.ConsumeIntInRange(-2, 2**62))
    if kind == 1:
        return b"-NOSCRIPT No matching script. Please use EVAL.\r\n"
    if kind in (2, 3):  # an error or a simple string, any text on one line
        line = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 40)).replace(b"\r", b"").replace(b"\n", b"")
        return (b"-" if kind == 2 else b"+") + line + b"\r\n"
    if kind == 4:  # bulk string, its announced length right or wrong
        body = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
        length = len(body) + fdp.ConsumeIntInRange(-2, 2)
        return b"$%d\r\n%s\r\n" % (length, body)
    if kind == 5:
        return b":%d\r\n" % fdp.ConsumeInt(9)
    if kind == 6:
        return b"$-1\r\n" if fdp.ConsumeBool() else b"*-1\r\n"
    if kind == 7 and depth < 4:  # array of anything, count right or wrong
        n = fdp.ConsumeIntInRange(0, 6)
        items = b"".join(resp_item(fdp, depth + 1) for _ in range(n))
        return b"*%d\r\n%s" % (n + fdp.ConsumeIntInRange(-1, 1), items)
    if kind == 8:  # a huge announced length. hiredis callocs 8 bytes per announced element
        # and frees element by element: 2**31 costs seconds per input (tests/test_faults_hostile
        # covers that one); these sizes either fit or fail calloc at once.
        size = fdp.PickValueInList([10**6, 10**7, 2**32 + 1, 2**40, 2**63 - 1, -2, -2**63])
        return (b"*" if fdp.ConsumeBool() else b"$") + b"%d\r\n" % size
    if kind == 9:  # the script's SHA1, as SCRIPT LOAD answers
        return b"$40\r\n" + _native.SCRIPT_SHA1.encode() + b"\r\n"
    if kind == 10:
        return b"-NOAUTH Authentication required.\r\n"
    if kind == 11:  # a decision with the wrong element types
        return b"*7\r\n:1\r\n$1\r\n5\r\n:0\r\n+1\r\n:0\r\n*0\r\n:0\r\n"
    return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 16))  # garbage


@atheris.instrument_func
def check_result(future: Future, request_windows: tuple[int, ...], with_window: bool,
                 limit: int) -> None:
    if future.state == "result":
        result = future.value
        if with_window is None:  # a plain command: bytes, int, None or a list
            if not (result is None or isinstance(result, (bytes, int, list))):
                raise AssertionError(f"command resolved with {result!r}")
            return
        if with_window == "reconcile":  # the windows whose entry was found
            if type(result) is not int or not 0 <= result <= len(request_windows):
                raise AssertionError(f"reconcile resolved with {result!r}")
            return
        if with_window == "acquire":  # (allowed, held, retry_s, retry_ms, lease id, expiry, now)
            if type(result) is not tuple or len(result) != 7 or type(result[0]) is not bool:
                raise AssertionError(f"acquire resolved with {result!r}")
            allowed, held, retry_s, retry_ms, lease_id, expires, now = result
            if held < 0 or now < 0 or (allowed and (held < 1 or retry_ms != 0 or expires <= now
                                                    or len(lease_id) != 36)) \
                    or (not allowed and (held < limit or retry_ms < 1 or lease_id != ""
                                         or retry_s != -(-retry_ms // 1000))):
                raise AssertionError(f"lease out of range accepted: {result!r} (limit {limit})")
            return
        if with_window == "reserve":
            if type(result) is not tuple or len(result) != 9 or type(result[7]) is not tuple \
                    or len(result[7]) != len(request_windows) + 1:
                raise AssertionError(f"reserve resolved with {result!r}")
            limit, with_window = RESERVE_TOKEN_LIMIT, True  # the token window's is the largest
            result = result[:4]
        if type(result) is not tuple or len(result) != (4 if with_window else 3):
            raise AssertionError(f"decision resolved with {result!r}")
        allowed, remaining, retry = result[:3]
        if type(allowed) is not bool or type(remaining) is not int or type(retry) is not int:
            raise AssertionError(f"decision resolved with {result!r}")
        if remaining < 0 or retry < 0 or (not allowed and retry < 1):
            raise AssertionError(f"decision out of range accepted: {result!r}")
        if ((allowed and (retry != 0 or remaining >= limit)) or (not allowed and remaining != 0)) \
                and "decision-range" not in KNOWN_BUGS:
            raise AssertionError(f"decision out of range accepted: {result!r} (limit {limit})")
        if with_window and result[3] not in request_windows:
            raise AssertionError(f"window {result[3]} is not one of {request_windows}")
    elif future.state == "exception":
        if not isinstance(future.value, (RateLimiterError, MemoryError)):
            raise AssertionError(f"future failed with {future.value!r}")
        classify(future.value)


RESERVE_TOKEN_LIMIT = 1000
ENTRY = "00000000-0000-4000-8000-000000000000"


def TestOneInput(data: bytes) -> None:
    if len(data) < 2:
        return
    head, options, rest = data[0], data[1], data[2:]
    decisions = head & 7
    structured = bool(head & 8)
    commands = (head >> 4) & 3
    some_done = bool(head & 64)
    hostile = bool(head & 128)
    nwindows = (options & 3) + 1
    client_clock = bool(options & 4)
    chunk = options >> 3

    codec = _native.Codec("fz", client_clock=client_clock)
    pipeline = _native.Pipeline(30.0)
    pushed: list[tuple[Future, tuple[int, ...], object, int]] = []
    commands_sent: set[bytes] = set()
    if chunk & 1:
        # The engine's handshake first (AUTH + SELECT, as aio.py queues it): its future is
        # resolved with None, or fails like the connection.
        future = Future("plain", pipeline)
        if pipeline.handshake(future, username="fz", password="pw", db=3, ping=True) is not True:
            raise AssertionError("a handshake with a password queued nothing")
        pushed.append((future, (), None, 0))
    for i in range(max(decisions, commands)):
        flavour = "plain"
        if some_done and i % 3 == 1:
            flavour = "done"
        elif hostile and i % 3 == 2:
            flavour = FLAVOURS[2 + (i // 3) % 2]
        if i < commands:
            future = Future(flavour, pipeline)
            pipeline.push_command(future, "SELECT", str(i))
            pushed.append((future, (), None, 0))
        if i < decisions:
            future = Future(flavour, pipeline)
            windows = WINDOW_SECONDS[:nwindows]
            if i == 5:
                request = codec.acquire(f"user-{i}", 3, 60)
                pushed.append((future, windows, "acquire", 3))
            elif i % 5 == 3:
                request = codec.reserve(f"user-{i}", [(5 + i, s) for s in windows],
                                        token_windows=[(RESERVE_TOKEN_LIMIT, windows[0])],
                                        tokens=7)
                pushed.append((future, windows, "reserve", 5 + i))
            elif i % 5 == 4:
                request = codec.reconcile(f"user-{i}", [(5 + i, s) for s in windows], ENTRY,
                                          1_767_225_600_000, i, tokens=bool(i & 1))
                pushed.append((future, windows, "reconcile", 5 + i))
            elif nwindows == 1 and i % 2 == 0:
                request = codec.check(f"user-{i}", 5 + i, windows[0])
                pushed.append((future, windows, False, 5 + i))
            else:
                request = codec.check_windows(f"user-{i}", [(5 + i, s) for s in windows])
                pushed.append((future, windows, True, 5 + i))
            commands_sent.add(request.command)
            pipeline.push(future, request)
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
            pipeline.fail_all(RateLimiterError("connection closed"))
    except HostileError:
        pass
    if pipeline.pending != 0:
        # a hostile future's error stops nothing: fail_all drains every entry regardless
        raise AssertionError(f"{pipeline.pending} entries left after fail_all")
    replayed_futures = {id(future) for future, _ in replayed}
    # After a future's set_exception raised, fail_all drops the rest without failing them
    # (reported: their awaiters would wait forever); so only check when none raised.
    any_hostile = tainted or any(f.flavour in ("hostile", "reentrant") for f, *_ in pushed)
    for future, windows, with_window, limit in pushed:
        if future.flavour == "plain" and not future.done() and not any_hostile \
                and id(future) not in replayed_futures:
            raise AssertionError("a pending future was not failed by fail_all")
        if future.calls > 1:
            raise AssertionError("a future was resolved twice")
        check_result(future, windows, with_window, limit)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
