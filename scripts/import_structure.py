"""The import structure of a package: its modules, the imports between them, floors and circles.

    python scripts/import_structure.py [PACKAGE_DIR ...]     (default: mtp_hooks)

A module is a room and an import of another module of the same packages an arrow (imports
inside functions count; those under ``if TYPE_CHECKING:`` do not, since they never run). A
room stands one floor above the highest room it imports, so a package without circles has as
many floors as its longest chain of imports. docs/contributing.md's table of the import
structure is counted this way; ``tests/core/test_house_rules.py`` holds the layers themselves.
"""

from __future__ import annotations

import ast
import pathlib
import sys


def modules(packages: list[pathlib.Path]) -> dict[str, pathlib.Path]:
    """Every module of ``packages`` by dotted name."""
    found = {}
    for package in packages:
        for path in package.rglob("*.py"):
            parts = path.relative_to(package.parent).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: pathlib.Path, known: set[str], lazy: bool = True) -> set[str]:
    """The modules of ``known`` that ``name`` imports: top-level imports (``try`` bodies
    included), and with ``lazy`` those inside functions too; never ``if TYPE_CHECKING:``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    statements = list(ast.parse(path.read_text()).body)
    while statements:
        node = statements.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            statements.extend(node.orelse)
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
        elif isinstance(node, ast.Try) or (lazy and isinstance(node, ast.If)):
            statements.extend(ast.iter_child_nodes(node))
        elif lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            statements.extend(ast.iter_child_nodes(node))
        elif lazy and isinstance(node, (ast.With, ast.For, ast.While, ast.ExceptHandler)):
            statements.extend(ast.iter_child_nodes(node))
    return {t for t in targets if t in known and t != name}


def structure(graph: dict[str, set[str]]) -> dict[str, int]:
    """Rooms, floors, arrows and the rooms that stand in a circle."""
    floors: dict[str, int] = {}
    open_: set[str] = set()
    circled: set[str] = set()

    def floor(name: str) -> int:
        if name in floors:
            return floors[name]
        open_.add(name)
        below = 0
        for target in graph[name]:
            if target in open_:  # an arrow back into the chain being climbed: a circle
                circled.update({name, target})
            else:
                below = max(below, floor(target))
        open_.discard(name)
        floors[name] = below + 1
        return below + 1

    highest = max((floor(name) for name in sorted(graph)), default=0)
    arrows = sum(len(targets) for targets in graph.values())
    return {"rooms": len(graph), "floors": highest, "arrows": arrows, "in circles": len(circled)}


def main(argv: list[str]) -> None:
    packages = [pathlib.Path(p).resolve() for p in argv or ["mtp_hooks"]]
    found = modules(packages)
    graph = {name: imports(name, path, set(found)) for name, path in found.items()}
    print(", ".join(f"{key} {value}" for key, value in structure(graph).items()))


if __name__ == "__main__":
    main(sys.argv[1:])
