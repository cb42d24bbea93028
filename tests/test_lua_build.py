"""The scripts Redis runs are built from lua/ and nothing else: each script file names the
shared files of lua/lib/ it stands on ("-- include: lib/x.lua" lines), the build
(setup.py) prepends them in that order, and the extension embeds and sends exactly that
text, whose SHA1 is the one it calls. No window arithmetic is kept twice: a function is
defined in one file only, and no run of lines of one file repeats in another."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from genai_ratelimit import _native

LUA = Path(__file__).resolve().parent.parent / "lua"
INCLUDE = re.compile(r"^-- include: (\S+)$", re.MULTILINE)

# The extension's exported scripts: (SHA1 name, source name) -> the file of lua/.
EMBEDDED = {
    ("SCRIPT_SHA1", "SCRIPT_SOURCE"): "sliding_window.lua",
    ("PEEK_SHA1", "PEEK_SOURCE"): "peek.lua",
    ("RECONCILE_SHA1", "RECONCILE_SOURCE"): "reconcile.lua",
    ("RESET_SHA1", "RESET_SOURCE"): "reset.lua",
    ("LEASE_SHA1", "LEASE_SOURCE"): "lease.lua",
    ("COMPACT_SHA1", "COMPACT_SOURCE"): "compact_window.lua",
    ("COMPACT_PEEK_SHA1", "COMPACT_PEEK_SOURCE"): "compact_peek.lua",
    ("COMPACT_RECONCILE_SHA1", "COMPACT_RECONCILE_SOURCE"): "compact_reconcile.lua",
    ("IN_FLIGHT_SHA1", "IN_FLIGHT_SOURCE"): "reserve_in_flight.lua",
    ("RECONCILE_RELEASE_SHA1", "RECONCILE_RELEASE_SOURCE"): "reconcile_release.lua",
    ("COMPACT_IN_FLIGHT_SHA1", "COMPACT_IN_FLIGHT_SOURCE"): "compact_reserve_in_flight.lua",
    ("COMPACT_RECONCILE_RELEASE_SHA1", "COMPACT_RECONCILE_RELEASE_SOURCE"):
        "compact_reconcile_release.lua",
    ("GCRA_SHA1", "GCRA_SOURCE"): "gcra.lua",
}


def assembled(name: str) -> str:
    """The shared files a script includes, in order, each ending in a newline, then its text."""
    text = (LUA / name).read_text(encoding="utf-8")
    parts = [(LUA / included).read_text(encoding="utf-8") for included in INCLUDE.findall(text)]
    return "".join(part if part.endswith("\n") else part + "\n" for part in parts) + text


@pytest.mark.parametrize(("names", "script"), list(EMBEDDED.items()), ids=list(EMBEDDED.values()))
def test_an_embedded_script_is_its_includes_then_its_file(names: tuple[str, str], script: str) -> None:
    sha_name, source_name = names
    source = getattr(_native, source_name)
    assert source == assembled(script)
    assert getattr(_native, sha_name) == hashlib.sha1(source.encode()).hexdigest()


def test_every_script_of_lua_is_embedded() -> None:
    scripts = {path.name for path in LUA.glob("*.lua")}
    assert scripts == set(EMBEDDED.values())


def test_a_shared_file_includes_nothing_and_is_used() -> None:
    used = {name for script in EMBEDDED.values()
            for name in INCLUDE.findall((LUA / script).read_text(encoding="utf-8"))}
    for path in (LUA / "lib").glob("*.lua"):
        assert not INCLUDE.search(path.read_text(encoding="utf-8")), path.name
        assert f"lib/{path.name}" in used, f"lib/{path.name} is included by no script"


def _definitions(text: str) -> list[str]:
    return re.findall(r"^\s*(?:local\s+)?function\s+([\w.:]+)", text, re.MULTILINE)


def test_each_function_is_defined_once_in_lua() -> None:
    """A plain function once in all of lua/; a storage's method (log.trim, ...) once per
    storage: each of lib/zset_log.lua and lib/compact_log.lua implements the interface that
    lib/decide.lua and lib/set_cost.lua drive."""
    seen: dict[str, str] = {}
    for path in sorted(LUA.rglob("*.lua")):
        where = path.relative_to(LUA).as_posix()
        for name in _definitions(path.read_text(encoding="utf-8")):
            key = f"{where}:{name}" if name.startswith("log.") else name
            assert key not in seen, f"{name} is defined in {seen[key]} and in {where}"
            seen[key] = where


def _code_lines(path: Path) -> list[str]:
    """The file's lines of code, stripped, without comments and blank lines."""
    text = re.sub(r"--\[\[.*?\]\]", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    lines = (line.split("--", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line and line not in ("end", "else", "return log")]


def test_no_run_of_code_lines_is_copied_between_files() -> None:
    """Four consecutive lines of code in two files is a copy: share them in lua/lib/."""
    run = 4
    where: dict[tuple[str, ...], str] = {}
    for path in sorted(LUA.rglob("*.lua")):
        lines = _code_lines(path)
        name = path.relative_to(LUA).as_posix()
        for start in range(len(lines) - run + 1):
            block = tuple(lines[start:start + run])
            assert where.get(block, name) == name, \
                f"these lines are in {where[block]} and in {name}:\n" + "\n".join(block)
            where[block] = name
