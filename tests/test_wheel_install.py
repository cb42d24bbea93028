"""The built distribution (`make test-wheel`, which builds it and passes --wheel-dist):

- the manylinux wheel carries hiredis, libuuid and OpenSSL, and its platform tag is the one
  `auditwheel show` finds honest;
- it installs with `pip install --no-index` and answers a real check in a minimal Debian 12
  root that has no compiler and no hiredis/libuuid/OpenSSL development files, against a
  redis-server started outside the root; over TLS, the wheel's own OpenSSL verifies the server;
- examples/Dockerfile's steps, replayed in that root, serve the example app, which limits;
- the sdist, in that root, stops with one message naming the packages to install on Debian,
  Alpine and Fedora;
- the sdist builds without any network on this machine, which has the -dev packages;
- the aarch64 wheel (`make wheel ARCH=aarch64`, cross-built) is the same abi3 build for
  manylinux_2_34_aarch64 with arm64 hiredis, libuuid and OpenSSL bundled, and in an arm64
  Debian 12 root run under qemu-user-static it installs, checks against the redis-server on
  this machine's loopback, and verifies that server over TLS with its own OpenSSL.

Every command run in the root is printed (pytest -rP shows it: the install log)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.parse
import uuid
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import genai_ratelimit
from debian_root import DebianRoot
from helpers_dockerfile import dockerfile_instructions
from redis_server import free_port
from test_tls import _tls_server as tls_redis_server
from test_tls import certificates  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.wheel,
    pytest.mark.not_asan(reason="checks a built wheel in a Debian root, in other processes"),
    pytest.mark.no_hiredis1(reason="checks a built wheel (hiredis bundled) in a Debian root"),
]

ROOT = Path(__file__).resolve().parent.parent
CHECK = ("import sys, genai_ratelimit as g, genai_ratelimit._native as n\n"
         "limiter = g.RateLimiter(sys.argv[1])\n"
         "print('answers:', *(limiter.check(sys.argv[2], 2, 60) for _ in range(3)))\n"
         "print('hiredis:', n.HIREDIS_VERSION, 'from:', n.__file__)\n")
EXPECTED_ANSWERS = "answers: (True, 1, 0) (True, 0, 0) (False, 0, 60)"
# What the user of the wheel must not need, and the root must not have.
DEV_PACKAGES = ("gcc", "cpp", "pkg-config", "pkgconf", "libhiredis0.14", "libhiredis-dev",
                "uuid-dev", "libssl-dev", "python3-dev", "libpython3.11-dev")


@dataclass
class Dist:
    wheel: Path
    sdist: Path
    root: DebianRoot
    wheelhouse: Path


@pytest.fixture(scope="module")
def dist(request: pytest.FixtureRequest) -> Dist:
    directory = Path(request.config.getoption("--wheel-dist")).resolve()
    version = genai_ratelimit.__version__
    wheels = sorted(directory.glob(f"genai_ratelimit-{version}-*-manylinux_*_x86_64.whl"))
    assert len(wheels) == 1, \
        f"expected one x86-64 manylinux wheel of {version} in {directory}, found {wheels}"
    sdist = directory / f"genai_ratelimit-{version}.tar.gz"
    assert sdist.exists(), f"{sdist} is missing"
    root_option = request.config.getoption("--debian-root")
    wheelhouse_option = request.config.getoption("--wheelhouse")
    assert root_option and wheelhouse_option, "--wheel-dist needs --debian-root and --wheelhouse"
    wheelhouse = Path(wheelhouse_option).resolve()
    assert any(wheelhouse.glob("setuptools-*.whl")), f"{wheelhouse} has no setuptools wheel"
    return Dist(wheels[0], sdist, DebianRoot(Path(root_option)), wheelhouse)


def transcript(title: str, output: str) -> str:
    """Prints a step's output (shown by pytest -rP) and returns it."""
    print(f"----- {title}\n{output.rstrip()}\n")
    return output


def in_root(dist: Dist, title: str, script: str, work: Path, env: dict[str, str] | None = None,
            expect_success: bool = True) -> str:
    result = dist.root.run(script, work, env)
    transcript(f"{title} (in the Debian root, exit {result.returncode})", result.stdout)
    if expect_success:
        assert result.returncode == 0, f"{title} failed in the Debian root:\n{result.stdout[-4000:]}"
    return result.stdout


