"""Every benchmark module imports and follows the runner contract (a stale import fails here)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "mmferry" / "bench"
MODULES = sorted(
    p.stem
    for p in BENCH.glob("*.py")
    if not p.stem.startswith("_") and p.stem not in {"harness", "plot"}
)
# Modules without a baseline to compare against print their own report instead of figures
# (pool is a model: its placements are compared with each other inside one report).
NO_FIGURES = {"stress", "pool"}


@pytest.mark.parametrize("name", MODULES)
def test_bench_module_imports_and_has_an_entry_point(name):
    mod = importlib.import_module(f"mmferry.bench.{name}")
    assert callable(mod.main)
    if name in NO_FIGURES:
        return
    assert list(inspect.signature(mod.run).parameters) == ["report", "quick"]
