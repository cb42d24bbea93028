"""Type stubs of the C extension genai_ratelimit._native (csrc/)."""

from collections.abc import Sequence
from typing import Any, ClassVar, Literal, final

from _typeshed import structseq
from typing_extensions import disjoint_base

from genai_ratelimit.metrics import LimiterMetrics

SCRIPT_SHA1: str
SCRIPT_SOURCE: str
RECONCILE_SHA1: str
RECONCILE_SOURCE: str
PEEK_SHA1: str
PEEK_SOURCE: str
RESET_SHA1: str
RESET_SOURCE: str
LEASE_SHA1: str
LEASE_SOURCE: str
COMPACT_SHA1: str
COMPACT_SOURCE: str
COMPACT_RECONCILE_SHA1: str
COMPACT_RECONCILE_SOURCE: str
COMPACT_PEEK_SHA1: str
COMPACT_PEEK_SOURCE: str
IN_FLIGHT_SHA1: str
IN_FLIGHT_SOURCE: str
RECONCILE_RELEASE_SHA1: str
RECONCILE_RELEASE_SOURCE: str
COMPACT_IN_FLIGHT_SHA1: str
COMPACT_IN_FLIGHT_SOURCE: str
COMPACT_RECONCILE_RELEASE_SHA1: str
COMPACT_RECONCILE_RELEASE_SOURCE: str
HIREDIS_VERSION: str  # "major.minor.patch" of the hiredis headers compiled against
STATUS_CONNECT: int
STATUS_TIMEOUT: int
STATUS_AUTH: int
STATUS_PROTOCOL: int
STATUS_CLOSED: int
STATUS_IO: int
STATUS_SERVER: int
STATUS_REDIRECT: int
ROUTE_SEND: int
ROUTE_READ: int
ROUTE_WAIT: int
ROUTE_FAIL: int
MAX_WINDOWS: int
MAX_LIMIT: int
MAX_WINDOW_SECONDS: int
MAX_TIMEOUT_SECONDS: int
MAX_UNIX_MS: int
MAX_CLOCK_SKEW_MS: int

def _set_client_clock(ms: int | None, /) -> None: ...
def check_options(
    key_prefix: object,
    clock: object,
    connect_timeout: object,
    socket_timeout: object,
    max_connections: object,
    storage: object,
    min_replicas: object,
    replica_timeout_ms: object,
    hash_tag: bool = False,
) -> None: ...
def key_owner(owner: str, hash_tag: bool, /) -> str: ...
_KeyKind = Literal["window", "scope", "shared", "leases", "gcra"]

def read_key(
    name: str, prefix: str, hash_tag: bool, /
) -> tuple[_KeyKind, str, int, bool, str | None, Literal["w", "c", ""]] | None: ...

@final
class WindowDecision(structseq[Any], tuple[bool, int, int, int]):
    """check_windows_detailed's answer: check_windows' 4-tuple with two more attributes."""

    __match_args__: ClassVar[tuple[str, str, str, str]]
    @property
    def allowed(self) -> bool: ...
    @property
    def remaining(self) -> int: ...
    @property
    def retry_after_s(self) -> int: ...
    @property
    def window_seconds(self) -> int: ...
    @property
    def retry_after_ms(self) -> int: ...
    @property
    def timestamp_ms(self) -> int: ...

# A scope of a reserve call: (name, shared, windows, token_windows); of a reconcile call:
# (name, shared, windows of the reconciled resource).
_NativeScope = tuple[str, bool, Sequence[tuple[int, int]], Sequence[tuple[int, int]]]
_NativeReconcileScope = tuple[str, bool, Sequence[tuple[int, int]]]
# (allowed, remaining, retry_after_s, window_seconds, is_token_window, member, timestamp_ms,
#  ((limit, window_seconds, is_token_window, remaining, scope), ...), retry_after_ms, scope,
#  tie, slot), where scope is 0 for the user's own windows and k for scopes[k - 1], tie names
# the entry with timestamp_ms in the compact storage (0 in the sorted-set storage), and slot
# is in_flight's answer (_acquire's tuple) or None.
_SlotTuple = tuple[bool, int, int, int, str, int, int, int]
# _acquire: the slot tuple and the reserved-share rule that refused it (0: none)
_AcquireTuple = tuple[bool, int, int, int, str, int, int, int, int]
_ReserveTuple = tuple[
    bool, int, int, int, bool, str, int, tuple[tuple[int, int, bool, int | None, int], ...], int,
    int, int, _SlotTuple | None, int
]

