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
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from mmferry.progress import terminal_bar

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
    # Where a figure is one point of a sweep, the setting it was taken at and the side its
    # "ours" values are ({"concurrency": 4, "side": "transformers float32"}): what a plot
    # draws it against, instead of parsing the label.
    at: dict[str, Any] = dataclasses.field(default_factory=dict)

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
        shown = self.shown(value)
        digits = f"{shown:.2f}" if self.unit == "ms" else f"{shown:.4g}"
        return f"{digits} {self.unit}".rstrip()

    def line(self) -> str:
        base, ours = statistics.median(self.base), statistics.median(self.ours)
        rs = self.ratios
        spread = f" ({min(rs):.2f}-{max(rs):.2f}x over {len(rs)} rounds)" if len(rs) > 1 else ""
        note = f"  [{self.note}]" if self.note else ""
        return (
            f"{self.label}: {self.base_name} {self._fmt(base)} | mmferry {self._fmt(ours)} "
            f"| {self.ratio:.2f}x{spread}{note}"
        )

    def shown(self, value: float) -> float:
        """`value` in the unit the figure names (times are kept in seconds, bytes in bytes)."""
        return value * _SCALE.get(self.unit, 1.0)

    def as_dict(self) -> dict[str, Any]:
        """Every value in the unit named by `unit` (ms for times, MiB for sizes); ratios bare."""
        d = dataclasses.asdict(self)
        d.update(
            base=[self.shown(v) for v in self.base],
            ours=[self.shown(v) for v in self.ours],
            base_median=self.shown(statistics.median(self.base)),
            ours_median=self.shown(statistics.median(self.ours)),
            ratio=self.ratio,
            ratio_min=min(self.ratios),
            ratio_max=max(self.ratios),
        )
        return d


# What a stored value is multiplied by to be in the figure's unit: times are measured in
# seconds and shown in ms, sizes are measured in bytes and shown in MiB.
_SCALE = {"ms": 1e3, "MiB": 1 / 2**20}


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
    with progress(rounds * len(runners), "rounds x sides") as bar:
        for r in range(rounds):
            for name in rotated(list(runners), r):
                times[name].append(runners[name]())
                bar.update(1)
    return times


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None


def progress(total: int, unit: str, stream: Any = None) -> Any:
    """A tqdm bar on stderr while a benchmark runs, only when stderr is a terminal (a log or a
    pipe gets nothing); else a no-op."""
    bar = terminal_bar(total, unit, stream, leave=False)
    return _NoBar() if bar is None else bar


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


WIDTH = 100  # the table's and the plot labels' width, in characters


def _num(value: float) -> str:
    return f"{value:.4g}"


def _spread(fig: Figure, values: list[float]) -> str:
    """Median with its unit, then the range in the same unit: `2.1 ms (1.9-2.4)`."""
    mid = f"{_num(fig.shown(statistics.median(values)))} {fig.unit}".rstrip()
    if len(values) < 2:
        return mid
    return f"{mid} ({_num(fig.shown(min(values)))}-{_num(fig.shown(max(values)))})"


def _ratio(fig: Figure) -> str:
    rs = fig.ratios
    return f"{fig.ratio:.2f}x" + (f" ({_num(min(rs))}-{_num(max(rs))})" if len(rs) > 1 else "")


def table(report: Report, width: int = WIDTH) -> str:
    """Every figure of `report` within `width` columns: a section line, then per figure its
    description (wrapped) over a row of baseline, mmferry, ratio and spread, rounds. The full
    descriptions are in the JSON (`--json`)."""
    head = ("baseline", "baseline value", "mmferry", "ratio (min-max)", "n")
    rows: list[tuple[str, ...]] = [head]
    for figs in report.sections.values():
        rows += [
            (f.base_name, _spread(f, f.base), _spread(f, f.ours), _ratio(f), str(len(f.ratios)))
            for f in figs
        ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    # A long baseline name gives way first: it is the one column a reader can do without.
    over = sum(widths) + 2 * (len(widths) - 1) + 4 - width
    if over > 0:
        widths[0] = max(8, widths[0] - over)
    cut = lambda text, w: text if len(text) <= w else text[: w - 1] + "~"  # noqa: E731
    line = lambda r: ("    " + "  ".join(cut(c, w).ljust(w) for c, w in zip(r, widths))).rstrip()  # noqa: E731
    out = [line(head), "    " + "  ".join("-" * w for w in widths)]
    i = 1
    for section, figs in report.sections.items():
        if not figs:
            continue
        out.append(f"{section}")
        for f in figs:
            out += textwrap.wrap(f.label, width, initial_indent="  ", subsequent_indent="    ")
            out.append(line(rows[i]))
            i += 1
    return "\n".join(out)


def plot(report: Report, path: str | Path) -> None:
    """mmferry's advantage per figure (median ratio, the min-max range drawn as a bar) on a
    log axis with 1x marked; every label whole (wrapped), numbered as in the table."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'mmferry[plot]'") from None
    figs = [(s, f) for s, fs in report.sections.items() for f in fs]
    labels = ["\n".join(textwrap.wrap(f"{s}: {f.label} (vs {f.base_name})", 60)) for s, f in figs]
    heights = [0.28 * label.count("\n") + 0.45 for label in labels]
    ys, y = [], 0.0
    for h in heights:
        ys.append(y + h / 2)
        y += h
    fig, ax = plt.subplots(figsize=(12, y + 1.6))
    for yi, (_, f) in zip(ys, figs):
        lo, hi = min(f.ratios), max(f.ratios)
        color = "tab:blue" if f.ratio >= 1 else "tab:red"
        ax.plot([lo, hi], [yi, yi], color=color, linewidth=6, alpha=0.35, solid_capstyle="butt")
        ax.plot([f.ratio], [yi], "o", color=color)
        ax.annotate(
            f"{f.ratio:.2f}x", (f.ratio, yi), textcoords="offset points", xytext=(6, 4), fontsize=7
        )
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.axvline(1.0, color="black", linewidth=1)
    ax.text(
        1.0,
        1.01,
        "1x = parity",
        transform=ax.get_xaxis_transform(),
        ha="center",
        va="bottom",
        fontsize=7,
    )
    ax.set_yticks(ys, labels, fontsize=7)
    ax.set_ylim(y, 0)
    ax.set_xlabel(
        "mmferry's advantage over the baseline (x, log scale): dot = median of the "
        "rounds, bar = min to max"
    )
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
