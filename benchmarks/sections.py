"""The measurements that are not "calls per second of one contender": server time per decision
(INFO commandstats), memory per logged request (MEMORY USAGE), client instructions per check
(callgrind) and the end-to-end FastAPI run under wrk. Each returns plain rows for run.py's report.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from benchlib import (
    BENCH_DIR,
    EMPTY_SCRIPT,
    FOUR_OP_ADD_ON_ALLOW_SCRIPT,
    ORIGINAL_FOUR_OP_SCRIPT,
    RAW_BINARY,
    ROOT,
    SCRIPT_TEXT,
    RedisTarget,
    RespPipe,
    clean_keys,
    free_port,
    script_stats,
    write_built_script,
)

BIG = 10**9


# --------------------------------------------------------------------------- server time

SERVER_SCRIPTS = {
    # name: (script text, build KEYS + ARGV from (key, member, now_ms, window_ms, limit)).
    # This package's script takes each window's key, its weights' key and its running totals'
    # key (cost 1 here), exactly as RateLimiter.check sends them.
    "this package's script, server clock (default)": (
        SCRIPT_TEXT, lambda k, m, now, w, limit: (3, k, f"{k}:w", f"{k}:t", m, "", w, limit, 1)),
    "this package's script, client clock": (
        SCRIPT_TEXT, lambda k, m, now, w, limit: (3, k, f"{k}:w", f"{k}:t", m, now, w, limit, 1)),
    "original four-op script (the design: all four commands every call)": (
        ORIGINAL_FOUR_OP_SCRIPT, lambda k, m, now, w, limit: (1, k, now, w, limit, m)),
    "four-op, ZADD+EXPIRE only on allow (stricter reference)": (
        FOUR_OP_ADD_ON_ALLOW_SCRIPT, lambda k, m, now, w, limit: (1, k, now, w, limit, m)),
    # What reading the server's clock costs by itself: the original with TIME instead of ARGV time.
    "original four-op script + TIME (server clock; reference)": (
        ORIGINAL_FOUR_OP_SCRIPT.replace(
            "local now = tonumber(ARGV[1])",
            "local t = redis.call('TIME')\n"
            "local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)"),
        lambda k, m, now, w, limit: (1, k, now, w, limit, m)),
    # The floor of any script decision: an EVALSHA that does nothing (same key count as the
    # four-op scripts, so that only the script's own work differs).
    "empty script (EVALSHA floor)": (EMPTY_SCRIPT, lambda k, m, now, w, limit: (1, k)),
}
EMPTY = "empty script (EVALSHA floor)"
OURS = "this package's script, server clock (default)"
FOUR_OP = "original four-op script (the design: all four commands every call)"
STRICT = "four-op, ZADD+EXPIRE only on allow (stricter reference)"
OURS_CLIENT = "this package's script, client clock"
FOUR_OP_TIME = "original four-op script + TIME (server clock; reference)"


def server_time_section(target: RedisTarget, admin, quick: bool, rounds: int) -> dict[str, Any]:
    """usec_per_call of the script (INFO commandstats) for this package's script against the
    original four-op script, on the same data. Each script gets its own copy of the keys,
    pre-filled identically; then batches of 128 calls go to the scripts in turn (the order
    rotating batch by batch), with commandstats read around every batch, so that drift on a
    shared machine lands on every script alike. The calls of a batch are sent pipelined; the
    server runs them one by one all the same, and only the server's own time is counted."""
    pipe = RespPipe(target)
    names = list(SERVER_SCRIPTS)
    shas = {name: pipe.execute([["SCRIPT", "LOAD", text]])[0].decode()
            for name, (text, _) in SERVER_SCRIPTS.items()}
    calls = 1024 if quick else 8000
    batch_size = 128
    users_small = 200 if quick else 1000
    prefix = "gbench:srv"
    scenarios = [
        # (title, users, limit, window_s, prefill_live, prefill_expired)
        ("allow, 1 user (the set grows to N entries)", 1, BIG, 60, 0, 0),
        ("allow, 1,000 users (empty keys at start)", 1000, BIG, 60, 0, 0),
        (f"allow, {users_small:,} users, each with 50 expired + 50 live entries to trim/count",
         users_small, BIG, 60, 50, 50),
        (f"reject, {users_small:,} users with full windows (100 of limit 100)", users_small, 100, 60, 100, 0),
    ]
    results: dict[str, dict[str, list[float]]] = {s[0]: {n: [] for n in names} for s in scenarios}
    verdicts: dict[str, dict[str, list[int]]] = {s[0]: {n: [0, 0] for n in names} for s in scenarios}
    for _ in range(rounds):
        for title, users, limit, window, live, expired in scenarios:
            clean_keys(admin, [prefix], target.owned)
            keys = {name: [f"{prefix}:s{index}:user_{u}:{window}" for u in range(users)]
                    for index, name in enumerate(names)}
            now = int(time.time() * 1000)
            if live or expired:
                for name in names:
                    fill = []
                    for key in keys[name]:
                        command: list[Any] = ["ZADD", key]
                        for i in range(expired):
                            command += [now - window * 1000 - 1000 - i, str(uuid.uuid4())]
                        for i in range(live):
                            command += [now - 5000 + i, str(uuid.uuid4())]
                        fill.append(command)
                    for start in range(0, len(fill), 256):
                        pipe.execute(fill[start:start + 256])
            usec = {name: 0.0 for name in names}
            count = {name: 0 for name in names}
            for batch_index, start in enumerate(range(0, calls, batch_size)):
                shift = batch_index % len(names)
                order = names[shift:] + names[:shift]
                if batch_index % 2:
                    order.reverse()
                for name in order:
                    _, argv = SERVER_SCRIPTS[name]
                    now = int(time.time() * 1000)
                    payload = pipe.encode([
                        ["EVALSHA", shas[name],
                         *argv(keys[name][i % users], str(uuid.uuid4()), now, window * 1000, limit)]
                        for i in range(start, min(calls, start + batch_size))])
                    n = min(calls, start + batch_size) - start
                    before = script_stats(admin)
                    replies = pipe.execute_encoded(payload, n)
                    after = script_stats(admin)
                    usec[name] += after[1] - before[1]
                    count[name] += after[0] - before[0]
                    for reply in replies:
                        verdicts[title][name][0 if reply[0] else 1] += 1
            for name in names:
                results[title][name].append(usec[name] / count[name] if count[name] else float("nan"))
    clean_keys(admin, [prefix], target.owned)
    pipe.close()
    return {"calls": calls, "rounds": rounds, "names": names, "results": results, "verdicts": verdicts}


