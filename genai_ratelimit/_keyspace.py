"""What the command line reads of Redis besides the limiter's own scripts: the names of the
limiter's keys (found with SCAN on every master, a bounded number of calls), what each name
says (whose key, which window, which scope), the identity the FastAPI layer wrote into it,
and the raw reads of values no script reads back: a user's in-flight leases, a GCRA
bucket's time, a calendar budget's hash and a shared cap's provider view (each the layout
its Lua library documents; what they mean for a decision is the scripts' alone).

Windows themselves are always read through the limiter's peek, of the storage the key's
name says (":c": compact, else sorted sets), never here. The key grammar is csrc/script.c's
(window_key, write_user_key, format_lease), and so is its reading (rl_key_read, exported as
_native.read_key, and the hash tag as _native.key_owner): a key is read from its end,

    {prefix}:{owner}:{seconds}[:tokens][:scope={name} | :shared][:w | :c]
    {prefix}:{owner}:leases
    {prefix}:{owner}:{seconds}:gcra       (a GCRA bucket: check_rate, a tier's burst)
    {prefix}:{owner}:{period_start_ms}:budget={name}   (a calendar budget: lib/budget.lua)
    {prefix}:{name}:upstream              (a shared cap's provider view: lib/upstream.lua;
                                           not read back by rl_key_read, named by upstream_key)
    {prefix}:{name}:queue[:h]             (a shared cap's wait queue: lib/queue.lua; named by
                                           queue_key, read by read_queue)
    {cap window key}:class={class}[:w]    (a class's use of a shared cap's window, its reserved
                                           shares: lib/shares.lua; read by class_key / read_class_use)

On a Redis Cluster the owner is a hash tag, "{owner}" with '%', '{' and '}' percent-encoded.
The owner is a user id (the FastAPI layer's identity: "ip:<host>", "user:<id>" or the id,
behind "ns:<namespace>:" in a namespace) or, for ":shared", a shared scope's name."""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from . import _native

__all__ = ["KeyName", "Identity", "Storage", "ScanReport", "NAMESPACE_PATTERN", "parse_key", "identity_of",
           "shown", "quoted",
           "glob_escape", "tagged", "user_key_pattern", "scan",
           "node_url", "read_leases", "read_bucket", "read_budget", "upstream_key", "read_upstream",
           "queue_key", "read_queue", "ClassKey", "class_key", "read_class_use",
           "SCAN_COUNT", "scan_calls_per_master"]

# SCAN's COUNT: the limiter's connections take replies of at most 64 elements, and a step
# of COUNT 10 returns about 10 keys (a few more while Redis rehashes).
SCAN_COUNT = 10
# A FastAPI namespace (RateLimit(namespace=...)): 1 to 64 of A-Z a-z 0-9 _ . -, the one
# definition (genai_ratelimit.fastapi checks a namespace with it), and the key identity
# "ns:<namespace>:<identity>" it makes.
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_NAMESPACE = re.compile(rf"ns:({NAMESPACE_PATTERN.pattern}):(.*)", re.DOTALL)

Kind = Literal["window", "scope", "shared", "leases", "gcra", "budget"]
Storage = Literal["zset", "compact"]


@dataclass(frozen=True)
class KeyName:
    """What one key's name says."""

    kind: Kind  # a user's own window, a user's scope window, a shared scope's window, leases,
    # a GCRA bucket (seconds: its period), a calendar budget (seconds: its period's start in
    # unix ms, scope: its name)
    owner: str  # the user id (identity) of the key, or a shared scope's name
    seconds: int = 0  # the window's length (0 for leases)
    tokens: bool = False  # a token window
    scope: str | None = None  # a user's scope name ("route:/v1/chat", "model:gpt-4o")
    weights: bool = False  # the window's weights hash ("<window key>:w"), not its entries
    storage: Storage = "zset"  # "compact": the window's string ("<window key>:c")


@dataclass(frozen=True)
class Identity:
    """A user id as the FastAPI layer writes it into keys (fastapi.key_identity): an
    anonymous client "ip:<host>", an id escaped as "user:<id>", or the id itself, each
    possibly in a namespace, "ns:<namespace>:<identity>"; a shadow budget's identity,
    "shadow:<identity>", reads as one in the namespace "shadow" (or "shadow:<namespace>")."""

    key: str  # the id the limiter was given
    user: str  # the app's user id, or the client's host when anonymous
    kind: Literal["user", "anonymous"]
    namespace: str | None


