"""Reserved shares of a shared cap: per class (a tier, or any name given per request), a
share of the cap the class keeps for itself and a ceiling it may not pass once the cap is
above a saturation level. Decided in the cap's own script execution (lua/lib/shares.lua);
this module validates the percentages once, computes every integer the script compares
(no float ever reaches a decision) and builds the script's spec.

For class c taking `cost` in a window of limit L whose use is `used` (every class's):
  reserve: used + cost <= L - sum over active k != c of max(0, R_k - used_k),
           R_k = floor(p_k * L / 100)
  ceiling: when another class is active and used + cost > s_c * L / 100,
           used_c + cost <= q_c * L / 100
where used_k is class k's own use in the window, and a class is active while it has entries
in the window or sent a request (admitted or refused) within it: work-conserving
(docs/upstreams.md, "Reserved shares").

An in-flight cap (`acquire(name, limit, lease_seconds, shares=Shares(...), share_class=...)`)
takes the same rule with cost 1, used = the cap's holders and used_k = class k's holders; a
class is active there while it holds a slot, or asked for one within its lease's length."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .reservation import Scope

__all__ = ["ShareRefusal", "Shares"]

Percent = int | str | Decimal | Fraction
# Class names go into keys and the script's spec: a word of at most 64 characters.
CLASS_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_CLASSES = 64

ShareRule = Literal["reserve", "ceiling"]


@dataclass(frozen=True, slots=True)
class ShareRefusal:
    """Why a reserved-share rule refused a request: `rule` "reserve" (the cap's room that is
    left is held by `share_class`'s reserve, which it does not use yet) or "ceiling" (the
    cap is above `share_class`'s saturation level and the class is at its ceiling);
    `request_class` is the request's class (None: a class with no share)."""

    scope: Scope | str
    rule: ShareRule
    share_class: str
    request_class: str | None

    @property
    def cap_name(self) -> str:
        """The name of the cap that refused: the Scope's, or the in-flight cap's (`scope`
        is then the name given to acquire)."""
        return self.scope if isinstance(self.scope, str) else self.scope.name

    def describe(self) -> str:
        """One sentence for a 429's body."""
        if self.rule == "ceiling":
            return (f"class {self.share_class!r} is at its ceiling of upstream "
                    f"{self.cap_name!r} while the upstream is saturated")
        return (f"the rest of upstream {self.cap_name!r} is reserved for class "
                f"{self.share_class!r}")


@dataclass(frozen=True, slots=True)
class Shares:
    """Reserved shares of an in-flight cap (`acquire(name, limit, lease_seconds,
    shares=..., share_class=...)`), the same mappings as Scope(reserved=, ceilings=):
    `reserved` {class: percent} the slots a class keeps for itself while it is active,
    `ceilings` {class: (ceiling percent, saturation percent)}: once the cap's holders pass
    the saturation, the class may not hold more than its ceiling while another class is
    active. Validated once, here (TypeError / ValueError naming the field); stored as
    Scope stores them (sorted tuples of Fractions)."""

    reserved: Any = ()
    ceilings: Any = ()

    def __post_init__(self) -> None:
        reserved = None if self.reserved == () else self.reserved
        ceilings = None if self.ceilings == () else self.ceilings
        valid_reserved, valid_ceilings = validate(reserved, ceilings)
        if not valid_reserved and not valid_ceilings:
            raise ValueError("Shares needs reserved shares or ceilings")
        object.__setattr__(self, "reserved", valid_reserved)
        object.__setattr__(self, "ceilings", valid_ceilings)


def percent(value: object, what: str, low_open: bool = True) -> Fraction:
    """A percentage as an exact Fraction: an int, a Decimal, a Fraction or a str of an exact
    decimal ("12.5"); in (0, 100] (low_open) or [0, 100]. Never a float."""
    if isinstance(value, bool) or isinstance(value, float) or not isinstance(
            value, (int, str, Decimal, Fraction)):
        raise TypeError(f"{what} must be an int, a Decimal or a str of a decimal number "
                        f"(not {type(value).__name__}: a float is never exact)")
    try:
        number = Fraction(value)
    except (ValueError, ArithmeticError) as error:
        raise ValueError(f"{what} must be a number of percent, got {value!r}") from error
    if (number <= 0 if low_open else number < 0) or number > 100:
        bounds = "(0, 100]" if low_open else "[0, 100]"
        raise ValueError(f"{what} must be in {bounds} percent, got {value!r}")
    return number


def _class_name(name: object, what: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{what}: a class name must be a str, not {type(name).__name__}")
    if not CLASS_NAME.fullmatch(name):
        raise ValueError(f"{what}: class name {name!r} must be 1 to 64 letters, digits, "
                         f"'_', '.' or '-'")
    return name


Reserved = tuple[tuple[str, Fraction], ...]
Ceilings = tuple[tuple[str, Fraction, Fraction], ...]


def validate(reserved: object, ceilings: object) -> tuple[Reserved, Ceilings]:
    """`reserved` {class: percent} and `ceilings` {class: (ceiling percent, saturation
    percent)} as sorted tuples of exact Fractions; TypeError/ValueError naming the field."""
    out_reserved: list[tuple[str, Fraction]] = []
    out_ceilings: list[tuple[str, Fraction, Fraction]] = []
    if reserved is not None:
        if not isinstance(reserved, Mapping):
            raise TypeError(f"reserved must be a mapping of class to percent, not "
                            f"{type(reserved).__name__}")
        for name, share in reserved.items():
            out_reserved.append((_class_name(name, "reserved"),
                                 percent(share, f"reserved[{name!r}]", low_open=False)))
        total = sum((share for _, share in out_reserved), Fraction(0))
        if total > 100:
            raise ValueError(f"reserved shares sum to {float(total):g} %, above 100 %")
    if ceilings is not None:
        if not isinstance(ceilings, Mapping):
            raise TypeError(f"ceilings must be a mapping of class to (ceiling, saturation) "
                            f"percents, not {type(ceilings).__name__}")
        for name, pair in ceilings.items():
            _class_name(name, "ceilings")
            if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise TypeError(f"ceilings[{name!r}] must be a (ceiling, saturation) pair of "
                                f"percents, got {pair!r}")
            out_ceilings.append((name, percent(pair[0], f"ceilings[{name!r}] ceiling"),
                                 percent(pair[1], f"ceilings[{name!r}] saturation")))
    names = {name for name, _ in out_reserved} | {name for name, _, _ in out_ceilings}
    if len(names) > MAX_CLASSES:
        raise ValueError(f"at most {MAX_CLASSES} classes per scope, got {len(names)}")
    return tuple(sorted(out_reserved)), tuple(sorted(out_ceilings))


def classes_of(scope: Scope | Shares) -> tuple[str, ...]:
    """The classes a scope knows, in the script's order (sorted)."""
    return tuple(sorted({n for n, _ in scope.reserved} | {n for n, _, _ in scope.ceilings}))


def _floor_of(share: Fraction, limit: int) -> int:
    return (share.numerator * limit) // (share.denominator * 100)


def _units(source: Scope | Shares, names: tuple[str, ...], limit: int) -> list[str]:
    """R_j C_j S_j of each class j of `names` in a cap of `limit` units: its reserve, its
    ceiling and its saturation level (no ceiling: C_j = S_j = limit)."""
    reserve = dict(source.reserved)
    ceiling = {name: (top, saturation) for name, top, saturation in source.ceilings}
    words = []
    for name in names:
        top, saturation = ceiling.get(name, (Fraction(100), Fraction(100)))
        words += [str(_floor_of(reserve.get(name, Fraction(0)), limit)),
                  str(_floor_of(top, limit)), str(_floor_of(saturation, limit))]
    return words


def spec(scope: Scope, shared_index: int, request_class: str | None) -> str:
    """lua/lib/shares.lua's spec for a call whose `shared_index`-th shared scope (1-based)
    is `scope`, for a request of `request_class` (None: no class)."""
    names = classes_of(scope)
    if request_class is not None and request_class not in names:
        raise ValueError(f"scope_class {request_class!r} is not a class of scope "
                         f"{scope.name!r} (its classes: {', '.join(names)})")
    c = names.index(request_class) + 1 if request_class is not None else 0
    words = ["S", str(shared_index), str(c), str(len(names)), *names]
    windows = [(limit, seconds, "requests") for limit, seconds in scope.windows]
    windows += [(limit, seconds, "tokens") for limit, seconds in scope.token_windows]
    words.append(str(len(windows)))
    for limit, seconds, resource in windows:
        words += [str(seconds * 1000), resource, *_units(scope, names, limit)]
    return " ".join(words)


def refusal(scope: Scope, code: int, request_class: str | None) -> ShareRefusal | None:
    """The script's rule code (2j: class j's reserve, 2j + 1: class j's ceiling) read back."""
    return _rule_read(scope, classes_of(scope), code, request_class, "a scope")


def _rule_read(owner: Scope | str, names: tuple[str, ...], code: int, request_class: str | None,
               what: str) -> ShareRefusal | None:
    """A rule code of a window cap's (owner: its Scope) or an in-flight cap's (owner: its
    name) classes `names`, read back: None below 2 (no rule refused)."""
    if code < 2:
        return None
    j, ceiling = divmod(code, 2)
    if not 1 <= j <= len(names):
        raise ValueError(f"the script answered share rule {code}, for {what} of {len(names)} "
                         f"classes")
    return ShareRefusal(owner, "ceiling" if ceiling else "reserve", names[j - 1], request_class)


def lease_spec(shares: Shares, limit: int, request_class: str | None) -> str:
    """lua/lib/shares.lua's lease_shares spec for an acquire of `limit` slots by a request
    of `request_class` (None: no class): "L c m names R_1 C_1 S_1 .. R_m C_m S_m"."""
    names = classes_of(shares)
    if request_class is not None and request_class not in names:
        raise ValueError(f"share_class {request_class!r} is not a class of the cap's shares "
                         f"(its classes: {', '.join(names)})")
    c = names.index(request_class) + 1 if request_class is not None else 0
    return " ".join(["L", str(c), str(len(names)), *names, *_units(shares, names, limit)])


def lease_refusal(name: str, shares: Shares, code: int,
                  request_class: str | None) -> ShareRefusal | None:
    """An acquire's rule code (2j: class j's reserve, 2j + 1: class j's ceiling) read back."""
    return _rule_read(name, classes_of(shares), code, request_class, "shares")
