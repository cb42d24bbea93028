"""Scopes besides the tier budget: upstream caps, route and model budgets."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from .._native import RateLimiterError
from .._tiers_config import (
    SCOPE_BUDGET_KEYS,
    in_flight_number,
    scope_sections_from_env,
    validate_scope_budget,
)
from ..lease import DEFAULT_LEASE_SECONDS
from ..provider_limits import DEFAULT_MAX_CLOSE_SECONDS, validate_max_close_seconds
from ..reservation import DEFAULT_PROBE_TIMEOUT_SECONDS, check_probe
from ..reservation import Scope as BudgetScope
from ..shares import Shares
from ..shares import validate as validate_shares
from ..wait_queue import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_QUEUE_PER_TENANT,
    queue_bound,
    queue_milliseconds,
)
from ._plan import UpstreamSlot
from ._usage import requested_model

logger = logging.getLogger("genai_ratelimit")

# The most route path templates whose Scope is kept (an app's routes: a handful).
_MAX_CACHED_ROUTES = 1024
# The ASGI scope's list of the upstreams an admitted request goes through, for
# forward_to_upstream to hand them the provider's answer: (limiter, is async, the shared
# scope's name, its max_close_seconds).
UPSTREAMS_KEY = "genai_ratelimit.upstreams"


def _scope_of(name: str, budget: Mapping[str, int], shared: bool, tokens: bool,
              reserved: Any = (), ceilings: Any = (), **probe: Any) -> BudgetScope | None:
    """The Scope of a budget (SCOPE_BUDGET_KEYS); its token windows only when `tokens` (a
    RateLimit charges no tokens). None when nothing of it applies. `reserved`, `ceilings`:
    an upstream's shares, as Upstream keeps them (validated tuples); `probe`: an upstream's
    probe and probe_timeout_seconds (Scope's)."""
    windows = [(budget[key], seconds) for key, (seconds, is_tokens) in SCOPE_BUDGET_KEYS.items()
               if key in budget and not is_tokens]
    token_windows = [(budget[key], seconds)
                     for key, (seconds, is_tokens) in SCOPE_BUDGET_KEYS.items()
                     if key in budget and is_tokens and tokens]
    if not windows and not token_windows:
        return None
    shares: dict[str, Any] = {}
    if reserved:
        shares["reserved"] = dict(reserved)
    if ceilings:
        shares["ceilings"] = {klass: (top, saturation) for klass, top, saturation in ceilings}
    return BudgetScope(name, windows=windows, token_windows=token_windows, shared=shared,
                       **shares, **probe)


# (max_wait, max_queue, max_queue_per_tenant) of an upstream's wait queue.
Wait = tuple[float, int, int]



@dataclass(frozen=True)
class Upstream:
    """An upstream provider's caps (e.g. provider + model), shared by every user: all users
    together stay below them. Decided in the same script as each user's own budget, so a
    request the cap refuses costs the user nothing, and one the user's budget refuses costs
    the cap nothing. Keys: {prefix}:{name}:{window}[:tokens]:shared.

    models: the request `model`s this upstream serves; empty: every request of the
    dependency. The token caps count in TokenRateLimit only. max_close_seconds: the
    longest the provider's word (a 429's retry-after, a reset) may close or narrow the cap
    (docs/upstreams.md). max_wait: seconds (> 0, at most 300) a request the cap refuses
    waits in its queue, shared by every replica, instead of a 429 (docs/wait-queue.md);
    None: refused at once. A request whose client disconnects while it waits leaves the
    queue at once (with an AsyncRateLimiter), answered 499 and counted queue_abandoned.

    reserved {class: percent}, ceilings {class: (ceiling percent, saturation percent)}: the
    cap's reserved shares (docs/upstreams.md, "Reserved shares"); a request's class is its
    tier. Kept as Scope keeps them (sorted tuples of exact Fractions).

    in_flight: at most this many requests through the upstream at once, every user's
    together: each takes one of its slots (acquire on the upstream's name, with its shares
    when it has some) and gives it back when its response is over (the middleware), or
    after in_flight_lease_seconds when it never does. Needs RateLimitHeadersMiddleware.
    probe, probe_timeout_seconds: the cap's cold start (Scope's; docs/upstreams.md, "Cold
    start"): until the provider's first answer is observed, at most `probe` requests go
    through; 0 (the default): off."""

    name: str
    per_minute: int | None = None
    per_day: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    models: tuple[str, ...] = ()
    max_close_seconds: float = DEFAULT_MAX_CLOSE_SECONDS
    reserved: Any = ()
    ceilings: Any = ()
    max_wait: float | None = None
    # The queue's bounds (with max_wait): live tickets in all, and of one tenant (the
    # dependency's key); past either a request gets its 429 at once (queue_full).
    max_queue: int = DEFAULT_MAX_QUEUE
    max_queue_per_tenant: int = DEFAULT_MAX_QUEUE_PER_TENANT
    in_flight: int | None = None
    in_flight_lease_seconds: int = DEFAULT_LEASE_SECONDS
    probe: int = 0
    probe_timeout_seconds: float = DEFAULT_PROBE_TIMEOUT_SECONDS

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"an Upstream's name must be a non-empty str, got {self.name!r}")
        if self.in_flight is not None:
            in_flight_number(self.in_flight, "in_flight")
        in_flight_number(self.in_flight_lease_seconds, "in_flight_lease_seconds")
        validate_scope_budget(self.budget(), "Upstream", repr(self.name),
                              required=self.in_flight is None)
        if isinstance(self.models, str) or not all(isinstance(m, str) and m for m in self.models):
            raise TypeError("models must be a sequence of model names (non-empty str)")
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "max_close_seconds",
                           validate_max_close_seconds(self.max_close_seconds))
        BudgetScope(self.name, windows=[(1, 60)])  # the name's own checks (length, UTF-8)
        reserved, ceilings = validate_shares(None if self.reserved == () else self.reserved,
                                             None if self.ceilings == () else self.ceilings)
        object.__setattr__(self, "reserved", reserved)
        object.__setattr__(self, "ceilings", ceilings)
        check_probe(self.probe, self.probe_timeout_seconds)
        if self.max_wait is not None:  # TypeError / ValueError now, not per request
            queue_milliseconds(self.max_wait)
        # Checked without max_wait too: a route's or a tier's max_wait uses them.
        queue_bound(self.max_queue, "max_queue")
        queue_bound(self.max_queue_per_tenant, "max_queue_per_tenant")

    def wait(self) -> Wait | None:
        """(max_wait, max_queue, max_queue_per_tenant), or None without max_wait."""
        if self.max_wait is None:
            return None
        return (self.max_wait, self.max_queue, self.max_queue_per_tenant)

    def slot(self) -> UpstreamSlot | None:
        """Its in-flight cap (None without in_flight), with its shares when it has some."""
        if self.in_flight is None:
            return None
        shares = None
        if self.reserved or self.ceilings:
            shares = Shares(reserved=dict(self.reserved) or (), ceilings={
                klass: (top, saturation) for klass, top, saturation in self.ceilings} or ())
        return UpstreamSlot(self.name, self.in_flight, self.in_flight_lease_seconds, shares)

    def budget(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in SCOPE_BUDGET_KEYS
                if getattr(self, key) is not None}

    def scope(self, tokens: bool = True) -> BudgetScope | None:
        """Its Scope (shared); the token caps only when `tokens`. None when none applies."""
        probe = {"probe": self.probe, "probe_timeout_seconds": self.probe_timeout_seconds} \
            if self.probe else {}
        return _scope_of(self.name, self.budget(), True, tokens, self.reserved, self.ceilings,
                         **probe)


