"""Benchmark: many images at once, the batch API (`proc.images`) beside today's per-item loop.

Workload: 64 seeded JPEGs, all of distinct sizes, 0.3 to 12 MP (log-spaced, four aspect
ratios), to the Qwen3-VL default resize. Figures:
- the batch API on 2 threads against the same API on 1 thread, against the per-item loop
  (`[proc.image(s) for s in sources]`) on 1 thread and against that loop on the same 2 threads
  (each item splitting its own resize and gather); every batch item is checked equal to its
  per-item call first. Twice: JPEGs of sizes new every round (every side takes the next set at
  every call, so no buffer the cache recycles fits a size it saw before), then the same JPEGs
  every round (the buffer cache warm after the first), JPEG bytes (compact-u8 and hf) and
  decoded PIL images (compact-u8);
- per stage (decode, resize, patch rows, key), the 64 items' stage on 2 threads against 1,
  and, for the largest item, the longest stretch in which the stage kept other threads from
  running Python (held the GIL): what holds it stays serial however many threads there are;
- the key's own throughput, BLAKE3 against SHA-256 (what the keys used before), and BLAKE3's
  own threads against one;
- one 12 MP image (a decoded array) to compact-u8 against its recycled-pages floor (one uint8
  resize plus one write of the output into recycled pages).

Run: python -m mmferry.bench.batch [--quick] [--json FILE]
"""

from __future__ import annotations

import hashlib
import io
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import blake3
import numpy as np
import torch
from PIL import Image

from mmferry.bench import harness
from mmferry.bench.harness import MIN_ROUNDS, Figure, Report, check_equal, compare, interleave
from mmferry.bench.harness import timed as timed_fn
from mmferry.bench.preprocess import _smooth_field
from mmferry.config import ProcessorConfig
from mmferry.models import preset
from mmferry.preprocess.batch import ImagePart, item_bytes, process_batch
from mmferry.preprocess.buffers import empty_host
from mmferry.preprocess.decode import as_batch, decode_image
from mmferry.preprocess.hashing import item_hash
from mmferry.preprocess.image import process_image
from mmferry.preprocess.patchify import patchify, resize_u8
from mmferry.preprocess.resize import smart_resize
from mmferry.preprocess.threads import intra_op_threads, preprocess_threads

ASPECTS = (4 / 3, 3 / 4, 16 / 9, 1.0)


def make_jpegs(n: int, lo_mp: float, hi_mp: float, seed: int = 20) -> list[bytes]:
    """`n` seeded JPEGs of distinct sizes, log-spaced from `lo_mp` to `hi_mp` megapixels."""
    rng = np.random.default_rng(seed)
    out, seen = [], set()
    for i, mp in enumerate(np.exp(np.linspace(np.log(lo_mp * 1e6), np.log(hi_mp * 1e6), n))):
        w = int(round((mp * ASPECTS[i % len(ASPECTS)]) ** 0.5))
        h = int(round(mp / w))
        while (w, h) in seen:
            w += 1
        seen.add((w, h))
        buf = io.BytesIO()
        Image.fromarray(_smooth_field(rng, w, h)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def distinct_jpegs(
    n: int, lo_mp: float, hi_mp: float, batches: int, seed: int = 21
) -> list[list[bytes]]:
    """`batches` sets of `n` JPEGs, `make_jpegs`' sizes grown by another step in each set, so
    that no size repeats across sets (each step moves the width by more than the 32-pixel
    rounding of the resize); cropped from one seeded field."""
    base = []
    for i, mp in enumerate(np.exp(np.linspace(np.log(lo_mp * 1e6), np.log(hi_mp * 1e6), n))):
        w = int(round((mp * ASPECTS[i % len(ASPECTS)]) ** 0.5))
        base.append((w, int(round(mp / w))))
    sizes = [
        [(w + 40 * (b + 1) + i, h + 24 * (b + 1)) for i, (w, h) in enumerate(base)]
        for b in range(batches)
    ]
    flat = [size for batch in sizes for size in batch]
    if len(set(flat)) != len(flat):
        raise AssertionError("the distinct-size workload repeats a size")
    rng = np.random.default_rng(seed)
    field = _smooth_field(rng, max(w for w, _ in flat) + 64, max(h for _, h in flat) + 64)
    out = []
    for b, batch in enumerate(sizes):
        datas = []
        for i, (w, h) in enumerate(batch):
            y, x = (7 * i + 3 * b) % 64, (5 * i + 11 * b) % 64
            buf = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(field[y : y + h, x : x + w])).save(
                buf, "JPEG", quality=90
            )
            datas.append(buf.getvalue())
        out.append(datas)
    return out


def _check_batch(sources: Sequence[Any], cfg: ProcessorConfig, layout: str) -> None:
    """Every batch item (2 threads) equal to its per-item call: rows, grid and key."""
    items = process_batch([ImagePart(s) for s in sources], cfg, layout=layout, threads=2)
    for i, (got, src) in enumerate(zip(items, sources)):
        want = process_image(src, cfg, layout=layout)
        check_equal(f"item {i}, {layout}", got.feature, want.feature)
        if (got.grid_thw, got.hash) != (want.grid_thw, want.hash):
            raise AssertionError(f"item {i}, {layout}: grid or key differs from the per-item call")


