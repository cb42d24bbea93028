"""RateLimitHeadersMiddleware: headers, 429 bodies, reconcile and release as the response passes."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._answer import _SCOPE_KEY, _AllowedDecision
from ._ledger import _IN_FLIGHT_KEY, _LEASES_KEY, _TOKENS_KEY, _LeaseLedger, _TokenLedger
from ._startup import checking_startup
from ._usage import UsageScanner

logger = logging.getLogger("genai_ratelimit")


class RateLimitHeadersMiddleware:
    """Pure ASGI middleware: adds the X-RateLimit-* headers of an allowed request to whatever
    response the route produced (StreamingResponse and JSONResponse included). A header the
    response already has (a 429's own, or one the route set) is left as it is.

        app.add_middleware(RateLimitHeadersMiddleware)

    For a TokenRateLimit it also adds OpenAI's x-ratelimit-*-requests/-tokens headers, gives
    its 429 the OpenAI-style body (the contract's `detail` plus an `error` object), and
    reconciles the token reservation with the usage the response reports: a JSON body's
    `usage.total_tokens`, or a server-sent event stream's last `data:` chunk carrying `usage`.
    Each chunk is forwarded as it comes (a stream is scanned, never held back); the
    reconcile runs before the response's last body message (or the stream's `data: [DONE]`
    chunk) is passed on, so a client that has read the whole response sees the corrected
    budget. Unless the route already called
    record_usage: each request is reconciled at most once. No usage found: the reservation
    stays as it was (never a silent refund).

    When the server starts the app (the ASGI lifespan), it runs the start-up checks of the
    app's rate-limit dependencies (two budgets on the same keys: see rate_limit_lifespan):
    a misconfigured app does not start, with or without rate_limit_lifespan.

    It also releases the in-flight leases of RateLimit's max_in_flight: once the response's
    last body message is due (before it is passed on), or when the app ends without one (a
    client that disconnected mid-stream, an exception, a cancelled task). max_in_flight
    needs this middleware.

    A refusal (429, or 503 when Redis cannot decide) owns its response: the middleware
    writes its status, headers and body itself, whatever exception handlers the app
    registered (an app-wide `@app.exception_handler(HTTPException)` included). An app that
    wants its own error envelope passes `error_envelope(status, body) -> JSON value`; the
    headers (Retry-After, retry-after-ms, x-should-retry, X-RateLimit-*) are kept:

        app.add_middleware(RateLimitHeadersMiddleware,
                           error_envelope=lambda status, body: {"ok": False, "error": body})
    """

    _rate_limit_headers = True  # the start-up checks' mark (_startup.has_headers_middleware)

    def __init__(self, app: ASGIApp, *,
                 error_envelope: Callable[[int, dict[str, Any]], Any] | None = None) -> None:
        if error_envelope is not None and not callable(error_envelope):
            raise TypeError("error_envelope must be a callable (status, body) -> JSON value")
        self.app = app
        self.error_envelope = error_envelope

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            # The server starts the app: the start-up checks run first (_startup).
            await self.app(scope, checking_startup(scope, receive, send), send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        decision = _AllowedDecision(middleware=True)
        scope[_SCOPE_KEY] = decision
        ledger = _TokenLedger(middleware=True)
        scope[_TOKENS_KEY] = ledger
        leases = _LeaseLedger()
        scope[_LEASES_KEY] = leases
        running: dict[int, Callable[[], None]] = {}  # the in-flight gauges this request is in
        scope[_IN_FLIGHT_KEY] = running
        scanner: UsageScanner | None = None
        replaced_body = False  # a TokenRateLimit 429 whose body this middleware wrote

        async def send_with_headers(message: Message) -> None:
            nonlocal scanner, replaced_body
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                extra = decision.raw_headers()
                if extra:
                    present = {bytes(name).lower() for name, _ in headers}
                    headers += [(name, value) for name, value in extra if name not in present]
                    message = {**message, "headers": headers}
                if ledger.refusal is not None:
                    # Our refusal owns the response: its status, headers and body, whatever an
                    # exception handler of the app made of it (only the body's shape is the
                    # app's to choose: error_envelope).
                    status, refusal_headers, refusal_body = ledger.refusal
                    envelope = refusal_body if self.error_envelope is None else \
                        self.error_envelope(status, refusal_body)
                    body = json.dumps(envelope).encode()
                    own = {name.lower().encode("latin-1"): value.encode("latin-1")
                           for name, value in refusal_headers.items()}
                    headers = [(name, value) for name, value in headers
                               if bytes(name).lower() not in own and bytes(name).lower()
                               not in (b"content-length", b"content-type")]
                    headers += [*own.items(), (b"content-length", str(len(body)).encode()),
                                (b"content-type", b"application/json")]
                    await send({**message, "status": status, "headers": headers})
                    await leases.release_all()
                    await send({"type": "http.response.body", "body": body, "more_body": False})
                    replaced_body = True
                    return
                if ledger.entries and not ledger.reported:
                    content_type = content_encoding = ""
                    for name, value in headers:  # the last of each, as a dict of them keeps
                        lowered = bytes(name).lower()
                        if lowered == b"content-type":
                            content_type = bytes(value).decode("latin-1")
                        elif lowered == b"content-encoding":
                            content_encoding = bytes(value).decode("latin-1")
                    scanner = UsageScanner.for_response(content_type, content_encoding,
                                                        count_streamed=ledger.charge_streamed)
            elif message["type"] == "http.response.body":
                if replaced_body:
                    return  # the 429 body FastAPI wrote, replaced by ours
                if scanner is not None:
                    scanner.feed(message.get("body", b""))
                    if scanner.done or not message.get("more_body", False):
                        # The end of the body, or of the stream's events ("data: [DONE]",
                        # where OpenAI's clients stop reading): reconcile before passing it on.
                        total = _usage_of(scanner, ledger)
                        kinds, scanner = scanner.token_usage(ledger.prompt_tokens), None
                        if total is not None and not ledger.reported:
                            ledger.reported = True
                            await ledger.reconcile(total, leases, kinds)
                if not message.get("more_body", False):
                    await leases.release_all()  # the response is complete: its slots are free
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            # No last body message went out (disconnected, failed, cancelled): a stream cut
            # short is charged what it streamed when its TokenRateLimit says so
            # (aborted_stream="streamed"), then the slots are released.
            if scanner is not None and ledger.charge_streamed and not ledger.reported:
                total = _usage_of(scanner, ledger)
                if total is not None:
                    ledger.reported = True
                    with anyio.CancelScope(shield=True):
                        await ledger.reconcile(total, leases, scanner.token_usage(ledger.prompt_tokens))
            await leases.release_all()
            for leave in running.values():  # the in-flight gauge: this request is over
                leave()


def _usage_of(scanner: UsageScanner, ledger: _TokenLedger) -> int | None:
    """The usage the response reported; else, for aborted_stream="streamed", what a stream
    streamed (UsageScanner.streamed_tokens), None otherwise (the reservation stays)."""
    if ledger.charge_streamed:
        return scanner.streamed_tokens(ledger.prompt_tokens)
    return scanner.total_tokens()