def identity_of(key: str) -> Identity:
    """The reading of fastapi.key_identity's output (tests/test_cli.py checks the two agree)."""
    namespace = None
    shadow = key.startswith("shadow:")  # a shadow budget's identity: apart, never a user
    rest = key[len("shadow:"):] if shadow else key
    match = _NAMESPACE.fullmatch(rest)
    if match is not None:
        namespace, rest = match[1], match[2]
    if shadow:  # namespace names hold no ':', so "shadow" and "shadow:<ns>" are never a real one
        namespace = "shadow" if namespace is None else f"shadow:{namespace}"
    if rest.startswith("ip:"):
        return Identity(key, rest[3:], "anonymous", namespace)
    if rest.startswith("user:"):
        return Identity(key, rest[5:], "user", namespace)
    return Identity(key, rest, "user", namespace)


def parse_key(name: str, prefix: str, hash_tag: bool) -> KeyName | None:
    """What a key's name says, or None for a name that is not one of the limiter's
    (the extension's reading, _native.read_key, of the names it writes)."""
    read = _native.read_key(name, prefix, hash_tag)
    if read is None:
        return None
    kind, owner, seconds, tokens, scope, suffix = read
    return KeyName(kind, owner, seconds, tokens, scope, suffix == "w",
                   "compact" if suffix == "c" else "zset")


