"""megapipe's imports run downward only (DESIGN idea 8), and its pure arithmetic imports no torch.

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

# Bottom first. A unit may import its own modules and units of lower layers, nothing else: two
# units of one layer are independent of each other.
LAYERS = (
    ("errors",),
    ("optional", "json_http", "atomic_files"),
    ("launcher",),  # megapipe's side of torchrun: no torch until torchrun has imported it
    ("layout",),
    ("pipeline.ir",),
    ("pipeline.analysis",),
    # config: the dataclasses low, their command line high
    ("config.flag", "config.sharding", "config.parser", "config.notes"),
    ("config.optimizer", "config.moe"),
    ("config.schema",),
    ("config.operations", "config.unread", "config"),
    ("parallel",),
    ("fusions",),
    ("tensor_parallel",),
    ("context_parallel",),  # attention over a sequence split over context ranks: kernels, ring, all-to-all
    ("models", "data"),
    ("optim",),
    ("pipeline.runtime",),
    ("checkpointing",),
    ("inference", "planner", "cluster.auth"),  # cluster.auth: the signing both the lease and the service use
    ("pipeline.selection", "cluster.client"),
    ("config.flags",),  # the flags, generated from the dataclasses and the model families' own
    ("config.checkpoint_args",),  # --use-checkpoint-args: the model shape of the --load checkpoint
    ("config.parse",),  # parse_config: flags, presets and every cross-flag check (the schedule search's too)
    ("training",),
    ("cluster.core",),
    ("cluster.sim", "cluster.worker"),
    ("cluster.service",),
    ("acceptance", "testing", "pipeline", "cluster"),  # "pipeline", "cluster": the packages' own __init__
)
SPLIT = ("pipeline", "cluster", "config")  # packages whose subpackages or modules are units of their own
PURE = ("layout", "pipeline.ir")  # arithmetic that must run without torch


def module_name(path: Path) -> str:
    parts = ("megapipe",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "megapipe"
    return ".".join(parts[:2]) if parts[0] in SPLIT and len(parts) > 1 else parts[0]


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


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
GRAPH = {module: imports_of(path) for module, path in MODULES.items()}
LAYER = {unit: index for index, layer in enumerate(LAYERS) for unit in layer}


def test_every_unit_has_a_layer():
    units = {unit_of(module) for module in MODULES} - {"megapipe"}
    assert units <= set(LAYER), f"units without a layer: {sorted(units - set(LAYER))}; add them to LAYERS"


def test_imports_run_downward_only():
    upward = []
    for module, imported in sorted(GRAPH.items()):
        unit = unit_of(module)
        for target in sorted(imported):
            if not target.startswith("megapipe.") or target not in MODULES:
                continue
            other = unit_of(target)
            if other != unit and LAYER.get(other, -1) >= LAYER.get(unit, -1):
                upward.append(f"{module} imports {target} ({unit} may not depend on {other})")
    assert not upward, "\n".join(upward)


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
        for target in GRAPH[module]:
            if target.split(".")[0] in ("torch", "numpy"):
                heavy.append(f"{module} imports {target}")
            elif target in MODULES:
                todo.append(target)
    assert not heavy, "\n".join(sorted(heavy))
