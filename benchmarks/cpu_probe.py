"""Client instructions per check, measured under `valgrind --tool=callgrind` (run.py starts it).

For each implementation named on the command line: set it up, warm it up, then
    dump counters -> N checks -> dump counters -> 2N checks -> dump counters
with `callgrind_control --dump` (which also zeroes the counters). run.py reads the dumps in
order: instructions per check = (I[2N segment] - I[N segment]) / N, so the interpreter's start-up,
the imports, the set-up and the cost of the dump itself (a subprocess) all cancel out.

Usage (run.py builds this): valgrind --tool=callgrind --callgrind-out-file=DIR/cg.out \
    python benchmarks/cpu_probe.py --url redis://... --calls N pkg redispy redispy-pure limits
Prints one line per implementation, "<impl> <N-segment file> <2N-segment file>" (the K of
cg.out.K; callgrind numbers dumps from 1), so run.py can map
dumps to implementations.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import RedisPyLimiter, RedisTarget, limits_storage_uri, redis_py_client  # noqa: E402

USERS = [f"user_{u}" for u in range(1000)]
LIMIT, WINDOW = 10**9, 60


def make(impl: str, target: RedisTarget, prefix: str):
    """Returns (check(i), close)."""
    if impl == "pkg":
        from genai_ratelimit import RateLimiter
        limiter = RateLimiter(target.url, key_prefix=prefix)
        check = limiter.check
        return (lambda i: check(USERS[i % 1000], LIMIT, WINDOW)), limiter.close
    if impl in ("redispy", "redispy-pure"):
        client = redis_py_client(target, pure_python_parser=impl == "redispy-pure")
        check = RedisPyLimiter(client, key_prefix=prefix).check
        return (lambda i: check(USERS[i % 1000], LIMIT, WINDOW)), client.close
    if impl == "limits":
        from limits import RateLimitItemPerMinute
        from limits.storage import storage_from_string
        from limits.strategies import MovingWindowRateLimiter
        storage = storage_from_string(limits_storage_uri(target), key_prefix=prefix)
        hit = MovingWindowRateLimiter(storage).hit
        item = RateLimitItemPerMinute(LIMIT)
        return (lambda i: hit(item, USERS[i % 1000])), storage.get_connection().close
    raise SystemExit(f"unknown implementation {impl}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--prefix", default="gbench:cpu")
    parser.add_argument("impls", nargs="+")
    args = parser.parse_args()
    target = RedisTarget.from_url(args.url)
    pid = str(os.getpid())
    dumps = 0

    def dump() -> None:
        nonlocal dumps
        subprocess.run(["callgrind_control", f"--dump=segment{dumps}", pid], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        dumps += 1

    for impl in args.impls:
        check, close = make(impl, target, f"{args.prefix}:{impl}")
        for i in range(args.warmup):
            check(i)
        dump()                       # ends set-up + warm-up
        for i in range(args.calls):
            check(i)
        dump()                       # the N segment
        for i in range(2 * args.calls):
            check(i)
        dump()                       # the 2N segment
        print(impl, dumps - 1, dumps, flush=True)  # callgrind files .K of the N and 2N segments
        close()


if __name__ == "__main__":
    main()
