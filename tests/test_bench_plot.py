"""`python -m mmferry.bench.plot`: PNGs from the benchmarks' own JSON, and a clear refusal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mmferry.bench import harness

pytest.importorskip("matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"


def _plot(tmp_path: Path, *files: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mmferry.bench.plot", *map(str, files), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_harness_report_gives_one_chart_per_section(tmp_path):
    report = harness.Report(quiet=True)
    data = list(range(2000, 0, -1))
    runs = {"sorted": lambda: sorted(data), "mmferry": lambda: sum(data)}
    for section in ("sum", "sort"):
        report.section(section)
        report.add(harness.compare(f"{section} 2000 ints", runs))
    report.dump_json(tmp_path / "r.json")
    r = _plot(tmp_path, tmp_path / "r.json")
    assert r.returncode == 0, r.stderr
    for section in ("sum", "sort"):
        assert (tmp_path / f"{section}.png").read_bytes()[:8] == PNG
    assert r.stdout.split() == [str(tmp_path / "sum.png"), str(tmp_path / "sort.png")]


def test_a_faceoff_json_gives_ttft_per_setup_and_workload(tmp_path):
    rounds = lambda *v: [{"median_ttft_ms": x} for x in v]  # noqa: E731
    doc = {
        "model": "/ckpt/heavy",
        "multimodal": {
            "runs": {
                "share 0, 1.0 req/s": {"a": rounds(240, 250, 230), "c": rounds(180, 190, 170)},
                "share 0.5, 1.0 req/s": {"a": rounds(220, 210, 225), "c": rounds(120, 130, 125)},
            }
        },
    }
    (tmp_path / "f.json").write_text(json.dumps(doc))
    r = _plot(tmp_path, tmp_path / "f.json")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "faceoff-heavy.png").read_bytes()[:8] == PNG


def test_a_file_no_benchmark_wrote_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"hello": 1}))
    r = _plot(tmp_path, tmp_path / "x.json")
    assert r.returncode == 2
    assert "not a benchmark's --json output" in r.stderr
    assert not list(tmp_path.glob("*.png"))


def test_a_concurrency_sweep_gives_the_capacity_chart(tmp_path):
    report = harness.Report(quiet=True)
    floor = [9.0, 10.0, 11.0, 10.0, 10.0]
    for c in (1, 4, 16):
        for side, rate in (("mmferry float32", 8.0), ("transformers float32", 5.0)):
            report.add(
                harness.Figure(
                    f"requests/s, float32, all distinct, concurrency {c}, {side}",
                    "tower alone float32",
                    floor,
                    [rate + c / 16] * 5,
                    unit="req/s",
                    higher_is_better=True,
                    at={"concurrency": c, "side": side},
                )
            )
        report.add(  # side against side: no second floor
            harness.Figure(
                f"requests/s, float32, all distinct, concurrency {c}",
                f"transformers float32, concurrency {c}",
                [5.0] * 5,
                [8.0] * 5,
                unit="req/s",
                higher_is_better=True,
                at={"concurrency": c, "side": "mmferry float32"},
            )
        )
    report.dump_json(tmp_path / "c.json")
    r = _plot(tmp_path, tmp_path / "c.json")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(tmp_path / "capacity.png")]
    assert (tmp_path / "capacity.png").read_bytes()[:8] == PNG


def test_per_size_figures_give_the_ratio_against_image_size(tmp_path):
    report = harness.Report(quiet=True)
    report.section("image sizes")
    for w, h, gain in ((224, 224, 2.0), (1280, 720, 4.0), (4000, 3000, 8.0)):
        for base_name in ("transformers PIL processor", "transformers torchvision processor"):
            report.add(
                harness.Figure(
                    f"{w}x{h} PIL image, hf",
                    base_name,
                    [gain * 1e-3] * 5,
                    [1e-3] * 5,
                    at={"pixels": w * h, "size": f"{w}x{h}", "side": "mmferry hf"},
                )
            )
    report.dump_json(tmp_path / "s.json")
    r = _plot(tmp_path, tmp_path / "s.json")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(tmp_path / "image-sizes.png")]
    assert (tmp_path / "image-sizes.png").read_bytes()[:8] == PNG
