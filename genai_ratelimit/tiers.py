"""Tier budgets. A tier changes only the budget consulted, never the algorithm or the keys.

TIER_LIMITS counts requests (the contract's budgets). TIER_TOKEN_LIMITS counts tokens: what
a GenAI request really spends (prompt + completion, as an OpenAI-shaped `usage.total_tokens`
reports it), per minute and per day, used by `genai_ratelimit.fastapi.TokenRateLimit`. The
token defaults follow the request defaults' proportions: a free user may ask for about 2,000
tokens per request (10,000 a minute over 5 requests), pro and enterprise about 3,300."""

from __future__ import annotations

__all__ = ["TIER_LIMITS", "TIER_TOKEN_LIMITS", "DEFAULT_TIER", "DEFAULT_MAX_TOKENS"]

DEFAULT_TIER = "free"

TIER_LIMITS: dict[str, dict[str, int]] = {
    "free": {"per_minute": 5, "per_day": 100},
    "pro": {"per_minute": 60, "per_day": 5_000},
    "enterprise": {"per_minute": 600, "per_day": 100_000},
}

TIER_TOKEN_LIMITS: dict[str, dict[str, int]] = {
    "free": {"per_minute": 10_000, "per_day": 100_000},
    "pro": {"per_minute": 200_000, "per_day": 5_000_000},
    "enterprise": {"per_minute": 2_000_000, "per_day": 50_000_000},
}

# The completion tokens a request is assumed to ask for when it names no max_tokens /
# max_completion_tokens (TokenRateLimit's default estimate; `default_max_tokens=` changes it).
DEFAULT_MAX_TOKENS = 1_000
