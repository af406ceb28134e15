"""The package's import graph: config is pure data, no import, at module level or inside a
function, closes a cycle between modules, and every import of an mmferry name resolves."""

from __future__ import annotations

import ast
import importlib
import sys
import types
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


# (lower, higher): packages the lower one never imports, in any form (type-only imports too:
# they are dependencies the reader follows). The proxy and vLLM's connector share the router
# from below (`mmferry.routing`); the service puts its store in front of its batcher, the
# store knows no service; a benchmark builds its tower without the command line's options.
LAYERED = [
    ("mmferry.engines", "mmferry.proxy"),
    ("mmferry.store", "mmferry.server"),
    ("mmferry.bench", "mmferry.commands"),
]


def test_lower_packages_import_no_higher_one():
    modules = _modules_of(PKG)
    up = []
    for lower, higher in LAYERED:
        for module, path in sorted(modules.items()):
            if module != lower and not module.startswith(lower + "."):
                continue
            for line, target, _ in _targets(path, module, higher):
                up.append(f"{path.relative_to(PKG.parent)}:{line} imports {target}")
    assert not up, "\n".join(up)


def _modules_of(pkg: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the package in folder `pkg`."""
    out = {}
    for path in pkg.rglob("*.py"):
        parts = path.relative_to(pkg.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(path: Path, module: str, package: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) for each thing an import statement in `path` takes from
    `package`, in every form: `import a.b [as c]` -> (a.b, None); `from a import x` and the
    relative forms -> (a, x); at any depth (inside functions, TYPE_CHECKING blocks)."""
    # The package a relative import starts from: the module's own for an __init__.py.
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out += [(node.lineno, base, a.name) for a in node.names]
    return [t for t in out if t[1] == package or t[1].startswith(package + ".")]


def _top_level(path: Path) -> tuple[set[str], dict[str, str], list[str]]:
    """What a module's source binds at its top level (under if / try / with / for too): names,
    lazy exports (name -> module, from `__getattr__ = lazy_exports(__name__, MAPPING)`) and
    the modules it star-imports."""
    names: set[str] = set()
    dicts: dict[str, dict[str, str]] = {}
    lazy: str | None = None
    stars: list[str] = []

    def bind(target: ast.AST) -> None:
        for n in ast.walk(target):
            if isinstance(n, ast.Name):
                names.add(n.id)

    def visit(body: list[ast.stmt]) -> None:
        nonlocal lazy
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for t in targets:
                    bind(t)
                value = stmt.value
                if isinstance(value, ast.Dict) and isinstance(targets[0], ast.Name):
                    dicts[targets[0].id] = {
                        k.value: v.value
                        for k, v in zip(value.keys, value.values)
                        if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)
                    }
                if (
                    isinstance(targets[0], ast.Name)
                    and targets[0].id == "__getattr__"
                    and isinstance(value, ast.Call)
                    and len(value.args) == 2
                    and isinstance(value.args[1], ast.Name)
                ):
                    lazy = value.args[1].id
            elif isinstance(stmt, ast.Import):
                names.update(a.asname or a.name.split(".")[0] for a in stmt.names)
            elif isinstance(stmt, ast.ImportFrom):
                for a in stmt.names:
                    if a.name == "*":
                        stars.append(stmt.module or "")
                    else:
                        names.add(a.asname or a.name)
            elif isinstance(stmt, (ast.For, ast.AsyncFor)):
                bind(stmt.target)
            elif isinstance(stmt, (ast.With, ast.AsyncWith)):
                for item in stmt.items:
                    if item.optional_vars is not None:
                        bind(item.optional_vars)
            for block in ("body", "orelse", "finalbody"):
                if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(getattr(stmt, block, []))
            for handler in getattr(stmt, "handlers", []):
                visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return names, dicts.get(lazy, {}) if lazy else {}, stars


def _defines(modules: dict[str, Path], module: str, name: str) -> bool:
    """Whether `module`'s source makes `name` importable from it (statically)."""
    if f"{module}.{name}" in modules:
        return True
    names, lazy, stars = _top_level(modules[module])
    if name in names:
        return True
    if name in lazy:
        return lazy[name] in modules and _defines(modules, lazy[name], name)
    return any(star in modules and _defines(modules, star, name) for star in stars)


def _imported(module: str) -> types.ModuleType | None:
    """The module, or None when it cannot be imported here (a dependency outside the package is
    missing, or a stale import inside it, which is reported where it stands)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _resolves(modules: dict[str, Path], module: str, name: str | None) -> bool:
    if module not in modules:
        return False
    if name is None:
        return True
    loaded = _imported(module)
    if loaded is not None:
        try:
            if hasattr(loaded, name) or _imported(f"{module}.{name}") is not None:
                return True
        except ImportError:  # a lazy export whose module cannot be imported here
            pass
    # Checked from the source: the module, or what it names, cannot be imported here.
    return _defines(modules, module, name)


def stale_imports(pkg: Path) -> list[str]:
    """Every import in the package in folder `pkg` of a name of that package that does not
    resolve: `path:line: module[.name]`."""
    modules = _modules_of(pkg)
    stale = []
    for module, path in sorted(modules.items()):
        for line, target, name in _targets(path, module, pkg.name):
            if not _resolves(modules, target, name):
                what = target if name is None else f"{target}.{name}"
                stale.append(f"{path.relative_to(pkg.parent)}:{line}: {what}")
    return stale


def test_every_import_of_an_mmferry_name_resolves():
    """Imports inside functions run late; a stale one (a moved name) fails here, not in use."""
    stale = stale_imports(PKG)
    assert not stale, "\n".join(stale)


def test_stale_imports_are_found_in_every_form(tmp_path, monkeypatch):
    """The check above, on a package holding one stale import of each form, reports each of
    them and nothing else, also in a module that cannot import (a dependency is missing)."""
    pkg = tmp_path / "probe"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": (
            "from mmferry._exports import lazy_exports\n"
            '_EXPORTS = {"lazy_ok": "probe.good", "lazy_gone": "probe.good"}\n'
            "__getattr__ = lazy_exports(__name__, _EXPORTS)\n"
        ),
        "good.py": "real = 1\n\n\ndef lazy_ok():\n    pass\n",
        "sub/__init__.py": "",
        "sub/deep.py": (
            "import probe.good\n"
            "import probe.gone_module\n"
            "import probe.sub.gone_too as g\n"
            "from .. import good, no_such_name\n"
            "from ..good import real, not_real\n"
            "from . import deep, absent_sibling\n"
            "from probe import lazy_ok, lazy_gone\n"
            "\n\n"
            "def late():\n"
            "    from probe.good import inside_gone\n"
        ),
        "optional.py": (
            "import a_dependency_that_is_not_installed\n"
            "from probe.good import real, opt_gone\n"
            "defined_here = 1\n"
        ),
        "user.py": "from probe.optional import defined_here, not_defined\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        found = stale_imports(pkg)
    finally:
        for name in [m for m in sys.modules if m == "probe" or m.startswith("probe.")]:
            del sys.modules[name]
    assert sorted(line.rsplit(" ", 1)[-1] for line in found) == sorted(
        [
            "probe.gone_module",
            "probe.sub.gone_too",
            "probe.no_such_name",
            "probe.good.not_real",
            "probe.sub.absent_sibling",
            "probe.lazy_gone",
            "probe.good.inside_gone",
            "probe.good.opt_gone",
            "probe.optional.not_defined",
        ]
    ), found
