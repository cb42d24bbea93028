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

    .venv/bin/python benchmarks/script_instructions.py --sizes 10,1000,100000 [--baseline FILE]

`--sizes`: instead, an allowed plain check (one day window, the server's clock) into a window
that holds N entries, the sorted sets against the compact storage (and `--baseline FILE`,
another compact check script, e.g. the built text before a change, as a third contender). The
windows are filled by the same script on a redis-server of this run's own (not under
callgrind), then copied into the measured server with DUMP/RESTORE, the same copies in both of
its runs. Up to 100 entries every call goes to a window of its own holding N (so that every
call sees N); above, every call goes to one window of N entries, which grows by the calls.
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
from benchlib import (  # noqa: E402
    EMPTY_SCRIPT,
    ORIGINAL_FOUR_OP_SCRIPT,
    SCRIPT_TEXT,
    RedisTarget,
    free_port,
)
from genai_ratelimit import _native  # noqa: E402

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


def run_server(script: str, argv: Argv, calls: int, workdir: Path,
               prefill: Callable[[redis.Redis], None] | None = None) -> int:
    """Total instructions of a redis-server that served `calls` calls of `script` (after
    `prefill`, which must do the same in every run)."""
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
        if prefill is not None:
            prefill(client)
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


DAY_MS = 86_400_000
SMALL = 100  # up to this many entries, every call goes to a window of its own


def sized(zset: bool) -> Callable[[int], Argv]:
    """An allowed plain check of one day window (server clock); user = the window's name."""
    def for_size(entries: int) -> Argv:
        def argv(user: str, member: str, now: int) -> Sequence[object]:
            keys = [user, f"{user}:w", f"{user}:t"] if zset else [f"{user}:c"]
            return [len(keys), *keys, member, "", DAY_MS, BIG, 1]
        return argv
    return for_size


def numbered(base_argv: Argv, small: bool) -> Argv:
    """base_argv on the k-th call's own window (small) or on window 0 (large)."""
    calls = [0]

    def argv(user: str, member: str, now: int) -> Sequence[object]:
        del user
        window = calls[0] if small else 0
        calls[0] += 1
        return base_argv(f"gbench:size:w{window}", member, now)
    return argv


def window_copies(script: str, argv: Argv, entries: int) -> list[tuple[str, bytes]]:
    """(key suffix, DUMP) of every key of a window filled with `entries` allowed calls, made
    on a redis-server of this run's own (not under callgrind)."""
    target = RedisTarget.start_own()
    try:
        admin = redis.Redis(host=target.host, port=target.port)  # DUMP's bytes as they are
        sha = admin.script_load(script)
        for start in range(0, entries, 1000):
            pipe = admin.pipeline(transaction=False)
            for _ in range(start, min(entries, start + 1000)):
                pipe.evalsha(sha, *argv("fill", str(uuid.uuid4()), 0))
            check(pipe.execute())
        copies = []
        for key in admin.keys("fill*"):
            name = key.decode()
            copies.append((name[len("fill"):], admin.dump(name)))
        return copies
    finally:
        target.close()


def size_rows(sizes: list[int], calls: int, baseline: Path | None, workdir: Path) -> None:
    contenders = [("zset", _native.SCRIPT_SOURCE, sized(True))]
    if baseline is not None:
        contenders.append(("compact, before", baseline.read_text(), sized(False)))
    contenders.append(("compact", _native.COMPACT_SOURCE, sized(False)))
    table: dict[int, list[float]] = {}
    for entries in sizes:
        table[entries] = []
        for name, script, for_size in contenders:
            base_argv = for_size(entries)
            copies = window_copies(script, base_argv, entries)
            small = entries <= SMALL
            windows = 2 * calls if small else 1

            def prefill(client: redis.Redis, copies: list[tuple[str, bytes]] = copies,
                        windows: int = windows) -> None:
                pipe = client.pipeline(transaction=False)
                for w in range(windows):
                    for suffix, dumped in copies:
                        pipe.restore(f"gbench:size:w{w}{suffix}", DAY_MS, dumped, replace=True)
                pipe.execute()

            per_run = []
            for n in (calls, 2 * calls):
                per_run.append(run_server(script, numbered(base_argv, small), n, workdir, prefill))
            per_call = (per_run[1] - per_run[0]) / calls
            table[entries].append(per_call)
            print(f"  {entries} entries, {name}: {per_call:,.0f} instructions/call",
                  file=sys.stderr, flush=True)
    names = [c[0] for c in contenders]
    print(f"Instructions per allowed plain check into a day window of N entries (callgrind, "
          f"{calls:,} vs {2 * calls:,} calls; redis-server {redis_version()}):\n")
    print("| entries | " + " | ".join(names) + " | " +
          " | ".join(f"{n} / zset" for n in names[1:]) + " |")
    print("| ---: |" + " ---: |" * (2 * len(names) - 1))
    for entries, values in table.items():
        print(f"| {entries:,} | " + " | ".join(f"{v:,.0f}" for v in values) + " | " +
              " | ".join(f"{v / values[0]:.2f}×" for v in values[1:]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--only", help="only contenders whose name contains this text")
    parser.add_argument("--sizes", help="allowed checks into windows of these sizes "
                        "(e.g. 10,1000,100000): zset against compact")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="with --sizes: another compact check script, a third contender")
    options = parser.parse_args()
    if options.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            size_rows([int(s) for s in options.sizes.split(",")], options.calls,
                      options.baseline, Path(tmp))
        return
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
