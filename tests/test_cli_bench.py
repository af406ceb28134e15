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
    assert lines[0].split()[:3] == ["baseline", "baseline", "value"]
    row = lines[lines.index("  forward") + 1]
    # baseline median 2000 ms (1800-2400), ours 1000 ms, ratio 2.00x (1.8-2.4) over 5 rounds
    assert "2000 ms (1800-2400)" in row and "1000 ms" in row and "2.00x (1.8-2.4)" in row, row
    assert row.rstrip().endswith("5")
    assert "3.00x" in lines[lines.index("  requests/s") + 1]


def test_table_fits_100_columns_and_keeps_every_word_of_long_labels():
    report = harness.Report(quiet=True)
    report.section("materialize")
    long = "transport: a pageable tensor handed to another process, producer copy, " * 3
    for i in range(4):
        report.add(
            harness.Figure(f"{long}#{i}", "torch.multiprocessing queue", [1e-3] * 5, [5e-4] * 5)
        )
    text = harness.table(report)
    assert max(len(line) for line in text.splitlines()) <= 100, text
    words = " ".join(text.split())
    for i in range(4):
        assert f"producer copy, #{i}" in words


def test_json_values_are_in_the_unit_they_claim(tmp_path):
    """A 20 ms sleep is ~20 in a figure whose unit is ms; 3 MiB of bytes is 3 in MiB."""
    import time

    report = harness.Report(quiet=True)
    report.section("s")
    report.add(
        harness.compare(
            "sleep", {"base": lambda: time.sleep(0.02), "mmferry": lambda: time.sleep(0.01)}
        )
    )
    report.add(harness.Figure.of_values("peak", "base", 6 * 2**20, 3 * 2**20, unit="MiB"))
    out = tmp_path / "b.json"
    report.dump_json(out)
    timed, size = json.loads(out.read_text())["sections"]["s"]
    assert timed["unit"] == "ms" and 15 < timed["base_median"] < 200, timed
    assert all(5 < v < 200 for v in timed["ours"]), timed
    assert size["unit"] == "MiB" and size["base_median"] == 6 and size["ours"] == [3]


def test_plot_writes_a_png(tmp_path):
    out = tmp_path / "bench.png"
    harness.plot(_report(), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_holds_every_round(tmp_path):
    out = tmp_path / "bench.json"
    _report().dump_json(out)
    doc = json.loads(out.read_text())
    # Seconds measured, milliseconds stored (the unit the figure names).
    assert doc["sections"]["encoder"][0]["base"] == pytest.approx([2000, 2200, 1800, 2000, 2400])


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
