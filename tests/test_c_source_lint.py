"""Lints the C source in csrc/ against the house rules (docs: style.md, practices 1, 2, 13):
every file opens with a comment saying what it is for, no Python object lives in a static
variable (module state instead), the rooms' calls only go down a floor (no file calls a
function of a file that calls back into it, directly or around a circle; base.c calls no
room and includes base.h only), the built extension exports PyInit__native and nothing
else, and every file compiles warning-free with -Wall -Wextra -Werror in the release and the
debug configuration of setup.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

# Left out of make test-asan / test-hiredis1, and why (the markers are pyproject.toml's).
pytestmark = [
    pytest.mark.not_asan(reason="reads the C source: runs no C"),
    pytest.mark.no_hiredis1(reason="reads the C source: no hiredis path"),
]

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
C_FILES = sorted(CSRC.glob("*.c"))
ALL_FILES = sorted(CSRC.glob("*.[ch]"))


def strip_comments_and_literals(source: str) -> str:
    """The source with comments, string and char literals blanked (newlines kept)."""
    pattern = re.compile(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)

    def blank(match: re.Match[str]) -> str:
        text = match.group(0)
        if text.startswith("/"):
            return re.sub(r"[^\n]", " ", text)
        return text[0] + " " * (len(text) - 2) + text[-1]

    return pattern.sub(blank, source)


# A Python object type, as a pointer (PyObject *, PyTypeObject *) or a static type object.
_PY_TYPE = r"(?:struct\s+)?(?:Py\w*Object)\b"


def python_object_statics(source: str) -> list[str]:
    """Declarations of variables with static storage that hold Python objects: file-scope
    variables (static or not) and block-scope `static` ones. Function definitions and
    prototypes returning PyObject * are not variables and are not reported."""
    code = strip_comments_and_literals(source)
    code = re.sub(r"^[ \t]*#.*$", "", code, flags=re.M)  # preprocessor lines
    found: list[str] = []
    # Block-scope and file-scope `static` variables: the declarator ends in = ; [ or ,
    # (a function's name is followed by a parenthesis).
    static_var = re.compile(
        rf"\bstatic\s+(?:const\s+)?{_PY_TYPE}\s*(?:\*\s*(?:const\s+)?)*(\w+)\s*(?=[=;\[,])")
    found += [m.group(0).split("\n")[0].strip() + " ..." for m in static_var.finditer(code)]
    # File-scope declarations without `static` (exported globals).
    depth = 0
    statement = []
    for ch in code:
        if ch == "{":
            if depth == 0:
                statement = []
            depth += 1
        elif ch == "}":
            depth -= 1
            statement = []
        elif depth == 0:
            if ch == ";":
                text = " ".join("".join(statement).split())
                head = text.split("=", 1)[0]
                if ("(" not in head and not head.startswith(("static ", "extern ", "typedef "))
                        and re.search(rf"^(?:const\s+)?{_PY_TYPE}", head)):
                    found.append(text)
                statement = []
            else:
                statement.append(ch)
    return found


def exported_functions(source: str) -> set[str]:
    """The rl_* functions a file defines for the others: a name at the start of a line
    followed by "(" (the house style puts the return type on the line above), whose
    return type line does not say static."""
    code = strip_comments_and_literals(source)
    found = set()
    for match in re.finditer(r"^(rl_\w+)\(", code, re.M):
        before = code[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if "static" not in before.split():
            found.add(match.group(1))
    return found


def calls_between_rooms(sources: dict[str, str]) -> dict[str, dict[str, set[str]]]:
    """{file: {other file: the functions of other file it calls}}, over the files given
    ({name: source}); macros and a file's own functions are left out."""
    owner = {name: path for path, source in sources.items() for name in exported_functions(source)}
    graph: dict[str, dict[str, set[str]]] = {path: {} for path in sources}
    for path, source in sources.items():
        code = strip_comments_and_literals(source)
        for match in re.finditer(r"\b(rl_\w+)\s*\(", code):
            callee = owner.get(match.group(1))
            if callee is not None and callee != path:
                graph[path].setdefault(callee, set()).add(match.group(1))
    return graph


