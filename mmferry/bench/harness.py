"""Timing and reporting shared by every benchmark.

Each figure is a product measurement beside its baseline, both taken in the same rounds:
product and baseline are interleaved in every round (the order alternates, so drift and load
from other processes hit both alike), warm-up is excluded, and the figure reports the median
of each side plus the median and the spread (min-max) of the per-round ratios.

    fig = compare("16 JPEGs, hf", {"transformers": base_fn, "mmferry": ours_fn}, rounds=7)
    report.add(fig)          # prints "label: transformers 78.3 ms | mmferry 29.9 ms | 2.62x
                             #         (2.41-2.80x over 7 rounds)"
    report.dump_json(path)   # every figure, every round, for machines

A benchmark that has a value to compare rather than a time (bytes, memory) records it with
`Figure.of_values`. Outputs must be checked equal (or the tolerance stated) before timing;
`check_equal` does it for tensors and says how far apart they are when they differ.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

MIN_ROUNDS = 5


@dataclasses.dataclass
class Figure:
    """One product-vs-baseline figure: the per-round values of each side."""

    label: str
    base_name: str
    base: list[float]
    ours: list[float]
    unit: str = "ms"  # "ms" for times measured in seconds; anything else is shown as is
    higher_is_better: bool = False  # True for throughputs (images/s), False for times, bytes
    note: str = ""

    @classmethod
    def of_values(
        cls,
        label: str,
        base_name: str,
        base: float | Sequence[float],
        ours: float | Sequence[float],
        *,
        unit: str,
        higher_is_better: bool = False,
        note: str = "",
    ) -> Figure:
        """A figure from values that were not timed by `compare` (bytes, peak memory)."""
        as_list = lambda v: [float(x) for x in v] if isinstance(v, Sequence) else [float(v)]  # noqa: E731
        return cls(label, base_name, as_list(base), as_list(ours), unit, higher_is_better, note)

    @property
    def ratios(self) -> list[float]:
        """Per-round advantage of mmferry (>1 means mmferry is better)."""
        pairs = zip(self.base, self.ours)
        if self.higher_is_better:
            return [o / b if b else float("inf") for b, o in pairs]
        return [b / o if o else float("inf") for b, o in pairs]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    def _fmt(self, value: float) -> str:
        if self.unit == "ms":
            return f"{value * 1e3:.2f} ms"
        if self.unit == "MiB":
            return f"{value / 2**20:.1f} MiB"
        return f"{value:.4g} {self.unit}".rstrip()

    def line(self) -> str:
        base, ours = statistics.median(self.base), statistics.median(self.ours)
        rs = self.ratios
        spread = f" ({min(rs):.2f}-{max(rs):.2f}x over {len(rs)} rounds)" if len(rs) > 1 else ""
        note = f"  [{self.note}]" if self.note else ""
        return (
            f"{self.label}: {self.base_name} {self._fmt(base)} | mmferry {self._fmt(ours)} "
            f"| {self.ratio:.2f}x{spread}{note}"
        )

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(
            base_median=statistics.median(self.base),
            ours_median=statistics.median(self.ours),
            ratio=self.ratio,
            ratio_min=min(self.ratios),
            ratio_max=max(self.ratios),
        )
        return d


def compare(
    label: str,
    runs: dict[str, Callable[[], object]],
    *,
    rounds: int = MIN_ROUNDS,
    warmup: int = 1,
    sync: Callable[[], None] = lambda: None,
    per: float = 1.0,
    unit: str = "ms",
    note: str = "",
) -> Figure:
    """Time a baseline and mmferry interleaved, `rounds` times each, after `warmup` calls.

    `runs` holds exactly two entries, the baseline first and then "mmferry". With `per` > 1
    and `unit` like "images/s", the figure is a throughput: `per` units of work per call.
    """
    if len(runs) != 2:
        raise ValueError("compare takes exactly two runs: the baseline, then mmferry")
    (base_name, base_fn), (_, ours_fn) = runs.items()

    def synced(fn: Callable[[], object]) -> Callable[[], object]:
        return lambda: (fn(), sync())

    # NOTE: two sides rotate by alternating who goes first, so a cache warmed (or evicted) by
    # one side does not always favour the same side.
    times = interleave(
        {"base": timed(synced(base_fn)), "ours": timed(synced(ours_fn))},
        rounds=rounds,
        warmup=warmup,
    )
    if unit == "ms":
        return Figure(label, base_name, times["base"], times["ours"], "ms", note=note)
    rate = lambda ts: [per / t for t in ts]  # noqa: E731
    return Figure(label, base_name, rate(times["base"]), rate(times["ours"]), unit, True, note)


def interleave(
    runners: dict[str, Callable[[], float]], *, rounds: int = MIN_ROUNDS, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per round of each runner (each returns the seconds it took), all interleaved.

    For more than two sides, or sides that time themselves (a worker process): every round
    runs every side once, the order rotating each round; warm-up calls are left out.
    """
    if rounds < MIN_ROUNDS:
        raise ValueError(f"at least {MIN_ROUNDS} rounds make a figure, got {rounds}")
    for _ in range(warmup):
        for fn in runners.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in runners}
    for r in range(rounds):
        for name in rotated(list(runners), r):
            times[name].append(runners[name]())
    return times


