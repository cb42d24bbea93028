#!/usr/bin/env python3
"""genai-ratelimit benchmarks: this package side by side with its baselines, in one run.

    make bench            # full run (several minutes)
    make bench QUICK=1    # under a minute
    .venv/bin/python benchmarks/run.py [--quick] [--rounds N] [--duration S] [--only TEXT]
                                       [--skip e2e,memory,server,cpu] [--no-write]

What it does:
  1. builds the raw hiredis client (make -C benchmarks),
  2. starts its own redis-server on a free loopback port (--save "" --appendonly no), unless
     REDIS_URL is set (then only keys under gbench:* / the contenders' prefixes are touched),
  3. runs every contender in contenders.py against that server, round after round, the order
     alternating forward / reversed (drift cancels), each run on a clean keyspace,
  4. measures server time per decision (INFO commandstats), memory per logged request
     (MEMORY USAGE), client instructions per check (callgrind), and the example FastAPI app under
     uvicorn + wrk (limited vs unlimited route),
  5. prints the tables (medians, min-max over rounds, ratios to the baselines) and writes them to
     benchmarks/RESULTS.md with the commit, versions, CPU model and a met/not-met line per target.
All traffic goes to loopback (or REDIS_URL), bounded in time and count.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sections  # noqa: E402
from benchlib import BENCH_DIR, ROOT, RedisTarget, Sample, admin_client, clean_keys, script_stats  # noqa: E402
from contenders import ASYNC_REDISPY, RAW, REDISPY, WORKLOADS, Contender, Context, all_contenders  # noqa: E402

# Issue 4 targets (ratios in the same run) and issue 5's async ones.
TARGET_CHECK_THROUGHPUT = 0.9      # check calls/s >= 0.9x raw hiredis sequential
TARGET_CHECK_P50 = 1.1             # check p50 <= 1.1x raw hiredis sequential
TARGET_CPU = 0.5                   # client CPU per check <= 0.5x redis-py
TARGET_WINDOWS = 1.15              # check_windows (2 windows) <= 1.15x one check
TARGET_SERVER = 1.0                # server usec per decision <= the four-op script's
TARGET_E2E = 0.8                   # limited route >= 0.8x the unlimited route's requests/s
TARGET_ASYNC_VS_REDISPY = 3.0      # async @64+ >= 3x redis.asyncio
TARGET_ASYNC_VS_PIPE64 = 0.7       # async @64+ >= 0.7x raw pipelined depth 64


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- environment

def environment(target: RedisTarget, admin) -> dict[str, str]:
    def cmd(*args: str) -> str:
        try:
            return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return "?"

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dirty = cmd("git", "status", "--porcelain", "--untracked-files=no")
    versions = {}
    for module in ("redis", "hiredis", "limits", "fastapi", "uvicorn"):
        try:
            versions[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001
            versions[module] = "not installed"
    try:
        import genai_ratelimit
        package = genai_ratelimit.__version__
    except Exception as exc:  # noqa: BLE001
        package = f"not importable ({type(exc).__name__})"
    info = admin.info("server")
    return {
        "load average at start (1/5/15 min)": _loadavg(),
        "commit": cmd("git", "rev-parse", "--short", "HEAD") + (" (+ uncommitted changes)" if dirty else ""),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "hiredis (C, pkg-config)": cmd("pkg-config", "--modversion", "hiredis"),
        "redis server": f"{info.get('redis_version')} "
                        f"({'started by run.py' if target.owned else 'REDIS_URL'})",
        "cpu": f"{cpu} x {os.cpu_count()} vCPU",
        "kernel": platform.release(),
        "genai_ratelimit": package,
        "redis-py / hiredis-py / limits":
            f"{versions['redis']} / {versions['hiredis']} / {versions['limits']}",
        "fastapi / uvicorn / wrk": f"{versions['fastapi']} / {versions['uvicorn']} / "
                                   f"{cmd('sh', '-c', 'wrk -v 2>&1 | head -1').split(' [')[0] or '?'}",
    }


# --------------------------------------------------------------------------- the main loop

def run_contenders(contenders: list[Contender], target: RedisTarget, admin, rounds: int,
                   duration: float, warmup: int) -> tuple[dict[str, list[Sample]], dict[str, str]]:
    ctx = Context(target=target)
    samples: dict[str, list[Sample]] = {c.key: [] for c in contenders}
    skipped: dict[str, str] = {}
    runners: dict[str, tuple[Any, Any, str]] = {}
    for index, contender in enumerate(contenders):
        reason = contender.available()
        if reason:
            skipped[contender.key] = reason
            continue
        prefix = f"gbench:c{index}"
        try:
            run, close = contender.setup(ctx, prefix)
        except Exception as exc:  # noqa: BLE001 - a broken contender must not hide the others
            skipped[contender.key] = f"set-up failed: {type(exc).__name__}: {exc}"
            continue
        runners[contender.key] = (run, close, prefix)
    active = [c for c in contenders if c.key in runners]
    max_calls = int(duration * 200_000) + warmup
    for round_index in range(rounds):
        order = active if round_index % 2 == 0 else active[::-1]
        started = time.monotonic()
        for contender in order:
            run, _, prefix = runners[contender.key]
            if contender.key in skipped:
                continue
            clean_keys(admin, [prefix], target.owned)
            before = script_stats(admin)
            try:
                sample = run(duration, max_calls, warmup)
            except Exception as exc:  # noqa: BLE001
                skipped[contender.key] = f"failed in round {round_index + 1}: {type(exc).__name__}: {exc}"
                continue
            after = script_stats(admin)
            if after[0] > before[0]:
                sample.server_us_per_call = (after[1] - before[1]) / (after[0] - before[0])
            samples[contender.key].append(sample)
        log(f"  round {round_index + 1}/{rounds}: {len(order)} contenders "
            f"in {time.monotonic() - started:.1f} s")
    for _, close, prefix in runners.values():
        try:
            close()
        except Exception:  # noqa: BLE001
            pass
        clean_keys(admin, [prefix], target.owned)
    return samples, skipped


# --------------------------------------------------------------------------- report helpers

def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def spread(values: list[float], digits: int = 1) -> str:
    if not values:
        return "–"
    med = statistics.median(values)
    if len(values) == 1:
        return fmt(med, digits)
    return f"{fmt(med, digits)} ({fmt(min(values), digits)}–{fmt(max(values), digits)})"


def ratio_str(values: list[float]) -> str:
    if not values:
        return "–"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.2f}×"
    return f"{med:.2f}× ({min(values):.2f}–{max(values):.2f})"


def paired(a: list[Sample], b: list[Sample], fn) -> list[float]:
    """Per-round ratios fn(a_round, b_round), for rounds both completed."""
    out = []
    for x, y in zip(a, b, strict=False):  # a contender may have fewer rounds than the other
        try:
            out.append(fn(x, y))
        except ZeroDivisionError:
            pass
    return out


def round_ratios(a: list[float], b: list[float]) -> list[float]:
    """Per-round ratios a/b, for rounds both completed and where b is not 0."""
    return [x / y for x, y in zip(a, b, strict=False) if y]


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class Report:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, line: str = "") -> None:
        self.lines.append(line)

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        self.add("| " + " | ".join(header) + " |")
        self.add("|" + "|".join("---" for _ in header) + "|")
        for row in rows:
            self.add("| " + " | ".join(row) + " |")
        self.add()

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def by_role(contenders: list[Contender], workload: str, role: str) -> Contender | None:
    for c in contenders:
        if c.workload == workload and c.role == role:
            return c
    return None


def find(contenders: list[Contender], workload: str, startswith: str) -> Contender | None:
    for c in contenders:
        if c.workload == workload and c.name.startswith(startswith):
            return c
    return None


# --------------------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    parser.add_argument("--rounds", type=int, help="rounds over all contenders (default 5 quick, 24 full)")
    parser.add_argument("--duration", type=float,
                        help="seconds per contender per round (default 0.1 quick, 0.3 full)")
    parser.add_argument("--only", help="only contenders whose workload or name contains this text")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: e2e,memory,server,cpu")
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = parser.parse_args()
    quick = args.quick
    rounds = args.rounds or (5 if quick else 24)
    duration = args.duration or (0.1 if quick else 0.3)
    warmup = 50 if quick else 100
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    os.environ.pop("RATE_LIMIT_DISABLED", None)  # the kill switch must not turn a benchmark into a no-op
    began = time.monotonic()

    build = subprocess.run(["make", "-s", "-C", str(BENCH_DIR)], capture_output=True, text=True)
    if build.returncode != 0:
        log(build.stdout + build.stderr)
        return 1

    external = os.environ.get("REDIS_URL", "").strip()
    target = RedisTarget.from_url(external) if external else RedisTarget.start_own()
    admin = admin_client(target)
    try:
        env = environment(target, admin)
        contenders = all_contenders(quick)
        if args.only:
            contenders = [c for c in contenders if args.only in c.workload or args.only in c.name]
        package_ok = _package_importable()
        log(f"benchmarks: {len(contenders)} contenders, {rounds} rounds x {duration} s, "
            f"Redis at {target.url if target.owned else 'REDIS_URL'}")
        account = CpuAccount(target)
        samples, skipped = run_contenders(contenders, target, admin, rounds, duration, warmup)
        results: dict[str, Any] = {}
        # Instruction counts do not depend on timing: in the quick run callgrind overlaps the
        # server-time (interleaved, so load lands on every script alike) and memory sections.
        callgrind = sections.Callgrind(target, quick, package_ok) if "cpu" not in skip else None
        if callgrind is not None and quick:
            callgrind.start()
        plan = [
            ("server", "server time per decision (INFO commandstats)",
             lambda: sections.server_time_section(target, admin, quick, 3 if quick else 5)),
            ("memory", "memory per logged request (MEMORY USAGE)",
             lambda: sections.memory_section(target, admin, quick, package_ok)),
            ("cpu", "client instructions per check (callgrind)",
             lambda: (callgrind if quick else callgrind.start()).finish()),
            ("e2e", "end to end (uvicorn + wrk)",
             lambda: sections.e2e_section(target, admin, quick, 2 if quick else 10, 1.0)),
        ]
        for name, title, section in plan:
            if name in skip:
                continue
            started = time.monotonic()
            results[name] = section()
            log(f"benchmarks: {title}: {time.monotonic() - started:.1f} s")
        results["others_cpu"] = account.others()
    finally:
        if not target.owned:  # leave somebody else's server as we found it
            try:
                clean_keys(admin, ["gbench:"], owned=False)
            except Exception:  # noqa: BLE001
                pass
        admin.close()
        target.close()

    report = build_report(env, contenders, samples, skipped, results, quick, rounds, duration,
                          time.monotonic() - began)
    print(report)
    if not args.no_write and not args.only:
        (BENCH_DIR / "RESULTS.md").write_text(report)
        log("benchmarks: wrote benchmarks/RESULTS.md")
    log(f"benchmarks: done in {time.monotonic() - began:.0f} s")
    return 0


class CpuAccount:
    """How much CPU other processes took while we ran: the machine's busy time (/proc/stat)
    minus ours (this process, its waited-for children, and the redis-server we started)."""

    def __init__(self, target: RedisTarget) -> None:
        self.pid = target.process.pid if target.process is not None else None
        self.tick = os.sysconf("SC_CLK_TCK")
        self.start = self._sample()

    def _busy(self) -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        user, nice, system, idle, iowait, irq, softirq = fields[:7]
        return (user + nice + system + irq + softirq) / self.tick

    def _ours(self) -> float:
        total = 0.0
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            ru = resource.getrusage(who)
            total += ru.ru_utime + ru.ru_stime
        if self.pid is not None:
            try:
                stat = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(stat[11]) + int(stat[12])) / self.tick
            except (OSError, IndexError, ValueError):
                pass
        return total

    def _sample(self) -> tuple[float, float, float]:
        return time.monotonic(), self._busy(), self._ours()

    def others(self) -> float | None:
        """Average vCPUs used by others since the start."""
        try:
            end = self._sample()
        except OSError:
            return None
        wall = end[0] - self.start[0]
        if wall <= 0:
            return None
        return max(0.0, ((end[1] - self.start[1]) - (end[2] - self.start[2])) / wall)


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _package_importable() -> bool:
    try:
        import genai_ratelimit  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


# --------------------------------------------------------------------------- the report

def build_report(env: dict[str, str], contenders: list[Contender], samples: dict[str, list[Sample]],
                 skipped: dict[str, str], results: dict[str, Any], quick: bool, rounds: int,
                 duration: float, elapsed: float) -> str:
    r = Report()
    r.add("# genai-ratelimit benchmark results")
    r.add()
    r.add(f"Generated by `benchmarks/run.py{' --quick' if quick else ''}` "
          f"({time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {rounds} rounds × {duration:g} s per contender, "
          f"order alternating forward/reversed; {elapsed:.0f} s in all).")
    r.add()
    others = results.get("others_cpu")
    env = dict(env)
    if others is not None:
        env["CPU used by other processes during the run"] = (
            f"{others:.2f} of {os.cpu_count()} vCPU on average (not this benchmark, not its Redis)")
    r.table(["", ""], [[k, v] for k, v in env.items()])
    if others is not None and others > 0.25:
        r.add(f"**Warning:** other work on this machine used {others:.2f} vCPU on average during the run: "
              f"absolute figures are inflated and noisy; same-round ratios are more trustworthy.")
        r.add()
    r.add("Cells: median over rounds (min–max). Ratios are computed per round against the baseline "
          "measured in the same round, then the median (min–max) of those is shown. "
          "Client CPU = user+sys of the client process (getrusage) per call; server µs = "
          "`INFO commandstats` usec_per_call of EVALSHA over the run. Python contenders are timed "
          "by the same loop (perf_counter_ns per call, ≈0.1 µs).")
    r.add()

    targets: list[tuple[str, bool | None, str]] = []

    def sample_list(c: Contender | None) -> list[Sample]:
        return samples.get(c.key, []) if c else []

    # ---- sequential table
    r.add("## Sequential: one connection, one call at a time")
    r.add()
    r.add("Pipelined raw rows: latency per batch / per call (batch ÷ depth).")
    r.add()
    header = ["workload", "contender", "calls/s", "p50 µs", "p99 µs", "client CPU µs/call",
              "server µs/call", "calls/s vs raw C", "p50 vs raw C", "calls/s vs redis-py"]
    rows = []
    for workload, wl in WORKLOADS.items():
        raw = by_role(contenders, workload, RAW)
        redispy = by_role(contenders, workload, REDISPY)
        for c in contenders:
            if c.workload != workload:
                continue
            rows.append(_row(c, wl.title, samples, skipped, raw, redispy))
    r.table(header, rows)

    # ---- async table
    async_rows = []
    pipe64 = find(contenders, "1ku-allow", "raw hiredis C, pipelined depth 64")
    for c in contenders:
        if not c.workload.startswith("async-"):
            continue
        base = by_role(contenders, c.workload, ASYNC_REDISPY)
        row = _row(c, f"{c.concurrency} in flight", samples, skipped, None, base, with_p50_ratio=False)
        vs_pipe64 = ratio_str(paired(sample_list(c), sample_list(pipe64),
                                     lambda a, b: a.calls_per_s / b.calls_per_s))
        row = row[:7] + [vs_pipe64 if c.key not in skipped else "–", row[9]]
        async_rows.append(row)
    if async_rows:
        r.add("## Concurrent (issue 5): checks/s at N in-flight calls, 1,000 users, allow-heavy")
        r.add()
        r.add("Baselines: `redis.asyncio` register_script at the same concurrency (its pool opens one "
              "connection per in-flight call), and the raw C client pipelined at depth 64 (same run).")
        r.add()
        r.table(["in flight", "contender", "checks/s", "p50 µs", "p99 µs", "client CPU µs/call",
                 "server µs/call", "vs raw C pipelined 64", "vs redis.asyncio"], async_rows)

    # ---- targets: check vs raw
    pkg_rows = []
    all_met: bool | None = True
    for workload in ("1u-allow", "1ku-allow", "1u-reject", "1ku-reject"):
        pkg = find(contenders, workload, "genai_ratelimit check")
        raw = by_role(contenders, workload, RAW)
        if not sample_list(pkg) or not sample_list(raw):
            all_met = None
            continue
        tput = med(paired(sample_list(pkg), sample_list(raw), lambda a, b: a.calls_per_s / b.calls_per_s))
        p50 = med(paired(sample_list(pkg), sample_list(raw), lambda a, b: a.p50_us / b.p50_us))
        ok = tput >= TARGET_CHECK_THROUGHPUT and p50 <= TARGET_CHECK_P50
        if all_met is not None:
            all_met = all_met and ok
        pkg_rows.append(f"{workload}: {tput:.2f}× calls/s, p50 {p50:.2f}×")
    targets.append(("sync `check` ≥ 0.9× raw hiredis loop calls/s, p50 within 1.1×",
                    all_met if pkg_rows else None, "; ".join(pkg_rows) or "package not measured"))

    # ---- targets: client CPU
    cpu = results.get("cpu", {})
    per_check = cpu.get("per_check", {})
    cpu_detail = []
    cpu_ok: bool | None = None
    if "pkg" in per_check and "redispy" in per_check:
        ratio = per_check["pkg"] / per_check["redispy"]
        cpu_ok = ratio <= TARGET_CPU
        cpu_detail.append(f"callgrind {fmt(per_check['pkg'], 0)} vs {fmt(per_check['redispy'], 0)} "
                          f"instructions/check = {ratio:.3f}×")
    pkg1 = find(contenders, "1u-allow", "genai_ratelimit check")
    rp1 = by_role(contenders, "1u-allow", REDISPY)
    rus = paired(sample_list(pkg1), sample_list(rp1), lambda a, b: a.cpu_us_per_call / b.cpu_us_per_call)
    if rus:
        cpu_detail.append(f"getrusage user+sys {med(rus):.2f}× (1 user allow-heavy)")
        if cpu_ok is None:
            cpu_ok = med(rus) <= TARGET_CPU
    targets.append(("client CPU per check ≤ 0.5× redis-py", cpu_ok,
                    "; ".join(cpu_detail) or cpu.get("error", "package not measured")))

    # ---- targets: check_windows vs check
    pw = find(contenders, "1ku-2win", "genai_ratelimit check_windows")
    pc = find(contenders, "1ku-allow", "genai_ratelimit check")
    if sample_list(pw) and sample_list(pc):
        cost = med(paired(sample_list(pw), sample_list(pc), lambda a, b: b.calls_per_s / a.calls_per_s))
        p50 = med(paired(sample_list(pw), sample_list(pc), lambda a, b: a.p50_us / b.p50_us))
        raw2, raw1 = by_role(contenders, "1ku-2win", RAW), by_role(contenders, "1ku-allow", RAW)
        floor = med(paired(sample_list(raw2), sample_list(raw1), lambda a, b: b.calls_per_s / a.calls_per_s))
        floor_p50 = med(paired(sample_list(raw2), sample_list(raw1), lambda a, b: a.p50_us / b.p50_us))
        floor_text = (f"; the raw C client's own 2-window/1-window cost in the same run: {floor:.2f}× "
                      f"(p50 {floor_p50:.2f}×), i.e. the server's extra Lua work for the second window"
                      if floor is not None else "")
        targets.append(("`check_windows` (minute+day) ≤ 1.15× one `check` (judged on p50 latency, the "
                        "per-call cost least disturbed by other work on the machine)", p50 <= TARGET_WINDOWS,
                        f"p50 {p50:.2f}×, time per call (1 / calls/s) {cost:.2f}× (1,000 users, allow-heavy)"
                        f"{floor_text}"))
    else:
        targets.append(("`check_windows` (minute+day) ≤ 1.15× one `check`", None, "package not measured"))

    # ---- server time section
    server = results.get("server")
    if server:
        r.add("## Server time per decision (`INFO commandstats`, usec_per_call of EVALSHA)")
        r.add()
        r.add(f"Same data for every script: each script has its own copy of the keys, pre-filled "
              f"identically where stated; {server['calls']:,} calls per script per round in batches of "
              f"128 that go to the scripts in turn (order rotating batch by batch), commandstats read "
              f"around every batch; {server['rounds']} rounds. A batch is sent pipelined; the server "
              f"runs its calls one by one. Ratios: median of per-round ratios to the original four-op "
              f"script and to the stricter four-op variant.")
        r.add()
        srows = []
        server_ok: bool | None = True
        details = []
        for title, per_script in server["results"].items():
            for name in server["names"]:
                values = per_script[name]
                vs_orig = round_ratios(values, per_script[sections.FOUR_OP])
                vs_strict = round_ratios(values, per_script[sections.STRICT])
                allowed, rejected = server["verdicts"][title][name]
                srows.append([title, name, spread(values, 2), ratio_str(vs_orig), ratio_str(vs_strict),
                              f"{allowed:,} / {rejected:,}"])
            ours = round_ratios(per_script[sections.OURS], per_script[sections.FOUR_OP])
            strict = round_ratios(per_script[sections.OURS], per_script[sections.STRICT])
            client = round_ratios(per_script[sections.OURS_CLIENT], per_script[sections.FOUR_OP])
            timed = round_ratios(per_script[sections.OURS], per_script[sections.FOUR_OP_TIME])
            floor = round_ratios(per_script[sections.OURS], per_script[sections.EMPTY])
            if ours:
                details.append(f"{title.split(' (')[0]}: {med(ours):.2f}× (client clock {med(client):.2f}×; "
                               f"vs the original + TIME {med(timed):.2f}×; "
                               f"vs an empty EVALSHA {med(floor):.1f}×; "
                               f"vs the stricter variant {med(strict):.2f}×)")
                server_ok = server_ok and med(ours) <= TARGET_SERVER
        r.table(["data", "script", "server µs/call", "vs original four-op", "vs add-on-allow four-op",
                 "allowed / rejected"], srows)
        targets.append(("server time per decision ≤ the original four-op script's (this package's "
                        "script, default server clock)", server_ok, "; ".join(details)))
    else:
        targets.append(("server time per decision ≤ the original four-op script's", None, "skipped"))

    # ---- memory
    memory = results.get("memory")
    if memory:
        r.add("## Memory per logged request (`MEMORY USAGE key SAMPLES 0` ÷ entries)")
        r.add()
        cfg = memory.get("config", {})
        r.add("Redis encoding thresholds: " + ", ".join(f"{k}={v}" for k, v in sorted(cfg.items())) + ".")
        r.add()
        mrows = []
        for row in memory["rows"]:
            pkg_cell = "–"
            if "pkg_bytes" in row:
                pkg_cell = (f"{row['pkg_per_entry']:.1f} ({row['pkg_bytes']:,} B, {row['pkg_encoding']}; "
                            f"members {','.join(map(str, row['pkg_member_lengths']))} chars, "
                            f"UUID v{','.join(map(str, row['pkg_member_uuid_versions']))})")
            mrows.append([f"{row['entries']:,}",
                          f"{row['uuid_per_entry']:.1f} ({row['uuid_bytes']:,} B, {row['uuid_encoding']})",
                          pkg_cell])
        r.table(["entries", "36-char UUID4 text members: B/entry (total, encoding)",
                 "written by this package's check: B/entry"], mrows)

    # ---- callgrind
    if cpu:
        r.add("## Client instructions per check (callgrind, user space)")
        r.add()
        if "error" in cpu:
            r.add(f"n/a: {cpu['error']}")
            r.add()
        else:
            r.add(f"Instructions in the client process per check: (I(2N) − I(N)) / N with "
                  f"N = {cpu['calls']:,}, 1,000 users allow-heavy; start-up, imports and set-up cancel out.")
            r.add()
            names = {"raw": "raw hiredis C", "pkg": "genai_ratelimit check",
                     "redispy": "redis-py register_script (hiredis parser)",
                     "redispy-pure": "redis-py register_script (pure-Python parser)",
                     "limits": "limits MovingWindowRateLimiter.hit"}
            base = per_check.get("redispy")
            crows = [[names.get(k, k), fmt(v, 0), f"{v / base:.3f}×" if base else "–"]
                     for k, v in per_check.items()]
            r.table(["client", "instructions/check", "vs redis-py"], crows)

    # ---- e2e
    e2e = results.get("e2e")
    if e2e:
        r.add("## End to end: examples/app.py under uvicorn, wrk on loopback")
        r.add()
        if "error" in e2e:
            r.add(e2e["error"])
            r.add()
            targets.append(("limited FastAPI route ≥ 0.8× the unlimited route's requests/s", None,
                            e2e["error"]))
        else:
            r.add(f"`POST /v1/chat/completions` (`\"stream\": false`), one uvicorn worker, wrk 1 thread × "
                  f"{e2e['connections']} connections × {e2e['duration']:g} s, "
                  f"{e2e['rounds']} rounds alternated. "
                  "The unlimited route is the same handler behind the same middlewares without "
                  "`Depends(rate_limit)` (benchmarks/e2e_app.py).")
            r.add()
            unlimited = e2e["variants"][0]
            erows = []
            for title in e2e["variants"]:
                rows_ = e2e["results"][title]
                ratios = [a["rps"] / b["rps"]
                          for a, b in zip(rows_, e2e["results"][unlimited], strict=False) if b["rps"]]
                non2xx = sum(x["non2xx"] for x in rows_)
                total = sum(x["requests"] for x in rows_)
                erows.append([title, e2e["statuses"].get(title, "?"),
                              spread([x["rps"] for x in rows_]), spread([x["p50_us"] for x in rows_]),
                              spread([x["p99_us"] for x in rows_]),
                              f"{non2xx / total:.0%}" if total else "–", ratio_str(ratios)])
            r.table(["route", "probe status", "requests/s", "p50 µs", "p99 µs", "non-2xx", "vs unlimited"],
                    erows)
            instructions = e2e.get("instructions")
            if instructions:
                if "error" in instructions:
                    r.add(f"Server instructions per request (callgrind): n/a: {instructions['error']}")
                    r.add()
                else:
                    per = instructions["per_request"]
                    base = per.get(unlimited)
                    r.add(f"The app's own CPU per request, free of the machine's noise: uvicorn under "
                          f"callgrind, {instructions['requests']} sequential keep-alive requests per route; "
                          f"all threads of the server process, user space only (kernel work such as "
                          f"the threadpool's wake-ups is not counted, so this is a lower bound).")
                    r.add()
                    r.table(["route", "server instructions/request", "vs unlimited"],
                            [[title, fmt(value, 0), f"{value / base:.2f}×" if base else "–"]
                             for title, value in per.items()])
            limited = e2e["variants"][1]
            ratios = [a["rps"] / b["rps"]
                      for a, b in zip(e2e["results"][limited], e2e["results"][unlimited], strict=False)
                      if b["rps"]]
            targets.append(("limited FastAPI route ≥ 0.8× the unlimited route's requests/s",
                            med(ratios) >= TARGET_E2E if ratios else None,
                            f"{med(ratios):.2f}× (allow-heavy)" if ratios else "no data"))
    else:
        targets.append(("limited FastAPI route ≥ 0.8× the unlimited route's requests/s", None, "skipped"))

    # ---- async targets (issue 5)
    async_detail = []
    async_ok: bool | None = None
    for c in contenders:
        if (c.workload.startswith("async-") and c.concurrency >= 64
                and c.name.startswith("genai_ratelimit AsyncRateLimiter")):
            base = by_role(contenders, c.workload, ASYNC_REDISPY)
            vs_rp = med(paired(sample_list(c), sample_list(base),
                               lambda a, b: a.calls_per_s / b.calls_per_s))
            vs_pipe = med(paired(sample_list(c), sample_list(pipe64),
                                 lambda a, b: a.calls_per_s / b.calls_per_s))
            if vs_rp is None:
                continue
            ok = vs_rp >= TARGET_ASYNC_VS_REDISPY and (vs_pipe is not None
                                                       and vs_pipe >= TARGET_ASYNC_VS_PIPE64)
            async_ok = ok if async_ok is None else async_ok and ok
            async_detail.append(f"@{c.concurrency}: {vs_rp:.2f}× redis.asyncio, "
                                + (f"{vs_pipe:.2f}× raw pipelined 64" if vs_pipe is not None
                                   else "raw pipelined 64 not measured"))

    r.add("## Targets (issue 4; issue 5's async targets last)")
    r.add()
    for title, ok, detail in targets:
        r.add(f"- {title}: **{_verdict(ok)}** — {detail}")
    r.add(f"- (issue 5) AsyncRateLimiter at 64+ in flight ≥ 3× redis.asyncio and ≥ 0.7× raw pipelined "
          f"depth 64: **{_verdict(async_ok)}** — "
          + ("; ".join(async_detail) if async_detail else "AsyncRateLimiter not measured in this run"))
    r.add()
    if skipped:
        r.add("## Not measured in this run")
        r.add()
        for key, reason in skipped.items():
            r.add(f"- {key.replace('|', ': ')} — {reason}")
        r.add()
    return r.text()


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def _row(c: Contender, workload_title: str, samples: dict[str, list[Sample]], skipped: dict[str, str],
         raw: Contender | None, redispy: Contender | None, with_p50_ratio: bool = True) -> list[str]:
    got = samples.get(c.key, [])
    if c.key in skipped or not got:
        reason = skipped.get(c.key, "no data")
        return [workload_title, c.name, f"n/a ({reason})", "", "", "", "", "", "", ""]
    depth = got[0].extra.get("depth", 1)
    if depth > 1:
        p50 = (f"{spread([s.p50_us for s in got])} / "
               f"{fmt(statistics.median(s.p50_us / depth for s in got), 1)}")
        p99 = (f"{spread([s.p99_us for s in got])} / "
               f"{fmt(statistics.median(s.p99_us / depth for s in got), 1)}")
    else:
        p50 = spread([s.p50_us for s in got])
        p99 = spread([s.p99_us for s in got])
    server = [s.server_us_per_call for s in got if s.server_us_per_call is not None]
    raw_s = samples.get(raw.key, []) if raw else []
    rp_s = samples.get(redispy.key, []) if redispy else []
    vs_raw = (ratio_str(paired(got, raw_s, lambda a, b: a.calls_per_s / b.calls_per_s))
              if raw and raw is not c else "")
    p50_raw = (ratio_str(paired(got, raw_s, lambda a, b: a.p50_us / b.p50_us))
               if raw and raw is not c and depth == 1 else "")
    vs_rp = (ratio_str(paired(got, rp_s, lambda a, b: a.calls_per_s / b.calls_per_s))
             if redispy and redispy is not c else "")
    name = c.name + (" **(baseline)**" if c.role else "")
    return [workload_title, name, spread([s.calls_per_s for s in got], 0), p50, p99,
            spread([s.cpu_us_per_call for s in got]), spread(server, 1), vs_raw,
            p50_raw if with_p50_ratio else "", vs_rp]


if __name__ == "__main__":
    sys.exit(main())