def test_wheel_bundles_hiredis_libuuid_and_openssl_under_an_honest_manylinux_tag(dist: Dist) -> None:
    shown = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(dist.wheel)],
                           capture_output=True, text=True)
    transcript(f"auditwheel show {dist.wheel.name}", shown.stdout + shown.stderr)
    assert shown.returncode == 0, shown.stderr
    consistent = re.search(r'consistent with\s+the following platform tag:\s+"([^"]+)"', shown.stdout)
    assert consistent is not None, shown.stdout
    tag = consistent.group(1)
    assert tag.startswith("manylinux_") and dist.wheel.name.endswith(f"-{tag}.whl"), (tag, dist.wheel.name)

    with zipfile.ZipFile(dist.wheel) as archive:
        names = archive.namelist()
    bundled = [Path(name).name for name in names
               if name.startswith("genai_ratelimit.libs/") and not name.endswith("/")]
    for library in ("libhiredis", "libuuid", "libssl", "libcrypto"):
        assert any(name.startswith(library + "-") for name in bundled), f"{library} not bundled: {bundled}"
    # Nothing but the libraries the extension needs: no libpython, no libc.
    assert len(bundled) == 4, bundled


def test_wheel_installs_and_checks_in_a_debian_root_without_compiler_or_dev_packages(
        dist: Dist, tmp_path: Path, redis_url: str, redis_client: object) -> None:
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(dist.wheel, work)
    (work / "check.py").write_text(CHECK)

    # (`! command` does not stop `sh -e`: each check fails the script explicitly.)
    absent = in_root(dist, "what the root lacks", f"""
        for tool in gcc cc cpp pkg-config; do if command -v $tool; then exit 1; fi; done
        if dpkg-query -W -f='${{Package}} ${{Status}}\\n' {' '.join(DEV_PACKAGES)} 2>&1 | \
             grep 'install ok installed'; then exit 1; fi
        for path in /usr/lib/x86_64-linux-gnu/libhiredis* /usr/include/hiredis /usr/include/uuid \
                    /usr/include/openssl; do if [ -e "$path" ]; then exit 1; fi; done
        echo root-lacks-the-toolchain
        """, work)
    assert "root-lacks-the-toolchain" in absent

    out = in_root(dist, "pip install of the wheel, ldd and a check", f"""
        python3 --version
        python3 -m venv /opt/venv
        /opt/venv/bin/pip install --no-index /mnt/{dist.wheel.name}
        so=$(cd / && /opt/venv/bin/python -c 'import genai_ratelimit._native as n; print(n.__file__)')
        ldd "$so"
        if ldd "$so" | grep -F 'not found'; then exit 1; fi
        /opt/venv/bin/python /mnt/check.py "$REDIS_URL" wheel-user-{uuid.uuid4().hex}
        """, work, env={"REDIS_URL": redis_url})
    assert f"Successfully installed genai-ratelimit-{genai_ratelimit.__version__}" in out
    assert EXPECTED_ANSWERS in out
    libs_dir = "/opt/venv/lib/python3.11/site-packages/genai_ratelimit.libs"
    for library in ("libhiredis", "libuuid", "libssl", "libcrypto"):
        [line] = [line for line in out.splitlines() if line.strip().startswith(library)]
        loaded = os.path.normpath(line.split("=>")[1].split()[0])
        assert os.path.dirname(loaded) == libs_dir and Path(loaded).name.startswith(library + "-"), \
            f"{library} is not loaded from the wheel: {line}"
    assert "from: /opt/venv/lib/python3.11/site-packages/genai_ratelimit/" in out


TLS_CHECKS = """import os, sys, genai_ratelimit as g
url, user = sys.argv[1], sys.argv[2]
for label, query, cert_file in (("ssl_ca_certs", "?ssl_ca_certs=/mnt/ca.crt", None),
                                ("system store", "", None),
                                ("SSL_CERT_FILE", "", "/mnt/ca.crt")):
    if cert_file:
        os.environ["SSL_CERT_FILE"] = cert_file
    try:
        print(label, "->", g.RateLimiter(url + query).check(user + label, 2, 60))
    except g.RateLimiterError as error:
        print(label, "->", type(error).__name__, error)
"""


