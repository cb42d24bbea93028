"""A release anyone can install, checked as far as this machine allows (docs/install.md,
"Releases"): the metadata PyPI shows, `twine check` on an sdist and a wheel built here, that
wheel installed in a fresh venv and smoke-tested (cibuildwheel's test-command), every
`pip install` line of the docs naming extras that exist, the cibuildwheel configuration as
cibuildwheel itself reads it, the release workflow's shape, and setup.py's macOS path (its
choices, run here with sys.platform set to darwin: nothing is compiled for macOS here)."""

from __future__ import annotations

import ast
import importlib.metadata
import io
import os
import re
import subprocess
import sys
import venv
import warnings
from contextlib import redirect_stderr
from pathlib import Path
from platform import machine
from typing import Any

import pytest
import tomllib
import trove_classifiers
import yaml

import genai_ratelimit

with warnings.catch_warnings():
    # setup.py's imports, made now, on this machine's platform (setup_py_as_on runs setup.py
    # with another one); setuptools complains when something imported distutils first.
    warnings.filterwarnings("ignore", ".*[Dd]istutils", UserWarning)
    import setuptools.command.build_ext  # noqa: F401

pytestmark = [
    pytest.mark.not_asan(reason="builds, installs and runs in subprocesses: no C of ours runs here"),
    pytest.mark.no_hiredis1(reason="builds, installs and runs in subprocesses: no hiredis path of its own"),
]

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
WORKFLOW_PATH = ROOT / ".github" / "workflows" / "release.yml"
WORKFLOW = yaml.safe_load(WORKFLOW_PATH.read_text(encoding="utf-8"))
CIBUILDWHEEL = PYPROJECT["tool"]["cibuildwheel"]


def run(*args: str | Path, cwd: Path = ROOT, env: dict[str, str] | None = None) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, f"{args}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


# --- metadata ---------------------------------------------------------------------------------


def test_the_metadata_names_the_project_s_addresses_and_valid_classifiers() -> None:
    project = PYPROJECT["project"]
    assert set(project["urls"]) == {"Homepage", "Documentation", "Source", "Issues", "Changelog"}
    assert all(url.startswith("https://") for url in project["urls"].values())
    unknown = [c for c in project["classifiers"] if c not in trove_classifiers.classifiers]
    assert not unknown, f"PyPI refuses these classifiers: {unknown}"
    # The license is an SPDX expression (PEP 639): a License :: classifier beside it is refused.
    assert project["license"] == "MIT"
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]
    installed = importlib.metadata.metadata("genai-ratelimit")
    assert sorted(installed.get_all("Project-URL") or []) == sorted(
        f"{name}, {url}" for name, url in project["urls"].items())
    assert installed["Requires-Python"] == ">=3.10"


PIP_INSTALL = re.compile(r"pip3? install\b[^\n`]*")
EXTRAS = re.compile(r"(?:genai[-_]ratelimit|\.whl|\.tar\.gz|^\.|\s\.)\[([^\]]+)\]")


def pip_install_extras() -> list[tuple[str, str]]:
    """(where, extra) for every extra that a `pip install` line of the README, docs/ or
    examples/ names."""
    found = []
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "examples").rglob("*.md"))]
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for command in PIP_INSTALL.findall(line):
                for token in command.split():
                    for extras in EXTRAS.findall(token.strip("'\"")):
                        found += [(f"{path.relative_to(ROOT)}:{number}", extra.strip())
                                  for extra in extras.split(",")]
    return found


def test_every_pip_install_line_names_a_declared_extra() -> None:
    declared = set(PYPROJECT["project"]["optional-dependencies"])
    named = pip_install_extras()
    assert {extra for _, extra in named} >= {"fastapi", "prometheus", "otel"}, named
    wrong = [(where, extra) for where, extra in named if extra not in declared]
    assert not wrong, f"extras that pyproject.toml does not declare ({sorted(declared)}): {wrong}"


# --- the distribution, built here ---------------------------------------------------------------


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An sdist and a wheel of this tree, built as the release's sdist job builds them."""
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--sdist", "--wheel", "--no-isolation", "--outdir", out, ROOT)
    return out


