"""Runs the fuzz targets in fuzz/ (`make fuzz`) in two phases:

  explore  each target, coverage-guided, for its share of --seconds, on the release build
           (.venv). The corpus grows in build/fuzz/corpus/<target>/ from the committed
           seeds in fuzz/corpus/<target>/.
  replay   every seed and every input the exploration kept, once, on the ASan + UBSan build
           (.venv-asan).

Why two: atheris steers by Python coverage, and gcc's ASan runtime, which must be preloaded
into Python, defines the same coverage hooks as libFuzzer and wins, so under ASan libFuzzer
sees no coverage and would fuzz blind from an empty corpus. The C code itself is compiled by
gcc, which cannot emit libFuzzer's coverage in either build; the targets generate replies and
arguments from a grammar so that mutations stay meaningful.

Prints executions, executions/s and the outcome per target. Exits 1 when a target crashed,
timed out, ran out of memory or raised an unexpected exception; the input is kept in
build/fuzz/artifacts/ and the line to replay it is printed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TARGETS = ["pipeline", "arguments", "pushes"]
BUILD = os.path.join(REPO, "build", "fuzz")


def run_target(phase: str, name: str, seconds: int, extra: list[str]) -> dict[str, object]:
    seeds = os.path.join(HERE, "corpus", name)
    work = os.path.join(BUILD, "corpus", name)
    artifacts = os.path.join(BUILD, "artifacts")
    os.makedirs(work, exist_ok=True)
    os.makedirs(artifacts, exist_ok=True)
    log_path = os.path.join(BUILD, f"{phase}-{name}.log")
    limits = [f"-max_total_time={seconds}"] if phase == "explore" else ["-runs=0"]
    command = [
        sys.executable, os.path.join(HERE, f"fuzz_{name}.py"), *limits,
        "-timeout=30",            # per input
        "-rss_limit_mb=3072",
        # hiredis callocs 8 bytes per announced array element up front: a huge header is a
        # huge allocation that is never touched. RSS is what -rss_limit_mb bounds.
        "-malloc_limit_mb=65536",
        "-max_len=4096",
        "-print_final_stats=1",
        f"-artifact_prefix={artifacts}/{phase}-{name}-",
        *extra, work, seeds,
    ]
    started = time.monotonic()
    with open(log_path, "w") as log:
        status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=BUILD).returncode
    elapsed = time.monotonic() - started
    text = open(log_path, errors="replace").read()
    stats = dict(re.findall(r"^stat::(\w+):\s*(\d+)", text, re.M))
    artifact = re.findall(r"Test unit written to (\S+)", text)
    execs = int(stats.get("number_of_executed_units", 0))
    return {"name": name, "status": status, "seconds": elapsed, "log": log_path,
            "execs": execs, "per_second": execs / elapsed if elapsed else 0.0,
            "corpus": len(os.listdir(work)) + len(os.listdir(seeds)),
            "artifact": artifact[-1] if artifact else None, "text": text}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=["explore", "replay"])
    parser.add_argument("--seconds", type=int, default=60, help="explore: in total, shared by the targets")
    parser.add_argument("--target", action="append", choices=TARGETS)
    parser.add_argument("libfuzzer_flags", nargs="*", help="passed on, e.g. -seed=1")
    args = parser.parse_args()
    targets = args.target or TARGETS
    share = max(1, args.seconds // len(targets))
    results = [run_target(args.phase, name, share, args.libfuzzer_flags) for name in targets]

    build = "ASan + UBSan build" if args.phase == "replay" else "release build"
    print(f"fuzz {args.phase} ({build}):")
    print(f"  {'target':<10} {'seconds':>7} {'execs':>10} {'execs/s':>8} {'corpus':>7}  result")
    failed = False
    for r in results:
        ok = r["status"] == 0
        failed |= not ok
        verdict = "ok" if ok else f"CRASH (exit {r['status']})"
        print(f"  {r['name']:<10} {r['seconds']:>7.1f} {r['execs']:>10,} {r['per_second']:>8,.0f} "
              f"{r['corpus']:>7}  {verdict}")
    for r in results:
        if r["status"] != 0:
            print(f"\n--- fuzz_{r['name']} ({args.phase}): {r['log']}")
            print("\n".join(line for line in r["text"].splitlines()
                            if not line.startswith("INFO: Instrumenting"))[-6000:])
            if r["artifact"]:
                venv = ".venv-asan (with the Makefile's FUZZ_ENV)" if args.phase == "replay" else ".venv"
                print(f"\nreproduce: {venv}/bin/python fuzz/fuzz_{r['name']}.py {r['artifact']}")
    print(f"fuzz {args.phase}: {'FAILED' if failed else 'no crash'} "
          f"({sum(r['execs'] for r in results):,} executions, {len(results)} targets)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
