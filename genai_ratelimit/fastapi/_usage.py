"""Token usage with no I/O: the default estimate of a request (OpenAI chat completions,
completions, embeddings and Responses, Anthropic Messages), and the usage a response reports,
found as its bytes pass without holding the stream back:

- OpenAI chat completions: `usage.total_tokens` of the JSON body, or of the last stream chunk
  carrying `usage` (sent when the request asked stream_options={"include_usage": true});
- OpenAI Responses: `usage` of the JSON body, or of the stream's `response.completed`
  (`response.incomplete`, `response.failed`) event;
- Anthropic Messages: `usage` of the JSON body, input_tokens + output_tokens +
  cache_creation_input_tokens + cache_read_input_tokens, or in a stream the same fields of
  `message_start`, updated by `message_delta` (whose counts are cumulative).

No FastAPI here: bytes in, numbers out. Nothing here raises on a hostile body, except the
request's own maximum (`max_tokens` that is not a count): InvalidTokenCount, a ValueError the
route answers with 422."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from .._native import MAX_LIMIT
from ..prices import ANTHROPIC_USAGE_FIELDS, TokenUsage, usage_count

__all__ = ["estimate_openai_tokens", "prompt_characters", "prompt_tokens",
           "requested_completion_tokens", "parse_token_count", "InvalidTokenCount",
           "UsageScanner", "total_tokens_of", "usage_total", "json_object", "requested_model",
           "EventStreamParser", "ServerSentEvent"]

logger = logging.getLogger("genai_ratelimit")

# A JSON response body is kept (a copy, the response itself is not held) up to this size to
# read its usage; a larger one is passed through unread and its reservation kept.
MAX_JSON_BYTES = 4 * 1024 * 1024
# A server-sent event with a line, or data, longer than this is skipped (a usage chunk is a
# few hundred bytes); what is kept of a stream never grows past about this much.
MAX_EVENT_BYTES = 1024 * 1024
# A request body larger than this is not decoded: its model is unknown, and the estimate
# counts every byte of it as a prompt character (never less than the upstream bills).
MAX_REQUEST_JSON_BYTES = 32 * 1024 * 1024
CHARACTERS_PER_TOKEN = 4

# The request fields whose text the upstream bills, walked string by string ...
_TEXT_FIELDS = ("messages", "system", "instructions", "prompt", "input", "suffix")
# ... and those billed as the JSON they hold (function schemas, structured-output schemas).
_JSON_FIELDS = ("tools", "functions", "response_format", "text")
# Inside the text fields, a mapping or list under one of these keys is a JSON document
# (tool arguments, schemas), counted as its compact JSON.
_JSON_VALUED_KEYS = frozenset(("input", "parameters", "input_schema", "schema", "json_schema"))
# Keys whose values are not billed as text: structure, identifiers, and media payloads
# (an image, audio or file is billed by its pixels, seconds or pages, not by its base64;
# the reconcile with the reported usage settles what they cost).
_SKIPPED_KEYS = frozenset(("type", "role", "id", "index", "cache_control", "media_type",
                           "mime_type", "detail", "format", "status", "signature",
                           "encrypted_content", "image_url", "url", "file_data", "file_url",
                           "logprobs"))
# The Anthropic usage fields, all billed (cache reads and writes included): the prices'
# list, which reads each as its own kind.
_ANTHROPIC_FIELDS = ANTHROPIC_USAGE_FIELDS
_ANTHROPIC_INPUT_FIELDS = _ANTHROPIC_FIELDS[:1] + _ANTHROPIC_FIELDS[2:]
# Responses API events that close a response and carry its usage.
_RESPONSE_FINAL_EVENTS = frozenset(("response.completed", "response.incomplete", "response.failed"))
# A count as pydantic (in lax mode) and the upstreams read it from a string: "50000",
# " 50_000 ", "+7", "50000.0".
_COUNT_TEXT = re.compile(r"\s*\+?(\d+(?:_\d+)*)(?:\.0*)?\s*")
_MAX_COUNT_DIGITS = 32


class InvalidTokenCount(ValueError):
    """A request's max_tokens / max_completion_tokens / max_output_tokens / n that the
    upstream would refuse (not a positive whole number): the route's 422."""

    def __init__(self, field: str, value: object) -> None:
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        super().__init__(f"{field} must be a positive whole number (an integer, an integral "
                         f"number or a numeric string), got {shown}")
        self.field = field
        self.value = value


