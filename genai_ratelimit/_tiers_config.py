"""Tier budgets from configuration: validation of a `tier_limits` mapping and loading it from
the JSON or TOML file that the environment variable GENAI_RATELIMIT_TIERS names.

Everything here runs when a `RateLimit` is built (at start-up), never per request, so a
malformed file stops the service before it answers anything, with a message naming the file
and the problem.

File shape (JSON or TOML, chosen by the file's suffix), one table per tier; `free` is required
because an unknown tier gets its budget:

    # tiers.toml                        // tiers.json
    [free]                              {"free": {"per_minute": 5, "per_day": 100},
    per_minute = 5                       "pro":  {"per_minute": 60, "per_day": 5000}}
    per_day = 100

A tier gives at least one window of per_second, per_minute, per_hour, per_day (integers from
1 to 2**53 - 1; a longer window not below a shorter one). It may also give its token budget
(TokenRateLimit): any of tokens_per_second, tokens_per_minute, tokens_per_hour,
tokens_per_day, the same rules:

    [pro]
    per_minute = 60
    per_day = 5000
    tokens_per_minute = 200000
    tokens_per_day = 5000000

A tier without them takes TIER_TOKEN_LIMITS' budget of the same name, else the token budget
of the file's `free` tier (when it has one), else TIER_TOKEN_LIMITS' free budget.

A tier may also cap its concurrent requests (RateLimit's in-flight leases), an integer >= 1;
a tier without it has no concurrency limit:

    [free]
    per_minute = 5
    per_day = 100
    max_in_flight = 3

A tier may also let its requests wait when an upstream's cap refuses them (the wait queue
of shared caps, docs/wait-queue.md): max_wait, seconds (> 0, at most 300; an int or a
float). On a route with upstreams, a tier's max_wait wins over its Upstream's and the
route's (RateLimit(max_wait=...)):

    [pro]
    per_minute = 60
    max_wait = 5

Two more tables are sections, not tiers (so no tier can be named `models` or `upstreams`):
per-model budgets of each user, beside the tier's, and the caps of upstream providers, shared
by all users; each takes any of per_minute, per_day, tokens_per_minute, tokens_per_day (at
least one; the token keys count in TokenRateLimit only), and an upstream lists the request
`model`s it serves (none: every request):

    [models."gpt-4o"]                   # each user: 20 gpt-4o requests a minute at most
    per_minute = 20
    tokens_per_minute = 40000

    [upstreams."openai/gpt-4o"]         # all users together stay below the provider's caps
    models = ["gpt-4o", "gpt-4o-2024-08-06"]
    per_minute = 500
    tokens_per_minute = 30000
    reserved = { enterprise = 30 }      # optional: reserved shares per tier (percent), and
    ceilings = { free = [50, 80] }      # ceilings (percent) above a saturation (percent)
    probe = 1                           # optional: the cold start (docs/upstreams.md)
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._native import MAX_LIMIT
from .reservation import DEFAULT_PROBE_TIMEOUT_SECONDS, check_probe
from .shares import validate as validate_shares
from .tiers import DEFAULT_TIER, TIER_TOKEN_LIMITS
from .wait_queue import queue_bound, queue_milliseconds

__all__ = [
    "BURST_KEY",
    "TIERS_FILE_ENV",
    "TIER_BUDGET_KEYS",
    "SPEND_KEY",
    "spend_limits_of_tiers",
    "tier_spend_limits_from_env",
    "TIER_TOKEN_KEYS",
    "TierConfigError",
    "validate_tier_limits",
    "validate_token_limits",
    "token_limits_of_tiers",
    "load_tier_limits",
    "load_tier_config",
    "tier_limits_from_env",
    "tier_token_limits_from_env",
    "SCOPE_SECTIONS",
    "SCOPE_BUDGET_KEYS",
    "validate_scope_budget",
    "scope_sections_of",
    "scope_sections_from_env",
    "MAX_IN_FLIGHT_KEY",
    "max_in_flight_of_tiers",
    "tier_max_in_flight_from_env",
    "MAX_WAIT_KEY",
    "max_wait_of_tiers",
    "tier_max_wait_from_env",
]

TIERS_FILE_ENV = "GENAI_RATELIMIT_TIERS"

# Budget key -> window length in seconds, shortest window first. A tier gives at least one.
# A tier's money budget (TokenRateLimit(prices=...)): daily_usd, weekly_eur, monthly_credits.
SPEND_KEY = re.compile(r"(daily|weekly|monthly)_[a-z0-9]+\Z")

TIER_BUDGET_KEYS: dict[str, int] = {"per_second": 1, "per_minute": 60, "per_hour": 3_600,
                                    "per_day": 86_400}
# The optional token budget keys of a tiers file -> the key of a token budget table
# (TIER_TOKEN_LIMITS' shape), in the order of TIER_BUDGET_KEYS.
TIER_TOKEN_KEYS: dict[str, str] = {"tokens_per_second": "per_second",
                                   "tokens_per_minute": "per_minute",
                                   "tokens_per_hour": "per_hour", "tokens_per_day": "per_day"}
# The optional cap on a tier's concurrent requests (in-flight leases).
MAX_IN_FLIGHT_KEY = "max_in_flight"
# The optional burst of a tier's minute budget: per_minute is then decided as GCRA (rate
# per_minute per 60 s, up to `burst` at once; docs/gcra.md) instead of a sliding minute log.
BURST_KEY = "burst"
# The optional wait of a tier's requests in an upstream's queue (seconds, > 0, <= 300).
MAX_WAIT_KEY = "max_wait"


# The tables of a tiers file that are sections, not tiers.
SCOPE_SECTIONS = ("models", "upstreams")
# The budget keys of a scope (a route's, a model's, an upstream's) -> (window seconds, tokens).
SCOPE_BUDGET_KEYS: dict[str, tuple[int, bool]] = {
    "per_minute": (60, False), "per_day": (86_400, False),
    "tokens_per_minute": (60, True), "tokens_per_day": (86_400, True)}


class TierConfigError(ValueError):
    """Tier budgets that cannot be used: the message names where they came from and why."""


def _budget(source: str, tier: str, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TierConfigError(f"{source}: tier {tier!r}: {key} must be an integer >= 1, "
                              f"got {type(value).__name__} {value!r}")
    if value < 1:
        raise TierConfigError(f"{source}: tier {tier!r}: {key} must be an integer >= 1, got {value}")
    if value > MAX_LIMIT:  # the limiter could decide no request against it
        raise TierConfigError(f"{source}: tier {tier!r}: {key} must be at most {MAX_LIMIT} "
                              f"(2**53 - 1), got {value}")
    return value


def _tier_tables(data: object, source: str, *, token_keys: bool) -> dict[str, dict[str, int]]:
    """The strict check shared by request and token budgets: a mapping of non-empty tier names
    to tables of exactly {"per_minute": int >= 1, "per_day": int >= 1} (plus, when
    `token_keys`, optionally both of "tokens_per_minute", "tokens_per_day", and
    "max_in_flight": int >= 1), each day budget
    not below its minute budget, with a `free` tier. Returns fresh dicts."""
    if not isinstance(data, Mapping):
        raise TierConfigError(f"{source}: expected a table of tiers "
                              f"(e.g. {{\"free\": {{\"per_minute\": 5, \"per_day\": 100}}}}), "
                              f"got {type(data).__name__}")
    if not data:
        raise TierConfigError(f"{source}: no tiers defined")
    allowed = {**TIER_BUDGET_KEYS,
               **({**TIER_TOKEN_KEYS, MAX_IN_FLIGHT_KEY: 0, BURST_KEY: 0, MAX_WAIT_KEY: 0}
                  if token_keys else {})}
    tiers: dict[str, dict[str, int]] = {}
    for tier, budget in data.items():
        if tier in SCOPE_SECTIONS:
            continue
        if not isinstance(tier, str) or not tier.strip():
            raise TierConfigError(f"{source}: tier names must be non-empty strings, got {tier!r}")
        if not isinstance(budget, Mapping):
            raise TierConfigError(f"{source}: tier {tier!r} must be a table with per_minute and "
                                  f"per_day, got {type(budget).__name__}")
        unknown = sorted(str(key) for key in budget if key not in allowed and not (
            token_keys and isinstance(key, str) and SPEND_KEY.match(key)))
        if unknown:
            spend = " and daily_/weekly_/monthly_<currency>" if token_keys else ""
            raise TierConfigError(f"{source}: tier {tier!r}: unknown key(s) {unknown}; "
                                  f"allowed: {sorted(allowed)}{spend}")
        if not any(key in budget for key in TIER_BUDGET_KEYS):
            raise TierConfigError(f"{source}: tier {tier!r}: missing a window: give at least one "
                                  f"of {', '.join(TIER_BUDGET_KEYS)}")
        checked = {key: _budget(source, tier, key, budget[key]) for key in allowed
                   if key in budget and key != MAX_WAIT_KEY}
        if MAX_WAIT_KEY in budget:  # seconds, not a budget: checked as reserve checks it
            try:
                queue_milliseconds(budget[MAX_WAIT_KEY])
            except (TypeError, ValueError) as exc:
                raise TierConfigError(f"{source}: tier {tier!r}: {exc}") from None
        if BURST_KEY in checked and "per_minute" not in checked:
            raise TierConfigError(f"{source}: tier {tier!r}: burst applies to per_minute (the "
                                  f"minute budget decided as GCRA): give per_minute too")
        # A longer window never allows fewer than a shorter one (it could never be reached).
        for keys in (list(TIER_BUDGET_KEYS), list(TIER_TOKEN_KEYS)):
            given = [key for key in keys if key in checked]
            for shorter, longer in zip(given, given[1:], strict=False):
                if checked[longer] < checked[shorter]:
                    raise TierConfigError(f"{source}: tier {tier!r}: {longer} ({checked[longer]}) "
                                          f"is smaller than {shorter} ({checked[shorter]})")
        tiers[tier] = checked
    if DEFAULT_TIER not in tiers:
        raise TierConfigError(f"{source}: the {DEFAULT_TIER!r} tier is required "
                              "(requests with no tier or an unknown tier get its budget)")
    return tiers


def validate_tier_limits(data: object, source: str = "tier_limits") -> dict[str, dict[str, int]]:
    """Checks tier budgets strictly: a mapping of non-empty tier names to exactly
    {"per_minute": int >= 1, "per_day": int >= 1}, per_day not below per_minute, with a `free`
    tier; a tier may also carry "burst" (int >= 1, with per_minute: the minute budget decided as
    GCRA, kept in the result) and a token budget, "tokens_per_minute" and "tokens_per_day"
    together (see token_limits_of_tiers), checked the same way and left out of the result.
    Returns a fresh dict of the request budgets (later changes to `data` do not leak in).
    Raises TierConfigError (a ValueError) naming `source` and the first problem found."""
    tiers = _tier_tables(data, source, token_keys=True)
    return {tier: {key: budget[key] for key in (*TIER_BUDGET_KEYS, BURST_KEY) if key in budget}
            for tier, budget in tiers.items()}


def validate_token_limits(data: object, source: str = "token_limits") -> dict[str, dict[str, int]]:
    """Checks token budgets (TIER_TOKEN_LIMITS' shape) as strictly as validate_tier_limits:
    {"free": {"per_minute": int >= 1, "per_day": int >= 1}, ...}, per_day not below
    per_minute, `free` required. Returns a fresh dict; raises TierConfigError."""
    return _tier_tables(data, source, token_keys=False)


def token_limits_of_tiers(data: object, source: str = "tier_limits") -> dict[str, dict[str, int]]:
    """The token budgets a tiers table carries: {tier: {"per_minute": tokens_per_minute,
    "per_day": tokens_per_day}} for each tier that gives them (possibly none). Checks `data`
    as validate_tier_limits does."""
    tiers = _tier_tables(data, source, token_keys=True)
    return {tier: {name: budget[key] for key, name in TIER_TOKEN_KEYS.items() if key in budget}
            for tier, budget in tiers.items() if any(key in budget for key in TIER_TOKEN_KEYS)}


def validate_scope_budget(budget: object, source: str, what: str, *,
                          extra: tuple[str, ...] = (), required: bool = True) -> dict[str, int]:
    """A scope's budget: a table of some of per_minute, per_day, tokens_per_minute,
    tokens_per_day (integers >= 1, at least one unless not `required`: an upstream with an
    in-flight cap only). Keys in `extra` are left to the caller. Raises TierConfigError
    naming `source` and `what` (e.g. "model 'gpt-4o'")."""
    if not isinstance(budget, Mapping):
        raise TierConfigError(f"{source}: {what} must be a table of budgets (e.g. "
                              f"{{\"per_minute\": 30}}), got {type(budget).__name__}")
    unknown = sorted(str(key) for key in budget if key not in SCOPE_BUDGET_KEYS and key not in extra)
    if unknown:
        raise TierConfigError(f"{source}: {what}: unknown key(s) {unknown}; allowed: "
                              f"{sorted([*SCOPE_BUDGET_KEYS, *extra])}")
    checked = {key: _budget(source, what, key, budget[key])
               for key in SCOPE_BUDGET_KEYS if key in budget}
    if not checked and required:
        raise TierConfigError(f"{source}: {what} needs at least one of "
                              f"{', '.join(SCOPE_BUDGET_KEYS)}")
    return checked


# An upstream's section: (budget, models, {"reserved": ..., "ceilings": ..., "in_flight":
# ..., "in_flight_lease_seconds": ..., "probe": ..., "probe_timeout_seconds": ...,
# "max_wait": ..., "max_queue": ..., "max_queue_per_tenant": ...} as given: the Upstream's
# keywords besides its budget).
PROBE_KEYS = ("probe", "probe_timeout_seconds")
UpstreamSection = tuple[dict[str, int], tuple[str, ...], dict[str, Any]]
ScopeSections = tuple[dict[str, dict[str, int]], dict[str, UpstreamSection]]


# The keys of an [upstreams."name"] section besides its budget.
QUEUE_KEYS = ("max_wait", "max_queue", "max_queue_per_tenant")
UPSTREAM_KEYS = ("models", "reserved", "ceilings", "in_flight", "in_flight_lease_seconds",
                 *PROBE_KEYS, *QUEUE_KEYS)


def in_flight_number(value: object, what: str) -> int:
    """An upstream's in_flight or in_flight_lease_seconds: an int >= 1 (at most 10**9)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    if not 1 <= value <= 10**9:
        raise ValueError(f"{what} must be >= 1 (and at most 10**9), got {value}")
    return value


def scope_sections_of(data: object, source: str) -> ScopeSections:
    """The `models` and `upstreams` sections of a tiers table: ({model: budget},
    {upstream: (budget, models, shares)}). Raises TierConfigError for a malformed section."""
    models: dict[str, dict[str, int]] = {}
    upstreams: dict[str, UpstreamSection] = {}
    if not isinstance(data, Mapping):
        return models, upstreams
    for section in SCOPE_SECTIONS:
        table = data.get(section)
        if table is None:
            continue
        if not isinstance(table, Mapping):
            raise TierConfigError(f"{source}: [{section}] must be a table of names to budgets, "
                                  f"got {type(table).__name__}")
        for name, budget in table.items():
            what = f"{section[:-1]} {name!r}"
            if not isinstance(name, str) or not name.strip():
                raise TierConfigError(f"{source}: [{section}] names must be non-empty strings, "
                                      f"got {name!r}")
            in_flight = section == "upstreams" and isinstance(budget, Mapping) and \
                "in_flight" in budget
            checked = validate_scope_budget(
                budget, source, what,
                extra=UPSTREAM_KEYS if section == "upstreams" else (), required=not in_flight)
            if section == "models":
                models[name] = checked
                continue
            served = budget.get("models", [])
            if not isinstance(served, list) or not all(isinstance(m, str) and m for m in served):
                raise TierConfigError(f"{source}: {what}: models must be a list of model names")
            shares = {key: budget[key] for key in UPSTREAM_KEYS[1:] if key in budget}
            try:
                validate_shares(shares.get("reserved"), shares.get("ceilings"))
                for key in ("in_flight", "in_flight_lease_seconds"):
                    if key in shares:
                        in_flight_number(shares[key], key)
                check_probe(shares.get("probe", 0),
                            shares.get("probe_timeout_seconds", DEFAULT_PROBE_TIMEOUT_SECONDS))
                if "max_wait" in shares:
                    queue_milliseconds(shares["max_wait"])
                for key in QUEUE_KEYS[1:]:
                    if key in shares:
                        queue_bound(shares[key], key)
            except (TypeError, ValueError) as exc:
                raise TierConfigError(f"{source}: {what}: {exc}") from None
            upstreams[name] = (checked, tuple(served), shares)
    return models, upstreams


def scope_sections_from_env(environ: Mapping[str, str] | None = None) -> ScopeSections | None:
    """The `models` and `upstreams` sections of the file named by GENAI_RATELIMIT_TIERS
    (scope_sections_of), or None when the variable is unset or empty."""
    config = _config_from_env(environ)
    return None if config is None else scope_sections_of(*config)


def spend_limits_of_tiers(data: object, source: str = "tier_limits") -> dict[str, dict[str, object]]:
    """The money budgets a tiers table carries: {tier: {"daily_usd": 1, "monthly_usd": "50"}}
    for each tier that gives one, the values as written (an int or a decimal string in the
    currency's unit: TokenRateLimit(prices=...) checks them against its price table). Checks
    `data` as validate_tier_limits does."""
    _tier_tables(data, source, token_keys=True)
    assert isinstance(data, Mapping)
    found = {str(tier): {key: value for key, value in budget.items()
                         if isinstance(key, str) and SPEND_KEY.match(key)}
             for tier, budget in data.items() if tier not in SCOPE_SECTIONS}
    return {tier: limits for tier, limits in found.items() if limits}


def tier_spend_limits_from_env(environ: Mapping[str, str] | None = None
                               ) -> dict[str, dict[str, object]] | None:
    """The money budgets of the file named by GENAI_RATELIMIT_TIERS (spend_limits_of_tiers),
    or None when the variable is unset or empty."""
    config = _config_from_env(environ)
    return None if config is None else spend_limits_of_tiers(*config)


def max_in_flight_of_tiers(data: object, source: str = "tier_limits") -> dict[str, int]:
    """The concurrency caps a tiers table carries: {tier: max_in_flight} for each tier that
    gives one (possibly none). Checks `data` as validate_tier_limits does."""
    tiers = _tier_tables(data, source, token_keys=True)
    return {tier: budget[MAX_IN_FLIGHT_KEY] for tier, budget in tiers.items()
            if MAX_IN_FLIGHT_KEY in budget}


def max_wait_of_tiers(data: object, source: str = "tier_limits") -> dict[str, float]:
    """The waits a tiers table carries: {tier: max_wait seconds} for each tier that gives
    one (possibly none). Checks `data` as validate_tier_limits does."""
    _tier_tables(data, source, token_keys=True)
    assert isinstance(data, Mapping)
    return {str(tier): float(budget[MAX_WAIT_KEY]) for tier, budget in data.items()
            if tier not in SCOPE_SECTIONS and MAX_WAIT_KEY in budget}


def tier_max_wait_from_env(environ: Mapping[str, str] | None = None) -> dict[str, float] | None:
    """The max_wait of each tier of the file named by GENAI_RATELIMIT_TIERS ({} when it
    gives none), or None when the variable is unset or empty."""
    config = _config_from_env(environ)
    return None if config is None else max_wait_of_tiers(*config)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _parse_toml(text: str) -> object:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ValueError("reading TOML needs Python 3.11+ or the tomli package "
                             "(pip install tomli); or use a .json file") from None
    return tomllib.loads(text)


def read_config_file(path: str | os.PathLike[str], where: str,
                     error: type[ValueError]) -> object:
    """The parsed content of a `.json` or `.toml` file (UTF-8), a duplicate key refused in
    both formats. Raises `error` with a message starting with `where`: another suffix, a
    file that cannot be read, text that is not JSON / TOML. The one reader of the tiers
    file and of a price table (prices.PriceTable.load)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise error(f"{where}: unsupported file type {path.suffix or '(no suffix)'!r}; "
                    "use a .json or .toml file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{where}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{where}: cannot be read: {exc}") from None
    try:
        if suffix == ".json":
            return json.loads(text, object_pairs_hook=_reject_duplicate_keys)
        return _parse_toml(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, TOMLDecodeError; deep nesting
        kind = "JSON" if suffix == ".json" else "TOML"
        raise error(f"{where}: invalid {kind}: {exc}") from None


def load_tier_limits(path: str | os.PathLike[str], *, source: str | None = None) -> dict[str, dict[str, int]]:
    """Reads and validates a tiers file (`.json` or `.toml`). Returns the request budgets.
    Raises TierConfigError whose message starts with `source` (default: the file's path)."""
    data, where = load_tier_config(path, source=source)
    return validate_tier_limits(data, where)


def load_tier_config(path: str | os.PathLike[str], *, source: str | None = None) -> tuple[object, str]:
    """Reads a tiers file (`.json` or `.toml`) and checks it (validate_tier_limits). Returns
    its parsed content, token keys included, and the source name its errors start with."""
    where = source or str(path)
    data = read_config_file(path, where, TierConfigError)
    validate_tier_limits(data, where)
    scope_sections_of(data, where)
    return data, where


def _config_from_env(environ: Mapping[str, str] | None) -> tuple[object, str] | None:
    """The parsed and checked file named by GENAI_RATELIMIT_TIERS and its source name
    (load_tier_config), or None when the variable is unset or empty."""
    env = os.environ if environ is None else environ
    value = env.get(TIERS_FILE_ENV, "").strip()
    if not value:
        return None
    return load_tier_config(value, source=f"{TIERS_FILE_ENV}={value}")


def tier_limits_from_env(environ: Mapping[str, str] | None = None) -> dict[str, dict[str, int]] | None:
    """The budgets from the file named by GENAI_RATELIMIT_TIERS, or None when it is unset or
    empty. Raises TierConfigError naming the variable, the file and the problem."""
    env = os.environ if environ is None else environ
    value = env.get(TIERS_FILE_ENV, "").strip()
    if not value:
        return None
    return load_tier_limits(value, source=f"{TIERS_FILE_ENV}={value}")


def tier_token_limits_from_env(environ: Mapping[str, str] | None = None) -> dict[str, dict[str, int]] | None:
    """The token budgets of the file named by GENAI_RATELIMIT_TIERS, or None when it is unset
    or empty. A tier of the file without token keys takes TIER_TOKEN_LIMITS' budget of the
    same name, else the file's free token budget, else TIER_TOKEN_LIMITS' free budget; so
    every tier of the file has one. Raises TierConfigError as tier_limits_from_env does."""
    config = _config_from_env(environ)
    if config is None:
        return None
    data, where = config
    given = token_limits_of_tiers(data, where)
    fallback = given.get(DEFAULT_TIER) or TIER_TOKEN_LIMITS[DEFAULT_TIER]
    return {tier: dict(given.get(tier) or TIER_TOKEN_LIMITS.get(tier) or fallback)
            for tier in validate_tier_limits(data, where)}


def tier_max_in_flight_from_env(environ: Mapping[str, str] | None = None) -> dict[str, int] | None:
    """The max_in_flight caps of the file named by GENAI_RATELIMIT_TIERS ({} when it gives
    none), or None when the variable is unset or empty. Raises TierConfigError as
    tier_limits_from_env does."""
    config = _config_from_env(environ)
    return None if config is None else max_in_flight_of_tiers(*config)
