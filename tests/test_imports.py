"""No import circles between eyas's modules.

Two graphs, read from the source with `ast` (nothing is imported but the packages): the module-level imports (what
runs when a module is first imported, `if TYPE_CHECKING:` blocks included: a reader and a type checker follow them
too), which must have no cycle at all; and every import, those deferred into functions too, where a cycle is a
layering problem even when Python never trips on it: none is allowed. And no test module imports another, at
module level or inside a function: shared helpers are in tests/tiny.py, shared fixtures in tests/conftest.py.
"""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import eyas


def eyas_modules() -> dict[str, Path]:
    """{module name: source file} for eyas and everything under it."""
    modules = {"eyas": Path(eyas.__file__)}
    for info in pkgutil.walk_packages(eyas.__path__, "eyas."):
        leaf = Path(info.module_finder.path) / info.name.rsplit(".", 1)[-1]
        modules[info.name] = leaf / "__init__.py" if info.ispkg else leaf.with_suffix(".py")
    return modules


def _module_level(body: list[ast.stmt]):
    """The statements a module runs on import: into if/try/with blocks, not into functions or classes' methods."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _module_level([n for n in getattr(node, field, []) if isinstance(n, ast.AST)])


def imported_modules(name: str, path: Path, modules: dict[str, Path], deferred: bool) -> set[str]:
    """The eyas modules `name` (at `path`) imports: at module level, or anywhere with `deferred`."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree) if deferred else _module_level(tree.body):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y, from .. import z
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for a in node.names:  # `from eyas.serve import app` imports the module eyas.serve.app
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                if target in modules:
                    out.add(target)
    out.discard(name)
    return out


MODULES = eyas_modules()


def import_graph(deferred: bool) -> dict[str, set[str]]:
    return {name: imported_modules(name, path, MODULES, deferred) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> dict[frozenset[str], list[str]]:
    """{modules of a strongly connected component (Tarjan), of more than one: a shortest cycle through its first
    module}; the cycle [a, b, c] reads a -> b -> c -> a."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return {component: _a_cycle(graph, component) for component in components}


def _a_cycle(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    """The shortest path from the component's first module back to itself (breadth first, within the component)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(component)} is not a cycle")


def describe(cycle: list[str]) -> str:
    return " -> ".join(cycle + cycle[:1])


def test_cycles_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert {members: describe(c) for members, c in cycles(graph).items()} == {
        frozenset("abc"): "a -> b -> c -> a"}
    assert cycles({"a": {"b"}, "b": set()}) == {}


def test_the_walk_sees_every_module():
    on_disk = set(Path(eyas.__file__).parent.rglob("*.py"))
    assert set(MODULES.values()) == on_disk
    assert {"eyas.engine_args", "eyas.sampling_params", "eyas.engine.grammar"} <= set(MODULES)
    # an edge the graph must see: the engine imports its sampling parameters
    assert "eyas.sampling_params" in import_graph(deferred=False)["eyas.engine.llm"]


def test_no_module_level_import_cycle():
    found = cycles(import_graph(deferred=False))
    assert not found, "module-level import cycles: " + "; ".join(describe(c) for c in found.values())


def test_no_import_cycle_counting_deferred_imports():
    found = cycles(import_graph(deferred=True))
    assert not found, "import cycles (deferred imports included): " + "; ".join(describe(c) for c in found.values())


# -- the test modules -----------------------------------------------------------------------------------------------

TESTS = Path(__file__).parent


def imported_test_modules(path: Path) -> set[str]:
    """The test modules of tests/ that the file at `path` imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return {name for name in out if name.startswith("test_") and (TESTS / f"{name}.py").is_file()}


def test_imported_test_modules_finds_planted_imports(tmp_path):
    path = tmp_path / "test_planted.py"
    path.write_text("import test_serve\nfrom tiny import running\n\n\ndef test_x():\n"
                    "    from test_eagle3 import write_draft\n")
    assert imported_test_modules(path) == {"test_serve", "test_eagle3"}


def test_no_test_module_imports_another():
    """What more than one test module needs lives in tests/tiny.py (helpers) or tests/conftest.py (fixtures), where
    a reader looks for it, not in the test module that happened to need it first."""
    found = {path.stem: sorted(imported) for path in sorted(TESTS.glob("test_*.py"))
             if (imported := imported_test_modules(path))}
    assert not found, "test modules importing test modules (move the helper to tiny.py or conftest.py): " + "; ".join(
        f"{module} imports {', '.join(imported)}" for module, imported in found.items())
