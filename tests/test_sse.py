"""genai_ratelimit.fastapi._usage.EventStreamParser: a text/event-stream read as the WHATWG HTML
standard's "event stream interpretation" says, incrementally. The standard's own example
streams (written here as vectors: the stream, the events it dispatches), each fed whole, one
byte at a time and in random splits, with LF, CR and CRLF line ends; random streams against
a reference reading of the standard that sees the whole stream at once; the bound on what
is kept; and UsageScanner reading the usage of a stream written in any of these ways
(issue 30, item 3: bare CR line ends and an event whose JSON spans two data: lines). Pure
unit tests: bytes in, events out."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genai_ratelimit.fastapi._usage import EventStreamParser, ServerSentEvent, UsageScanner

M = "message"


def event(data: str, type_: str = M, last_event_id: str = "") -> ServerSentEvent:
    return ServerSentEvent(type_, data, last_event_id)


# The standard's examples (section "Server-sent events": its introduction, "Parsing an event
# stream", "Interpreting an event stream" and the authoring notes), each as: a name, the
# stream (LF line ends), the events dispatched, the reconnection time it leaves.
STANDARD_EXAMPLES: list[tuple[str, bytes, list[ServerSentEvent], int | None]] = [
    ("three-messages",
     b"data: This is the first message.\n\n"
     b"data: This is the second message, it\ndata: has two lines.\n\n"
     b"data: This is the third message.\n\n",
     [event("This is the first message."),
      event("This is the second message, it\nhas two lines."),
      event("This is the third message.")], None),
    ("event-types",
     b"event: add\ndata: 73857293\n\nevent: remove\ndata: 2153\n\nevent: add\ndata: 113411\n\n",
     [event("73857293", "add"), event("2153", "remove"), event("113411", "add")], None),
    ("stock-lines", b"data: YHOO\ndata: +2\ndata: 10\n\n", [event("YHOO\n+2\n10")], None),
    # A comment; data then an id; an id without a value (the last event ID back to empty);
    # a value whose second space is kept.
    ("comment-and-ids",
     b": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\ndata:  third event\n\n",
     [event("first event", last_event_id="1"), event("second event"), event(" third event")], None),
    # "data" alone is a data field with an empty value; the last block has no blank line
    # after it, so it is never dispatched.
    ("empty-data", b"data\n\ndata\ndata\n\ndata:", [event(""), event("\n")], None),
    # With or without the space after the colon: the same event.
    ("optional-space", b"data:test\n\ndata: test\n\n", [event("test"), event("test")], None),
    # The last event ID stays until an id field changes it; the reconnection time.
    ("retry-and-id",
     b"retry: 10000\nid: 42\ndata: one\n\ndata: two\n\nid: 43\ndata: three\n\n",
     [event("one", last_event_id="42"), event("two", last_event_id="42"),
      event("three", last_event_id="43")], 10_000),
    # A keep-alive comment line between events dispatches nothing.
    ("keep-alive", b"data: a\n\n:\n\n: ping\n\ndata: b\n\n", [event("a"), event("b")], None),
]

# The processing rules the examples do not show, one by one.
RULES: list[tuple[str, bytes, list[ServerSentEvent], int | None]] = [
    ("an-id-with-nul-is-ignored", b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n",
     [event("a", last_event_id="1"), event("b", last_event_id="1")], None),
    ("a-retry-not-all-digits-is-ignored", b"retry: 1000\n\nretry: 2e3\nretry: -5\nretry:\n\n", [], 1000),
    ("the-type-is-reset-after-each-event", b"event: add\ndata: a\n\ndata: b\n\n",
     [event("a", "add"), event("b")], None),
    ("a-block-without-data-dispatches-nothing-and-forgets-its-type",
     b"event: add\n\ndata: a\n\nevent: x\nid: 9\n\ndata: b\n\n",
     [event("a"), event("b", last_event_id="9")], None),
    ("an-empty-event-type-is-message", b"event:\ndata: a\n\n", [event("a")], None),
    ("field-names-are-case-sensitive-and-unknown-ones-ignored",
     b"Data: a\nDATA: b\nfoo: c\ndata : d\ndata: e\n\n", [event("e")], None),
    ("only-one-space-is-dropped", b"data:   x  \n\n", [event("  x  ")], None),
    ("a-colon-in-the-value-stays", b"data: a: b:c\n\n", [event("a: b:c")], None),
    ("a-bom-is-dropped-once", b"\xef\xbb\xbfdata: a\n\n", [event("a")], None),
    ("a-second-bom-is-part-of-the-field-name", b"\xef\xbb\xbf\xef\xbb\xbfdata: a\n\ndata: b\n\n",
     [event("b")], None),
    ("utf-8-text", "data: h\u00e9llo \u4e16\u754c \U0001f389\nevent: \u00e9\n\n".encode(),
     [event("h\u00e9llo \u4e16\u754c \U0001f389", "\u00e9")], None),
    ("invalid-utf-8-is-replaced", b"data: a\xffb\xe4\n\n", [event("a\ufffdb\ufffd")], None),
    ("blank-lines-alone-dispatch-nothing", b"\n\n\n\ndata: a\n\n\n", [event("a")], None),
]

VECTORS = STANDARD_EXAMPLES + RULES


def with_line_ends(stream: bytes, line_end: bytes) -> bytes:
    return stream.replace(b"\n", line_end)


def feed_in(chunks: Iterable[bytes]) -> tuple[list[ServerSentEvent], EventStreamParser]:
    parser = EventStreamParser()
    events: list[ServerSentEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events, parser


def split_at(stream: bytes, cuts: Sequence[int]) -> list[bytes]:
    edges = [0, *sorted(cuts), len(stream)]
    return [stream[a:b] for a, b in pairwise(edges)]


LINE_ENDS = {"lf": b"\n", "cr": b"\r", "crlf": b"\r\n"}


@pytest.mark.parametrize("line_end", sorted(LINE_ENDS))
@pytest.mark.parametrize("name, stream, expected, retry", VECTORS, ids=[v[0] for v in VECTORS])
def test_every_example_whole_and_one_byte_at_a_time(
        name: str, stream: bytes, expected: list[ServerSentEvent], retry: int | None, line_end: str) -> None:
    stream = with_line_ends(stream, LINE_ENDS[line_end])
    for chunks in ([stream], [stream[i:i + 1] for i in range(len(stream))]):
        events, parser = feed_in(chunks)
        assert events == expected
        assert parser.retry == retry


@settings(max_examples=300, deadline=None)
@given(vector=st.sampled_from(VECTORS), line_end=st.sampled_from(sorted(LINE_ENDS)),
       cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_every_example_in_random_splits(
        vector: tuple[str, bytes, list[ServerSentEvent], int | None], line_end: str, cuts: list[int]) -> None:
    _, stream, expected, retry = vector
    stream = with_line_ends(stream, LINE_ENDS[line_end])
    events, parser = feed_in(split_at(stream, [cut % (len(stream) + 1) for cut in cuts]))
    assert events == expected
    assert parser.retry == retry


def test_a_crlf_split_between_two_chunks_is_one_line_end() -> None:
    parser = EventStreamParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\n") == []  # the LF of the CRLF, not a blank line
    assert parser.feed(b"\r") == [event("a")]  # this CR is the blank line
    assert parser.feed(b"\ndata: b\r\n\r\n") == [event("b")]  # ... and its LF again one end


def test_a_bom_split_over_chunks_is_dropped_and_only_at_the_start() -> None:
    assert feed_in([b"\xef", b"\xbb", b"\xbfdata: a\n\n"])[0] == [event("a")]
    assert feed_in([b"\xef\xbb", b"\xbf\xef\xbb\xbfdata: a\n\n"])[0] == []
    assert feed_in([b"data: a\n\n", b"\xef\xbb\xbfdata: b\n\n"])[0] == [event("a")]
    assert feed_in([b"", b"\xef", b"", b"\xbb\xbf", b"data: a\n\n"])[0] == [event("a")]


def test_an_unfinished_last_event_is_not_dispatched_but_end_returns_it() -> None:
    parser = EventStreamParser()
    assert parser.feed(b"data: a\n\nevent: e\ndata: b\ndata: c") == [event("a")]
    assert parser.end() == event("b\nc", "e")
    assert parser.end() is None  # said once
    assert parser.feed(b"data: d\n\n") == [event("d")]
    assert EventStreamParser().end() is None


# --- random streams against a reference reading of the standard ---------------------------


def reference(stream: bytes) -> tuple[list[ServerSentEvent], int | None]:
    """The standard read literally, on the whole stream at once: decode as UTF-8 (U+FFFD for
    what is invalid), drop one leading BOM, split at CRLF / LF / CR, interpret each line.
    Only lines that a line end closes are interpreted (the end of the file discards the
    rest)."""
    text = stream.decode("utf-8", "replace")
    text = text[1:] if text.startswith("\ufeff") else text
    lines = re.split("\r\n|\r|\n", text)[:-1]
    events: list[ServerSentEvent] = []
    data, kind, last_id, retry = "", "", "", None
    for line in lines:
        if line == "":
            if data:
                events.append(ServerSentEvent(kind or M, data[:-1] if data.endswith("\n") else data, last_id))
            data, kind = "", ""
            continue
        if line.startswith(":"):
            continue
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            data += value + "\n"
        elif name == "event":
            kind = value
        elif name == "id" and "\0" not in value:
            last_id = value
        elif name == "retry" and value and all(c in "0123456789" for c in value):
            retry = int(value)
    return events, retry


PIECES = [b"data", b"event", b"id", b"retry", b":", b" ", b"  ", b"\n", b"\r", b"\r\n", b"\n\n",
          b"x", b"42", b"\x00", b"\xef\xbb\xbf", b"\xc3\xa9", b"\xe4\xb8", b"\x96", b"\xff",
          b"data: ", b"data:", b"event: add", b":comment"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=60), seed=st.integers(0, 2**32 - 1))
def test_random_streams_in_random_splits_read_as_the_standard_says(pieces: list[bytes], seed: int) -> None:
    stream = b"".join(pieces)
    expected, retry = reference(stream)
    rng = random.Random(seed)
    cuts = [rng.randrange(len(stream) + 1) for _ in range(rng.randrange(8))]
    for chunks in ([stream], split_at(stream, cuts), [stream[i:i + 1] for i in range(len(stream))]):
        events, parser = feed_in(chunks)
        assert events == expected
        assert parser.retry == retry


# --- bounded -------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [1 << 16, 1 << 22], ids=["pieces", "whole"])
def test_an_event_too_long_to_keep_is_skipped_and_nothing_grows(step: int) -> None:
    bound = 1 << 18
    parser = EventStreamParser(max_event_bytes=bound)
    long_line = b"data: " + b"x" * (3 * bound) + b"\ndata: end\n\n"
    many_lines = b"data: " + b"y" * 1000 + b"\n"
    stream = (b"data: a\n\n" + long_line + many_lines * (bound // 1000 + 1) + b"\n"
              + b": " + b"z" * (2 * bound) + b"\r\ndata: b\r\n\r\ndata: c\n\n")
    events = []
    for start in range(0, len(stream), step):
        events += parser.feed(stream[start:start + step])
        kept = len(parser._line) + sum(len(part) for part in parser._data)
        assert kept <= bound + 1
    # The long line's event, the event of too many data lines, the one with a long comment.
    assert events == [event("a"), event("c")]
    assert parser.skipped == 3


# --- UsageScanner over streams written as the standard allows -------------------------------

USAGE = {"id": "c", "object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 1_000, "completion_tokens": 4_000, "total_tokens": 5_000}}


def usage_streams() -> dict[str, bytes]:
    one_line = json.dumps(USAGE)
    lines = json.dumps(USAGE, indent=2).split("\n")
    return {
        "bare-cr": f"data: {one_line}\r\rdata: [DONE]\r\r".encode(),
        "crlf": f"data: {one_line}\r\n\r\ndata: [DONE]\r\n\r\n".encode(),
        "multi-line-data": ("".join(f"data: {line}\n" for line in lines) + "\ndata: [DONE]\n\n").encode(),
        "two-data-lines": "data: {}\ndata: {}\n\ndata: [DONE]\n\n".format(
            *one_line.split(" ", 1)).encode(),  # split where JSON allows a line end
        "bom-comments-no-space": (f"\ufeff: hello\n\nid: 1\nevent: chunk\ndata:{one_line}\n\n"
                                  ": bye\ndata:[DONE]\n\n").encode(),
    }


@pytest.mark.parametrize("name", sorted(usage_streams()))
def test_the_usage_of_a_stream_written_as_the_standard_allows(name: str) -> None:
    stream = usage_streams()[name]
    for step in (1, 2, 5, len(stream)):
        scanner = UsageScanner("sse")
        for start in range(0, len(stream), step):
            scanner.feed(stream[start:start + step])
        assert scanner.done
        assert scanner.total_tokens() == 5_000


def test_data_done_is_the_end_only_as_a_whole_event() -> None:
    scanner = UsageScanner("sse")
    scanner.feed(b"data: [DONE]\n")
    assert not scanner.done  # the event may go on: no blank line yet
    scanner.feed(b"data: more\n\n")
    assert not scanner.done  # its data is "[DONE]\nmore", not [DONE]
    scanner.feed(b"data: [DONE]\n\n")
    assert scanner.done