BASELINES = ("batch, 1 thread", "per-item loop, 1 thread", "per-item loop, 2 threads")


def batch_figures(
    report: Report,
    batches: Sequence[Sequence[Any]],
    kind: str,
    cfg: ProcessorConfig,
    layout: str,
    rounds: int,
) -> None:
    """Batch on 2 threads, batch on 1, and the per-item loop on 1 and on 2 threads,
    interleaved in every round; each side takes the next of `batches` at every call (the
    warm-up too), so one set repeated times the same sources every round."""
    if len(batches) < rounds + 1:
        raise ValueError(f"{rounds} rounds and a warm-up take {rounds + 1} sets of sources")
    for sources in batches[:1] if batches[0] is batches[-1] else batches:
        _check_batch(sources, cfg, layout)

    def side(work: Callable[[Sequence[Any]], object]) -> Callable[[], float]:
        sets = iter(batches)
        return timed_fn(lambda: work(next(sets)))

    def loop(threads: int) -> Callable[[Sequence[Any]], object]:
        return lambda sources: [
            process_image(s, cfg, layout=layout, threads=threads) for s in sources
        ]

    def batch(threads: int) -> Callable[[Sequence[Any]], object]:
        return lambda sources: process_batch(
            [ImagePart(s) for s in sources], cfg, layout=layout, threads=threads
        )

    times = interleave(
        {
            "per-item loop, 1 thread": side(loop(1)),
            "per-item loop, 2 threads": side(loop(2)),
            "batch, 1 thread": side(batch(1)),
            "batch, 2 threads": side(batch(2)),
        },
        rounds=rounds,
    )
    n = len(batches[0])
    rate = f"{n / statistics.median(times['batch, 2 threads']):.1f} images/s on 2 threads"
    for base in BASELINES:
        label = f"{n} {kind}, {layout}, batch API on 2 threads"
        report.add(Figure(label, base, times[base], times["batch, 2 threads"], note=rate))


def longest_gil_hold(fn: Callable[[], object]) -> tuple[float, float]:
    """(longest stretch in which another thread could not run Python code, `fn`'s wall time),
    in seconds, with `fn` on this thread and a probe thread spinning beside it.

    A call that holds the GIL shows a stretch as long as itself; one that releases it shows
    only scheduling gaps (a few ms on a loaded host), whatever the load, so this tells
    serial from parallel work where the load hides any speedup."""
    stop = threading.Event()
    longest = [0.0]

    def probe() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            longest[0] = max(longest[0], now - last)
            last = now

    t = threading.Thread(target=probe)
    t.start()
    time.sleep(0.01)  # the probe is spinning before the call starts
    longest[0] = 0.0
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    stop.set()
    t.join()
    return longest[0], took


def _on_threads(work: list[Callable[[], object]], threads: int) -> Callable[[], None]:
    """Run every callable of `work`, whole ones on `threads` threads (one intra-op thread each)."""

    def one(fn: Callable[[], object]) -> None:
        with intra_op_threads(1):
            fn()

    def run() -> None:
        if threads == 1:
            for fn in work:
                one(fn)
            return
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, work))

    return run


def stage_figures(report: Report, datas: Sequence[bytes], cfg: ProcessorConfig, rounds) -> None:
    """Each stage of the 64 items on 2 threads against 1; the note gives the GIL-free share."""
    decoded = [decode_image(d, cfg.max_decoded_pixels) for d in datas]
    sizes = [
        smart_resize(
            *d.pixels.shape[1:],
            factor=cfg.factor,
            min_pixels=cfg.image_min_pixels,
            max_pixels=cfg.image_max_pixels,
        )
        for d in decoded
    ]
    resized = [resize_u8(as_batch(d.pixels), *s) for d, s in zip(decoded, sizes)]
    geometry = dict(
        image=True,
        patch=cfg.patch_size,
        merge=cfg.merge_size,
        temporal=cfg.temporal_patch_size,
        mean=cfg.image_mean,
        std=cfg.image_std,
    )
    stages: dict[str, list[Callable[[], object]]] = {
        "decode (Pillow, into recycled pages)": [
            lambda d=d: decode_image(d, cfg.max_decoded_pixels) for d in datas
        ],
        "resize (torch uint8 antialiased bicubic)": [
            lambda d=d, s=s: resize_u8(as_batch(d.pixels), *s) for d, s in zip(decoded, sizes)
        ],
        "patch rows, compact-u8 (compiled kernel)": [
            lambda r=r: patchify(r, layout="compact-u8", **geometry) for r in resized
        ],
        "patch rows, hf (compiled kernel)": [
            lambda r=r: patchify(r, layout="hf", **geometry) for r in resized
        ],
        "key (BLAKE3 over the encoded bytes)": [
            lambda d=d: item_hash("image", (b"encoded", d), cfg) for d in datas
        ],
    }
    largest = max(range(len(datas)), key=lambda i: sizes[i][0] * sizes[i][1])
    for name, work in stages.items():
        held, took = longest_gil_hold(work[largest])
        fig = compare(
            f"{len(work)} items' {name}, 2 threads",
            {"1 thread": _on_threads(work, 1), "mmferry": _on_threads(work, 2)},
            rounds=rounds,
        )
        fig.note = (
            f"largest item: GIL held at most {held * 1e3:.1f} ms of a {took * 1e3:.1f} ms call"
        )
        report.add(fig)
    del decoded, resized
    # What the batch adds around the stages: one Image.open of each header (sizes), workers.
    parts = [ImagePart(d) for d in datas]
    t0 = time.perf_counter()
    for p in parts:
        item_bytes(p, cfg, "compact-u8")
    headers = time.perf_counter() - t0
    print(f"(serial before the workers start: {len(parts)} headers read in {headers * 1e3:.1f} ms)")