def test_the_bundled_openssl_verifies_redis_over_tls_in_the_debian_root(
        dist: Dist, tmp_path: Path, certificates: Path, user_id: str) -> None:
    """The blocking limiter's TLS is the wheel's own OpenSSL: it verifies with the CA file
    given, refuses a server that the root's CA store does not know, and honours SSL_CERT_FILE
    (docs/install.md's advice where the system's CAs are not where Debian keeps them)."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(dist.wheel, work)
    shutil.copy(certificates / "ca.crt", work)
    (work / "tls_checks.py").write_text(TLS_CHECKS)
    server = tls_redis_server(certificates)
    try:
        out = in_root(dist, "the wheel's OpenSSL against a TLS redis-server", f"""
            python3 -m venv /opt/venv
            /opt/venv/bin/pip install --no-index /mnt/{dist.wheel.name}
            /opt/venv/bin/python /mnt/tls_checks.py rediss://127.0.0.1:{server.tls_port}/0 {user_id}
            """, work)
    finally:
        server.close()
    assert "ssl_ca_certs -> (True, 1, 0)" in out
    assert re.search(r"system store -> RateLimiterUnavailable .*certificate", out, re.IGNORECASE), out
    assert "SSL_CERT_FILE -> (True, 1, 0)" in out

def replay_dockerfile(path: Path, port: int) -> tuple[str, list[str]]:
    """A shell script that does in the Debian root what `docker build` + `docker run` of the
    Dockerfile do in the image, and the command it serves (the CMD, its --host and --port
    changed to 127.0.0.1 and `port`: the root shares this machine's network).

    The build context is /mnt/context. Differences, each forced by the setting: the image's
    Python comes from FROM, here Debian's python3 in a venv (Debian's own Python refuses
    system-wide pip installs, PEP 668); pip installs from /mnt/wheelhouse (PIP_NO_INDEX,
    PIP_FIND_LINKS) where the image's pip downloads the same pins from PyPI."""
    script = ["python3 -m venv /opt/venv", "export PATH=/opt/venv/bin:$PATH", "cd /"]
    command: list[str] = []
    user = "root"
    build_args: dict[str, str] = {}
    for instruction in dockerfile_instructions(path):
        keyword, arguments = instruction.keyword, instruction.arguments
        if keyword == "ARG":
            name, _, default = arguments.partition("=")
            build_args[name] = default
        elif keyword == "FROM":
            base = re.sub(r"\$\{(\w+)\}", lambda m: build_args[m.group(1)], arguments)
            assert base == "python:3.11-slim", f"the replay stands in for python:3.11-slim: {base}"
        elif keyword == "RUN":
            script.append(arguments)
        elif keyword == "WORKDIR":
            script.append(f"mkdir -p {arguments} && cd {arguments}")
        elif keyword == "COPY":
            *sources, destination = shlex.split(arguments)
            assert not any(s.startswith("--") for s in sources), f"COPY flags are not replayed: {arguments}"
            parent = destination if destination.endswith("/") else os.path.dirname(destination)
            script.append(f"mkdir -p {parent or '.'}")
            script += [f"cp -r /mnt/context/{source} {destination}" for source in sources]
        elif keyword == "ENV":
            for assignment in shlex.split(arguments):
                name, _, value = assignment.partition("=")
                script.append(f"export {name}=${{{name}_OVERRIDE:-{shlex.quote(value)}}}")
        elif keyword == "USER":
            user = arguments
        elif keyword == "EXPOSE":
            assert arguments == "8000", arguments
        elif keyword == "CMD":
            command = json.loads(arguments)
        else:
            raise AssertionError(f"replay_dockerfile() does not know {keyword}: teach it")
    assert command[:1] == ["uvicorn"], command
    served = list(command)
    served[served.index("--host") + 1] = "127.0.0.1"
    served[served.index("--port") + 1] = str(port)
    uid, _, gid = user.partition(":")
    script.append(f"exec setpriv --reuid={uid} --regid={gid or uid} --init-groups -- env PATH=\"$PATH\" "
                  f"HOME=$(getent passwd {uid} | cut -d: -f6) {shlex.join(served)}")
    return "\n".join(script), served


