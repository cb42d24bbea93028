"""The command line: `python -m genai_ratelimit` (or `genai-ratelimit`), for the people who
operate a limiter: why was a user refused and when may they retry, what a user holds in
flight and in its route / model budgets, how full an upstream's shared cap is, reset a
quota, who is closest to their limits, and a quick manual decision.

    genai-ratelimit inspect USER [--tier T] [--upstream NAME]...
                                            every budget of a user: windows (requests and
                                            tokens), route / model scopes, in-flight leases,
                                            namespaces, calendar budgets; upstream caps with
                                            the provider's view (writes nothing)
    genai-ratelimit reset USER [--window S]...  forget the user's entries (all windows by default)
    genai-ratelimit top [--tier T | --tier USER=T]... [-n N] [--max-keys K]
                                            users closest to their limits, by the fullest of
                                            their request and token windows; upstream caps
                                            with the provider's view; calendar budgets, the
                                            most used first (bounded SCAN of every master)
    genai-ratelimit check USER [--tier T] [--cost N] [--tokens N]
                                            one real decision (logged when allowed)

Options go before or after the command. Redis: --url, else $REDIS_URL, else
redis://localhost:6379/0. Budgets: --tiers FILE, else the file $GENAI_RATELIMIT_TIERS names,
else TIER_LIMITS and TIER_TOKEN_LIMITS. --json: JSON instead of a table (every command).

Exit codes: 0 done (check: allowed), 1 check refused, 2 usage or configuration error (a bad
URL or tiers file, an unknown tier, a command the Redis ACL user may not run), 3 Redis
unavailable (unreachable, timed out, refused).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, NoReturn, TextIO
from urllib.parse import urlsplit, urlunsplit

from . import _native
from ._keyspace import (
    SCAN_COUNT,
    Identity,
    KeyName,
    ScanReport,
    Storage,
    class_key,
    glob_escape,
    identity_of,
    node_url,
    parse_key,
    queue_key,
    quoted,
    read_bucket,
    read_budget,
    read_class_use,
    read_leases,
    read_queue,
    read_upstream,
    scan,
    shown,
    tagged,
    upstream_key,
    user_key_pattern,
)
from ._native import RateLimiterError
from ._tiers_config import (
    SCOPE_BUDGET_KEYS,
    SCOPE_SECTIONS,
    TIERS_FILE_ENV,
    TierConfigError,
    load_tier_config,
    max_in_flight_of_tiers,
    scope_sections_of,
    token_limits_of_tiers,
)
from ._url import RedisOptions, parse_redis_url
from .aio import AsyncRateLimiter
from .limiter import RateLimiter
from .reservation import Scope
from .tiers import DEFAULT_TIER, TIER_LIMITS, TIER_TOKEN_LIMITS

__all__ = ["main"]

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3

# Budget key -> window length in seconds (the FastAPI dependencies' windows).
WINDOW_OF = {"per_minute": 60, "per_day": 86_400}
# Peeks sent at once (top): pipelined on the limiter's connections.
PEEKS_AT_ONCE = 64
# A window whose limit the command line does not know (a namespace's, a route's): peeked
# with the largest limit, so that what it reports is what the window holds.
UNKNOWN_LIMIT = _native.MAX_LIMIT
OPERATOR_ACL = "docs/security.md, \"An operator's ACL user\""

Windows = list[tuple[int, int]]
# Windows whose limit may be unknown (None): a route's, a namespace's, an upstream's
# without a [upstreams] table.
Known = list[tuple[int | None, int]]
# (window_seconds, is_token_window) -> limit, None when unknown.
Limits = dict[tuple[int, bool], int | None]
# The storages whose keys were found for a window: (kind, owner, scope, seconds, tokens) ->
# the storages (a switch of storage leaves a window's keys in both until they expire).
Held = dict[tuple[str, str, str | None, int, bool], set[Storage]]
STORAGES: tuple[Storage, ...] = ("zset", "compact")


class UsageError(Exception):
    """A configuration problem the user must fix: exit 2."""


# ------------------------------------------------------------------------------ budgets

@dataclass
class Budgets:
    """What the tiers file (or the defaults) says."""

    requests: dict[str, dict[str, int]]  # tier -> {"per_minute": n, "per_day": n}
    tokens: dict[str, dict[str, int]]  # tier -> token budget (TIER_TOKEN_LIMITS' shape)
    max_in_flight: dict[str, int] = field(default_factory=dict)
    models: dict[str, dict[str, int]] = field(default_factory=dict)  # model -> scope budget
    upstreams: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> scope budget

    def tier(self, name: str) -> str:
        if name not in self.requests:
            raise UsageError(f"unknown tier {name!r}: one of {', '.join(sorted(self.requests))}")
        return name

    def windows(self, tier: str) -> tuple[Windows, Windows]:
        """The tier's (limit, window_seconds) request and token windows (a minute budget
        with a burst is a GCRA bucket, not a window: Budgets.bucket)."""
        request_budget = self.requests[tier]
        token_budget = self.tokens.get(tier) or self.tokens.get(DEFAULT_TIER) or {}
        bucket = self.bucket(tier)
        return ([(request_budget[k], s) for k, s in WINDOW_OF.items()
                 if k in request_budget and (bucket is None or s != bucket[1])],
                [(token_budget[k], s) for k, s in WINDOW_OF.items() if k in token_budget])


    def bucket(self, tier: str) -> tuple[int, int, int] | None:
        """The tier's minute budget as GCRA, (per_minute, 60, burst), when it has a burst."""
        budget = self.requests[tier]
        if "burst" not in budget or "per_minute" not in budget:
            return None
        return budget["per_minute"], 60, budget["burst"]


def _budgets(args: argparse.Namespace) -> Budgets:
    path = args.tiers or os.environ.get(TIERS_FILE_ENV) or None
    if not path:
        return Budgets(dict(TIER_LIMITS), dict(TIER_TOKEN_LIMITS))
    try:
        data, where = load_tier_config(path)
        tables: dict[str, Any] = dict(data)  # type: ignore[call-overload]
        models, upstreams = scope_sections_of(data, where)
        return Budgets({t: b for t, b in tables.items() if t not in SCOPE_SECTIONS},
                       token_limits_of_tiers(data, where), max_in_flight_of_tiers(data, where),
                       models, {name: section[0] for name, section in upstreams.items()})
    except TierConfigError as exc:
        raise UsageError(str(exc)) from None


