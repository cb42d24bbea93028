"""Commands in the minimal Debian 12 root of scripts/debian-root.sh: python3 and python3-venv,
no compiler, no pkg-config, no -dev package, no libhiredis. Used by tests/test_wheel_install.py.

Each command gets a throwaway root of its own. In a private mount namespace (`unshare
--mount`), the cached root is the read-only lower layer of an overlay whose upper layer is a
tmpfs; /proc and /dev are mounted in it and a host directory (`work`) is bound at /mnt. What
the command writes outside /mnt vanishes with it, so the cached root stays as debootstrap left
it. The mounts live and die with the namespace: the kernel unmounts them when its last process
exits, however the test ends (a killed pytest leaves no mount behind, and `rm -rf build` never
meets a bound /dev). The network namespace is the host's: a redis-server that the test started
on 127.0.0.1 is reachable from inside."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

# Runs as root in the new mount namespace: $1 the cached root, $2 the work directory,
# $3 an empty directory for the overlay's layers; the rest is `env -i`'s command line.
_ENTER = r"""
set -eu
root=$1 work=$2 layers=$3
shift 3
mount -t tmpfs -o mode=0755 tmpfs "$layers"
mkdir "$layers/upper" "$layers/scratch" "$layers/merged"
mount -t overlay overlay -o "lowerdir=$root,upperdir=$layers/upper,workdir=$layers/scratch" \
      "$layers/merged"
mount -t proc proc "$layers/merged/proc"
mount --bind /dev "$layers/merged/dev"
mount --bind "$work" "$layers/merged/mnt"
exec chroot "$layers/merged" /usr/bin/env -i "$@"
"""

# What a login shell on a fresh Debian would have, and nothing of the host's environment
# (no PIP_* variables, no pip configuration: pip inside sees only what the test gives it).
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "PIP_NO_CACHE_DIR": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}


class DebianRoot:
    """The root built by scripts/debian-root.sh at `path`."""

    def __init__(self, path: Path) -> None:
        if not (path / ".debian-root-stamp").exists():
            raise RuntimeError(f"{path} is not a root built by scripts/debian-root.sh "
                               "(run `make test-wheel`, which builds it)")
        for tool in ("unshare", "chroot", "mount"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is not installed (util-linux / coreutils)")
        self.path = path.resolve()

    def command(self, script: str, work: Path, env: dict[str, str] | None = None) -> list[str]:
        """The command line that runs `script` with /bin/sh -e -x in a throwaway copy of the
        root, `work` bound at /mnt. -x puts every command in the transcript."""
        layers = work.with_name(work.name + ".layers")
        layers.mkdir(exist_ok=True)
        variables = [f"{key}={value}" for key, value in {**BASE_ENV, **(env or {})}.items()]
        return ["unshare", "--mount", "--propagation", "private", "--",
                "sh", "-c", _ENTER, "enter-debian-root", str(self.path), str(work.resolve()),
                str(layers.resolve()), *variables, "/bin/sh", "-exc", script]

    def run(self, script: str, work: Path, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Runs `script` to its end; stdout and stderr together in .stdout."""
        return subprocess.run(self.command(script, work, env), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)

    def start(self, script: str, work: Path, log: Path,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Starts `script` (a server: it should end in `exec`, so that the Popen's pid is the
        server's own and terminate() reaches it), its output going to `log`."""
        with log.open("wb") as out:
            return subprocess.Popen(self.command(script, work, env), stdout=out,
                                    stderr=subprocess.STDOUT)
