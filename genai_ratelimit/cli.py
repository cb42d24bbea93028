"""The command line: `python -m genai_ratelimit` (or `genai-ratelimit`), for the people who
operate a limiter: why was a user refused and when may they retry, reset a quota, who is
closest to their limit, and a quick manual decision.

    genai-ratelimit inspect USER [--tier T]     every window: used, limit, oldest entry, retry
    genai-ratelimit reset USER [--window S]...  forget the user's entries (all windows by default)
    genai-ratelimit top [--tier T] [-n N]       users closest to their limits (bounded SCAN)
    genai-ratelimit check USER [--tier T]       one real decision (logged when allowed)

Redis: --url, else $REDIS_URL, else redis://localhost:6379/0. Budgets: --tiers FILE, else the
file $GENAI_RATELIMIT_TIERS names, else TIER_LIMITS and TIER_TOKEN_LIMITS.

Exit codes: 0 done (check: allowed), 1 check refused, 2 usage or configuration error (a bad
URL or tiers file, an unknown tier), 3 Redis unavailable (unreachable, timed out, refused).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, TextIO

from ._native import RateLimiterError
from ._tiers_config import TIERS_FILE_ENV, TierConfigError, load_tier_config, token_limits_of_tiers
from .aio import AsyncRateLimiter
from .limiter import RateLimiter
from .tiers import TIER_LIMITS, TIER_TOKEN_LIMITS

__all__ = ["main"]

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3

# Budget key -> window length in seconds (the FastAPI dependencies' windows).
WINDOW_OF = {"per_minute": 60, "per_day": 86_400}
# top: keys one SCAN step looks at. The client takes replies of at most 64 elements.
SCAN_COUNT = "10"
TOP_PEEKS_AT_ONCE = 64


class UsageError(Exception):
    """A configuration problem the user must fix: exit 2."""


def _budgets(args: argparse.Namespace) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The tier's (limit, window_seconds) request and token windows."""
    path = args.tiers or os.environ.get(TIERS_FILE_ENV) or None
    if path:
        try:
            data, where = load_tier_config(path)
            requests: dict[str, dict[str, int]] = dict(data)  # type: ignore[call-overload]
            tokens = token_limits_of_tiers(data, where)
        except TierConfigError as exc:
            raise UsageError(str(exc)) from None
    else:
        requests, tokens = TIER_LIMITS, TIER_TOKEN_LIMITS
    if args.tier not in requests:
        raise UsageError(f"unknown tier {args.tier!r}: one of {', '.join(sorted(requests))}")
    request_budget = requests[args.tier]
    token_budget = tokens.get(args.tier) or tokens.get("free") or {}
    return ([(request_budget[k], s) for k, s in WINDOW_OF.items()],
            [(token_budget[k], s) for k, s in WINDOW_OF.items() if k in token_budget])


def _limiter_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"key_prefix": args.key_prefix, "connect_timeout": args.timeout,
            "socket_timeout": args.timeout}


def _time(ms: int | None) -> str:
    if ms is None:
        return "-"
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def _window_name(seconds: int, tokens: bool) -> str:
    return f"{seconds} s{' tokens' if tokens else ''}"


def _print_table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.ljust(w) if i in (0, 1) else cell.rjust(w)
                            for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip() + "\n")


# ------------------------------------------------------------------------------ commands

def inspect(args: argparse.Namespace, out: TextIO) -> int:
    """Each window of the user's tier: used, limit, remaining after one more request, the
    oldest entry still in it and when a request would be allowed again. Writes nothing."""
    requests, tokens = _budgets(args)
    rows = []
    with RateLimiter(args.url, **_limiter_options(args)) as limiter:
        # One peek per window: each answers for that window alone (a peek of all stops
        # at the first refusing window, as a check does).
        for windows, is_tokens in [(requests, False), (tokens, True)]:
            for limit, seconds in windows:
                if is_tokens:
                    peek = limiter._peek(args.user, (), token_windows=[(limit, seconds)], tokens=1)
                else:
                    peek = limiter._peek(args.user, [(limit, seconds)])
                allowed, remaining, retry, _, _, now, usage, _ = peek
                used, oldest = usage[0][3], usage[0][4]
                rows.append({"window_seconds": seconds, "tokens": is_tokens, "used": used,
                             "limit": limit, "remaining": remaining, "allowed": allowed,
                             "oldest_ms": oldest, "retry_after_s": retry, "now_ms": now})
    if args.json:
        json.dump({"user": args.user, "tier": args.tier, "windows": rows}, out)
        out.write("\n")
        return EXIT_OK
    server_now = rows[0]["now_ms"] if rows else None
    out.write(f"user {args.user!r}, tier {args.tier}, Redis time {_time(server_now)}\n")
    table = [["window", "resource", "used", "limit", "oldest entry (UTC)", "retry after"]]
    for r in rows:
        table.append([f"{r['window_seconds']} s", "tokens" if r["tokens"] else "requests",
                      str(r["used"]), str(r["limit"]), _time(r["oldest_ms"]),
                      f"{r['retry_after_s']} s" if not r["allowed"] else "-"])
    _print_table(table, out)
    return EXIT_OK


def reset(args: argparse.Namespace, out: TextIO) -> int:
    """Forgets the user's entries: the windows named, or every window of the user."""
    with RateLimiter(args.url, **_limiter_options(args)) as limiter:
        if args.window:
            removed = limiter.reset(args.user, [(1, s) for s in args.window],
                                    token_windows=[(1, s) for s in args.window])
        else:
            removed = limiter.reset(args.user)
    what = ", ".join(f"{s} s" for s in args.window) if args.window else "every window"
    out.write(f"reset {args.user!r} ({what}): {removed} entries removed\n")
    return EXIT_OK


