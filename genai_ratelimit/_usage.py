"""Token usage: the default estimate of an OpenAI-shaped request, and finding the usage an
OpenAI-shaped response reports (JSON `usage.total_tokens`, or the last server-sent event
carrying `usage` in a stream) as its bytes pass, without holding the stream back.

No FastAPI here: bytes in, numbers out."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["estimate_openai_tokens", "prompt_characters", "requested_completion_tokens",
           "UsageScanner", "total_tokens_of"]

# A JSON response body is kept (a copy, the response itself is not held) up to this size to
# read its usage; a larger one is passed through unread and its reservation kept.
MAX_JSON_BYTES = 4 * 1024 * 1024
# One server-sent event line longer than this is skipped (a usage chunk is a few hundred bytes).
MAX_EVENT_LINE_BYTES = 1024 * 1024


def _text_length(content: object) -> int:
    """Characters of a message's content: a str, or a list of parts ({"type": "text",
    "text": ...}); other parts (images, audio) are not counted."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(_text_length(part.get("text")) if isinstance(part, Mapping) else _text_length(part)
                   for part in content)
    return 0


def prompt_characters(body: Mapping[str, Any]) -> int:
    """Characters of the prompt of an OpenAI-shaped request: the content of its `messages`
    (chat), its `prompt` (completions) and its `input` (responses, embeddings)."""
    characters = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        characters += sum(_text_length(m.get("content")) for m in messages if isinstance(m, Mapping))
    for key in ("prompt", "input"):
        characters += _text_length(body.get(key))
    return characters


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def requested_completion_tokens(body: Mapping[str, Any], default_max_tokens: int) -> int:
    """The completion tokens a request may spend: `max_completion_tokens`, else `max_tokens`
    (else `max_output_tokens`), else `default_max_tokens`; times `n` choices."""
    maximum = next((found for key in ("max_completion_tokens", "max_tokens", "max_output_tokens")
                    if (found := _positive_int(body.get(key))) is not None), default_max_tokens)
    return maximum * (_positive_int(body.get("n")) or 1)


def json_object(body: bytes | Mapping[str, Any]) -> Mapping[str, Any]:
    """A request body as a JSON object; {} when it is not one."""
    if isinstance(body, (bytes, bytearray)):
        try:
            parsed: object = json.loads(body) if body else None
        except ValueError:
            parsed = None
        return parsed if isinstance(parsed, Mapping) else {}
    return body


def requested_model(body: bytes | Mapping[str, Any]) -> str | None:
    """The request's `model` (an OpenAI- or Anthropic-shaped body), when it is a non-empty str."""
    model = json_object(body).get("model")
    return model if isinstance(model, str) and model else None


def estimate_openai_tokens(body: bytes | Mapping[str, Any], default_max_tokens: int) -> int:
    """The default token estimate of a request: what it may spend on the completion
    (requested_completion_tokens) plus the prompt's characters / 4, rounded up; at least 1.
    A body that is not a JSON object counts as an empty prompt asking for the default."""
    body = json_object(body)
    prompt_tokens = math.ceil(prompt_characters(body) / 4)
    return max(1, prompt_tokens + requested_completion_tokens(body, default_max_tokens))


def total_tokens_of(document: object) -> int | None:
    """`usage.total_tokens` of a decoded response or chunk, when it is an int >= 0."""
    if not isinstance(document, Mapping):
        return None
    usage = document.get("usage")
    if not isinstance(usage, Mapping):
        return None
    total = usage.get("total_tokens")
    return total if isinstance(total, int) and not isinstance(total, bool) and total >= 0 else None


class UsageScanner:
    """Reads the usage of a response as its body passes. `feed` each body chunk (the caller
    forwards the chunk itself at once), then `total_tokens()`.

    "json": a copy of the body is kept up to MAX_JSON_BYTES and decoded at the end.
    "sse": only the unfinished last line is kept; every `data:` line that mentions "usage"
    is decoded, and the last one carrying usage.total_tokens wins (OpenAI sends usage in the
    final chunk when the request asked stream_options={"include_usage": true}). `done` turns
    true at the stream's `data: [DONE]` line: OpenAI's clients stop reading there, so the
    usage is final and can be acted on before that chunk is passed on."""

    __slots__ = ("kind", "done", "_parts", "_size", "_overflow", "_line", "_skipping_line", "_total")

    def __init__(self, kind: str) -> None:
        if kind not in ("json", "sse"):
            raise ValueError(f"kind must be 'json' or 'sse', got {kind!r}")
        self.kind = kind
        self.done = False
        self._parts: list[bytes] = []
        self._size = 0
        self._overflow = False
        self._line = b""
        self._skipping_line = False
        self._total: int | None = None

    @classmethod
    def for_response(cls, content_type: str, content_encoding: str = "") -> UsageScanner | None:
        """A scanner for a response of this media type, or None when its usage cannot be
        read (another media type, or a compressed body)."""
        if content_encoding.strip().lower() not in ("", "identity"):
            return None
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type == "text/event-stream":
            return cls("sse")
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
        data = self._line + bytes(chunk)
        *lines, self._line = data.split(b"\n")
        for line in lines:
            if self._skipping_line:
                self._skipping_line = False  # the end of a line too long to keep
                continue
            self._event_line(line.rstrip(b"\r"))
        if len(self._line) > MAX_EVENT_LINE_BYTES:
            self._line, self._skipping_line = b"", True

    def _event_line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        if line[5:].strip() == b"[DONE]":
            self.done = True
            return
        if b'"usage"' not in line:
            return
        try:
            total = total_tokens_of(json.loads(line[5:]))
        except ValueError:
            return
        if total is not None:
            self._total = total

    def total_tokens(self) -> int | None:
        """The usage found, or None (none reported, or a body too large to read)."""
        if self.kind == "json":
            if self._overflow or not self._parts:
                return None
            try:
                return total_tokens_of(json.loads(b"".join(self._parts)))
            except ValueError:
                return None
        if self._line and not self._skipping_line:  # a last line without its newline
            self._event_line(self._line.rstrip(b"\r"))
            self._line = b""
        return self._total