# --------------------------------------------------------------------------- memory

MEMORY_SIZES = (10, 128, 129, 1000, 100000)


def memory_section(target: RedisTarget, admin, quick: bool, package_ok: bool) -> dict[str, Any]:
    """Bytes per logged request: MEMORY USAGE key SAMPLES 0 divided by the entries, for sorted
    sets of 36-char UUID4 text members with ms scores (written directly with ZADD), and for the
    keys this package itself writes (N allowed checks on one user)."""
    import redis
    client = redis.Redis(**target.redis_kwargs())
    encoding_limits = admin.config_get("zset-max-*")
    rows = []
    prefix = "gbench:mem"
    limiter = None
    if package_ok:
        from genai_ratelimit import RateLimiter
        limiter = RateLimiter(target.url, key_prefix=f"{prefix}:pkg")
    for n in MEMORY_SIZES:
        clean_keys(admin, [prefix], target.owned)
        key = f"{prefix}:uuid:{n}"
        now = int(time.time() * 1000)
        pipe = client.pipeline(transaction=False)
        batch: dict[str, int] = {}
        for i in range(n):
            batch[str(uuid.uuid4())] = now - n + i
            if len(batch) == 1000:
                pipe.zadd(key, batch)
                batch = {}
        if batch:
            pipe.zadd(key, batch)
        pipe.execute()
        usage = admin.memory_usage(key, samples=0)
        row = {"entries": n, "uuid_bytes": usage, "uuid_per_entry": usage / n,
               "uuid_encoding": admin.object("encoding", key)}
        if limiter is not None and (n <= 1000 or not quick):
            user = f"mem{n}"
            for _ in range(n):
                allowed = limiter.check(user, BIG, 86400)[0]
                if not allowed:
                    raise RuntimeError("memory section: a check was rejected under a 1e9 limit")
            pkg_key = f"{prefix}:pkg:{user}:86400"
            count = admin.zcard(pkg_key)
            pkg_usage = admin.memory_usage(pkg_key, samples=0)
            members = admin.zrange(pkg_key, 0, 2)
            lengths = sorted({len(m) for m in members})
            versions = sorted({_uuid_version(m) for m in members})
            row.update(pkg_entries=count, pkg_bytes=pkg_usage, pkg_per_entry=pkg_usage / count,
                       pkg_encoding=admin.object("encoding", pkg_key),
                       pkg_member_lengths=lengths, pkg_member_uuid_versions=versions)
        rows.append(row)
    clean_keys(admin, [prefix], target.owned)
    if limiter is not None:
        limiter.close()
    client.close()
    return {"rows": rows, "config": encoding_limits}


