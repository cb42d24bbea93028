"""Reservations: reserve an estimated cost, reconcile it with what the request really cost.

`limiter.reserve(user_id, windows, cost=..., token_windows=..., tokens=...)` decides a
request against its request windows and its token windows in ONE script execution, all or
nothing (lua/sliding_window.lua), and returns a Reservation. `limiter.reconcile(reservation,
actual)` then sets the logged entry's cost to `actual` in every window where it still is
(lua/reconcile.lua): lower refunds, higher charges, 0 removes it; the same call twice
changes nothing. This module holds what the blocking and the asyncio limiter share: the
Reservation type and the arguments of the reconcile call."""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from . import shares as _shares
from .lease import Lease
from .shares import ShareRefusal

__all__ = ["Reservation", "Scope", "WindowState"]

Resource = Literal["requests", "tokens"]
Windows = tuple[tuple[int, int], ...]

# The most scopes one decision takes (csrc/native.h RL_MAX_SCOPES; the C layer checks it
# too) and the longest name, in bytes of UTF-8 (RL_MAX_SCOPE_NAME).
MAX_SCOPES = 8
MAX_SCOPE_NAME_BYTES = 256
# A cap that follows its provider (Scope.probe): the most probes one cold cap admits, and
# the longest a probe's answer is waited for (lib/upstream.lua's cold start).
MAX_PROBE = 1000
DEFAULT_PROBE_TIMEOUT_SECONDS = 30.0
MAX_PROBE_TIMEOUT_SECONDS = 86400.0


def _window_pairs(value: object, what: str) -> Windows:
    """(limit, window_seconds) pairs as a tuple of int pairs; TypeError/ValueError otherwise."""
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise TypeError(f"{what} must be a sequence of (limit, window_seconds) pairs, "
                        f"not {type(value).__name__}")
    pairs = []
    for i, pair in enumerate(value):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"{what}[{i}] must be a (limit, window_seconds) pair, "
                            f"got {type(pair).__name__}")
        for number in pair:
            if isinstance(number, bool) or not isinstance(number, int):
                raise TypeError(f"{what}[{i}] must hold ints, not {type(number).__name__}")
            if number < 1:
                raise ValueError(f"{what}[{i}] must hold positive ints, got {tuple(pair)}")
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)