def _scope_limits(budget: dict[str, int]) -> Limits:
    """A scope budget's limits by (window_seconds, is_token_window)."""
    return {(seconds, tokens): budget[key] for key, (seconds, tokens) in SCOPE_BUDGET_KEYS.items()
            if key in budget}


def _split(limits: Limits) -> tuple[Known, Known]:
    """Limits as (limit, seconds) request and token windows, shortest first."""
    windows = sorted(limits)
    return ([(limits[w], w[0]) for w in windows if not w[1]],
            [(limits[w], w[0]) for w in windows if w[1]])


def _user_tiers(args: argparse.Namespace, budgets: Budgets) -> tuple[str, dict[str, str]]:
    """--tier T (everyone's) and --tier USER=T (one user's, by the app's user id or the key's
    id): (the default tier, {user: tier})."""
    default, named = DEFAULT_TIER, {}
    for value in args.tier or []:
        user, equals, tier = value.rpartition("=")
        if equals:
            named[user] = budgets.tier(tier)
        else:
            default = budgets.tier(value)
    return default, named


# ------------------------------------------------------------------------------ output

def _time(ms: int | None) -> str:
    if ms is None:
        return "-"
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def _local_time(ms: int | None) -> str:
    """A unix ms in the machine's time zone, ISO 8601 with its offset."""
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).astimezone().isoformat(
        timespec="seconds")


def _print_table(rows: list[list[str]], out: TextIO, left: int = 2) -> None:
    """Columns padded; the first `left` ones to the left, the others to the right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.ljust(w) if i < left else cell.rjust(w)
                            for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip() + "\n")


def _json(value: Any, out: TextIO) -> int:
    json.dump(value, out)
    out.write("\n")
    return EXIT_OK


def _resource(tokens: bool) -> str:
    return "tokens" if tokens else "requests"


def _retry(window: dict[str, Any]) -> str:
    return f"{window['retry_after_s']} s" if window.get("retry_after_s") else "-"


def _limit(window: dict[str, Any]) -> str:
    return "?" if window["limit"] is None else str(window["limit"])


# ------------------------------------------------------------------------------ limiters

def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {"key_prefix": args.key_prefix, "connect_timeout": args.timeout,
            "socket_timeout": args.timeout}


def _url(args: argparse.Namespace) -> str:
    """--url, else $REDIS_URL, else the default (what a limiter given no URL reads), kept in
    args.url for the commands' other limiters."""
    args.url = args.url or os.environ.get("REDIS_URL") or "redis://localhost:6379/0"
    return str(args.url)


def _redis_options(args: argparse.Namespace) -> RedisOptions:
    return parse_redis_url(_url(args))


def _without_storage(url: str) -> str:
    """The URL without its storage= query parameter (a limiter of the other storage)."""
    parts = urlsplit(url)
    query = "&".join(p for p in parts.query.split("&") if p and not p.startswith("storage="))
    return urlunsplit(parts._replace(query=query))


def _other_storage_name(limiter: RateLimiter | AsyncRateLimiter) -> str:
    return "compact" if limiter.storage == "zset" else "zset"


def _other_storage(limiter: RateLimiter | AsyncRateLimiter, args: argparse.Namespace,
                   kind: type[Any]) -> Any:
    """A limiter like `limiter` (a RateLimiter or AsyncRateLimiter: `kind`) of the other
    storage: the command line reads each key with the storage its name says."""
    return kind(_without_storage(_url(args)), storage=_other_storage_name(limiter), **_options(args))


@dataclass
class Masters:
    """The limiter (it routes peeks on a cluster, and knows the slot map), one of each
    storage for the peeks (each key is read with the storage its name says, whatever the
    URL's), and a limiter per master (SCAN, the raw read). Every SCAN's keys are noted
    (held): which storage holds each window."""

    limiter: AsyncRateLimiter
    nodes: dict[tuple[str, int] | None, AsyncRateLimiter]  # None: the URL's single node
    peekers: dict[str, AsyncRateLimiter]  # storage -> its limiter (the URL's is `limiter`)
    prefix: str
    hash_tag: bool
    held: Held = field(default_factory=dict)

    @property
    def scanned(self) -> list[tuple[str, Any]]:
        """(name, SCAN-able command) of every master."""
        return [("" if address is None else f"{address[0]}:{address[1]}", node._command)
                for address, node in self.nodes.items()]

    async def scan(self, pattern: str, max_keys: int) -> ScanReport:
        report = await scan(self.scanned, pattern, max_keys)
        for key in (parse_key(k, self.prefix, self.hash_tag) for k in report.keys):
            if key is not None and key.kind not in ("leases", "gcra", "budget"):
                self.held.setdefault((key.kind, key.owner, key.scope, key.seconds, key.tokens),
                                     set()).add(key.storage)
        return report

    def storages(self, kind: str, owner: str, scope: str | None, seconds: int,
                 tokens: bool) -> list[Storage]:
        """The storages whose keys hold that window (sorted sets first). None found (the
        window is empty in both): the storage of the owner's other keys, else the URL's."""
        found = self.held.get((kind, owner, scope, seconds, tokens))
        if found:
            return [s for s in STORAGES if s in found]
        others = self.owner_storages(owner, None)
        return others if len(others) == 1 else [self.url_storage]

    def owner_storages(self, owner: str, kind: str | None = "window") -> list[Storage]:
        """The storages of the owner's keys of that kind (None: any) that the SCANs found
        (none: the URL's)."""
        found = {s for (each, who, _, _, _), held in self.held.items()
                 if who == owner and kind in (None, each) for s in held}
        return [s for s in STORAGES if s in found] or [self.url_storage]

    @property
    def url_storage(self) -> Storage:
        return "compact" if self.limiter.storage == "compact" else "zset"

    async def aclose(self) -> None:
        for node in self.nodes.values():
            if node is not self.limiter:
                await node.aclose()
        for peeker in self.peekers.values():
            if peeker is not self.limiter:
                await peeker.aclose()
        await self.limiter.aclose()


async def _masters(args: argparse.Namespace, options: RedisOptions) -> Masters:
    limiter = AsyncRateLimiter(args.url, **_options(args))
    peekers = {limiter.storage: limiter}
    try:
        peekers[_other_storage_name(limiter)] = _other_storage(limiter, args, AsyncRateLimiter)
        # The limiter's own router: every sentinel asked, the highest config epoch.
        masters = await limiter._masters()
    except BaseException:
        for peeker in peekers.values():
            await peeker.aclose()
        raise
    hash_tag = options.mode == "cluster"
    if masters is None:
        return Masters(limiter, {None: limiter}, peekers, args.key_prefix, hash_tag)
    nodes: dict[tuple[str, int] | None, AsyncRateLimiter] = {
        address: AsyncRateLimiter(node_url(args.url, address[0], address[1], options.db),
                                  **_options(args))
        for address in sorted(masters)}
    return Masters(limiter, nodes, peekers, args.key_prefix, hash_tag)



