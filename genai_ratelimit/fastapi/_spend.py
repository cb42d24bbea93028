"""Money budgets of a TokenRateLimit: the levels, their limits, the worst case of a request.

What is read of a request here (its owners at each level, the overrides the app gives) is
turned into `SpendFacts`: the `Budget`s to hold and the amount, which the plan (`_plan.py`)
holds after the token reservation is allowed. The keys of a budget never depend on its
limit: an override changes the limit, never what was spent.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from fastapi import Request

from ..periods import Budget, BudgetHold, PeriodName
from ..prices import PriceTable

#: A money amount in the currency's unit: an int ($50) or a decimal string ("0.45").
Amount = int | str | Decimal
OwnerOf = Callable[[Request], "str | None | Awaitable[str | None]"]
LimitOf = Callable[[str, str, str], "Amount | None | Awaitable[Amount | None]"]

_PERIODS: dict[str, PeriodName] = {"daily": "day", "weekly": "week", "monthly": "month"}
_NAME = re.compile(r"(daily|weekly|monthly)_([a-z0-9]+)\Z")


def money_units(table: PriceTable, value: object, where: str) -> int:
    """An amount in the currency's unit (an int, or a decimal string / Decimal) as the table's
    integer money units, exactly: a float, or more decimals than a unit holds, is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, str, Decimal)):
        raise TypeError(f"{where} must be an int or a decimal string such as '0.45' "
                        f"(no float), not {type(value).__name__}")
    try:
        number = Decimal(value) if not isinstance(value, Decimal) else value
    except InvalidOperation:
        raise ValueError(f"{where} must be a decimal number such as '0.45', got {value!r}") from None
    if not number.is_finite():
        raise ValueError(f"{where} must be a finite amount, got {value!r}")
    units = number * table.units_per_currency
    if units != units.to_integral_value():
        raise ValueError(f"{where} = {value!r} is finer than one money unit "
                         f"(1/{table.units_per_currency} {table.currency})")
    amount = int(units)
    if not 1 <= amount <= 2**53 - 1:
        raise ValueError(f"{where} must be at least one money unit and at most 2**53 - 1 units, "
                         f"got {value!r}")
    return amount


def budget_limits(table: PriceTable, limits: Mapping[str, Any], where: str) -> dict[str, int]:
    """{"daily_usd": "1", "monthly_usd": 50} checked against the table's currency, as money
    units."""
    if not isinstance(limits, Mapping):
        raise TypeError(f"{where} must be a mapping such as {{'daily_usd': '1.00'}}, "
                        f"not {type(limits).__name__}")
    currency = table.currency.lower()
    checked: dict[str, int] = {}
    for name, value in limits.items():
        match = _NAME.match(name) if isinstance(name, str) else None
        if match is None or match.group(2) != currency:
            raise ValueError(f"{where}: unknown budget {name!r}; expected daily_{currency}, "
                             f"weekly_{currency} or monthly_{currency} (the price table's "
                             f"currency is {table.currency})")
        checked[name] = money_units(table, value, f"{where}.{name}")
    return checked


@dataclass(frozen=True)
class SpendLevel:
    """Money budgets at one level of a hierarchy (an org, a team, a user, ...), decided in
    the same hold as the key's own. `owner_of(request)` (sync or async) names the owner at
    this level, or None when the request has none (the level is skipped); `budgets` are
    its limits in the currency's unit, e.g. {"monthly_usd": "2000"}."""

    level: str
    owner_of: OwnerOf
    budgets: Mapping[str, Amount]

    def __post_init__(self) -> None:
        if not isinstance(self.level, str) or not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", self.level):
            raise ValueError(f"SpendLevel level must be a short lowercase name such as 'org', "
                             f"got {self.level!r}")
        if self.level == "key":
            raise ValueError("SpendLevel level 'key' is the dependency's own (spend_limits=)")
        if not callable(self.owner_of):
            raise TypeError(f"SpendLevel owner_of must be a callable taking the request, "
                            f"not {type(self.owner_of).__name__}")


@dataclass(frozen=True, slots=True)
class SpendFacts:
    """What the plan holds for one request: its budgets, the worst case (money units), how
    long a hold may stay, and what the answers say (model, table)."""

    budgets: tuple[Budget, ...]
    amount: int
    hold_seconds: int
    model: str
    table: PriceTable


