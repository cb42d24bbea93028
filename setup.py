"""Build the genai_ratelimit._native extension against the system hiredis and libuuid.

Metadata lives in pyproject.toml; this file only knows how to compile.

On macOS it builds against Homebrew's hiredis and OpenSSL (`brew install hiredis openssl@3
pkgconf`; the keg-only OpenSSL's pkg-config directory is added by itself) and the C
library's uuid functions (no libuuid there). Written for the release workflow's macOS
runners (docs/install.md says what is built and tested where).

A library that pkg-config finds outside the system's directories (PKG_CONFIG_PATH pointing at
a prefix of its own, as `make test-hiredis1` does for hiredis 1.x) is also the extension's
rpath, so that library is the one loaded at run time.

Environment switches:
  GENAI_RATELIMIT_SANITIZE=1  build with AddressSanitizer + UndefinedBehaviorSanitizer
  GENAI_RATELIMIT_DEBUG=1     build with -O0 -g3 (for gdb and valgrind)
  GENAI_RATELIMIT_WERROR=1    turn compiler warnings into errors (CI does)
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
# Each script of lua/ and the prefix of its C names (RL_SCRIPT_SHA1, rl_script_source, ...):
# (its file, the storage it is built over). A script written over a storage names
# "lib/{storage}_log.lua" in an include line and is built once per storage, that line
# naming lib/zset_log.lua or lib/compact_log.lua (each defines the storage's log and the
# names the scripts use: KEYS_PER_WINDOW, open_log, TIE_NAMES_ENTRY).
LUA = HERE / "lua"
SCRIPTS: dict[str, tuple[Path, str | None]] = {
    "RL_SCRIPT": (LUA / "sliding_window.lua", "zset"),
    "RL_RECONCILE": (LUA / "reconcile.lua", "zset"),
    "RL_PEEK": (LUA / "peek.lua", "zset"),
    "RL_RESET": (LUA / "reset.lua", None),
    "RL_LEASE": (LUA / "lease.lua", None),
    "RL_COMPACT": (LUA / "sliding_window.lua", "compact"),
    "RL_COMPACT_RECONCILE": (LUA / "reconcile.lua", "compact"),
    "RL_COMPACT_PEEK": (LUA / "peek.lua", "compact"),
    "RL_IN_FLIGHT": (LUA / "reserve_in_flight.lua", "zset"),
    "RL_RECONCILE_RELEASE": (LUA / "reconcile_release.lua", "zset"),
    "RL_COMPACT_IN_FLIGHT": (LUA / "reserve_in_flight.lua", "compact"),
    "RL_COMPACT_RECONCILE_RELEASE": (LUA / "reconcile_release.lua", "compact"),
    "RL_GCRA": (LUA / "gcra.lua", None),
    "RL_GCRA_WINDOWS": (LUA / "gcra_windows.lua", "zset"),
    "RL_COMPACT_GCRA_WINDOWS": (LUA / "gcra_windows.lua", "compact"),
    "RL_BUDGET_HOLD": (LUA / "budget_hold.lua", None),
    "RL_BUDGET_SETTLE": (LUA / "budget_settle.lua", None),
    "RL_OBSERVE": (LUA / "observe_upstream.lua", None),
    "RL_QUEUE": (LUA / "wait_queue.lua", None),
}
SCRIPT_HEADER = HERE / "csrc" / "script_source.h"
# A script names the shared files of lua/lib/ it is built on, one "-- include: lib/x.lua"
# line each; the build prepends them, in that order, to its text.
INCLUDE_LINE = re.compile(r"^-- include: (\S+)$", re.MULTILINE)
# The oldest CPython whose stable ABI the extension uses (Py_LIMITED_API), and the wheel's
# tag for it.
LIMITED_API = "0x030A0000"
LIMITED_API_TAG = "cp310"

MACOS = sys.platform == "darwin"

# (pkg-config name, header, libraries)
SYSTEM_LIBRARIES = [
    ("hiredis", "hiredis/hiredis.h", ["hiredis"]),
    ("uuid", "uuid/uuid.h", ["uuid"]),
    ("openssl", "openssl/ssl.h", ["ssl", "crypto"]),
]
if MACOS:
    # macOS' C library has the uuid functions (<uuid/uuid.h>): csrc/member.c uses those
    # (RL_SYSTEM_UUID). A "uuid" that pkg-config may know there is Homebrew's ossp-uuid, whose
    # API is another one: never looked up.
    SYSTEM_LIBRARIES = [library for library in SYSTEM_LIBRARIES if library[0] != "uuid"]

# What provides each build requirement, per distribution family: (Debian/Ubuntu, Alpine,
# Fedora/RHEL). One message names them all, so a bare machine is fixed in one install.
DISTRIBUTIONS = ("Debian/Ubuntu", "Alpine", "Fedora/RHEL")
INSTALL_COMMANDS = ("apt-get install", "apk add", "dnf install")
PACKAGES = {
    "hiredis": ("libhiredis-dev", "hiredis-dev", "hiredis-devel"),
    "uuid": ("uuid-dev", "util-linux-dev", "libuuid-devel"),
    "openssl": ("libssl-dev", "openssl-dev", "openssl-devel"),
    "pkg-config": ("pkg-config", "pkgconf", "pkgconf-pkg-config"),
    "compiler": ("gcc", "gcc musl-dev", "gcc"),
    "python": ("python3-dev", "python3-dev", "python3-devel"),
}
# On macOS, Homebrew's formulae (the compiler and the Python headers come with the Xcode
# command line tools and the Python itself).
HOMEBREW_PACKAGES = {"hiredis": "hiredis", "openssl": "openssl@3", "pkg-config": "pkgconf"}
# Homebrew's OpenSSL is keg-only: its pkg-config files are not on pkg-config's default path.
HOMEBREW_KEG_ONLY = ("openssl@3",)


def fail(message: str) -> None:
    sys.stderr.write(f"\nerror: {message}\n\n")
    raise SystemExit(1)


def find_library(
        pc_name: str, header: str, libraries: list[str]
) -> tuple[list[str], list[str], list[str]] | None:
    """Returns (include_dirs, library_dirs, libraries) for one system library, or None when
    neither pkg-config nor the usual include directories know it.

    library_dirs is what pkg-config names with -L: for a system package nothing (pkg-config
    leaves out its system directories), for a library installed into a prefix of its own
    that prefix's lib, e.g. hiredis 1.x from scripts/build-hiredis1.sh with PKG_CONFIG_PATH
    pointing at it."""
    if shutil.which("pkg-config"):
        result = subprocess.run(
            ["pkg-config", "--cflags-only-I", "--libs", pc_name],
            capture_output=True,
            text=True,
        )
        if result.returncode == 0:
            flags = result.stdout.split()
            includes = [f[2:] for f in flags if f.startswith("-I")]
            # The .pc files point into .../include/hiredis and .../include/uuid: the C
            # code includes <hiredis.h> and <uuid.h>, which works for 0.14 and 1.x alike.
            lib_dirs = [f[2:] for f in flags if f.startswith("-L")]
            libs = [f[2:] for f in flags if f.startswith("-l")]
            return includes, lib_dirs, libs or libraries
    for prefix in ("/usr/include", "/usr/local/include"):
        if (Path(prefix) / header).exists():
            return [str(Path(prefix) / Path(header).parent)], [], libraries
    return None


def missing_toolchain() -> list[str]:
    """The keys of PACKAGES for a C compiler and the Python headers, when absent: a machine
    without the libraries often lacks these too, and one message should name everything."""
    missing = []
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    if not compiler or shutil.which(compiler[0]) is None:
        missing.append("compiler")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        missing.append("python")
    return missing


def fail_missing(libraries: list[tuple[str, str]], toolchain: list[str]) -> None:
    """Stops the build with one message naming, for each distribution family, the packages
    that provide everything missing. libraries: (pkg-config name, header) pairs."""
    keys = [name for name, _ in libraries]
    if libraries and not shutil.which("pkg-config"):
        keys.append("pkg-config")
    keys += toolchain
    what = [f"{name} (no pkg-config entry '{name}', no {header})" for name, header in libraries]
    toolchain_names = {"compiler": "a C compiler", "python": "the Python headers (Python.h)"}
    what += [toolchain_names[key] for key in toolchain]
    lines = [
        "genai-ratelimit's C extension cannot be built here: missing " + "; ".join(what) + ".",
        "Install the development packages, then build again:",
    ]
    if MACOS:
        formulae = " ".join(HOMEBREW_PACKAGES[key] for key in keys if key in HOMEBREW_PACKAGES)
        if formulae:
            lines.append(f"  {'macOS:':15} brew install {formulae}")
        if any(key in ("compiler", "python") for key in keys):
            lines.append(f"  {'macOS:':15} xcode-select --install")
    else:
        for index, (distribution, command) in enumerate(zip(DISTRIBUTIONS, INSTALL_COMMANDS, strict=True)):
            packages = " ".join(PACKAGES[key][index] for key in keys)
            lines.append(f"  {distribution + ':':15} {command} {packages}")
    if not MACOS:
        lines.append("Or install the prebuilt manylinux wheel (built by `make wheel`), "
                     "which needs none of them.")
    fail("\n".join(lines))


def add_homebrew_pkg_config_path() -> None:
    """macOS: puts the pkg-config directories of Homebrew's keg-only formulae (OpenSSL) on
    PKG_CONFIG_PATH, after any the caller set, so that `brew install hiredis openssl@3
    pkgconf` is all a build needs. Homebrew's hiredis is found without help."""
    brew = shutil.which("brew")
    if not MACOS or brew is None:
        return
    paths = [p for p in os.environ.get("PKG_CONFIG_PATH", "").split(os.pathsep) if p]
    for formula in HOMEBREW_KEG_ONLY:
        result = subprocess.run([brew, "--prefix", formula], capture_output=True, text=True)
        directory = Path(result.stdout.strip()) / "lib" / "pkgconfig"
        if result.returncode == 0 and directory.is_dir() and str(directory) not in paths:
            paths.append(str(directory))
    if paths:
        os.environ["PKG_CONFIG_PATH"] = os.pathsep.join(paths)


