"""The child side of tests/test_secret_wipe.py: one scenario per run, in a process of its
own (a missing wipe aborts it in the debug and sanitized builds, and its memory must hold
nothing but what the scenario left).

    python tests/helpers_wipe.py SCENARIO      (GENAI_RATELIMIT_TEST_PASSWORD, _URL in the
                                                environment; _SCAN=1 scans the memory)

Exit status 0: done, and when scanning, no copy of the AUTH command's password was found;
1: copies found (listed on stdout); a signal (SIGABRT): the extension's wipe check fired
(its message on stderr)."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
from collections.abc import Callable

PASSWORD = os.environ.get("GENAI_RATELIMIT_TEST_PASSWORD", "")
URL = os.environ.get("GENAI_RATELIMIT_TEST_URL", "")
SCAN = os.environ.get("GENAI_RATELIMIT_TEST_SCAN") == "1"
CRLF = b"\r\n"
LARGEST_REGION = 1 << 30  # an ASan shadow or reserved heap is terabytes of untouched pages


def framed_copies(secret: bytes) -> list[str]:
    """Where `secret` sits between CRLFs (as in the RESP text of AUTH) in this process's
    writable memory. Only that shape is looked for: the password is also in the URL
    (between ':' and '@') and in str objects (after an object header), which nothing
    here can or need wipe. The needle is never built: each hit of the bare secret is
    checked for a CRLF on both sides."""
    found = []
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    with open("/proc/self/mem", "rb", 0) as mem:
        for fields in regions:
            if not fields[1].startswith("rw") or (len(fields) > 5 and fields[5].startswith("[v")):
                continue
            start, end = (int(address, 16) for address in fields[0].split("-"))
            if end - start > LARGEST_REGION:
                continue
            try:
                mem.seek(start)
                chunk = mem.read(end - start)
            except OSError:
                continue
            at = chunk.find(secret)
            while at >= 0:
                after = at + len(secret)
                if chunk[at - 2:at] == CRLF and chunk[after:after + 2] == CRLF:
                    found.append(f"{start + at:#x} in {' '.join(fields[5:]) or 'anonymous memory'}")
                at = chunk.find(secret, at + 1)
            del chunk
    return found


def scan(when: str) -> None:
    if not SCAN:
        return
    gc.collect()
    copies = framed_copies(PASSWORD.encode())
    if copies:
        print(f"{when}: {len(copies)} copies of the AUTH command's password: {copies}")
        sys.stdout.flush()
        os._exit(1)


# ------------------------------------------------------------------------------- scenarios

class Future:
    """What Pipeline needs of a future."""

    def __init__(self) -> None:
        self.value: object = None
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def set_result(self, value: object) -> None:
        self.value, self.finished = value, True

    def set_exception(self, exc: BaseException) -> None:
        self.value, self.finished = exc, True


def handshake() -> object:
    from genai_ratelimit import _native

    pipeline = _native.Pipeline(5.0)
    assert pipeline.handshake(Future(), username="app", password=PASSWORD, db=2) is True
    return pipeline


def pipeline_dropped() -> None:
    """Queued, never written: the engine frees its output buffer with the command in it."""
    pipeline = handshake()
    del pipeline


def pipeline_grown() -> None:
    """A command too big for the buffer that holds AUTH: it moves to a larger one."""
    pipeline = handshake()
    pipeline.push_command(Future(), "ECHO", "x" * 4096)  # type: ignore[attr-defined]
    del pipeline


def pipeline_written() -> None:
    """Written (take): the buffer is used again from its start, then freed."""
    pipeline = handshake()
    sent = pipeline.take()  # type: ignore[attr-defined]
    assert type(sent) is bytearray, f"take() gave the AUTH command as {type(sent).__name__}"
    sent[:] = bytes(len(sent))  # the caller's copy: aio.py wipes it once sent
    del pipeline


def pipeline_failed() -> None:
    """Never written: the connection failed, every entry is dropped (fail_all)."""
    from genai_ratelimit import RateLimiterUnavailable, _native

    pipeline = handshake()
    lost = RateLimiterUnavailable("connection lost")
    pipeline.fail_all(lost, _native.STATUS_IO)  # type: ignore[attr-defined]
    del pipeline


def refused(check: Callable[[], object]) -> None:
    """A password the server refuses: the connection is dropped before INFO's answer."""
    from genai_ratelimit import RateLimiterAuthError

    try:
        check()
    except RateLimiterAuthError:
        scan("refused")
    else:
        raise AssertionError("the server took a password it does not know")


def sync_limiter() -> None:
    """The blocking limiter: the pool's copy of the password, the handshake on a socket."""
    from genai_ratelimit import RateLimiter

    limiter = RateLimiter(URL, connect_timeout=5, socket_timeout=5)
    assert limiter.check(f"wipe-{os.getpid()}", 5, 60)[0] is True
    scan("connected")
    limiter.close()
    del limiter


def async_limiter(loop_factory: Callable[[], asyncio.AbstractEventLoop],
                  refused_password: bool = False) -> None:
    """The asyncio limiter: the handshake's bytes handed to the event loop's transport."""
    from genai_ratelimit import AsyncRateLimiter, RateLimiterAuthError

    async def scenario() -> None:
        limiter = AsyncRateLimiter(URL, connect_timeout=5, socket_timeout=5)
        try:
            assert (await limiter.check(f"wipe-{os.getpid()}", 5, 60))[0] is True
        except RateLimiterAuthError:
            if not refused_password:
                raise
            await asyncio.sleep(0)  # the transport's connection_lost runs
            scan("refused")
        else:
            assert not refused_password, "the server took a password it does not know"
        scan("connected")
        await limiter.aclose()

    loop = loop_factory()
    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()


def uvloop_limiter(refused_password: bool = False) -> None:
    import uvloop

    async_limiter(uvloop.new_event_loop, refused_password)


def sync_refused() -> None:
    from genai_ratelimit import RateLimiter

    limiter = RateLimiter(URL, connect_timeout=5, socket_timeout=5)
    refused(lambda: limiter.check(f"wipe-{os.getpid()}", 5, 60))
    limiter.close()


def cluster_config() -> None:
    """A cluster limiter's seed nodes each hold a copy of the credentials."""
    from genai_ratelimit import RateLimiter

    limiter = RateLimiter(f"redis+cluster://:{PASSWORD}@127.0.0.1:1,127.0.0.1:2")
    limiter.close()
    del limiter


SCENARIOS: dict[str, Callable[[], None]] = {
    "pipeline-dropped": pipeline_dropped,
    "pipeline-grown": pipeline_grown,
    "pipeline-written": pipeline_written,
    "pipeline-failed": pipeline_failed,
    "sync": sync_limiter,
    "asyncio": lambda: async_limiter(asyncio.new_event_loop),
    "uvloop": uvloop_limiter,
    "cluster-config": cluster_config,
    "sync-refused": sync_refused,
    "asyncio-refused": lambda: async_limiter(asyncio.new_event_loop, refused_password=True),
    "uvloop-refused": lambda: uvloop_limiter(refused_password=True),
}


def main() -> None:
    SCENARIOS[sys.argv[1]]()
    scan("closed")


if __name__ == "__main__":
    main()
