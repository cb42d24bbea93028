"""RateLimit: the request-budget dependency (sync and async drivers)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import time
from collections.abc import Hashable, Mapping
from typing import Any

from fastapi import Request, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from typing_extensions import Unpack

from .. import RateLimiterError
from .._keyspace import NAMESPACE_PATTERN
from .._tiers_config import (
    TIER_BUDGET_KEYS,
    TierConfigError,
    max_in_flight_of_tiers,
    max_wait_of_tiers,
    scope_sections_from_env,
    tier_limits_from_env,
    tier_max_in_flight_from_env,
    tier_max_wait_from_env,
    validate_tier_limits,
)
from ..aio import AsyncRateLimiter
from ..lease import Lease
from ..limiter import RateLimiter
from ..metrics import RequestOutcomes, request_outcomes
from ..reservation import Reservation
from ..tiers import DEFAULT_TIER, TIER_LIMITS
from ._answer import _COUNTED_KEY, _SHADOWED_KEY, _record_shadow, answer, shadow_headers, unavailable
from ._clients import Identify, UnknownClientAddress, default_identify, key_identity
from ._disconnect import DisconnectWatch
from ._ietf_headers import HeaderMode, PartitionKeys
from ._ledger import _IN_FLIGHT_KEY, _LEASES_KEY, _LeaseLedger
from ._openai_headers import ErrorFormat
from ._options import ClassSignature, Mode, OnUnavailable, SharedOptions, options_from
from ._plan import (
    AsyncWindowLimiter,
    Decision,
    Facts,
    Policy,
    SyncWindowLimiter,
    UpstreamSlot,
    Windows,
    abandon,
    plan,
    run,
    run_async,
)
from ._scopes import _Scopes, note_upstreams
from ._spend import SpendHeld
from ._startup import RateLimitConfigError, check_dependencies, dependencies_of

logger = logging.getLogger("genai_ratelimit")

# {id(dependency): [tier, counted]}: each dependency counts a request in one outcome, once.
_OUTCOME_KEY = "genai_ratelimit.outcome"
# The outcomes whose request runs (and is then in flight until its response is over).
_RUNS = frozenset(("allowed", "queued_then_allowed", "shadow_would_refuse", "fail_open"))
# This package's own check_windows: the plan may ask their detailed twin instead (_policy).
_STOCK_CHECK_WINDOWS = (RateLimiter.check_windows, AsyncRateLimiter.check_windows)


def _is_async_limiter(limiter: object) -> bool:
    flag = getattr(limiter, "is_async", None)
    if isinstance(flag, bool):
        return flag
    return inspect.iscoroutinefunction(getattr(limiter, "check_windows", None))


class RateLimit:
    """A FastAPI dependency: `Depends(RateLimit(...))`, or the ready `rate_limit`.

    limiter        a RateLimiter or an AsyncRateLimiter; None: an AsyncRateLimiter() created on
                   the first request (it reads $REDIS_URL, else redis://localhost:6379/0).
    tier_limits    {"free": {"per_minute": 5, "per_day": 100}, ...}; None: the file named by
                   $GENAI_RATELIMIT_TIERS when set, else TIER_LIMITS. Checked here, at start-up.
    identify       identify(request) -> (user_id, tier), replacing default_identify.
    on_unavailable "deny": HTTP 503 + Retry-After: 1 when Redis cannot decide; "allow": let the
                   request through, log a warning and count it in fail_open_count.
    namespace      the name of the budget's key space (1-64 of A-Z a-z 0-9 _ . -): keys become
                   {prefix}:ns:{namespace}:{identity}:{window}, and every RateLimit naming it
                   draws on one budget. None: no namespace, the contract's keys, whatever the
                   budget (two budgets on the same keys are refused at start-up).

    Keyword-only (see genai_ratelimit.fastapi._openai_headers for the shapes):

    error_format   "openai" (default): 429/503 bodies carry OpenAI's `error` object beside the
                   contract's `detail`, responses OpenAI's x-ratelimit-*-requests headers;
                   "anthropic": Anthropic's {"type": "error", "error": {...}} and its
                   anthropic-ratelimit-* headers; "plain": the contract's body and headers only.
                   The bodies need RateLimitHeadersMiddleware (without it: {"detail": ...}).
    max_client_wait_seconds
                   a 429 whose wait is longer says x-should-retry: false (the SDKs then give
                   up at once instead of sleeping); true otherwise. Default 300.
    unavailable_log_interval
                   at most one warning per this many seconds while Redis is unavailable, with
                   the count of requests it covers. Default 60.
    log_user_ids   False: that warning (and the shadow one) names no user.
    mode           "enforce" (default): refuse what the budget refuses. "shadow": decide and
                   count in "shadow:" keys of its own, but never refuse: a request the
                   budget would refuse runs; the verdict goes out only as
                   X-RateLimit-Shadow-* headers (plus X-RateLimit-Shadow: would-refuse),
                   shadow_count and a warning (at most one per shadow_log_interval seconds,
                   default 60); never an enforced header, body or retry instruction.
    headers        "contract" (default): the contract's X-RateLimit-* (and the error
                   format's family). "ietf" or "both" (the same): those, plus the IETF
                   draft's RateLimit-Policy and RateLimit fields (genai_ratelimit.fastapi._ietf_headers).
    partition_key_secret
                   the secret of the IETF fields' partition keys (pk), an HMAC of the
                   identity: None reads $GENAI_RATELIMIT_PARTITION_KEY_SECRET, else a random
                   secret of this process (keys then differ between workers).
    upstream       an Upstream (a provider's caps, shared by every user), a list of them (each
                   for the request `model`s it lists, or every request), or a callable
                   upstream(request) -> Upstream | None (sync or async).
    route_limits   {"per_minute": 2, "per_day": 50}: each user's own budget on the routes of
                   this instance, beside the tier's (keys: scope=route:<path template>).
    model_limits   {"gpt-4o": {"per_minute": 20}}: each user's budget per request `model` (read
                   from the JSON body). TokenRateLimit also takes tokens_per_minute/_day keys.
                   With any of the three (or the tiers file's [models]/[upstreams]) the
                   decision is one `reserve` over the tier's windows and the request's scopes,
                   and the dependency is an async def; see docs/scopes.md, "In FastAPI", for
                   the 429s (X-RateLimit-Scope).
    max_in_flight  {tier: n}: at most n requests of one identity in flight at once, for the
                   tiers whose budget (tier_limits, or the tiers file) gives no
                   "max_in_flight" of its own; a tier with neither has no concurrency limit
                   (and costs no extra round trip). Needs RateLimitHeadersMiddleware.
    lease_seconds  how long an in-flight slot stays taken when its release never comes (a
                   worker killed mid-request): default 300 (DEFAULT_LEASE_SECONDS). A request
                   that may run longer renews its lease: in_flight_lease(request).renew()
                   (awaited with an AsyncRateLimiter).

    In-flight slots (max_in_flight): before the windows are decided, the request takes one
    of its identity's slots (`acquire`, one script execution); the middleware gives it back
    when the response's last byte is due, or when the client disconnected or the route
    failed. Refused: 429 with X-RateLimit-Window: concurrent, X-RateLimit-Limit: the cap,
    and Retry-After: by default the limiter's hint (Lease.retry_after_ms: how long requests
    on this cap were held, a decayed mean kept in Redis, less how long the oldest one in
    flight has run; 5 s before any was; 1 to 60 s), never past the soonest slot's lease
    expiry, which is only an upper bound (a request that finishes frees its slot sooner).
    A request refused for concurrency is not counted in the windows. In
    shadow mode the slots are taken in "shadow:" keys; a request beyond the cap runs and is
    counted, logged and marked as would-refuse like a window refusal.
    in_flight_retry_after
                   a fixed Retry-After in seconds for the concurrency 429, instead of the
                   limiter's hint (see above); at most 60, never past the soonest expiry.
                   Default None: the hint.

    The decision is one `check_windows` call; the WindowDecision it answers carries the
    exact wait (retry_after_ms) that retry-after-ms reports.

    An async limiter (the default) gives an instance of a subclass whose __call__ is async,
    awaited on the event loop; a blocking limiter gives an instance whose __call__ is a plain
    def (FastAPI's threadpool).
    """

    # TokenRateLimit charges tokens: its scopes keep their token windows.
    _charges_tokens = False
    _rate_limit_dependency = True  # the start-up checks' mark (_startup.dependencies_of)
    __signature__ = ClassSignature()

    def __new__(cls, limiter: SyncWindowLimiter | AsyncWindowLimiter | None = None,
                *args: Any, **kwargs: Any) -> RateLimit:
        # Scopes may read the body (a model's budget): an async def, the blocking limiter's
        # calls then in the threadpool.
        scoped = any(kwargs.get(key) is not None
                     for key in ("upstream", "route_limits", "model_limits"))
        if not scoped and (args[:1] or [kwargs.get("tier_limits")])[0] is None:
            try:
                sections = scope_sections_from_env()
            except TierConfigError:
                sections = None  # __init__ says what is wrong
            scoped = sections is not None and any(sections)
        if cls is RateLimit and (limiter is None or _is_async_limiter(limiter) or scoped):
            cls = _AsyncRateLimit
        return super().__new__(cls)

    def __init__(
        self,
        limiter: SyncWindowLimiter | AsyncWindowLimiter | None = None,
        tier_limits: Mapping[str, Mapping[str, float]] | None = None,
        identify: Identify | None = None,
        on_unavailable: OnUnavailable = "deny",
        namespace: str | None = None,
        **options: Unpack[SharedOptions],
    ) -> None:
        opts = self.options = options_from(options)
        self.in_flight_retry_after = (None if opts.in_flight_retry_after is None
                                      else float(opts.in_flight_retry_after))
        self.error_format: ErrorFormat = opts.error_format
        self.max_client_wait_seconds = float(opts.max_client_wait_seconds)
        self.unavailable_log_interval = float(opts.unavailable_log_interval)
        self.log_user_ids = opts.log_user_ids
        self._unavailable_log = _LogThrottle(self.unavailable_log_interval)
        self.mode: Mode = opts.mode
        self.headers: HeaderMode = opts.headers
        self._shadow_log = _LogThrottle(float(opts.shadow_log_interval))
        self._shadow_count = 0
        self._partition_keys: PartitionKeys | None = None
        if opts.headers != "contract":
            self._partition_keys = PartitionKeys(opts.partition_key_secret)
            if self._partition_keys.per_process:
                logger.warning(
                    "RateLimit(headers=%r) has no partition_key_secret (nor $%s): the IETF "
                    "RateLimit fields' partition keys come from a random secret of this process, "
                    "so they differ between workers and restarts", opts.headers,
                    "GENAI_RATELIMIT_PARTITION_KEY_SECRET")
        if namespace is not None:
            if not isinstance(namespace, str):
                raise TypeError(f"namespace must be a str or None, not {type(namespace).__name__}")
            if not NAMESPACE_PATTERN.fullmatch(namespace):
                raise ValueError("namespace must be 1 to 64 of the characters A-Z a-z 0-9 _ . -, "
                                 f"got {namespace!r}")
        if on_unavailable not in ("deny", "allow"):
            raise ValueError(f"on_unavailable must be 'deny' or 'allow', got {on_unavailable!r}")
        if identify is not None and not callable(identify):
            raise TypeError(f"identify must be a callable taking the request, not {type(identify).__name__}")
        if limiter is not None and not callable(getattr(limiter, "check_windows", None)):
            raise TypeError(
                f"limiter must be a RateLimiter or AsyncRateLimiter, not {type(limiter).__name__}")
        from_file = tier_limits is None
        self.lease_seconds = opts.lease_seconds
        if tier_limits is None:
            tiers_in_flight = tier_max_in_flight_from_env() or {}
            tiers_wait = tier_max_wait_from_env() or {}
            tier_limits = tier_limits_from_env() or TIER_LIMITS
        else:
            tiers_in_flight = max_in_flight_of_tiers(tier_limits)
            tiers_wait = max_wait_of_tiers(tier_limits)
        self.tier_limits: dict[str, dict[str, int]] = validate_tier_limits(tier_limits)
        # Per tier, how long its requests may wait in an upstream's queue (absent: the
        # Upstream's max_wait, else the route's): docs/wait-queue.md, "Precedence".
        self.tier_max_wait: dict[str, float] = tiers_wait
        self._scopes = _Scopes(opts.upstream, opts.route_limits, opts.model_limits, from_file,
                               tokens=self._charges_tokens, shadow=opts.mode == "shadow",
                               max_wait=opts.max_wait)
        if opts.max_wait is not None and not (self._scopes.upstreams or self._scopes.upstream_of):
            raise ValueError("max_wait is how long a request waits in an upstream's queue: "
                             "give the dependency an upstream (upstream=Upstream(...), or an "
                             "[upstreams] section in the tiers file)")
        self._limiter_is_async = limiter is None or _is_async_limiter(limiter)
        # A tier the budget does not know never applies.
        defaults = {tier: cap for tier, cap in (opts.max_in_flight or {}).items() if tier in self.tier_limits}
        # Per tier, the most requests of one identity in flight at once (absent: no cap).
        self.max_in_flight: dict[str, int] = {**defaults, **tiers_in_flight}
        if self.max_in_flight and limiter is not None and not (
                callable(getattr(limiter, "acquire", None)) and callable(getattr(limiter, "release", None))):
            raise TypeError(f"max_in_flight needs a limiter with acquire() and release() "
                            f"(RateLimiter, AsyncRateLimiter), not {type(limiter).__name__}")
        # Per tier, the (limit, window_seconds) pairs of one check_windows call, shortest first.
        self._windows: dict[str, Windows] = {
            tier: tuple((budget[key], seconds) for key, seconds in TIER_BUDGET_KEYS.items()
                        if key in budget)
            for tier, budget in self.tier_limits.items()
        }
        # Per tier with a burst: its minute budget as GCRA, (per_minute, 60, burst) (Facts.gcra).
        self._gcra: dict[str, tuple[int, int, int]] = {
            tier: (budget["per_minute"], 60, budget["burst"])
            for tier, budget in self.tier_limits.items() if "burst" in budget}
        if self._gcra and (self._charges_tokens or self._scopes):
            raise ValueError(f"burst (tier {sorted(self._gcra)[0]!r}) is decided by a RateLimit "
                             f"without scopes; {type(self).__name__} with tokens or scopes decides "
                             f"in one reserve, which has no GCRA bucket: remove burst from its tiers")
        if self._gcra and limiter is not None and \
                not callable(getattr(limiter, "check_windows_detailed", None)):
            raise TypeError(f"burst needs a limiter with check_windows_detailed(gcra=...) "
                            f"(RateLimiter, AsyncRateLimiter), not {type(limiter).__name__}")
        self.namespace: str | None = namespace
        self.identify: Identify = identify or default_identify
        self.on_unavailable: OnUnavailable = on_unavailable
        self._limiter = limiter
        self._limiter_lock = threading.Lock()
        self._fail_open_count = 0
        self._fail_open_lock = threading.Lock()  # the threadpool may fail open in parallel
        self._checked_apps: set[int] = set()  # id() of the apps whose start-up checks passed
        self._plan_policy: Policy | None = None
        self._limiter_facts: tuple[Any, tuple[object, ...], RequestOutcomes] | None = None

    @property
    def limiter(self) -> Any:
        """The limiter; the default one, an AsyncRateLimiter, is created on first use."""
        if self._limiter is None:
            with self._limiter_lock:
                if self._limiter is None:
                    self._limiter = AsyncRateLimiter()
        return self._limiter

    @property
    def fail_open_count(self) -> int:
        """How many requests on_unavailable="allow" let through because the limiter could not
        decide (Redis unreachable, timed out, answering garbage). Always 0 with "deny". For
        alerting: each one is a request that was never counted against any budget."""
        return self._fail_open_count

    @property
    def shadow_count(self) -> int:
        """How many requests mode="shadow" let through that the budget would have refused
        (each request once). Always 0 with mode="enforce"."""
        return self._shadow_count

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(limiter={self._limiter!r}, tiers={sorted(self.tier_limits)}, "
                f"on_unavailable={self.on_unavailable!r}, namespace={self.namespace!r})")

    def key_budgets(self) -> list[tuple[tuple[object, ...], object]]:
        """(key space, budget) pairs for the start-up collision check: the key space is the
        Redis and key prefix, the mode, the namespace and the resource; two dependencies
        that share a key space must have the same budget there."""
        return [((*self._space(), self.mode, self.namespace, "requests"),
                 tuple(sorted(self._windows.items())))]

    def _space(self) -> tuple[object, ...]:
        """The limiter's Redis and key prefix (the limiter itself when it does not say; the
        default limiter's: $REDIS_URL)."""
        return ("default limiter",) if self._limiter is None else self._of_limiter()[1]

    def mark_checked(self, app: object) -> None:
        """The start-up checks of `app` passed (rate_limit_lifespan, or the first request)."""
        self._checked_apps.add(id(app))

    def _check_on_first_use(self, request: Request) -> None:
        """The start-up checks, once per app, when no rate_limit_lifespan ran them: a
        misconfigured app answers 500 (and logs why) instead of counting wrongly."""
        app = request.scope.get("app")
        middleware = isinstance(request.scope.get(_LEASES_KEY), _LeaseLedger)
        try:
            check_dependencies(dependencies_of(app) or [self], middleware=middleware)
        except RateLimitConfigError as exc:
            logger.error("%s", exc)
            raise
        self.mark_checked(app)

    def _identity_and_tier(self, request: Request) -> tuple[str, str] | None:
        """(key identity, the tier whose budget applies: DEFAULT_TIER for none or unknown).
        None in shadow mode for a client whose address is unknown (an observer never refuses:
        not counted; the identify logged it)."""
        if id(request.scope.get("app")) not in self._checked_apps:
            self._check_on_first_use(request)
        try:
            user_id, tier = self.identify(request)
        except StarletteHTTPException as refused:
            if self.mode != "shadow" or not isinstance(refused.__cause__, UnknownClientAddress):
                raise
            return None
        if isinstance(user_id, int) and not isinstance(user_id, bool):
            user_id = str(user_id)
        if not isinstance(user_id, str) or not user_id:
            raise TypeError(f"the rate-limit identity must be a non-empty str, got {user_id!r}")
        budget_tier = tier if isinstance(tier, str) and tier in self._windows else DEFAULT_TIER
        identity = key_identity(user_id, self.namespace)
        request.scope.setdefault(_OUTCOME_KEY, {})[id(self)] = [budget_tier, False]
        # A shadow budget counts (and takes its in-flight slots) in keys of its own, so it
        # never makes an enforced budget refuse more.
        return (f"shadow:{identity}" if self.mode == "shadow" else identity), budget_tier

    def _counted_key(self, identity: str, windows: Windows) -> tuple[object, ...]:
        """Which keys a check of `identity` would count in: the limiter's Redis and key prefix
        (the limiter object itself when it does not say), the identity and the budget."""
        return (*self._of_limiter()[1], identity, windows)

    def _of_limiter(self) -> tuple[Any, tuple[object, ...], RequestOutcomes]:
        """(the limiter, its key space, its request_outcomes), read once per limiter."""
        cached = self._limiter_facts
        if cached is not None and cached[0] is self._limiter:
            return cached
        limiter = self.limiter
        if cached is None or cached[0] is not limiter:
            url, prefix = getattr(limiter, "url", None), getattr(limiter, "key_prefix", None)
            space: tuple[object, ...] = (url, prefix) if isinstance(url, str) and \
                isinstance(prefix, str) else (id(limiter),)
            cached = self._limiter_facts = (limiter, space, request_outcomes(limiter))
        return cached

    def _remember(self, request: Request, identity: str, windows: Windows, decision: Decision) -> None:
        request.scope.setdefault(_COUNTED_KEY, {})[self._counted_key(identity, windows)] = decision

    def _count(self, request: Request, outcome: str, window_seconds: int | None = None,
               resource: str = "none", scope: str = "none") -> None:
        """Counts this request in `outcome` (request_outcomes(limiter)), the first time only:
        every request this dependency decides lands in exactly one outcome. A refusal in
        shadow mode is counted as shadow_would_refuse. A request that runs is in flight (by
        tier) until the middleware sees its response end."""
        request_scope = request.scope
        notes = request_scope.get(_OUTCOME_KEY)
        note = notes.get(id(self)) if isinstance(notes, dict) else None
        if note is None or note[1]:
            return
        note[1] = True
        mode = self.mode
        if mode == "shadow" and outcome in ("rejected", "too_large", "concurrency_rejected"):
            outcome = "shadow_would_refuse"
        tally = self._of_limiter()[2]
        seconds = "none" if window_seconds is None else str(window_seconds)
        running = request_scope.get(_IN_FLIGHT_KEY) if outcome in _RUNS else None
        if isinstance(running, dict) and id(tally) not in running:
            running[id(tally)] = tally._add_running(outcome, note[0], scope, mode, seconds, resource)
        else:
            tally.add(outcome, tier=note[0], scope=scope, mode=mode, resource=resource,
                      window_seconds=seconds)

    def _hold(self, request: Request, identity: str | None, lease: Lease) -> None:
        """Keeps an allowed lease for the middleware to release when the response is over.
        identity None: a slot of an upstream's in-flight cap (keyed by the upstream)."""
        leases = request.scope[_LEASES_KEY]
        key = (self._counted_key(identity, ()) if identity is not None else
               (*self._of_limiter()[1], "upstream", lease.user_id))
        leases.entries.append((key, self.limiter, self._limiter_is_async, lease))

    def _checked_slots(self, request: Request, slots: tuple[UpstreamSlot, ...], tier: str
                       ) -> tuple[UpstreamSlot, ...]:
        """The in-flight caps of a request's upstreams, once the middleware that gives their
        slots back is known to be there, each with how a request of `tier` may wait in its
        queue (_Scopes.slot_wait)."""
        if slots and not isinstance(request.scope.get(_LEASES_KEY), _LeaseLedger):
            raise RuntimeError(
                "an Upstream's in_flight needs RateLimitHeadersMiddleware, which gives the slot "
                "back when the response is over: add app.add_middleware("
                "genai_ratelimit.fastapi.RateLimitHeadersMiddleware)")
        tier_wait = self.tier_max_wait.get(tier)
        return tuple(slot._replace(wait=self._scopes.slot_wait(slot, tier_wait))
                     for slot in slots)

    def _keep(self, request: Request, tier: str, reservation: Reservation) -> None:
        """A token reservation, kept for the reconcile (TokenRateLimit's)."""
        raise NotImplementedError

    def _keep_spend(self, request: Request, tier: str, held: SpendHeld) -> None:
        """A money hold, kept for the settle (TokenRateLimit's)."""
        raise NotImplementedError

    def _would_refuse(self, request: Request, response: Response, identity: str, once: Hashable | None,
                      message: str, refusal: list[tuple[str, str]]) -> None:
        """Shadow mode: the refusal the budget would have answered, let through. The response
        carries its X-RateLimit-* headers renamed X-RateLimit-Shadow-* (never an enforced
        header, never a retry instruction: nothing was refused) plus X-RateLimit-Shadow:
        would-refuse. The request is counted and logged,
        once per `once` when given: a decision that two dependencies of one route share (see
        _remember) is one request; None: always."""
        shadowed = request.scope.setdefault(_SHADOWED_KEY, set())
        if once is None or once not in shadowed:
            shadowed.add(once)
            with self._shadow_log.lock:
                self._shadow_count += 1
            record_outcome = getattr(self.limiter, "_record_outcome", None)
            if callable(record_outcome):
                record_outcome("shadow")
            count = self._shadow_log.due()
            if count is not None:
                latest = f", the latest for {identity!r}" if self.log_user_ids else ""
                logger.warning("shadow mode: %d request(s) the budget would have refused were let "
                               "through since the last report%s; the 429 would have said: %s "
                               "(next report in %gs at the earliest)", count, latest, message,
                               self._shadow_log.interval)
        _record_shadow(request, response, shadow_headers(refusal, "would-refuse"))

    def _unavailable(self, request: Request, user_id: str, exc: RateLimiterError) -> None:
        """Redis could not decide: 503 (deny) or a logged pass (allow)."""
        self._count(request, "fail_open" if self.on_unavailable == "allow" else "unavailable_denied")
        if self.on_unavailable == "allow":
            with self._fail_open_lock:
                self._fail_open_count += 1
                count = self._fail_open_count
            record = getattr(self.limiter, "_record_outcome", None)
            if record is not None:  # the limiter's metrics count it too
                record("fail_open")
            self._log_unavailable(f"let through (on_unavailable='allow', fail-open #{count} in all)",
                                  user_id, exc)
            return
        self._log_unavailable("answered 503", user_id, exc)
        unavailable(request, self.error_format)

    def _log_unavailable(self, action: str, user_id: str, exc: RateLimiterError) -> None:
        """One warning per unavailable_log_interval at most, counting the requests it covers
        (an outage must not flood the log with one line per request)."""
        count = self._unavailable_log.due()
        if count is None:
            return
        latest = f", the latest for {user_id!r}" if self.log_user_ids else ""
        logger.warning("rate limiter unavailable: %d request(s) %s since the last report%s "
                       "(next report in %gs at the earliest): %s",
                       count, action, latest, self.unavailable_log_interval, exc)

    def _policy(self) -> Policy:
        """The plan's policy, made on the first request (the default limiter is made then)."""
        policy = self._plan_policy
        if policy is None:
            limiter = self.limiter
            decide = "check_windows"
            # This package's own check_windows (not overridden by a subclass or replaced on the
            # instance): its detailed twin sends the same command and answers the same tuple
            # with the exact wait as attributes.
            if getattr(type(limiter), "check_windows", None) in _STOCK_CHECK_WINDOWS and \
                    "check_windows" not in getattr(limiter, "__dict__", ()):
                decide = "check_windows_detailed"
            policy = self._plan_policy = Policy(
                shadow=self.mode == "shadow", lease_seconds=self.lease_seconds,
                in_flight_retry_after=self.in_flight_retry_after, fused=self._fuses(limiter),
                decide=decide)
        return policy

    def _fuses(self, limiter: Any) -> bool:
        """Whether an in-flight slot rides on the reserve (TokenRateLimit's)."""
        return False

    def _facts(self, request: Request) -> Facts | None:
        """What the plan needs of this request but its body: the identity, its tier's windows,
        the decision another dependency of this route took on them, the in-flight cap. None:
        nothing to decide (a shadow observer of a client whose address is unknown)."""
        found = self._identity_and_tier(request)
        if found is None:
            return None
        identity, tier = found
        windows = self._windows[tier]
        counted = request.scope.get(_COUNTED_KEY)
        if isinstance(counted, dict):
            counted = counted.get(self._counted_key(identity, windows))
        cap = self.max_in_flight.get(tier)
        held = None
        if cap is not None:
            leases = request.scope.get(_LEASES_KEY)
            if not isinstance(leases, _LeaseLedger):
                raise RuntimeError(
                    "max_in_flight needs RateLimitHeadersMiddleware, which gives the slot back "
                    "when the response is over: add "
                    "app.add_middleware(genai_ratelimit.fastapi.RateLimitHeadersMiddleware)")
            # One slot per lease key (Redis, key prefix, identity: namespace and mode
            # included), never two of one key: a second cap on the same key checks the slot
            # already taken.
            held = leases.lease_of(self._counted_key(identity, ()))
        return Facts(identity, tier, windows, counted=counted, cap=cap, held=held,
                     gcra=self._gcra.get(tier))

    def __call__(self, request: Request, response: Response) -> Any:
        # A plain def: FastAPI runs it in its threadpool, where the blocking C call belongs.
        facts = self._facts(request)
        if facts is not None:
            answer(self, request, response, facts, run(plan(facts, self._policy()), self.limiter))


class _AsyncRateLimit(RateLimit):
    """RateLimit over an async limiter (or with scopes, which may read the body): awaited on
    the event loop; a blocking limiter's calls run in the threadpool."""

    async def _facts_async(self, request: Request) -> Facts | None:
        facts = self._facts(request)
        if facts is not None and self._scopes:
            scopes, slots = await self._scopes.with_slots(request)
            if scopes:
                facts = dataclasses.replace(
                    facts, scopes=tuple(scopes),
                    wait=self._scopes.wait_in(scopes, self.tier_max_wait.get(facts.tier)))
                note_upstreams(request, self.limiter, self._limiter_is_async,
                               self._scopes.upstreams_in(scopes))
            if slots:
                facts = dataclasses.replace(
                    facts, slots=self._checked_slots(request, slots, facts.tier))
        return facts

    async def __call__(self, request: Request, response: Response) -> None:
        facts = await self._facts_async(request)
        if facts is None:
            return
        steps = plan(facts, self._policy())
        limiter = self.limiter
        offload = None if self._limiter_is_async else run_in_threadpool
        if self.mode != "shadow" and (facts.wait is not None or
                                      any(slot.wait is not None for slot in facts.slots)):
            # It may wait in a queue: a client that leaves meanwhile takes its ticket along
            # (the waiting call cancelled). A blocking limiter's wait, in a thread, cannot be
            # cancelled: it runs out, then the route does not run for nobody (abandon).
            watch = DisconnectWatch(request)
            try:
                outcome = await (run_async(steps, limiter, gone=watch) if offload is None else
                                 watch.during(run_async(steps, limiter, offload)))
            finally:
                watch.restore()
            if watch.left:
                outcome = abandon(outcome)
        else:
            outcome = await run_async(steps, limiter, offload)
        answer(self, request, response, facts, outcome)


class _LogThrottle:
    """At most one log line per `interval` seconds: `due()` counts one event and answers the
    number of events the line should cover, or None when it is not time yet."""

    __slots__ = ("interval", "lock", "_pending", "_logged_at")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.lock = threading.Lock()  # the threadpool may log in parallel
        self._pending = 0  # events since the last line
        self._logged_at: float | None = None  # time.monotonic() of that line

    def due(self) -> int | None:
        with self.lock:
            self._pending += 1
            now = time.monotonic()
            if self._logged_at is not None and now - self._logged_at < self.interval:
                return None
            count, self._pending, self._logged_at = self._pending, 0, now
            return count

