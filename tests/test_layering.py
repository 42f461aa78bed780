"""megapipe's imports run downward only, folder by folder (docs/layout.md), and its pure arithmetic imports no torch.

The import graph is read from the source (every ``import`` statement, the ones inside functions
included: an import deferred into a function is still a dependency, and deferring was how cycles
used to be hidden), so the test needs no imports of its own and sees optional packages too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import megapipe

pytestmark = pytest.mark.unit

PACKAGE = Path(megapipe.__file__).parent

# Bottom first, one top-level folder (or loose module) per unit. A unit may import its own modules and
# units of lower layers, nothing else: two units of one layer are independent of each other.
LAYERS = (
    ("errors",),
    ("optional", "json_http", "atomic_files"),
    ("launcher",),  # megapipe's side of torchrun: no torch until torchrun has imported it
    ("layout",),  # ranks, stage plans, placements: arithmetic
    ("schedules",),  # schedules as data (actions, descriptors, lowering, validators) and their simulator
    ("config",),  # the dataclasses a run is described by, each field with its flag
    ("parallel",),
    ("fusions",),
    ("tensor_parallel",),
    ("context_parallel",),  # attention over a sequence split over context ranks: kernels, ring, all-to-all
    ("models", "data"),
    ("optim",),
    ("pipeline",),  # the executor, transports, weight stores, the engine
    ("checkpointing",),
    ("inference", "planner", "lease", "replicas"),  # lease: a training job's side of the cluster service, and the
    # signing; replicas: fault-tolerant replicas' lighthouse, quorum and cross-replica groups
    ("cli",),  # flags, every cross-flag check, schedule selection: reads models, schedules and the planner
    ("training",),
    ("cluster",),  # Gavel: core, simulator, worker agents, the scheduler service
    ("acceptance", "testing"),
)
PURE = ("layout", "schedules")  # arithmetic that must run without torch


def module_name(path: Path) -> str:
    parts = ("megapipe",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The top-level folder (or loose module) ``module`` lives in."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "megapipe"


def packages_above(module: str) -> list[str]:
    """The packages whose ``__init__`` Python runs before ``module``: importing ``a.b.c`` runs ``a`` and ``a.b``."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def _type_checking_only(node: ast.If) -> bool:
    return isinstance(node.test, (ast.Name, ast.Attribute)) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports (``from a import b`` counts as ``a.b`` when that is a module)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in MODULES)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def loads(module: str, imported: set[str]) -> set[str]:
    """What importing ``module`` runs of megapipe: its imports and every package ``__init__`` above them."""
    found = {target for target in imported if target in MODULES}
    for target in list(found) + [module]:
        found.update(package for package in packages_above(target) if package in MODULES)
    return found - {module}


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
IMPORTS = {module: imports_of(path) for module, path in MODULES.items()}
GRAPH = {module: loads(module, imported) for module, imported in IMPORTS.items()}
LAYER = {unit: index for index, layer in enumerate(LAYERS) for unit in layer}


def test_every_unit_has_a_layer():
    units = {unit_of(module) for module in MODULES} - {"megapipe"}
    assert units <= set(LAYER), f"units without a layer: {sorted(units - set(LAYER))}; add them to LAYERS"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    upward = []
    for module, imported in sorted(graph.items()):
        unit = unit_of(module)
        for target in sorted(imported):
            if not target.startswith("megapipe.") or target not in MODULES:
                continue
            other = unit_of(target)
            if other != unit and LAYER.get(other, -1) >= LAYER.get(unit, -1):
                upward.append(f"{module} imports {target} ({unit} may not depend on {other})")
    return upward


def test_imports_run_downward_only():
    upward = upward_imports(GRAPH)
    assert not upward, "\n".join(upward)


def test_the_check_follows_package_inits():
    """Importing a deep module runs the ``__init__`` of every package above it, so the check counts those:
    a leased training process that imported ``cluster.x.y`` would load Gavel's ``cluster/__init__``."""
    loaded = loads("megapipe.training.trainer", {"megapipe.cluster.core.jobs"})
    assert {"megapipe.cluster", "megapipe.cluster.core"} <= loaded
    assert upward_imports({"megapipe.training.trainer": loaded})


def test_no_import_cycles_between_folders():
    """Counted by top-level folder, the units form no cycle either (the layers' order implies it; this names one)."""
    edges: dict[str, set[str]] = {unit: set() for unit in LAYER}
    for module, loaded in GRAPH.items():
        edges.setdefault(unit_of(module), set()).update(unit_of(target) for target in loaded)
    edges = {unit: targets - {unit, "megapipe"} for unit, targets in edges.items()}
    for targets in list(edges.values()):
        for target in targets:
            edges.setdefault(target, set())
    cycle = _find_cycle(edges)
    assert cycle is None, " -> ".join(cycle or [])


def test_no_import_cycles_between_modules():
    """Within a unit too, modules form no cycle (counting imports inside functions)."""
    edges = {m: {t for t in imports if t in MODULES and t != m} for m, imports in GRAPH.items()}
    for module in edges:  # a package's __init__ is imported by its modules' import; not an edge back
        edges[module] = {t for t in edges[module] if not module.startswith(t + ".")}
    cycle = _find_cycle(edges)
    assert cycle is None, " -> ".join(cycle or [])


def _find_cycle(edges: dict[str, set[str]]):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str):
        state[node] = 1
        stack.append(node)
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


@pytest.mark.parametrize("unit", PURE)
def test_pure_arithmetic_imports_no_torch(unit):
    """What ``unit`` reaches through megapipe's own imports imports neither torch nor numpy."""
    seen, todo, heavy = set(), [m for m in MODULES if unit_of(m) == unit], []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        heavy.extend(f"{module} imports {target}" for target in IMPORTS[module]
                     if target.split(".")[0] in ("torch", "numpy"))
        todo.extend(GRAPH[module])
    assert not heavy, "\n".join(sorted(heavy))
