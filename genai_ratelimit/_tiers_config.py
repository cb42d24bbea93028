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
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .tiers import DEFAULT_TIER

__all__ = [
    "TIERS_FILE_ENV",
    "TIER_BUDGET_KEYS",
    "TierConfigError",
    "validate_tier_limits",
    "load_tier_limits",
    "tier_limits_from_env",
]

TIERS_FILE_ENV = "GENAI_RATELIMIT_TIERS"

# Budget key -> window length in seconds, shortest window first.
TIER_BUDGET_KEYS: dict[str, int] = {"per_minute": 60, "per_day": 86_400}


class TierConfigError(ValueError):
    """Tier budgets that cannot be used: the message names where they came from and why."""


def _budget(source: str, tier: str, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TierConfigError(f"{source}: tier {tier!r}: {key} must be an integer >= 1, "
                              f"got {type(value).__name__} {value!r}")
    if value < 1:
        raise TierConfigError(f"{source}: tier {tier!r}: {key} must be an integer >= 1, got {value}")
    return value


def validate_tier_limits(data: object, source: str = "tier_limits") -> dict[str, dict[str, int]]:
    """Checks tier budgets strictly: a mapping of non-empty tier names to exactly
    {"per_minute": int >= 1, "per_day": int >= 1}, per_day not below per_minute, with a `free`
    tier. Returns a fresh dict (later changes to `data` do not leak in). Raises
    TierConfigError (a ValueError) naming `source` and the first problem found."""
    if not isinstance(data, Mapping):
        raise TierConfigError(f"{source}: expected a table of tiers "
                              f"(e.g. {{\"free\": {{\"per_minute\": 5, \"per_day\": 100}}}}), "
                              f"got {type(data).__name__}")
    if not data:
        raise TierConfigError(f"{source}: no tiers defined")
    tiers: dict[str, dict[str, int]] = {}
    for tier, budget in data.items():
        if not isinstance(tier, str) or not tier.strip():
            raise TierConfigError(f"{source}: tier names must be non-empty strings, got {tier!r}")
        if not isinstance(budget, Mapping):
            raise TierConfigError(f"{source}: tier {tier!r} must be a table with per_minute and "
                                  f"per_day, got {type(budget).__name__}")
        unknown = sorted(str(key) for key in budget if key not in TIER_BUDGET_KEYS)
        if unknown:
            raise TierConfigError(f"{source}: tier {tier!r}: unknown key(s) {unknown}; "
                                  f"allowed: {sorted(TIER_BUDGET_KEYS)}")
        missing = [key for key in TIER_BUDGET_KEYS if key not in budget]
        if missing:
            raise TierConfigError(f"{source}: tier {tier!r}: missing {', '.join(missing)}")
        checked = {key: _budget(source, tier, key, budget[key]) for key in TIER_BUDGET_KEYS}
        if checked["per_day"] < checked["per_minute"]:
            raise TierConfigError(f"{source}: tier {tier!r}: per_day ({checked['per_day']}) is "
                                  f"smaller than per_minute ({checked['per_minute']})")
        tiers[tier] = checked
    if DEFAULT_TIER not in tiers:
        raise TierConfigError(f"{source}: the {DEFAULT_TIER!r} tier is required "
                              "(requests with no tier or an unknown tier get its budget)")
    return tiers


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


def load_tier_limits(path: str | os.PathLike[str], *, source: str | None = None) -> dict[str, dict[str, int]]:
    """Reads and validates a tiers file (`.json` or `.toml`). Returns the budgets. Raises
    TierConfigError whose message starts with `source` (default: the file's path)."""
    path = Path(path)
    where = source or str(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise TierConfigError(f"{where}: unsupported file type {path.suffix or '(no suffix)'!r}; "
                              "use a .json or .toml file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TierConfigError(f"{where}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TierConfigError(f"{where}: cannot be read: {exc}") from None
    try:
        if suffix == ".json":
            data = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
        else:
            data = _parse_toml(text)
    except ValueError as exc:  # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
        kind = "JSON" if suffix == ".json" else "TOML"
        raise TierConfigError(f"{where}: invalid {kind}: {exc}") from None
    return validate_tier_limits(data, where)


def tier_limits_from_env(environ: Mapping[str, str] | None = None) -> dict[str, dict[str, int]] | None:
    """The budgets from the file named by GENAI_RATELIMIT_TIERS, or None when it is unset or
    empty. Raises TierConfigError naming the variable, the file and the problem."""
    env = os.environ if environ is None else environ
    value = env.get(TIERS_FILE_ENV, "").strip()
    if not value:
        return None
    return load_tier_limits(value, source=f"{TIERS_FILE_ENV}={value}")
