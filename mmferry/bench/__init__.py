"""Benchmarks, one module per stage, run by `mmferry bench [NAME ...|all]`.

The runner contract. A benchmark is a module `mmferry/bench/NAME.py` (not `harness.py`, not starting
with `_`) that defines

    def run(report: mmferry.bench.harness.Report, quick: bool) -> None

which measures with `mmferry.bench.harness.compare` (product and baseline interleaved per round, at
least five rounds, warm-up excluded), checks outputs equal (`check_equal`, or states its
tolerance in the figure's note) BEFORE timing, and adds each `Figure` with `report.add`. It
may call `report.section(...)` for sub-sections; the runner opens a section named NAME first.
`quick=True` asks for a short run (CI, `make bench` on a laptop). A mismatch raises; the runner
reports it and carries on with the next module.

For a standalone run, end the module with

    def main(argv: list[str] | None = None) -> int:
        return harness.main_for(run, argv, __doc__.splitlines()[0])

which gives `python -m mmferry.bench.NAME [--quick] [--json FILE]`. The runner collects every
module's figures into one table, `--json FILE` and `--plot FILE.png`. A module with only
`main(argv) -> int` still runs (with `--quick` when asked) but its figures stay out of the table.
"""
