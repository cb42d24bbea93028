"""The distribution: `python -m build` makes an sdist and a wheel, and the sdist alone
(lua/ and the C headers ship in it) builds and works in a fresh virtualenv."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tarfile
import venv
from pathlib import Path

import pytest

import genai_ratelimit

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.not_asan(reason="builds and installs in subprocesses: no C of ours runs in this process"),
    pytest.mark.no_hiredis1(reason="builds and installs in subprocesses: no hiredis path of its own"),
]

ROOT = Path(__file__).resolve().parent.parent


def test_installed_distribution_version_is_the_package_version() -> None:
    assert importlib.metadata.version("genai-ratelimit") == genai_ratelimit.__version__


def run(*args: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.mark.slow
def test_sdist_and_wheel_build_and_the_sdist_installs_in_a_fresh_venv(
        tmp_path: Path, redis_url: str, redis_client: object) -> None:
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--sdist", "--wheel", "--no-isolation", "--outdir", dist,
        ROOT, cwd=tmp_path)
    [sdist] = dist.glob(f"genai_ratelimit-{genai_ratelimit.__version__}.tar.gz")
    [wheel] = dist.glob(f"genai_ratelimit-{genai_ratelimit.__version__}-*.whl")
    assert "cp3" in wheel.name

    with tarfile.open(sdist) as archive:
        names = {Path(name).relative_to(Path(name).parts[0]).as_posix()
                 for name in archive.getnames() if len(Path(name).parts) > 1}
    for needed in ("lua/sliding_window.lua", "csrc/native.h", "csrc/script.c", "setup.py",
                   "pyproject.toml", "genai_ratelimit/py.typed", "README.md", "LICENSE"):
        assert needed in names, f"{needed} is missing from the sdist"
    assert "csrc/script_source.h" not in names, "the generated header must be rebuilt from lua/"

    env_dir = tmp_path / "fresh-venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "setuptools>=77")
    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
        "--no-build-isolation", sdist, cwd=tmp_path)
    out = run(python, "-c",
              "import sys, genai_ratelimit as g\n"
              "l = g.RateLimiter(sys.argv[1])\n"
              "print(g.SCRIPT_SHA1, l.check('sdist-user', 2, 60), l.check('sdist-user', 2, 60),"
              " l.check('sdist-user', 2, 60), g.__file__)",
              redis_url, cwd=tmp_path)
    from genai_ratelimit import SCRIPT_SHA1
    assert out.split()[0] == SCRIPT_SHA1
    assert "(True, 1, 0) (True, 0, 0) (False, 0, 60)" in out
    assert str(env_dir) in out  # imported from the fresh venv, not from the source tree