def call_circles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Every circle of the graph, each once (as the files met in order), by a depth-first
    search from every file."""
    circles: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def walk(path: list[str]) -> None:
        for callee in sorted(graph[path[-1]]):
            if callee == path[0]:
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    circles.append(path + [callee])
            elif callee not in path and callee > path[0]:
                walk(path + [callee])

    for start in sorted(graph):
        walk([start])
    return circles


def installed_extension() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("genai_ratelimit._native")
    assert spec is not None and spec.origin, "genai_ratelimit._native is not importable"
    path = Path(spec.origin)
    assert path.parent != REPO / "genai_ratelimit", (
        f"the tests import the extension from the source tree ({path}), not the installed package")
    return path


def extension_config(**env: str) -> dict[str, object]:
    """What setup.py would compile, and how, under the given environment switches. Runs
    setup.py in a child with setuptools.setup replaced by a recorder, so nothing is built."""
    code = (
        "import json, runpy, setuptools\n"
        "seen = {}\n"
        "setuptools.setup = lambda **kw: seen.update(kw)\n"
        "runpy.run_path('setup.py', run_name='__main__')\n"
        "ext = seen['ext_modules'][0]\n"
        "print(json.dumps({'sources': ext.sources, 'include_dirs': ext.include_dirs,\n"
        "                  'define_macros': ext.define_macros,\n"
        "                  'extra_compile_args': ext.extra_compile_args}))\n"
    )
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("GENAI_RATELIMIT_")}
    child_env.pop("LD_PRELOAD", None)
    child_env.update(env)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------ the checker

def test_the_static_checker_flags_python_objects_in_static_storage():
    source = """
    /* a comment: static PyObject *not_code; */
    static PyObject *cache;
    static PyTypeObject Foo_Type = { 0 };
    PyObject *exported_global = NULL;
    static PyObject *
    a_function(PyObject *self)
    {
        static PyObject *interned = NULL;
        PyObject *local = NULL;
        return local;
    }
    static PyObject *prototype(void);
    static const char *text = "static PyObject *in_a_string;";
    """
    found = python_object_statics(source)
    assert len(found) == 4, found
    assert any("cache" in f for f in found)
    assert any("Foo_Type" in f for f in found)
    assert any("exported_global" in f for f in found)
    assert any("interned" in f for f in found)


# ------------------------------------------------------------------------- the rules

def test_csrc_has_c_files():
    assert C_FILES, f"no C files under {CSRC}"


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.name)
def test_every_c_file_opens_with_a_comment(path):
    text = path.read_text(encoding="utf-8").lstrip()
    assert text.startswith(("/*", "//")), f"{path.name} must open with a comment saying what it is for"
    if path.name != "script_source.h":  # generated: its comment says so
        first = text[2:text.find("*/")] if text.startswith("/*") else text.splitlines()[0]
        assert len(first.split()) >= 8, f"{path.name}'s opening comment says too little: {first!r}"


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.name)
def test_no_python_object_lives_in_a_static_variable(path):
    found = python_object_statics(path.read_text(encoding="utf-8"))
    assert not found, (f"{path.name}: Python objects belong in the module state, not in static "
                       f"storage: {found}")


def test_the_call_checker_finds_a_circle_and_names_the_calls():
    sources = {
        "conn.c": "int\nrl_conn_run(void)\n{\n    return rl_proto_next() + rl_wipe();\n}\n",
        "proto.c": "int\nrl_proto_next(void)\n{\n    return rl_wipe();\n}\n"
                   "static int\nrl_proto_local(void)\n{\n    return rl_conn_run();\n}\n",
        "base.c": "void\nrl_wipe(void)\n{\n}\n",
    }
    graph = calls_between_rooms(sources)
    assert graph == {"conn.c": {"proto.c": {"rl_proto_next"}, "base.c": {"rl_wipe"}},
                     "proto.c": {"base.c": {"rl_wipe"}, "conn.c": {"rl_conn_run"}},
                     "base.c": {}}
    assert call_circles(graph) == [["conn.c", "proto.c", "conn.c"]]
    del sources["proto.c"]
    assert call_circles(calls_between_rooms(sources)) == []


def test_the_rooms_calls_only_go_down_a_floor():
    """conn.c -> proto.c -> script.c -> base.c: no room calls a room that calls it back,
    directly or around a circle (proto.c and script.c once called conn.c for errors, wipes
    and clocks, which now live in base.c)."""
    graph = calls_between_rooms({p.name: p.read_text(encoding="utf-8") for p in C_FILES})
    circles = call_circles(graph)
    detail = ["; ".join(f"{a} calls {b} ({', '.join(sorted(graph[a][b]))})"
                        for a, b in zip(circle, circle[1:], strict=False))
              for circle in circles]
    assert not circles, "the rooms call each other in a circle: " + " | ".join(detail)
    assert graph["base.c"] == {}, f"base.c must call no other room: {graph['base.c']}"


def test_the_base_room_sees_no_floor_above_it():
    for name in ("base.c", "base.h"):
        includes = re.findall(r'^\s*#\s*include\s+"([^"]+)"', (CSRC / name).read_text(), re.M)
        assert includes == ([] if name == "base.h" else ["base.h"]), (
            f"{name} includes {includes}: the ground floor must not see the rooms above it")


# A call of the Python API (a function or a macro: PyLong_AsLong(, Py_INCREF(, _PyArg_...).
PYTHON_CALL = re.compile(r"\b_?Py[A-Za-z0-9_]*\s*\(")


@pytest.mark.parametrize("path", C_FILES, ids=lambda p: p.name)
def test_a_c_files_name_says_whether_it_is_a_python_face(path):
    """py_*.c are the Python faces (GIL held, Python API); every other file calls none of the
    Python API, so the layout shows which C runs without Python (docs/architecture.md)."""
    calls = sorted(set(m.group(0).rstrip("( ") for m in
                       PYTHON_CALL.finditer(strip_comments_and_literals(path.read_text()))))
    if path.name.startswith("py_"):
        assert calls, f"{path.name} calls no Python API: it is not a Python face, rename it"
    else:
        assert calls == [], f"{path.name} calls the Python API ({calls[:5]}): a py_*.c file's work"


def test_the_extension_exports_only_its_init_function():
    nm = shutil.which("nm")
    assert nm, "nm (binutils) is needed to list the extension's exported symbols"
    so = installed_extension()
    listing = subprocess.run([nm, "-D", "--defined-only", str(so)], capture_output=True,
                             text=True, check=True).stdout
    exported = sorted(line.split()[-1] for line in listing.splitlines() if line.strip())
    assert exported == ["PyInit__native"], f"{so.name} exports {exported}"


@pytest.mark.parametrize("switches, hooks", [
    ({}, False), ({"GENAI_RATELIMIT_DEBUG": "1"}, True), ({"GENAI_RATELIMIT_SANITIZE": "1"}, True),
], ids=["release", "debug", "sanitize"])
def test_only_the_debug_and_sanitized_builds_compile_the_test_hooks(switches, hooks):
    """RL_DEBUG_HOOKS (failure injection, the wipe check) never reaches a release build."""
    flags = list(extension_config(**switches)["extra_compile_args"])  # type: ignore[arg-type]
    assert ("-DRL_DEBUG_HOOKS=1" in flags) == hooks, flags


@pytest.mark.parametrize("switches", [{}, {"GENAI_RATELIMIT_DEBUG": "1"}],
                         ids=["release", "debug"])
def test_every_c_file_compiles_with_wall_wextra_werror(switches, tmp_path):
    config = extension_config(**switches)
    flags = list(config["extra_compile_args"])  # type: ignore[arg-type]
    assert "-Wall" in flags and "-Wextra" in flags, f"setup.py dropped -Wall/-Wextra: {flags}"
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
    includes = [f"-I{d}" for d in [sysconfig.get_paths()["include"], *config["include_dirs"]]]  # type: ignore[misc]
    macros = [f"-D{name}" if value is None else f"-D{name}={value}"
              for name, value in config["define_macros"]]  # type: ignore[union-attr]
    sources = config["sources"]
    assert sorted(Path(REPO, s) for s in sources) == C_FILES  # type: ignore[union-attr]
    failures = []
    for source in sources:  # type: ignore[union-attr]
        obj = tmp_path / (Path(source).stem + ".o")
        result = subprocess.run([*compiler, "-fPIC", *flags, "-Werror", *includes, *macros,
                                 "-c", source, "-o", str(obj)],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        if result.returncode != 0 or result.stderr.strip():
            failures.append(f"{source}:\n{result.stderr}")
    assert not failures, "\n".join(failures)



# The calls whose spelling differs on macOS: named in csrc/base.c only, which has a branch for
# both. The macOS branch is compiled here with the Linux spellings hidden (no Mac runs here).
LINUX_ONLY = ("SOCK_CLOEXEC", "MSG_NOSIGNAL", "pthread_condattr_setclock", "explicit_bzero")


def test_only_the_base_room_names_the_linux_only_calls():
    offenders = [f"{path.name}: {name}" for path in C_FILES if path.name != "base.c"
                 for name in LINUX_ONLY if name in strip_comments_and_literals(path.read_text())]
    assert offenders == []


def test_the_base_rooms_macos_branch_compiles_with_the_linux_spellings_hidden(tmp_path):
    hide = tmp_path / "as_on_macos.h"
    hide.write_text("#include <sys/socket.h>\n#undef SOCK_CLOEXEC\n#undef MSG_NOSIGNAL\n"
                    "#define SO_NOSIGPIPE 0x1022\n")
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
    result = subprocess.run([*compiler, "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-D__APPLE__",
                             "-include", str(hide), str(CSRC / "base.c")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    assert "SO_NOSIGPIPE" in (CSRC / "base.c").read_text()  # the branch this compiled


# ------------------------------------------------------- the Limited API (abi3, 3.10+)

LIMITED_API = ["Py_LIMITED_API", "0x030A0000"]


def compile_snippet(tmp_path: Path, code: str,
                    macros: list[list[str | None]]) -> subprocess.CompletedProcess[str]:
    """Compiles `code` as setup.py compiles csrc/ (its flags and include directories, csrc/
    too), with -Werror and the given (name, value) macros instead of setup.py's."""
    config = extension_config()
    flags = list(config["extra_compile_args"])  # type: ignore[arg-type]
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
    includes = [f"-I{d}" for d in [sysconfig.get_paths()["include"], str(CSRC),
                                   *config["include_dirs"]]]  # type: ignore[misc]
    defines = [f"-D{name}" if value is None else f"-D{name}={value}" for name, value in macros]
    source = tmp_path / "snippet.c"
    source.write_text(code)
    return subprocess.run([*compiler, "-fPIC", *flags, "-Werror", *includes, *defines, "-c",
                           str(source), "-o", str(tmp_path / "snippet.o")],
                          capture_output=True, text=True, timeout=120)