def _uuid_version(text: str) -> int | None:
    try:
        return uuid.UUID(text).version
    except ValueError:
        return None


# --------------------------------------------------------------------------- client CPU

class Callgrind:
    """Instructions per check in the client process, under callgrind (user-space only, which is
    what makes it stable on a noisy VM). Python implementations: one valgrind process, counters
    dumped around N and 2N checks (see cpu_probe.py). Raw C: two runs, N and 2N calls.
    Instruction counts do not depend on timing, so the quick run lets this work overlap the
    server-time and memory sections (start() ... finish())."""

    def __init__(self, target: RedisTarget, quick: bool, package_ok: bool) -> None:
        self.target = target
        self.quick = quick
        self.calls = 100 if quick else 1000
        self.impls = ((["pkg"] if package_ok else []) + ["redispy"]
                      + ([] if quick else ["redispy-pure", "limits"]))
        self.error: str | None = None
        self.proc: subprocess.Popen | None = None
        self.tmp = tempfile.TemporaryDirectory(prefix="gbench-cg-")
        if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
            self.error = "valgrind not installed (apt-get install valgrind)"

    def start(self) -> Callgrind:
        if self.error:
            return self
        tmp = self.tmp.name
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out",
               sys.executable, str(BENCH_DIR / "cpu_probe.py"), "--url", self.target.url,
               "--calls", str(self.calls), "--warmup", "20" if self.quick else "100", *self.impls]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=self.target.raw_env())
        return self

    def finish(self) -> dict[str, Any]:
        try:
            return self._finish()
        finally:
            self.tmp.cleanup()

    def _finish(self) -> dict[str, Any]:
        if self.error:
            return {"error": self.error}
        assert self.proc is not None
        tmp = Path(self.tmp.name)
        try:
            stdout, stderr = self.proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return {"error": "cpu_probe under callgrind took more than 15 minutes"}
        if self.proc.returncode != 0:
            return {"error": f"cpu_probe under callgrind failed: {stderr[-2000:]}"}
        calls = self.calls
        out: dict[str, Any] = {"calls": calls, "per_check": {}}
        for line in stdout.splitlines():
            impl, first, second = line.split()
            i1 = _callgrind_total(tmp / f"cg.out.{first}")
            i2 = _callgrind_total(tmp / f"cg.out.{second}")
            out["per_check"][impl] = (i2 - i1) / calls
        totals = []
        for n in (calls, 2 * calls):
            proc = subprocess.run(
                ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/raw.{n}", str(RAW_BINARY),
                 "--script", str(write_built_script()), *self.target.raw_args(), "--prefix", "gbench:cpu:raw",
                 "--users", "1000", "--window", f"60:{BIG}", "--calls", str(n), "--warmup", "100",
                 "--duration", "600"],
                capture_output=True, text=True, timeout=600, env=self.target.raw_env())
            if proc.returncode != 0:
                return {"error": f"raw_hiredis under callgrind failed: {proc.stderr[-2000:]}"}
            totals.append(_callgrind_total(tmp / f"raw.{n}"))
        out["per_check"]["raw"] = (totals[1] - totals[0]) / calls
        return out


