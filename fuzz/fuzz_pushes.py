"""Fuzz target: the wait queue's pub/sub reader (genai_ratelimit._native.PushReader, csrc/
proto.c's rl_push_* through csrc/py_pushes.c), which decodes what a subscriber connection
reads: SUBSCRIBE / UNSUBSCRIBE confirmations, the releases' messages (lua/lease.lua
PUBLISHes the woken tickets), an AUTH's status, an error.

Input: byte 0 bit 0 structured mode, bits 1-7 the chunk size (0: one feed); the rest is the
server's bytes (raw mode), or choices for a grammar of pushes (RESP2 arrays and RESP3 `>`
pushes of every kind, with counts and lengths right or wrong, nested, huge, garbage:
push_item) so that mutations stay near valid pushes.

The oracle: feed() returns a list of (kind, channel, payload) with kind one of the four the
reader knows and channel, payload bytes; or it raises RateLimiterError, after which the
reader is done: every later feed raises RateLimiterError too, and nothing crashes. Fails
(crash) on a sanitizer report, any other exception, or a result outside that shape.

    python fuzz/fuzz_pushes.py [libFuzzer flags] [corpus dirs]   (see fuzz/run.py)
"""

from __future__ import annotations

import sys

from common import RateLimiterError, _native, atheris, integer_text

KINDS = ("message", "subscribe", "unsubscribe", "status")
WORDS = (b"message", b"subscribe", b"unsubscribe", b"pmessage", b"psubscribe", b"pong", b"")
CHANNEL = b"ratelimit:openai/gpt-4o:leases:queue"
TICKET = b"00000000-0000-4000-8000-000000000000"


def bulk(fdp: atheris.FuzzedDataProvider, body: bytes) -> bytes:
    """A bulk string, its announced length right or (sometimes) wrong."""
    length = len(body) + (fdp.ConsumeIntInRange(-2, 2) if fdp.ConsumeIntInRange(0, 7) == 0 else 0)
    return b"$%d\r\n%s\r\n" % (length, body)


def push_item(fdp: atheris.FuzzedDataProvider, depth: int = 0) -> bytes:
    kind = fdp.ConsumeIntInRange(0, 11)
    if kind <= 3:  # a push of three: a kind's word, a channel, a payload or a count
        lead = b">" if fdp.ConsumeBool() else b"*"
        word = fdp.PickValueInList(list(WORDS))
        channel = CHANNEL if fdp.ConsumeBool() else fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 40))
        if word in (b"subscribe", b"unsubscribe") and fdp.ConsumeBool():
            last = b":" + integer_text(fdp, (0, 1, 2)) + b"\r\n"
        else:
            tickets = b" ".join(TICKET for _ in range(fdp.ConsumeIntInRange(0, 3)))
            last = bulk(fdp, tickets if fdp.ConsumeBool()
                        else fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64)))
        count = 3 + (fdp.ConsumeIntInRange(-3, 2) if fdp.ConsumeIntInRange(0, 5) == 0 else 0)
        return b"%s%d\r\n%s%s%s" % (lead, count, bulk(fdp, word), bulk(fdp, channel), last)
    if kind == 4:  # a status (AUTH's +OK) or an error (-NOAUTH, -NOPERM)
        line = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 40)).replace(b"\r", b"").replace(b"\n", b"")
        return (b"+" if fdp.ConsumeBool() else b"-") + line + b"\r\n"
    if kind == 5:
        return b":" + integer_text(fdp, (0, 1)) + b"\r\n"
    if kind == 6:
        return fdp.PickValueInList([b"$-1\r\n", b"*-1\r\n", b"_\r\n", b">-1\r\n", b"*0\r\n"])
    if kind == 7 and depth < 4:  # an array or a push of anything, its count right or wrong
        n = fdp.ConsumeIntInRange(0, 5)
        items = b"".join(push_item(fdp, depth + 1) for _ in range(n))
        lead = fdp.PickValueInList([b"*", b">", b"%", b"~"])
        return b"%s%d\r\n%s" % (lead, n + fdp.ConsumeIntInRange(-1, 1), items)
    if kind == 8:  # a huge announced length (fits, or fails calloc at once)
        size = fdp.PickValueInList([10**6, 10**7, 2**32 + 1, 2**40, 2**63 - 1, -2, -2**63])
        return fdp.PickValueInList([b"*", b">", b"$"]) + b"%d\r\n" % size
    if kind == 9:  # RESP3 scalars the reader may meet
        return fdp.PickValueInList([b"#t\r\n", b",1.5\r\n", b"(12345678901234567890\r\n",
                                    b"=7\r\ntxt:abc\r\n", b"!5\r\nERROR\r\n"])
    return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 16))  # garbage


def check(pushes: object) -> None:
    if not isinstance(pushes, list):
        raise AssertionError(f"feed() answered {type(pushes).__name__}, not a list")
    for push in pushes:
        if not (isinstance(push, tuple) and len(push) == 3 and push[0] in KINDS
                and isinstance(push[1], bytes) and isinstance(push[2], bytes)):
            raise AssertionError(f"feed() answered a push outside the model: {push!r}")


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    fdp = atheris.FuzzedDataProvider(data)
    header = fdp.ConsumeInt(1) & 0xFF
    chunk = header >> 1
    if header & 1:
        stream = b"".join(push_item(fdp) for _ in range(fdp.ConsumeIntInRange(1, 8)))
    else:
        stream = fdp.ConsumeBytes(fdp.remaining_bytes())
    reader = _native.PushReader()
    pieces = [stream] if chunk == 0 else [stream[i:i + chunk]
                                          for i in range(0, len(stream), chunk)]
    failed = False
    for piece in pieces:
        try:
            pushes = reader.feed(piece)
        except RateLimiterError:
            failed = True
            continue
        if failed:
            raise AssertionError("feed() answered after the reader raised: it must stay done")
        check(pushes)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
