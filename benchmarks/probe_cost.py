"""What the cold start of a cap that follows its provider (Scope.probe, docs/upstreams.md)
costs a decision: the check script (lua/sliding_window.lua over sorted sets, as the
extension embeds it) of this tree and of a BASE git revision (assembled from its lua/
files, benchmarks/upstream_view_cost.py's base_script), with the same KEYS and ARGV:

- a plain check (the user's minute window), and a reserve through a shared cap nobody
  observed (the user's window and the cap's, the cap's view and queue keys): what every
  call pays for the feature when it is off (no probe spec in ARGV);
- this tree only: through a cap with `probe=1` (the spec in ARGV), cold (the first call
  admits the probe, the others are refused while it is out) and warm (a view observed).

Commands per call: every command the script ran (INFO commandstats, EVALSHA left out) over
`--calls` calls. `--instructions`: server instructions per call under callgrind
(benchmarks/script_instructions.py's method: N vs 2N calls), which a busy machine does
not move.

    .venv/bin/python benchmarks/probe_cost.py [--base main] [--calls 2000] [--instructions]
        [--only TEXT]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import redis

from genai_ratelimit import _native
from genai_ratelimit.testing import ThrowawayRedis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upstream_view_cost import base_script  # noqa: E402

CAP = "provider/model"
VIEW = f"ratelimit:{CAP}:upstream"
Make = Callable[[str, str, int], list[object]]


def keys_of(user: str, shared: bool) -> list[str]:
    windows = [f"ratelimit:{user}:60"] + ([f"ratelimit:{CAP}:60:shared"] if shared else [])
    keys = windows + [f"{w}:w" for w in windows] + [f"{w}:t" for w in windows]
    if shared:  # the cap's view, then its wait queue's two keys (csrc/script.c's order)
        keys += [VIEW, f"ratelimit:{CAP}:queue", f"ratelimit:{CAP}:queue:h"]
    return keys


def argv(shared: bool, probe: str | None = None) -> Make:
    def make(user: str, member: str, now: int) -> list[object]:
        keys = keys_of(user, shared)
        tail = [probe] if probe else []
        return [len(keys), *keys, member, "",
                *([60_000, 10**12, 1] * (2 if shared else 1)), *tail]
    return make


def observed(client: redis.Redis) -> None:
    """A view that never runs out during a sample."""
    client.hset(VIEW, mapping={"requests": 10**12, "requests_reset": 2**52,
                               "requests_limit": 10**12, "bound": 60_000})


def commands(client: redis.Redis, script: str, make: Make, calls: int,
             prefill: Callable[[redis.Redis], None] | None) -> tuple[float, int]:
    """(commands per call, calls admitted)."""
    client.flushdb()
    if prefill is not None:
        prefill(client)
    sha = client.script_load(script)
    client.config_resetstat()
    admitted = 0
    for i in range(calls):
        arguments = make(f"user-{i % 1000}", str(uuid.uuid4()), 0)
        reply = client.evalsha(sha, *arguments)  # type: ignore[arg-type]
        admitted += int(reply[0])
    stats = client.info("commandstats")
    total = sum(v["calls"] for k, v in stats.items() if k != "cmdstat_evalsha"
                and k.startswith("cmdstat_"))
    return total / calls, admitted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--instructions", action="store_true")
    parser.add_argument("--only", default="", help="only the rows whose name holds this text")
    args = parser.parse_args()
    this, before = _native.SCRIPT_SOURCE, base_script(args.base)
    probe = "P 1 30000"
    contenders: dict[str, tuple[str, Make, Callable[[redis.Redis], None] | None]] = {
        "plain check, BASE": (before, argv(False), None),
        "plain check, this tree": (this, argv(False), None),
        "through a shared cap nobody observed, BASE": (before, argv(True), None),
        "through a shared cap nobody observed, this tree": (this, argv(True), None),
        "through a cap observed, BASE": (before, argv(True), observed),
        "through a cap observed, this tree": (this, argv(True), observed),
        "through a cap with probe=1, cold (1 admitted, the rest refused)":
            (this, argv(True, probe), None),
        "through a cap with probe=1, observed": (this, argv(True, probe), observed),
    }
    print(f"\nBASE {args.base}, {args.calls:,} calls each\n")
    header = "| script call | commands/call | admitted |"
    if args.instructions:
        header += " instructions/call |"
    print(header)
    print("|---|---:|---:|" + ("---:|" if args.instructions else ""))
    with ThrowawayRedis() as server, tempfile.TemporaryDirectory() as tmp:
        client = redis.Redis.from_url(server.url)
        for name, (script, make, prefill) in contenders.items():
            if args.only not in name:
                continue
            per_call, admitted = commands(client, script, make, args.calls, prefill)
            row = f"| {name} | {per_call:.2f} | {admitted:,} |"
            if args.instructions and admitted < args.calls:  # its method admits every call
                row += " — |"
            elif args.instructions:
                from script_instructions import run_server
                once = run_server(script, make, args.calls, Path(tmp), prefill)
                twice = run_server(script, make, 2 * args.calls, Path(tmp), prefill)
                row += f" {(twice - once) / args.calls:,.0f} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