def _callgrind_total(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("totals:") or line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


# --------------------------------------------------------------------------- end to end

WRK_SCRIPT = """\
wrk.method = "POST"
wrk.body = '{"model": "demo-1", "messages": [{"role": "user", "content": "hello"}], "stream": false}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %s"
"""


def e2e_section(target: RedisTarget, admin, quick: bool, rounds: int, duration: float) -> dict[str, Any]:
    """examples/app.py under uvicorn (one worker), driven by wrk on loopback: the rate-limited
    POST /v1/chat/completions against the same handler without the limiter. With a tiers file
    of huge budgets the limited route allows everything (its full cost); a reject-heavy variant
    (free tier, 5/min) is measured in the full run."""
    if not (ROOT / "examples" / "app.py").exists():
        return {"error": "n/a: examples/app.py does not exist yet"}
    if shutil.which("wrk") is None:
        return {"error": "n/a: wrk is not installed (apt-get install wrk)"}
    try:
        import uvicorn  # noqa: F401

        import genai_ratelimit  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return {"error": f"n/a: {type(exc).__name__}: {exc}"}
    connections = 16
    tmp = Path(tempfile.mkdtemp(prefix="gbench-e2e-"))
    tiers = tmp / "tiers.json"
    tiers.write_text(json.dumps({t: {"per_minute": BIG, "per_day": BIG}
                                 for t in ("free", "pro", "enterprise")}))
    variants = [
        ("unlimited route (same handler, no limiter)", "/bench/unlimited/v1/chat/completions", "big",
         "sk-demo-enterprise"),
        ("limited route, allow-heavy (budgets 1e9)", "/v1/chat/completions", "big", "sk-demo-enterprise"),
    ]
    if not quick:
        variants.append(("reference: same handler behind a no-op plain-`def` dependency "
                         "(threadpool hop only)",
                         "/bench/noop-sync-dependency/v1/chat/completions", "big", "sk-demo-enterprise"))
    import genai_ratelimit
    if hasattr(genai_ratelimit, "AsyncRateLimiter"):
        variants.append(("bench route: same handler, `RateLimit(limiter=AsyncRateLimiter())`, allow-heavy",
                         "/bench/async/v1/chat/completions", "big", "sk-demo-enterprise"))
    if not quick:
        variants.append(("limited route, reject-heavy (free tier 5/min: 429s)", "/v1/chat/completions",
                         "default", "sk-demo-free"))
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    results: dict[str, list[dict[str, float]]] = {v[0]: [] for v in variants}
    statuses: dict[str, str] = {}
    try:
        for budget in sorted({v[2] for v in variants}):
            port = free_port()
            env = dict(os.environ, REDIS_URL=target.url, EXAMPLE_KEY_PREFIX=f"gbench:e2e:{budget}",
                       PYTHONPATH=str(BENCH_DIR))
            env.pop("RATE_LIMIT_DISABLED", None)
            if budget == "big":
                env["GENAI_RATELIMIT_TIERS"] = str(tiers)
            else:
                env.pop("GENAI_RATELIMIT_TIERS", None)
            log = open(tmp / f"uvicorn-{budget}.log", "wb")
            proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "e2e_app:app", "--app-dir", str(BENCH_DIR),
                 "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log"],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(BENCH_DIR))
            servers[budget] = (proc, port)
            if not _wait_http(f"http://127.0.0.1:{port}/healthz", proc, 20):
                log_tail = (tmp / f"uvicorn-{budget}.log").read_text()[-2000:]
                return {"error": "uvicorn did not start: " + log_tail}
        for title, path, budget, key in variants:
            _, port = servers[budget]
            statuses[title] = _probe_status(f"http://127.0.0.1:{port}{path}", key)
        for round_index in range(rounds):
            order = variants if round_index % 2 == 0 else variants[::-1]
            for title, path, budget, key in order:
                if title.startswith("limited"):
                    clean_keys(admin, [f"gbench:e2e:{budget}"], target.owned)
                _, port = servers[budget]
                script = tmp / f"post-{key}.lua"
                script.write_text(WRK_SCRIPT % key)
                results[title].append(_wrk(f"http://127.0.0.1:{port}{path}", script, connections, duration))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    instructions = None
    if not quick:
        instructions = e2e_instructions(target, admin, [(title, path, key)
                                                        for title, path, budget, key in variants
                                                        if budget == "big"])
    return {"results": results, "statuses": statuses, "connections": connections,
            "duration": duration, "rounds": rounds, "variants": [v[0] for v in variants],
            "instructions": instructions}


