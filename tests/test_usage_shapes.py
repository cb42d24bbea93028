"""genai_ratelimit.fastapi._usage, the I/O-free half of TokenRateLimit: what the estimate counts for
each API (every text the upstream bills), the maximum a request asks for as the upstream reads
it, and the usage every response shape reports (OpenAI chat completions, OpenAI Responses,
Anthropic Messages; JSON and streamed), absurd numbers included, and what an interrupted
stream spent. Pure unit tests: bytes in, numbers out (the wire shapes are the providers'
documented ones, copied field for field)."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import pytest

from genai_ratelimit._native import MAX_LIMIT
from genai_ratelimit.fastapi import _usage
from genai_ratelimit.fastapi._usage import (
    InvalidTokenCount,
    UsageScanner,
    estimate_openai_tokens,
    json_object,
    parse_token_count,
    prompt_tokens,
    requested_completion_tokens,
    requested_model,
    total_tokens_of,
)

LONG = "x" * 100_000  # the 100,000-character prompt: 25,000 tokens


def estimate(body: dict[str, Any], default: int = 1) -> int:
    return estimate_openai_tokens(json.dumps(body).encode(), default)


# --- what the estimate counts ----------------------------------------------------------


@pytest.mark.parametrize("body", [
    pytest.param({"system": LONG, "messages": [{"role": "user", "content": "hi"}]},
                 id="anthropic-system-str"),
    pytest.param({"system": [{"type": "text", "text": LONG, "cache_control": {"type": "ephemeral"}}]},
                 id="anthropic-system-blocks"),
    pytest.param({"instructions": LONG, "input": "hi"}, id="responses-instructions"),
    pytest.param({"input": LONG}, id="responses-input-str"),
    pytest.param({"input": [{"role": "user", "content": [{"type": "input_text", "text": LONG}]}]},
                 id="responses-input-items"),
    pytest.param({"input": [{"type": "function_call_output", "call_id": "c1", "output": LONG}]},
                 id="responses-tool-output"),
    pytest.param({"messages": [{"role": "tool", "tool_call_id": "c1", "content": LONG}]},
                 id="openai-tool-result"),
    pytest.param({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": LONG}]}]}]},
                 id="anthropic-tool-result"),
    pytest.param({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": LONG}}]}]},
                 id="openai-tool-call-arguments"),
    pytest.param({"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"query": LONG}}]}]},
                 id="anthropic-tool-use-input"),
    pytest.param({"tools": [{"type": "function", "function": {
        "name": "f", "description": LONG, "parameters": {"type": "object"}}}]}, id="openai-tools"),
    pytest.param({"tools": [{"name": "f", "description": "d", "input_schema": {
        "type": "object", "properties": {"q": {"type": "string", "description": LONG}}}}]},
                 id="anthropic-tools"),
    pytest.param({"functions": [{"name": "f", "description": LONG}]}, id="openai-functions"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {"description": LONG}}},
                 id="openai-response-format"),
    pytest.param({"messages": [{"role": "user", "content": [{"type": "text", "text": LONG[:50_000]},
                                                             {"type": "text", "text": LONG[:50_000]}]}]},
                 id="content-parts"),
    pytest.param({"prompt": [LONG[:50_000], LONG[:50_000]]}, id="completions-prompt-list"),
    pytest.param({"messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "text", "media_type": "text/plain", "data": LONG}}]}]}, id="anthropic-text-document"),
])
def test_every_billed_text_counts_in_the_estimate(body: dict[str, Any]) -> None:
    # The issue: a 100,000-character system prompt or tool list reserved 2 tokens.
    assert 25_000 <= estimate(body, default=1) - 1 <= 25_200


def test_the_estimate_of_a_chat_request_is_its_text_over_four_plus_its_maximum() -> None:
    body = {"max_completion_tokens": 100, "n": 2,
            "messages": [{"role": "system", "content": "abcd" * 10},
                         {"role": "user", "content": [{"type": "text", "text": "abcdefgh"},
                                                      {"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert estimate(body) == 200 + 12  # 48 characters: roles, types and the image URL are not text


def test_media_payloads_are_not_counted_as_text() -> None:
    image = "iVBORw0KGgo" * 100_000  # a megabyte of base64
    for part in ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}},
                 {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image}},
                 {"type": "input_audio", "input_audio": {"data": image, "format": "wav"}},
                 {"type": "file", "file": {"file_data": image, "filename": "a.pdf"}},
                 {"type": "input_image", "image_url": "data:image/png;base64," + image}):
        assert estimate({"messages": [{"role": "user", "content": [part]}], "max_tokens": 10}) < 20


def test_tool_schemas_count_as_their_json() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    compact = len(json.dumps(tools, separators=(",", ":")))
    assert abs(prompt_tokens({"tools": tools}) - math.ceil(compact / 4)) <= 3


def test_a_body_too_deep_to_decode_counts_every_byte() -> None:
    deep = b'{"model": "m", "messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    assert estimate_openai_tokens(deep, 10) == math.ceil(len(deep) / 4) + 10
    assert json_object(deep) == {}


def test_a_body_that_is_not_json_asks_for_the_default() -> None:
    assert estimate_openai_tokens(b"not json", 30) == 30
    assert estimate_openai_tokens(b"", 30) == 30
    assert estimate_openai_tokens(b"[1, 2]", 30) == 30
    assert estimate_openai_tokens(b"\xff\xfe", 30) == 30


# --- the maximum, as the upstream reads it ----------------------------------------------


@pytest.mark.parametrize("value", [50_000, 50_000.0, "50000", " 50000 ", "50_000", "+50000", "50000.0"])
def test_a_maximum_counts_as_the_upstream_reads_it(value: object) -> None:
    # The issue: "50000" and 50000.0, which pydantic and the upstream accept, reserved 1,001.
    assert estimate({"max_tokens": value}) == 50_000
    assert requested_completion_tokens({"max_output_tokens": value}, 1) == 50_000


@pytest.mark.parametrize("value", [True, False, 0, -5, 1.5, float("inf"), float("nan"), "5e4", "1.5",
                                   "0x10", "", "fifty", "-3", [], {}, "1" * 40])
def test_a_maximum_the_upstream_refuses_is_a_value_error(value: object) -> None:
    with pytest.raises(InvalidTokenCount, match="max_tokens must be a positive whole number") as caught:
        requested_completion_tokens({"max_tokens": value}, 1)
    assert isinstance(caught.value, ValueError)
    assert caught.value.field == "max_tokens"
    with pytest.raises(ValueError):
        estimate_openai_tokens(json.dumps({"max_tokens": value}).encode()
                               if not isinstance(value, float) or math.isfinite(value)
                               else b'{"max_tokens": 1e999}', 1)


def test_null_is_no_maximum_and_the_largest_named_one_wins() -> None:
    assert requested_completion_tokens({"max_tokens": None}, 300) == 300
    assert requested_completion_tokens({"max_completion_tokens": 10, "max_tokens": 5_000}, 1) == 5_000
    assert requested_completion_tokens({"max_tokens": "100", "n": "3"}, 1) == 300
    with pytest.raises(InvalidTokenCount, match="^n must"):
        requested_completion_tokens({"n": 0}, 1)


def test_an_absurd_maximum_is_clamped() -> None:
    assert parse_token_count("max_tokens", 10**30) == MAX_LIMIT
    assert estimate({"max_tokens": 2**60, "n": 100}) == MAX_LIMIT


# --- the model --------------------------------------------------------------------------


def test_the_model_lookup_never_raises() -> None:
    assert requested_model(b'{"model": "gpt-4o", "messages": []}') == "gpt-4o"
    assert requested_model({"model": "claude-x"}) == "claude-x"
    assert requested_model(b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}") is None
    assert requested_model(b'{"a":' * 100_000 + b"1" + b"}" * 100_000) is None
    assert requested_model(b'{"model": 5}') is None
    assert requested_model(b'{"model": ""}') is None
    assert requested_model(json.dumps({"model": "m" * 257}).encode()) is None
    assert requested_model(b"\xff") is None
    assert requested_model(b'{"model": 1' + b"0" * 5000 + b"}") is None  # int too long for Python


def test_the_model_of_a_body_over_the_size_bound_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_usage, "MAX_REQUEST_JSON_BYTES", 64)
    big = json.dumps({"model": "m", "input": "x" * 100}).encode()
    assert requested_model(big) is None
    assert estimate_openai_tokens(big, 1) == math.ceil(len(big) / 4) + 1  # every byte counts


# --- usage: every shape -----------------------------------------------------------------

OPENAI_CHAT_JSON = {
    "id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-4o",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12,
              "prompt_tokens_details": {"cached_tokens": 4}}}
OPENAI_RESPONSES_JSON = {
    "id": "resp_1", "object": "response", "status": "completed",
    "output": [{"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Hi", "annotations": []}]}],
    "usage": {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 5},
              "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 27}}
ANTHROPIC_JSON = {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4",
    "content": [{"type": "text", "text": "Hi"}], "stop_reason": "end_turn",
    "usage": {"input_tokens": 10, "cache_creation_input_tokens": 2_000,
              "cache_read_input_tokens": 30_000, "output_tokens": 50}}


def sse(*events: tuple[str | None, dict[str, Any] | str]) -> bytes:
    out = b""
    for name, data in events:
        if name is not None:
            out += f"event: {name}\n".encode()
        out += b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"
    return out


def chat_chunk(content: str | None, usage: dict[str, int] | None = None) -> dict[str, Any]:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}, "finish_reason": None}]
    return {"id": "c", "object": "chat.completion.chunk", "choices": choices, "usage": usage}


OPENAI_CHAT_STREAM = sse(
    (None, {**chat_chunk(""), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    (None, chat_chunk("Hello")), (None, chat_chunk(" world")),
    (None, chat_chunk(None, {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11})),
    (None, "[DONE]"))
OPENAI_RESPONSES_STREAM = sse(
    ("response.created", {"type": "response.created", "sequence_number": 0,
                          "response": {"id": "resp_1", "status": "in_progress", "usage": None}}),
    ("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "m", "output_index": 0,
                                    "content_index": 0, "delta": "Hello", "sequence_number": 1}),
    ("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "m", "output_index": 0,
                                    "content_index": 0, "delta": " world", "sequence_number": 2}),
    ("response.completed", {"type": "response.completed", "sequence_number": 3,
                            "response": {**OPENAI_RESPONSES_JSON}}))
ANTHROPIC_STREAM = sse(
    ("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "claude-sonnet-4",
        "stop_reason": None, "usage": {"input_tokens": 10, "cache_creation_input_tokens": 2_000,
                                       "cache_read_input_tokens": 30_000, "output_tokens": 1}}}),
    ("content_block_start", {"type": "content_block_start", "index": 0,
                             "content_block": {"type": "text", "text": ""}}),
    ("ping", {"type": "ping"}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": "Hello"}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": " world"}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                       "usage": {"output_tokens": 50}}),
    ("message_stop", {"type": "message_stop"}))


@pytest.mark.parametrize("document, total", [
    (OPENAI_CHAT_JSON, 12), (OPENAI_RESPONSES_JSON, 27), (ANTHROPIC_JSON, 32_060),
    ({"usage": {"input_tokens": 10, "output_tokens": 5}}, 15),  # Responses without a total
    ({"usage": {"prompt_tokens": 4}}, 4), ({"usage": None}, None), ({"error": {}}, None),
    ({"usage": {"total_tokens": -1}}, None), ({"usage": {"total_tokens": True}}, None),
    ({"usage": {"input_tokens": "10"}}, None), ([], None),
], ids=["openai-chat", "openai-responses", "anthropic-with-cache", "responses-no-total", "prompt-only",
        "null", "error", "negative", "bool", "string", "not-an-object"])
def test_the_billed_total_of_every_json_shape(document: object, total: int | None) -> None:
    assert total_tokens_of(document) == total
    scanner = UsageScanner.for_response("application/json")
    assert scanner is not None
    scanner.feed(json.dumps(document).encode())
    assert scanner.total_tokens() == total


@pytest.mark.parametrize("stream, total", [
    (OPENAI_CHAT_STREAM, 11), (OPENAI_RESPONSES_STREAM, 27), (ANTHROPIC_STREAM, 32_060),
], ids=["openai-chat", "openai-responses", "anthropic"])
@pytest.mark.parametrize("step", [1, 7, 1 << 20])
def test_the_billed_total_of_every_stream_and_its_end(stream: bytes, total: int, step: int) -> None:
    scanner = UsageScanner.for_response("text/event-stream; charset=utf-8")
    assert scanner is not None
    last_event = stream.rindex(b"data:")
    for start in range(0, len(stream), step):  # arbitrary chunk boundaries
        scanner.feed(stream[start:start + step])
        # Done at the blank line that ends the last event (the standard dispatches it there).
        assert scanner.done == (start + step > stream.index(b"\n\n", last_event) + 1)
    assert scanner.done  # [DONE], message_stop, response.completed: act before passing it on
    assert scanner.total_tokens() == total


def test_anthropic_message_delta_counts_are_cumulative_and_may_carry_the_input() -> None:
    scanner = UsageScanner("sse")
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 5, "output_tokens": 1}}}
    scanner.feed(sse((None, start),
                     (None, {"type": "message_delta", "usage": {"output_tokens": 10}}),
                     (None, {"type": "message_delta", "usage": {"input_tokens": 900, "output_tokens": 30,
                                                                "cache_read_input_tokens": 70}})))
    assert scanner.total_tokens() == 1_000


def test_an_anthropic_stream_cut_before_message_delta_has_no_final_usage() -> None:
    scanner = UsageScanner("sse")
    scanner.feed(ANTHROPIC_STREAM.split(b"event: message_delta")[0])
    assert scanner.total_tokens() is None  # message_start's output_tokens is not the output


@pytest.mark.parametrize("event", ["response.incomplete", "response.failed"])
def test_a_responses_stream_that_ends_otherwise_still_bills(event: str) -> None:
    scanner = UsageScanner("sse")
    scanner.feed(sse((event, {"type": event, "response": {"usage": {"input_tokens": 3, "output_tokens": 4,
                                                                       "total_tokens": 7}}})))
    assert scanner.done and scanner.total_tokens() == 7


# --- absurd numbers ---------------------------------------------------------------------


@pytest.mark.parametrize("usage", [
    {"total_tokens": 2**53}, {"total_tokens": 10**400},
    {"input_tokens": 2**52, "output_tokens": 2**52, "cache_read_input_tokens": 2**52},
])
def test_an_absurd_usage_is_clamped_and_logged(usage: dict[str, int],
                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="genai_ratelimit"):
        assert total_tokens_of({"usage": usage}) == MAX_LIMIT
        scanner = UsageScanner("sse")
        scanner.feed(sse((None, {"choices": [], "usage": usage}), (None, "[DONE]")))
        assert scanner.total_tokens() == MAX_LIMIT
    assert "above the most a budget can count" in caplog.text


def test_an_absurd_anthropic_stream_is_clamped() -> None:
    scanner = UsageScanner("sse")
    scanner.feed(sse((None, {"type": "message_start", "message": {"usage": {"input_tokens": 2**62}}}),
                     (None, {"type": "message_delta", "usage": {"output_tokens": 2**62}})))
    assert scanner.total_tokens() == MAX_LIMIT


def test_hostile_stream_lines_are_skipped() -> None:
    scanner = UsageScanner("sse", count_streamed=True)
    scanner.feed(b'data: {"usage": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n\n")
    scanner.feed(b'data: {"usage": {"total_tokens": 1' + b"0" * 5000 + b"}}\n\n")
    scanner.feed(b'data: "usage"\n\ndata: [1, "usage"]\n\ndata: {"usage": 5}\n\n')
    assert scanner.total_tokens() is None
    assert scanner.streamed_tokens(3) == 3


# --- an interrupted stream: what was streamed -------------------------------------------


def cut(stream: bytes, before: bytes) -> bytes:
    return stream[:stream.index(before)]


def test_an_interrupted_openai_chat_stream_spent_its_prompt_and_what_it_sent() -> None:
    scanner = UsageScanner.for_response("text/event-stream", count_streamed=True)
    assert scanner is not None
    scanner.feed(cut(OPENAI_CHAT_STREAM, b'data: {"id": "c", "object": "chat.completion.chunk", '
                                         b'"choices": [], '))
    assert scanner.total_tokens() is None
    # "Hello", " world": 11 characters, 3 tokens; two events that carried text.
    assert scanner.streamed_tokens(prompt_tokens=40) == 40 + 3


def test_an_interrupted_anthropic_stream_spent_the_input_it_reported() -> None:
    scanner = UsageScanner("sse", count_streamed=True)
    scanner.feed(cut(ANTHROPIC_STREAM, b"event: message_delta"))
    assert scanner.total_tokens() is None
    assert scanner.streamed_tokens(prompt_tokens=5) == 10 + 2_000 + 30_000 + 3


def test_an_interrupted_responses_stream_counts_its_deltas() -> None:
    scanner = UsageScanner("sse", count_streamed=True)
    scanner.feed(cut(OPENAI_RESPONSES_STREAM, b"event: response.completed"))
    assert scanner.streamed_tokens(prompt_tokens=0) == 3


def test_at_least_one_token_per_event_that_carried_text() -> None:
    scanner = UsageScanner("sse", count_streamed=True)
    scanner.feed(b"".join(sse((None, chat_chunk("\u4e16"))) for _ in range(10)))  # one CJK token each
    scanner.feed(sse((None, {"choices": [{"delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": '{"q": "abcdefghijklmnopqrstuvwx"}'}}]}}]})))
    thinking = {"type": "content_block_delta", "delta": {"type": "thinking_delta", "thinking": "abcd"}}
    scanner.feed(sse((None, thinking),
                     (None, {"type": "content_block_delta", "delta": {"type": "signature_delta",
                                                                      "signature": "s" * 400}}),
                     (None, {"type": "response.audio.delta", "delta": "A" * 400})))
    # 10 + 33 + 4 characters (the signature and the audio are not text): 12 tokens, 12 events.
    assert scanner.streamed_tokens() == 12
    scanner.feed(b"".join(sse((None, chat_chunk("\u4e16"))) for _ in range(8)))
    assert scanner.streamed_tokens() == 20  # 55 characters, but 20 events that carried text


def test_a_finished_stream_answers_its_reported_total() -> None:
    scanner = UsageScanner("sse", count_streamed=True)
    scanner.feed(OPENAI_CHAT_STREAM)
    assert scanner.streamed_tokens(prompt_tokens=1_000) == 11


def test_only_a_counting_stream_scanner_says_what_was_streamed() -> None:
    plain = UsageScanner("sse")
    plain.feed(OPENAI_CHAT_STREAM[:200])
    assert plain.streamed_tokens(5) is None  # the policy "keep the estimate" pays nothing
    assert UsageScanner("json").streamed_tokens(5) is None


def test_only_events_that_may_carry_usage_are_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[str] = []
    real_loads = json.loads
    quoting = sse((None, chat_chunk('say "usage": {"total_tokens": 5}')))  # the key, escaped in text
    monkeypatch.setattr(_usage.json, "loads", lambda data: decoded.append(data) or real_loads(data))
    scanner = UsageScanner("sse")
    scanner.feed(OPENAI_CHAT_STREAM)  # three chunks with "usage": null, then the usage chunk
    scanner.feed(quoting)
    assert scanner.total_tokens() == 11
    assert len(decoded) == 1 and '"total_tokens": 11' in decoded[0]
