"""Loopback TCP proxies that can cut a Redis Cluster in two, run as a process of its own by
tests/partition.py (its traffic costs CPU that must not take the GIL from the limiter under
test). Standard library only.

    python tests/partition_proxy.py '[{"port": P, "bus_port": B, "source": "127.0.0.11"}, ...]'

For each node it listens on two free loopback ports, one forwarded to the node's client port
and one to its cluster bus port, and prints them as one JSON line ([[port, bus_port], ...]).
The nodes announce these ports (cluster-announce-port, cluster-announce-bus-port), so that
gossip, replication and clients all cross a proxy. A proxy tells the sides of a connection
apart by its source address: each node makes its outgoing connections from its own
(bind-source-addr), and anything else (127.0.0.1) is a client.

Commands, one line each on stdin, each answered by one line on stdout once done:

    cut {"isolated": [k, ...], "clients_isolated": true}
        Nodes k (and the clients, if clients_isolated) are one side, the other nodes the
        other. Every forwarded connection across the cut is aborted; a new one across it is
        accepted and never forwarded (what it sends is read and dropped). Answers
        "ok <connections aborted>".
    heal
        Forwards again; the connections held across the cut are aborted (their peers
        reconnect). Answers "ok <connections aborted>".

It exits when stdin closes (the test process is gone) or on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import sys
from functools import partial
from typing import Any


class Proxy:
    """Which connections cross the cut, and every connection alive, by kind."""

    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        self.nodes = nodes
        self.node_of_source = {node["source"]: k for k, node in enumerate(nodes)}
        self.isolated: set[int] | None = None  # None: no cut
        self.clients_isolated = True
        self.links: set[Downstream] = set()  # forwarded
        self.held: set[asyncio.Transport] = set()  # accepted across the cut, dropped

    def crosses(self, source: str, node: int) -> bool:
        """Whether a connection from `source` to node `node` crosses the cut."""
        if self.isolated is None:
            return False
        source_node = self.node_of_source.get(source)
        source_isolated = (self.clients_isolated if source_node is None
                           else source_node in self.isolated)
        return source_isolated != (node in self.isolated)

    def cut(self, isolated: list[int], clients_isolated: bool) -> int:
        self.isolated = set(isolated)
        self.clients_isolated = clients_isolated
        crossing = [link for link in self.links if self.crosses(link.source, link.node)]
        for link in crossing:
            link.abort()
        return len(crossing)

    def heal(self) -> int:
        self.isolated = None
        held = list(self.held)
        for transport in held:
            transport.abort()
        self.held.clear()
        return len(held)


class Upstream(asyncio.Protocol):
    """The proxy's connection to the node: what the node sends goes to the peer."""

    def __init__(self, downstream: Downstream) -> None:
        self.downstream = downstream
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.downstream.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.downstream.abort()

    def pause_writing(self) -> None:  # the node reads slower than the peer sends
        self.downstream.transport.pause_reading()

    def resume_writing(self) -> None:
        self.downstream.transport.resume_reading()


class Downstream(asyncio.Protocol):
    """A connection accepted for node `node`: forwarded to it, or held across the cut."""

    def __init__(self, proxy: Proxy, node: int, port: int) -> None:
        self.proxy = proxy
        self.node = node
        self.port = port
        self.source = ""
        self.upstream: Upstream | None = None
        self.held = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.source = transport.get_extra_info("peername")[0]
        if self.proxy.crosses(self.source, self.node):
            self.held = True
            self.proxy.held.add(transport)
            return
        transport.pause_reading()  # until the node is connected
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(lambda: Upstream(self), "127.0.0.1",
                                                       self.port)
        except OSError:
            self.transport.abort()
            return
        self.upstream = upstream
        if self.transport.is_closing() or self.proxy.crosses(self.source, self.node):
            self.abort()  # closed, or cut, while connecting
            return
        self.proxy.links.add(self)
        self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.upstream is not None and self.upstream.transport is not None and not self.held:
            self.upstream.transport.write(data)

    def abort(self) -> None:
        self.proxy.links.discard(self)
        self.transport.abort()
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.proxy.held.discard(self.transport)
        self.abort()

    def pause_writing(self) -> None:  # the peer reads slower than the node sends
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()


async def serve(nodes: list[dict[str, Any]]) -> None:
    loop = asyncio.get_running_loop()
    proxy = Proxy(nodes)
    ports = []
    for k, node in enumerate(nodes):
        pair = []
        for port in (node["port"], node["bus_port"]):
            server = await loop.create_server(partial(Downstream, proxy, k, port), "127.0.0.1", 0)
            pair.append(server.sockets[0].getsockname()[1])
        ports.append(pair)
    print(json.dumps(ports), flush=True)
    commands = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(commands), sys.stdin)
    while line := (await commands.readline()).decode():
        verb, _, argument = line.strip().partition(" ")
        if verb == "cut":
            sides = json.loads(argument)
            aborted = proxy.cut(sides["isolated"], sides.get("clients_isolated", True))
        elif verb == "heal":
            aborted = proxy.heal()
        else:
            print(f"error unknown command {verb!r}", flush=True)
            continue
        print(f"ok {aborted}", flush=True)


if __name__ == "__main__":
    asyncio.run(serve(json.loads(sys.argv[1])))
