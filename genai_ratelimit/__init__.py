"""genai-ratelimit: exact sliding-window rate limiting for GenAI endpoints on Redis.

    from genai_ratelimit import RateLimiter
    allowed, remaining, retry_after_s = RateLimiter().check("user_8421", limit=10, window_seconds=60)
"""

from __future__ import annotations

from ._native import (
    MAX_LIMIT,
    SCRIPT_SHA1,
    RateLimiterAuthError,
    RateLimiterError,
    RateLimiterTimeout,
    RateLimiterUnavailable,
    WindowDecision,
)
from ._version import __version__
from .aio import AsyncRateLimiter
from .lease import AsyncLease, Lease
from .limiter import RateLimiter
from .periods import Budget, BudgetCrossing, BudgetHold, BudgetPeriod, BudgetSettlement
from .prices import ModelPrice, PriceRule, PriceTable, PriceTableError, TokenUsage, UnpricedModel
from .provider_limits import ProviderLimits, read_provider_limits
from .reservation import Reservation, Scope, WindowState
from .shares import ShareRefusal, Shares
from .tiers import TIER_LIMITS, TIER_TOKEN_LIMITS

__all__ = [
    "RateLimiter",
    "AsyncRateLimiter",
    "RateLimiterError",
    "RateLimiterUnavailable",
    "RateLimiterTimeout",
    "RateLimiterAuthError",
    "WindowDecision",
    "Reservation",
    "WindowState",
    "Scope",
    "ShareRefusal",
    "Shares",
    "Lease",
    "AsyncLease",
    "PriceTable",
    "ModelPrice",
    "PriceRule",
    "TokenUsage",
    "UnpricedModel",
    "PriceTableError",
    "Budget",
    "BudgetCrossing",
    "BudgetHold",
    "BudgetPeriod",
    "ProviderLimits",
    "read_provider_limits",
    "BudgetSettlement",
    "TIER_LIMITS",
    "TIER_TOKEN_LIMITS",
    "SCRIPT_SHA1",
    "MAX_LIMIT",
    "__version__",
]
