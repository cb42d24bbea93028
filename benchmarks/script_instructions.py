#!/usr/bin/env python3
"""The server's share of a decision in instructions: redis-server under callgrind.

    .venv/bin/python benchmarks/script_instructions.py [--calls N] [--only NAME]

Seconds on a shared 2-core machine are noisy; instructions are not. For each contender a
redis-server is started under `valgrind --tool=callgrind` on a free loopback port, the script
is loaded, N calls are sent (pipelined, 100 users round-robin, allow-heavy), the server is shut
down and callgrind's total read; then the same with 2N calls. The difference divided by N is
what one call costs the server (command parsing, the script, the reply), start-up and
shut-down cancelled out. Repeatable to a few instructions for the same binaries and inputs,
whatever else the machine does (instructions are not time: cache misses and allocation differ,
so quote these beside the commandstats rows of `make bench`, not instead of them).

Contenders: an empty script (the floor of any EVALSHA), the seed's four-command script (client
time), the same with the server's TIME, this package's check as the extension sends it
(server clock, client clock; one window, and minute + day), and the same check loaded once as
a Redis Function (`FUNCTION LOAD`, called with `FCALL`): the library's definitions made once
per server instead of once per call (an experiment: the extension sends EVALSHA).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import EMPTY_SCRIPT, ORIGINAL_FOUR_OP_SCRIPT, SCRIPT_TEXT, free_port  # noqa: E402

BIG = 10**9
USERS = 100
Argv = Callable[[str, str, int], Sequence[object]]


def ours(windows: Sequence[int], client_clock: bool) -> Argv:
    """The check's keys and ARGV as RateLimiter.check_windows sends them (3 keys a window)."""
    def argv(user: str, member: str, now: int) -> Sequence[object]:
        keys = [f"{user}:{w}" for w in windows]
        companions = [f"{key}:{suffix}" for suffix in ("w", "t") for key in keys]
        args: list[object] = [member, now if client_clock else ""]
        for w in windows:
            args += [w * 1000, BIG, 1]
        return [len(keys) * 3, *keys, *companions, *args]
    return argv


def four_op(user: str, member: str, now: int) -> Sequence[object]:
    return [1, f"{user}:60", now, 60_000, BIG, member]


def as_function(script: str) -> str:
    """The check as a Redis Functions library: the library part (every `local function` the
    build prepends) is run once by FUNCTION LOAD, the entry script's body per FCALL. KEYS and
    ARGV are upvalues the registered function sets (a library may not read globals)."""
    entry = script.index("--[[\nsliding_window.lua")
    return ("#!lua name=genai_ratelimit_bench\nlocal KEYS, ARGV\n" + script[:entry] +
            "\nredis.register_function('check', function(keys, args)\nKEYS, ARGV = keys, args\n" +
            script[entry:] + "\nend)\n")


FUNCTION_PREFIX = "#!lua name="

FOUR_OP_TIME = ORIGINAL_FOUR_OP_SCRIPT.replace(
    "local now = tonumber(ARGV[1])",
    "local t = redis.call('TIME')\n"
    "local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)")

CONTENDERS: dict[str, tuple[str, Argv]] = {
    "empty script (EVALSHA floor)": (EMPTY_SCRIPT, lambda u, m, now: [1, u]),
    "seed four-op script (client time)": (ORIGINAL_FOUR_OP_SCRIPT, four_op),
    "seed four-op script + TIME": (FOUR_OP_TIME, four_op),
    "check, server clock (default)": (SCRIPT_TEXT, ours([60], False)),
    "check, client clock": (SCRIPT_TEXT, ours([60], True)),
    "check_windows minute + day, server clock": (SCRIPT_TEXT, ours([60, 86400], False)),
    "check, server clock, as a Redis Function (FCALL)": (as_function(SCRIPT_TEXT), ours([60], False)),
    "minute + day, server clock, as a Redis Function (FCALL)":
        (as_function(SCRIPT_TEXT), ours([60, 86400], False)),
}
BASELINE = "seed four-op script (client time)"


def total_instructions(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no total in {path}")


def run_server(script: str, argv: Argv, calls: int, workdir: Path) -> int:
    """Total instructions of a redis-server that served `calls` calls of `script`."""
    port = free_port()
    out = workdir / f"callgrind.{port}"
    server = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "redis-server",
         "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server under callgrind did not start") from None
                time.sleep(0.1)
        function = script.startswith(FUNCTION_PREFIX)
        if function:
            client.function_load(script, replace=True)
        else:
            sha = client.script_load(script)
        pipe = client.pipeline(transaction=False)
        for i in range(calls):
            arguments = argv(f"gbench:ir:user_{i % USERS}", str(uuid.uuid4()),
                             int(time.time() * 1000))
            if function:
                pipe.execute_command("FCALL", "check", *arguments)
            else:
                pipe.evalsha(sha, *arguments)
            if len(pipe) == 500:
                check(pipe.execute())
        check(pipe.execute())
        client.shutdown(nosave=True)
    except redis.ConnectionError:
        pass  # SHUTDOWN closes the connection
    finally:
        server.wait(120)
    total = total_instructions(out)
    out.unlink()
    return total


def check(replies: list[object]) -> None:
    for reply in replies:
        if not isinstance(reply, list) or reply[0] != 1:
            raise RuntimeError(f"a call was not allowed: {reply!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--only", help="only contenders whose name contains this text")
    options = parser.parse_args()
    names = [n for n in CONTENDERS if not options.only or options.only in n or n == BASELINE]
    per_call: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            script, argv = CONTENDERS[name]
            once = run_server(script, argv, options.calls, Path(tmp))
            twice = run_server(script, argv, 2 * options.calls, Path(tmp))
            per_call[name] = (twice - once) / options.calls
            print(f"  {name}: {per_call[name]:,.0f} instructions/call", file=sys.stderr, flush=True)
    floor = per_call.get("empty script (EVALSHA floor)")
    print(f"Instructions per call on the server (callgrind, {options.calls:,} vs "
          f"{2 * options.calls:,} calls; redis-server {redis_version()}):\n")
    print("| contender | instructions/call | vs seed four-op | above the EVALSHA floor |")
    print("| --- | ---: | ---: | ---: |")
    for name in names:
        above = f"{per_call[name] - floor:,.0f}" if floor is not None else "–"
        print(f"| {name} | {per_call[name]:,.0f} | {per_call[name] / per_call[BASELINE]:.2f}× | {above} |")


def redis_version() -> str:
    text = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    return next((word[2:] for word in text.split() if word.startswith("v=")), "?")


if __name__ == "__main__":
    if not os.environ.get("PATH") or subprocess.run(["which", "valgrind"], capture_output=True).returncode:
        sys.exit("benchmarks/script_instructions.py needs valgrind (apt-get install valgrind)")
    main()
