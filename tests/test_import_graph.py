"""No import circle anywhere in the package: module-level imports (``if TYPE_CHECKING:`` blocks and class bodies
included, function bodies not) form a graph without a cycle, and neither do all imports together: an import
deferred into a function body does not excuse a circle (a report module importing, for its types, the module that
runs the simulation and imports the report back when it finishes is still a circle).

The graph is read from the source (``ast``), never imported, so the integrations whose engine is not installed
here (``integrations/vllm``) are in it too.

An edge goes from a module to the deepest module an import names (``from .x import y`` names ``x``, or ``x.y``
when ``y`` is a submodule); parent packages, which Python imports on the way, are not edges of their own.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvcanary_cupy"


def _modules(root: Path) -> dict[str, Path]:
    """Dotted name of every module under the package ``root`` -> its file."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of the module, wherever it sits (function bodies included)."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements run when the module is imported: not those inside a function body."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))
    return found


def import_graph(root: Path, *, deferred: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level (``deferred``: or in a function body)."""
    find_imports = _all_imports if deferred else _module_level_imports
    modules = _modules(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in find_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem
                           for alias in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

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
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_package_has_no_import_circle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and "kvcanary_cupy.backends.numpy_plan" in graph
    assert circles(graph) == []


def test_no_circle_closes_through_an_import_deferred_into_a_function_body():
    graph = import_graph(PACKAGE, deferred=True)
    # the engines' integrations are read whether or not their engine is installed
    assert {"kvcanary_cupy.integrations.vllm.report", "kvcanary_cupy.integrations.vllm.simulate",
            "kvcanary_cupy.integrations.transformers.report"} <= set(graph)
    assert circles(graph) == []


def test_the_circle_finder_finds_a_circle_through_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import X\n")
    (pkg / "c.py").write_text("import pkg.a\n\ndef late():\n    from . import d\n")
    (pkg / "d.py").write_text("from . import c\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.d"] == {"pkg.c"}
    # c -> d sits in a function body: not a module-level edge, so d is outside the circle
    assert circles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    # counting deferred imports, c -> d is an edge and d joins the circle
    graph = import_graph(pkg, deferred=True)
    assert graph["pkg.c"] == {"pkg.a", "pkg.d"}
    assert circles(graph) == [["pkg.a", "pkg.c", "pkg.d", "pkg.sub.b"]]


def test_a_circle_closed_by_a_deferred_import_is_found_only_when_deferred_imports_count(tmp_path):
    """The shape of a report that imports the simulation for its types while the simulation imports the report
    inside the function that finishes the run."""
    pkg = tmp_path / "eng"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "report.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from .simulate import Sim\n\ndef build(sim: 'Sim') -> dict: ...\n")
    (pkg / "simulate.py").write_text("class Sim:\n    def run(self):\n        from .report import build\n"
                                     "        return build(self)\n")
    assert circles(import_graph(pkg)) == []
    assert circles(import_graph(pkg, deferred=True)) == [["eng.report", "eng.simulate"]]