def system_library_dirs() -> set[str]:
    """The directories the system's libraries live in (pkg-config's own list, which it
    leaves out of -L unless PKG_CONFIG_ALLOW_SYSTEM_LIBS is set)."""
    dirs = {"/lib", "/lib64", "/usr/lib", "/usr/lib64"}
    if shutil.which("pkg-config"):
        result = subprocess.run(
            ["pkg-config", "--variable=pc_system_libdirs", "pkg-config"],
            capture_output=True,
            text=True,
        )
        if result.returncode == 0:
            dirs.update(d for d in result.stdout.strip().split(":") if d)
    return {os.path.realpath(d) for d in dirs}


def c_string_literal(text: str) -> str:
    lines = []
    for line in text.splitlines(keepends=True):
        escaped = line.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("?", "\\?")
        lines.append(f'    "{escaped}"')
    return "\n".join(lines) if lines else '    ""'


def script_includes(path: Path, storage: str | None) -> list[Path]:
    """The shared files a script of lua/ names in its "-- include:" lines, in order, with
    the storage's name in the place of "{storage}"."""
    text = path.read_text(encoding="utf-8")
    names = INCLUDE_LINE.findall(text)
    if any("{storage}" in name for name in names) != (storage is not None):
        fail(f"{path.relative_to(HERE)}: an include of \"{{storage}}\" needs a storage, and only it")
    includes = [path.parent / name.replace("{storage}", storage or "") for name in names]
    for included in includes:
        if not included.is_file():
            fail(f"{path.relative_to(HERE)} includes {included.relative_to(HERE)}, which is missing")
        if INCLUDE_LINE.search(included.read_text(encoding="utf-8")):
            fail(f"{included.relative_to(HERE)} includes another file: only scripts include")
    return includes


