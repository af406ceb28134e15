"""vLLM's encoder-cache connector API read from its source, and what a connector class must
match of it: every abstract method defined, and every method it overrides taking the arguments
vLLM passes (names in order, keyword-only names, `*args` / `**kwargs`), with the same binding
(classmethod, staticmethod, property). Read with `ast`, so no vLLM needs to be importable: the
release GPU users install is a CUDA build that does not import on this machine."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

BASE = "vllm/distributed/ec_transfer/ec_connector/base.py"
BINDINGS = ("classmethod", "staticmethod", "property")


@dataclass(frozen=True)
class Method:
    name: str
    abstract: bool
    binding: str  # "method" or one of BINDINGS
    positional: tuple[str, ...]  # positional parameters in order, self/cls included
    required: frozenset[str]  # parameters without a default
    keyword_only: frozenset[str]
    var_args: bool
    var_kwargs: bool


def _decorators(fn: ast.FunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        node = d.func if isinstance(d, ast.Call) else d
        names.add(node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", ""))
    return names


def _method(fn: ast.FunctionDef) -> Method:
    a = fn.args
    positional = [p.arg for p in (*a.posonlyargs, *a.args)]
    with_default = set(positional[len(positional) - len(a.defaults) :]) if a.defaults else set()
    required = {p for p in positional if p not in with_default}
    required |= {p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None}
    decorators = _decorators(fn)
    binding = next((b for b in BINDINGS if b in decorators), "method")
    return Method(
        fn.name,
        "abstractmethod" in decorators,
        binding,
        tuple(positional),
        frozenset(required),
        frozenset(p.arg for p in a.kwonlyargs),
        a.vararg is not None,
        a.kwarg is not None,
    )


def methods(source: str, cls: str) -> dict[str, Method]:
    """The methods `cls` defines in `source`, by name."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                fn.name: _method(fn)
                for fn in node.body
                if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    raise LookupError(f"no class {cls} in the source")


def base_api(root: Path) -> dict[str, Method]:
    """`ECConnectorBase`'s methods in the vLLM tree (site-packages or an unpacked wheel) `root`."""
    return methods((root / BASE).read_text(), "ECConnectorBase")


def _accepts(base: Method, impl: Method) -> list[str]:
    """How `impl` fails to take the calls vLLM makes with `base`'s signature."""
    out = []
    if impl.positional[: len(base.positional)] != base.positional:
        out.append(f"positional parameters {impl.positional}, vLLM's {base.positional}")
    extra_required = impl.required - set(base.positional) - base.keyword_only
    if extra_required:
        out.append(f"requires {sorted(extra_required)}, which vLLM does not pass")
    missing_kw = base.keyword_only - impl.keyword_only - set(impl.positional)
    if missing_kw and not impl.var_kwargs:
        out.append(f"lacks keyword-only {sorted(missing_kw)}")
    if base.var_args and not impl.var_args:
        out.append("lacks *args")
    if base.var_kwargs and not impl.var_kwargs:
        out.append("lacks **kwargs")
    if base.binding != impl.binding:
        out.append(f"is a {impl.binding}, vLLM's a {base.binding}")
    return out


def mismatches(base: dict[str, Method], impl: dict[str, Method]) -> list[str]:
    """Every way `impl` (a connector's methods) breaks `base` (vLLM's API), one line each."""
    out = [
        f"{name}: abstract in vLLM, not defined"
        for name, m in sorted(base.items())
        if m.abstract and name not in impl
    ]
    for name, m in sorted(impl.items()):
        if name.startswith("_") and name != "__init__":
            continue  # the connector's own helpers
        if name not in base:
            out.append(f"{name}: not in vLLM's API, so vLLM never calls it")
            continue
        out += [f"{name}: {why}" for why in _accepts(base[name], m)]
    return out
