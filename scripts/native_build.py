"""Inspects the genai_ratelimit._native extension installed in the running interpreter's
environment, without importing it (an ASan build cannot be imported before its runtime is
preloaded). Used by the Makefile's test-asan, test-valgrind and fuzz targets.

  python scripts/native_build.py path            the installed .so
  python scripts/native_build.py check asan      fails unless it is an ASan + UBSan build
  python scripts/native_build.py check debug     fails unless it is an -O0 -g build
  python scripts/native_build.py asan-runtime    the libasan the .so links against (for LD_PRELOAD)
  python scripts/native_build.py cxx-runtime     libstdc++ (preloaded with libasan for atheris,
                                                 whose C++ exceptions ASan must intercept)
  python scripts/native_build.py requirements EXTRA   pyproject.toml's dependencies + that extra

Checking what was installed catches a stale build reused by setuptools, or a build whose
environment switch did not reach setup.py.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import sysconfig


def installed_extension() -> str:
    found = []
    for key in ("platlib", "purelib"):
        found += glob.glob(os.path.join(sysconfig.get_paths()[key], "genai_ratelimit", "_native*.so"))
    found = sorted(set(found))
    if len(found) != 1:
        sys.exit(f"error: expected one installed genai_ratelimit/_native*.so under {sys.prefix}, "
                 f"found {found or 'none'}")
    return found[0]


def run(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def linked_libraries(so: str) -> dict[str, str]:
    """soname -> resolved path, from ldd."""
    libs = {}
    for line in run("ldd", so).splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>":
            libs[parts[0]] = parts[2]
    return libs


def undefined_symbols(so: str) -> set[str]:
    return {line.split()[-1] for line in run("nm", "-D", "--undefined-only", so).splitlines() if line.strip()}


def producer(so: str) -> str:
    """The DW_AT_producer of the first compile unit: the compiler and its flags."""
    for line in run("readelf", "--debug-dump=info", so).splitlines():
        if "DW_AT_producer" in line:
            return line.split(":", 1)[-1].strip()
    return ""


def check(kind: str) -> None:
    so = installed_extension()
    if kind == "asan":
        symbols = undefined_symbols(so)
        missing = [name for name, present in (
            ("__asan_init", "__asan_init" in symbols),
            ("__ubsan_handle_*", any(s.startswith("__ubsan_handle_") for s in symbols)),
        ) if not present]
        if missing:
            sys.exit(f"error: {so} is not an ASan + UBSan build (no {', '.join(missing)}); "
                     "was it built with GENAI_RATELIMIT_SANITIZE=1?")
    elif kind == "debug":
        flags = producer(so)
        if "-O0" not in flags or "-g" not in flags:
            sys.exit(f"error: {so} is not an -O0 -g build (compiler flags: {flags or 'no debug info'}); "
                     "was it built with GENAI_RATELIMIT_DEBUG=1?")
    else:
        sys.exit(f"error: unknown build kind {kind!r}")
    print(f"{so}: {kind} build")


def asan_runtime() -> None:
    so = installed_extension()
    for name, path in linked_libraries(so).items():
        if name.startswith("libasan.so"):
            print(os.path.realpath(path))
            return
    sys.exit(f"error: {so} does not link libasan")


def cxx_runtime() -> None:
    """ASan intercepts __cxa_throw only when libstdc++ is loaded at start-up; atheris (C++)
    is loaded later, by import, so without this its first exception trips an ASan CHECK."""
    out = run(os.environ.get("CC", "gcc"), "-print-file-name=libstdc++.so.6").strip()
    if not os.path.isabs(out):
        sys.exit("error: libstdc++.so.6 not found (is g++'s runtime installed?)")
    print(os.path.realpath(out))


def requirements(extra: str) -> None:
    """Lets a special venv install the test dependencies without building the package
    (`pip install ".[test]"` would build and install a plain extension over the special one)."""
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    print("\n".join(project.get("dependencies", []) + project["optional-dependencies"][extra]))


def main(argv: list[str]) -> None:
    if argv[:1] == ["path"]:
        print(installed_extension())
    elif argv[:1] == ["check"] and len(argv) == 2:
        check(argv[1])
    elif argv[:1] == ["asan-runtime"]:
        asan_runtime()
    elif argv[:1] == ["cxx-runtime"]:
        cxx_runtime()
    elif argv[:1] == ["requirements"] and len(argv) == 2:
        requirements(argv[1])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