def script_text(path: Path, storage: str | None) -> str:
    """What is embedded and sent for a script of lua/ over a storage: the shared files it
    includes, in order, then its own text. Its SHA1 is the SHA1 of exactly this."""
    parts = [included.read_text(encoding="utf-8") for included in script_includes(path, storage)]
    return "".join(part if part.endswith("\n") else part + "\n" for part in parts) + \
        path.read_text(encoding="utf-8")


def script_definitions(prefix: str, path: Path, storage: str | None) -> str:
    """The C definitions of one script: its SHA1, its source and SCRIPT LOAD of it."""
    source = script_text(path, storage)
    sha1 = hashlib.sha1(source.encode("utf-8")).hexdigest()
    name = prefix.lower()
    over = f", storage {storage}" if storage else ""
    return (
        f"/* {path.relative_to(HERE)}{over} */\n"
        f'#define {prefix}_SHA1 "{sha1}"\n'
        f"static const char {name}_source[] =\n"
        f"{c_string_literal(source)};\n"
        "/* SCRIPT LOAD <source>, already RESP-encoded: sent as is on NOSCRIPT. */\n"
        f"static const char {name}_load_command[] =\n"
        f'    "*3\\r\\n$6\\r\\nSCRIPT\\r\\n$4\\r\\nLOAD\\r\\n${len(source.encode("utf-8"))}\\r\\n"\n'
        f"{c_string_literal(source)}\n"
        '    "\\r\\n";\n'
    )


