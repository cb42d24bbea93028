"""A stand-in for the provider: answers /v1/chat/completions, /v1/responses and /v1/messages
in OpenAI's and Anthropic's shapes, as JSON or as a stream (server-sent events), with a usage
that it also records. For trying the gateway without an API key, and for its tests
(tests/test_gateway_example.py). A plain ASGI app, one process:

    uvicorn fake_upstream:app --app-dir examples/gateway --port 9000

- The answer is N words, N = the request's max_tokens / max_output_tokens / max_completion_tokens
  (at most 8; default 8). Usage: input = the request body's bytes / 10, output = N (Anthropic:
  plus 3 tokens read from the prompt cache). A chat stream carries its usage only when the
  request asks for it (stream_options.include_usage), as OpenAI's does.
- A model whose name has "slow" in it streams 500 words, one every 20 ms (10 s), or, not
  streamed, answers after 10 s; "error" answers 400, as a provider refuses a request it
  does not bill.
- Its answers carry the provider's own rate-limit headers (x-ratelimit-*,
  anthropic-ratelimit-*), which the gateway replaces with its own, and x-request-id.
- GET /report: what it answered, one record per request: the path, the API key it was given
  (Authorization or x-api-key), its Accept-Encoding, whether it streamed, the usage total it
  reported (what it "billed"), and the outcome: "completed", "disconnected" (the client left
  mid-stream) or "refused". GET /healthz: 200."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

RECORDS: list[dict[str, Any]] = []
_NUMBERS = itertools.count(1)
PROVIDER_HEADERS = [(b"x-ratelimit-limit-requests", b"10000"), (b"x-ratelimit-remaining-requests", b"9999"),
                    (b"anthropic-ratelimit-requests-limit", b"4000"), (b"x-request-id", b"req-fake")]


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path, method = scope["path"], scope["method"]
    if method == "GET" and path == "/healthz":
        await _json(send, 200, {"status": "ok"})
    elif method == "GET" and path == "/report":
        await _json(send, 200, RECORDS)
    elif method == "POST" and path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        await _answer(scope, receive, send, path)
    else:
        await _json(send, 404, {"error": {"message": f"no route {method} {path}", "type": "not_found"}})


async def _json(send: Send, status: int, data: object,
                headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(data).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def _answer(scope: Scope, receive: Receive, send: Send, path: str) -> None:
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    request = json.loads(body)
    headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
    bearer = headers.get("authorization", "").removeprefix("Bearer ")
    model = str(request.get("model", "fake-1"))
    slow = "slow" in model
    asked = (request.get("max_tokens") or request.get("max_output_tokens")
             or request.get("max_completion_tokens"))
    words = [f"w{i}" for i in range(500 if slow else min(int(asked or 8), 8))]
    number = next(_NUMBERS)
    record: dict[str, Any] = {
        "number": number, "path": path, "model": model, "api_key": headers.get("x-api-key") or bearer,
        "accept_encoding": headers.get("accept-encoding"), "stream": request.get("stream") is True,
        "include_usage": (request.get("stream_options") or {}).get("include_usage") is True,
        "total_tokens": 0, "outcome": "streaming"}
    RECORDS.append(record)
    if "error" in model:
        record["outcome"] = "refused"
        await _json(send, 400, {"error": {"message": f"The model `{model}` does not exist",
                                          "type": "invalid_request_error", "code": "model_not_found"}},
                    PROVIDER_HEADERS)
        return
    input_tokens, output_tokens = len(body) // 10, len(words)
    cache_read = 3 if path == "/v1/messages" else 0
    record["total_tokens"] = input_tokens + cache_read + output_tokens
    answer = {"/v1/chat/completions": _chat, "/v1/responses": _responses, "/v1/messages": _messages}[path]
    events = answer(f"{number}", model, words, input_tokens, output_tokens, record)
    gone = asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    watcher = asyncio.create_task(watch())
    try:
        if record["stream"]:
            await _stream(send, events, 0.02 if slow else 0.0, record, gone)
            return
        if slow:  # the whole answer takes 10 s to write, unless the client leaves first
            try:
                await asyncio.wait_for(gone.wait(), 10.0)
                record["outcome"] = "disconnected"
                return
            except asyncio.TimeoutError:
                pass
        record["outcome"] = "completed"
        await _json(send, 200, next(events), PROVIDER_HEADERS)
    finally:
        watcher.cancel()


async def _stream(send: Send, events: Any, pace: float, record: dict[str, Any], gone: asyncio.Event) -> None:
    """Sends the events, pausing `pace` s after each, until the client is `gone`."""
    try:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                                *PROVIDER_HEADERS]})
        for event in events:
            if gone.is_set():
                break
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            if pace:
                try:
                    await asyncio.wait_for(gone.wait(), pace)
                except asyncio.TimeoutError:
                    pass
        if gone.is_set():
            record["outcome"] = "disconnected"
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        record["outcome"] = "completed"
    except OSError:
        record["outcome"] = "disconnected"


def _sse(data: object, event: str | None = None) -> str:
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(data)}\n\n"


def _chat(number: str, model: str, words: list[str], input_tokens: int, output_tokens: int,
          record: dict[str, Any]) -> Any:
    usage = {"prompt_tokens": input_tokens, "completion_tokens": output_tokens,
             "total_tokens": input_tokens + output_tokens}
    base = {"id": f"chatcmpl-{number}", "created": 0, "model": model}
    if not record["stream"]:
        yield {**base, "object": "chat.completion", "usage": usage,
               "choices": [{"index": 0, "finish_reason": "stop",
                            "message": {"role": "assistant", "content": " ".join(words)}}]}
        return
    chunk = {**base, "object": "chat.completion.chunk"}
    for word in words:
        yield _sse({**chunk, "choices": [{"index": 0, "delta": {"content": word + " "},
                                          "finish_reason": None}]})
    yield _sse({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if record["include_usage"]:
        yield _sse({**chunk, "choices": [], "usage": usage})
    else:
        record["total_tokens"] = None  # billed, but the client was never told how much
    yield "data: [DONE]\n\n"


def _responses(number: str, model: str, words: list[str], input_tokens: int, output_tokens: int,
               record: dict[str, Any]) -> Any:
    text = " ".join(words)
    response = {"id": f"resp_{number}", "object": "response", "created_at": 0, "model": model,
                "status": "completed", "output": [
                    {"type": "message", "id": f"msg_{number}", "status": "completed", "role": "assistant",
                     "content": [{"type": "output_text", "text": text, "annotations": []}]}],
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                          "total_tokens": input_tokens + output_tokens,
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": 0}}}
    if not record["stream"]:
        yield response
        return
    started = {**response, "status": "in_progress", "output": [], "usage": None}
    yield _sse({"type": "response.created", "sequence_number": 0, "response": started}, "response.created")
    for index, word in enumerate(words, start=1):
        yield _sse({"type": "response.output_text.delta", "sequence_number": index,
                    "item_id": f"msg_{number}", "output_index": 0, "content_index": 0,
                    "delta": word + " "}, "response.output_text.delta")
    yield _sse({"type": "response.completed", "sequence_number": len(words) + 1, "response": response},
               "response.completed")


def _messages(number: str, model: str, words: list[str], input_tokens: int, output_tokens: int,
              record: dict[str, Any]) -> Any:
    usage = {"input_tokens": input_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 3,
             "output_tokens": output_tokens}
    message = {"id": f"msg_{number}", "type": "message", "role": "assistant", "model": model,
               "content": [{"type": "text", "text": " ".join(words)}], "stop_reason": "end_turn",
               "stop_sequence": None, "usage": usage}
    if not record["stream"]:
        yield message
        return
    started = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    yield _sse({"type": "message_start", "message": started}, "message_start")
    yield _sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
               "content_block_start")
    for word in words:
        delta = {"type": "text_delta", "text": word + " "}
        yield _sse({"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta")
    yield _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
    yield _sse({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": output_tokens}}, "message_delta")
    yield _sse({"type": "message_stop"}, "message_stop")