def shown(text: str) -> str:
    """text for a terminal: control and format characters (ESC, bidi overrides, line
    separators), bytes that were not UTF-8 and the backslash itself escaped, so an id
    can neither move the cursor nor pass for another."""
    out = []
    for char in text:
        code = ord(char)
        if char == "\\":
            out.append("\\\\")
        elif 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
            out.append(f"\\x{code - 0xDC00:02x}")
        elif unicodedata.category(char) in ("Cc", "Cf", "Cs", "Zl", "Zp", "Co"):
            out.append(f"\\x{code:02x}" if code < 0x100 else
                       f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(char)
    return "".join(out)


def quoted(text: str) -> str:
    """shown(text) between single quotes, for an id inside a sentence."""
    return f"'{shown(text)}'"


def glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def tagged(owner: str, hash_tag: bool) -> str:
    """An owner as its keys spell it: on a cluster, the hash tag (_native.key_owner)."""
    return _native.key_owner(owner, hash_tag)


def user_key_pattern(prefix: str, owner: str, hash_tag: bool, namespaces: bool = False) -> str:
    """The SCAN MATCH pattern of an owner's keys, "{prefix}:{owner}:*"; with namespaces, of
    the same owner's keys in any namespace too, "{prefix}:*{owner}:*" (a wider pattern:
    parse_key and identity_of then keep the exact ones)."""
    any_namespace = "*" if namespaces else ""
    if hash_tag:
        inner = glob_escape(tagged(owner, True)[1:-1])
        return f"{glob_escape(prefix)}:\\{{{any_namespace}{inner}\\}}:*"
    return f"{glob_escape(prefix)}:{any_namespace}{glob_escape(owner)}:*"


# --------------------------------------------------------------------------------- SCAN

Command = Callable[..., Awaitable[Any]]


@dataclass
class ScanReport:
    """What a bounded SCAN of every master found."""

    keys: list[str] = field(default_factory=list)
    masters: list[str] = field(default_factory=list)  # "host:port", or "" for the URL's node
    calls: int = 0  # SCAN calls sent, all masters together
    max_calls_per_master: int = 0
    complete: bool = True  # every master's cursor came back to 0 within its calls


def scan_calls_per_master(max_keys: int, masters: int) -> int:
    """The bound: --max-keys shared by the masters, SCAN_COUNT keys a call."""
    return max(1, math.ceil(max_keys / (SCAN_COUNT * max(1, masters))))


async def scan(nodes: Sequence[tuple[str, Command]], pattern: str, max_keys: int) -> ScanReport:
    """SCAN ... MATCH pattern COUNT 10 on each node (a master's `_command`), at most
    scan_calls_per_master calls each; the keys as text (bytes that are not UTF-8 kept as
    surrogate escapes)."""
    report = ScanReport(max_calls_per_master=scan_calls_per_master(max_keys, len(nodes)))
    for name, command in nodes:
        report.masters.append(name)
        cursor: bytes = b"0"
        for _ in range(report.max_calls_per_master):
            cursor, keys = await command("SCAN", cursor, "MATCH", pattern, "COUNT", str(SCAN_COUNT))
            report.calls += 1
            report.keys += [k.decode("utf-8", "surrogateescape") for k in keys]
            if cursor == b"0":
                break
        else:
            report.complete = False
    return report


def node_url(url: str, host: str, port: int, db: int) -> str:
    """A cluster's or a Sentinel set's URL (redis+cluster://, rediss+sentinel://, ...)
    pointed at one node: the same credentials and TLS options, one host, the database."""
    parts = urlsplit(url)
    scheme = parts.scheme.split("+", 1)[0]
    credentials = parts.netloc.rpartition("@")[0]
    shown_host = f"[{host}]" if ":" in host else host
    netloc = f"{credentials}@{shown_host}:{port}" if credentials else f"{shown_host}:{port}"
    return urlunsplit((scheme, netloc, f"/{db}", parts.query, ""))


# ---------------------------------------------------------------------- the raw read

async def read_leases(command: Command, key: str, now_ms: int,
                      shown_at_most: int = 16) -> tuple[int, list[int]]:
    """A user's in-flight leases (lua/lease.lua's sorted set {lease id: expiry ms}), read as
    the script would count them at now_ms: (held, the soonest expiries, at most
    shown_at_most). The only value the command line reads without a script: no script
    reads leases back."""
    held = int(await command("ZCOUNT", key, f"({now_ms}", "+inf"))
    reply = await command("ZRANGEBYSCORE", key, f"({now_ms}", "+inf", "WITHSCORES", "LIMIT", "0",
                          str(shown_at_most))
    return held, [int(float(reply[i])) for i in range(1, len(reply), 2)]


async def read_bucket(command: Command, key: str) -> int | None:
    """When a GCRA bucket (lua/lib/gcra.lua's key) is full again: its theoretical arrival
    time, rounded up to a whole ms; None when the key does not exist (the bucket is full).
    The value's two forms are lib/gcra.lua's: the integer "<ms><6 digits>" (the digits
    scale * 1000 + the remainder in 1/scale ms) and the string "<ms>:<remainder>:<scale>".
    Read raw, as the leases are: only the time is read here, never a decision (the rate and
    the burst are the caller's; check_rate decides)."""
    raw = await command("GET", key)
    if raw is None:
        return None
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
    parts = text.split(":")
    if len(parts) == 3 and all(part.isdigit() for part in parts):
        return int(parts[0]) + (int(parts[1]) > 0)
    if len(parts) == 1 and text.isdigit() and len(text) > 6:
        return int(text[:-6]) + (int(text[-6:]) % 1000 > 0)
    raise ValueError(f"{key!r} holds no GCRA time: {text[:40]!r}")


# lib/budget.lua's fields of a budget's hash that are not holds (every other field is one
# hold in flight: its id, a UUID4, and its amount).
_BUDGET_FIELDS = frozenset({"spent", "held", "until", "fired", "fired_from", "fired_by"})


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


async def _hash(command: Command, key: str) -> dict[str, str]:
    reply = await command("HGETALL", key)
    return {_text(reply[i]): _text(reply[i + 1]) for i in range(0, len(reply) - 1, 2)}


def _integer(key: str, fields: dict[str, str], name: str) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{key!r}: field {name!r} holds no integer: {value[:40]!r}") from None


async def read_budget(command: Command, key: str) -> dict[str, int] | None:
    """A calendar budget's hash (lib/budget.lua: spent, held, until, soft limits' fired*,
    one field per hold in flight), read raw: {"spent", "held", "holds" (the holds in flight),
    "until_ms" (when the key expires, in the scripts' clock: the period's end plus the
    longest hold; 0 when absent)}; None when the key does not exist. The limit and the
    period are arguments of each hold: the app's, never in Redis."""
    fields = await _hash(command, key)
    if not fields:
        return None
    return {"spent": _integer(key, fields, "spent") or 0, "held": _integer(key, fields, "held") or 0,
            "holds": sum(1 for name in fields if name not in _BUDGET_FIELDS),
            "until_ms": _integer(key, fields, "until") or 0}


def upstream_key(prefix: str, name: str, hash_tag: bool) -> str:
    """A shared scope's provider view, "{prefix}:{name}:upstream" (script.c
    write_upstream_key: the name spelled as its windows' keys spell it)."""
    return f"{prefix}:{tagged(name, hash_tag)}:upstream"


# lib/upstream.lua's fields of a provider view, all integers (unix ms for the times).
UPSTREAM_FIELDS = ("requests", "requests_reset", "requests_limit", "requests_sent",
                   "requests_sent_at", "tokens", "tokens_reset", "tokens_limit",
                   "closed_until", "bound")


async def read_upstream(command: Command, key: str) -> dict[str, int | None] | None:
    """A shared cap's provider view (lib/upstream.lua's hash, written by
    observe_upstream.lua), read raw: each of UPSTREAM_FIELDS (None when absent); None when
    the key does not exist (nobody observed the provider within its bound). As observed:
    after a reset the provider has its limit again, which only the scripts apply."""
    fields = await _hash(command, key)
    if not fields:
        return None
    return {name: _integer(key, fields, name) for name in UPSTREAM_FIELDS}


def queue_key(prefix: str, name: str, hash_tag: bool) -> str:
    """A shared scope's wait queue, "{prefix}:{name}:queue" (its hash: the same + ":h";
    script.c writes them beside the provider view)."""
    return f"{prefix}:{tagged(name, hash_tag)}:queue"


# The tickets of a queue read_queue looks at one by one (a reply of the limiter's
# connections holds at most 64 elements: 32 with their scores); beyond them a ticket counts
# as live, as lib/queue.lua counts it until it nears the head.
QUEUE_READ = 32


async def read_queue(command: Command, key: str, now_ms: int) -> dict[str, int | None] | None:
    """A shared cap's wait queue (lib/queue.lua's sorted set `key` and its hash `key:h`),
    read raw at now_ms: {"tickets": the live tickets (those whose deadline has passed among
    the first QUEUE_READ, which the next script purges, left out), "expired": those left
    out, "tenants": the tenants among the first QUEUE_READ live tickets (at least that
    many wait), "head_round": the round being served,
    "soonest_deadline_ms" and "latest_deadline_ms" of the live ones read,
    "first_deadline_ms": the deadline of the ticket served next}; None when the queue is
    empty. A ticket records its deadline, not the time it was taken: how long it has waited
    is not in Redis (its waiter knows: Reservation.waited_ms, genai_ratelimit_queue_wait_seconds)."""
    total = int(await command("ZCARD", key))
    if total == 0:
        return None
    head = await command("ZRANGE", key, "0", str(QUEUE_READ - 1), "WITHSCORES")
    deadlines: list[int] = []
    tenants: set[str] = set()
    expired, first, round_ = 0, None, None
    for i in range(0, len(head) - 1, 2):
        parts = _text(head[i]).split("|")
        if len(parts) != 4 or not parts[1].isdigit():
            raise ValueError(f"{key!r} holds no ticket: {_text(head[i])[:40]!r}")
        deadline = int(parts[1])
        if deadline <= now_ms:
            expired += 1
            continue
        if first is None:
            first, round_ = deadline, int(float(_text(head[i + 1])))
        deadlines.append(deadline)
        tenants.add(parts[3])
    return {"tickets": total - expired, "expired": expired, "tenants": len(tenants),
            "head_round": round_, "first_deadline_ms": first,
            "soonest_deadline_ms": min(deadlines, default=None),
            "latest_deadline_ms": max(deadlines, default=None)}


_CLASS_SUFFIX = re.compile(r":class=([A-Za-z0-9_.\-]{1,64})(:w)?\Z")


@dataclass(frozen=True)
class ClassKey:
    """A class's companion log of a shared cap's window (lib/shares.lua)."""

    window: KeyName  # the cap's window (kind "shared")
    klass: str  # the class (a tier)
    weights: bool  # its weights hash ("...:w"), not its entries


def class_key(name: str, prefix: str, hash_tag: bool) -> ClassKey | None:
    """What a class's companion key says ("{cap window key}:class={class}[:w]"), or None
    for any other name (rl_key_read does not read these: they are read here)."""
    match = _CLASS_SUFFIX.search(name)
    if match is None:
        return None
    window = parse_key(name[:match.start()], prefix, hash_tag)
    if window is None or window.kind != "shared":
        return None
    return ClassKey(window, match[1], match[2] is not None)


async def read_class_use(command: Command, key: str, window_ms: int, now_ms: int,
                         pages: int = 64) -> tuple[int, bool]:
    """A class's use of a cap's window at now_ms (lib/shares.lua's class_used, without its
    trim): the costs of its entries after now - window_ms, read by pages of 64 entries (the
    longest reply of the limiter's connections), at most `pages` pages. Returns (use,
    complete): complete False when there were more."""
    used, start = 0, 0
    for _ in range(pages):
        members = await command("ZRANGEBYSCORE", key, f"({now_ms - window_ms}", "+inf",
                                "LIMIT", str(start), "64")
        if not members:
            return used, True
        costs = await command("HMGET", f"{key}:w", *members)
        used += sum(int(_text(c)) for c in costs if c is not None)
        if len(members) < 64:
            return used, True
        start += 64
    return used, False
