"""`mmferry bench [NAME ...|all]`: every benchmark of `mmferry.bench`, one table, JSON and a plot.

Names are the modules of `mmferry/bench/` (see its `__init__.py` for the contract they follow).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import shlex
import sys
import traceback

# harness: the runner; plot: charts from their JSON (`python -m mmferry.bench.plot`).
SKIP = ("harness", "plot")


def available() -> list[str]:
    """Benchmark names: modules of `mmferry.bench` other than the harness and private ones."""
    import mmferry.bench

    return sorted(
        m.name
        for m in pkgutil.iter_modules(mmferry.bench.__path__)
        if not m.name.startswith("_") and m.name not in SKIP
    )


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    p.add_argument("--quick", action="store_true", help="short runs")
    p.add_argument("--json", metavar="FILE", help="every figure and round, as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="a chart of the ratios (needs matplotlib)")
    p.add_argument(
        "--args",
        default="",
        metavar="'OPTIONS'",
        help="options for the one benchmark named, passed to its own main "
        "(e.g. mmferry bench pool --args='--zipf 0.8 --plot pool.png')",
    )


def run(args: argparse.Namespace) -> int:
    """Run the named benchmarks; 2 for an unknown name, 1 if any benchmark failed."""
    names = available()
    wanted = names if not args.names or args.names == ["all"] else args.names
    unknown = [n for n in wanted if n not in names]
    if unknown:
        print(
            f"unknown benchmark {unknown[0]!r}; choose from {', '.join(names)} or all",
            file=sys.stderr,
        )
        return 2
    extra = shlex.split(args.args)
    if extra and (
        len(wanted) != 1 or hasattr(importlib.import_module(f"mmferry.bench.{wanted[0]}"), "run")
    ):
        print("--args needs exactly one benchmark named, one with its own main", file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401 - fail before hours of benchmarks, not after
        except ImportError:
            print("--plot needs matplotlib: pip install 'mmferry[plot]'", file=sys.stderr)
            return 2
    from mmferry.bench import harness

    report = harness.Report()
    print(f"machine: {harness.machine()}", flush=True)
    failed = []
    for name in wanted:
        mod = importlib.import_module(f"mmferry.bench.{name}")
        report.section(name)
        try:
            if hasattr(mod, "run"):
                mod.run(report, args.quick)
            elif mod.main((["--quick"] if args.quick else []) + extra) != 0:
                failed.append(name)
        except Exception:  # noqa: BLE001 - one failing benchmark must not hide the others
            traceback.print_exc()
            failed.append(name)
    if any(report.sections.values()):
        print("\n" + harness.table(report))
    if args.json:
        report.dump_json(args.json)
    if args.plot and any(report.sections.values()):
        harness.plot(report, args.plot)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