@dataclass(frozen=True, slots=True)
class Scope:
    """Windows decided together with the user's own, in the same script, all or nothing,
    that belong to someone else than the user's own budget.

    shared=False: a budget of this user apart from its tier's, e.g. a route's or a model's
    ("route:/v1/embeddings", "model:gpt-4o"): its keys live under the user
    ({prefix}:{user_id}:60:scope={name}). shared=True: a budget every user draws from, e.g.
    an upstream provider's caps ("openai/gpt-4o"): its keys live under the name
    ({prefix}:{name}:60:shared). A request refused by any window charges nothing anywhere.

    reserved, ceilings (shared=True only): reserved shares of the cap per class, decided in
    the same script (docs/upstreams.md, "Reserved shares"). `reserved` {class: percent} is
    the share a class keeps for itself (no other class can take it while it does not use
    it); `ceilings` {class: (ceiling percent, saturation percent)}: once the cap is above
    its saturation, the class may not pass its ceiling. Percents are ints, Decimals or
    strs of exact decimals. The request's class is reserve(..., scope_class=...). Stored as
    sorted tuples: reserved ((class, Fraction), ...), ceilings ((class, ceiling,
    saturation), ...).

    probe, probe_timeout_seconds (shared=True only): the cap follows its provider
    (docs/upstreams.md, "Cold start"): while nothing was heard from the provider (no
    observe_upstream yet, or its view expired), the cap admits at most `probe` requests
    (an int, 0: off, the default) until the first answer is observed, and refuses the
    others with a wait of at most a second; a probe whose answer is never observed stops
    counting after `probe_timeout_seconds` (> 0, at most a day; default 30).
    """

    name: str
    # Stored as tuples of (limit, window_seconds) tuples, whatever sequences were given.
    windows: Sequence[tuple[int, int]] = ()
    token_windows: Sequence[tuple[int, int]] = ()
    shared: bool = False
    reserved: Any = ()
    ceilings: Any = ()
    probe: int = 0
    probe_timeout_seconds: float = DEFAULT_PROBE_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"a Scope's name must be a str, not {type(self.name).__name__}")
        size = len(self.name.encode("utf-8"))  # lone surrogates: UnicodeEncodeError (ValueError)
        if not 1 <= size <= MAX_SCOPE_NAME_BYTES:
            raise ValueError(f"a Scope's name must hold 1 to {MAX_SCOPE_NAME_BYTES} bytes of "
                             f"UTF-8, got {size}")
        if not isinstance(self.shared, bool):
            raise TypeError(f"shared must be a bool, not {type(self.shared).__name__}")
        object.__setattr__(self, "windows", _window_pairs(self.windows, "windows"))
        object.__setattr__(self, "token_windows",
                           _window_pairs(self.token_windows, "token_windows"))
        if not self.windows and not self.token_windows:
            raise ValueError(f"Scope {self.name!r} needs at least one window or token window")
        reserved = None if self.reserved == () else self.reserved
        ceilings = None if self.ceilings == () else self.ceilings
        if (reserved is not None or ceilings is not None) and not self.shared:
            raise ValueError(f"Scope {self.name!r}: reserved and ceilings need shared=True")
        valid_reserved, valid_ceilings = _shares.validate(reserved, ceilings)
        object.__setattr__(self, "reserved", valid_reserved)
        object.__setattr__(self, "ceilings", valid_ceilings)
        check_probe(self.probe, self.probe_timeout_seconds)
        if self.probe and not self.shared:
            raise ValueError(f"Scope {self.name!r}: probe needs shared=True")

    @property
    def probe_timeout_ms(self) -> int:
        """probe_timeout_seconds in whole milliseconds (at least 1)."""
        return max(1, math.ceil(self.probe_timeout_seconds * 1000))

    @property
    def has_shares(self) -> bool:
        """Whether the scope has reserved shares or ceilings."""
        return bool(self.reserved or self.ceilings)

    def native(self) -> tuple[str, bool, Windows, Windows]:
        """The C layer's form (csrc/py_request.c add_scopes)."""
        return (self.name, self.shared, tuple(self.windows), tuple(self.token_windows))

    def windows_of(self, resource: Resource) -> Sequence[tuple[int, int]]:
        return self.token_windows if resource == "tokens" else self.windows


@dataclass(frozen=True, slots=True)
class WindowState:
    """One window of a reservation, as the decision left it."""

    limit: int
    window_seconds: int
    resource: Resource
    # Units left in the window after this decision (the request's own cost taken when it
    # was allowed, not taken when it was refused); None for a window the decision never
    # reached (after the window that refused it).
    remaining: int | None
    # The Scope the window belongs to; None for the user's own windows.
    scope: Scope | None = None


