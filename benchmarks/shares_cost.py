"""What reserved shares cost Redis (docs/upstreams.md, "Reserved shares"): the check script
(lua/sliding_window.lua as the extension embeds it, sorted sets) of this tree and of a BASE
git revision (assembled as benchmarks/upstream_view_cost.py does), called as a reserve
through a shared cap (the user's minute window and the cap's):

- BASE, and this tree without shares: what a cap without shares pays for the feature;
- this tree with shares of three classes (enterprise 30 % reserved, pro 10 %, free ceiling
  50 % above 80 %), the request of class free (logged in its class log).

Side by side in one run on a redis-server of its own, rounds alternating forward and
reversed; commands per call and server time (EVALSHA's usec_per_call) from INFO
commandstats, reset per sample. The cap is large enough that every call is admitted.

    .venv/bin/python benchmarks/shares_cost.py [--base 2859c33] [--rounds 7] [--calls 4000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from pathlib import Path

import redis

from genai_ratelimit import Scope, _native
from genai_ratelimit.shares import spec
from genai_ratelimit.testing import ThrowawayRedis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upstream_view_cost import CAP, base_script, keys_of  # noqa: E402

SHARES = Scope(CAP, [(10**12, 60)], shared=True, reserved={"enterprise": 30, "pro": 10},
               ceilings={"free": (50, 80)})


def sample(client: redis.Redis, sha: str, view: bool, shares: bool,
           calls: int) -> tuple[float, float]:
    client.flushdb()
    client.config_resetstat()
    pipe = client.pipeline(transaction=False)
    extra = [spec(SHARES, 1, "free")] if shares else []
    for i in range(calls):
        keys = keys_of(f"user-{i % 1000}", True, view)
        pipe.evalsha(sha, len(keys), *keys, str(uuid.uuid4()), "",
                     *([60_000, 10**12, 1] * 2), *extra)
        if len(pipe) >= 200:
            pipe.execute()
    pipe.execute()
    stats = client.info("commandstats")
    commands = sum(v["calls"] for k, v in stats.items()
                   if k not in ("cmdstat_evalsha", "cmdstat_config|resetstat"))
    return commands / calls, float(stats["cmdstat_evalsha"]["usec_per_call"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="2859c33", help="the git revision before the feature")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=4000)
    args = parser.parse_args()
    with ThrowawayRedis() as server:
        client = redis.Redis.from_url(server.url)
        this = client.script_load(_native.SCRIPT_SOURCE)
        base = client.script_load(base_script(args.base))
        contenders = {  # name -> (script, view key, shares)
            "through a shared cap, BASE": (base, True, False),
            "through a shared cap, this tree, no shares": (this, True, False),
            "through a shared cap, this tree, 3 classes": (this, True, True),
        }
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
        for round_index in range(args.rounds):
            names = list(contenders)
            for name in (names if round_index % 2 == 0 else names[::-1]):
                results[name].append(sample(client, *contenders[name], args.calls))
        client.close()
    print(f"\n{args.rounds} rounds × {args.calls} calls, BASE {args.base}; ratio: median over "
          f"rounds of the same round's BASE\n")
    print("| script call | commands per call | µs per call | ratio to BASE |")
    print("|---|---:|---:|---:|")
    against = results["through a shared cap, BASE"]
    for name, values in results.items():
        ratio = statistics.median(v[1] / b[1] for v, b in zip(values, against, strict=True))
        print(f"| {name} | {statistics.median(v[0] for v in values):.2f} | "
              f"{statistics.median(v[1] for v in values):.2f} | {ratio:.3f}× |")


if __name__ == "__main__":
    main()
