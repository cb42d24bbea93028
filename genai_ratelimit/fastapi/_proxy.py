"""forward_to_upstream: what a gateway route does with a request its rate-limit dependencies
admitted. It sends the request to the upstream (an OpenAI-compatible or Anthropic API) with
the caller's httpx.AsyncClient and passes the upstream's answer back as it comes, streamed or
not, so that RateLimitHeadersMiddleware reads its usage on the way (the reconcile).

What it changes, and why:
- request: the hop-by-hop headers, Host and Content-Length (the new hop sets its own), and
  Accept-Encoding, replaced by `identity`: a compressed answer's usage cannot be read, and
  the body is passed on as it came (never decompressed, never re-encoded). A streamed chat
  completion (`/chat/completions` with `"stream": true`) gets
  `stream_options.include_usage = true`: without it OpenAI's stream carries no usage and the
  request keeps its whole estimate. (The Responses API and Anthropic's Messages report their
  usage in their stream's events already.)
- response: the status, the headers and the body are the upstream's, except the hop-by-hop
  headers, Date and Server (the gateway's HTTP server writes its own) and the rate-limit
  families the limiter writes (`x-ratelimit-*`, `anthropic-ratelimit-*`, `ratelimit`,
  `ratelimit-policy`): the client sees its own budget at the gateway, never the provider's
  account-wide one. Retry-After, retry-after-ms and x-should-retry of an upstream error stay.

What it tells the caps: the upstream's status and headers go to `observe_upstream` of the
limiter of every `Upstream` the request went through (docs/upstreams.md): the provider's
remaining requests and tokens, and a 429's retry-after, narrow or close that shared cap for
every replica.

What it charges: an upstream answer with a status >= 400 is reconciled to 0 tokens (the
providers bill no tokens for a refused request; it still counts as a request); so is an
upstream that could not be reached (502: nothing was sent). An upstream that timed out (504)
or broke off keeps the estimate: it may have generated, and billed, what was never delivered.

A client that goes away: while the upstream's answer is awaited, and then while it streams,
the server's `http.disconnect` is watched for; it stops the request at once and closes the
upstream response (its connection is closed, not returned to the pool: the upstream sees its
client leave and stops generating), whatever the ASGI server's spec version; the middleware
then releases the in-flight slot.

httpx is imported where it is used: `genai_ratelimit.fastapi` still imports without it."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from ._ledger import _TOKENS_KEY, _TokenLedger, record_usage
from ._scopes import observe_upstreams

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger("genai_ratelimit")

# RFC 9110 section 7.6.1: the headers of one connection, never forwarded.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"})
# Set anew for the upstream hop (accept-encoding: identity, see the module's docstring).
_REQUEST_SET_BY_HOP = frozenset({"host", "content-length", "accept-encoding"})
# Written by the gateway's own HTTP server (uvicorn would send both twice).
_RESPONSE_SET_BY_SERVER = frozenset({"date", "server"})
# The limiter's header families: the gateway's budget replaces the provider's.
_LIMITER_HEADER_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-")
_LIMITER_HEADERS = frozenset({"ratelimit", "ratelimit-policy"})


def _connection_tokens(headers: list[tuple[str, str]]) -> set[str]:
    """The header names a Connection header lists: hop-by-hop too (RFC 9110 7.6.1)."""
    return {token.strip().lower() for name, value in headers if name == "connection"
            for token in value.split(",") if token.strip()}


def upstream_request_headers(headers: list[tuple[str, str]],
                             replaced: Mapping[str, str | None] | None = None) -> list[tuple[str, str]]:
    """The client's request headers (lower-case names) as the upstream gets them; those named
    in `replaced` take its value instead (None: left out)."""
    replaced = {name.lower(): value for name, value in (replaced or {}).items()}
    dropped = HOP_BY_HOP | _REQUEST_SET_BY_HOP | _connection_tokens(headers) | set(replaced)
    return [(name, value) for name, value in headers if name not in dropped] + \
        [(name, value) for name, value in replaced.items() if value is not None] + \
        [("accept-encoding", "identity")]


def client_response_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The upstream's response headers (raw) as the client gets them."""
    lowered = [(name.lower(), value) for name, value in headers]
    listed = _connection_tokens([(name.decode("latin-1"), value.decode("latin-1"))
                                 for name, value in lowered])
    kept = []
    for (name, value), (lower, _) in zip(headers, lowered, strict=True):
        text = lower.decode("latin-1")
        if text in HOP_BY_HOP or text in _RESPONSE_SET_BY_SERVER or text in listed:
            continue
        if text in _LIMITER_HEADERS or text.startswith(_LIMITER_HEADER_PREFIXES):
            continue
        kept.append((name, value))
    return kept


