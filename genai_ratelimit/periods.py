"""Calendar budgets with holds in flight: the rules, with no I/O (docs/spend-budgets.md).

A `Budget` counts integer units (requests, tokens, or money in micro-units: the caller's
amounts) per calendar period: a day, a week (starting Monday) or a month, in an IANA time
zone, DST-correct (a local day is 23, 24 or 25 hours; a month starts at 00:00 local on the
1st). The time-zone arithmetic lives here only: the Redis scripts (lua/lib/budget.lua) see
plain unix milliseconds.

Which period? The script decides at its own now (the Redis server's TIME, or the client's
clock with clock="client"). The client cannot know that instant, so for each budget it
sends the period its own clock falls in and both neighbours (three keys); the script picks
the one holding its now. When the clocks are a whole period apart, the script answers
"stale" with its now, and the plan computes the periods again from that instant (a second
round trip, never a wrong period). A hold belongs to the period that admitted it: settled
after the boundary, it is charged to that period's total, not to the new one.

The plans (`hold_plan`, `settle_plan`) are generators of C calls, driven by the limiters
(limiter.py blocking, aio.py on the event loop), like reservation.py's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator, Iterable, Sequence
from datetime import date, datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Literal

from ._native import RateLimiterError

if TYPE_CHECKING:
    from zoneinfo import ZoneInfo

__all__ = [
    "DEFAULT_HOLD_SECONDS",
    "MAX_THRESHOLDS",
    "Budget",
    "BudgetCrossing",
    "BudgetHold",
    "BudgetPeriod",
    "BudgetSettlement",
    "period_bounds",
]

PeriodName = Literal["day", "week", "month"]
RefusalReason = Literal["permanent", "until_reset", "in_flight"]

PERIODS: tuple[str, ...] = ("day", "week", "month")
# A key outlives its period's end by the longest hold: a hold settled later than this
# after the end of the period that admitted it finds nothing (its key expired) and charges
# nothing. A day, by default; hold(..., hold_seconds=...) changes it.
DEFAULT_HOLD_SECONDS = 86_400
MAX_BUDGETS = 16  # csrc/native.h RL_MAX_BUDGETS: budgets of one hold
MAX_AMOUNT = 2**53 - 1  # exact in Lua's numbers (csrc RL_MAX_LIMIT)
_REASONS: dict[int, RefusalReason] = {1: "permanent", 2: "until_reset", 3: "in_flight"}
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MS = timedelta(milliseconds=1)
_STALE_TRIES = 3  # a stale answer gives the script's now: the second try holds it
# Soft limits per budget: packed in groups of three decimal digits into one integer the
# scripts read (50, 80, 95 -> 50080095), exact in Lua's doubles up to five.
MAX_THRESHOLDS = 5


def _check_int(value: object, name: str, low: int, high: int = MAX_AMOUNT) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be from {low} to {high}, got {value}")
    return value


def _check_text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} must not be empty")
    if len(value.encode("utf-8", "surrogatepass")) > 256:
        raise ValueError(f"{name} must hold at most 256 bytes of UTF-8, got {value[:40]!r}...")
    return value


def _thresholds(value: object) -> tuple[int, ...]:
    """Soft limits: percents of the limit, ints 1..100, strictly increasing, at most
    MAX_THRESHOLDS."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise TypeError(f"thresholds must be a sequence of ints (percents of the limit), "
                        f"not {type(value).__name__}")
    chosen = tuple(value)
    if len(chosen) > MAX_THRESHOLDS:
        raise ValueError(f"thresholds: at most {MAX_THRESHOLDS}, got {len(chosen)}")
    for i, t in enumerate(chosen):
        _check_int(t, f"thresholds[{i}]", 1, 100)
        if i and t <= chosen[i - 1]:
            raise ValueError(f"thresholds must be strictly increasing, got {chosen!r}")
    return chosen


def _packed(thresholds: tuple[int, ...]) -> int:
    """The thresholds as the scripts read them: three decimal digits each (lib/budget.lua)."""
    packed = 0
    for t in thresholds:
        packed = packed * 1000 + t
    return packed


