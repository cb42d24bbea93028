"""Start-up checks of an app's rate-limit dependencies, and `rate_limit_lifespan`.

What can be wrong before any request: a dependency that needs RateLimitHeadersMiddleware
without it (max_in_flight, TokenRateLimit), two dependencies whose budgets differ but would
count in the same keys, a limiter that cannot reach Redis. `check_app(app)` finds the first
two from the app's routes; `rate_limit_lifespan` runs it when the app starts, pings every
limiter, and closes them when it stops. RateLimitHeadersMiddleware runs the same checks when
the server starts the app (the ASGI lifespan's `lifespan.startup`, `checking_startup`), with
or without the lifespan: a misconfigured app answers `lifespan.startup.failed` with the
message, so the server does not start it. An app with neither (or a server that runs no
lifespan): each dependency runs the same checks on the first request of each app (then a
misconfigured app answers 500 with the message, and logs it, instead of counting wrongly)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.types import Message, Receive, Scope, Send

if TYPE_CHECKING:
    from ._dependency import RateLimit

logger = logging.getLogger("genai_ratelimit")


class RateLimitConfigError(RuntimeError):
    """The app's rate-limit dependencies cannot work as configured; the message says why
    and how to fix it."""


def _calls(dependant: Any) -> Iterator[Any]:
    for sub in getattr(dependant, "dependencies", ()) or ():
        yield getattr(sub, "call", None)
        yield from _calls(sub)


def dependencies_of(app: Any) -> list[RateLimit]:
    """Every RateLimit / TokenRateLimit the app's routes (and their routers) depend on, each
    once, in route order. (Known by their class's mark: this module is imported by theirs.)"""
    found: list[RateLimit] = []
    for route in getattr(app, "routes", ()):
        for call in _calls(getattr(route, "dependant", None)):
            marked = getattr(type(call), "_rate_limit_dependency", False)
            if marked and not any(call is seen for seen in found):
                found.append(call)
    return found


def has_headers_middleware(app: Any) -> bool:
    """Whether RateLimitHeadersMiddleware (known by its class's mark) wraps the app."""
    return any(getattr(getattr(m, "cls", None), "_rate_limit_headers", False)
               for m in getattr(app, "user_middleware", ()))


def check_dependencies(dependencies: Iterable[RateLimit], *, middleware: bool | None) -> None:
    """Raises RateLimitConfigError when a dependency needs the middleware that is missing
    (`middleware` False; None: unknown, not checked), or when two dependencies would count
    in the same keys with different budgets."""
    dependencies = list(dependencies)
    if middleware is False:
        for dependency in dependencies:
            if dependency.max_in_flight:
                raise RateLimitConfigError(
                    f"{dependency!r}: max_in_flight needs RateLimitHeadersMiddleware, which "
                    "gives each slot back when the response is over: add "
                    "app.add_middleware(genai_ratelimit.fastapi.RateLimitHeadersMiddleware)")
    seen: dict[tuple[object, ...], tuple[RateLimit, object]] = {}
    for dependency in dependencies:
        for space, budget in dependency.key_budgets():
            other = seen.get(space)
            if other is None:
                seen[space] = (dependency, budget)
            elif other[1] != budget:
                raise RateLimitConfigError(
                    f"{other[0]!r} and {dependency!r} would count in the same keys "
                    f"({space[-2] or 'no namespace'}, {space[-1]}) with different budgets "
                    f"({other[1]} and {budget}): give one of them namespace=\"...\" (keys of "
                    "its own), or keep one tier budget and put the difference in route_limits= "
                    "(a budget of the route beside the tier's)")


def check_app(app: Any) -> None:
    """The start-up checks of `app` (see the module's docstring); raises RateLimitConfigError."""
    check_dependencies(dependencies_of(app), middleware=has_headers_middleware(app))


# The apps whose start-up checks RateLimitHeadersMiddleware ran as the server started them:
# their rate_limit_lifespan does not run them again.
_checked_by_middleware: weakref.WeakSet[Any] = weakref.WeakSet()


def _check_and_mark(app: Any, dependencies: list[RateLimit], *, middleware: bool) -> None:
    check_dependencies(dependencies, middleware=middleware)
    for dependency in dependencies:
        dependency.mark_checked(app)


def checking_startup(scope: Scope, receive: Receive, send: Send) -> Receive:
    """The `receive` of an ASGI lifespan scope, for RateLimitHeadersMiddleware: on the
    server's `lifespan.startup` it runs the start-up checks of the app (scope["app"], which
    the app sets before it first receives: an app wrapped in the middleware from outside is
    found too) before the app sees the message. A check that fails answers the server
    `lifespan.startup.failed` with its message and raises into the app, which then never
    starts (uvicorn logs the message and exits with status 3; a TestClient raises it)."""
    started = False

    async def receive_checked() -> Message:
        nonlocal started
        message = await receive()
        if message.get("type") != "lifespan.startup" or started:
            return message
        started = True
        app = scope.get("app")
        try:
            _check_and_mark(app, dependencies_of(app), middleware=True)
        except Exception as exc:
            await send({"type": "lifespan.startup.failed",
                        "message": f"{type(exc).__name__}: {exc}"})
            raise
        if app is not None:
            try:
                _checked_by_middleware.add(app)
            except TypeError:  # an app that takes no weak reference: its lifespan checks again
                pass
        return message

    return receive_checked


def _distinct_limiters(dependencies: Iterable[RateLimit]) -> list[Any]:
    limiters: list[Any] = []
    for dependency in dependencies:
        limiter = dependency.limiter
        if not any(limiter is seen for seen in limiters):
            limiters.append(limiter)
    return limiters


async def ping_limiters(dependencies: Iterable[RateLimit]) -> None:
    """Pings each limiter once (awaited, or in the threadpool for a blocking one): raises
    what the limiter raises when Redis cannot answer."""
    for limiter in _distinct_limiters(dependencies):
        ping = getattr(limiter, "ping", None)
        if ping is None:
            continue
        if inspect.iscoroutinefunction(ping):
            await ping()
        else:
            await run_in_threadpool(ping)


async def close_limiters(dependencies: Iterable[RateLimit]) -> None:
    for limiter in _distinct_limiters(dependencies):
        aclose = getattr(limiter, "aclose", None)
        if aclose is not None and inspect.iscoroutinefunction(aclose):
            await aclose()
        elif callable(getattr(limiter, "close", None)):
            await run_in_threadpool(limiter.close)


@contextlib.asynccontextmanager
async def rate_limit_lifespan(app: Any, *, ping: bool = True, close: bool = True
                              ) -> AsyncIterator[None]:
    """A FastAPI lifespan that checks the app's rate limiting when it starts:

        app = FastAPI(lifespan=rate_limit_lifespan)

    or, inside a lifespan of your own, `async with rate_limit_lifespan(app): yield`.

    On start: check_app(app) (a dependency needing RateLimitHeadersMiddleware without it, two
    budgets on the same keys: RateLimitConfigError), then one `ping()` per limiter the
    dependencies use (`ping=False` skips it; a Redis that cannot answer raises
    RateLimiterUnavailable, so the app does not start). On stop: closes those limiters
    (`close=False` leaves them open, e.g. when they are shared with other apps)."""
    dependencies = dependencies_of(app)
    if app not in _checked_by_middleware:
        _check_and_mark(app, dependencies, middleware=has_headers_middleware(app))
    if ping:
        await ping_limiters(dependencies)
    try:
        yield
    finally:
        if close:
            await close_limiters(dependencies)
