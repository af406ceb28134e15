"""`mmferry bench [NAME ...|all]`: every benchmark in bench/, one table, JSON and a plot.

Names are the modules in bench/ (see bench/__init__.py for the contract they follow).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from pathlib import Path

SKIP = ("harness",)


def bench_root() -> Path | None:
    """The source checkout's bench/ folder (benchmarks are not installed with the package)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "bench" / "__init__.py").is_file() else None


def available(root: Path) -> list[str]:
    """Benchmark names: modules in bench/ other than the harness and private ones."""
    return sorted(
        p.stem
        for p in (root / "bench").glob("*.py")
        if not p.stem.startswith("_") and p.stem not in SKIP
    )


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    p.add_argument("--quick", action="store_true", help="short runs")
    p.add_argument("--json", metavar="FILE", help="every figure and round, as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="a chart of the ratios (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    """Run the named benchmarks; 2 for an unknown name, 1 if any benchmark failed."""
    root = bench_root()
    if root is None:
        print("mmferry bench needs a source checkout (the bench/ folder)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    names = available(root)
    wanted = names if not args.names or args.names == ["all"] else args.names
    unknown = [n for n in wanted if n not in names]
    if unknown:
        print(
            f"unknown benchmark {unknown[0]!r}; choose from {', '.join(names)} or all",
            file=sys.stderr,
        )
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401 - fail before hours of benchmarks, not after
        except ImportError:
            print("--plot needs matplotlib: pip install 'mmferry[plot]'", file=sys.stderr)
            return 2
    from bench import harness

    report = harness.Report()
    print(f"machine: {harness.machine()}", flush=True)
    failed = []
    for name in wanted:
        mod = importlib.import_module(f"bench.{name}")
        report.section(name)
        try:
            if hasattr(mod, "run"):
                mod.run(report, args.quick)
            elif mod.main(["--quick"] if args.quick else []) != 0:
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