class RateLimiterError(Exception): ...
class RateLimiterUnavailable(RateLimiterError): ...
class RateLimiterTimeout(RateLimiterUnavailable, TimeoutError): ...
class RateLimiterAuthError(RateLimiterUnavailable): ...

# _peek: (allowed, remaining, retry_after_s, window_seconds, is_token_window, now_ms,
#         ((limit, window_seconds, is_token_window, used, oldest_ms | None), ...),
#         retry_after_ms)
_PeekResult = tuple[bool, int, int, int, bool, int, tuple[tuple[int, int, bool, int, int | None], ...], int]
# _check_rate (GCRA): (allowed, remaining, retry_after_s, retry_after_ms, now_ms)
_RateResult = tuple[bool, int, int, int, int]
# (allowed, refused index, kind (0 allow, 1 permanent, 2 until_reset, 3 in_flight, -1 stale
# periods), now_ms, hold id, ((remaining, period_start_ms, period_end_ms, fired_before,
# fired_after), ...)); fired: the highest soft limit fired in the period (0: none)
_HoldResult = tuple[bool, int, int, int, str, tuple[tuple[int, int, int, int, int], ...]]
# (owner, name, limit, amount, previous_start, start, end, next_end, packed thresholds)
_HoldRow = tuple[str, str, int, int, int, int, int, int, int]
# (owner, name, period_start, actual, limit, packed thresholds)
_SettleRow = tuple[str, str, int, int, int, int]
# (found, ((fired_before, fired_after) per budget))
_SettleResult = tuple[int, tuple[tuple[int, int], ...]]
GCRA_SHA1: str
GCRA_SOURCE: str
# _observe_upstream: lua/observe_upstream.lua (closed-until, unix ms, 0 when open)
OBSERVE_SHA1: str
OBSERVE_SOURCE: str
# _wait_queue: lua/wait_queue.lua (take: the ticket's rank, -1/-2 full; leave: 1 or 0);
# numbers: (wait_ms, max_queue, max_tenant[, weight, class]): the ticket's class's share in
# basis points (0-10000, 0: no shares) and its index (0-64), wait_queue.queue_class
QUEUE_SHA1: str
QUEUE_SOURCE: str
GCRA_WINDOWS_SHA1: str
GCRA_WINDOWS_SOURCE: str
COMPACT_GCRA_WINDOWS_SHA1: str
COMPACT_GCRA_WINDOWS_SOURCE: str
BUDGET_HOLD_SHA1: str
BUDGET_HOLD_SOURCE: str
BUDGET_SETTLE_SHA1: str
BUDGET_SETTLE_SOURCE: str