def e2e_instructions(target: RedisTarget, admin, paths: list[tuple[str, str, str]],
                     requests: int = 100) -> dict[str, Any]:
    """The app's own CPU per request, free of the machine's noise: uvicorn runs under callgrind,
    one keep-alive client here sends `requests` POSTs per route (after a warm-up), and the
    counters are dumped around each route's requests (all threads of the server process: the
    event loop and FastAPI's threadpool). Kernel time (syscalls, context switches, the
    threadpool's wake-ups) is not counted, so this is a lower bound of what each route costs.
    paths: (title, path, api key). Full run only (about a minute)."""
    import http.client
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        return {"error": "valgrind not installed"}
    tmp = Path(tempfile.mkdtemp(prefix="gbench-e2e-cg-"))
    tiers = tmp / "tiers.json"
    tiers.write_text(json.dumps({t: {"per_minute": BIG, "per_day": BIG}
                                 for t in ("free", "pro", "enterprise")}))
    port = free_port()
    env = dict(os.environ, REDIS_URL=target.url, EXAMPLE_KEY_PREFIX="gbench:e2e:cg",
               GENAI_RATELIMIT_TIERS=str(tiers))
    env.pop("RATE_LIMIT_DISABLED", None)
    log = open(tmp / "uvicorn.log", "wb")
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out", sys.executable, "-m",
         "uvicorn", "e2e_app:app", "--app-dir", str(BENCH_DIR), "--host", "127.0.0.1", "--port",
         str(port), "--log-level", "warning", "--no-access-log"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(BENCH_DIR))
    body = json.dumps({"model": "demo-1", "messages": [{"role": "user", "content": "hello"}],
                       "stream": False})
    out: dict[str, Any] = {"requests": requests, "per_request": {}}
    try:
        if not _wait_http(f"http://127.0.0.1:{port}/healthz", proc, 180):
            log_tail = (tmp / "uvicorn.log").read_text()[-1000:]
            return {"error": "uvicorn under callgrind did not start: " + log_tail}
        dumps = 0

        def dump() -> None:
            nonlocal dumps
            subprocess.run(["callgrind_control", "--dump", str(proc.pid)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
            dumps += 1

        def send(connection: http.client.HTTPConnection, path: str, headers: dict[str, str], n: int) -> None:
            for _ in range(n):
                connection.request("POST", path, body=body, headers=headers)
                response = connection.getresponse()
                response.read()
                if response.status != 200:
                    raise RuntimeError(f"{path} answered {response.status}")

        segments: dict[str, int] = {}
        for title, path, key in paths:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
            send(connection, path, headers, 20)
            dump()
            send(connection, path, headers, requests)
            dump()
            segments[title] = dumps
            connection.close()
        for title, index in segments.items():
            out["per_request"][title] = _callgrind_total(tmp / f"cg.out.{index}") / requests
        return out
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        clean_keys(admin, ["gbench:e2e:cg"], target.owned)
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_http(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.05)  # polling for readiness until 200 or the deadline
    return False


def _probe_status(url: str, key: str) -> str:
    body = json.dumps({"model": "demo-1", "messages": [{"role": "user", "content": "hello"}],
                       "stream": False}).encode()
    request = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return str(response.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except OSError as exc:
        return f"error: {exc}"


_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6}


def _wrk(url: str, script: Path, connections: int, duration: float) -> dict[str, float]:
    proc = subprocess.run(["wrk", "-t", "1", "-c", str(connections), "-d", f"{max(1, round(duration))}s",
                           "--latency", "-s", str(script), url],
                          capture_output=True, text=True, timeout=duration + 60)
    text = proc.stdout
    if proc.returncode != 0 or "Requests/sec" not in text:
        raise RuntimeError(f"wrk failed: {proc.stderr or text}")
    result: dict[str, float] = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))}
    for label, key in (("50%", "p50_us"), ("99%", "p99_us")):
        match = re.search(rf"^\s+{re.escape(label)}\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
        result[key] = float(match.group(1)) * _UNITS[match.group(2)] if match else float("nan")
    total = re.search(r"(\d+) requests in", text)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors = re.search(r"Socket errors: (.*)", text)
    result["requests"] = float(total.group(1)) if total else 0.0
    result["non2xx"] = float(non2xx.group(1)) if non2xx else 0.0
    result["socket_errors"] = errors.group(1) if errors else ""
    return result


def median_of(rows: list[dict[str, float]], key: str) -> tuple[float, float, float]:
    values = [r[key] for r in rows]
    return statistics.median(values), min(values), max(values)
