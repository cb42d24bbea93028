"""What the provider's view costs (docs/upstreams.md), in server time: the check script
(lua/sliding_window.lua as the extension embeds it, sorted sets) of this tree and of a BASE
git revision (assembled from its lua/ files as setup.py does), called

- as a plain check (the user's minute window): what every check pays for the feature;
- as a reserve through a shared cap (the user's minute window and the cap's): BASE's, and
  this tree's with the cap nobody observed (one HMGET of a missing key) and with a cap the
  provider spoke about (HMGET, then HINCRBY of its remaining and of the requests on their way),

side by side in one run on a redis-server of its own, rounds alternating forward and
reversed; server time from INFO commandstats (EVALSHA's usec_per_call), reset per sample.

    .venv/bin/python benchmarks/upstream_view_cost.py [--base 6a8728a] [--rounds 7] [--calls 4000]
    .venv/bin/python benchmarks/upstream_view_cost.py --instructions [--calls 1000]

--instructions: the same calls (but the observed cap's) in server instructions, redis-server
under callgrind (benchmarks/script_instructions.py's method: N vs 2N calls), which a busy
machine does not move.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import uuid
from pathlib import Path

import redis

from genai_ratelimit import _native
from genai_ratelimit.testing import ThrowawayRedis

CAP = "provider/model"
ROOT = Path(__file__).resolve().parent.parent


def base_script(revision: str) -> str:
    """lua/sliding_window.lua of `revision` over the sorted sets, its includes prepended."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{revision}:lua/{path}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
    text = show("sliding_window.lua")
    parts = [show(name.replace("{storage}", "zset"))
             for name in re.findall(r"^-- include: (\S+)$", text, re.MULTILINE)]
    return "".join(p if p.endswith("\n") else p + "\n" for p in parts) + text


def keys_of(user: str, shared: bool, view: bool) -> list[str]:
    windows = [f"ratelimit:{user}:60"] + ([f"ratelimit:{CAP}:60:shared"] if shared else [])
    keys = windows + [f"{w}:w" for w in windows] + [f"{w}:t" for w in windows]
    return keys + ([f"ratelimit:{CAP}:upstream"] if view else [])


def sample(client: redis.Redis, sha: str, shared: bool, view: bool, observed: bool,
           calls: int) -> float:
    client.flushdb()
    if observed:  # a view that never runs out during the sample
        client.hset(f"ratelimit:{CAP}:upstream", mapping={
            "requests": 10**12, "requests_reset": 2**52, "requests_limit": 10**12, "bound": 60_000})
    client.config_resetstat()
    pipe = client.pipeline(transaction=False)
    per_window = [60_000, 10**12, 1]
    for i in range(calls):
        keys = keys_of(f"user-{i % 1000}", shared, view)
        pipe.evalsha(sha, len(keys), *keys, str(uuid.uuid4()), "",
                     *(per_window * (2 if shared else 1)))
        if len(pipe) >= 200:
            pipe.execute()
    pipe.execute()
    return float(client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def instructions(base: str, calls: int) -> None:
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from script_instructions import run_server

    def argv(shared: bool, view: bool):  # noqa: ANN202 - script_instructions.Argv
        def make(user: str, member: str, now: int) -> list[object]:
            keys = keys_of(user, shared, view)
            return [len(keys), *keys, member, "", *([60_000, 10**12, 1] * (2 if shared else 1))]
        return make

    this, before = _native.SCRIPT_SOURCE, base_script(base)
    contenders = {
        "plain check, BASE": (before, argv(False, False)),
        "plain check, this tree": (this, argv(False, False)),
        "through a shared cap, BASE": (before, argv(True, False)),
        "through a shared cap, nobody observed": (this, argv(True, True)),
    }
    per_call = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (script, make) in contenders.items():
            once = run_server(script, make, calls, Path(tmp))
            twice = run_server(script, make, 2 * calls, Path(tmp))
            per_call[name] = (twice - once) / calls
    print(f"\nserver instructions per call (callgrind, {calls:,} vs {2 * calls:,} calls), "
          f"BASE {base}\n")
    print("| script call | instructions/call | vs BASE |")
    print("|---|---:|---:|")
    for name, value in per_call.items():
        against = per_call["plain check, BASE" if name.startswith("plain") else
                           "through a shared cap, BASE"]
        print(f"| {name} | {value:,.0f} | {value - against:+,.0f} ({value / against:.3f}×) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="6a8728a", help="the git revision before the feature")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--instructions", action="store_true")
    args = parser.parse_args()
    if args.instructions:
        instructions(args.base, args.calls)
        return
    with ThrowawayRedis() as server:
        client = redis.Redis.from_url(server.url)
        this = client.script_load(_native.SCRIPT_SOURCE)
        base = client.script_load(base_script(args.base))
        # name -> (script, shared cap, view key, observed)
        contenders = {
            "plain check, BASE": (base, False, False, False),
            "plain check, this tree": (this, False, False, False),
            "through a shared cap, BASE": (base, True, False, False),
            "through a shared cap, nobody observed": (this, True, True, False),
            "through a shared cap, provider observed": (this, True, True, True),
        }
        results: dict[str, list[float]] = {name: [] for name in contenders}
        for round_index in range(args.rounds):
            names = list(contenders)
            for name in (names if round_index % 2 == 0 else names[::-1]):
                results[name].append(sample(client, *contenders[name], args.calls))
        client.close()
    print(f"\nserver µs per call (EVALSHA usec_per_call), {args.rounds} rounds × {args.calls} "
          f"calls, BASE {args.base}; ratio: median over rounds of the same round's BASE\n")
    print("| script call | µs per call | ratio to BASE |")
    print("|---|---:|---:|")
    for name, values in results.items():
        against = results["plain check, BASE" if name.startswith("plain") else
                          "through a shared cap, BASE"]
        ratio = statistics.median(v / b for v, b in zip(values, against, strict=True))
        print(f"| {name} | {statistics.median(values):.2f} | {ratio:.3f}× |")


if __name__ == "__main__":
    main()
