"""A uvicorn server in a subprocess for the real-HTTP tests: an app module written from
source into a temporary directory (so the installed package is imported, not the source
tree), served on a free loopback port or a unix socket, with one or several workers, started
until its readiness path answers, stopped, or killed with SIGKILL. test_fastapi_server.py's
UvicornApp (examples/app.py) builds on it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from redis_server import free_port

# httpx's transport, talking to a real uvicorn, sometimes leaves the socket of a connection
# the server ended (a stream cut, a worker's keep-alive timeout) to the garbage collector,
# which warns (ResourceWarning) in whatever test runs then. The files whose requests go to
# uvicorn over sockets carry this mark; everything else keeps ResourceWarning as an error.
HTTPX_SOCKETS = pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning")


class UvicornServer:
    """`python -m uvicorn <module>:app` for the module whose source is given. With `uds`, it
    serves on that unix socket instead of a loopback port (a relative path is taken inside
    the server's temporary directory); client() then talks over it."""

    def __init__(self, source: str, env: dict[str, str], *, workers: int = 1,
                 loop: str | None = None, ready_path: str = "/healthz",
                 uds: str | None = None) -> None:
        self.env = {**os.environ, **env}
        self.workers = workers
        self.loop = loop
        self.ready_path = ready_path
        self.directory = Path(tempfile.mkdtemp(prefix="genai-ratelimit-uvicorn-"))
        (self.directory / "served_app.py").write_text(source, encoding="utf-8")
        self.log_path = self.directory / "uvicorn.log"
        self.uds = str(self.directory / uds) if uds is not None else None
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        if self.uds is not None:
            return "http://localhost"  # over the unix socket: only the Host header shows it
        return f"http://127.0.0.1:{self.port}"

    def client(self, **options: Any) -> httpx.Client:
        """An httpx client of the server, its base_url set (over the unix socket with `uds`)."""
        transport = httpx.HTTPTransport(uds=self.uds) if self.uds is not None else None
        return httpx.Client(base_url=self.base_url, transport=transport, **options)

    def spawn(self) -> subprocess.Popen[bytes]:
        if self.uds is None:
            self.port = free_port()
            address = ["--host", "127.0.0.1", "--port", str(self.port)]
        else:
            address = ["--uds", self.uds]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "served_app:app", "--app-dir", str(self.directory),
                 *address, "--no-proxy-headers", "--no-access-log", "--log-level", "warning",
                 *(["--workers", str(self.workers)] if self.workers > 1 else []),
                 *(["--loop", self.loop] if self.loop else [])],
                cwd=self.directory, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self.process

    def start(self, timeout: float = 30.0) -> None:
        for _ in range(5):  # the free port may be taken before uvicorn binds it: try another
            process = self.spawn()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and process.poll() is None:
                if self._ready():
                    return
                time.sleep(0.05)  # readiness polling until it answers, exits, or the deadline
            self.stop()
            if self.uds is not None or "address already in use" not in self.log().lower():
                break
        raise RuntimeError(f"uvicorn did not start:\n{self.log()[-3000:]}")

    def _ready(self) -> bool:
        """Whether the readiness path answers 200 (now)."""
        if self.uds is not None:
            # Probe the socket with a socket of our own first: httpx's transport leaves the
            # socket of a refused unix connection to the garbage collector (ResourceWarning).
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(self.uds)
                except OSError:
                    return False
        try:
            with self.client(timeout=1.0) as client:
                return client.get(self.ready_path).status_code == 200
        except httpx.TransportError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self, pid: int) -> None:
        """SIGKILL to one process of the server (a worker): no cleanup code of it runs."""
        os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
