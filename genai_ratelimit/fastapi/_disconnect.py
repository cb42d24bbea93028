"""Watching a waiting request's client: the ASGI `http.disconnect` while (and only while) a
call waits in an upstream's queue, without losing a byte of the request's body."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.types import Message

T = TypeVar("T")


class DisconnectWatch:
    """`await watch()` ends when the request's client disconnects (run_async races it with a
    waiting call and cancels it when the call ends first). Every other message it receives (a
    body the route has not read yet: FastAPI reads it before the dependencies only when the
    route has body parameters) is kept, and `restore()` puts it back in front of the request's
    receive channel, where the route's `request.body()` / `request.stream()` reads it. The
    server's receive is cancellation-safe (uvicorn: a message is taken only once it is
    returned), so cancelling the watch loses nothing."""

    __slots__ = ("request", "kept", "left")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.kept: list[Message] = []
        self.left = False

    async def __call__(self) -> None:
        receive = self.request.receive
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.left = True
                return
            self.kept.append(message)

    async def during(self, work: Awaitable[T]) -> T:
        """`work`'s result, watching meanwhile (`left` says whether the client left): for a
        wait that cannot be cancelled (a blocking limiter's, in a thread)."""
        watcher = asyncio.ensure_future(self())
        try:
            return await work
        finally:
            watcher.cancel()
            await asyncio.wait((watcher,))

    def restore(self) -> None:
        """The body messages the watch took, first in the request's receive channel."""
        if not self.kept:
            return
        pending = deque(self.kept)
        self.kept = []
        receive = self.request.receive

        async def replay() -> Message:
            if pending:
                return pending.popleft()
            return await receive()

        self.request._receive = replay