def _zone(tz: object) -> ZoneInfo:
    # Imported here, not with the module: zoneinfo's C part needs datetime's C API, which a
    # subinterpreter of CPython 3.12 does not load, and `import genai_ratelimit` must work there.
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    if not isinstance(tz, str):
        raise TypeError(f"tz must be an IANA time zone name (a str), not {type(tz).__name__}")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as exc:  # ValueError: "../x", "", ...
        raise ValueError(f"tz: no IANA time zone is named {tz!r}") from exc


@dataclasses.dataclass(frozen=True)
class Budget:
    """At most `limit` units per `period` ("day", "week" from Monday, "month") in time zone
    `tz` (an IANA name, e.g. "Europe/Paris"), for `owner` (an org, a team, a key, a user:
    any non-empty str). `name` tells an owner's budgets apart ("monthly_usd",
    "daily_tokens"); `level` is a label the answers carry ("org", "team", ...). Redis key:
    `{key_prefix}:{owner}:{period_start_ms}:budget={name}`. `thresholds`: soft limits,
    percents of the limit (ints 1..100, strictly increasing, at most 5), each reported
    once per period when the budget's use (spent + held) reaches it (docs/spend-budgets.md,
    "Soft limits"). Raises TypeError or ValueError when built (a time zone that does not
    exist, a limit below 1, an unknown period, a bad threshold)."""

    owner: str
    name: str
    limit: int
    period: PeriodName = "month"
    tz: str = "UTC"
    level: str | None = None
    thresholds: tuple[int, ...] = ()
    zone: ZoneInfo = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_text(self.owner, "owner")
        _check_text(self.name, "name")
        _check_int(self.limit, "limit", 1)
        if self.period not in PERIODS:
            raise ValueError(f"period must be 'day', 'week' or 'month', got {self.period!r}")
        if self.level is not None:
            _check_text(self.level, "level")
        object.__setattr__(self, "thresholds", _thresholds(self.thresholds))
        object.__setattr__(self, "zone", _zone(self.tz))

    def period_at(self, instant_ms: int) -> tuple[int, int]:
        """The period holding the instant (unix ms): [start_ms, end_ms)."""
        return period_bounds(self.period, self.zone, instant_ms)


def _midnight_ms(zone: ZoneInfo, day: date) -> int:
    """The first instant of local `day` in unix ms. A midnight that does not exist (a DST
    gap at 00:00) is the instant the gap ends: fold=0 reads it with the offset before."""
    return (datetime(day.year, day.month, day.day, tzinfo=zone) - _EPOCH) // _MS


def _first_day(period: str, day: date) -> date:
    if period == "day":
        return day
    if period == "week":
        return day - timedelta(days=day.weekday())  # Monday
    return day.replace(day=1)