def test_twine_check_passes_on_the_sdist_and_the_wheel(dist: Path) -> None:
    files = sorted(dist.iterdir())
    assert [f.name for f in files] == [
        f"genai_ratelimit-{genai_ratelimit.__version__}-cp310-abi3-linux_{machine()}.whl",
        f"genai_ratelimit-{genai_ratelimit.__version__}.tar.gz"]
    output = run(sys.executable, "-m", "twine", "check", "--strict", *files)
    assert output.count("PASSED") == 2, output


def test_the_wheel_passes_the_smoke_test_in_a_fresh_venv(dist: Path, tmp_path: Path) -> None:
    """cibuildwheel's test-command, on this machine's wheel (unrepaired: the system's
    libraries are here): what the release workflow runs on each wheel it builds."""
    [wheel] = dist.glob("*.whl")
    venv.EnvBuilder(with_pip=True).create(tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--disable-pip-version-check",
        wheel)
    command = CIBUILDWHEEL["test-command"].split()
    assert command[0] == "python" and command[1:] == CIBUILDWHEEL["test-sources"]
    output = run(python, ROOT / command[1], cwd=tmp_path)
    assert f"from {tmp_path / 'venv'}" in output and "decide on Linux" in output


# --- cibuildwheel and the release workflow -------------------------------------------------------


@pytest.mark.parametrize(("platform", "archs", "identifiers"), [
    ("linux", "x86_64,aarch64", ["cp310-manylinux_x86_64", "cp310-manylinux_aarch64"]),
    ("macos", "arm64,x86_64", ["cp310-macosx_x86_64", "cp310-macosx_arm64"]),
])
def test_cibuildwheel_reads_the_configuration(platform: str, archs: str, identifiers: list[str]) -> None:
    """One abi3 wheel per platform and architecture, as cibuildwheel (the version the workflow
    pins) reads pyproject.toml."""
    output = run(sys.executable, "-m", "cibuildwheel", "--platform", platform, "--archs", archs,
                 "--print-build-identifiers", ROOT)
    assert output.split() == identifiers


def test_the_wheels_are_built_against_the_libraries_the_sdist_needs() -> None:
    linux, macos = CIBUILDWHEEL["linux"], CIBUILDWHEEL["macos"]
    assert CIBUILDWHEEL["build"] == "cp310-*"  # abi3: one build serves 3.10 and later
    assert linux["manylinux-x86_64-image"] == linux["manylinux-aarch64-image"] == "manylinux_2_34"
    for package in ("hiredis-devel", "libuuid-devel", "openssl-devel", "redis"):
        assert package in linux["before-all"].split()
    assert macos["before-all"].split() == ["brew", "install", "hiredis", "openssl@3", "pkgconf", "redis"]
    assert linux["archs"] == macos["archs"] == ["native"]  # one runner per architecture
    assert all((ROOT / source).is_file() for source in CIBUILDWHEEL["test-sources"])


def steps(job: str) -> list[dict[str, Any]]:
    return list(WORKFLOW["jobs"][job]["steps"])


def test_the_release_workflow_builds_linux_and_macos_and_uploads_tags_only() -> None:
    triggers = WORKFLOW[True]  # YAML 1.1 reads the key `on` as true
    assert triggers["push"] == {"tags": ["v*"]}
    jobs = WORKFLOW["jobs"]
    matrix = jobs["wheels"]["strategy"]["matrix"]["include"]
    assert {m["platform"]: m["runner"] for m in matrix} == {
        "linux-x86_64": "ubuntu-24.04", "linux-aarch64": "ubuntu-24.04-arm",
        "macos-arm64": "macos-15", "macos-x86_64": "macos-15-intel"}
    [build] = [s for s in steps("wheels") if s.get("uses", "").startswith("pypa/cibuildwheel@")]
    assert build["uses"] == f"pypa/cibuildwheel@v{importlib.metadata.version('cibuildwheel')}"
    for job in ("sdist", "wheels"):
        assert any("twine" in s.get("run", "") and "check --strict" in s.get("run", "")
                   for s in steps(job)), job
    assert any("wheel_smoke.py" in s.get("run", "") for s in steps("sdist"))
    publish = jobs["publish"]
    assert publish["needs"] == ["sdist", "wheels"]
    assert publish["if"] == "startsWith(github.ref, 'refs/tags/v')"
    assert publish["permissions"] == {"id-token": "write"}  # trusted publishing: no token stored
    assert WORKFLOW["permissions"] == {"contents": "read"}
    assert steps("publish")[-1]["uses"] == "pypa/gh-action-pypi-publish@release/v1"


