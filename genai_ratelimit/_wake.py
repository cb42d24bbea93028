"""The wake-ups of an in-flight cap's wait queue (docs/wait-queue.md): one pub/sub subscriber
connection per limiter (per process), opened when the first waiter appears.

A release (lua/lease.lua) PUBLISHes, on the channel named after the cap's queue key, the
tickets whose turn came; the subscriber hands each to its waiter. The bytes are decoded in
C (_native.PushReader, csrc/proto.c's push reader): this module only moves bytes and keeps
the table of who waits for what. Pub/sub is at-most-once: a waiter never sleeps longer than
its plan's backstop (wait_queue.WAKE_BACKSTOP_SECONDS), so a message lost to a reconnection
only delays it.

- `WakeSubscriber` (RateLimiter): a blocking socket read by a daemon thread (recv releases
  the GIL); waiters are threading.Events.
- `AsyncWakeSubscriber` (AsyncRateLimiter): an asyncio Protocol on the waiter's loop;
  waiters are asyncio.Events.

Subscribing returns once the server confirmed the subscription (or the connect timeout
passed: then the backstop wakes the waiter), so a release after it is never missed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import threading
from typing import Any

from . import _native
from ._url import RedisOptions, ssl_context

__all__ = ["AsyncWakeSubscriber", "WakeSubscriber", "Waiter"]

logger = logging.getLogger("genai_ratelimit")


class Waiter:
    """One waiting ticket: `event` is set when a release names it."""

    __slots__ = ("channel", "ticket", "event")

    def __init__(self, channel: str, ticket: str, event: Any) -> None:
        self.channel = channel
        self.ticket = ticket
        self.event = event


def _handshake_words(options: RedisOptions) -> list[tuple[str, ...]]:
    """AUTH's words when the URL has a password (pub/sub channels belong to no database:
    no SELECT)."""
    if options.password is None:
        return []
    if options.username:
        return [("AUTH", options.username, options.password)]
    return [("AUTH", options.password)]


def _address(options: RedisOptions) -> tuple[str, int] | None:
    """Where the subscriber connects: the URL's server, or a Cluster's first seed node (a
    PUBLISH reaches every node's subscribers). None for a unix socket (its path is the
    address) and for Sentinel (the backstop only)."""
    if options.mode == "sentinel" or options.unix_path is not None:
        return None
    if options.mode == "cluster":
        return options.nodes[0]
    assert options.host is not None
    return (options.host, options.port)


class _Table:
    """Who waits for which ticket on which channel (both subscribers' bookkeeping)."""

    def __init__(self) -> None:
        self.waiters: dict[str, dict[str, Waiter]] = {}

    def add(self, waiter: Waiter) -> bool:
        """Registers waiter; True when its channel is new (to SUBSCRIBE)."""
        tickets = self.waiters.get(waiter.channel)
        new = tickets is None
        if tickets is None:
            tickets = self.waiters[waiter.channel] = {}
        tickets[waiter.ticket] = waiter
        return new

    def remove(self, waiter: Waiter) -> bool:
        """Forgets waiter; True when its channel has no waiter left (to UNSUBSCRIBE)."""
        tickets = self.waiters.get(waiter.channel)
        if tickets is None or tickets.get(waiter.ticket) is not waiter:
            return False
        del tickets[waiter.ticket]
        if tickets:
            return False
        del self.waiters[waiter.channel]
        return True

    def notify(self, channel: bytes, payload: bytes) -> None:
        tickets = self.waiters.get(channel.decode("utf-8", "surrogateescape"))
        if not tickets:
            return
        for ticket in payload.decode("ascii", "replace").split():
            waiter = tickets.get(ticket)
            if waiter is not None:
                waiter.event.set()


class WakeSubscriber:
    """RateLimiter's subscriber: a dedicated blocking connection read by a daemon thread."""

    def __init__(self, options: RedisOptions, connect_timeout: float) -> None:
        self._options = options
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._table = _Table()
        self._confirmed: dict[str, threading.Event] = {}
        self._sock: socket.socket | None = None
        self._pid = os.getpid()
        self._closed = False

    def _open(self) -> socket.socket | None:
        """A fresh connection, authenticated, its reader thread started; None when the
        server cannot be reached (the waiters keep their backstop). Lock held."""
        address = _address(self._options)
        if address is None and self._options.unix_path is None:
            return None
        try:
            if self._options.unix_path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self._connect_timeout)
                sock.connect(self._options.unix_path)
            else:
                assert address is not None
                sock = socket.create_connection(address, timeout=self._connect_timeout)
                if self._options.tls:
                    context = ssl_context(self._options)
                    sock = context.wrap_socket(sock, server_hostname=address[0])
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader = _native.PushReader()
            for words in _handshake_words(self._options):
                command = reader.command(*words)
                try:
                    sock.sendall(command)
                finally:
                    command[:] = bytes(len(command))
                while not any(kind == "status" for kind, _, _ in reader.feed(sock.recv(4096))):
                    pass
            sock.settimeout(None)
        except (OSError, ssl.SSLError, _native.RateLimiterError) as exc:
            logger.warning("the wait queue's subscriber connection could not open (waiters "
                           "wake by their backstop): %s", exc)
            return None
        thread = threading.Thread(target=self._read, args=(sock, reader),
                                  name="genai-ratelimit-wake", daemon=True)
        thread.start()
        return sock

    def _send(self, words: tuple[str, ...]) -> None:
        """Lock held."""
        if self._sock is None:
            return
        try:
            self._sock.sendall(_native.PushReader().command(*words))
        except OSError:
            self._drop(self._sock)

    def _drop(self, sock: socket.socket) -> None:
        """The connection is done: the waiters wake by their backstop until the next
        subscribe opens another. Lock held."""
        if self._sock is sock:
            self._sock = None
            self._confirmed.clear()
        try:
            sock.close()
        except OSError:
            pass

    def _read(self, sock: socket.socket, reader: Any) -> None:
        while True:
            try:
                data = sock.recv(65536)
                pushes = reader.feed(data) if data else None
            except (OSError, ValueError, _native.RateLimiterError):
                pushes = None
            if pushes is None:
                with self._lock:
                    self._drop(sock)
                return
            with self._lock:
                for kind, channel, payload in pushes:
                    if kind == "message":
                        self._table.notify(channel, payload)
                    elif kind == "subscribe":
                        confirmed = self._confirmed.get(channel.decode("utf-8", "surrogateescape"))
                        if confirmed is not None:
                            confirmed.set()

    def subscribe(self, channel: str, ticket: str) -> Waiter:
        """A waiter for ticket on channel, once the server confirmed the subscription (or
        the connect timeout passed)."""
        waiter = Waiter(channel, ticket, threading.Event())
        if self._pid != os.getpid():
            # A fork child: the parent's socket and reader thread are not ours, and its lock
            # may have been held by that thread when the process forked.
            self._lock = threading.Lock()
            self._pid, self._sock, self._table = os.getpid(), None, _Table()
            self._confirmed = {}
        with self._lock:
            if self._closed:
                return waiter
            self._table.add(waiter)
            if self._sock is None:
                self._sock = self._open()
            confirmed = self._confirmed.get(channel)
            if confirmed is None and self._sock is not None:
                confirmed = self._confirmed[channel] = threading.Event()
                self._send(("SUBSCRIBE", channel))
        if confirmed is not None:
            confirmed.wait(self._connect_timeout)
        return waiter

    def wake(self, waiter: Waiter, timeout: float) -> bool:
        """Sleeps until a release names the waiter's ticket or timeout passes; whether it
        was named."""
        named = bool(waiter.event.wait(timeout))
        waiter.event.clear()
        return named

    def unsubscribe(self, waiter: Waiter) -> None:
        with self._lock:
            if self._table.remove(waiter) and self._sock is not None:
                self._confirmed.pop(waiter.channel, None)
                self._send(("UNSUBSCRIBE", waiter.channel))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._sock is not None:
                sock = self._sock
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._drop(sock)