def _next_first_day(period: str, first: date) -> date:
    if period == "day":
        return first + timedelta(days=1)
    if period == "week":
        return first + timedelta(days=7)
    return date(first.year + first.month // 12, first.month % 12 + 1, 1)


def period_bounds(period: str, zone: ZoneInfo, instant_ms: int) -> tuple[int, int]:
    """The calendar period ("day", "week" from Monday, "month") of `zone` holding the
    instant (unix ms), as [start_ms, end_ms) in unix ms: local midnights, so a day is 23,
    24 or 25 hours long across DST changes."""
    local = datetime.fromtimestamp(instant_ms // 1000, zone).date()
    first = _first_day(period, local)
    start = _midnight_ms(zone, first)
    if instant_ms < start:  # a zone whose midnight repeats: the earlier period
        first = _first_day(period, first - timedelta(days=1))
        start = _midnight_ms(zone, first)
    end = _midnight_ms(zone, _next_first_day(period, first))
    if instant_ms >= end:
        first = _next_first_day(period, first)
        start, end = end, _midnight_ms(zone, _next_first_day(period, first))
    return start, end


# The last neighbours computed per (period, tz): a hold's budgets mostly share a calendar,
# and the period changes once a day at most. Read and replaced whole (no lock needed).
_last_neighbours: dict[tuple[str, str], tuple[int, int, int, int]] = {}


def _neighbours(budget: Budget, instant_ms: int) -> tuple[int, int, int, int]:
    """(previous start, start, end, next end) around the period holding the instant."""
    calendar = (budget.period, budget.tz)
    known = _last_neighbours.get(calendar)
    if known is not None and known[1] <= instant_ms < known[2]:
        return known
    start, end = budget.period_at(instant_ms)
    previous, _ = budget.period_at(start - 1)
    _, following = budget.period_at(end)
    if len(_last_neighbours) >= 256:
        _last_neighbours.clear()
    _last_neighbours[calendar] = (previous, start, end, following)
    return previous, start, end, following


@dataclasses.dataclass(frozen=True)
class BudgetPeriod:
    """One budget of a hold's answer: the `amount` asked, what is `remaining` in its period
    (after the hold on allow; limit - spent - held, never below 0), and the period the
    hold was decided in, [period_start_ms, period_end_ms) (period_end_ms: when it resets).
    `hold_id`: "" when one script held every budget (the hold's `hold_id` names it); on a
    Redis Cluster, a hold over several owners is held owner by owner (hold_plan, grouped)
    and each budget carries the id of its owner's hold."""

    budget: Budget
    amount: int
    remaining: int
    period_start_ms: int
    period_end_ms: int
    hold_id: str = ""


@dataclasses.dataclass(frozen=True)
class BudgetCrossing:
    """A soft limit crossed: the budget's use (spent + held) reached `threshold` percent of
    its limit in the period [period_start_ms, period_end_ms), for the first time in that
    period across every replica. `by`: the call that crossed it, "hold" (an admission) or
    "settle" (a usage above its hold); `hold_id`: that hold's id."""

    budget: Budget
    threshold: int
    period_start_ms: int
    period_end_ms: int
    by: Literal["hold", "settle"]
    hold_id: str


def _crossed(budget: Budget, before: int, after: int) -> tuple[int, ...]:
    """The budget's thresholds in (before, after]: those one call crossed."""
    return tuple(t for t in budget.thresholds if before < t <= after)


class BudgetSettlement(int):
    """settle_budgets' answer: the number of budgets whose hold was found (an int, as
    before), with `crossed`, the soft limits the settle crossed (BudgetCrossing)."""

    crossed: tuple[BudgetCrossing, ...]

    def __new__(cls, found: int, crossed: tuple[BudgetCrossing, ...] = ()) -> BudgetSettlement:
        settled = super().__new__(cls, found)
        settled.crossed = crossed
        return settled


@dataclasses.dataclass(frozen=True)
class BudgetHold:
    """The answer of `hold`: `allowed`, with `hold_id` ("" when nothing is held: a refusal,
    or the kill switch) and every budget's `periods`. On a refusal, `refused` is the index
    of the first budget that refused and `reason` why:
      "permanent"    the amount exceeds the budget's whole limit: it can never pass;
      "until_reset"  what is spent leaves no room: wait for the period's end (reset_at_ms);
      "in_flight"    there is room once holds in flight settle: retry shortly.
    `now_ms` is the time the script decided at. `crossed`: the soft limits this hold
    crossed (BudgetCrossing), each once per period across every replica."""

    allowed: bool
    hold_id: str
    periods: tuple[BudgetPeriod, ...]
    now_ms: int
    refused: int | None = None
    reason: RefusalReason | None = None
    crossed: tuple[BudgetCrossing, ...] = ()

    @property
    def refused_by(self) -> BudgetPeriod | None:
        """The budget that refused, or None."""
        return None if self.refused is None else self.periods[self.refused]

    @property
    def reset_at_ms(self) -> int | None:
        """When the refusing budget's period ends (unix ms), or None on allow."""
        refused = self.refused_by
        return None if refused is None else refused.period_end_ms


Call = tuple[str, tuple[Any, ...], dict[str, Any]]
Plan = Generator[Call, Any, Any]


def _amounts(value: object, count: int, name: str) -> tuple[int, ...]:
    """One int for every budget, or one per budget."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (_check_int(value, name, 0),) * count
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be an int or a sequence of ints, not {type(value).__name__}")
    if len(value) != count:
        raise ValueError(f"{name} must give one int per budget ({count}), got {len(value)}")
    return tuple(_check_int(v, f"{name}[{i}]", 0) for i, v in enumerate(value))


def hold_arguments(budgets: object, amount: object,
                   hold_seconds: object) -> tuple[tuple[Budget, ...], tuple[int, ...], int]:
    """Checks hold's arguments before any I/O: (budgets, amounts, hold_ms)."""
    if isinstance(budgets, Budget):
        budgets = (budgets,)
    if not isinstance(budgets, Sequence) or isinstance(budgets, (str, bytes)):
        raise TypeError(f"budgets must be a sequence of Budget, not {type(budgets).__name__}")
    chosen = tuple(budgets)
    if not 1 <= len(chosen) <= MAX_BUDGETS:
        raise ValueError(f"1 to {MAX_BUDGETS} budgets can be held at once, got {len(chosen)}")
    for i, b in enumerate(chosen):
        if not isinstance(b, Budget):
            raise TypeError(f"budgets[{i}] must be a Budget, not {type(b).__name__}")
    seen = set()
    for b in chosen:
        if (b.owner, b.name) in seen:
            raise ValueError(f"budget {b.name!r} of {b.owner!r} appears twice")
        seen.add((b.owner, b.name))
    amounts = _amounts(amount, len(chosen), "amount")
    hold_ms = _check_int(hold_seconds, "hold_seconds", 0, 10 * 366 * 86_400) * 1000
    return chosen, amounts, hold_ms


def _groups(budgets: Sequence[Budget]) -> tuple[tuple[int, ...], ...]:
    """The budgets' indexes by owner, in the order owners first appear: on a Redis Cluster
    an owner's keys carry it as their hash tag, so one owner's budgets meet in one script."""
    owners: dict[str, list[int]] = {}
    for i, b in enumerate(budgets):
        owners.setdefault(b.owner, []).append(i)
    return tuple(tuple(indexes) for indexes in owners.values())


def _hold_once(chosen: tuple[Budget, ...], amounts: tuple[int, ...], hold_ms: int,
               guess: int) -> Plan:
    """One script holding `chosen` (one owner's budgets, or all of them off a cluster), all
    or nothing; again (at most twice) when the script's now falls outside the periods sent,
    from that now. Returns a BudgetHold over `chosen`."""
    for _ in range(_STALE_TRIES):
        rows = tuple((b.owner, b.name, b.limit, a) + _neighbours(b, guess) + (_packed(b.thresholds),)
                     for b, a in zip(chosen, amounts, strict=True))
        answer = yield ("hold_budgets", (chosen[0].owner, rows, hold_ms), {})
        allowed, refused, kind, script_now, hold_id, periods = answer
        if kind >= 0:
            answered = tuple(zip(chosen, amounts, periods, strict=True))
            crossed = tuple(BudgetCrossing(b, t, start, end, "hold", hold_id)
                            for b, _, (_, start, end, before, after) in answered
                            for t in _crossed(b, before, after))
            return BudgetHold(
                allowed=bool(allowed), hold_id=hold_id, now_ms=script_now,
                periods=tuple(BudgetPeriod(b, a, remaining, start, end)
                              for b, a, (remaining, start, end, _, _) in answered),
                refused=None if allowed else refused,
                reason=None if allowed else _REASONS[kind], crossed=crossed)
        guess = script_now
    raise RateLimiterError(f"the budget script's clock moved out of the periods sent {_STALE_TRIES} "
                       f"times (now_ms={guess})")


def hold_plan(budgets: object, amount: object, hold_seconds: object = DEFAULT_HOLD_SECONDS,
              now_ms: int | None = None, grouped: bool = False) -> Plan:
    """hold: one call ("hold_budgets", (owner, budget tuples, hold_ms)) deciding every
    budget in one script, all or nothing; again (at most twice) when the script's now
    falls outside the periods sent, from that now. Returns a BudgetHold. now_ms: the
    client's guess of the script's now (default: this machine's clock).

    grouped (a Redis Cluster: each owner's keys live in its own hash slot) and budgets of
    several owners: one script per owner, in the order the owners first appear, each all
    or nothing. Every group is asked, so the answer is the one a single script gives: the
    first budget that refuses, its reason and period, every budget's remaining (an earlier
    group's hold added back). When some group refuses (or a call fails), every group that
    held is given back exactly (settled to 0 in the period that admitted it: idempotent)
    before the refusal is answered (or the error raised). Between the steps, a group held
    while a later one refuses may refuse a concurrent request spuriously; nothing is ever
    admitted over a limit. A crash between the steps leaves an earlier group's hold until
    its key expires (the period's end plus hold_seconds)."""
    chosen, amounts, hold_ms = hold_arguments(budgets, amount, hold_seconds)
    guess = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    groups = _groups(chosen)
    if not grouped or len(groups) == 1:
        return (yield from _hold_once(chosen, amounts, hold_ms, guess))
    answers: list[tuple[tuple[int, ...], BudgetHold]] = []
    try:
        for group in groups:
            answer = yield from _hold_once(tuple(chosen[i] for i in group),
                                           tuple(amounts[i] for i in group), hold_ms, guess)
            answers.append((group, answer))
            guess = answer.now_ms
    except GeneratorExit:
        raise
    except BaseException:
        yield from _give_back(answer for _, answer in answers)
        raise
    periods: list[BudgetPeriod | None] = [None] * len(chosen)
    for group, answer in answers:
        for i, period in zip(group, answer.periods, strict=True):
            periods[i] = dataclasses.replace(period, hold_id=answer.hold_id)
    crossed = tuple(c for _, answer in answers for c in answer.crossed)
    refusals = [(group[answer.refused], answer) for group, answer in answers
                if not answer.allowed and answer.refused is not None]
    if not refusals:
        return BudgetHold(allowed=True, hold_id=answers[0][1].hold_id,
                          periods=tuple(p for p in periods if p is not None),
                          now_ms=answers[-1][1].now_ms, crossed=crossed)
    yield from _give_back(answer for _, answer in answers)
    for group, answer in answers:  # a group given back: what it had before its hold
        if answer.allowed:
            for i in group:
                held = periods[i]
                assert held is not None
                periods[i] = dataclasses.replace(held, remaining=held.remaining + held.amount)
    refused, refusal = min(refusals, key=lambda r: r[0])
    return BudgetHold(allowed=False, hold_id="",
                      periods=tuple(dataclasses.replace(p, hold_id="") for p in periods
                                    if p is not None),
                      now_ms=refusal.now_ms, refused=refused, reason=refusal.reason,
                      crossed=crossed)


def _give_back(answers: Iterable[BudgetHold]) -> Plan:
    """Settles every allowed group's hold to 0 (idempotent). A give-back that fails (Redis
    gone) leaves that hold until its key expires: the cost of a crash between the steps."""
    for answer in answers:
        if not (answer.allowed and answer.hold_id):
            continue
        try:
            yield from settle_plan(answer, 0)
        except Exception:  # noqa: BLE001 - best effort by design (see above)
            pass


def settle_plan(hold: object, actual: object) -> Plan:
    """settle: one call ("settle_budgets", (owner, budget tuples, hold_id)) moving each
    budget's hold to its admitting period's spent total as `actual` (an int for every
    budget, or one per budget; 0 gives the hold back unused). Returns a BudgetSettlement:
    the number of budgets whose hold was found (0 when it was settled already, expired, or
    nothing was held: then nothing is sent), with the soft limits the settle crossed. A
    hold made owner by owner (a Redis Cluster: BudgetPeriod.hold_id) is settled the same
    way, one call per owner; a call that fails raises after the others were sent."""
    if not isinstance(hold, BudgetHold):
        raise TypeError(f"hold must be a BudgetHold, not {type(hold).__name__}")
    actuals = _amounts(actual, len(hold.periods), "actual")
    if not hold.allowed or not hold.hold_id:
        return BudgetSettlement(0)
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(hold.periods):
        groups.setdefault(p.hold_id or hold.hold_id, []).append(i)
    found_total = 0
    fired_all: list[tuple[int, int]] = [(0, 0)] * len(hold.periods)
    failure: BaseException | None = None
    for hold_id, group in groups.items():
        rows = tuple((p.budget.owner, p.budget.name, p.period_start_ms, actuals[i],
                      p.budget.limit, _packed(p.budget.thresholds))
                     for i, p in ((i, hold.periods[i]) for i in group))
        try:
            found, fired = yield ("settle_budgets", (rows[0][0], rows, hold_id), {})
        except Exception as exc:  # noqa: BLE001 - the other owners are settled first
            if len(groups) == 1:
                raise
            failure = exc
            continue
        found_total += found
        for i, pair in zip(group, fired, strict=True):
            fired_all[i] = pair
    if failure is not None:
        raise failure
    crossed = tuple(BudgetCrossing(p.budget, t, p.period_start_ms, p.period_end_ms, "settle",
                                   p.hold_id or hold.hold_id)
                    for p, (before, after) in zip(hold.periods, fired_all, strict=True)
                    for t in _crossed(p.budget, before, after))
    return BudgetSettlement(found_total, crossed)