def _window_row(peek: Sequence[Any], limit: int | None, scope: str | None,
                storage: str) -> dict[str, Any]:
    """The one window of a peek as a JSON-able row: used, limit (None: unknown), what would
    remain after one more request (or token), the oldest entry, the wait when full, and the
    storage whose key it read."""
    _, seconds, tokens, used, oldest = peek[6][0]
    return {"window_seconds": seconds, "resource": _resource(tokens), "tokens": tokens,
            "scope": scope, "used": used, "limit": limit,
            "remaining": None if limit is None else peek[1], "allowed": peek[0],
            "oldest_ms": oldest, "retry_after_s": peek[2], "now_ms": peek[5], "storage": storage}


async def _peek_windows(masters: Masters, user: str, requests: Known, tokens: Known,
                        scope: tuple[str, bool] | None = None) -> list[dict[str, Any]]:
    """One peek per window (each answers for that window alone: a peek of several stops at
    the first that refuses, as a check does) and per storage whose keys hold it (the URL's
    when none does); `scope`: (name, shared), the windows are that scope's."""
    kind = "window" if scope is None else "shared" if scope[1] else "scope"
    scope_name = scope[0] if scope is not None and not scope[1] else None
    rows = []
    for windows, is_tokens in ((requests, False), (tokens, True)):
        for limit, seconds in windows:
            for storage in masters.storages(kind, user, scope_name, seconds, is_tokens):
                limiter = masters.peekers[storage]
                one = [(limit if limit is not None else UNKNOWN_LIMIT, seconds)]
                arguments: dict[str, Any] = {"tokens": 1} if is_tokens else {}
                if scope is not None:
                    native = Scope(scope[0], windows=[] if is_tokens else one,
                                   token_windows=one if is_tokens else [], shared=scope[1])
                    peek = await limiter._peek(user, [], scopes=(native.native(),), **arguments)
                elif is_tokens:
                    peek = await limiter._peek(user, (), token_windows=one, **arguments)
                else:
                    peek = await limiter._peek(user, one)
                rows.append(_window_row(peek, limit, scope[0] if scope is not None else None,
                                        storage))
    return rows


def _window_cell(row: dict[str, Any], rows: Iterable[dict[str, Any]]) -> str:
    """A row's window as the tables show it: its storage named when another row is of the
    same window in the other storage."""
    same = sum(1 for r in rows if (r["window_seconds"], r["resource"], r["scope"]) ==
               (row["window_seconds"], row["resource"], row["scope"]))
    return f"{row['window_seconds']} s" + (f" ({row['storage']})" if same > 1 else "")


# ------------------------------------------------------------------------------ inspect

def inspect(args: argparse.Namespace, out: TextIO) -> int:
    """Every budget of a user, as Redis holds it now. Writes nothing."""
    budgets = _budgets(args)
    default, named = _user_tiers(args, budgets)
    identity = identity_of(args.user)
    tier = named.get(identity.user, named.get(args.user, default))
    report = asyncio.run(_inspect(args, budgets, tier, identity))
    if args.json:
        return _json(report, out)
    out.write(f"user {quoted(args.user)}{_identity_text(identity)}, tier {tier}, Redis time "
              f"{_time(report['now_ms'])}\n")
    table = [["window", "resource", "scope", "used", "limit", "oldest entry (UTC)", "retry after"]]
    rows = report["windows"] + report["scopes"]
    for w in rows:
        table.append([_window_cell(w, rows), w["resource"], shown(w["scope"] or "-"),
                      str(w["used"]), _limit(w), _time(w["oldest_ms"]), _retry(w)])
    _print_table(table, out, left=3)
    for bucket in report["buckets"]:
        budget = (f"{bucket['rate']} per {bucket['period_seconds']} s, burst {bucket['burst']}"
                  if bucket["rate"] is not None else "rate and burst: the app's")
        state = ("full" if bucket["full_at_ms"] is None
                 else f"full again at {_time(bucket['full_at_ms'])}")
        out.write(f"GCRA bucket {bucket['period_seconds']} s ({budget}): {state}\n")
    for spend in report["budgets"]:
        out.write(f"budget {quoted(spend['name'])} from {_time(spend['period_start_ms'])}: spent "
                  f"{spend['spent']}, held {spend['held']} ({spend['holds']} in flight), key "
                  f"expires {_time(spend['expires_ms'])}\n")
    leases = report["leases"]
    cap = "no cap" if leases["max_in_flight"] is None else f"of {leases['max_in_flight']}"
    soonest = f", soonest expiry {_time(leases['expires_ms'][0])}" if leases["expires_ms"] else ""
    out.write(f"in flight: {leases['held']} ({cap}){soonest}\n")
    for upstream in report["upstreams"]:
        out.write(f"upstream {quoted(upstream['name'])} (shared by every user):\n")
        _print_table([["window", "resource", "used", "limit", "oldest entry (UTC)", "retry after"]]
                     + [[_window_cell(w, upstream["windows"]), w["resource"], str(w["used"]),
                         _limit(w), _time(w["oldest_ms"]), _retry(w)]
                        for w in upstream["windows"]], out)
        out.write(_provider_text(upstream["provider"], report["now_ms"]))
        out.write(_queue_text(upstream["queue"], report["now_ms"]))
        out.write(_classes_text(upstream["classes"]))
    for namespace in report["namespaces"]:
        windows = ", ".join(f"{w['window_seconds']} s {w['resource']} {w['used']}"
                            for w in namespace["windows"])
        out.write(f"namespace {quoted(namespace['namespace'])}: {windows} (its budget is the "
                  "app's: used only)\n")
    out.write(_scan_line(report["scan"]))
    return EXIT_OK


