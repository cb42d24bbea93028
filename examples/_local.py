"""What `make demo` and `make serve` start on this machine: a throwaway redis-server on a free
loopback port, and the example app under uvicorn in a subprocess. Small copies of the test
suite's helpers (examples never import from tests/)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

EXAMPLES = Path(__file__).resolve().parent


def free_port() -> int:
    """A loopback TCP port that nothing listened on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class LocalRedis:
    """A redis-server with no persistence in a temporary directory, removed on exit."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed: run `make demo` (it installs it), "
                             "apt-get install redis-server, or set REDIS_URL")
        self.binary = binary
        self.directory = Path(tempfile.mkdtemp(prefix="genai-ratelimit-demo-redis-"))
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        for _ in range(5):  # another process may take the free port before redis binds it
            self.port = free_port()
            self.process = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.directory),
                 "--logfile", str(self.directory / "redis.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready(timeout):
                return
            self.stop()
        log = self.directory / "redis.log"
        raise SystemExit("redis-server did not start: "
                         + (log.read_text()[-2000:] if log.exists() else "no log"))

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.02)  # readiness polling until PONG or the deadline
        return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def __enter__(self) -> LocalRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class AppServer:
    """examples/app.py under uvicorn in a subprocess on a free loopback port."""

    def __init__(self, env: dict[str, str], unset: tuple[str, ...] = ()) -> None:
        self.env = {name: value for name, value in {**os.environ, **env}.items() if name not in unset}
        self.directory = Path(tempfile.mkdtemp(prefix="genai-ratelimit-demo-app-"))
        self.log_path = self.directory / "uvicorn.log"
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        for _ in range(5):  # another process may take the free port before uvicorn binds it
            self.port = free_port()
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "uvicorn", "app:app", "--app-dir", str(EXAMPLES),
                     "--host", "127.0.0.1", "--port", str(self.port),
                     # request.client is the TCP peer: no X-Forwarded-For from untrusted clients
                     "--no-proxy-headers", "--no-access-log", "--log-level", "warning"],
                    cwd=self.directory, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            if self._wait_ready(timeout):
                return
            self.stop()
            if "address already in use" not in self.log().lower():
                break
        raise SystemExit(f"the example app did not start:\n{self.log()[-3000:]}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            try:
                if httpx.get(self.base_url + "/healthz", timeout=1.0).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.05)  # readiness polling until /healthz answers or the deadline
        return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def __enter__(self) -> AppServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