@dataclass(frozen=True, slots=True)
class SpendHeld:
    """An allowed hold kept for its settle."""

    hold: BudgetHold
    model: str
    table: PriceTable
    amount: int


def held_levels(held: SpendHeld) -> tuple[str, ...]:
    """The levels a hold reached ("key" for the key's own budgets), each once, in order:
    the metrics' `level` label (from the configuration, never an owner)."""
    return tuple(dict.fromkeys(p.budget.level or "key" for p in held.hold.periods))


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class SpendConfig:
    """The money side of a TokenRateLimit, checked once when it is built."""

    def __init__(self, table: object, spend_limits: Mapping[str, Mapping[str, Any]] | None,
                 spend_levels: Any, spend_limit_of: LimitOf | None, spend_tz: str,
                 hold_seconds: int) -> None:
        if not isinstance(table, PriceTable):
            raise TypeError(f"prices must be a genai_ratelimit.PriceTable, not {type(table).__name__}")
        self.table = table
        self.tiers: dict[str, dict[str, int]] = {}
        if spend_limits is not None:
            if not isinstance(spend_limits, Mapping):
                raise TypeError("spend_limits must map tiers to budgets, e.g. "
                                "{'free': {'daily_usd': '1'}}")
            for tier, limits in spend_limits.items():
                self.tiers[str(tier)] = budget_limits(table, limits, f"spend_limits[{tier!r}]")
        levels = tuple(spend_levels or ())
        names = set()
        self.levels: list[tuple[SpendLevel, dict[str, int]]] = []
        for level in levels:
            if not isinstance(level, SpendLevel):
                raise TypeError(f"spend_levels must hold SpendLevel objects, not {type(level).__name__}")
            if level.level in names:
                raise ValueError(f"spend_levels: level {level.level!r} named twice")
            names.add(level.level)
            self.levels.append((level, budget_limits(table, level.budgets,
                                                     f"SpendLevel({level.level!r}).budgets")))
        if spend_limit_of is not None and not callable(spend_limit_of):
            raise TypeError("spend_limit_of must be a callable (level, owner, name) -> amount | None")
        self.limit_of = spend_limit_of
        Budget("check", "daily_x", 1, "day", spend_tz)  # the time zone, checked now
        self.tz = spend_tz
        if isinstance(hold_seconds, bool) or not isinstance(hold_seconds, int) or hold_seconds < 1:
            raise ValueError(f"spend_hold_seconds must be an int >= 1, got {hold_seconds!r}")
        self.hold_seconds = hold_seconds

    async def _limit(self, level: str, owner: str, name: str, limit: int) -> int:
        if self.limit_of is None:
            return limit
        value = await _maybe_await(self.limit_of(level, owner, name))
        if value is None:
            return limit
        return money_units(self.table, value, f"spend_limit_of({level!r}, {owner!r}, {name!r})")

    async def budgets(self, request: Request, identity: str, user_id: str, tier: str,
                      shadow: bool) -> tuple[Budget, ...]:
        """The budgets of this request: the key's (its tier's spend_limits, owner the
        dependency's identity), then each level's whose owner_of names one."""
        found: list[Budget] = []
        own = self.tiers.get(tier)
        if own is None:
            own = self.tiers.get("free", {})
        for name, limit in own.items():
            found.append(Budget(identity, name, await self._limit("key", user_id, name, limit),
                                _PERIODS[name.split("_", 1)[0]], self.tz, level="key"))
        for level, limits in self.levels:
            owner = await _maybe_await(level.owner_of(request))
            if owner is None:
                continue
            if not isinstance(owner, str) or not owner:
                raise TypeError(f"SpendLevel({level.level!r}).owner_of must return a non-empty "
                                f"str or None, got {owner!r}")
            key_owner = f"{'shadow:' if shadow else ''}{level.level}:{owner}"
            for name, limit in limits.items():
                found.append(Budget(key_owner, name,
                                    await self._limit(level.level, owner, name, limit),
                                    _PERIODS[name.split("_", 1)[0]], self.tz, level=level.level))
        return tuple(found)