@dataclass(frozen=True, slots=True)
class Reservation:
    """The answer of `reserve`: the decision, and what `reconcile` needs to find its entry.

    allowed, remaining, retry_after_s, window_seconds: as check_windows answers them, over
    every window; `resource` says whether the deciding window counts requests or tokens,
    `scope` whose window it is (None: the user's own; a Scope with shared=True: a budget
    shared by every user, such as an upstream's cap).
    """

    allowed: bool
    remaining: int
    retry_after_s: int
    window_seconds: int
    resource: Resource
    # The same wait in milliseconds, not rounded up to a second (0 when allowed): for
    # clients that can sleep precisely (a `retry-after-ms` header).
    retry_after_ms: int
    user_id: str
    cost: int
    tokens: int | None
    windows: tuple[WindowState, ...]
    # The logged entry: its UUID4 member and its time (unix ms). The member is "" when
    # nothing was logged (refused, or RATE_LIMIT_DISABLED): reconcile then sends nothing.
    member: str
    timestamp_ms: int
    scope: Scope | None = None
    scopes: tuple[Scope, ...] = ()
    # Decided in steps (RateLimiter._two_step_scopes): the (member, timestamp_ms, tie) entry
    # of each shared scope, in the order of `scopes`, each logged by a step of its own.
    shared_entries: tuple[tuple[str, int, int], ...] = field(default=(), repr=False)
    # storage="compact": with timestamp_ms it names the logged entry in its windows (the
    # compact log keeps no member per entry); 0 in the sorted-set storage.
    tie: int = 0
    # reserve(..., in_flight=(limit, lease_seconds)): the in-flight slot taken in the same
    # script execution. A granted Lease (its lease_id is the entry's member: release it, or
    # reconcile(..., release=True)) when the request was allowed; a refused Lease when the
    # slot refused it (then no window was decided: window_seconds 0, resource "requests",
    # every window's remaining None, the lease's wait); None when a window refused it (no
    # slot is held) or without in_flight.
    lease: Lease | None = field(default=None, compare=False)
    # Refused by a reserved-share rule of a shared scope (Scope reserved/ceilings): which
    # class, which rule; None otherwise. scope_class: the class the request was decided as.
    share_refusal: ShareRefusal | None = None
    scope_class: str | None = None
    # reserve(..., max_wait=...): how its wait in the shared scopes' queue ended
    # ("queued_then_allowed", "queue_timeout", "queue_full"; "" when it did not wait) and how
    # long it waited (ms). docs/wait-queue.md.
    queue_outcome: str = ""
    waited_ms: int = 0

    def remaining_of(self, resource: Resource, scope: Scope | None | Literal["any"] = "any"
                     ) -> int | None:
        """The fewest units left over the windows of one resource the decision reached
        (of one scope when `scope` is given: None for the user's own), or None when it has
        none."""
        left = [w.remaining for w in self.windows
                if w.resource == resource and w.remaining is not None
                and (scope == "any" or w.scope == scope)]
        return min(left) if left else None

    @property
    def remaining_requests(self) -> int | None:
        return self.remaining_of("requests")

    @property
    def remaining_tokens(self) -> int | None:
        return self.remaining_of("tokens")


def windows_of(reservation: Reservation, resource: Resource) -> list[tuple[int, int]]:
    """The user's own windows of one resource."""
    return [(w.limit, w.window_seconds) for w in reservation.windows
            if w.resource == resource and w.scope is None]


def _states(report: Sequence[Any], scopes: Sequence[Scope]) -> tuple[WindowState, ...]:
    return tuple(WindowState(limit, seconds, "tokens" if token else "requests", left,
                             scopes[index - 1] if index else None)
                 for limit, seconds, token, left, index in report)


def make_reservation(raw: tuple[Any, ...], user_id: str, cost: int, tokens: int | None,
                     scopes: Sequence[Scope] = (), lease: Any = None,
                     scope_class: str | None = None) -> Reservation:
    """A Reservation from the C extension's reserve tuple (see Limiter._reserve); `scopes`
    are the Scopes of that call, in its order; `lease(raw)` makes the Lease of an in-flight
    slot from the tuple's last element."""
    (allowed, remaining, retry, window_seconds, is_tokens, member, timestamp_ms, report,
     retry_ms, scope_index, tie, slot, share_rule) = raw
    resource: Resource = "tokens" if is_tokens else "requests"
    share_refusal = None
    if share_rule and scope_index:
        share_refusal = _shares.refusal(scopes[scope_index - 1], share_rule, scope_class)
    return Reservation(
        allowed=allowed, remaining=remaining, retry_after_s=retry, retry_after_ms=retry_ms,
        window_seconds=window_seconds, lease=lease(slot) if slot is not None and lease else None,
        resource=resource, user_id=user_id, cost=cost,
        tokens=tokens, windows=_states(report, scopes), member=member, timestamp_ms=timestamp_ms,
        scope=scopes[scope_index - 1] if scope_index else None, scopes=tuple(scopes), tie=tie,
        share_refusal=share_refusal, scope_class=scope_class)


def check_probe(probe: object, timeout_seconds: object) -> None:
    """A Scope's (or an Upstream's) probe and probe_timeout_seconds: raises TypeError or
    ValueError naming the field."""
    if isinstance(probe, bool) or not isinstance(probe, int):
        raise TypeError(f"probe must be an int, not {type(probe).__name__}")
    if not 0 <= probe <= MAX_PROBE:
        raise ValueError(f"probe must be 0 (off) to {MAX_PROBE}, got {probe}")
    if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)):
        raise TypeError(f"probe_timeout_seconds must be a number, not "
                        f"{type(timeout_seconds).__name__}")
    if not 0 < timeout_seconds <= MAX_PROBE_TIMEOUT_SECONDS:  # NaN fails too
        raise ValueError(f"probe_timeout_seconds must be > 0 and at most "
                         f"{MAX_PROBE_TIMEOUT_SECONDS:g}, got {timeout_seconds!r}")


