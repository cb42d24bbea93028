"""Tier budgets. A tier changes only the budget consulted, never the algorithm or the keys."""

from __future__ import annotations

__all__ = ["TIER_LIMITS", "DEFAULT_TIER"]

DEFAULT_TIER = "free"

TIER_LIMITS: dict[str, dict[str, int]] = {
    "free": {"per_minute": 5, "per_day": 100},
    "pro": {"per_minute": 60, "per_day": 5_000},
    "enterprise": {"per_minute": 600, "per_day": 100_000},
}
