"""The package's modules form no import circle: a module never imports one that imports it back,
directly or through others, counting the imports inside functions (which hide a circle from Python
but not from a reader)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "crossalign"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of crossalign and the crossalign modules it imports anywhere in its text."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("crossalign"):
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    graph[name].add(submodule if submodule in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next((e for e in edges if e in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert len(graph) > 50 and graph["crossalign.report.compare"], "the graph holds the package's imports"
    assert circles(graph) == []


def test_the_step_table_and_the_sides_sit_below_the_store_tasks_and_flows():
    """dag.py (the step table, which the store reads) imports only the config and the sides' protocol; no side
    imports the step table, the tasks or the flows."""
    graph = import_graph()
    assert graph["crossalign.dag"] <= {"crossalign.config", "crossalign.sides.protocol"}, graph["crossalign.dag"]
    above = ("crossalign.dag", "crossalign.tasks", "crossalign.flows")
    reaching = {module: sorted(i for i in imported if i.startswith(above))
                for module, imported in graph.items() if module.startswith("crossalign.sides")}
    assert not {module: found for module, found in reaching.items() if found}, reaching


# The packages of crossalign from the bottom up: a package imports only from the layers below its own. ``sides``
# holds both frameworks' folders; neither of those imports the other.
LAYERS = [
    {"config", "versions", "dump_settings", "tensorio", "data"},
    {"site", "models", "hf_config", "patching"},
    {"sides"},
    {"dag", "logs", "preflight"},
    {"store", "checkpoint"},
    {"stop", "request", "diagnose", "agents"},
    {"report"},
    {"tasks"},
    {"flows"},
    {"cli"},
]


def package_of(module: str) -> str:
    """``crossalign.sides.megatron.backend`` -> ``sides``; a module at the top is its own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        packages.setdefault(package_of(module), set()).update(
            package_of(i) for i in imported if package_of(i) not in ("", package_of(module)))
    return packages


def test_no_package_imports_one_that_imports_it_back():
    packages = package_graph(import_graph())
    assert {"sides", "checkpoint", "diagnose", "tasks", "flows", "cli"} <= set(packages)
    assert circles(packages) == []


def test_every_package_imports_only_from_the_layers_below_it():
    layer = {package: depth for depth, group in enumerate(LAYERS) for package in group}
    packages = package_graph(import_graph())
    unplaced = sorted(set(packages) - set(layer) - {""})
    assert not unplaced, f"place these packages in LAYERS: {unplaced}"
    upward = {package: sorted(i for i in imported if layer[i] >= layer[package])
              for package, imported in packages.items() if package}
    assert not {package: found for package, found in upward.items() if found}, upward


def test_the_two_sides_never_import_each_other():
    graph = import_graph()
    for side, other in (("megatron", "mindformers"), ("mindformers", "megatron")):
        crossing = {module: sorted(i for i in imported if i.startswith(f"crossalign.sides.{other}"))
                    for module, imported in graph.items() if module.startswith(f"crossalign.sides.{side}")}
        assert not {module: found for module, found in crossing.items() if found}, crossing
