"""A real redis-server for the tests: started on a free loopback port and a unix socket in a
temporary directory, stopped, killed and restarted on demand. No mock of Redis anywhere."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    """A loopback TCP port that nothing listened on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process that this test session owns."""

    def __init__(self, *extra_args: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run `make test` (it installs it) "
                               "or apt-get install redis-server")
        self.binary = binary
        self.extra_args = list(extra_args)
        self.directory = Path(tempfile.mkdtemp(prefix="genai-ratelimit-redis-"))
        self.unix_path = str(self.directory / "redis.sock")
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.unix_path}?db=0"

    def start(self, port: int | None = None, timeout: float = 10.0) -> None:
        """Starts the server (on `port`, else a free one) and waits until it answers PING."""
        for _ in range(5):
            self.port = port or free_port()
            args = [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--unixsocket", self.unix_path,
                "--unixsocketperm", "700",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.directory),
                "--logfile", str(self.directory / "redis.log"),
                *self.extra_args,
            ]
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready(timeout):
                return
            self.stop()
            if port is not None:
                break
        log = (self.directory / "redis.log")
        raise RuntimeError("redis-server did not start: "
                           + (log.read_text()[-2000:] if log.exists() else "no log"))

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            try:
                # Over this server's own unix socket: Redis creates it after binding every TCP
                # port, so a PONG here means our process holds self.port (another test session
                # running beside this one may have taken the same "free" port first: then our
                # server exits, and a PING over TCP would have reached theirs).
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(0.5)
                    s.connect(self.unix_path)
                    s.sendall(b"PING\r\n")
                    # -NOAUTH: a server started with --requirepass is up, too.
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        return True
            except OSError:
                pass
            time.sleep(0.02)  # readiness polling, not a race: we loop until PONG or the deadline
        return False

    def stop(self) -> None:
        """Stops the server gracefully (SIGTERM) and waits for it to exit."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def kill(self) -> None:
        """Kills the server with SIGKILL: connections die without a goodbye."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self.process = None

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections but answers nothing."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Stops the server and starts a fresh one (empty data, empty script cache) on the same port."""
        port = self.port
        self.stop()
        self.start(port=port)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def env_redis_url() -> str | None:
    url = os.environ.get("REDIS_URL", "").strip()
    return url or None
