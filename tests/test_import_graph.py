"""The package's import graph, read from the source (ast), not by importing: no module imports
another that imports it back (directly or around a circle), the core never imports the HTTP
floor (genai_ratelimit.fastapi), and no function imports a module of the package lazily to get
around a circle. Imports under `if TYPE_CHECKING:` are typing only and do not count."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "genai_ratelimit"
PACKAGE = "genai_ratelimit"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}
# Compiled modules (the C extension), known by their stubs: leaves of the graph.
COMPILED = {module_name(path) for path in PACKAGE_DIR.rglob("*.pyi")} - set(MODULES)


def resolve(importer: str, is_package: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The package's modules that an import statement names (a name imported from a package
    counts as its submodule when there is one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE]
    if node.level:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != PACKAGE:
        return []
    names = [f"{target}.{alias.name}" for alias in node.names
             if f"{target}.{alias.name}" in MODULES or f"{target}.{alias.name}" in COMPILED]
    return names or [target]


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str) -> tuple[set[str], list[tuple[int, str]]]:
    """(module-level imports of the package's modules, [(line, module)] imported inside
    functions)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    top: set[str] = set()
    lazy: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child.test):
                for other in child.orelse:
                    visit(other, in_function)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                for target in resolve(name, is_package, child):
                    if in_function:
                        lazy.append((child.lineno, target))
                    else:
                        top.add(target)
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(tree, False)
    return top, lazy


GRAPH = {name: imports_of(name) for name in MODULES}


def test_http_only_modules_live_under_fastapi() -> None:
    """What serves only the HTTP floor lives in it: a root module that imports the floor is one
    of its public faces (a re-export, no code of its own), and nothing of the core imports it."""
    faces = {name for name, (top, _) in GRAPH.items() if not name.startswith(f"{PACKAGE}.fastapi")
             and any(t.startswith(f"{PACKAGE}.fastapi") for t in top)}
    assert faces <= HTTP_FLOOR_FACES
    for name in faces:
        tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
        assert all(isinstance(node, ast.ImportFrom | ast.Assign) or (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) for node in tree.body), name
    importers = [name for name, (top, _) in GRAPH.items() if HTTP_FLOOR_FACES & top
                 and not name.startswith(f"{PACKAGE}.fastapi")]
    assert importers == []


def test_the_graph_is_read() -> None:
    # A reader that found nothing would pass every test below.
    assert "genai_ratelimit.fastapi._dependency" in GRAPH["genai_ratelimit.fastapi"][0]
    assert "genai_ratelimit.limiter" in GRAPH["genai_ratelimit"][0]
    assert "genai_ratelimit._native" in COMPILED


def test_no_import_circle_in_the_package() -> None:
    edges = {name: {t for t in top if t in MODULES and t != name} for name, (top, _) in GRAPH.items()}
    # A submodule's parent package runs first when the submodule is imported, but that is
    # Python's order, not a dependency of the submodule's code: only written imports count.
    circles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                circles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                walk(target)
        stack.pop()
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            walk(name)
    # A package's __init__ importing its own submodules, which import a sibling through the
    # package, is the one shape allowed: parent -> child -> parent is how re-exports work.
    real = [c for c in circles
            if not all(a.startswith(b + ".") or b.startswith(a + ".") for a, b in itertools.pairwise(c))]
    assert real == [], "import circles: " + "; ".join(" -> ".join(c) for c in real)


# The HTTP floor: genai_ratelimit.fastapi and the public re-exports of its parts.
HTTP_FLOOR_FACES = {f"{PACKAGE}.proxies"}


def test_the_core_never_imports_the_http_floor() -> None:
    offenders = []
    for name, (top, lazy) in GRAPH.items():
        if name.startswith(f"{PACKAGE}.fastapi") or name in HTTP_FLOOR_FACES:
            continue
        for target in sorted(top) + [t for _, t in lazy]:
            if target == f"{PACKAGE}.fastapi" or target.startswith(f"{PACKAGE}.fastapi."):
                offenders.append(f"{name} imports {target}")
    assert offenders == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_function_imports_a_module_of_the_package(name: str) -> None:
    """A lazy import of the package's own code hides a circle or a floor crossed upward.
    (Optional third-party imports inside functions are fine and not looked at.)"""
    _, lazy = GRAPH[name]
    allowed = LAZY_ALLOWED.get(name, set())
    assert [f"line {line}: {target}" for line, target in lazy if target not in allowed] == []


# The lazy imports that remain, each with its reason; the list only shrinks.
LAZY_ALLOWED: dict[str, set[str]] = {}