def test_the_dockerfile_steps_replayed_in_the_debian_root_serve_the_example_app_which_limits(
        dist: Dist, tmp_path: Path, redis_url: str, redis_client: object) -> None:
    work = tmp_path / "work"
    context = work / "context"
    (context / "dist").mkdir(parents=True)
    (context / "examples").mkdir()
    shutil.copy(dist.wheel, context / "dist")
    for name in ("app.py", "requirements.txt"):
        shutil.copy(ROOT / "examples" / name, context / "examples")
    shutil.copytree(dist.wheelhouse, work / "wheelhouse")

    port = free_port()
    script, served = replay_dockerfile(ROOT / "examples" / "Dockerfile", port)
    log = tmp_path / "app.log"
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/mnt/wheelhouse", "REDIS_URL_OVERRIDE": redis_url,
           "EXAMPLE_KEY_PREFIX": f"wheel-{uuid.uuid4().hex}"}
    server = dist.root.start(script, work, log, env)
    try:
        deadline = time.monotonic() + 180  # the install steps run first
        while True:
            assert server.poll() is None, f"the app exited:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the app never answered:\n{log.read_text()[-4000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # readiness polling: we loop until /healthz answers or the deadline

        rows = []
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for _ in range(6):
                response = client.post("/v1/chat/completions",
                                       headers={"Authorization": "Bearer sk-demo-free"},
                                       json={"messages": [{"role": "user", "content": "hi"}],
                                             "stream": False})
                rows.append((response.status_code, response.headers.get("x-ratelimit-remaining"),
                             response.headers.get("retry-after")))
    finally:
        server.terminate()
        server.wait(30)
    transcript("the Dockerfile replayed in the Debian root, then `" + shlex.join(served) + "`",
               log.read_text() + "\n(status, X-RateLimit-Remaining, Retry-After) per request:\n"
               + "\n".join(map(str, rows)))
    assert rows[:5] == [(200, str(remaining), None) for remaining in (4, 3, 2, 1, 0)]
    assert rows[5] == (429, "0", "60")


def test_the_sdist_without_the_dev_packages_names_them_for_debian_alpine_and_fedora(
        dist: Dist, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(dist.sdist, work)
    shutil.copytree(dist.wheelhouse, work / "wheelhouse")
    out = in_root(dist, "pip install of the sdist without the -dev packages", f"""
        python3 -m venv /opt/venv
        /opt/venv/bin/pip install --no-index --find-links /mnt/wheelhouse 'setuptools>=77' wheel
        if /opt/venv/bin/pip install --no-index --no-build-isolation /mnt/{dist.sdist.name}; then exit 1; fi
        echo the-build-failed
        """, work)
    assert "the-build-failed" in out
    assert "genai-ratelimit's C extension cannot be built here: missing hiredis" in out
    debian, alpine, fedora = (
        next(line for line in out.splitlines() if line.strip().startswith(distribution))
        for distribution in ("Debian/Ubuntu:", "Alpine:", "Fedora/RHEL:"))
    for line, packages in (
            (debian, "apt-get install libhiredis-dev uuid-dev libssl-dev pkg-config gcc python3-dev"),
            (alpine, "apk add hiredis-dev util-linux-dev openssl-dev pkgconf gcc musl-dev python3-dev"),
            (fedora, "dnf install hiredis-devel libuuid-devel openssl-devel pkgconf-pkg-config gcc "
                     "python3-devel")):
        assert line.strip().endswith(packages), line


def test_the_sdist_builds_without_network_where_the_dev_packages_are(
        dist: Dist, tmp_path: Path, redis_url: str, redis_client: object) -> None:
    env_dir = tmp_path / "offline-venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # Only what the machine has: no pip configuration, no PIP_* variables of the host.
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    # The session's redis-server listens on this port of the host's loopback: unreachable here.
    port = urllib.parse.urlsplit(redis_url).port or free_port()
    script = f"""
        set -ex
        if {python} -c 'import socket; socket.create_connection(("127.0.0.1", {port}), timeout=1)'; then
          exit 1
        fi
        cat /proc/net/dev
        {python} -m pip install --no-index --find-links {dist.wheelhouse} 'setuptools>=77' wheel
        {python} -m pip install --no-index --no-build-isolation {dist.sdist}
        """
    # A network namespace of its own: no interface but a loopback that is down.
    result = subprocess.run(["unshare", "--net", "--", "sh", "-c", script], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    transcript("offline sdist build (unshare --net)", result.stdout)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "ConnectionRefusedError" in result.stdout or "Network is unreachable" in result.stdout

    (tmp_path / "check.py").write_text(CHECK)
    checked = subprocess.run([str(python), "check.py", redis_url, f"sdist-user-{uuid.uuid4().hex}"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)
    transcript("a check with the offline build", checked.stdout + checked.stderr)
    assert EXPECTED_ANSWERS in checked.stdout
    assert f"from: {env_dir}" in checked.stdout



# ------------------------------------------------------------------ aarch64 under qemu

ARM64_CHECK = CHECK + """import platform
print("machine:", platform.machine())
"""


@pytest.fixture(scope="module")
def arm64(request: pytest.FixtureRequest) -> tuple[Path, DebianRoot]:
    """The aarch64 wheel beside the x86-64 one, and the arm64 root to run it in."""
    directory = Path(request.config.getoption("--wheel-dist")).resolve()
    version = genai_ratelimit.__version__
    wheels = sorted(directory.glob(f"genai_ratelimit-{version}-*-manylinux_*_aarch64.whl"))
    assert len(wheels) == 1, f"expected one aarch64 wheel in {directory} (make wheel ARCH=aarch64): {wheels}"
    root_option = request.config.getoption("--arm64-root")
    assert root_option, "--wheel-dist needs --arm64-root (make test-wheel passes both)"
    return wheels[0], DebianRoot(Path(root_option))


def test_the_aarch64_wheel_is_the_abi3_build_with_the_arm64_libraries_bundled(
        arm64: tuple[Path, DebianRoot]) -> None:
    wheel, _ = arm64
    assert wheel.name.endswith("-cp310-abi3-manylinux_2_34_aarch64.whl"), wheel.name
    shown = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)],
                           capture_output=True, text=True)
    transcript(f"auditwheel show {wheel.name}", shown.stdout + shown.stderr)
    assert 'consistent with the following platform tag: "manylinux_2_34_aarch64"' in \
        " ".join(shown.stdout.split()), shown.stdout
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        extension = archive.read("genai_ratelimit/_native.abi3.so")
    # ELF e_machine (offset 18, little-endian): 183 is EM_AARCH64.
    assert extension[:4] == b"\x7fELF" and int.from_bytes(extension[18:20], "little") == 183
    bundled = sorted(Path(name).name.split("-")[0] for name in names
                     if name.startswith("genai_ratelimit.libs/") and not name.endswith("/"))
    assert bundled == ["libcrypto", "libhiredis", "libssl", "libuuid"], bundled