def rotated(names: list[str], round_index: int) -> list[str]:
    """The order of the sides in round `round_index`: rotated by one each round, so load and
    cache effects hit every side alike."""
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    """`fn` as a runner for `interleave`: it returns the seconds one call took."""

    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run


def check_equal(name: str, ours: torch.Tensor, ref: torch.Tensor, *, atol: float = 0.0) -> None:
    """Raise unless two outputs agree (exactly, or within `atol`), before anything is timed."""
    if ours.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}")
    diff = (ours.double() - ref.double()).abs().max().item() if ours.numel() else 0.0
    if diff > atol:
        raise AssertionError(f"{name}: outputs differ by {diff:.3g} (allowed {atol:.3g})")


def machine() -> str:
    """One line describing where the figures were taken."""
    import os

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average {load:.2f}"
    )


class Report:
    """Figures of one or more benchmarks, printed as they come and kept for JSON and plots."""

    def __init__(self, *, quiet: bool = False) -> None:
        self.sections: dict[str, list[Figure]] = {}
        self._section = "main"
        self.quiet = quiet

    def section(self, name: str) -> None:
        self._section = name
        self.sections.setdefault(name, [])
        if not self.quiet:
            print(f"== {name} ==", flush=True)

    def add(self, fig: Figure) -> Figure:
        self.sections.setdefault(self._section, []).append(fig)
        if not self.quiet:
            print(fig.line(), flush=True)
        return fig

    def as_dict(self) -> dict[str, Any]:
        return {
            "machine": machine(),
            "sections": {s: [f.as_dict() for f in figs] for s, figs in self.sections.items()},
        }

    def dump_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=2))


# -- runner support (used by `mmferry bench` and each module's `main`) --------------------------


def _spread(fig: Figure, values: list[float]) -> str:
    """Median with its unit, then the range as bare numbers in the same unit."""
    mid = fig._fmt(statistics.median(values))
    if len(values) < 2:
        return mid
    bare = lambda v: fig._fmt(v).split(" ")[0]  # noqa: E731
    return f"{mid} ({bare(min(values))}-{bare(max(values))})"


def table(report: Report) -> str:
    """Every figure of `report` as one aligned table: baseline, mmferry, ratio, spread."""
    rows = [("benchmark", "figure", "baseline", "baseline value", "mmferry", "ratio", "rounds")]
    for section, figs in report.sections.items():
        for f in figs:
            rs = f.ratios
            rows.append(
                (
                    section,
                    f.label,
                    f.base_name,
                    _spread(f, f.base),
                    _spread(f, f.ours),
                    f"{f.ratio:.2f}x" + (f" ({min(rs):.2f}-{max(rs):.2f})" if len(rs) > 1 else ""),
                    str(len(rs)),
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(report: Report, path: str | Path) -> None:
    """A bar per figure: mmferry's advantage (median ratio, whiskers min-max), saved to `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'mmferry[plot]'") from None
    figs = [(s, f) for s, fs in report.sections.items() for f in fs]
    labels = [f"{s}: {f.label}"[:70] for s, f in figs]
    mids = [f.ratio for _, f in figs]
    lo = [f.ratio - min(f.ratios) for _, f in figs]
    hi = [max(f.ratios) - f.ratio for _, f in figs]
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(figs) + 1.5))
    ax.barh(range(len(figs)), mids, xerr=[lo, hi], color="tab:blue", capsize=3)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(figs)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("mmferry advantage over the baseline (x, median; whiskers: min-max)")
    ax.set_title(machine(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main_for(run: Callable[[Report, bool], None], argv: list[str] | None, description: str) -> int:
    """`python -m mmferry.bench.NAME [--quick] [--json FILE]` for a module that defines `run`."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a shorter run")
    parser.add_argument("--json", metavar="FILE", help="write every figure and round as JSON")
    args = parser.parse_args(argv)
    report = Report()
    print(f"machine: {machine()}", flush=True)
    run(report, args.quick)
    if args.json:
        report.dump_json(args.json)
    return 0