@pytest.mark.parametrize(("tag", "passes"), [(f"v{genai_ratelimit.__version__}", True), ("v9.9.9", False)])
def test_the_workflow_uploads_only_a_tag_that_is_the_package_s_version(tag: str, passes: bool) -> None:
    [step] = [s for s in steps("sdist") if s.get("name") == "The tag is the package's version"]
    result = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, env={"GITHUB_REF_NAME": tag,
                                             "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
    assert (result.returncode == 0) is passes, result.stderr


# --- setup.py on macOS ----------------------------------------------------------------------------


def setup_py_as_on(monkeypatch: pytest.MonkeyPatch, platform: str) -> dict[str, Any]:
    """setup.py's definitions as a build on `platform` makes them (its setup() call left out)."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    call = tree.body[-1]
    assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)
    assert getattr(call.value.func, "id", None) == "setup"
    tree.body.pop()
    monkeypatch.setattr(sys, "platform", platform)
    namespace: dict[str, Any] = {"__file__": str(ROOT / "setup.py"), "__name__": "setup_for_test"}
    exec(compile(tree, "setup.py", "exec"), namespace)
    return namespace


def missing_message(namespace: dict[str, Any]) -> str:
    stderr = io.StringIO()
    with redirect_stderr(stderr), pytest.raises(SystemExit):
        namespace["fail_missing"]([(name, header) for name, header, _ in namespace["SYSTEM_LIBRARIES"]],
                                  ["compiler"])
    return stderr.getvalue()


def test_on_macos_setup_py_uses_homebrew_and_the_c_library_s_uuid(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    macos = setup_py_as_on(monkeypatch, "darwin")
    assert [name for name, _, _ in macos["SYSTEM_LIBRARIES"]] == ["hiredis", "openssl"]
    monkeypatch.setenv("PATH", str(tmp_path))  # no pkg-config either
    message = missing_message(macos)
    assert "brew install hiredis openssl@3 pkgconf" in message
    assert "xcode-select --install" in message
    assert "apt-get" not in message and "manylinux" not in message
    source = (ROOT / "setup.py").read_text(encoding="utf-8")
    assert 'define_macros.append(("RL_SYSTEM_UUID", "1"))' in source
    member = (ROOT / "csrc" / "member.c").read_text(encoding="utf-8")
    assert "#ifdef RL_SYSTEM_UUID\n#include <uuid/uuid.h>" in member
    assert "getentropy(" in member


def test_on_linux_setup_py_still_needs_libuuid(monkeypatch: pytest.MonkeyPatch) -> None:
    linux = setup_py_as_on(monkeypatch, "linux")
    assert [name for name, _, _ in linux["SYSTEM_LIBRARIES"]] == ["hiredis", "uuid", "openssl"]
    message = missing_message(linux)
    assert "apt-get install libhiredis-dev uuid-dev libssl-dev" in message
    assert "brew" not in message


def test_on_macos_homebrew_s_keg_only_openssl_is_put_on_pkg_config_s_path(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`brew --prefix openssl@3` is asked (a stand-in brew here: the real one is macOS'), and
    its lib/pkgconfig follows what PKG_CONFIG_PATH already held."""
    prefix = tmp_path / "Cellar" / "openssl@3"
    (prefix / "lib" / "pkgconfig").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    brew = bin_dir / "brew"
    brew.write_text(f'#!/bin/sh\n[ "$1 $2" = "--prefix openssl@3" ] && echo {prefix}\n')
    brew.chmod(0o755)
    macos = setup_py_as_on(monkeypatch, "darwin")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("PKG_CONFIG_PATH", "/opt/mine/pkgconfig")
    macos["add_homebrew_pkg_config_path"]()
    assert os.environ["PKG_CONFIG_PATH"] == f"/opt/mine/pkgconfig:{prefix / 'lib' / 'pkgconfig'}"