def test_the_aarch64_wheel_checks_over_tcp_and_tls_in_an_arm64_debian_root_under_qemu(
        arm64: tuple[Path, DebianRoot], tmp_path: Path, redis_url: str, redis_client: object,
        certificates: Path, user_id: str) -> None:
    """The root's python3 is Debian's arm64 build, run by qemu-user-static (binfmt_misc): pip
    picks the aarch64 wheel, its extension loads the bundled arm64 libraries, and the checks
    reach the redis-servers on this machine's loopback, over TCP and over TLS."""
    wheel, root = arm64
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(wheel, work)
    shutil.copy(certificates / "ca.crt", work)
    (work / "check.py").write_text(ARM64_CHECK)
    (work / "tls_checks.py").write_text(TLS_CHECKS)
    server = tls_redis_server(certificates)
    try:
        result = root.run(f"""
            uname -m
            for tool in gcc cc cpp pkg-config; do if command -v $tool; then exit 1; fi; done
            python3 --version
            python3 -m venv /opt/venv
            /opt/venv/bin/pip install --no-index /mnt/{wheel.name}
            so=$(cd / && /opt/venv/bin/python -c 'import genai_ratelimit._native as n; print(n.__file__)')
            ldd "$so"
            if ldd "$so" | grep -F 'not found'; then exit 1; fi
            /opt/venv/bin/python /mnt/check.py "$REDIS_URL" arm64-user-{uuid.uuid4().hex}
            /opt/venv/bin/python /mnt/tls_checks.py rediss://127.0.0.1:{server.tls_port}/0 {user_id}
            """, work, env={"REDIS_URL": redis_url}, timeout=600)
    finally:
        server.close()
    out = transcript(f"the aarch64 wheel in the arm64 Debian root (qemu), exit {result.returncode}",
                     result.stdout)
    assert result.returncode == 0, out[-4000:]
    assert "machine: aarch64" in out
    assert f"Successfully installed genai-ratelimit-{genai_ratelimit.__version__}" in out
    assert EXPECTED_ANSWERS in out
    libs_dir = "/opt/venv/lib/python3.11/site-packages/genai_ratelimit.libs"
    for library in ("libhiredis", "libuuid", "libssl", "libcrypto"):
        [line] = [line for line in out.splitlines() if line.strip().startswith(library)]
        assert os.path.dirname(os.path.normpath(line.split("=>")[1].split()[0])) == libs_dir, line
    assert "ssl_ca_certs -> (True, 1, 0)" in out
    assert re.search(r"system store -> RateLimiterUnavailable .*certificate", out, re.IGNORECASE), out
    assert "SSL_CERT_FILE -> (True, 1, 0)" in out