async def _inspect(args: argparse.Namespace, budgets: Budgets, tier: str,
                   identity: Identity) -> dict[str, Any]:
    options = _redis_options(args)
    hash_tag = options.mode == "cluster"
    masters = await _masters(args, options)
    try:
        # The user's keys, found by one SCAN: the storage of each window, its scopes, the
        # same id in namespaces.
        found = await masters.scan(user_key_pattern(args.key_prefix, args.user, hash_tag, True),
                                   args.max_keys)
        keys = [k for k in (parse_key(n, args.key_prefix, hash_tag) for n in found.keys)
                if k is not None]
        requests, tokens = budgets.windows(tier)
        windows = await _peek_windows(masters, args.user, list(requests), list(tokens))
        if windows:
            now = windows[0]["now_ms"]
        else:  # a tier whose only budget is a GCRA bucket: Redis's clock, as a peek reads it
            seconds, micros = await masters.limiter._command("TIME")
            now = int(seconds) * 1000 + int(micros) // 1000
        scope_rows: list[dict[str, Any]] = []
        for name, limits in _scopes_of([k for k in keys if k.owner == args.user], budgets):
            scope_rows += await _peek_windows(masters, args.user, *_split(limits), (name, False))
        leases = await _leases(args, masters, hash_tag, now)
        buckets = await _buckets(args, masters, hash_tag, keys, budgets.bucket(tier), now)
        spend = await _calendar_budgets(args, masters, hash_tag, found.keys, now)
        upstreams, scans = [], [found]
        for name in args.upstream:
            limits, upstream_scan = await _upstream_limits(args, masters, budgets, name, hash_tag)
            scans.append(upstream_scan)
            upstreams.append({"name": name, "windows": await _peek_windows(
                masters, name, *_split(limits), (name, True)),
                "provider": await _provider_view(args, masters, name, hash_tag),
                "queue": await _queue_view(args, masters, name, hash_tag, now),
                "classes": await _class_rows(args, masters, upstream_scan.keys, name,
                                             hash_tag, now)})
        namespaces = await _namespaces_of(masters, args.user, keys)
    finally:
        await masters.aclose()
    return {"user": args.user, "identity": _identity_json(identity), "tier": tier,
            "now_ms": now, "windows": windows, "scopes": scope_rows, "buckets": buckets,
            "budgets": spend,
            "leases": {**leases, "max_in_flight": budgets.max_in_flight.get(tier)},
            "upstreams": upstreams, "namespaces": namespaces, "scan": _scan_json(*scans)}


def _scopes_of(keys: list[KeyName], budgets: Budgets) -> list[tuple[str, Limits]]:
    """The user's scopes found in its keys, each with its windows' limits where the tiers
    file gives them (a model's; a route's budget lives in the app: unknown)."""
    found: dict[str, Limits] = {}
    for key in keys:
        if key.kind == "scope" and key.scope is not None:
            found.setdefault(key.scope, {})[(key.seconds, key.tokens)] = None
    scopes = []
    for name in sorted(found):
        model = budgets.models.get(name[len("model:"):]) if name.startswith("model:") else None
        scopes.append((name, found[name] | _scope_limits(model or {})))
    return scopes


async def _upstream_limits(args: argparse.Namespace, masters: Masters, budgets: Budgets,
                           name: str, hash_tag: bool) -> tuple[Limits, ScanReport]:
    """An upstream's windows: the tiers file's, and any other its keys show."""
    limits = _scope_limits(budgets.upstreams.get(name, {}))
    found = await masters.scan(user_key_pattern(args.key_prefix, name, hash_tag), args.max_keys)
    for key in (parse_key(k, args.key_prefix, hash_tag) for k in found.keys):
        if key is not None and key.kind == "shared" and key.owner == name:
            limits.setdefault((key.seconds, key.tokens), None)
    if not limits:
        raise UsageError(f"no upstream {name!r}: not in the tiers file's [upstreams] and no key "
                         "of it in Redis")
    return limits, found


async def _node_of(masters: Masters, key: str, hash_tag: bool) -> Any:
    """The master that holds `key`."""
    node = masters.nodes.get(None)
    if node is None and hash_tag:  # a cluster: the master of the key's slot
        slot = int(await masters.limiter._command("CLUSTER", "KEYSLOT", key))
        node = masters.nodes.get(masters.limiter._destination(slot))
    elif node is None:  # Sentinel: the one master
        node = next(iter(masters.nodes.values()), None)
    if node is None:
        raise RateLimiterError(f"no master of the cluster serves {key!r}")
    return node


async def _leases(args: argparse.Namespace, masters: Masters, hash_tag: bool,
                  now_ms: int) -> dict[str, Any]:
    """The user's in-flight leases, read on the master that holds their key."""
    key = f"{args.key_prefix}:{tagged(args.user, hash_tag)}:leases"
    node = await _node_of(masters, key, hash_tag)
    held, expires = await read_leases(node._command, key, now_ms)
    return {"key": key, "held": held, "expires_ms": expires}


async def _buckets(args: argparse.Namespace, masters: Masters, hash_tag: bool,
                   keys: list[KeyName], bucket: tuple[int, int, int] | None,
                   now_ms: int) -> list[dict[str, Any]]:
    """The user's GCRA buckets: the tier's (a burst) and every other the SCAN found, each with
    when it is full again (None: it is full now)."""
    periods = sorted({k.seconds for k in keys if k.kind == "gcra" and k.owner == args.user} |
                     ({bucket[1]} if bucket is not None else set()))
    rows = []
    for period in periods:
        key = f"{args.key_prefix}:{tagged(args.user, hash_tag)}:{period}:gcra"
        full_at = await read_bucket((await _node_of(masters, key, hash_tag))._command, key)
        tier_rate = bucket is not None and bucket[1] == period
        rows.append({"period_seconds": period, "key": key,
                     "rate": bucket[0] if tier_rate and bucket else None,
                     "burst": bucket[2] if tier_rate and bucket else None,
                     "full_at_ms": full_at if full_at is not None and full_at > now_ms else None})
    return rows


async def _calendar_budgets(args: argparse.Namespace, masters: Masters, hash_tag: bool,
                            names: list[str], now_ms: int) -> list[dict[str, Any]]:
    """The user's calendar budgets the SCAN found (docs/spend-budgets.md), one row per
    budget and period: spent, held, the holds in flight and when the key expires. Read raw,
    as the leases are (the limit and the period are the app's)."""
    found = [(name, key) for name, key in ((n, parse_key(n, args.key_prefix, hash_tag))
                                           for n in names)
             if key is not None and key.kind == "budget" and key.owner == args.user]
    rows = []
    for name, key in sorted(found, key=lambda pair: (pair[1].scope or "", pair[1].seconds)):
        command = (await _node_of(masters, name, hash_tag))._command
        read = await read_budget(command, name)
        if read is None:  # expired since the SCAN
            continue
        ttl = int(await command("PTTL", name))
        rows.append({"name": key.scope, "key": name, "period_start_ms": key.seconds,
                     "spent": read["spent"], "held": read["held"], "holds": read["holds"],
                     "expires_ms": now_ms + ttl if ttl >= 0 else None})
    return rows


