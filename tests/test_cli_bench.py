"""`mmferry bench`: the modules it finds, its table and its plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import harness
from mmferry.commands.bench import available, bench_root

ROOT = Path(__file__).resolve().parents[1]


def _report() -> harness.Report:
    report = harness.Report(quiet=True)
    report.section("encoder")
    report.add(harness.Figure("forward", "transformers", [2.0, 2.2, 1.8, 2.0, 2.4], [1.0] * 5))
    report.section("load")
    report.add(
        harness.Figure.of_values(
            "requests/s", "transformers", 4.0, 12.0, unit="req/s", higher_is_better=True
        )
    )
    return report


def test_every_bench_module_is_found_and_none_else():
    names = available(bench_root())
    assert {"encoder", "load", "preprocess", "sharded"} <= set(names)
    assert "harness" not in names and "__init__" not in names
    assert not [n for n in names if n.startswith("_")], "helpers are not benchmarks"


def test_table_shows_baseline_ours_ratio_and_spread():
    lines = harness.table(_report()).splitlines()
    assert lines[0].split()[:3] == ["benchmark", "figure", "baseline"]
    row = next(ln for ln in lines if ln.startswith("encoder"))
    # baseline median 2000 ms (1800-2400), ours 1000 ms, ratio 2.00x (1.80-2.40) over 5 rounds
    assert "2000.00 ms (1800.00-2400.00)" in row and "2.00x (1.80-2.40)" in row
    assert row.rstrip().endswith("5")
    assert "3.00x" in next(ln for ln in lines if ln.startswith("load"))


def test_plot_writes_a_png(tmp_path):
    out = tmp_path / "bench.png"
    harness.plot(_report(), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_holds_every_round(tmp_path):
    out = tmp_path / "bench.json"
    _report().dump_json(out)
    doc = json.loads(out.read_text())
    assert doc["sections"]["encoder"][0]["base"] == [2.0, 2.2, 1.8, 2.0, 2.4]


def test_unknown_name_lists_the_real_ones():
    p = subprocess.run(
        [sys.executable, "-m", "mmferry", "bench", "transport-x"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert p.returncode == 2
    assert "unknown benchmark 'transport-x'" in p.stderr and "load" in p.stderr
