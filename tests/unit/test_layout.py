"""The package layout holds: who may import whom, and no import cycle.

Read from the source (every import statement, inside functions and
`TYPE_CHECKING` blocks too), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("contracts", "shared", "services", "launch", "kvlane", "loadtest", "benchmarks")
# A worker role's entry point runs the worker service under another role: the one import across services.
ROLE_ENTRY_POINTS = {"services.decode_worker.__main__", "services.prefill_worker.__main__"}
# What each library may build on, besides itself and third-party packages.
ALLOWED_BELOW = {
    "contracts": set(),
    "shared": {"contracts"},
    "services": {"contracts", "shared"},
    "launch": {"contracts", "shared"},
}
# Benchmarks that measure a service process itself, and so start its wiring.
MEASURES_A_SERVICE = {"benchmarks.vllm_worker_cpu_bench"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = _modules()


def _imported(name: str, path: Path) -> Iterator[str]:
    """The project modules `name` imports (a `from package import module` counts as the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


GRAPH = {name: set(_imported(name, path)) for name, path in MODULES.items()}


def _edges() -> Iterator[tuple[str, str]]:
    for name, imported in sorted(GRAPH.items()):
        for target in sorted(imported):
            yield name, target


def test_the_graph_is_read() -> None:
    # A parse that found nothing would pass every rule below.
    assert "services.balancer.router" in GRAPH["services.balancer.service"]
    assert "launch.launcher" in GRAPH["launch.fleet"]


@pytest.mark.parametrize("library", sorted(ALLOWED_BELOW))
def test_a_library_imports_only_what_lies_below_it(library: str) -> None:
    wrong = [f"{name} -> {target}" for name, target in _edges()
             if name.split(".")[0] == library and target.split(".")[0] not in ALLOWED_BELOW[library] | {library}]
    assert not wrong, f"{library} may build only on {sorted(ALLOWED_BELOW[library])}: {wrong}"


def test_services_do_not_import_each_other() -> None:
    wrong = [f"{name} -> {target}" for name, target in _edges()
             if name.startswith("services.") and target.startswith("services.")
             and name.split(".")[1] != target.split(".")[1] and name not in ROLE_ENTRY_POINTS]
    assert not wrong, f"a service imports only contracts/, shared/ and its own package: {wrong}"


def test_tools_drive_service_cores_not_service_wiring() -> None:
    """The simulator and the benchmarks run the services' pure cores; a service's process wiring is its own."""
    wiring = {"main", "service", "__main__"}
    wrong = [f"{name} -> {target}" for name, target in _edges()
             if name.split(".")[0] in ("loadtest", "benchmarks") and name not in MEASURES_A_SERVICE
             and target.startswith("services.") and target.rpartition(".")[2] in wiring]
    assert not wrong, f"import the core, not the process wiring: {wrong}"


def test_no_import_cycle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(name: str) -> None:  # Tarjan's strongly connected components
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in GRAPH[name]:
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = []
            while not component or component[-1] != name:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    assert not cycles, f"import cycles: {cycles}"