@disjoint_base
class Limiter:
    def __init__(
        self,
        *,
        host: str | None = ...,
        port: int = ...,
        unix_path: str | None = ...,
        db: int = ...,
        username: str | None = ...,
        password: str | None = ...,
        connect_timeout: float = ...,
        socket_timeout: float = ...,
        key_prefix: str = ...,
        client_clock: bool = ...,
        max_connections: int = ...,
        tls: bool = ...,
        ssl_verify: bool = ...,
        ssl_ca_certs: str | None = ...,
        ssl_certfile: str | None = ...,
        ssl_keyfile: str | None = ...,
        metrics: bool = ...,
        cluster_nodes: Sequence[tuple[str, int]] | None = ...,
        sentinel_master: str | None = ...,
        storage: str | None = ...,
        min_replicas: int = ...,
        replica_timeout_ms: int = ...,
    ) -> None: ...
    def check(
        self, user_id: str, limit: int, window_seconds: int, *, cost: int = 1
    ) -> tuple[bool, int, int]: ...
    def check_windows(
        self, user_id: str, windows: Sequence[tuple[int, int]], *, cost: int = 1
    ) -> tuple[bool, int, int, int]: ...
    def check_windows_detailed(
        self,
        user_id: str,
        windows: Sequence[tuple[int, int]],
        *,
        cost: int = 1,
        gcra: tuple[int, int, int] | None = None,
    ) -> WindowDecision: ...
    def _reserve(
        self,
        user_id: str,
        windows: Sequence[tuple[int, int]],
        *,
        cost: int = 1,
        token_windows: Sequence[tuple[int, int]] = (),
        tokens: int | None = None,
        scopes: tuple[_NativeScope, ...] = (),
        in_flight: tuple[int, int] | None = None,
        shares: str | None = None,
        ticket: str | None = None,
        probe: str | None = None,
    ) -> _ReserveTuple: ...
    def _reconcile(
        self,
        user_id: str,
        windows: Sequence[tuple[int, int]],
        member: str,
        timestamp_ms: int,
        cost: int,
        *,
        tokens: bool = False,
        scopes: tuple[_NativeReconcileScope, ...] = (),
        tie: int = 0,
        release: bool = False,
        shares: str | None = None,
    ) -> int: ...
    def _peek(
        self,
        user_id: str,
        windows: Sequence[tuple[int, int]],
        *,
        cost: int = 1,
        token_windows: Sequence[tuple[int, int]] = (),
        tokens: int | None = None,
        scopes: tuple[_NativeScope, ...] = (),
    ) -> _PeekResult: ...
    def _check_rate(
        self, user_id: str, rate: int, period_seconds: int, burst: int, *, cost: int = 1
    ) -> _RateResult: ...
    def _hold_budgets(
        self, user_id: str, budgets: tuple[_HoldRow, ...], hold_ms: int
    ) -> _HoldResult: ...
    def _settle_budgets(
        self, user_id: str, budgets: tuple[_SettleRow, ...], hold_id: str
    ) -> _SettleResult: ...
    def _observe_upstream(
        self, name: str, observation: tuple[int, int, int, int, int, int, int, int]
    ) -> int: ...
    def _wait_queue(
        self, name: str, ticket: str, tenant: str,
        numbers: tuple[int, int, int] | tuple[int, int, int, int, int],
        leases: bool = False,
    ) -> int: ...
    def _reset(
        self,
        user_id: str,
        windows: Sequence[tuple[int, int]] | None = None,
        *,
        token_windows: Sequence[tuple[int, int]] | None = None,
        cursor: str | None = None,
    ) -> tuple[int, str]: ...
    def metrics(self) -> LimiterMetrics: ...
    def _record_outcome(self, kind: str, count: int = 1, /) -> None: ...
    def _acquire(
        self, user_id: str, limit: int, lease_seconds: int, shares: str | None = None,
        ticket: str | None = None
    ) -> _AcquireTuple: ...  # (allowed, held, retry_after_s, retry_after_ms, lease_id,
    # expires_at_ms, now_ms, retry_bound_ms, share rule)
    def _release(self, user_id: str, lease_id: str) -> bool: ...
    def _renew(self, user_id: str, lease_id: str, lease_seconds: int) -> tuple[bool, int]: ...
    def close(self) -> None: ...
    @property
    def key_prefix(self) -> str: ...
    @property
    def max_connections(self) -> int: ...
    @property
    def open_connections(self) -> int: ...
    @property
    def closed(self) -> bool: ...

@final
class Request:
    @property
    def command(self) -> bytes | None: ...
    @property
    def replayed(self) -> bool: ...
    @property
    def reloaded(self) -> bool: ...
    @property
    def slot(self) -> int: ...
    @property
    def route(self) -> Route | None: ...
    @route.setter
    def route(self, value: Route | None) -> None: ...

@final
class Codec:
    def __init__(
        self, key_prefix: str, *, client_clock: bool = ..., metrics: bool = ...,
        hash_tag: bool = ..., storage: str | None = ...
    ) -> None: ...
    def check(
        self, user_id: str, limit: int, window_seconds: int, *, cost: int = 1
    ) -> Request | tuple[bool, int, int]: ...
    def check_windows(
        self, user_id: str, windows: Sequence[tuple[int, int]], *, cost: int = 1
    ) -> Request | tuple[bool, int, int, int]: ...
    def check_windows_detailed(
        self,
        user_id: str,
        windows: Sequence[tuple[int, int]],
        *,
        cost: int = 1,
        gcra: tuple[int, int, int] | None = None,
    ) -> Request | WindowDecision: ...
    def reserve(
        self,
        user_id: str,
        windows: Sequence[tuple[int, int]],
        *,
        cost: int = 1,
        token_windows: Sequence[tuple[int, int]] = (),
        tokens: int | None = None,
        scopes: tuple[_NativeScope, ...] = (),
        in_flight: tuple[int, int] | None = None,
        shares: str | None = None,
        ticket: str | None = None,
        probe: str | None = None,
    ) -> Request | _ReserveTuple: ...
    def reconcile(
        self,
        user_id: str,
        windows: Sequence[tuple[int, int]],
        member: str,
        timestamp_ms: int,
        cost: int,
        *,
        tokens: bool = False,
        scopes: tuple[_NativeReconcileScope, ...] = (),
        tie: int = 0,
        release: bool = False,
        shares: str | None = None,
    ) -> Request: ...
    def peek(
        self,
        user_id: str,
        windows: Sequence[tuple[int, int]],
        *,
        cost: int = 1,
        token_windows: Sequence[tuple[int, int]] = (),
        tokens: int | None = None,
        scopes: tuple[_NativeScope, ...] = (),
    ) -> Request | _PeekResult: ...
    def check_rate(
        self, user_id: str, rate: int, period_seconds: int, burst: int, *, cost: int = 1
    ) -> Request | _RateResult: ...
    def hold_budgets(
        self, user_id: str, budgets: tuple[_HoldRow, ...], hold_ms: int
    ) -> Request | _HoldResult: ...
    def settle_budgets(
        self, user_id: str, budgets: tuple[_SettleRow, ...], hold_id: str
    ) -> Request: ...
    def observe_upstream(
        self, name: str, observation: tuple[int, int, int, int, int, int, int, int]
    ) -> Request | int: ...
    def wait_queue(
        self, name: str, ticket: str, tenant: str,
        numbers: tuple[int, int, int] | tuple[int, int, int, int, int],
        leases: bool = False,
    ) -> Request: ...
    def reset(
        self,
        user_id: str,
        windows: Sequence[tuple[int, int]] | None = None,
        *,
        token_windows: Sequence[tuple[int, int]] | None = None,
        cursor: str | None = None,
    ) -> Request: ...
    def metrics(self) -> LimiterMetrics: ...
    def _record_outcome(self, kind: str, count: int = 1, /) -> None: ...
    def acquire(
        self, user_id: str, limit: int, lease_seconds: int, shares: str | None = None,
        ticket: str | None = None
    ) -> Request | _AcquireTuple: ...
    # The kill switch answers new decisions only: what Redis holds is always given back,
    # renewed, reconciled or reset there, so these four always answer a Request.
    def release(self, user_id: str, lease_id: str) -> Request: ...
    def renew(self, user_id: str, lease_id: str, lease_seconds: int) -> Request: ...