def with_stream_usage(body: bytes) -> bytes:
    """A chat completions request body that asks for its stream's usage: when it is a JSON
    object with `"stream": true` and no `stream_options.include_usage` true yet, the same
    object with `stream_options.include_usage` set (its other stream_options kept). Any
    other body is returned as it is (the upstream judges it)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if not isinstance(data, dict) or data.get("stream") is not True:
        return body
    options = data.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict) or options.get("include_usage") is True:
        return body
    data["stream_options"] = {**options, "include_usage": True}
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def _error(status: int, code: str, message: str) -> JSONResponse:
    """An error both SDKs read: error.message and error.type (Anthropic's envelope, OpenAI's
    fields)."""
    return JSONResponse({"type": "error", "error": {"type": "api_error", "code": code,
                                                    "message": message}}, status_code=status)


async def _charge_nothing(request: Request) -> None:
    """Reconciles the request's TokenRateLimit reservation to 0, when it has one whose usage
    is not recorded yet (a route without a TokenRateLimit has nothing to reconcile)."""
    ledger = request.scope.get(_TOKENS_KEY)
    if isinstance(ledger, _TokenLedger) and ledger.decided and not ledger.reported:
        await record_usage(request, 0)


class UpstreamResponse(Response):
    """The upstream's response, passed on as it streams in (its raw bytes: never decoded), and
    closed when it ends, fails, or the client disconnects (see forward_to_upstream)."""

    def __init__(self, upstream: httpx.Response) -> None:
        self.upstream = upstream
        self.status_code = upstream.status_code
        self.raw_headers = client_response_headers(list(upstream.headers.raw))
        self.background = None
        self.body = b""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        import httpx

        failure: BaseException | None = None
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    nonlocal failure
                    try:
                        await send({"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
                        async for chunk in self.upstream.aiter_raw():
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    except OSError:
                        pass  # the client is gone (an ASGI 2.4 server raises on send)
                    except Exception as error:  # raised below, as itself, not in an ExceptionGroup
                        failure = error  # e.g. the upstream broke off: the client's stream must too
                    finally:
                        group.cancel_scope.cancel()

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch_disconnect)
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
        if failure is not None:
            if isinstance(failure, httpx.TransportError):
                logger.warning("upstream %s broke off mid-response: %r", self.upstream.url, failure)
            raise failure


async def forward_to_upstream(request: Request, client: httpx.AsyncClient, path: str | None = None, *,
                              headers: Mapping[str, str | None] | None = None,
                              include_stream_usage: bool = True) -> Response:
    """Sends `request` to the upstream with `client` (its `base_url` is the upstream's; `path`,
    default the request's own path, with the request's query string) and returns the
    upstream's answer as a streamed response: status, headers and body as the upstream sent
    them, but for the headers named in this module's docstring. `headers` replaces the
    request's headers of those names (None: not sent), e.g. the upstream's API key in place
    of the gateway's own: `{"authorization": f"Bearer {key}", "x-api-key": None}`. A chat
    completions stream is made to carry its usage (`include_stream_usage=False` leaves the
    body alone).

    Upstream unreachable: 502; timed out before it answered: 504; both in the error shape of
    the openai and anthropic SDKs. Use it in a route behind a TokenRateLimit, with
    RateLimitHeadersMiddleware on the app (the reconcile reads the usage it passes on)."""
    import httpx

    target = path if path is not None else request.url.path
    body = await request.body()
    if include_stream_usage and target.rstrip("/").endswith("/chat/completions"):
        body = with_stream_usage(body)
    sent = upstream_request_headers([(name.decode("latin-1").lower(), value.decode("latin-1"))
                                     for name, value in request.scope["headers"]], headers)
    params: Any = request.url.query or None
    outgoing = client.build_request(request.method, target, params=params, headers=sent, content=body)
    upstream: httpx.Response | None = None
    failure: Exception | None = None
    async with anyio.create_task_group() as group:
        # The upstream may take minutes before its first byte (a long answer that is not
        # streamed): a client that leaves meanwhile cancels the request, which closes its
        # connection.

        async def send_upstream() -> None:
            nonlocal upstream, failure
            try:
                upstream = await client.send(outgoing, stream=True)
            except Exception as error:  # judged below, outside the task group
                failure = error
            finally:
                group.cancel_scope.cancel()

        async def watch_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(send_upstream)
        group.start_soon(watch_disconnect)
    if isinstance(failure, (httpx.ConnectError, httpx.ConnectTimeout)):
        await _charge_nothing(request)  # nothing reached the upstream
        return _error(502, "upstream_unavailable", f"the upstream could not be reached: {failure!r}")
    if isinstance(failure, httpx.TimeoutException):
        return _error(504, "upstream_timeout", f"the upstream did not answer in time: {failure!r}")
    if isinstance(failure, httpx.TransportError):
        return _error(502, "upstream_unavailable", f"the upstream failed: {failure!r}")
    if failure is not None:
        raise failure  # not the upstream's failure (a bad URL, say): the route's own error
    if upstream is None:
        # The client left before the upstream answered (nginx's 499: nobody reads it). The
        # upstream may have generated meanwhile: the reservation stays as it is.
        return Response(status_code=499)
    # The provider's word on its limits (its headers, a 429's retry-after) reaches the caps
    # of every upstream the request went through, before its body streams.
    await observe_upstreams(request, upstream.status_code, upstream.headers.raw)
    if upstream.status_code >= 400:
        await _charge_nothing(request)
    return UpstreamResponse(upstream)