def test_the_extension_is_built_against_the_limited_api_of_python_3_10():
    config = extension_config()
    assert config["define_macros"] == [LIMITED_API], (
        f"setup.py must define {LIMITED_API} (one abi3 wheel for 3.10+): {config['define_macros']}")
    so = installed_extension()
    assert so.name == "_native.abi3.so", f"{so.name} is not a stable-ABI extension"


@pytest.mark.parametrize("call", [
    "PyTuple_GET_ITEM(o, 0)",              # a macro reading the tuple's fields
    "Py_TYPE(o)->tp_name",                 # PyTypeObject is opaque
    "PyUnicode_AsUTF8(o)",                 # not in the stable ABI (AsUTF8AndSize is)
    "_PyObject_GetDictPtr(o)",             # a private function
])
def test_a_call_outside_the_limited_api_does_not_compile_with_setup_py_s_macros(tmp_path, call):
    code = ("#define PY_SSIZE_T_CLEAN\n#include <Python.h>\n"
            f"const void *rl_snippet(PyObject *o) {{ return (const void *)({call}); }}\n")
    assert compile_snippet(tmp_path, code, []).returncode == 0, f"{call} is not C API at all"
    macros = extension_config()["define_macros"]
    result = compile_snippet(tmp_path, code, macros)  # type: ignore[arg-type]
    assert result.returncode != 0, f"{call} compiled with setup.py's macros {macros}"


def test_native_h_refuses_a_build_without_the_limited_api_of_3_10(tmp_path):
    code = '#include "native.h"\nint rl_snippet(void) { return 0; }\n'
    assert compile_snippet(tmp_path, code, [LIMITED_API]).returncode == 0
    for macros in ([], [["Py_LIMITED_API", "0x030C0000"]]):
        result = compile_snippet(tmp_path, code, macros)
        assert result.returncode != 0 and "Py_LIMITED_API=0x030A0000" in result.stderr, (
            macros, result.stderr)
