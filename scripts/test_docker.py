"""`make test-docker`: Redis in Docker for real, and the example image built and run.

1. Starts a Docker engine of its own (Debian's docker.io): `dockerd --bridge=none
   --iptables=false --storage-driver=overlay2` (vfs when overlay2 fails), its socket, data
   and state in directories of this run, so it meets no other engine of the machine. No
   bridge and no NAT: containers use `--network host` and listen on free 127.0.0.1 ports.
   Stopped by its pid at the end, however the run ends.
2. Builds a Redis image here (no registry is reachable): `docker import` of a directory that
   holds redis-server, redis-cli and the libraries `ldd` names for them.
3. Runs that image (`--network host`, a free port, an unprivileged user), checks that the
   server answering REDIS_URL is the container's (its run_id, read from inside by `docker
   exec redis-cli` and from here), and runs the suite's core and FastAPI files with REDIS_URL
   pointing at it.
4. Builds a local stand-in for python:3.11-slim from the Debian 12 root of
   scripts/debian-root.sh (`docker import`, then a venv of Debian's python3 first on PATH and
   pip reading the wheelhouse of `make test-wheel`: the build needs no network), builds
   examples/Dockerfile with `docker build --build-arg PYTHON_IMAGE=<that image>` from the
   repository's root (its .dockerignore sends the wheel and the two example files only), and
   runs the app container beside the Redis container with the image's own CMD (its --host and
   --port moved to 127.0.0.1 and a free port: the network is the host's). A burst of six
   requests over HTTP must get five 200s and then a 429 with Retry-After.

    python scripts/test_docker.py --pytest .venv/bin/pytest --debian-root build/debian-root \
        --wheelhouse build/wheelhouse --state build/docker -- tests/test_limiter_core.py ...

Every step's time is printed, and a table at the end."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Debian's client, of the engine's own release (another docker may come first on PATH).
DOCKER = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else "docker"
REDIS_IMAGE = "genai-ratelimit-redis:local"
DEBIAN_IMAGE = "genai-ratelimit-debian:bookworm"
PYTHON_IMAGE = "genai-ratelimit-python:3.11-local"
APP_IMAGE = "genai-ratelimit-example:local"
# The stand-in for python:3.11-slim: what the example Dockerfile expects of its base (python
# and pip on PATH, groupadd/useradd), with pip reading the wheelhouse instead of PyPI.
PYTHON_DOCKERFILE = f"""\
FROM {DEBIAN_IMAGE}
RUN python3 -m venv /opt/python
COPY wheelhouse/ /wheelhouse/
ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse PIP_DISABLE_PIP_VERSION_CHECK=1 LANG=C.UTF-8
"""

timings: list[tuple[str, float]] = []


@contextmanager
def step(title: str) -> Iterator[None]:
    print(f"\n=== test-docker: {title}", flush=True)
    started = time.monotonic()
    try:
        yield
    finally:
        seconds = time.monotonic() - started
        timings.append((title, seconds))
        print(f"=== test-docker: {title}: {seconds:.1f} s", flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Engine:
    """A dockerd of this run: its own socket, data root and exec root."""

    def __init__(self, state: Path, storage_driver: str) -> None:
        self.state = state
        self.storage_driver = storage_driver
        # A unix socket path must stay under 108 bytes: a short directory in /tmp.
        self.sockets = Path(tempfile.mkdtemp(prefix="genai-docker-"))
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.sockets}/docker.sock"}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Starts dockerd with the first storage driver of the list that works."""
        self.clear_state()  # images of an earlier run: none kept
        for driver in self.storage_driver.split(","):
            self.state.mkdir(parents=True, exist_ok=True)
            log = (self.state / "dockerd.log").open("wb")
            self.process = subprocess.Popen(
                ["dockerd", "--bridge=none", "--iptables=false", "--ip6tables=false",
                 f"--storage-driver={driver}", "--data-root", str(self.state / "data"),
                 "--exec-root", str(self.sockets / "exec"), "--pidfile", str(self.sockets / "dockerd.pid"),
                 "--host", self.env["DOCKER_HOST"]],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + 60
            while self.docker("version", "--format", "{{.Server.Version}}", check=False).returncode != 0:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.2)  # polling the engine's socket until it answers, up to the deadline
            else:
                print(f"dockerd (pid {self.process.pid}) with --storage-driver={driver}")
                break
            print(f"dockerd did not start with --storage-driver={driver}:\n"
                  + (self.state / "dockerd.log").read_text()[-2000:])
            self.stop()
            self.clear_state()
        else:
            raise RuntimeError(f"dockerd started with none of the storage drivers {self.storage_driver}")
        print("engine:", self.docker("version", "--format",
                                     "client {{.Client.Version}}, server {{.Server.Version}}").stdout.strip())

    def stop(self) -> None:
        """SIGTERM to our dockerd's pid (it stops its containerd), SIGKILL after 30 s."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
            print(f"dockerd (pid {self.process.pid}) stopped, exit {self.process.returncode}")
        # dockerd leaves its default network namespace's bind mount in the exec root.
        for mount in self.mounts_under(self.sockets) + self.mounts_under(self.state):
            subprocess.run(["umount", "-l", mount], check=False)
        shutil.rmtree(self.sockets / "exec", ignore_errors=True)

    def clear_state(self) -> None:
        for mount in self.mounts_under(self.state):  # a run killed before its end
            subprocess.run(["umount", "-l", mount], check=False)
        shutil.rmtree(self.state, ignore_errors=True)

    @staticmethod
    def mounts_under(directory: Path) -> list[str]:
        """Mount points at or under `directory`, deepest first."""
        prefix = os.path.realpath(directory)
        with open("/proc/self/mountinfo") as mountinfo:
            points = [line.split()[4] for line in mountinfo]
        return sorted((p for p in points if p == prefix or p.startswith(prefix + "/")), reverse=True)

    def docker(self, *args: str, check: bool = True,
               input: bytes | None = None) -> subprocess.CompletedProcess[str]:
        """Runs the docker client on this engine; its output decoded (errors replaced)."""
        result = subprocess.run([DOCKER, *args], env=self.env, input=input, capture_output=True)
        done = subprocess.CompletedProcess(result.args, result.returncode,
                                           result.stdout.decode(errors="replace"),
                                           result.stderr.decode(errors="replace"))
        if check and done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed ({done.returncode}):\n"
                               f"{done.stdout}{done.stderr}")
        return done


def import_directory(engine: Engine, directory: Path, image: str) -> None:
    tar = subprocess.run(["tar", "-C", str(directory), "--numeric-owner", "-c", "."],
                         capture_output=True, check=True)
    engine.docker("import", "-", image, input=tar.stdout)


def redis_image(engine: Engine, work: Path) -> None:
    """redis-server and redis-cli, with every library ldd names (and the loader), imported."""
    root = work / "redis-root"
    shutil.rmtree(root, ignore_errors=True)
    for binary in ("redis-server", "redis-cli"):
        path = shutil.which(binary)
        if path is None:
            raise RuntimeError(f"{binary} is not installed (make test installs redis-server)")
        path = os.path.realpath(path)
        files = [path] + [word for word in subprocess.run(["ldd", path], capture_output=True, text=True,
                                                          check=True).stdout.split()
                          if word.startswith("/")]
        for source in files:
            target = root / ("usr/bin/" + binary if source == path else source.lstrip("/"))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(source), target)
    (root / "tmp").mkdir(mode=0o1777)
    (root / "tmp").chmod(0o1777)
    import_directory(engine, root, REDIS_IMAGE)
    print(f"{REDIS_IMAGE}: {sorted(str(p.relative_to(root)) for p in root.rglob('*') if p.is_file())}")


def wait_for(what: str, probe: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if probe():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer within {seconds} s")
        time.sleep(0.1)  # readiness polling, up to the deadline


def redis_command(port: int, *words: str) -> bytes:
    """One RESP command on a new connection: a status reply's line, or a bulk reply's body."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        payload = f"*{len(words)}\r\n" + "".join(f"${len(w)}\r\n{w}\r\n" for w in words)
        connection.sendall(payload.encode())
        reply = b""
        while b"\r\n" not in reply:
            chunk = connection.recv(65536)
            if not chunk:
                raise OSError("the connection closed mid-reply")
            reply += chunk
        head, _, rest = reply.partition(b"\r\n")
        if not head.startswith(b"$"):
            return head + b"\r\n"
        length = int(head[1:])
        while len(rest) < length + 2:
            chunk = connection.recv(65536)
            if not chunk:
                raise OSError("the connection closed mid-reply")
            rest += chunk
        return rest[:length]


