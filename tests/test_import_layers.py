"""The package's imports form layers that only point down, with no cycle (docs/development.md).

Every `diffperf` module's intra-package imports are read from its AST (imports under
`if TYPE_CHECKING:` are ignored: they never run). A module may import a module of its own layer
or of a lower one; an import inside a function is allowed only for the optional heavy
dependencies (optax, matplotlib, pandas) and multi-process JAX, nothing else.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "diffperf"

#: Layers from the bottom. A module's layer is its subpackage's (or, at the top, its own name's).
LAYERS = [
    {"_checks", "_paths", "_types", "_stored_programs"},
    {"specs"},
    {"presets"},
    {"costs"},
    {"feasibility"},
    {"training", "inference"},
    {"serving"},
    {"explore"},
    {"design", "validation"},
    {"calibrate"},
    {"plots"},
    {"internal", "cli"},
    {"__init__"},
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return ids


#: Imports that may stay inside a function: the heavy dependencies (matplotlib, the `plot`
#: extra; optax, only for fitting and co-design; pandas, only where a table is built or read:
#: `import diffperf` and one prediction load none of them, `tests/test_import_cost.py`) and
#: multi-process JAX.
DEFERRED = ("optax", "matplotlib", "pandas", "jax.experimental.multihost_utils")


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the package modules it imports at run time, imports inside functions other
    than `DEFERRED` ones)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph, nested = {}, []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        top = {id(n) for n in tree.body}
        edges = set()
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.ImportFrom):
                base = _absolute(name, _is_package(path), node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            else:
                targets = [a.name for a in node.names]
            external = (node.module or "") if isinstance(node, ast.ImportFrom) and not node.level \
                else ",".join(a.name for a in node.names) if isinstance(node, ast.Import) else ""
            if id(node) not in top and not external.startswith(DEFERRED):
                nested.append(f"{name}:{node.lineno}")
            targets = [t for t in targets if t.split(".")[0] == "diffperf"]
            edges.update(t for t in targets if t != name)
        graph[name] = edges
    return graph, nested


def _layer(module: str) -> int:
    parts = module.split(".")
    return LEVEL["__init__"] if len(parts) == 1 else LEVEL[parts[1]]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_module_has_a_layer():
    graph, _ = import_graph()
    unknown = sorted(m for m in graph if len(m.split(".")) > 1 and m.split(".")[1] not in LEVEL)
    assert not unknown, f"modules outside the layers of this test: {unknown}"


def test_the_import_graph_has_no_cycle():
    graph, _ = import_graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_imports_point_down_only():
    graph, _ = import_graph()
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    if _layer(t) > _layer(m))
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_imports_are_at_module_level():
    _, nested = import_graph()
    assert not nested, f"imports inside functions (hoist them): {nested}"


def test_the_graph_is_read():
    """The walker sees the imports it should (guards against a test that passes vacuously)."""
    graph, _ = import_graph()
    assert "diffperf.specs._transformer" in graph["diffperf.training._step"]
    assert "diffperf.training._step" in graph["diffperf.explore._search_training"]
    assert len(graph) > 40