async def _namespaces_of(masters: Masters, user: str,
                         keys: list[KeyName]) -> list[dict[str, Any]]:
    """The same user id's windows in each namespace its keys show (used only: a namespace's
    budget lives in the app)."""
    found: dict[str, Limits] = {}
    for key in keys:
        identity = identity_of(key.owner)
        if key.kind == "window" and identity.namespace is not None and \
                key.owner == f"ns:{identity.namespace}:{user}":
            found.setdefault(key.owner, {})[(key.seconds, key.tokens)] = None
    result = []
    for owner in sorted(found):
        rows = await _peek_windows(masters, owner, *_split(found[owner]))
        result.append({"namespace": identity_of(owner).namespace, "user": owner, "windows": rows})
    return result


def _identity_text(identity: Identity) -> str:
    """What the FastAPI layer's identity means, when it is more than the id itself."""
    who = (f"anonymous client {quoted(identity.user)}" if identity.kind == "anonymous"
           else f"user id {quoted(identity.user)}")
    if identity.namespace is not None:
        return f" ({who} in namespace {quoted(identity.namespace)})"
    return f" ({who})" if identity.user != identity.key else ""


def _identity_json(identity: Identity) -> dict[str, Any]:
    return {"user": identity.user, "kind": identity.kind, "namespace": identity.namespace}


def _scan_json(*reports: ScanReport) -> dict[str, Any]:
    first = reports[0]
    return {"masters": first.masters, "count": SCAN_COUNT,
            "max_calls_per_master": first.max_calls_per_master,
            "calls": sum(r.calls for r in reports), "keys": sum(len(r.keys) for r in reports),
            "complete": all(r.complete for r in reports)}


def _scan_line(scan_report: dict[str, Any]) -> str:
    masters = len(scan_report["masters"])
    state = ("complete" if scan_report["complete"] else
             "INCOMPLETE: raise --max-keys to see every key")
    return (f"({scan_report['keys']} keys found by {scan_report['calls']} SCAN calls of COUNT "
            f"{scan_report['count']} on {masters} master{'s' if masters != 1 else ''}, at most "
            f"{scan_report['max_calls_per_master']} per master per pattern; {state})\n")


# ------------------------------------------------------------------------------ reset

def reset(args: argparse.Namespace, out: TextIO) -> int:
    """Forgets the user's entries: the windows named, or every window of the user."""
    with RateLimiter(args.url, **_options(args)) as limiter:
        if args.window:
            # Each storage's keys of those windows (every window: reset.lua finds both).
            removed = 0
            with _other_storage(limiter, args, RateLimiter) as other:
                for each in (limiter, other):
                    removed += each.reset(args.user, [(1, s) for s in args.window],
                                          token_windows=[(1, s) for s in args.window])
        else:
            removed = limiter.reset(args.user)
    if args.json:
        return _json({"user": args.user, "windows": args.window or None, "removed": removed}, out)
    what = ", ".join(f"{s} s" for s in args.window) if args.window else "every window"
    out.write(f"reset {quoted(args.user)} ({what}): {removed} entries removed\n")
    return EXIT_OK


# ------------------------------------------------------------------------------ check

def check(args: argparse.Namespace, out: TextIO) -> int:
    """One real decision against the tier's request windows (and its token windows with
    --tokens): logged when allowed."""
    budgets = _budgets(args)
    default, named = _user_tiers(args, budgets)
    tier = named.get(identity_of(args.user).user, named.get(args.user, default))
    requests, tokens = budgets.windows(tier)
    bucket = budgets.bucket(tier)
    with RateLimiter(args.url, **_options(args)) as limiter:
        if args.tokens is None and bucket is not None:  # the app's decision: one call
            allowed, remaining, retry, window = limiter.check_windows_detailed(
                args.user, requests, cost=args.cost, gcra=bucket)
            resource = "requests"
        elif args.tokens is None:
            allowed, remaining, retry, window = limiter.check_windows(args.user, requests,
                                                                      cost=args.cost)
            resource = "requests"
        else:
            if not tokens:
                raise UsageError(f"tier {tier!r} has no token budget")
            if bucket is not None:
                raise UsageError(f"tier {tier!r} has a burst: TokenRateLimit refuses it, so "
                                 "no token decision has one (docs/gcra.md)")
            r = limiter.reserve(args.user, requests, cost=args.cost, token_windows=tokens,
                                tokens=args.tokens)
            allowed, remaining, retry, window, resource = (r.allowed, r.remaining,
                                                           r.retry_after_s, r.window_seconds,
                                                           r.resource)
    if args.json:
        _json({"allowed": allowed, "remaining": remaining, "retry_after_s": retry,
               "window_seconds": window, "resource": resource, "tier": tier}, out)
    elif allowed:
        out.write(f"allowed: {remaining} {resource} left in the {window} s window\n")
    else:
        out.write(f"refused by the {window} s {resource} window: retry after {retry} s\n")
    return EXIT_OK if allowed else EXIT_REFUSED


# ------------------------------------------------------------------------------ top

def top(args: argparse.Namespace, out: TextIO) -> int:
    """The users closest to their limits, among the keys a bounded SCAN finds."""
    budgets = _budgets(args)
    default, named = _user_tiers(args, budgets)
    report = asyncio.run(_top(args, budgets, default, named))
    if args.json:
        return _json(report, out)
    users = report["users"]
    out.write(f"users closest to their limits ({len(users)} shown; default tier {default}):\n")
    table = [["user", "kind", "tier", "fullest window", "used", "limit", "use", "retry after"]]
    for u in users:
        table.append([shown(u["user"]), u["kind"], u["tier"],
                      f"{u['window_seconds']} s {u['resource']}", str(u["used"]), str(u["limit"]),
                      f"{100 * u['fraction']:.0f}%", _retry(u)])
    _print_table(table, out, left=4)
    for namespace in report["namespaces"]:
        out.write(f"namespace {quoted(namespace['namespace'])} (its budget is the app's: used "
                  "only; the most used first):\n")
        rows = [["user", "kind", "shortest window", "used"]]
        rows += [[shown(u["user"]), u["kind"], f"{u['window_seconds']} s {u['resource']}",
                  str(u["used"])] for u in namespace["users"]]
        _print_table(rows, out, left=3)
    if report["upstreams"]:
        out.write("upstream caps (shared by every user):\n")
        rows = [["upstream", "window", "used", "limit", "use"]]
        for u in report["upstreams"]:
            for w in u["windows"]:
                rows.append([shown(u["name"]), f"{w['window_seconds']} s {w['resource']}",
                             str(w["used"]), _limit(w),
                             "-" if w["limit"] is None else f"{100 * w['used'] / w['limit']:.0f}%"])
        _print_table(rows, out)
        for u in report["upstreams"]:
            out.write(f"{quoted(u['name'])} {_provider_text(u['provider'], report['now_ms'])}")
            out.write(f"{quoted(u['name'])} {_queue_text(u['queue'], report['now_ms'])}")
            if u["classes"]:
                out.write(f"{quoted(u['name'])} {_classes_text(u['classes'])}")
    if report["budgets"]:
        out.write("calendar budgets, the most used first (limits and periods are the app's; "
                  "times local):\n")
        rows = [["owner", "budget", "period from", "spent", "held", "holds", "key until"]]
        rows += [[shown(b["owner"]), shown(b["name"] or "-"), _local_time(b["period_start_ms"]),
                  str(b["spent"]), str(b["held"]), str(b["holds"]),
                  _local_time(b["until_ms"] or None)] for b in report["budgets"]]
        _print_table(rows, out, left=3)
    out.write(_scan_line(report["scan"]))
    return EXIT_OK