def run_id_of(info: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("run_id:"))


def start_redis(engine: Engine, port: int) -> str:
    name = f"genai-redis-{uuid.uuid4().hex[:8]}"
    engine.docker("run", "-d", "--name", name, "--network", "host", "--user", "65534:65534",
                  REDIS_IMAGE, "/usr/bin/redis-server", "--bind", "127.0.0.1", "--port", str(port),
                  "--save", "", "--appendonly", "no", "--dir", "/tmp",
                  "--maxmemory-policy", "noeviction")
    wait_for("Redis in the container", lambda: redis_command(port, "PING") == b"+PONG\r\n", 30)
    inside = engine.docker("exec", name, "/usr/bin/redis-cli", "-p", str(port), "info", "server").stdout
    outside = redis_command(port, "INFO", "server").decode()
    assert run_id_of(inside) == run_id_of(outside), "the server on the port is not the container's"
    print(f"Redis in container {name} on 127.0.0.1:{port}, run_id {run_id_of(inside)} "
          "(the same from inside the container and from here)")
    return name


def http(method: str, url: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str]]:
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}


def build_app_image(engine: Engine, debian_root: Path, wheelhouse: Path, work: Path) -> None:
    import_directory(engine, debian_root, DEBIAN_IMAGE)
    context = work / "python-image"
    shutil.rmtree(context, ignore_errors=True)
    context.mkdir(parents=True)
    shutil.copytree(wheelhouse, context / "wheelhouse")
    (context / "Dockerfile").write_text(PYTHON_DOCKERFILE)
    engine.docker("build", "-q", "-t", PYTHON_IMAGE, str(context))
    # examples/Dockerfile from the repository's root, as its header and compose.yaml say.
    built = engine.docker("build", "--progress=plain", "-f", "examples/Dockerfile",
                          "--build-arg", f"PYTHON_IMAGE={PYTHON_IMAGE}", "-t", APP_IMAGE, str(ROOT),
                          check=False)
    print(built.stdout + built.stderr)
    if built.returncode != 0:
        raise RuntimeError("docker build of examples/Dockerfile failed")


