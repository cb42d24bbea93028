"""Writes the seed corpus in fuzz/corpus/ (committed; rerun after changing an input layout).

pipeline/: raw-mode inputs (fuzz/layout.py: three header bytes) holding what a server really
answers: a reply of every kind (fuzz/layout.py KINDS), well formed and with integers out of
what the script can answer or out of int64, NOSCRIPT then the SHA then a decision, error
replies, statuses for handshake commands, a few broken ones, and RESP3 values in those
places.
Structured-mode and arguments/ seeds are short random-looking byte strings: their bytes are
choices, not text.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil

from layout import KINDS, head

HERE = os.path.dirname(os.path.abspath(__file__))
LLONG_MAX, LLONG_MIN = 2**63 - 1, -(2**63)
NOW = 1_767_225_600_000


def decision(allowed: int, remaining: int, retry: int, window: int) -> bytes:
    """A reply of lua/sliding_window.lua to a check of `window` windows."""
    return (b"*7\r\n:%d\r\n:%d\r\n:%d\r\n:%d\r\n:1767225600000\r\n" % (allowed, remaining, retry, window)
            + b"*%d\r\n" % window + b":%d\r\n" % (remaining if allowed else 0) * window
            + b":%d\r\n" % (retry * 1000))


def resp(value: object) -> bytes:
    """RESP2 text of an int, bytes (a bulk string) or a list of those; a str is put as is
    (an integer's text that is no int64, for hiredis to refuse)."""
    if isinstance(value, list):
        return b"*%d\r\n" % len(value) + b"".join(resp(v) for v in value)
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if isinstance(value, str):
        return b":" + value.encode() + b"\r\n"
    return b":%d\r\n" % value  # type: ignore[str-format]


def window(allowed: int = 1, remaining: int = 4, retry: int = 0, index: int = 1, now: object = NOW,
           each: list[object] | None = None, retry_ms: object = 0,
           usage: list[object] | None = None) -> bytes:
    """sliding_window.lua's reply (peek.lua's with usage), any element replaceable."""
    items: list[object] = [allowed, remaining, retry, index, now,
                           [remaining] if each is None else each, retry_ms]
    return resp(items + ([usage] if usage is not None else []))


def lease(ok: int = 1, held: int = 1, retry_ms: object = 0, expires: object = NOW + 60_000,
          now: object = NOW) -> bytes:
    return resp([ok, held, retry_ms, expires, now])


SHA = b"$40\r\n" + b"0" * 40 + b"\r\n"  # the real SHA is read at run time; any 40 bytes do
NOSCRIPT = b"-NOSCRIPT No matching script. Please use EVAL.\r\n"

PIPELINE = {
    "one-allow": head(1) + decision(1, 9, 0, 1),
    "one-reject": head(1) + decision(0, 0, 42, 1),
    "three-allow-byte-by-byte": (head(3, chunk=1)
                                 + decision(1, 4, 0, 1) + decision(1, 5, 0, 1) + decision(1, 6, 0, 1)),
    "two-windows": head(2, windows=2) + decision(1, 3, 0, 2) + decision(0, 0, 7, 1),
    "four-windows-chunked": head(2, windows=4, chunk=5) + decision(1, 3, 0, 4) + decision(0, 0, 3600, 3),
    "noscript-reload": head(1) + NOSCRIPT + SHA + decision(1, 9, 0, 1),
    "noscript-twice": head(1) + NOSCRIPT + SHA + NOSCRIPT,
    "handshake-then-decision": head(1, commands=1) + b"+OK\r\n" + decision(1, 9, 0, 1),
    "auth-error": (head(1, commands=1) + b"-WRONGPASS invalid username-password pair\r\n"
                   + decision(1, 9, 0, 1)),
    "server-error": head(2) + b"-ERR Error running script: WRONGTYPE\r\n" + decision(1, 1, 0, 1),
    "out-of-range": head(1) + decision(1, -1, 0, 1),
    "wrong-window": head(1, windows=2) + decision(1, 1, 0, 3),
    "wrong-types": head(1) + b"*7\r\n:1\r\n$1\r\n5\r\n:0\r\n+1\r\n:0\r\n*0\r\n:0\r\n",
    "short-array": head(1) + b"*3\r\n:1\r\n:2\r\n:0\r\n",
    "nested": head(1) + b"*7\r\n*1\r\n:1\r\n:2\r\n:0\r\n:1\r\n:0\r\n*1\r\n:2\r\n:0\r\n",
    "nil": head(2) + b"$-1\r\n*-1\r\n",
    "unasked": head(0) + decision(1, 9, 0, 1),
    "truncated": head(1) + b"*7\r\n:1\r\n:9",
    "garbage": head(1) + b"HTTP/1.1 400 Bad Request\r\n\r\n",
    "bulk": head(1) + b"$5\r\nhello\r\n",
    "cancelled-futures": (head(3, some_done=True)
                          + decision(1, 4, 0, 1) + decision(1, 5, 0, 1) + decision(1, 6, 0, 1)),
    "hostile-futures": head(6, commands=2, hostile=True) + b"+OK\r\n" + b"+OK\r\n" + decision(1, 4, 0, 1) * 6,
    "client-clock": head(1, client_clock=True) + decision(1, 9, 0, 1),
    # Regressions (see KNOWN_BUGS in fuzz_pipeline.py).
    "non-utf8-error-reply": head(1) + b"-ERR \xff\r\n",
    "command-answered-by-array-with-error": head(0, commands=1) + b"*1\r\n-ERR inside\r\n",
    "feed-after-protocol-error": head(2, chunk=1) + b"!x\r\n" + decision(1, 1, 0, 1),
    "utf8-error-reply-cut-mid-character": head(1) + b"-ERR " + b"x" * 235 + "\u00e9".encode() + b"\r\n",
}

# Every reply kind, well formed and with the integers that once went unchecked (issue 21:
# retry_ms = 2**63 - 1 made a lease with retry_after_s -9223372036854774) or that no int64
# holds (hiredis refuses those texts).
PIPELINE.update({
    "check-refused-retry-2p62": head(1) + window(0, 0, 2**62, 1, NOW, [0], 2**62),
    "check-refused-retry-292-million-years": head(1) + window(0, 0, 9223372036854775, 1, NOW, [0],
                                                             9223372036854775000),
    "check-now-llong-max": head(1) + window(now=LLONG_MAX),
    "check-now-llong-min": head(1) + window(now=LLONG_MIN),
    "check-now-20-digits": head(1) + window(now="18446744073709551617"),
    "check-now-40-digits": head(1) + window(now="-" + "9" * 40),
    "check-remaining-leading-zeros": head(1) + window(remaining="004"),
    "weighted-refused": head(1, first="weighted") + window(0, 0, 60, 1, NOW, [0], 59_001),
    "detailed-allowed": head(1, first="detailed") + window(),
    "detailed-now-after-year-9999": head(1, first="detailed") + window(now=253402300800000),
    "reserve-allowed": head(1, first="reserve") + window(each=[4, 999]),
    "reserve-refused-retry-ms-llong-max": head(1, first="reserve")
    + window(0, 0, LLONG_MAX // 1000 + 1, 1, NOW, [0], LLONG_MAX),
    "scopes-allowed": head(1, first="scopes") + window(each=[4, 4]),
    "scopes-remaining-llong-max": head(1, first="scopes") + window(each=[4, LLONG_MAX]),
    "reconcile-found": head(1, first="reconcile") + resp(1),
    "reconcile-found-llong-max": head(1, first="reconcile") + resp(LLONG_MAX),
    "peek-allowed": head(1, first="peek") + window(usage=[1, NOW - 1000]),
    "peek-used-llong-max": head(1, first="peek") + window(usage=[LLONG_MAX, NOW - 1000]),
    "peek-oldest-llong-min": head(1, first="peek") + window(usage=[1, LLONG_MIN]),
    "reset-removed": head(1, first="reset") + resp([2, b"0"]),
    "reset-removed-llong-max": head(1, first="reset") + resp([LLONG_MAX, b"0"]),
    "scan-cursor-at-2p64": head(1, first="scan") + resp([0, b"18446744073709551615"]),
    "scan-cursor-past-2p64": head(1, first="scan") + resp([0, b"18446744073709551616"]),
    "scan-cursor-21-digits": head(1, first="scan") + resp([0, b"1" * 21]),
    "acquire-allowed": head(1, first="acquire") + lease(),
    "acquire-refused": head(1, first="acquire") + lease(0, 3, 1500, 0),
    "acquire-refused-retry-ms-llong-max": head(1, first="acquire") + lease(0, 3, LLONG_MAX, 0),
    "acquire-expires-llong-max": head(1, first="acquire") + lease(expires=LLONG_MAX),
    "acquire-retry-ms-20-digits": head(1, first="acquire") + lease(0, 3, "99999999999999999999", 0),
    "release-held": head(1, first="release") + lease(1, 0, 0, 0),
    "release-now-llong-max": head(1, first="release") + lease(1, 0, 0, 0, LLONG_MAX),
    "renew-held": head(1, first="renew") + lease(),
    "renew-expires-llong-max": head(1, first="renew") + lease(expires=LLONG_MAX),
    "every-kind-allowed": head(7, first="reconcile") + resp(1) + window(usage=[1, NOW])
    + resp([2, b"0"]) + resp([0, b"0"]) + lease() + lease(1, 0, 0, 0) + lease(),
})

# RESP3 values, which hiredis 1.x parses (0.14 calls their type bytes a protocol error) and
# our reader refuses on every version: as the decision, inside it, as the reply to a
# handshake command, and as SCRIPT LOAD's reply after a NOSCRIPT.
RESP3 = {
    "double": b",1.5\r\n",
    "bool": b"#t\r\n",
    "null": b"_\r\n",
    "map": b"%2\r\n:1\r\n:9\r\n:0\r\n:1\r\n",
    "set": b"~4\r\n:1\r\n:9\r\n:0\r\n:1\r\n",
    "attribute": b"|1\r\n+ttl\r\n:3\r\n",
    "push": b">2\r\n$10\r\ninvalidate\r\n_\r\n",
    "big-number": b"(3492890328409238509324850943850943825024385\r\n",
    "verbatim": b"=15\r\ntxt:Some string\r\n",
}
for _name, _value in RESP3.items():
    PIPELINE[f"resp3-{_name}-as-decision"] = head(1) + _value + decision(1, 9, 0, 1)
    PIPELINE[f"resp3-{_name}-in-decision"] = (head(1) + b"*7\r\n:1\r\n" + _value
                                              + b":0\r\n:1\r\n:0\r\n*1\r\n:5\r\n:0\r\n")
    PIPELINE[f"resp3-{_name}-to-handshake"] = (head(1, commands=1) + _value + b"+OK\r\n"
                                               + decision(1, 9, 0, 1))
    PIPELINE[f"resp3-{_name}-to-script-load"] = (head(1) + NOSCRIPT + _value + SHA
                                                 + decision(1, 9, 0, 1))


def main() -> None:
    rng = random.Random(6)
    shutil.rmtree(os.path.join(HERE, "corpus", "pipeline"), ignore_errors=True)
    os.makedirs(os.path.join(HERE, "corpus", "pipeline"))
    for name, data in PIPELINE.items():
        with open(os.path.join(HERE, "corpus", "pipeline", name), "wb") as f:
            f.write(data)
    firsts = random.Random(7)  # apart, so that the seeds of arguments/ stay what they were
    for i in range(6):  # structured mode: header + choices
        data = head(rng.randint(0, 7), rng.randint(0, 3), structured=True, windows=rng.randint(1, 4),
                    first=firsts.choice(KINDS))
        data += bytes(rng.randrange(256) for _ in range(rng.randint(16, 96)))
        with open(os.path.join(HERE, "corpus", "pipeline", f"structured-{i}"), "wb") as f:
            f.write(data)
    for _ in range(16):
        data = bytes(rng.randrange(256) for _ in range(rng.randint(4, 64)))
        name = hashlib.sha1(data).hexdigest()[:12]
        with open(os.path.join(HERE, "corpus", "arguments", f"random-{name}"), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