async def _top(args: argparse.Namespace, budgets: Budgets, default: str,
               named: dict[str, str]) -> dict[str, Any]:
    options = _redis_options(args)
    hash_tag = options.mode == "cluster"
    masters = await _masters(args, options)
    try:
        found = await masters.scan(glob_escape(args.key_prefix) + ":*", args.max_keys)
        seconds, micros = await masters.limiter._command("TIME")
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        owners: dict[str, Limits] = {}  # user -> the own windows its keys show
        shared: dict[str, Limits] = {}  # upstream -> its windows
        spend: list[str] = []  # the budget keys found
        for name, key in ((k, parse_key(k, args.key_prefix, hash_tag)) for k in found.keys):
            if key is None or not _usable(key.owner):
                continue
            if key.kind == "shared":
                shared.setdefault(key.owner, {})[(key.seconds, key.tokens)] = None
                continue
            if key.kind == "budget":  # an org's or a team's budget is no user: listed apart
                spend.append(name)
                continue
            windows = owners.setdefault(key.owner, {})  # a user, whatever key shows it
            if key.kind == "window":
                windows[(key.seconds, key.tokens)] = None
        plain: list[str] = []
        spaced: list[str] = []
        for owner in sorted(owners):
            (spaced if identity_of(owner).namespace is not None else plain).append(owner)
        users = await _rank_users(masters, plain, budgets, default, named)
        namespaces = await _rank_namespaces(masters, spaced, owners)
        upstreams = await _upstream_rows(args, masters, shared, budgets, hash_tag, found.keys,
                                         now_ms)
        spending = await _spend_rows(args, masters, spend, hash_tag)
    finally:
        await masters.aclose()
    return {"users": users[:args.count], "namespaces": namespaces, "upstreams": upstreams,
            "budgets": spending[:args.count], "now_ms": now_ms,
            "scan": _scan_json(found), "keys_examined": len(found.keys)}


async def _spend_rows(args: argparse.Namespace, masters: Masters, names: list[str],
                      hash_tag: bool) -> list[dict[str, Any]]:
    """The calendar budgets the SCAN found (every owner's: a user's, an org's, a team's),
    each read raw (read_budget), the most used (spent + held) first."""
    rows: list[dict[str, Any]] = []
    for name in names:
        key = parse_key(name, args.key_prefix, hash_tag)
        assert key is not None
        read = await read_budget((await _node_of(masters, name, hash_tag))._command, name)
        if read is None:  # expired since the SCAN
            continue
        rows.append({"owner": key.owner, "name": key.scope, "key": name,
                     "period_start_ms": key.seconds, "spent": read["spent"],
                     "held": read["held"], "holds": read["holds"], "until_ms": read["until_ms"]})
    rows.sort(key=lambda r: (-int(r["spent"] + r["held"]), str(r["owner"]), str(r["name"] or ""),
                             int(r["period_start_ms"])))
    return rows


async def _provider_view(args: argparse.Namespace, masters: Masters, name: str,
                         hash_tag: bool) -> dict[str, Any] | None:
    """A shared cap's provider view (read_upstream), with its key; None when nobody
    observed the provider within its bound."""
    key = upstream_key(args.key_prefix, name, hash_tag)
    view = await read_upstream((await _node_of(masters, key, hash_tag))._command, key)
    return None if view is None else {"key": key, **view}


def _provider_text(view: dict[str, Any] | None, now_ms: int) -> str:
    """A provider view as one line: what the provider said it has left until its reset
    (a reset already past: it has its limit again), and whether it closed the cap."""
    if view is None:
        return "provider: not observed\n"
    parts = []
    for resource in ("requests", "tokens"):
        left, reset, limit = view[resource], view[f"{resource}_reset"], view[f"{resource}_limit"]
        if left is None:
            continue
        of = "" if limit is None else f" of {limit}"
        when = ("reset passed" if reset is not None and reset <= now_ms
                else f"reset {_time(reset)}")
        parts.append(f"{resource} {left}{of} left ({when})")
    if view["requests_sent"]:
        parts.append(f"{view['requests_sent']} sent, not observed yet")
    closed = view["closed_until"]
    parts.append(f"CLOSED until {_time(closed)}" if closed is not None and closed > now_ms
                 else "open")
    return f"provider: {', '.join(parts)}\n"


def _usable(owner: str) -> bool:
    """An id the limiter can be asked about (valid UTF-8, no lone surrogate)."""
    try:
        owner.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def _gathered(calls: list[Any]) -> list[Any]:
    """Awaits coroutines PEEKS_AT_ONCE at a time (pipelined on the limiter's connections)."""
    results: list[Any] = []
    for start in range(0, len(calls), PEEKS_AT_ONCE):
        results += await asyncio.gather(*calls[start:start + PEEKS_AT_ONCE])
    return results


def _fullness(window: Sequence[Any]) -> tuple[float, int]:
    """How full a peek's window report (limit, seconds, tokens, used, oldest) is, for max():
    the use, then the shorter window."""
    return window[3] / window[0], -window[1]