def clamp(tokens: int, what: str) -> int:
    """tokens, at most MAX_LIMIT (the most a window can count): an absurd number from a
    response or a request is logged and clamped, never a broken response."""
    if tokens > MAX_LIMIT:
        logger.warning("%s of %s tokens is above the most a budget can count; counted as %d",
                       what, tokens if tokens < 10**30 else "over 10**30", MAX_LIMIT)
        return MAX_LIMIT
    return tokens


# --- the request -----------------------------------------------------------------------


def _number_characters(number: int | float) -> int:
    if isinstance(number, int) and abs(number) >= 10**4000:
        return number.bit_length() * 3 // 10  # str() refuses numbers this long
    return len(repr(number))


def _json_characters(value: object) -> int:
    """About the length of value written as compact JSON (escapes aside). No recursion:
    any depth is walked in a loop."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, (int, float)):
            total += _number_characters(item)
        elif isinstance(item, Mapping):
            total += 2 + sum(len(str(key)) + 4 for key in item)
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            total += 2 + len(item)
            stack.extend(item)
    return total


def _text_characters(value: object) -> int:
    """Characters of the text in value: every string and number in it (message contents and
    their parts, tool calls and results, names), except under _SKIPPED_KEYS or a key ending
    in "_id"; a JSON document under _JSON_VALUED_KEYS counts as its JSON. A "data" string
    is text only when its media_type is text/* (Anthropic's plain-text documents); else it
    is a media payload. No recursion."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, (int, float)):
            total += _number_characters(item)  # token ids of a prompt, tool arguments
        elif isinstance(item, (list, tuple)):  # before Mapping: an ABC's check costs more
            stack.extend(item)
        elif isinstance(item, Mapping):
            for key, child in item.items():
                if not isinstance(key, str):
                    continue
                if key in _JSON_VALUED_KEYS and isinstance(child, (Mapping, list)):
                    total += _json_characters(child)
                elif key in _SKIPPED_KEYS or key.endswith("_id"):
                    continue
                elif key == "data":
                    media_type = item.get("media_type")
                    if isinstance(media_type, str) and media_type.startswith("text/"):
                        stack.append(child)
                else:
                    stack.append(child)
    return total


def prompt_characters(body: Mapping[str, Any]) -> int:
    """Characters of everything a request sends the model: `messages` (every content part,
    tool calls and tool results included), `system`, `instructions`, `prompt`, `input`
    (Responses, embeddings), `suffix`, and the JSON of `tools`, `functions`,
    `response_format` and `text` (the Responses API's output schema). Images, audio and
    files are not counted (their size in base64 says little of their tokens)."""
    characters = 0
    for key in _TEXT_FIELDS:
        if key in body:
            characters += _text_characters(body.get(key))
    for key in _JSON_FIELDS:
        value = body.get(key)
        if value is not None and isinstance(value, (dict, list, Mapping)):
            characters += _json_characters(value)
    return characters


def parse_token_count(field: str, value: object) -> int:
    """A count as the upstream reads it: an int >= 1, an integral float (50000.0) or a
    numeric string ("50000", " 50_000 ", "50000.0"); anything else (booleans, 0, negatives,
    fractions, "5e4", objects) raises InvalidTokenCount. Clamped to MAX_LIMIT."""
    count: int | None = None
    if isinstance(value, bool):
        count = None
    elif isinstance(value, int):
        count = value
    elif isinstance(value, float):
        count = int(value) if math.isfinite(value) and value.is_integer() else None
    elif isinstance(value, str) and len(value) <= 2 * _MAX_COUNT_DIGITS:
        match = _COUNT_TEXT.fullmatch(value)
        if match is not None and len(match.group(1)) <= _MAX_COUNT_DIGITS:
            count = int(match.group(1).replace("_", ""))
    if count is None or count < 1:
        raise InvalidTokenCount(field, value)
    return min(count, MAX_LIMIT)


def requested_completion_tokens(body: Mapping[str, Any], default_max_tokens: int) -> int:
    """The completion tokens a request may spend: the largest of `max_completion_tokens`,
    `max_tokens` and `max_output_tokens` it names (parse_token_count; null is absent), else
    `default_max_tokens`; times `n` choices. Raises InvalidTokenCount."""
    named = [parse_token_count(key, body[key])
             for key in ("max_completion_tokens", "max_tokens", "max_output_tokens")
             if body.get(key) is not None]
    choices = parse_token_count("n", body["n"]) if body.get("n") is not None else 1
    return min((max(named) if named else default_max_tokens) * choices, MAX_LIMIT)


_UNREADABLE = object()  # a body too large or too deeply nested to decode


def _decode(body: bytes | bytearray | Mapping[str, Any]) -> object:
    """The decoded request body; None when it is not JSON; _UNREADABLE when it is too
    large (MAX_REQUEST_JSON_BYTES) or too deeply nested for the decoder. Never raises."""
    if isinstance(body, Mapping):
        return body
    if not body:
        return None
    if len(body) > MAX_REQUEST_JSON_BYTES:
        return _UNREADABLE
    try:
        return json.loads(body)
    except RecursionError:
        return _UNREADABLE
    except (ValueError, TypeError):
        return None


def json_object(body: bytes | bytearray | Mapping[str, Any]) -> Mapping[str, Any]:
    """A request body as a JSON object; {} when it is not one (not JSON, another JSON
    value, too large or too deep). Never raises."""
    parsed = _decode(body)
    return parsed if isinstance(parsed, Mapping) else {}


def requested_model(body: bytes | bytearray | Mapping[str, Any]) -> str | None:
    """The request's `model` (an OpenAI- or Anthropic-shaped body), when it is a non-empty
    str of at most 256 characters. Bounded: a body over MAX_REQUEST_JSON_BYTES is not
    decoded, one nested deeper than the decoder goes is not read (None); never raises."""
    model = json_object(body).get("model")
    return model if isinstance(model, str) and 0 < len(model) <= 256 else None


def prompt_tokens(body: bytes | bytearray | Mapping[str, Any]) -> int:
    """The prompt's tokens as the estimate counts them: prompt_characters / 4, rounded up.
    A body too large or too deep to decode counts every byte as a character."""
    parsed = _decode(body)
    if parsed is _UNREADABLE:
        assert isinstance(body, (bytes, bytearray))
        characters = len(body)
    else:
        characters = prompt_characters(parsed) if isinstance(parsed, Mapping) else 0
    return math.ceil(characters / CHARACTERS_PER_TOKEN)


def estimate_openai_tokens(body: bytes | bytearray | Mapping[str, Any], default_max_tokens: int) -> int:
    """The default token estimate of a request: what it may spend on the completion
    (requested_completion_tokens) plus its prompt (prompt_tokens); at least 1, at most
    MAX_LIMIT. A body that is not a JSON object counts as an empty prompt asking for the
    default. Raises InvalidTokenCount (a ValueError) for a maximum the upstream refuses."""
    parsed = _decode(body)
    document = parsed if isinstance(parsed, Mapping) else {}
    completion = requested_completion_tokens(document, default_max_tokens)
    return min(max(1, prompt_tokens(body if parsed is _UNREADABLE else document) + completion),
               MAX_LIMIT)


# --- the response ----------------------------------------------------------------------


_count = usage_count  # what a count in a usage is: one rule, the prices' (an int >= 0)


def usage_total(usage: object) -> int | None:
    """The tokens a `usage` object bills: its total_tokens (OpenAI chat completions and
    Responses), else the sum of the counts it has among prompt_tokens, completion_tokens,
    input_tokens, output_tokens, cache_creation_input_tokens and cache_read_input_tokens
    (Anthropic, whose input_tokens leaves the cache out). None when it has none. Clamped to
    MAX_LIMIT (and logged)."""
    if not isinstance(usage, Mapping):
        return None
    total = _count(usage.get("total_tokens"))
    if total is None:
        parts = [found for key in ("prompt_tokens", "completion_tokens", *_ANTHROPIC_FIELDS)
                 if (found := _count(usage.get(key))) is not None]
        if not parts:
            return None
        total = sum(parts)
    return clamp(total, "a reported usage")


def total_tokens_of(document: object) -> int | None:
    """The billed total of a decoded response or final stream event: its `usage`
    (chat completions, Responses, Anthropic), or its `response.usage` (a Responses
    stream's response.completed). None when it reports none."""
    if not isinstance(document, Mapping):
        return None
    if "usage" in document:
        return usage_total(document.get("usage"))
    response = document.get("response")
    return usage_total(response.get("usage")) if isinstance(response, Mapping) else None


def _delta_characters(document: Mapping[str, Any]) -> int:
    """Characters of generated text in one stream event: a chat chunk's choices' delta
    (content, reasoning, tool call arguments) or a completion's text; a Responses
    `*.delta` event's delta (output text, function call arguments, reasoning summary; not
    audio); an Anthropic content_block_delta (text, thinking, partial_json)."""
    choices = document.get("choices")
    if isinstance(choices, list):
        return sum(_text_characters(choice.get("delta")) + _text_characters(choice.get("text"))
                   for choice in choices if isinstance(choice, Mapping))
    kind = document.get("type")
    if kind == "content_block_delta":
        return _text_characters(document.get("delta"))
    if (isinstance(kind, str) and kind.startswith("response.") and kind.endswith(".delta")
            and kind != "response.audio.delta"):
        delta = document.get("delta")
        return len(delta) if isinstance(delta, str) else 0
    return 0


def _may_carry_usage(data: str) -> bool:
    """Whether a stream event may carry usage: it names "usage", and not only as the
    `"usage": null` of every OpenAI chunk before the last (a quote inside a JSON string is
    escaped, so text cannot fake the key)."""
    named = data.count('"usage"')
    return named > data.count('"usage": null') + data.count('"usage":null')


class ServerSentEvent(NamedTuple):
    """One event of a text/event-stream, as the standard dispatches it: its type ("message"
    unless an `event` field named one), its data (the `data` fields joined with LF) and the
    stream's last event ID when it was dispatched."""

    type: str
    data: str
    last_event_id: str


_BOM = b"\xef\xbb\xbf"


class EventStreamParser:
    """The event stream interpretation of the WHATWG HTML standard ("Server-sent events"),
    incrementally: `feed` any chunk of the stream's bytes (split anywhere, a CRLF or a UTF-8
    character included) and get the events it completed.

    - a line ends at CRLF, LF or a bare CR; one UTF-8 BOM at the start of the stream is dropped;
    - a line starting with ':' is a comment; `name:value` is a field (one space after the
      colon is dropped), a line without a colon is a field with an empty value;
    - `data` lines are joined with LF; `event` names the type; `id` sets the last event ID
      (not when it holds a NUL); `retry` (ASCII digits only) sets `retry`; other fields are
      ignored;
    - a blank line dispatches the event, when it had data; the type is reset, the ID kept.
    The bytes are decoded as UTF-8, an invalid sequence read as U+FFFD.

    Bounded: a line, or the data of one event, longer than max_event_bytes is not kept, and
    that event is skipped (the next one is read as usual). An event left unfinished when the
    stream ends is not dispatched (the standard drops it): `end()` returns it for a caller
    that wants it."""

    __slots__ = ("max_event_bytes", "retry", "last_event_id", "skipped", "_line", "_after_cr",
                 "_at_start", "_skipping_line", "_data", "_data_size", "_oversized", "_type")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self.retry: int | None = None  # the reconnection time the stream asked for, in ms
        self.last_event_id = ""
        self.skipped = 0  # events too long to keep
        self._line = bytearray()  # the unfinished last line (at the start: a partial BOM)
        self._after_cr = False  # the last line ended at a CR: an LF next is its CRLF's
        self._at_start = True  # the BOM is not decided yet
        self._skipping_line = False  # the rest of a line too long to keep
        self._data: list[bytes] = []
        self._data_size = 0
        self._oversized = False
        self._type = b""

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[ServerSentEvent]:
        """The events this chunk completed, in order."""
        data = bytes(chunk)
        if self._at_start:
            self._line += data
            if len(self._line) < len(_BOM) and _BOM.startswith(self._line):
                return []  # maybe a BOM, not all of it yet
            self._at_start = False
            data = bytes(self._line[len(_BOM):] if self._line.startswith(_BOM) else self._line)
            self._line = bytearray()
        if self._after_cr and data:
            self._after_cr = False
            if data[0] == 0x0A:  # the LF of a CRLF split between two chunks
                data = data[1:]
        if not data:
            return []
        # bytes.splitlines ends a line at LF, CRLF or CR, exactly the standard's line ends.
        lines = data.splitlines()
        last = data[-1]
        self._after_cr = last == 0x0D
        tail = lines.pop() if last != 0x0A and last != 0x0D else b""  # an unfinished line
        events: list[ServerSentEvent] = []
        if lines and (self._line or self._skipping_line):  # the end of the line under way
            if self._skipping_line:
                self._skipping_line = False  # the end of a line too long to keep
                del lines[0]
            else:
                self._line += lines[0]
                lines[0] = bytes(self._line)
                self._line = bytearray()
        for line in lines:
            if line:
                self._process(line)
            else:
                event = self._dispatch()
                if event is not None:
                    events.append(event)
        if tail and not self._skipping_line:
            self._line += tail
            if len(self._line) > self.max_event_bytes:
                self._line, self._skipping_line, self._oversized = bytearray(), True, True
        return events

    def end(self) -> ServerSentEvent | None:
        """The end of the stream: the event it left unfinished (its last line included, when
        that has no line end), as if a blank line had closed it, or None. The standard drops
        that event; the parser is ready for a new stream's events after this."""
        line, skipping = bytes(self._line), self._skipping_line
        self._line, self._skipping_line, self._after_cr = bytearray(), False, False
        self._at_start = False  # (a stream of less than a BOM: its bytes are a line)
        if line and not skipping:
            self._process(line)
        return self._dispatch()

    def _process(self, line: bytes) -> None:
        """One line that is not blank: a comment or a field."""
        if len(line) > self.max_event_bytes:  # whatever it is, as when it came in pieces
            self._oversized = True
            return
        if line[0] == 0x3A:  # ":", a comment
            return
        name, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            if not self._oversized:
                self._data_size += len(value) + 1
                if self._data_size > self.max_event_bytes:
                    self._oversized, self._data = True, []
                else:
                    self._data.append(value)
        elif name == b"event":
            self._type = value
        elif name == b"id":
            if b"\x00" not in value:
                self.last_event_id = value.decode("utf-8", "replace")
        elif name == b"retry":
            if value.isdigit():  # ASCII digits only (bytes.isdigit)
                digits = value.lstrip(b"0") or b"0"
                if len(digits) <= 18:  # longer: no time a stream could wait
                    self.retry = int(digits)

    def _dispatch(self) -> ServerSentEvent | None:
        data, kind, oversized = self._data, self._type, self._oversized
        self._data, self._data_size, self._oversized, self._type = [], 0, False, b""
        if oversized:
            self.skipped += 1
            return None
        if not data:
            return None
        return ServerSentEvent(kind.decode("utf-8", "replace") or "message",
                               b"\n".join(data).decode("utf-8", "replace"), self.last_event_id)


class UsageScanner:
    """Reads the usage of a response as its body passes. `feed` each body chunk (the caller
    forwards the chunk itself at once), then `total_tokens()`.

    "json": a copy of the body is kept up to MAX_JSON_BYTES and decoded at the end.
    "sse": the body is read as the standard's event stream (EventStreamParser: CR, LF or
    CRLF line ends, comments, multi-line data joined with LF, an event ends at a blank line),
    keeping only the event under way (at most MAX_EVENT_BYTES); the data of every event that
    may carry usage is decoded: the last OpenAI chunk carrying usage, a Responses final event
    (response.completed), or Anthropic's message_start updated by message_delta. `done`
    turns true at the end of the stream's events (the event `[DONE]`, Anthropic's
    message_stop, Responses' final event): the usage is final there and can be acted on
    before that chunk is passed on. An event the stream leaves unfinished at its end (no
    blank line after it) is still read by total_tokens(): the upstream billed it.

    count_streamed=True (an "sse" scanner) also counts the text the stream delivered, for
    streamed_tokens(): what an interrupted stream spent."""

    __slots__ = ("kind", "done", "count_streamed", "_parts", "_size", "_overflow", "_events",
                 "_total", "_anthropic", "_delta_characters", "_delta_events", "_usage")

    def __init__(self, kind: str, *, count_streamed: bool = False) -> None:
        if kind not in ("json", "sse"):
            raise ValueError(f"kind must be 'json' or 'sse', got {kind!r}")
        self.kind = kind
        self.done = False
        self.count_streamed = count_streamed
        self._parts: list[bytes] = []
        self._size = 0
        self._overflow = False
        self._events = EventStreamParser()
        self._total: int | None = None
        self._anthropic: dict[str, int] = {}  # usage counts of message_start / message_delta
        self._delta_characters = 0
        self._delta_events = 0
        self._usage: Mapping[str, Any] | None = None  # the usage object the total came from

    @classmethod
    def for_response(cls, content_type: str, content_encoding: str = "", *,
                     count_streamed: bool = False) -> UsageScanner | None:
        """A scanner for a response of this media type, or None when its usage cannot be
        read (another media type, or a compressed body)."""
        if content_encoding.strip().lower() not in ("", "identity"):
            return None
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type == "text/event-stream":
            return cls("sse", count_streamed=count_streamed)
        if media_type == "application/json" or media_type.endswith("+json"):
            return cls("json")
        return None

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self.kind == "json":
            if self._overflow:
                return
            self._size += len(chunk)
            if self._size > MAX_JSON_BYTES:
                self._overflow, self._parts = True, []
            else:
                self._parts.append(bytes(chunk))
            return
        for event in self._events.feed(chunk):
            self._event_data(event.data)

    def _event_data(self, data: str) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        if not (self.count_streamed or '"message_stop"' in data or _may_carry_usage(data)):
            return
        try:
            document = json.loads(data)
        except (ValueError, RecursionError):
            return
        if isinstance(document, Mapping):
            self._event(document)

    def _event(self, document: Mapping[str, Any]) -> None:
        kind = document.get("type")
        if self.count_streamed:
            characters = _delta_characters(document)
            if characters:
                self._delta_characters += characters
                self._delta_events += 1
        if kind == "message_start":  # Anthropic: the input counts (output so far: 1 or so)
            message = document.get("message")
            usage = message.get("usage") if isinstance(message, Mapping) else None
            self._anthropic_usage(usage)
        elif kind == "message_delta":  # Anthropic: cumulative counts, the output's final
            self._anthropic_usage(document.get("usage"))
            total = usage_total(self._anthropic)
            if total is not None:
                self._total, self._usage = total, dict(self._anthropic)
        elif kind == "message_stop":
            self.done = True
        elif kind in _RESPONSE_FINAL_EVENTS:  # OpenAI Responses
            response = document.get("response")
            self._found(response.get("usage") if isinstance(response, Mapping) else None)
            self.done = True
        elif "usage" in document:  # OpenAI chat completions / completions
            self._found(document.get("usage"))

    def _found(self, usage: object) -> None:
        total = usage_total(usage)
        if total is not None:
            assert isinstance(usage, Mapping)
            self._total, self._usage = total, usage

    def _anthropic_usage(self, usage: object) -> None:
        if isinstance(usage, Mapping):
            for key in _ANTHROPIC_FIELDS:
                found = _count(usage.get(key))
                if found is not None:
                    self._anthropic[key] = found

    def total_tokens(self) -> int | None:
        """The billed total found, or None (none reported, a stream cut before its final
        usage, or a body too large to read). At most MAX_LIMIT."""
        if self.kind == "json":
            if self._overflow or not self._parts:
                return None
            try:
                document = json.loads(b"".join(self._parts))
            except (ValueError, RecursionError):
                return None
            if isinstance(document, Mapping):
                usage = document.get("usage") if "usage" in document else (
                    document["response"].get("usage")
                    if isinstance(document.get("response"), Mapping) else None)
                if usage_total(usage) is not None:
                    self._usage = usage
            return total_tokens_of(document)
        unfinished = self._events.end()  # a last event without its blank line
        if unfinished is not None:
            self._event_data(unfinished.data)
        return self._total

    def token_usage(self, prompt_tokens: int = 0) -> TokenUsage | None:
        """The usage by billed kind (prices.TokenUsage) of the total total_tokens() or
        streamed_tokens() found (call one of them first): the reported usage object; for an
        interrupted stream charged what it streamed, the input it reported (else
        prompt_tokens) and the text delivered as output. None: no kinds are known."""
        if self._usage is not None:
            return TokenUsage.from_usage(self._usage)
        if self.kind != "sse" or not self.count_streamed:
            return None
        reported = TokenUsage.from_usage(self._anthropic) if self._anthropic else None
        output = max(math.ceil(self._delta_characters / CHARACTERS_PER_TOKEN), self._delta_events)
        output = min(output, MAX_LIMIT)
        if reported is not None:
            return TokenUsage(reported.input, reported.cached_input, reported.cache_write, output)
        return TokenUsage(input=min(max(0, prompt_tokens), MAX_LIMIT), output=output)

    def streamed_tokens(self, prompt_tokens: int = 0) -> int | None:
        """What an interrupted stream spent, for a policy that charges it: the reported
        total when the stream got that far; else the input the stream reported (Anthropic's
        message_start), or prompt_tokens when it reported none, plus the text delivered
        (its characters / 4, rounded up, and at least one token per event that carried
        text). None for a scanner made without count_streamed (or a JSON one)."""
        total = self.total_tokens()
        if total is not None:
            return total
        if self.kind != "sse" or not self.count_streamed:
            return None
        reported = [self._anthropic[key] for key in _ANTHROPIC_INPUT_FIELDS if key in self._anthropic]
        spent_input = sum(reported) if reported else max(0, prompt_tokens)
        output = max(math.ceil(self._delta_characters / CHARACTERS_PER_TOKEN), self._delta_events)
        return clamp(spent_input + output, "a streamed usage")