def hash_figures(report: Report, datas: Sequence[bytes], rounds: int) -> None:
    """The key's own throughput: BLAKE3 against SHA-256, and BLAKE3's threads against one."""
    pixels = np.random.default_rng(3).integers(0, 256, 36_000_000, dtype=np.uint8).tobytes()
    jpegs = b"".join(datas)
    for what, data in (("36 MB (12 MP RGB pixels)", pixels), (f"the {len(datas)} JPEGs", jpegs)):
        mib = len(data) / 2**20
        report.add(
            compare(
                f"key throughput over {what}, one thread",
                {
                    "SHA-256 (hashlib)": lambda d=data: hashlib.sha256(d).digest(),
                    "mmferry": lambda d=data: blake3.blake3(d).digest(length=16),
                },
                rounds=rounds,
                per=mib,
                unit="MiB/s",
                note="BLAKE3, 128-bit output",
            )
        )
    mib = len(pixels) / 2**20
    report.add(
        compare(
            "BLAKE3 over 36 MB with max_threads=2 (mmferry uses one)",
            {
                "max_threads=2": lambda: blake3.blake3(pixels, max_threads=2).digest(length=16),
                "mmferry": lambda: blake3.blake3(pixels).digest(length=16),
            },
            rounds=rounds,
            per=mib,
            unit="MiB/s",
        )
    )


def floor_figure(report: Report, cfg: ProcessorConfig, rounds: int) -> None:
    """One 4000x3000 decoded image to compact-u8 against its recycled-pages floor."""
    rgb = np.ascontiguousarray(_smooth_field(np.random.default_rng(7), 4000, 3000))
    h, w = smart_resize(
        3000,
        4000,
        factor=cfg.factor,
        min_pixels=cfg.image_min_pixels,
        max_pixels=cfg.image_max_pixels,
    )
    chw = torch.from_numpy(rgb).unsqueeze(0).permute(0, 3, 1, 2)
    threads = preprocess_threads()

    def floor() -> None:
        with intra_op_threads(threads):
            resize_u8(chw, h, w)
            empty_host((h * w * 3,), torch.uint8).fill_(1)

    fig = compare(
        f"one 4000x3000 image -> {w}x{h}, compact-u8, {threads} thread(s)",
        {
            "floor (recycled pages)": floor,
            "mmferry": lambda: process_image(rgb, cfg, layout="compact-u8", threads=threads),
        },
        rounds=rounds,
    )
    fig.note = f"{1 / fig.ratio:.2f}x the floor (target <= 1.5x)"
    report.add(fig)


def run(report: Report, quick: bool) -> None:
    """Every figure above; `quick`: 16 images of 0.3-3 MP and fewer stages."""
    cfg = preset("qwen3-vl")
    rounds = MIN_ROUNDS
    t0 = time.perf_counter()
    datas = make_jpegs(16, 0.3, 3.0) if quick else make_jpegs(64, 0.3, 12.0)
    print(
        f"qwen3-vl settings; {len(datas)} JPEGs made in {time.perf_counter() - t0:.0f} s; "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    report.section("batch")
    t0 = time.perf_counter()
    n, lo, hi = (16, 0.3, 3.0) if quick else (64, 0.3, 12.0)
    distinct = distinct_jpegs(n, lo, hi, rounds + 1)
    print(f"{rounds + 1} sets of sizes new every round made in {time.perf_counter() - t0:.0f} s")
    batch_figures(report, distinct, "JPEGs of sizes new every round", cfg, "compact-u8", rounds)
    del distinct
    same = [datas] * (rounds + 1)
    batch_figures(report, same, "JPEG bytes, the same every round", cfg, "compact-u8", rounds)
    if not quick:
        batch_figures(report, same, "JPEG bytes, the same every round", cfg, "hf", rounds)
        pils = [Image.open(io.BytesIO(d)).convert("RGB") for d in datas]
        batch_figures(report, [pils] * (rounds + 1), "PIL images", cfg, "compact-u8", rounds)
        del pils
    report.section("stages")
    stage_figures(report, datas, cfg, rounds)
    report.section("key")
    hash_figures(report, datas, rounds)
    report.section("floor")
    floor_figure(report, cfg, rounds)
    print(f"load average at the end {os.getloadavg()[0]:.1f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    return harness.main_for(run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
