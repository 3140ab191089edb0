"""The house rules a reader relies on: imports go down the layers, with no cycles, and the
long files are the ones a single concept needs."""

from __future__ import annotations

import fnmatch
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the script contributors count the import structure with reads the imports, so the rules
# and the docs' table read them one way
_spec = importlib.util.spec_from_file_location(
    "import_structure", ROOT / "scripts/import_structure.py"
)
assert _spec is not None and _spec.loader is not None
import_structure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_structure)
PACKAGES = [ROOT / "mtp_hooks", *sorted((ROOT / "plugins").glob("*/mtp_hooks_*"))]

# The layers, lowest first. A module imports from its own layer or a lower one, at module level
# or inside a function (TYPE_CHECKING imports are annotations, and may point anywhere).
LAYERS = {
    "ground floor": [
        "mtp_hooks._errors", "mtp_hooks._env", "mtp_hooks._policy_snapshot", "mtp_hooks._runtime",
        "mtp_hooks._phases",
        "mtp_hooks._weights", "mtp_hooks._metrics", "mtp_hooks._forward_call",
        "mtp_hooks.hookspecs",
    ],
    # below the registry, which adds the hookspecs of the options installed distributions
    # contribute before it loads a plugin that implements one
    "policy options": [
        "mtp_hooks._plugin_checks", "mtp_hooks._policy_errors", "mtp_hooks._option_base",
        "mtp_hooks._options", "mtp_hooks._contributed_options",
    ],
    "plugin registry": ["mtp_hooks._plugin_registry", "mtp_hooks._roles"],
    "policy": [
        "mtp_hooks._phase_catalogue", "mtp_hooks._policy_entry",
        "mtp_hooks._policy",
        "mtp_hooks._sources", "mtp_hooks._decision", "mtp_hooks._explain", "mtp_hooks._loss_masks",
    ],
    "public faces below the adapters": [
        "mtp_hooks.plugins", "mtp_hooks.testing", "mtp_hooks.framework", "mtp_hooks.framework.*",
    ],
    "Megatron adapters": ["mtp_hooks.megatron", "mtp_hooks.megatron.*"],
    "the package": [
        "mtp_hooks", "mtp_hooks.__main__", "mtp_hooks.cli", "mtp_hooks._autostart",
        "mtp_hooks.demo", "mtp_hooks.demo.*",
    ],
    "framework plugins": ["mtp_hooks_*"],
}  # fmt: skip

# Files past about 300 lines, each because one concept needs the room.
LONG = {
    "mtp_hooks.megatron._gate": "the gate: one class, its two hooks and their bookkeeping",
    "mtp_hooks._options": "the policy options, one class each: checks, answers, plan, description",
    "mtp_hooks._option_base": "what an option is, and the Options record every layer reads",
    "mtp_hooks._policy": "the policy's grammar: a string, a mapping or a TOML file, every error",
    "mtp_hooks._plugin_registry": "the one PluginManager: loading, registration, each hook's call",
    "mtp_hooks_drafting.controller": "the AcceptanceController: its update, hooks and advice",
}


def modules(packages: list[pathlib.Path] = PACKAGES) -> dict[str, pathlib.Path]:
    """Every module of the library and the plugins, by dotted name."""
    return import_structure.modules(packages)


imports = import_structure.imports


def layer_of(name: str) -> int:
    found = [
        rank
        for rank, patterns in enumerate(LAYERS.values())
        if any(fnmatch.fnmatchcase(name, p) for p in patterns)
    ]
    assert len(found) == 1, f"{name} is in {len(found)} layers; give it exactly one"
    return found[0]


def upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports of ``graph`` that go from a lower layer to a higher one."""
    return sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(source)
    )


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


def test_no_import_goes_up_a_layer_not_even_inside_a_function():
    found = modules()
    graph = {name: imports(name, path, set(found), lazy=True) for name, path in found.items()}
    assert "mtp_hooks.megatron._ddp_settling" in graph["mtp_hooks.megatron._gate"]
    assert "mtp_hooks.megatron._phase_plan" in graph["mtp_hooks.megatron._attach"]  # a lazy one
    assert upward(graph) == []


def test_no_module_imports_itself_back_through_a_cycle():
    found = modules()
    graph = {name: imports(name, path, set(found), lazy=False) for name, path in found.items()}
    assert graph["mtp_hooks.megatron._gate"] >= {
        "mtp_hooks._runtime",
        "mtp_hooks.megatron._call_stack",
    }
    assert any(name.startswith("mtp_hooks_verl") for name in graph)  # the plugins are read too
    assert cycles(graph) == []


def test_every_name_in_the_layers_is_a_module_that_exists():
    # a module merged or removed leaves no name behind that could hide a later one
    names = modules()
    stale = [
        pattern
        for patterns in LAYERS.values()
        for pattern in patterns
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names)
    ]
    assert stale == []


def test_a_file_past_300_lines_is_one_concept_that_needs_the_room():
    long = {
        name: n
        for name, path in modules().items()
        if (n := len(path.read_text().splitlines())) >= 300 and name not in LONG
    }
    assert long == {}, "split these by concept, or name the one concept in LONG"
    assert all(len(modules()[name].read_text().splitlines()) >= 300 for name in LONG)


def test_the_checks_find_a_cycle_and_an_upward_lazy_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("from .a import x\n")
    (package / "c.py").write_text("if TYPE_CHECKING:\n    from . import a\n")
    (package / "d.py").write_text("def f():\n    from . import a\n")
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"}
    found = modules([package])
    eager = {m: imports(m, found[m], known, lazy=False) for m in known}
    lazy = {m: imports(m, found[m], known, lazy=True) for m in known}
    assert eager["pkg.c"] == lazy["pkg.c"] == set()
    assert (eager["pkg.d"], lazy["pkg.d"]) == (set(), {"pkg.a"})
    assert cycles(eager) == [["pkg.a", "pkg.b", "pkg.a"]]
    LAYERS["test: low"], LAYERS["test: high"] = ["pkg.d"], ["pkg.a"]
    try:
        assert upward({"pkg.d": lazy["pkg.d"]}) == ["pkg.d -> pkg.a"]
    finally:
        del LAYERS["test: low"], LAYERS["test: high"]


def test_no_two_test_modules_share_a_basename():
    # pytest imports test modules by basename (no __init__.py in tests/): a second module of
    # the same name stops the whole collection with "import file mismatch"
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