def probe_spec(shared: Sequence[Scope]) -> str | None:
    """lib/upstream.lua's probe spec for a call whose shared scopes are `shared` (in the
    order of their view keys): "P p_1 t_1 ...", or None when none follows its provider."""
    if not any(scope.probe for scope in shared):
        return None
    return "P " + " ".join(f"{scope.probe} {scope.probe_timeout_ms}" for scope in shared)


def _scope_list(scopes: object) -> tuple[Scope, ...]:
    if isinstance(scopes, (str, bytes, Scope)) or not isinstance(scopes, Sequence):
        raise TypeError(f"scopes must be a sequence of Scope, not {type(scopes).__name__}")
    for scope in scopes:
        if not isinstance(scope, Scope):
            raise TypeError(f"scopes must hold Scope objects, not {type(scope).__name__}")
    if len(scopes) > MAX_SCOPES:
        raise ValueError(f"at most {MAX_SCOPES} scopes can be decided at once, got {len(scopes)}")
    return tuple(scopes)


def reserve_arguments(cost: int, token_windows: Sequence[tuple[int, int]],
                      tokens: int | None, scopes: Sequence[Scope] = (),
                      in_flight: tuple[int, int] | None = None,
                      scope_class: str | None = None, *, decides: bool = True
                      ) -> dict[str, Any]:
    """The keyword arguments of the C reserve call (validated there); decides=False: a
    peek's (no probe, which only an admission counts)."""
    arguments: dict[str, Any] = {"cost": cost, "token_windows": token_windows}
    shared = [scope for scope in scopes if scope.shared]
    probe = probe_spec(shared) if decides else None
    if probe is not None:
        if in_flight is not None:
            raise ValueError("a probe (a cap that follows its provider) does not go with "
                             "in_flight yet")
        arguments["probe"] = probe
    with_shares = [scope for scope in shared if scope.has_shares]
    if len(with_shares) > 1:
        raise ValueError("one decision takes at most one scope with reserved shares")
    if with_shares:
        if in_flight is not None:
            raise ValueError("reserved shares do not go with in_flight yet")
        arguments["shares"] = _shares.spec(with_shares[0], shared.index(with_shares[0]) + 1,
                                           scope_class)
    if tokens is not None:
        arguments["tokens"] = tokens
    if scopes:
        arguments["scopes"] = tuple(scope.native() for scope in scopes)
    if in_flight is not None:
        arguments["in_flight"] = in_flight
    return arguments


# --- one plan for both limiters ---------------------------------------------------------
#
# A plan is a generator that yields the C calls of one operation, ("reserve" | "reconcile" |
# "validate", positional, keywords), is sent each call's answer (or thrown its exception)
# and returns the operation's result. RateLimiter runs the calls blocking, AsyncRateLimiter
# awaits them: the two-step logic exists once.

Call = tuple[str, tuple[Any, ...], dict[str, Any]]
Plan = Generator[Call, Any, Any]


def advance(plan: Plan, answer: Any = None,
            error: BaseException | None = None) -> tuple[Call | None, Any]:
    """One step of a plan: sends the last call's answer (or throws its error; nothing to
    start it). Returns (the next call, None), or (None, the plan's result) once it is done."""
    try:
        call = plan.throw(error) if error is not None else plan.send(answer)
    except StopIteration as done:
        return None, done.value
    return call, None


def check_scope_class(scope_class: object, shared: Sequence[Scope]) -> None:
    """reserve's scope_class: None, or a str when a shared scope has reserved shares."""
    if scope_class is not None:
        if not isinstance(scope_class, str):
            raise TypeError(f"scope_class must be a str, not {type(scope_class).__name__}")
        if not any(s.has_shares for s in shared):
            raise ValueError("scope_class needs a shared Scope with reserved or ceilings")


