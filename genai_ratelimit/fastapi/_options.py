"""The keywords RateLimit and TokenRateLimit share, in one place: `Options` checks them once,
`SharedOptions` types them for `**options`, and `with_options_signature` gives each class the
real signature (inspect.signature(TokenRateLimit) lists every keyword with its default)."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from .._native import MAX_LIMIT
from ..lease import DEFAULT_LEASE_SECONDS
from ..wait_queue import queue_milliseconds
from ._ietf_headers import HEADER_MODES, HeaderMode
from ._openai_headers import ERROR_FORMATS, ErrorFormat

if TYPE_CHECKING:
    from ._scopes import Upstream, UpstreamOf

Mode = Literal["enforce", "shadow"]
OnUnavailable = Literal["deny", "allow"]

# The longest Retry-After both SDKs act on: the openai SDK ignores a longer one (it raises at
# once), the anthropic SDK sleeps on it; 60 s is the cap of both.
SDK_MAX_RETRY_AFTER = 60.0
# The wait a concurrency 429 announces unless in_flight_retry_after sets one: None, the
# limiter's hint (Lease.retry_after_ms: the cap's expected hold less how long the oldest
# request in flight has run, 5 s before any history; lua/lib/lease.lua), never past the
# soonest lease's expiry (up to lease_seconds), which is only a bound.
DEFAULT_IN_FLIGHT_RETRY_AFTER = None


@dataclass(frozen=True)
class Options:
    """The shared keywords of RateLimit and TokenRateLimit, checked when the dependency is
    built (see RateLimit for what each means)."""

    error_format: ErrorFormat = "openai"
    max_client_wait_seconds: float = 300.0
    unavailable_log_interval: float = 60.0
    log_user_ids: bool = True
    mode: Mode = "enforce"
    shadow_log_interval: float = 60.0
    headers: HeaderMode = "contract"
    partition_key_secret: str | bytes | None = None
    max_in_flight: Mapping[str, int] | None = None
    lease_seconds: int = DEFAULT_LEASE_SECONDS
    in_flight_retry_after: float | None = DEFAULT_IN_FLIGHT_RETRY_AFTER
    upstream: Upstream | Sequence[Upstream] | UpstreamOf | None = None
    route_limits: Mapping[str, int] | None = None
    model_limits: Mapping[str, Mapping[str, int]] | None = None
    max_wait: float | None = None

    def __post_init__(self) -> None:
        if self.max_wait is not None:  # TypeError / ValueError now, not per request
            queue_milliseconds(self.max_wait)
        if self.mode not in ("enforce", "shadow"):
            raise ValueError(f"mode must be 'enforce' or 'shadow', got {self.mode!r}")
        if self.headers not in HEADER_MODES:
            raise ValueError(f"headers must be 'contract', 'ietf' or 'both', got {self.headers!r}")
        if self.error_format not in ERROR_FORMATS:
            raise ValueError("error_format must be 'openai', 'anthropic' or 'plain', "
                             f"got {self.error_format!r}")
        for name in ("max_client_wait_seconds", "unavailable_log_interval", "shadow_log_interval",
                     "in_flight_retry_after"):
            number = getattr(self, name)
            if number is None and name == "in_flight_retry_after":
                continue  # the limiter's hint
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise TypeError(f"{name} must be a number of seconds, not {type(number).__name__}")
            if not number >= 0 or not math.isfinite(number):
                raise ValueError(f"{name} must be a finite number >= 0, got {number!r}")
        if self.in_flight_retry_after is not None and self.in_flight_retry_after > SDK_MAX_RETRY_AFTER:
            raise ValueError(f"in_flight_retry_after must be at most {SDK_MAX_RETRY_AFTER:g} s "
                             "(the longest Retry-After the openai and anthropic SDKs act on), "
                             f"got {self.in_flight_retry_after!r}")
        if not isinstance(self.log_user_ids, bool):
            raise TypeError(f"log_user_ids must be a bool, not {type(self.log_user_ids).__name__}")
        lease = self.lease_seconds
        if isinstance(lease, bool) or not isinstance(lease, int):
            raise TypeError(f"lease_seconds must be an int, not {type(lease).__name__}")
        if not 1 <= lease <= MAX_LIMIT:
            raise ValueError(f"lease_seconds must be >= 1 and at most {MAX_LIMIT}, got {lease}")
        if self.max_in_flight is not None:
            if not isinstance(self.max_in_flight, Mapping):
                raise TypeError("max_in_flight must be a mapping of tier to int, not "
                                f"{type(self.max_in_flight).__name__}")
            for tier, cap in self.max_in_flight.items():
                if isinstance(cap, bool) or not isinstance(cap, int):
                    raise TypeError(f"max_in_flight[{tier!r}] must be an int, not {type(cap).__name__}")
                if not 1 <= cap <= MAX_LIMIT:
                    raise ValueError(f"max_in_flight[{tier!r}] must be >= 1 and at most "
                                     f"{MAX_LIMIT}, got {cap}")


class SharedOptions(TypedDict, total=False):
    """`**options` of RateLimit and TokenRateLimit: the fields of Options (a test keeps the
    two lists equal)."""

    error_format: ErrorFormat
    max_client_wait_seconds: float
    unavailable_log_interval: float
    log_user_ids: bool
    mode: Mode
    shadow_log_interval: float
    headers: HeaderMode
    partition_key_secret: str | bytes | None
    max_in_flight: Mapping[str, int] | None
    lease_seconds: int
    in_flight_retry_after: float | None
    upstream: Upstream | Sequence[Upstream] | UpstreamOf | None
    route_limits: Mapping[str, int] | None
    model_limits: Mapping[str, Mapping[str, int]] | None
    max_wait: float | None


def _signature_of(init: Callable[..., None]) -> inspect.Signature:
    """`init`'s signature without self, its **options replaced by Options' keywords."""
    parameters = [p for p in inspect.signature(init).parameters.values()
                  if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
    parameters += [inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY,
                                     default=field.default, annotation=field.type)
                   for field in dataclasses.fields(Options)]
    return inspect.Signature(parameters)


class ClassSignature:
    """A class attribute `__signature__` read on the class only: `inspect.signature(RateLimit)`
    shows every keyword, while an instance (the dependency FastAPI inspects) still answers
    its __call__'s signature."""

    def __get__(self, instance: object, owner: type) -> inspect.Signature:
        if instance is not None:
            raise AttributeError("__signature__")
        init: Callable[..., None] = next(vars(klass)["__init__"] for klass in owner.__mro__
                                         if "__init__" in vars(klass))
        return _signature_of(init)


def options_from(options: Mapping[str, Any]) -> Options:
    """Options(**options), with a TypeError naming an unknown keyword as Python would."""
    known = {field.name for field in dataclasses.fields(Options)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(unknown)}")
    return Options(**options)
