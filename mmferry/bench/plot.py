"""`python -m mmferry.bench.plot FILE.json ... --out DIR`: PNG charts from benchmarks' own JSON.

Reads what the benchmarks write with `--json` and draws, never from figures typed by hand:

- a harness report (`mmferry bench --json`, `python -m mmferry.bench.NAME --json`): one chart
  per section, each figure's median ratio (mmferry over its baseline) with its spread over the
  rounds, `<section>.png`; where a section's figures are points of a concurrency sweep
  (`python -m mmferry.bench.load --capacity D --concurrency 1,4,16`), requests/s of each side
  against concurrency with its floor, `capacity.png`, instead; where they are points per image
  size (`python -m mmferry.bench.preprocess --only sizes`), each ratio against the image's
  size, `image-sizes.png`;
- the face-off (`examples/bench_proxy.py --json`): TTFT p50 per set-up and workload, median
  and spread over the rounds, `faceoff-<model>.png`;
- SGLang's disaggregation (`examples/bench_sglang_epd.py --json`): the same for its two encoder
  sets, `sglang.png`.

Needs matplotlib (`pip install 'mmferry[plot]'`). Prints the files it wrote.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install 'mmferry[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def ratio_chart(title: str, figures: list[dict[str, Any]], path: Path) -> Path:
    """Median ratio and min-max spread of each figure, one row each, 1x marked."""
    plt = _pyplot()
    import matplotlib.ticker

    rows = [f for f in figures if f.get("ratio") is not None]
    if not rows:
        raise ValueError(f"{title}: no figures with a ratio")
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.6))
    for y, f in enumerate(reversed(rows)):
        lo, hi = f.get("ratio_min", f["ratio"]), f.get("ratio_max", f["ratio"])
        ax.plot([lo, hi], [y, y], color="tab:blue", linewidth=6, alpha=0.35, solid_capstyle="butt")
        ax.plot([f["ratio"]], [y], "o", color="tab:blue")
    labels = [f"{f['label']} (vs {f.get('base_name', 'baseline')})" for f in reversed(rows)]
    ax.set_yticks(range(len(rows)), [label[:90] for label in labels], fontsize=8)
    ax.axvline(1.0, color="grey", linewidth=1)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xlabel("mmferry's advantage (x, median and spread over the rounds; > 1: mmferry ahead)")
    ax.set_title(title)
    return _save(plt, fig, path)


def grouped_bars(
    title: str, groups: dict[str, dict[str, list[float]]], ylabel: str, path: Path
) -> Path:
    """`groups[workload][setup]` = per-round values: median bars with min-max error bars."""
    plt = _pyplot()
    works = list(groups)
    setups = list(dict.fromkeys(s for per in groups.values() for s in per))
    width = 0.8 / max(len(setups), 1)
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(works)), 4.8))
    for i, setup in enumerate(setups):
        xs, meds, lows, highs = [], [], [], []
        for j, work in enumerate(works):
            values = groups[work].get(setup)
            if not values:
                continue
            med = statistics.median(values)
            xs.append(j + (i - (len(setups) - 1) / 2) * width)
            meds.append(med)
            lows.append(med - min(values))
            highs.append(max(values) - med)
        ax.bar(xs, meds, width, yerr=[lows, highs], capsize=3, label=setup)
    ax.set_xticks(range(len(works)), works, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_chart(title: str, figures: list[dict[str, Any]], path: Path) -> Path:
    """Requests/s of each side against concurrency (median, min-max error bars), each floor
    the sides were measured against a dashed line at its median with its spread shaded."""
    plt = _pyplot()
    points = [f for f in figures if "concurrency" in f.get("at", {})]
    sides: dict[str, dict[int, list[float]]] = {}
    floors: dict[str, list[float]] = {}
    for f in points:
        sides.setdefault(f["at"]["side"], {})[int(f["at"]["concurrency"])] = f["ours"]
    for f in points:
        # A floor, not a side compared with another side ("transformers float32, concurrency 4").
        if not any(f["base_name"].startswith(side) for side in sides):
            floors.setdefault(f["base_name"], f["base"])
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for side, per in sides.items():
        cs = sorted(per)
        meds = [statistics.median(per[c]) for c in cs]
        lows = [m - min(per[c]) for m, c in zip(meds, cs)]
        highs = [max(per[c]) - m for m, c in zip(meds, cs)]
        ax.errorbar(cs, meds, yerr=[lows, highs], marker="o", capsize=3, label=side)
    for i, (floor, values) in enumerate(floors.items()):
        color = f"C{len(sides) + i}"
        ax.axhline(statistics.median(values), color=color, linestyle="--", label=floor)
        ax.axhspan(min(values), max(values), color=color, alpha=0.12)
    unit = points[0].get("unit", "") if points else ""
    ax.set_xscale("log", base=2)
    ticks = sorted({c for per in sides.values() for c in per})
    ax.set_xticks(ticks, [str(c) for c in ticks])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel(f"{unit} (median and spread over the rounds)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def size_chart(title: str, figures: list[dict[str, Any]], path: Path) -> Path:
    """mmferry's ratio against the image's size in megapixels, a line per side and baseline
    (median, min-max error bars), 1x marked."""
    plt = _pyplot()
    import matplotlib.ticker

    lines: dict[str, list[dict[str, Any]]] = {}
    for f in figures:
        if "pixels" in f.get("at", {}) and f.get("ratio") is not None:
            lines.setdefault(f"{f['at']['side']} vs {f['base_name']}", []).append(f)
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, points in lines.items():
        points.sort(key=lambda f: f["at"]["pixels"])
        xs = [f["at"]["pixels"] / 1e6 for f in points]
        meds = [f["ratio"] for f in points]
        lows = [f["ratio"] - f.get("ratio_min", f["ratio"]) for f in points]
        highs = [f.get("ratio_max", f["ratio"]) - f["ratio"] for f in points]
        ax.errorbar(xs, meds, yerr=[lows, highs], marker="o", markersize=4, capsize=2, label=name)
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    fmt = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(fmt)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xlabel("image size (megapixels, log)")
    ax.set_ylabel("mmferry's advantage (x; median and spread over the rounds)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def from_report(doc: dict[str, Any], out: Path) -> list[Path]:
    machine = doc.get("machine", "")
    written = []
    for section, figures in doc["sections"].items():
        if any("concurrency" in f.get("at", {}) for f in figures):
            title = f"The encoder tier's capacity against concurrency\n{machine}"
            written.append(sweep_chart(title, figures, out / "capacity.png"))
        elif any("pixels" in f.get("at", {}) for f in figures):
            title = f"Preprocessing against transformers' processors per image size\n{machine}"
            written.append(size_chart(title, figures, out / "image-sizes.png"))
        elif any(f.get("ratio") is not None for f in figures):
            written.append(ratio_chart(f"{section}\n{machine}", figures, out / f"{section}.png"))
    return written


def from_faceoff(doc: dict[str, Any], out: Path) -> list[Path]:
    runs = doc["multimodal"]["runs"]
    groups = {
        work: {key: [r["median_ttft_ms"] for r in rounds] for key, rounds in per.items()}
        for work, per in runs.items()
    }
    # "tiny checkpoint, vision tower depth 2, width 32" (or a folder's path before it): the
    # file is named by its first word, the title carries the whole description.
    described = str(doc.get("model", "model"))
    model = (Path(described).name.split(" ")[0] or "model") if described else "model"
    title = "TTFT p50 per set-up and workload, median and spread over the rounds"
    title += f"\n{Path(described).name}"
    return [grouped_bars(title, groups, "TTFT p50 (ms)", out / f"faceoff-{model}.png")]


def from_sglang(doc: dict[str, Any], out: Path) -> list[Path]:
    groups: dict[str, dict[str, list[float]]] = {}
    for key, rounds in doc["runs"].items():  # "distinct / sglang": a list of rounds
        dataset, _, encoder = key.partition(" / ")
        groups.setdefault(dataset, {})[encoder] = [r["median_ttft_ms"] for r in rounds]
    title = "SGLang language-only server: TTFT p50 per encoder set (median and spread)"
    return [grouped_bars(title, groups, "TTFT p50 (ms)", out / "sglang.png")]


def plot_file(path: Path, out: Path) -> list[Path]:
    """Every chart one JSON file gives, written into `out`."""
    doc = json.loads(path.read_text())
    if "sections" in doc:
        return from_report(doc, out)
    if "multimodal" in doc:
        return from_faceoff(doc, out)
    if "runs" in doc:
        return from_sglang(doc, out)
    raise ValueError(f"{path}: not a benchmark's --json output (no sections, multimodal or runs)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmferry.bench.plot", description=__doc__)
    p.add_argument("files", nargs="+", type=Path, help="JSON written by a benchmark's --json")
    p.add_argument("--out", type=Path, default=Path("."), help="folder for the PNGs")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.files:
        try:
            written = plot_file(path, args.out)
        except (OSError, ValueError, KeyError) as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 2
        for w in written:
            print(w)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