def reserve_plan(user_id: str, windows: Sequence[tuple[int, int]], cost: int,
                 token_windows: Sequence[tuple[int, int]], tokens: int | None,
                 scopes: object, two_step: bool, in_flight: tuple[int, int] | None = None,
                 lease: Any = None, scope_class: str | None = None) -> Plan:
    """reserve: one script over every window; or, two_step and some scope shared, one step
    per shared scope (each lives in its own cluster slot), then the user's own windows and
    scopes. When a step refuses (or fails), every earlier step is refunded exactly: its
    entry reconciled to cost 0. Shared scopes go first: a crash between the steps leaves
    an entry in a shared cap (the provider is protected, a little too much, until it leaves
    the window), never a charge on the user for a request the cap refused."""
    chosen = _scope_list(scopes)
    shared = tuple(s for s in chosen if s.shared)
    check_scope_class(scope_class, shared)
    if not two_step or not shared:
        raw = yield ("reserve", (user_id, windows),
                     reserve_arguments(cost, token_windows, tokens, chosen, in_flight,
                                       scope_class))
        return make_reservation(raw, user_id, cost, tokens, chosen, lease, scope_class)
    own = tuple(s for s in chosen if not s.shared)
    if in_flight is not None and not (windows or token_windows or own):
        raise ValueError("in_flight with shared scopes on a Redis Cluster needs windows of "
                         "the user's own (the slot is taken in their step)")
    # Everything is validated (no I/O) before the first step writes anything.
    yield ("validate", (user_id, windows),
           reserve_arguments(cost, token_windows, tokens, chosen, scope_class=scope_class))
    steps: list[tuple[tuple[Scope, ...], Windows, Windows]] = [((s,), (), ()) for s in shared]
    if windows or token_windows or own:
        steps.append((own, tuple(windows), tuple(token_windows)))
    done: list[Reservation] = []
    for number, (step_scopes, step_windows, step_token_windows) in enumerate(steps):
        step_tokens = tokens if step_token_windows or any(s.token_windows for s in step_scopes) \
            else None
        own_step = number == len(shared)
        try:
            raw = yield ("reserve", (user_id, step_windows),
                         reserve_arguments(cost, step_token_windows, step_tokens, step_scopes,
                                           in_flight if own_step else None, scope_class))
        except BaseException:
            yield from _refund_all(done)
            raise
        step = make_reservation(raw, user_id, cost, step_tokens, step_scopes, lease,
                                scope_class)
        if not step.allowed:
            yield from _refund_all(done)
            states = tuple(_unspent(w, cost, tokens) for r in done for w in r.windows)
            states += step.windows
            for later_scopes, later_windows, later_token_windows in steps[number + 1:]:
                states += _unreached(later_windows, later_token_windows, later_scopes)
            return _with(step, windows=states, scopes=chosen, tokens=tokens)
        done.append(step)
    user_step = done[-1] if len(done) > len(shared) else None
    tightest = min(done, key=lambda r: (r.remaining, r.window_seconds))
    return _with(tightest, windows=tuple(w for r in done for w in r.windows), scopes=chosen,
                 lease=user_step.lease if user_step else None,
                 tokens=tokens, member=user_step.member if user_step else "",
                 timestamp_ms=user_step.timestamp_ms if user_step else tightest.timestamp_ms,
                 tie=user_step.tie if user_step else 0,
                 shared_entries=tuple((r.member, r.timestamp_ms, r.tie)
                                      for r in done[:len(shared)]))


def _unreached(windows: Windows, token_windows: Windows,
               scopes: Sequence[Scope]) -> tuple[WindowState, ...]:
    """The windows of a step the decision never reached."""
    states = [WindowState(limit, seconds, "requests", None) for limit, seconds in windows]
    states += [WindowState(limit, seconds, "tokens", None) for limit, seconds in token_windows]
    for scope in scopes:
        states += [WindowState(limit, seconds, "requests", None, scope)
                   for limit, seconds in scope.windows]
        states += [WindowState(limit, seconds, "tokens", None, scope)
                   for limit, seconds in scope.token_windows]
    return tuple(states)


def _with(reservation: Reservation, **changes: Any) -> Reservation:
    values = {name: getattr(reservation, name) for name in Reservation.__dataclass_fields__}
    values.update(changes)
    return Reservation(**values)


