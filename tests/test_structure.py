"""The package's import graph: config is pure data, and no import, at module level or inside a
function, closes a cycle between modules."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "mmferry"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every mmferry module `path` imports, wherever the import statement sits."""
    out: set[str] = set()
    modules = {_module_name(p) for p in PKG.rglob("*.py")}
    tree = ast.parse(path.read_text())
    # Imports for type checkers only never run.
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from pkg import sub` imports the module pkg.sub (pkg itself is then its parent,
            # initialised first in any case); `from pkg import name` imports pkg.
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [n for n in subs if n in modules] or [node.module]
        else:
            continue
        out |= {n for n in names if n in modules}
    return out


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PKG.rglob("*.py")}


def test_config_imports_nothing_of_mmferry():
    assert _imports(PKG / "config.py") == set()


def test_no_import_closes_a_cycle():
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_every_import_of_an_mmferry_name_resolves():
    """Imports inside functions run late; a stale one (a moved name) fails here, not in use."""
    import importlib

    stale = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and not node.level):
                continue
            if node.module.split(".")[0] != "mmferry":
                continue
            try:
                module = importlib.import_module(node.module)
            except ImportError as e:
                if "mmferry" in str(e):
                    stale.append(f"{path.relative_to(PKG.parent)}: {node.module}: {e}")
                continue  # an optional dependency that is not installed
            for alias in node.names:
                if hasattr(module, alias.name):
                    continue
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    stale.append(f"{path.relative_to(PKG.parent)}: {node.module}.{alias.name}")
    assert not stale, "\n".join(stale)
