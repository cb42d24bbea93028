"""Writes the seed corpus in fuzz/corpus/ (committed; rerun after changing an input layout).

pipeline/: raw-mode inputs (see fuzz_pipeline.py for the two header bytes) holding what a
server really answers: decisions, NOSCRIPT then the SHA then a decision, error replies,
statuses for handshake commands, a few broken ones, and RESP3 values in those places.
Structured-mode and arguments/ seeds are short random-looking byte strings: their bytes are
choices, not text.
"""

from __future__ import annotations

import hashlib
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))


def decision(allowed: int, remaining: int, retry: int, window: int) -> bytes:
    """A reply of lua/sliding_window.lua to a check of `window` windows."""
    return (b"*7\r\n:%d\r\n:%d\r\n:%d\r\n:%d\r\n:1767225600000\r\n" % (allowed, remaining, retry, window)
            + b"*%d\r\n" % window + b":%d\r\n" % (remaining if allowed else 0) * window
            + b":%d\r\n" % (retry * 1000))


def head(decisions: int, commands: int = 0, structured: bool = False, windows: int = 1,
         chunk: int = 0, client_clock: bool = False, some_done: bool = False,
         hostile: bool = False) -> bytes:
    b0 = (decisions | (8 if structured else 0) | (commands << 4) | (64 if some_done else 0)
          | (128 if hostile else 0))
    b1 = (windows - 1) | (4 if client_clock else 0) | (chunk << 3)
    return bytes([b0, b1])


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
    for name, data in PIPELINE.items():
        with open(os.path.join(HERE, "corpus", "pipeline", name), "wb") as f:
            f.write(data)
    for i in range(6):  # structured mode: header + choices
        data = head(rng.randint(0, 7), rng.randint(0, 3), structured=True, windows=rng.randint(1, 4))
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
