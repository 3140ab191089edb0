"""The house rules that a reader relies on: short modules, and imports without cycles."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = [ROOT / "mtp_hooks", *sorted((ROOT / "plugins").glob("*/mtp_hooks_*"))]


def modules() -> dict[str, pathlib.Path]:
    """Every module of the library and the plugins, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            parts = path.relative_to(package.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imported_at_module_level(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` imports when it is imported: top-level imports,
    ``try`` bodies included, ``if TYPE_CHECKING:`` blocks and function bodies not."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    statements = list(ast.parse(path.read_text()).body)
    while statements:
        node = statements.pop()
        if isinstance(node, ast.Try):
            statements.extend(node.body)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                child = f"{module}.{alias.name}"
                targets.add(child if child in known else module)
        elif isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
    return {t for t in targets if t in known and t != name}


def test_every_module_stays_under_300_lines():
    long = {
        name: n
        for name, path in modules().items()
        if (n := len(path.read_text().splitlines())) >= 300
    }
    assert long == {}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module -> modules it imports), each as a path."""
    state: dict[str, str] = {}
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return found


def test_no_module_imports_itself_back_through_a_cycle():
    found = modules()
    graph = {name: imported_at_module_level(name, path, set(found)) for name, path in found.items()}
    assert graph["mtp_hooks.megatron._gate"] >= {"mtp_hooks._runtime", "mtp_hooks.megatron._calls"}
    assert any(name.startswith("mtp_hooks_verl") for name in graph)  # the plugins are read too
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle_of_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("from .a import x\n")
    (package / "c.py").write_text("if TYPE_CHECKING:\n    from . import a\n")
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    graph = {
        m: imported_at_module_level(m, package / f"{m[4:] or '__init__'}.py", known) for m in known
    }
    assert graph["pkg.c"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
