"""The simulator's modules import each other without a circle (TYPE_CHECKING imports included), so each can
be read, tested and changed on its own; the runtime never imports the simulator."""

from __future__ import annotations

import ast
from pathlib import Path

import kvcanary_cupy

PACKAGE = Path(kvcanary_cupy.__file__).resolve().parent


def local_imports(path: Path) -> set[str]:
    """Sibling modules ``path`` imports (``from .x import ...``), wherever the import stands."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_the_simulator_modules_form_no_import_circle():
    sim = PACKAGE / "sim"
    graph = {p.stem: local_imports(p) for p in sim.glob("*.py") if p.stem != "__init__"}
    assert {"runner", "replay", "report", "engine", "allocator", "radix", "kvstore", "requests",
            "workload"} <= set(graph)
    done: set[str] = set()

    def visit(module: str, stack: tuple[str, ...]) -> None:
        assert module not in stack, f"import circle: {' -> '.join((*stack, module))}"
        if module in done:
            return
        for dep in graph.get(module, ()):
            visit(dep, (*stack, module))
        done.add(module)

    for module in graph:
        visit(module, ())


def test_the_runtime_does_not_import_the_simulator():
    for path in (PACKAGE / "runtime").glob("*.py"):
        text = path.read_text()
        assert "sim" not in {n.module.split(".")[0] for n in ast.walk(ast.parse(text))
                             if isinstance(n, ast.ImportFrom) and n.level == 2 and n.module}, path
