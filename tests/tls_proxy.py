"""A TLS-record-aware TCP proxy on loopback (tests/test_tls.py): it stands between a client
and a TLS server and delivers the server's first flight (ServerHello up to the server's
Finished, everything the server sends before the client's second flight) in a chosen shape;
the client's bytes, and everything the server sends after the client's second flight
(session tickets, replies), pass unchanged.

Shapes of the first flight:
  "split"      every record cut at odd places: its 5-byte header in two writes (1 + 4),
               its body in writes of 1, 2, 3, 5, 8, 13, ... bytes, a short pause between
  "coalesced"  every record the server sent, held until it has fallen silent, then all of
               them in one write
  "paused"     one record per write, `pause` seconds between records
  "trickle"    one byte per write, `pause` seconds between bytes (a server that is slow but
               never silent for long)
  "held"       nothing until release() is called, then all of it in one write

The proxy runs an asyncio loop on a thread of its own, so it keeps forwarding while the
test's thread is blocked inside the limiter (with or without the GIL)."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

SHAPES = ("split", "coalesced", "paused", "trickle", "held")
_HEADER = 5
_FIBONACCI = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987)


def _records(buf: bytearray) -> list[bytes]:
    """Takes the complete TLS records at the start of buf out of it."""
    out = []
    while len(buf) >= _HEADER:
        size = _HEADER + int.from_bytes(buf[3:5], "big")
        if len(buf) < size:
            break
        out.append(bytes(buf[:size]))
        del buf[:size]
    return out


class TlsProxy:
    """TlsProxy(upstream_port, shape): listens on 127.0.0.1:`port`, forwards to
    127.0.0.1:upstream_port. `shaped` counts the first flights delivered in the shape
    (a test checks its premise with it); `first_flight_bytes` is the size of the last."""

    def __init__(self, upstream_port: int, shape: str, pause: float = 0.05,
                 quiet: float = 0.05) -> None:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}")
        self.upstream_port = upstream_port
        self.shape = shape
        self.pause = pause
        self.quiet = quiet  # "coalesced": how long the server must be silent
        self.port = 0
        self.shaped = 0
        self.first_flight_bytes = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._released: asyncio.Event | None = None
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._run, name="tls-proxy", daemon=True)

    # -- control, from the test's thread
    def __enter__(self) -> TlsProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the TLS proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def release(self) -> None:
        """"held": delivers the held first flight (and any later one at once)."""
        self._loop.call_soon_threadsafe(self._release)

    def close(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
            self._thread.join(10)

    # -- the proxy's own thread
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._released = asyncio.Event()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _release(self) -> None:
        assert self._released is not None
        self._released.set()

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()
        self._loop.call_soon(self._loop.stop)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.transport.abort()
            return
        for writer in (client_w, server_w):
            self._writers.add(writer)
            sock = writer.get_extra_info("socket")
            if sock is not None:  # every write its own segment
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        second_flight = asyncio.Event()  # the client spoke after its ClientHello
        try:
            await asyncio.gather(self._upstream(client_r, server_w, second_flight),
                                 self._downstream(server_r, client_w, second_flight))
        finally:
            for writer in (client_w, server_w):
                writer.transport.abort()
                self._writers.discard(writer)

    async def _upstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        second_flight: asyncio.Event) -> None:
        buf = bytearray()
        seen = 0
        try:
            while data := await reader.read(65536):
                if not second_flight.is_set():
                    buf += data
                    seen += len(_records(buf))
                    if seen > 1:  # ClientHello, then the client's second flight
                        second_flight.set()
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            second_flight.set()
            writer.transport.abort()

    async def _downstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          second_flight: asyncio.Event) -> None:
        try:
            await self._first_flight(reader, writer, second_flight)
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.transport.abort()

    async def _first_flight(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            second_flight: asyncio.Event) -> None:
        """Reads what the server sends until the client's second flight and delivers it
        in the proxy's shape."""
        buf = bytearray()
        total = 0
        assert self._released is not None
        while not second_flight.is_set():
            read = asyncio.ensure_future(reader.read(65536))
            others = {asyncio.ensure_future(second_flight.wait())}
            if self.shape == "held":
                others.add(asyncio.ensure_future(self._released.wait()))
            timeout = self.quiet if self.shape == "coalesced" and buf else None
            await asyncio.wait({read, *others}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            for other in others:
                other.cancel()
            if not read.done():
                read.cancel()
                try:
                    await read
                except asyncio.CancelledError:
                    pass
            data = b"" if read.cancelled() else read.result()
            if read.done() and not read.cancelled() and not data:
                break  # the server hung up
            buf += data
            total += len(data)
            if self.shape == "held":
                if self._released.is_set():
                    break
            elif self.shape == "coalesced":
                if not data and buf:  # the server fell silent: all of it at once
                    writer.write(bytes(buf))
                    buf.clear()
                    await writer.drain()
            else:
                for record in _records(buf):
                    await self._deliver(record, writer)
        if buf:
            writer.write(bytes(buf))
            await writer.drain()
        if total:
            self.shaped += 1
            self.first_flight_bytes = total

    async def _deliver(self, record: bytes, writer: asyncio.StreamWriter) -> None:
        if self.shape == "paused":
            writer.write(record)
            await writer.drain()
            await asyncio.sleep(self.pause)
            return
        if self.shape == "trickle":
            pieces: list[bytes] = [record[i:i + 1] for i in range(len(record))]
        else:  # split: header 1 + 4, then the body in growing odd pieces
            pieces = [record[:1], record[1:_HEADER]]
            at, k = _HEADER, 0
            while at < len(record):
                step = _FIBONACCI[min(k, len(_FIBONACCI) - 1)]
                pieces.append(record[at:at + step])
                at += step
                k += 1
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(self.pause if self.shape == "trickle" else 0.001)

    def __repr__(self) -> str:
        return f"<TlsProxy {self.shape} :{self.port} -> :{self.upstream_port}>"

    def stats(self) -> dict[str, Any]:
        return {"shape": self.shape, "shaped": self.shaped,
                "first_flight_bytes": self.first_flight_bytes}