def run_app(engine: Engine, redis_port: int) -> list[tuple[int, str | None, str | None]]:
    config = json.loads(engine.docker("image", "inspect", "--format", "{{json .Config}}", APP_IMAGE).stdout)
    command = list(config["Cmd"])
    assert command[:1] == ["uvicorn"] and config["User"] == "10001:10001", config
    port = free_port()
    command[command.index("--host") + 1] = "127.0.0.1"
    command[command.index("--port") + 1] = str(port)
    name = f"genai-app-{uuid.uuid4().hex[:8]}"
    engine.docker("run", "-d", "--name", name, "--network", "host",
                  "-e", f"REDIS_URL=redis://127.0.0.1:{redis_port}/0",
                  "-e", f"EXAMPLE_KEY_PREFIX=docker-{uuid.uuid4().hex}", APP_IMAGE, *command)
    print(f"app container {name}: {' '.join(command)} (user {config['User']})")
    try:
        wait_for("the app container", lambda: http("GET", f"http://127.0.0.1:{port}/healthz")[0] == 200, 60)
    except RuntimeError:
        print(engine.docker("logs", name, check=False).stderr)
        raise
    rows = []
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": False}).encode()
    for _ in range(6):
        status, headers = http("POST", f"http://127.0.0.1:{port}/v1/chat/completions", body,
                               {"Authorization": "Bearer sk-demo-free", "Content-Type": "application/json"})
        rows.append((status, headers.get("x-ratelimit-remaining"), headers.get("retry-after")))
    logs = engine.docker("logs", name, check=False)
    print("app container's log:\n" + logs.stdout + logs.stderr)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pytest", required=True, help="the pytest of the venv that runs the suite")
    parser.add_argument("--debian-root", required=True, type=Path)
    parser.add_argument("--wheelhouse", required=True, type=Path)
    parser.add_argument("--state", required=True, type=Path, help="the engine's data (deleted first)")
    parser.add_argument("--storage-driver", default="overlay2,vfs",
                        help="dockerd's, the first of the list that starts: overlay2 (layers "
                             "shared), else vfs (every layer copied whole: 5x slower here)")
    parser.add_argument("tests", nargs="+", help="pytest arguments: the files run against Redis in Docker")
    options = parser.parse_args()
    wheels = list((ROOT / "dist").glob("genai_ratelimit-*-cp310-abi3-manylinux_*_x86_64.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one x86-64 wheel in dist/ (make wheel): {wheels}")

    engine = Engine(options.state.resolve(), options.storage_driver)
    status = 0
    try:
        with step("start dockerd"):
            engine.start()
        with step("build the Redis image (docker import)"):
            redis_image(engine, options.state)
        redis_port = free_port()
        with step("start the Redis container"):
            start_redis(engine, redis_port)
        with step("the suite's files against Redis in Docker"):
            env = {**os.environ, "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"}
            print(f"REDIS_URL={env['REDIS_URL']} {options.pytest} {' '.join(options.tests)}", flush=True)
            suite = subprocess.run([options.pytest, "-p", "no:cacheprovider", *options.tests],
                                   env=env, cwd=ROOT)
            if suite.returncode != 0:
                status = 1
        with step("build examples/Dockerfile (base image from the Debian root)"):
            build_app_image(engine, options.debian_root.resolve(), options.wheelhouse.resolve(),
                            options.state)
        with step("run the app container and a burst over HTTP"):
            rows = run_app(engine, redis_port)
        print("(status, X-RateLimit-Remaining, Retry-After) per request:")
        for row in rows:
            print("   ", row)
        expected = [(200, str(left), None) for left in (4, 3, 2, 1, 0)] + [(429, "0", "60")]
        if rows != expected:
            print(f"error: the burst answered {rows}, expected {expected}")
            status = 1
        else:
            print(f"the 6th request: HTTP {rows[5][0]}, Retry-After: {rows[5][2]} "
                  "(the app in Docker, limited by Redis in Docker)")
    except (RuntimeError, AssertionError) as error:
        print(f"error: {error}")
        status = 1
    finally:
        with step("stop the containers and dockerd"):
            if engine.process is not None and engine.process.poll() is None:
                running = engine.docker("ps", "-aq", check=False).stdout.split()
                if running:
                    engine.docker("rm", "-f", *running, check=False)
            engine.stop()
            engine.clear_state()  # GBs under vfs: not left to the next run
            shutil.rmtree(engine.sockets, ignore_errors=True)
    print("\n=== test-docker: steps")
    for title, seconds in timings:
        print(f"{seconds:7.1f} s  {title}")
    print(f"{sum(s for _, s in timings):7.1f} s  in all; {'ok' if status == 0 else 'FAILED'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