@final
class Pipeline:
    def __init__(self, timeout: float, *, codec: Codec | None = ...) -> None: ...
    def handshake(
        self,
        future: Any,
        /,
        username: str | None = ...,
        password: str | None = ...,
        db: int = ...,
        ping: bool = ...,
    ) -> bool: ...
    def push(self, future: Any, request: Request, extend: float = ..., /) -> None: ...
    def push_command(self, future: Any, /, *words: str | bytes) -> None: ...
    def take(self) -> bytes | bytearray | None: ...
    def feed(self, data: bytes, /) -> bool: ...
    def push_wait(self, future: Any, replicas: int, timeout_ms: int, /) -> None: ...
    def push_question(self, future: Any, read: RouteRead, /) -> None: ...
    def fail_all(self, exception: BaseException, status: int, /) -> None: ...
    def fail_wait(self, future: Any, exception: BaseException, status: int, /) -> None: ...
    def take_replays(self, exception: BaseException, /) -> list[tuple[Any, Request]]: ...
    def oldest_deadline(self) -> float | None: ...
    def idle_is_stale(self, fd: int, /) -> bool: ...
    @property
    def pending(self) -> int: ...
    @property
    def eviction_warning(self) -> str | None: ...


@final
class PushReader:
    """The decoding half of a pub/sub subscriber connection (csrc/py_pushes.c)."""

    def __init__(self) -> None: ...
    def feed(self, data: bytes, /) -> list[tuple[str, bytes, bytes]]: ...
    def command(self, *words: str | bytes) -> bytearray: ...

@final
class Router:
    """The routing of a Redis Cluster or a Sentinel set, with no I/O (csrc/router.c)."""

    def __new__(cls, nodes: Sequence[tuple[str, int]], tls: bool = False,
                master_name: str | None = None, socket_timeout: float = 1.0) -> Router: ...
    @property
    def master_name(self) -> str | None: ...
    def address(self, node: int, /) -> tuple[str, int]: ...
    def sentinel(self, index: int, /) -> tuple[str, int]: ...
    def destination(self, slot: int, /) -> int: ...
    def masters(self) -> list[int]: ...
    def route(self, slot: int, deadline: float, /) -> Route: ...
    def read(self, deadline: float, route: Route | None = None, /) -> RouteRead: ...

@final
class Route:
    """One call's route through a Router."""

    @property
    def deadline(self) -> float: ...
    @property
    def go_on(self) -> bool: ...
    def next(self) -> tuple[int, Any, bool]: ...
    def failed(self, status: int, exc: BaseException, /) -> bool: ...

@final
class RouteRead:
    """One read of a Router's map or sentinels."""

    def question(self) -> tuple[bool, int, float] | None: ...
    def failed(self, status: int, exc: BaseException, /) -> None: ...
    def end(self) -> int: ...
    def error(self) -> RateLimiterError | None: ...