def check(args: argparse.Namespace, out: TextIO) -> int:
    """One real decision against the tier's request windows: logged when allowed."""
    requests, _ = _budgets(args)
    with RateLimiter(args.url, **_limiter_options(args)) as limiter:
        allowed, remaining, retry, window = limiter.check_windows(args.user, requests,
                                                                  cost=args.cost)
    if args.json:
        json.dump({"allowed": allowed, "remaining": remaining, "retry_after_s": retry,
                   "window_seconds": window}, out)
        out.write("\n")
    elif allowed:
        out.write(f"allowed: {remaining} left in the {window} s window\n")
    else:
        out.write(f"refused by the {window} s window: retry after {retry} s\n")
    return EXIT_OK if allowed else EXIT_REFUSED


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _user_of(key: str, prefix: str, seconds: set[int]) -> str | None:
    """The user id of a request window key "{prefix}:{user}:{seconds}", or None."""
    if not key.startswith(prefix + ":"):
        return None
    user, _, window = key[len(prefix) + 1:].rpartition(":")
    if not user or not window.isdigit() or int(window) not in seconds:
        return None
    return user


async def _top(args: argparse.Namespace, requests: list[tuple[int, int]]) -> tuple[list[Any], int]:
    """Finds users by SCAN (at most --max-keys keys examined), then peeks each."""
    seconds = {s for _, s in requests}
    users: set[str] = set()
    examined = 0
    async with AsyncRateLimiter(args.url, **_limiter_options(args)) as limiter:
        cursor = b"0"
        pattern = _glob_escape(args.key_prefix) + ":*"
        while examined < args.max_keys:
            cursor, keys = await limiter._command("SCAN", cursor, "MATCH", pattern,
                                                  "COUNT", SCAN_COUNT)
            examined += len(keys)
            for key in keys:
                user = _user_of(key.decode("utf-8", errors="replace"), args.key_prefix, seconds)
                if user is not None:
                    users.add(user)
            if cursor == b"0":
                break
        ordered = sorted(users)
        peeks: list[Any] = []
        for start in range(0, len(ordered), TOP_PEEKS_AT_ONCE):
            batch = ordered[start:start + TOP_PEEKS_AT_ONCE]
            peeks += await asyncio.gather(*(limiter._peek(u, requests) for u in batch))
    ranked = []
    for user, peek in zip(ordered, peeks, strict=True):
        usage = peek[6]
        limit, window, _, used, _ = max(usage, key=lambda w: (w[3] / w[0], -w[1]))
        ranked.append({"user": user, "window_seconds": window, "used": used, "limit": limit,
                       "fraction": used / limit, "retry_after_s": peek[2]})
    ranked.sort(key=lambda r: (-r["fraction"], r["user"]))
    return ranked[:args.count], examined


def top(args: argparse.Namespace, out: TextIO) -> int:
    """The users closest to their limits, among the keys one bounded SCAN examines."""
    requests, _ = _budgets(args)
    ranked, examined = asyncio.run(_top(args, requests))
    if args.json:
        json.dump({"users": ranked, "keys_examined": examined}, out)
        out.write("\n")
        return EXIT_OK
    table = [["user", "window", "used", "limit", "use", "retry after"]]
    for r in ranked:
        table.append([r["user"], f"{r['window_seconds']} s", str(r["used"]), str(r["limit"]),
                      f"{100 * r['fraction']:.0f}%",
                      f"{r['retry_after_s']} s" if r["retry_after_s"] else "-"])
    _print_table(table, out)
    out.write(f"({examined} keys examined, tier {args.tier} budgets)\n")
    return EXIT_OK


# ---------------------------------------------------------------------------------- main

def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="genai-ratelimit", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Exit codes: 0 done, 1 check refused, 2 usage or "
                                       "configuration error, 3 Redis unavailable.")
    p.add_argument("--url", default=None,
                   help="Redis URL (default: $REDIS_URL, else redis://localhost:6379/0)")
    p.add_argument("--key-prefix", default="ratelimit", help="key prefix (default: ratelimit)")
    p.add_argument("--tiers", default=None,
                   help=f"tiers file, JSON or TOML (default: ${TIERS_FILE_ENV}, else TIER_LIMITS)")
    p.add_argument("--timeout", type=float, default=2.0,
                   help="connect and reply timeout, seconds (default: 2)")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, user: bool = True, tier: bool = True) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        if user:
            c.add_argument("user", help="the user id (exactly as the app passes it)")
        if tier:
            c.add_argument("--tier", default="free", help="the tier whose budgets apply (default: free)")
        c.add_argument("--json", action="store_true", help="print JSON instead of a table")
        return c

    command("inspect", "each window of a user: used, limit, oldest entry, retry (writes nothing)")
    c = command("reset", "forget a user's entries (every window unless --window)", tier=False)
    c.add_argument("--window", type=_positive, action="append", default=[], metavar="SECONDS",
                   help="only this window (request and token keys); repeatable")
    c = command("top", "the users closest to their limits (bounded SCAN)", user=False)
    c.add_argument("-n", "--count", type=_positive, default=10, help="users to show (default 10)")
    c.add_argument("--max-keys", type=_positive, default=10_000,
                   help="stop the SCAN after this many keys (default 10000)")
    c = command("check", "one real decision for a user (logged when allowed); exit 1 if refused")
    c.add_argument("--cost", type=_positive, default=1, help="what the request costs (default 1)")
    return p


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
        print(f"genai-ratelimit: Redis unavailable: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (ValueError, TypeError) as exc:  # a malformed URL, a bad user id
        print(f"genai-ratelimit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _console() -> None:
    """The genai-ratelimit console script."""
    sys.exit(main())