def write_script_header() -> None:
    """Embeds the scripts of lua/ (the only copy of each algorithm) and their SHA1s."""
    missing = [path for path, _ in SCRIPTS.values() if not path.exists()]
    if missing:
        if SCRIPT_HEADER.exists():
            return
        fail(f"{missing[0]} is missing: the sdist or checkout is incomplete")
    content = (
        "/* Generated by setup.py from the scripts of lua/. Do not edit. */\n"
        "#ifndef GENAI_RATELIMIT_SCRIPT_SOURCE_H\n"
        "#define GENAI_RATELIMIT_SCRIPT_SOURCE_H\n"
        + "".join(script_definitions(prefix, path, storage)
                  for prefix, (path, storage) in SCRIPTS.items())
        + "#endif\n"
    )
    if not SCRIPT_HEADER.exists() or SCRIPT_HEADER.read_text() != content:
        SCRIPT_HEADER.write_text(content)


def build_extension() -> Extension:
    write_script_header()
    add_homebrew_pkg_config_path()
    include_dirs: list[str] = []
    library_dirs: list[str] = []
    libraries: list[str] = []
    missing: list[tuple[str, str]] = []
    found = []
    for pc_name, header, names in SYSTEM_LIBRARIES:
        flags = find_library(pc_name, header, names)
        if flags is None:
            missing.append((pc_name, header))
        else:
            found.append(flags)
    toolchain = missing_toolchain()
    if missing or toolchain:
        fail_missing(missing, toolchain)
    for inc, libdirs, libs in found:
        include_dirs += [d for d in inc if d not in include_dirs]
        library_dirs += [d for d in libdirs if d not in library_dirs]
        libraries += [lib for lib in libs if lib not in libraries]
    libraries.append("pthread")
    system_dirs = system_library_dirs()
    rpath = [d for d in library_dirs if os.path.realpath(d) not in system_dirs]

    compile_args = ["-std=c11", "-Wall", "-Wextra", "-fvisibility=hidden", "-D_GNU_SOURCE"]
    define_macros = [("Py_LIMITED_API", LIMITED_API)]
    if MACOS:
        define_macros.append(("RL_SYSTEM_UUID", "1"))
    link_args: list[str] = []
    if os.environ.get("GENAI_RATELIMIT_WERROR") == "1":
        compile_args.append("-Werror")
    if os.environ.get("GENAI_RATELIMIT_DEBUG") == "1" or os.environ.get("GENAI_RATELIMIT_SANITIZE") == "1":
        # RL_DEBUG_HOOKS: the failure injection and the wipe check the tests drive (see
        # csrc/base.h); never in a release build or a wheel.
        compile_args += ["-O0", "-g3", "-fno-omit-frame-pointer", "-DRL_DEBUG_HOOKS=1"]
    else:
        compile_args += ["-O2"]
    if os.environ.get("GENAI_RATELIMIT_SANITIZE") == "1":
        sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
        # Python's CFLAGS carry -fwrapv, which defines signed overflow and so turns UBSan's
        # signed-integer-overflow check off: the sanitized build wants it on.
        compile_args += sanitize + ["-fno-wrapv"]
        link_args += sanitize

    sources = sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc").glob("*.c"))
    return Extension(
        "genai_ratelimit._native",
        sources=sources,
        # The Limited API of CPython 3.10: the extension is _native.abi3.so and the wheel
        # cp310-abi3, one build for 3.10 and every later CPython. csrc/native.h refuses a
        # build without this exact define.
        define_macros=define_macros,
        py_limited_api=True,
        depends=[str(p.relative_to(HERE)) for p in (HERE / "csrc").glob("*.h")]
        + sorted({f"lua/{path.name}" for path, _ in SCRIPTS.values()})
        + [f"lua/lib/{path.name}" for path in sorted((HERE / "lua" / "lib").glob("*.lua"))],
        include_dirs=include_dirs,
        library_dirs=library_dirs,
        libraries=libraries,
        # A library found outside the system's directories (see find_library) must also be
        # the one loaded at run time, not a system copy of the same name: without an rpath
        # the dynamic loader would pick the system's libhiredis (0.14) for a build against
        # 1.x. Empty, so no rpath at all, for the normal build against system libraries.
        runtime_library_dirs=rpath,
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )


class BuildExtension(build_ext):
    """build_ext that leaves one _native in the build directory: a tree built before the
    Limited API still holds _native.cpython-3XX-*.so there, which the wheel would pack
    beside _native.abi3.so (and Python would import first)."""

    def run(self) -> None:
        for ext in self.extensions:
            built = Path(self.build_lib) / self.get_ext_filename(ext.name)
            for stale in built.parent.glob(ext.name.rpartition(".")[2] + ".*.so"):
                if stale.name != built.name:
                    stale.unlink()
        super().run()


setup(
    ext_modules=[build_extension()],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": LIMITED_API_TAG}},
)