async def _rank_users(masters: Masters, users: list[str], budgets: Budgets,
                      default: str, named: dict[str, str]) -> list[dict[str, Any]]:
    """Each user judged by its tier's budgets: one peek of its request and token windows
    (the 8th answer gives every window's use) in each storage its keys show (the fuller
    answer kept), ranked by the fullest window."""
    tiers = dict(zip(users, (named.get(identity_of(u).user, named.get(u, default))
                             for u in users), strict=True))
    asked = [(u, s) for u in users for s in masters.owner_storages(u)]

    async def peek(user: str, storage: str) -> Any:
        limiter = masters.peekers[storage]
        requests, tokens = budgets.windows(tiers[user])
        if tokens:
            return await limiter._peek(user, requests, token_windows=tokens, tokens=1)
        return await limiter._peek(user, requests)

    peeks = await _gathered([peek(u, s) for u, s in asked])
    answers: dict[str, tuple[Storage, Any]] = {}
    for (user, storage), answer in zip(asked, peeks, strict=True):
        kept = answers.get(user)
        if kept is None or _fullness(max(answer[6], key=_fullness)) > \
                _fullness(max(kept[1][6], key=_fullness)):
            answers[user] = (storage, answer)
    ranked = []
    for user, (storage, answer) in answers.items():
        tier = tiers[user]
        identity = identity_of(user)
        fullest = max(answer[6], key=_fullness)
        limit, seconds, tokens, used, _ = fullest
        ranked.append({"user": user, "id": identity.user, "kind": identity.kind, "tier": tier,
                       "tier_from": "named" if tier != default or user in named
                       or identity.user in named else "default",
                       "window_seconds": seconds, "resource": _resource(tokens), "used": used,
                       "limit": limit, "fraction": used / limit, "retry_after_s": answer[2],
                       "storage": storage,
                       "windows": [{"window_seconds": s, "resource": _resource(t), "used": n,
                                    "limit": lim} for lim, s, t, n, _ in answer[6]]})
    ranked.sort(key=lambda r: (-r["fraction"], r["user"]))
    return ranked


async def _rank_namespaces(masters: Masters, users: list[str],
                           windows: dict[str, Limits]) -> list[dict[str, Any]]:
    """The users of each namespace, by what they used in the shortest window their keys
    show (the limits are the app's), in each storage that holds it (the most used kept)."""
    chosen = {u: min(windows[u]) for u in users if windows[u]}
    asked = [(u, s) for u in chosen for s in masters.storages("window", u, None, *chosen[u])]

    async def peek(user: str, storage: str) -> Any:
        limiter = masters.peekers[storage]
        seconds, tokens = chosen[user]
        if tokens:
            return await limiter._peek(user, (), token_windows=[(UNKNOWN_LIMIT, seconds)], tokens=1)
        return await limiter._peek(user, [(UNKNOWN_LIMIT, seconds)])

    peeks = await _gathered([peek(u, s) for u, s in asked])
    kept: dict[str, tuple[Storage, Any]] = {}
    for (user, storage), answer in zip(asked, peeks, strict=True):
        if user not in kept or answer[6][0][3] > kept[user][1][6][0][3]:
            kept[user] = (storage, answer)
    by_namespace: dict[str, list[dict[str, Any]]] = {}
    for user, (storage, answer) in kept.items():
        identity = identity_of(user)
        _, seconds, tokens, used, _ = answer[6][0]
        assert identity.namespace is not None
        by_namespace.setdefault(identity.namespace, []).append(
            {"user": user, "id": identity.user, "kind": identity.kind, "window_seconds": seconds,
             "resource": _resource(tokens), "used": used, "storage": storage})
    return [{"namespace": name, "users": sorted(rows, key=lambda r: (-r["used"], r["user"]))}
            for name, rows in sorted(by_namespace.items())]


async def _upstream_rows(args: argparse.Namespace, masters: Masters, shared: dict[str, Limits],
                         budgets: Budgets, hash_tag: bool, keys: Sequence[str],
                         now_ms: int) -> list[dict[str, Any]]:
    """Each upstream cap the keys show: its windows, with the tiers file's limits, the
    provider's view, its wait queue and its classes' use (reserved shares)."""
    rows = []
    for name in sorted(shared):
        limits = shared[name] | _scope_limits(budgets.upstreams.get(name, {}))
        rows.append({"name": name, "windows": await _peek_windows(masters, name, *_split(limits),
                                                                  (name, True)),
                     "provider": await _provider_view(args, masters, name, hash_tag),
                     "queue": await _queue_view(args, masters, name, hash_tag, now_ms),
                     "classes": await _class_rows(args, masters, keys, name, hash_tag, now_ms)})
    return rows


async def _queue_view(args: argparse.Namespace, masters: Masters, name: str, hash_tag: bool,
                      now_ms: int) -> dict[str, Any] | None:
    """A shared cap's wait queue (read_queue), with its key; None when it is empty."""
    key = queue_key(args.key_prefix, name, hash_tag)
    view = await read_queue((await _node_of(masters, key, hash_tag))._command, key, now_ms)
    return None if view is None else {"key": key, **view}


def _queue_text(view: dict[str, Any] | None, now_ms: int) -> str:
    """A wait queue as one line: its live tickets, their tenants, the next one's deadline."""
    if view is None:
        return "queue: empty\n"
    parts = [f"{view['tickets']} waiting", f"{view['tenants']} tenant(s) among the first"]
    if view["first_deadline_ms"] is not None:
        parts.append(f"next served gives up at {_time(view['first_deadline_ms'])} "
                     f"(in {(view['first_deadline_ms'] - now_ms) / 1000:.1f} s)")
    if view["latest_deadline_ms"] is not None:
        parts.append(f"the last deadline {_time(view['latest_deadline_ms'])}")
    if view["expired"]:
        parts.append(f"{view['expired']} expired, purged by the next admission")
    return f"queue: {', '.join(parts)}\n"


async def _class_rows(args: argparse.Namespace, masters: Masters, keys: Sequence[str],
                      name: str, hash_tag: bool, now_ms: int) -> list[dict[str, Any]]:
    """The use of each class (reserved shares: lib/shares.lua's companion logs) in each
    window of the shared cap `name` the keys show, the longest use first."""
    rows: list[dict[str, Any]] = []
    for key in sorted(set(keys)):
        found = class_key(key, args.key_prefix, hash_tag)
        if found is None or found.weights or found.window.owner != name:
            continue
        window = found.window
        used, complete = await read_class_use((await _node_of(masters, key, hash_tag))._command,
                                              key, window.seconds * 1000, now_ms)
        rows.append({"class": found.klass, "window_seconds": window.seconds,
                     "resource": _resource(window.tokens), "used": used, "complete": complete,
                     "key": key})
    rows.sort(key=lambda r: (int(r["window_seconds"]), str(r["resource"]), -int(r["used"]),
                             str(r["class"])))
    return rows