def _unspent(state: WindowState, cost: int, tokens: int | None) -> WindowState:
    """A window of a refunded step: what it had before."""
    spent = (tokens or 0) if state.resource == "tokens" else cost
    left = None if state.remaining is None else state.remaining + spent
    return WindowState(state.limit, state.window_seconds, state.resource, left, state.scope)


def _class_logs(scopes: Sequence[Scope], scope_class: str | None) -> dict[str, str]:
    """reconcile's keyword that moves the entry in its class's logs too (lib/set_cost.lua),
    when one of `scopes` has reserved shares and the entry has a class."""
    if scope_class is not None and any(s.shared and s.has_shares for s in scopes):
        return {"shares": f"C {scope_class}"}
    return {}


def _refund_all(steps: Sequence[Reservation]) -> Plan:
    """Every step's entry back to cost 0 in each of its windows (idempotent). A refund that
    fails (Redis gone) leaves that entry charged until it leaves its windows: the cost of a
    crash between the steps (docs/scopes.md)."""
    for step in steps:
        if not step.member:
            continue
        resources: tuple[Resource, ...] = ("requests", "tokens")
        for resource in resources:
            own = windows_of(step, resource)
            scoped = tuple((s.name, s.shared, s.windows_of(resource)) for s in step.scopes
                           if s.windows_of(resource))
            if not (own or scoped):
                continue
            keywords: dict[str, Any] = {"tokens": resource == "tokens", "scopes": scoped,
                                        "tie": step.tie}
            keywords.update(_class_logs(step.scopes, step.scope_class))
            try:
                yield ("reconcile", (step.user_id, own, step.member, step.timestamp_ms, 0),
                       keywords)
            except Exception:  # noqa: BLE001 - the refund is best effort by design (see above)
                pass


def reconcile_plan(reservation: Reservation, actual: int, release: bool = False) -> Plan:
    """reconcile: the entry's estimate (its tokens when it has token windows, else its
    request cost) set to `actual` in the user's windows and its scopes' of that resource;
    in two calls when it was reserved in two steps. With `release`, the reservation's
    in-flight slot is given back in the same script execution as the user's own entry
    (or by a release of its own when that entry has no window to reconcile). Returns the
    windows found."""
    if not isinstance(reservation, Reservation):
        raise TypeError(f"reconcile needs a Reservation made by reserve, not "
                        f"{type(reservation).__name__}")
    if isinstance(actual, bool) or not isinstance(actual, int):
        raise TypeError(f"actual must be an int, not {type(actual).__name__}")
    if actual < 0:
        raise ValueError(f"actual must be >= 0, got {actual}")
    tokens = any(w.resource == "tokens" for w in reservation.windows)
    resource: Resource = "tokens" if tokens else "requests"
    own = windows_of(reservation, resource)
    shared = [s for s in reservation.scopes if s.shared] if reservation.shared_entries else []
    entries = [(reservation.member, reservation.timestamp_ms, reservation.tie, own,
                [s for s in reservation.scopes if s not in shared])]
    entries += [(member, timestamp_ms, tie, [], [scope])
                for (member, timestamp_ms, tie), scope
                in zip(reservation.shared_entries, shared, strict=True)]
    lease = reservation.lease
    releasing = bool(release and lease is not None and lease.lease_id)
    found = 0
    for number, (member, timestamp_ms, tie, windows, scopes) in enumerate(entries):
        scoped = tuple((s.name, s.shared, s.windows_of(resource)) for s in scopes
                       if s.windows_of(resource))
        if not member or not (windows or scoped):
            continue
        keywords: dict[str, Any] = {"tokens": tokens, "tie": tie}
        if scoped:
            keywords["scopes"] = scoped
            keywords.update(_class_logs(scopes, reservation.scope_class))
        if releasing and number == 0:  # the user's own entry: its member is the lease id
            keywords["release"] = True
            releasing = False
        found += yield ("reconcile", (reservation.user_id, windows, member, timestamp_ms, actual),
                        keywords)
    if releasing:
        assert lease is not None
        yield ("release", (lease.user_id, lease.lease_id), {})
    return found
