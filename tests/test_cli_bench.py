"""`mmferry bench`: the modules it finds, its table and its plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mmferry.bench import harness
from mmferry.commands.bench import available

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
    names = available()
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


def test_interleave_rotates_the_order_and_counts_every_round():
    calls: list[str] = []

    def side(name: str):
        def run() -> float:
            calls.append(name)
            return float(len(calls))

        return run

    times = harness.interleave({k: side(k) for k in "abc"}, rounds=5, warmup=1)
    assert calls[:3] == ["a", "b", "c"]  # the warm-up, left out of the times
    rounds = [calls[3 + 3 * r : 6 + 3 * r] for r in range(5)]
    assert rounds[0] == ["a", "b", "c"] and rounds[1] == ["b", "c", "a"]
    assert rounds[2] == ["c", "a", "b"] and rounds[3] == rounds[0]
    assert {k: len(v) for k, v in times.items()} == {"a": 5, "b": 5, "c": 5}
    assert times["b"][1] == 7.0  # round 2 ran b first: the seventh call in all
    with pytest.raises(ValueError, match="at least 5 rounds"):
        harness.interleave({"a": side("a")}, rounds=2)


def test_timed_returns_the_seconds_of_one_call():
    seconds = harness.timed(lambda: sum(range(10_000)))()
    assert 0.0 < seconds < 5.0