class _PushProtocol(asyncio.Protocol):
    def __init__(self, owner: AsyncWakeSubscriber) -> None:
        self.owner = owner
        self.reader = _native.PushReader()
        self.transport: asyncio.Transport | None = None
        self.statuses: asyncio.Queue[bytes] = asyncio.Queue()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            pushes = self.reader.feed(data)
        except _native.RateLimiterError as exc:
            self.owner._lost(self, exc)
            return
        for kind, channel, payload in pushes:
            if kind == "message":
                self.owner._table.notify(channel, payload)
            elif kind == "subscribe":
                confirmed = self.owner._confirmed.get(channel.decode("utf-8", "surrogateescape"))
                if confirmed is not None and not confirmed.done():
                    confirmed.set_result(None)
            elif kind == "status":
                self.statuses.put_nowait(payload)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._lost(self, exc)


class AsyncWakeSubscriber:
    """AsyncRateLimiter's subscriber on one event loop: a dedicated asyncio connection."""

    def __init__(self, options: RedisOptions, connect_timeout: float,
                 ssl_context: ssl.SSLContext | None) -> None:
        self._options = options
        self._connect_timeout = connect_timeout
        self._ssl = ssl_context
        self._table = _Table()
        self._confirmed: dict[str, asyncio.Future[None]] = {}
        self._protocol: _PushProtocol | None = None
        self._opening: asyncio.Task[_PushProtocol | None] | None = None
        self._closed = False

    async def _open(self) -> _PushProtocol | None:
        protocol = _PushProtocol(self)
        try:
            await asyncio.wait_for(self._connect(protocol), self._connect_timeout)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, _native.RateLimiterError) as exc:
            logger.warning("the wait queue's subscriber connection could not open (waiters "
                           "wake by their backstop): %s", exc)
            if protocol.transport is not None:
                protocol.transport.abort()
            return None
        if protocol.transport is None or protocol.transport.is_closing():
            return None
        return protocol

    async def _connect(self, protocol: _PushProtocol) -> None:
        loop = asyncio.get_running_loop()
        address = _address(self._options)
        if self._options.unix_path is not None:
            await loop.create_unix_connection(lambda: protocol, self._options.unix_path)
        elif address is not None:
            await loop.create_connection(
                lambda: protocol, address[0], address[1], ssl=self._ssl,
                server_hostname=address[0] if self._ssl is not None else None)
        else:
            raise OSError("a Sentinel URL: no subscriber connection")
        for words in _handshake_words(self._options):
            command = protocol.reader.command(*words)
            assert protocol.transport is not None
            protocol.transport.write(bytes(command))
            command[:] = bytes(len(command))
            await protocol.statuses.get()

    def _lost(self, protocol: _PushProtocol, exc: BaseException | None) -> None:
        if self._protocol is protocol:
            self._protocol = None
            for confirmed in self._confirmed.values():
                if not confirmed.done():
                    confirmed.set_result(None)  # nobody waits for what will not come
            self._confirmed.clear()
        if protocol.transport is not None:
            protocol.transport.abort()

    def _send(self, *words: str) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.write(bytes(self._protocol.reader.command(*words)))

    async def subscribe(self, channel: str, ticket: str) -> Waiter:
        """AsyncRateLimiter's WakeSubscriber.subscribe."""
        waiter = Waiter(channel, ticket, asyncio.Event())
        if self._closed:
            return waiter
        self._table.add(waiter)
        try:
            await self._subscribed(channel)
        except BaseException:  # cancelled: the plan never gets the waiter to unsubscribe
            self.unsubscribe(waiter)
            raise
        return waiter

    async def _subscribed(self, channel: str) -> None:
        """Opens the connection if needed and SUBSCRIBEs channel unless it is, then waits
        for the confirmation (at most connect_timeout)."""
        if self._protocol is None:
            if self._opening is None:
                self._opening = asyncio.get_running_loop().create_task(self._open())
            opening = self._opening
            try:
                protocol = await asyncio.shield(opening)
            finally:
                if self._opening is opening and opening.done():
                    self._opening = None
            if self._protocol is None and protocol is not None:
                self._protocol = protocol
        confirmed = self._confirmed.get(channel)
        if confirmed is None and self._protocol is not None:
            confirmed = self._confirmed[channel] = asyncio.get_running_loop().create_future()
            self._send("SUBSCRIBE", channel)
        if confirmed is not None:
            try:
                await asyncio.wait_for(asyncio.shield(confirmed), self._connect_timeout)
            except asyncio.TimeoutError:
                pass

    async def wake(self, waiter: Waiter, timeout: float) -> bool:
        try:
            await asyncio.wait_for(waiter.event.wait(), timeout)
            named = True
        except asyncio.TimeoutError:
            named = False
        waiter.event.clear()
        return named

    def unsubscribe(self, waiter: Waiter) -> None:
        if self._table.remove(waiter) and self._protocol is not None:
            self._confirmed.pop(waiter.channel, None)
            self._send("UNSUBSCRIBE", waiter.channel)

    def close(self) -> None:
        self._closed = True
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()