def _classes_text(rows: list[dict[str, Any]]) -> str:
    """The classes' use of a cap, one window a part: "shares: 60 s requests: pro 3, free 1"."""
    if not rows:
        return ""
    windows: dict[tuple[int, str], list[str]] = {}
    for r in rows:
        windows.setdefault((r["window_seconds"], r["resource"]), []).append(
            f"{shown(r['class'])} {r['used']}{'' if r['complete'] else '+'}")
    return "shares: " + "; ".join(f"{seconds} s {resource}: {', '.join(uses)}"
                                  for (seconds, resource), uses in windows.items()) + "\n"


# ---------------------------------------------------------------------------------- main

def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _global_options(p: argparse.ArgumentParser, defaults: bool) -> None:
    """The options every command takes, before or after it. On the commands their defaults
    are SUPPRESS, so a value given before the command is not overwritten."""
    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    p.add_argument("--url", default=default(None),
                   help="Redis URL (default: $REDIS_URL, else redis://localhost:6379/0)")
    p.add_argument("--key-prefix", default=default("ratelimit"),
                   help="key prefix (default: ratelimit)")
    p.add_argument("--tiers", default=default(None),
                   help=f"tiers file, JSON or TOML (default: ${TIERS_FILE_ENV}, else TIER_LIMITS)")
    p.add_argument("--timeout", type=float, default=default(2.0),
                   help="connect and reply timeout, seconds (default: 2)")
    p.add_argument("--json", action="store_true", default=default(False),
                   help="print JSON instead of a table")


# A URL's userinfo, up to its last '@' (a password may hold '/', '@' or quotes as is).
_USERINFO = re.compile(r"://\S*@")


class _Parser(argparse.ArgumentParser):
    """argparse, whose usage errors quote what they could not place ("unrecognized
    arguments: ...", "invalid choice: ..."): a URL put in the wrong place would print its
    password. Every URL's user name and password is hidden there (the subcommands' parsers
    are of this class too: add_subparsers takes the parent's)."""

    def error(self, message: str) -> NoReturn:
        super().error(_USERINFO.sub("://***@", message))


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="genai-ratelimit", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Options go before or after the command. Exit codes: 0 "
                                       "done, 1 check refused, 2 usage or configuration error "
                                       "(a command the Redis ACL user may not run too), 3 "
                                       "Redis unavailable.")
    _global_options(p, True)
    sub = p.add_subparsers(dest="command", required=True)
    tier_help = ("the tier whose budgets apply (default: free); repeatable as USER=TIER for "
                 "one user's tier (by the app's user id or the key's id)")

    def command(name: str, help: str, user: bool = True, tier: bool = True) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        if user:
            c.add_argument("user", help="the user id the limiter was given (FastAPI: 'ip:HOST' "
                                        "for an anonymous client, 'ns:NAME:ID' in a namespace)")
        if tier:
            c.add_argument("--tier", action="append", default=[], metavar="TIER|USER=TIER",
                           help=tier_help)
        _global_options(c, False)
        return c

    max_keys_help = ("SCAN bound: at most ceil(MAX_KEYS / (10 x masters)) SCAN calls of COUNT "
                     "10 per master, so about MAX_KEYS keys in all (default 10000)")
    c = command("inspect", "every budget of a user: request and token windows, route / model "
                           "scopes, in-flight leases, namespaces, and upstream caps (writes "
                           "nothing)")
    c.add_argument("--upstream", action="append", default=[], metavar="NAME",
                   help="also show this upstream's shared cap; repeatable")
    c.add_argument("--max-keys", type=_positive, default=10_000, help=max_keys_help)
    c = command("reset", "forget a user's entries (every window unless --window)", tier=False)
    c.add_argument("--window", type=_positive, action="append", default=[], metavar="SECONDS",
                   help="only this window (request and token keys); repeatable")
    c = command("top", "the users closest to their limits, by the fullest of their request "
                       "and token windows; upstream caps with the provider's view; calendar "
                       "budgets by spent + held (bounded SCAN of every master)", user=False)
    c.add_argument("-n", "--count", type=_positive, default=10, help="users to show (default 10)")
    c.add_argument("--max-keys", type=_positive, default=10_000, help=max_keys_help)
    c = command("check", "one real decision for a user (logged when allowed); exit 1 if refused")
    c.add_argument("--cost", type=_positive, default=1, help="what the request costs (default 1)")
    c.add_argument("--tokens", type=_positive, default=None,
                   help="decide the tier's token windows too, for this many tokens (a reserve)")
    return p


# An ACL refusal: of a command sent, or of one inside a script (its SHA1 and line).
_NOPERM = re.compile(r"NOPERM|no permissions|can't run this command")
_NOPERM_COMMAND = re.compile(r"'([A-Za-z|]+)' command")
_SCRIPT_LINE = re.compile(r"script: ([0-9a-f]{40}), on @user_script:(\d+)")
_REDIS_CALL = re.compile(r"redis\.call\('([A-Za-z]+)'")


def refused_command(message: str) -> str | None:
    """The command a Redis ACL refused, from its error message: named by Redis, or found on
    the script's line (a script's refusal names only the line)."""
    if not _NOPERM.search(message):
        return None
    named = _NOPERM_COMMAND.search(message)
    if named is not None:
        return named[1].lower()
    at = _SCRIPT_LINE.search(message)
    if at is not None:
        for name in dir(_native):
            if name.endswith("_SHA1") and getattr(_native, name) == at[1]:
                source = getattr(_native, name[:-5] + "_SOURCE").splitlines()
                line = int(at[2])
                call = _REDIS_CALL.search(source[line - 1]) if 0 < line <= len(source) else None
                if call is not None:
                    return call[1].lower()
    return "a command"


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    args = parser().parse_args(argv)
    out = out or sys.stdout
    handler = {"inspect": inspect, "reset": reset, "top": top, "check": check}[args.command]
    try:
        return handler(args, out)
    except UsageError as exc:
        print(f"genai-ratelimit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RateLimiterError as exc:
        refused = refused_command(str(exc))
        if refused is not None:
            print(f"genai-ratelimit: error: the Redis ACL user may not run {refused!r}, which "
                  f"{args.command} needs (see {OPERATOR_ACL}): {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"genai-ratelimit: Redis unavailable: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (ValueError, TypeError) as exc:  # a malformed URL, a bad user id
        print(f"genai-ratelimit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _console() -> None:
    """The genai-ratelimit console script."""
    sys.exit(main())
