"""Redis Cluster and Sentinel for the asyncio limiter: the slot map, read from CLUSTER
SHARDS (Redis 7) or CLUSTER SLOTS, or the master that the sentinels name; and the cluster's
answers (MOVED, ASK, TRYAGAIN, CLUSTERDOWN) told apart. The blocking limiter does the same
in C (csrc/cluster.c); the hash slot of a decision is computed once, in C, when the codec
formats it (Request.slot)."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["SlotMap", "Address", "redirect_of", "SLOTS"]

SLOTS = 16384
Address = tuple[str, int]

# The text of a cluster answer as the C engine reports it (RL_ERR_REDIRECT, module.c).
_REDIRECT = re.compile(r"^Redis answered (MOVED|ASK) (\d+) (\S+):(\d+):")
_BUSY = re.compile(r"^Redis answered (TRYAGAIN|CLUSTERDOWN)")


def redirect_of(message: str) -> tuple[str, int, Address] | tuple[str, None, None] | None:
    """("MOVED" | "ASK", slot, (host, port)), ("TRYAGAIN" | "CLUSTERDOWN", None, None), or
    None when message is not a cluster answer."""
    match = _REDIRECT.match(message)
    if match is not None:
        return match[1], int(match[2]), (match[3].strip("[]"), int(match[4]))
    busy = _BUSY.match(message)
    if busy is not None:
        return busy[1], None, None
    return None


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _flat_map(value: Any) -> dict[str, Any]:
    """A RESP2 map (a flat list of name, value, ...) as a dict."""
    if not isinstance(value, list) or len(value) % 2:
        raise ValueError("not a map")
    return {_text(value[i]): value[i + 1] for i in range(0, len(value), 2)}


class SlotMap:
    """Which node serves each hash slot, shared by every event loop of one limiter; nodes
    are kept once met, seeds first. In sentinel mode (master_name) `nodes` are the
    sentinels and every slot is the master's."""

    def __init__(self, seeds: tuple[Address, ...], tls: bool,
                 master_name: str | None = None) -> None:
        self.nodes: list[Address] = list(seeds)
        self.slots: list[Address | None] = [None] * SLOTS
        self.tls = tls
        self.refreshes = 0
        self.master_name = master_name
        self.master: Address | None = None
        # Sentinel: when they were last asked (monotonic), whether a task asks now, the one
        # that answered last, those that timed out (asked last until then), since when a
        # sentinel reports a failover under way (0: none).
        self.asked_at = 0.0
        self.asking = False
        self.last_sentinel = 0
        self.suspect_until: dict[Address, float] = {}
        self.failover_since = 0.0
        # Cluster: a call timed out: the map is read again (every _STALE_REREAD) until then;
        # when it was last read so.
        self.stale_until = 0.0
        self.map_read_at = 0.0

    def destination(self, slot: int) -> Address | None:
        """Where a decision of this slot goes (None: read the map first)."""
        return self.master if self.master_name is not None else self.slots[slot]

    def sentinel_order(self, now: float) -> tuple[list[Address], int]:
        """The sentinels to ask, the last one that answered first and those that timed out
        lately (suspects) last; and how many suspects end the list."""
        start = self.last_sentinel % len(self.nodes)
        rotated = self.nodes[start:] + self.nodes[:start]
        trusted = [a for a in rotated if self.suspect_until.get(a, 0.0) <= now]
        suspects = [a for a in rotated if self.suspect_until.get(a, 0.0) > now]
        return trusted + suspects, len(suspects)

    @staticmethod
    def sentinel_view(reply: Any, asked: Address) -> tuple[Address, int, bool]:
        """SENTINEL MASTER's reply (a flat map): (the master's address, its config epoch,
        whether this sentinel leads a failover now). ValueError when it knows no master."""
        fields = _flat_map(reply)
        host, port = _text(fields.get("ip", "")), int(_text(fields.get("port", "0")))
        if not host or not 1 <= port <= 65535:
            raise ValueError(f"the sentinel at {asked[0]}:{asked[1]} answered no master address")
        epoch = int(_text(fields.get("config-epoch", "0")))
        return (host, port), epoch, "failover_in_progress" in _text(fields.get("flags", ""))

    @staticmethod
    def choose_master(views: list[tuple[Address, int, bool]]) -> Address:
        """The address of the highest config epoch; between equal ones, the one more
        sentinels name (csrc/cluster.c's rule)."""
        def rank(view: tuple[Address, int, bool]) -> tuple[int, int]:
            return view[1], sum(1 for v in views if v[:2] == view[:2])
        return max(views, key=rank)[0]

    def install_master(self, reply: Any, asked: Address) -> None:
        """SENTINEL get-master-addr-by-name's reply: [host, port]. ValueError otherwise."""
        if not isinstance(reply, list) or len(reply) != 2:
            raise ValueError(f"the sentinel at {asked[0]}:{asked[1]} does not know a master "
                             f"named {self.master_name}")
        self.master = (_text(reply[0]), int(reply[1]))
        self.refreshes += 1

    def node_order(self) -> list[Address]:
        """The nodes to ask for the map, starting from a different one each time."""
        start = self.refreshes % len(self.nodes)
        return self.nodes[start:] + self.nodes[:start]

    def point(self, slot: int, address: Address) -> None:
        if address not in self.nodes:
            self.nodes.append(address)
        self.slots[slot] = address

    def install(self, reply: Any, asked: Address, shards: bool) -> None:
        """Replaces the map with CLUSTER SHARDS' or CLUSTER SLOTS' reply. ValueError when
        the reply is not one."""
        ranges = self._shards(reply, asked) if shards else self._slots(reply, asked)
        slots: list[Address | None] = [None] * SLOTS
        for start, end, address in ranges:
            if not 0 <= start <= end < SLOTS:
                raise ValueError(f"slot range {start}-{end} out of range")
            if address not in self.nodes:
                self.nodes.append(address)
            slots[start:end + 1] = [address] * (end - start + 1)
        self.slots = slots
        self.refreshes += 1

    @staticmethod
    def _address(host: Any, port: Any, asked: Address) -> Address:
        name = _text(host) if host is not None else ""
        if not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError("a node without a port")
        return (name if name not in ("", "?") else asked[0], port)

    def _slots(self, reply: Any, asked: Address) -> list[tuple[int, int, Address]]:
        if not isinstance(reply, list):
            raise ValueError("CLUSTER SLOTS answered something else than an array")
        ranges = []
        for entry in reply:
            start, end, master = entry[0], entry[1], entry[2]
            ranges.append((int(start), int(end), self._address(master[0], master[1], asked)))
        return ranges

    def _shards(self, reply: Any, asked: Address) -> list[tuple[int, int, Address]]:
        if not isinstance(reply, list):
            raise ValueError("CLUSTER SHARDS answered something else than an array")
        ranges: list[tuple[int, int, Address]] = []
        for raw in reply:
            shard = _flat_map(raw)
            bounds = shard["slots"]
            if not bounds:
                continue  # a master without slots
            master = None
            for node in map(_flat_map, shard["nodes"]):
                if _text(node.get("role")) != "master":
                    continue
                if master is None or _text(node.get("health")) == "online":
                    master = node
            if master is None:
                raise ValueError("a shard without a master")
            address = self._address(master.get("ip"),
                                    master.get("tls-port" if self.tls else "port"), asked)
            ranges.extend((int(bounds[i]), int(bounds[i + 1]), address)
                          for i in range(0, len(bounds), 2))
        return ranges
