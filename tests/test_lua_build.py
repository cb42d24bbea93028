"""The scripts Redis runs are built from lua/ and nothing else: each script file names the
shared files of lua/lib/ it stands on ("-- include: lib/x.lua" lines), the build
(setup.py) prepends them in that order, and the extension embeds and sends exactly that
text, whose SHA1 is the one it calls. A script written over a storage names
"lib/{storage}_log.lua" and is embedded once per storage (one file per operation). No window
arithmetic is kept twice: a function is defined in one file only, and no run of lines of one
file repeats in another."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from genai_ratelimit import _native

LUA = Path(__file__).resolve().parent.parent / "lua"
INCLUDE = re.compile(r"^-- include: (\S+)$", re.MULTILINE)

# The extension's exported scripts: (SHA1 name, source name) -> (the file of lua/, the
# storage it is built over: its "lib/{storage}_log.lua" include names lib/zset_log.lua or
# lib/compact_log.lua).
EMBEDDED = {
    ("SCRIPT_SHA1", "SCRIPT_SOURCE"): ("sliding_window.lua", "zset"),
    ("PEEK_SHA1", "PEEK_SOURCE"): ("peek.lua", "zset"),
    ("RECONCILE_SHA1", "RECONCILE_SOURCE"): ("reconcile.lua", "zset"),
    ("RESET_SHA1", "RESET_SOURCE"): ("reset.lua", None),
    ("LEASE_SHA1", "LEASE_SOURCE"): ("lease.lua", None),
    ("COMPACT_SHA1", "COMPACT_SOURCE"): ("sliding_window.lua", "compact"),
    ("COMPACT_PEEK_SHA1", "COMPACT_PEEK_SOURCE"): ("peek.lua", "compact"),
    ("COMPACT_RECONCILE_SHA1", "COMPACT_RECONCILE_SOURCE"): ("reconcile.lua", "compact"),
    ("IN_FLIGHT_SHA1", "IN_FLIGHT_SOURCE"): ("reserve_in_flight.lua", "zset"),
    ("RECONCILE_RELEASE_SHA1", "RECONCILE_RELEASE_SOURCE"): ("reconcile_release.lua", "zset"),
    ("COMPACT_IN_FLIGHT_SHA1", "COMPACT_IN_FLIGHT_SOURCE"): ("reserve_in_flight.lua", "compact"),
    ("COMPACT_RECONCILE_RELEASE_SHA1", "COMPACT_RECONCILE_RELEASE_SOURCE"):
        ("reconcile_release.lua", "compact"),
    ("GCRA_SHA1", "GCRA_SOURCE"): ("gcra.lua", None),
    ("GCRA_WINDOWS_SHA1", "GCRA_WINDOWS_SOURCE"): ("gcra_windows.lua", "zset"),
    ("COMPACT_GCRA_WINDOWS_SHA1", "COMPACT_GCRA_WINDOWS_SOURCE"): ("gcra_windows.lua", "compact"),
    ("BUDGET_HOLD_SHA1", "BUDGET_HOLD_SOURCE"): ("budget_hold.lua", None),
    ("BUDGET_SETTLE_SHA1", "BUDGET_SETTLE_SOURCE"): ("budget_settle.lua", None),
    ("OBSERVE_SHA1", "OBSERVE_SOURCE"): ("observe_upstream.lua", None),
    ("QUEUE_SHA1", "QUEUE_SOURCE"): ("wait_queue.lua", None),
}
STORAGES = ("zset", "compact")
# What each storage's file defines for the scripts written over a storage (beside the
# log's methods, log.*): defined once per storage, used by the scripts without knowing which.
STORAGE_NAMES = ("KEYS_PER_WINDOW", "open_log", "TIE_NAMES_ENTRY")


def includes(name: str, storage: str | None) -> list[str]:
    """The shared files a script includes over a storage, in order."""
    text = (LUA / name).read_text(encoding="utf-8")
    return [included.replace("{storage}", storage or "") for included in INCLUDE.findall(text)]


def assembled(name: str, storage: str | None) -> str:
    """The shared files a script includes, in order, each ending in a newline, then its text."""
    parts = [(LUA / included).read_text(encoding="utf-8") for included in includes(name, storage)]
    text = (LUA / name).read_text(encoding="utf-8")
    return "".join(part if part.endswith("\n") else part + "\n" for part in parts) + text


@pytest.mark.parametrize(("names", "script"), list(EMBEDDED.items()),
                         ids=[f"{name}-{storage}" if storage else name
                              for name, storage in EMBEDDED.values()])
def test_an_embedded_script_is_its_includes_then_its_file(
        names: tuple[str, str], script: tuple[str, str | None]) -> None:
    sha_name, source_name = names
    source = getattr(_native, source_name)
    assert source == assembled(*script)
    assert getattr(_native, sha_name) == hashlib.sha1(source.encode()).hexdigest()


def test_every_script_of_lua_is_embedded() -> None:
    scripts = {path.name for path in LUA.glob("*.lua")}
    assert scripts == {name for name, _ in EMBEDDED.values()}


def test_a_script_over_a_storage_is_embedded_once_per_storage() -> None:
    """One file per operation: the twins of the two storages differ only in the storage's
    file their include names, so the rules of an operation are written once."""
    over: dict[str, set[str | None]] = {}
    for name, storage in EMBEDDED.values():
        over.setdefault(name, set()).add(storage)
    for name, storages in over.items():
        text = (LUA / name).read_text(encoding="utf-8")
        generic = any("{storage}" in line for line in INCLUDE.findall(text))
        assert storages == (set(STORAGES) if generic else {None}), name


@pytest.mark.parametrize("storage_name", STORAGES)
def test_each_storage_defines_what_the_scripts_use(storage_name: str) -> None:
    text = (LUA / "lib" / f"{storage_name}_log.lua").read_text(encoding="utf-8")
    for name in STORAGE_NAMES:
        assert re.search(rf"^local (?:function )?[\w, ]*\b{name}\b", text, re.MULTILINE), name


def test_a_shared_file_includes_nothing_and_is_used() -> None:
    used = {included for name, storage in EMBEDDED.values() for included in includes(name, storage)}
    for path in (LUA / "lib").glob("*.lua"):
        assert not INCLUDE.search(path.read_text(encoding="utf-8")), path.name
        assert f"lib/{path.name}" in used, f"lib/{path.name} is included by no script"


def _definitions(text: str) -> list[str]:
    return re.findall(r"^\s*(?:local\s+)?function\s+([\w.:]+)", text, re.MULTILINE)


def test_each_function_is_defined_once_in_lua() -> None:
    """A plain function once in all of lua/; a storage's method (log.trim, ...) once per
    storage: each of lib/zset_log.lua and lib/compact_log.lua implements the interface that
    lib/decide.lua, lib/set_cost.lua and the scripts drive."""
    seen: dict[str, str] = {}
    for path in sorted(LUA.rglob("*.lua")):
        where = path.relative_to(LUA).as_posix()
        for name in _definitions(path.read_text(encoding="utf-8")):
            key = f"{where}:{name}" if name.startswith("log.") or name in STORAGE_NAMES else name
            assert key not in seen, f"{name} is defined in {seen[key]} and in {where}"
            seen[key] = where


def _code_lines(path: Path) -> list[str]:
    """The file's lines of code, stripped, without comments and blank lines."""
    text = re.sub(r"--\[\[.*?\]\]", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    lines = (line.split("--", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line and line not in ("end", "else", "return log", "return log, now")]


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