UpstreamOf = Callable[[Request], "Upstream | None | Awaitable[Upstream | None]"]


def note_upstreams(request: Request, limiter: Any, is_async: bool,
                   upstreams: Sequence[tuple[str, float]]) -> None:
    """Keeps the (name, max_close_seconds) of the upstreams an admitted request goes
    through, with the limiter that decided them, for observe_upstreams."""
    if upstreams:
        noted = request.scope.setdefault(UPSTREAMS_KEY, [])
        noted.extend((limiter, is_async, name, bound) for name, bound in upstreams)


async def observe_upstreams(request: Request, status: int, headers: Any) -> None:
    """Hands one upstream response (its status and headers) to every upstream the request
    went through (limiter.observe_upstream). A limiter that cannot answer is logged: the
    response goes on."""
    for limiter, is_async, name, bound in request.scope.get(UPSTREAMS_KEY) or ():
        try:
            if is_async:
                await limiter.observe_upstream(name, status, headers, max_close_seconds=bound)
            else:
                await run_in_threadpool(limiter.observe_upstream, name, status, headers,
                                        max_close_seconds=bound)
        except RateLimiterError as exc:
            logger.warning("could not record the answer of upstream %r: %s", name, exc)


class _Scopes:
    """What a dependency decides besides the user's tier budget: a route budget, per-model
    budgets (from the request's JSON `model`) and upstream caps (fixed, by model, or from a
    callable). Built at start-up; `of(request)` gives one request's Scopes."""

    def __init__(self, upstream: Upstream | Sequence[Upstream] | UpstreamOf | None,
                 route_limits: Mapping[str, int] | None,
                 model_limits: Mapping[str, Mapping[str, int]] | None,
                 from_file: bool, tokens: bool, shadow: bool = False,
                 max_wait: float | None = None) -> None:
        self.tokens = tokens
        self.shadow = shadow
        # The route's max_wait (RateLimit(max_wait=...)): for every upstream without one.
        self.max_wait = max_wait
        self.upstreams: tuple[Upstream, ...] = ()
        self.upstream_of: UpstreamOf | None = None
        if isinstance(upstream, Upstream):
            self.upstreams = (upstream,)
        elif callable(upstream):
            self.upstream_of = upstream
        elif upstream is not None:
            if isinstance(upstream, (str, bytes)) or not isinstance(upstream, Sequence) or \
                    not all(isinstance(u, Upstream) for u in upstream):
                raise TypeError("upstream must be an Upstream, a sequence of Upstream or a "
                                f"callable taking the request, not {type(upstream).__name__}")
            self.upstreams = tuple(upstream)
        self.route_budget = (None if route_limits is None else
                             validate_scope_budget(route_limits, "route_limits", "the route"))
        self.model_budgets = {
            str(model): validate_scope_budget(budget, "model_limits", f"model {model!r}")
            for model, budget in (model_limits or {}).items()}
        if from_file and upstream is None and model_limits is None:
            sections = scope_sections_from_env()
            if sections is not None:
                models, upstreams = sections
                self.model_budgets = models
                self.upstreams = tuple(
                    Upstream(name, **budget, models=served, **shares)
                    for name, (budget, served, shares) in upstreams.items())
        names = [u.name for u in self.upstreams]
        if len(set(names)) != len(names):
            raise ValueError(f"two upstreams share a name: {sorted(names)}")
        if not tokens:
            for what, budget in (("route_limits", self.route_budget),
                                 *((f"model_limits[{m!r}]", b) for m, b in (model_limits or {}).items())):
                if budget and any(SCOPE_BUDGET_KEYS[key][1] for key in budget):
                    raise ValueError(f"{what}: token budgets need TokenRateLimit (a RateLimit "
                                     "charges no tokens)")
        self.reads_model = bool(self.model_budgets) or any(u.models for u in self.upstreams)
        # The Scopes of the fixed budgets, each made on its first request (a Scope checks its
        # windows when made) and kept: by model, by route path template (both bounded by the
        # configuration and the app's routes) and by fixed upstream (its index).
        self._model_scopes: dict[str, BudgetScope | None] = {}
        self._route_scopes: dict[str, BudgetScope | None] = {}
        self._upstream_scopes: dict[int, BudgetScope | None] = {}
        # Each upstream's max_close_seconds by name: the fixed ones, and those the callable
        # chose (up to _MAX_CACHED_ROUTES names).
        self._bounds: dict[str, float] = {u.name: u.max_close_seconds for u in self.upstreams}
        self._waits: dict[str, Wait | None] = {u.name: u.wait() for u in self.upstreams}
        self._chosen: dict[str, Upstream] = {}  # the upstreams the callable chose, by name
        self._slots: dict[int, UpstreamSlot | None] = {}  # by fixed upstream (its index)

    def upstreams_in(self, scopes: Sequence[BudgetScope]) -> list[tuple[str, float]]:
        """(name, max_close_seconds) of the upstream caps among a request's scopes (none in
        shadow mode: a shadow cap never hears from the provider)."""
        if self.shadow:
            return []
        return [(scope.name, self._bounds.get(scope.name, DEFAULT_MAX_CLOSE_SECONDS))
                for scope in scopes if scope.shared]

    def wait_in(self, scopes: Sequence[BudgetScope], tier_wait: float | None = None
                ) -> Wait | None:
        """How a request through these scopes may wait in their upstreams' queue: the
        (max_wait, max_queue, max_queue_per_tenant) of its upstream with the shortest
        max_wait (None: none has one; and in shadow mode, which never holds a request back).
        Each upstream's max_wait is the tier's (`tier_wait`) when it has one, else the
        Upstream's own, else the route's (self.max_wait); the bounds are the Upstream's."""
        if self.shadow:
            return None
        waits: list[Wait] = []
        for scope in scopes:
            if not scope.shared:
                continue
            own = self._waits.get(scope.name)
            seconds = tier_wait if tier_wait is not None else (
                own[0] if own is not None else self.max_wait)
            if seconds is not None:
                waits.append((seconds, *self._queue_bounds(scope.name)))
        return min(waits) if waits else None

    def slot_wait(self, slot: UpstreamSlot, tier_wait: float | None = None) -> Wait | None:
        """How a request may wait in the queue of an upstream's in-flight cap: its max_wait
        as wait_in chooses it (the tier's, else the Upstream's, else the route's) and the
        Upstream's bounds; None in shadow mode, without a max_wait, and (not yet) for a cap
        with reserved shares (wait_queue.check_queue_shares)."""
        if self.shadow or slot.shares is not None:
            return None
        own = self._waits.get(slot.name)
        seconds = tier_wait if tier_wait is not None else (
            own[0] if own is not None else self.max_wait)
        if seconds is None:
            return None
        return (seconds, *self._queue_bounds(slot.name))

    def _queue_bounds(self, name: str) -> tuple[int, int]:
        """(max_queue, max_queue_per_tenant) of the upstream `name` (the defaults for one
        the configuration does not name)."""
        chosen = next((u for u in self.upstreams if u.name == name), None)
        if chosen is None:
            chosen = self._chosen.get(name)
        if chosen is None:
            return (DEFAULT_MAX_QUEUE, DEFAULT_MAX_QUEUE_PER_TENANT)
        return (chosen.max_queue, chosen.max_queue_per_tenant)

    def _named(self, scope: BudgetScope | None) -> BudgetScope | None:
        """A shadow budget's scopes count in keys of their own, shared ones too."""
        if scope is None or not self.shadow:
            return scope
        return dataclasses.replace(scope, name=f"shadow:{scope.name}")

    def __bool__(self) -> bool:
        return bool(self.upstreams or self.upstream_of or self.route_budget or self.model_budgets)

    @staticmethod
    def route_of(request: Request) -> str:
        """The route's path template (/items/{id}): never the request's own path, which the
        client chooses (one budget, and one key, per path it invents). "*" when FastAPI
        matched no route (a dependency always runs on one)."""
        path = getattr(request.scope.get("route"), "path", None)
        return path if isinstance(path, str) and path else "*"

    async def of(self, request: Request, document: Mapping[str, Any] | None = None
                 ) -> tuple[BudgetScope, ...]:
        """The Scopes of one request. `document`: its JSON body, when the caller decoded
        it already (the body is then not decoded again for its `model`)."""
        return (await self.with_slots(request, document))[0]

    def _slot(self, upstream: Upstream) -> UpstreamSlot | None:
        """An upstream's in-flight cap; a shadow budget's in a cap of its own."""
        slot = upstream.slot()
        if slot is None or not self.shadow:
            return slot
        return slot._replace(name=f"shadow:{slot.name}")

    async def with_slots(self, request: Request, document: Mapping[str, Any] | None = None
                         ) -> tuple[tuple[BudgetScope, ...], tuple[UpstreamSlot, ...]]:
        """The Scopes of one request (`of`) and the in-flight caps of its upstreams."""
        found: list[BudgetScope | None] = []
        slots: list[UpstreamSlot | None] = []
        if self.route_budget:
            path = self.route_of(request)
            if path in self._route_scopes:
                found.append(self._route_scopes[path])
            else:
                scope = self._named(_scope_of(f"route:{path}", self.route_budget, False, self.tokens))
                if len(self._route_scopes) < _MAX_CACHED_ROUTES:
                    self._route_scopes[path] = scope
                found.append(scope)
        model = None
        if self.reads_model:
            model = requested_model(await request.body() if document is None else document)
        if model is not None and model in self.model_budgets:
            if model not in self._model_scopes:
                self._model_scopes[model] = self._named(_scope_of(
                    f"model:{model}", self.model_budgets[model], False, self.tokens))
            found.append(self._model_scopes[model])
        for index, upstream in enumerate(self.upstreams):
            if not upstream.models or model in upstream.models:
                if index not in self._upstream_scopes:
                    self._upstream_scopes[index] = self._named(upstream.scope(self.tokens))
                    self._slots[index] = self._slot(upstream)
                found.append(self._upstream_scopes[index])
                slots.append(self._slots[index])
        if self.upstream_of is not None:
            chosen = self.upstream_of(request)
            if inspect.isawaitable(chosen):
                chosen = await chosen
            if chosen is not None and not isinstance(chosen, Upstream):
                raise TypeError(f"upstream(request) must return an Upstream or None, "
                                f"not {type(chosen).__name__}")
            if chosen is not None:
                if chosen.name in self._bounds or len(self._bounds) < _MAX_CACHED_ROUTES:
                    self._bounds[chosen.name] = chosen.max_close_seconds
                    self._waits[chosen.name] = chosen.wait()
                    self._chosen[chosen.name] = chosen
                found.append(self._named(chosen.scope(self.tokens)))
                slots.append(self._slot(chosen))
        return (tuple(scope for scope in found if scope is not None),
                tuple(slot for slot in slots if slot is not None))

