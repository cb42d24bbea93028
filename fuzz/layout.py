"""The input layout of fuzz_pipeline.py, shared with make_corpus.py (which writes seeds in
it and must run without atheris).

  byte 0  bits 0-2 requests (0-7), bit 3 structured mode, bits 4-5 commands (0-3),
          bit 6 some futures already done (cancelled), bit 7 hostile/reentrant futures
  byte 1  bits 0-1 windows per request - 1, bit 2 client clock, bits 3-7 chunk size
          (0: one feed; bit 3 also queues the AUTH/SELECT handshake first, bit 4 ends
          with take_replays instead of fail_all)
  byte 2  the kind of request i is KINDS[(byte 2 + i) % len(KINDS)]
  rest    raw mode: the bytes the "server" sends. Structured mode: choices for a RESP
          grammar (see fuzz_pipeline.resp_item)
"""

from __future__ import annotations

# Every reply kind the decoder knows: the sliding window's (check, weighted, check_windows,
# check_windows_detailed, reserve, reserve with scopes), peek's, reconcile's, reset's (of
# windows, and one SCAN step) and the lease script's (acquire, release, renew).
KINDS = ("check", "weighted", "windows", "detailed", "reserve", "scopes", "reconcile", "peek",
         "reset", "scan", "acquire", "release", "renew")
HEADER = 3


def head(requests: int, commands: int = 0, structured: bool = False, windows: int = 1,
         chunk: int = 0, client_clock: bool = False, some_done: bool = False,
         hostile: bool = False, first: str = "check") -> bytes:
    """The header of an input: `first` is the kind of request 0 (the next ones follow in
    KINDS order)."""
    b0 = (requests | (8 if structured else 0) | (commands << 4) | (64 if some_done else 0)
          | (128 if hostile else 0))
    b1 = (windows - 1) | (4 if client_clock else 0) | (chunk << 3)
    return bytes([b0, b1, KINDS.index(first)])
