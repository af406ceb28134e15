"""Load: `mmferry serve` (batching on and off) vs transformers served the obvious way, on loopback.

Three seeded workloads, in the order they are run and reported. Two of 200 requests of one PNG
each at concurrency 16, mixed sizes. "all distinct", the headline: 200 images, none repeated, so
nothing is served from a cache and every server encodes every request; here mmferry runs with a
32 MiB cache, which the workload fills within its first 20 requests and then keeps evicting from,
and the check below reads the cache's size. Beside it, "88% repeats (mostly cache hits)": 24
distinct images, all first seen within the first 50 requests, the rest repeats; most of mmferry's
answers come from its encoder cache and the baseline has none, so its ratio measures mostly the
cache. "4 JPEGs each": 24 requests of 4 JPEGs at concurrency 4, 96 distinct sizes from 0.05 to 0.5
MP, none repeated (a request's items preprocessed in parallel, largest first), the same 32 MiB
cache. Servers:
`mmferry serve` with the built-in qwen3-vl tower (random weights), batching on, then
`--no-batching`; the baseline is the same FastAPI + uvicorn serving transformers the obvious way:
per request, one call of transformers' default Qwen-VL image processor (`Qwen2VLImageProcessor`,
torchvision's kernels; where torchvision does not import, transformers' own fallback,
`Qwen2VLImageProcessorPil`) and one `Qwen3VLVisionModel` forward, same weights.
Checked before any figure: zero errors; every response's grid, token count and hash equal an
in-process preprocess of its image; every response equals the first one for its image; mmferry's
pixels equal the baseline processor's (run here, in-process) for every image, and its rows equal
the baseline server's within ROWS_TOLERANCE; mmferry's encoder cache (its /metrics) within its
32 MiB at the end. Pillow's bicubic resize rounds differently from torch's (and torchvision's)
uint8 kernel, which mmferry runs: with the Pillow fallback a resized image's pixels may differ by
PIL_LEVELS uint8 levels in at most PIL_SHARE of its values (checked), and its rows are then not
compared (a 1-layer tower moved them by up to 0.0136 for such pixels). The server's RSS at a
quarter of the requests and at the end is reported, not checked: the same code's RSS moved by
-4% and +7% between those points in two runs (allocator high-water marks of a 900 MiB
process), a swing larger than the whole 32 MiB cache.
Figures, per workload: requests/s and p50/p99 latency, the median and spread over 5 rounds; each
round runs every server on each workload once, the order rotating.
--against DIR compares this tree's `mmferry serve` with the one in DIR (another checkout, e.g.
the previous commit, its compiled kernel built) instead: both with batching on, same
workloads, same rounds, no transformers. --only A,B runs the workloads whose names hold A or B.
--quick cuts the tower to 1 layer (the repeating workload takes about 2 minutes a round on 2
quiet CPUs, the all-distinct one longer, as mmferry encodes every request there; the full
24-layer tower takes hours for 5 rounds).

Run: python -m mmferry.bench.load [--quick] [--json FILE] [--against DIR] [--only A,B]
     python -m mmferry.bench.load --capacity DTYPES [--requests N] [--concurrency 1,4,16] ...
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmferry.bench import harness

# The folder holding the mmferry package (a checkout, or site-packages when installed).
ROOT = Path(__file__).resolve().parents[2]
REQUESTS, CONCURRENCY, DISTINCT, FIRST_SEEN_BY = 200, 16, 24, 50
# The many-images workload: requests of PER_REQUEST JPEGs, all distinct.
MULTI_REQUESTS, MULTI_CONCURRENCY, PER_REQUEST = 24, 4, 4
ROUNDS = harness.MIN_ROUNDS
SIZES = [(256, 256), (320, 240), (240, 320), (384, 256)]
# mmferry vs transformers after the tower, same weights, same pixels: about 6e-6 for both the
# 1-layer and the 24-layer tower (float32 sums in another order), on rows of magnitude about 5.
ROWS_TOLERANCE = 1e-4
# Pillow's uint8 bicubic against torch's, on the workloads' resized images: 1 level in 0.2-0.5 %
# of the values, 2 levels in a few.
PIL_LEVELS, PIL_SHARE = 2, 0.01
# Where they differ in more values than that (near-unity scales: a 199x353 JPEG resized to
# 192x352 differs in 19.4 % of its values, by at most 2 levels), mmferry's resized pixels are
# held to the exact resample instead: the same antialiased bicubic in float64, a pass per axis
# (width first, clipped to 0-255 between, as both uint8 kernels do). Two uint8 passes lie at
# most about 0.5 * sum|weights| + 0.5 levels from it; measured: mmferry 1.11 at most over the
# three workloads, Pillow 2.09 (so Pillow is not held to it).
EXACT_LEVELS = 1.25


def images(count: int | None = None, first_seed: int = 0) -> list[bytes]:
    """`count` (default DISTINCT) distinct seeded PNGs, sizes cycling through SIZES."""
    out = []
    for i in range(DISTINCT if count is None else count):
        w, h = SIZES[i % len(SIZES)]
        px = np.random.default_rng(first_seed + i).integers(0, 256, (h, w, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(px).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def sequence(seed: int = 0) -> list[int]:
    """Image index per request: every image first seen before request 50, then repeats."""
    rng = random.Random(seed)
    head = list(range(DISTINCT)) + [
        rng.randrange(DISTINCT) for _ in range(FIRST_SEEN_BY - DISTINCT)
    ]
    rng.shuffle(head)
    return head + [rng.randrange(DISTINCT) for _ in range(REQUESTS - FIRST_SEEN_BY)]


@dataclass(frozen=True)
class Workload:
    """The images, which ones each request sends, and flags for the mmferry servers."""

    name: str
    datas: list[bytes]
    seq: list[tuple[int, ...]]
    serve_flags: tuple[str, ...] = ()
    concurrency: int = CONCURRENCY
    mime: str = "image/png"
    # The encoder cache's bound the serve flags set, checked at the end of each run.
    cache_bytes: int | None = None


def workloads() -> list[Workload]:
    """The all-distinct workload (no cache hits: the headline), the repeating one beside it (the
    cache's best case) and the many-images one."""
    from mmferry.bench.batch import make_jpegs

    repeats = round(100 * (1 - DISTINCT / REQUESTS))
    # NOTE: seeds after the repeating workload's, so no image is shared between the two.
    distinct = images(REQUESTS, first_seed=DISTINCT)
    n = MULTI_REQUESTS * PER_REQUEST
    # Sizes interleaved across requests, so each request mixes small and large images.
    order = np.random.default_rng(7).permutation(n)
    multi = [tuple(int(j) for j in order[i::MULTI_REQUESTS]) for i in range(MULTI_REQUESTS)]
    return [
        Workload(
            "all distinct",
            distinct,
            [(i,) for i in range(REQUESTS)],
            ("--cache-mib", "32"),
            cache_bytes=32 << 20,
        ),
        Workload(f"{repeats}% repeats (mostly cache hits)", images(), [(i,) for i in sequence()]),
        Workload(
            f"{PER_REQUEST} JPEGs each",
            make_jpegs(n, 0.05, 0.5, seed=31),
            multi,
            ("--cache-mib", "32"),
            concurrency=MULTI_CONCURRENCY,
            mime="image/jpeg",
            cache_bytes=32 << 20,
        ),
    ]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process `pid` so far, every thread of it."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def start(cmd: list[str], root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """A server subprocess (mmferry imported from `root`) and the URL it prints once listening."""
    # NOTE: PYTHONSAFEPATH: `python -m` puts the working directory ahead of PYTHONPATH, and a
    # baseline checkout's server started from this one would run this one's code.
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONSAFEPATH": "1"}
    env.pop("MMFERRY_API_KEY", None)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if "listening on " in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, line.split("listening on ")[1].strip()
    raise RuntimeError("server did not start:\n" + "".join(lines))


@dataclass
class Run:
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    rss_quarter: int = 0  # at a quarter of the requests (at most the 50th)
    rss_end: int = 0
    cache_bytes: float | None = None  # the service's encoder cache at the end (/metrics)
    errors: list[str] = field(default_factory=list)
    responses: dict[int, list] = field(default_factory=dict)  # request index -> items
    cpu_s: float = 0.0  # the server process's CPU seconds (every thread) over the requests


async def drive(url: str, pid: int, w: Workload) -> Run:
    """Send every request at the workload's concurrency; latencies, RSS, responses."""
    from mmferry.server.client import AsyncEncoderClient, EncodeError, image_part

    run = Run()
    sem = asyncio.Semaphore(w.concurrency)
    mark = min(FIRST_SEEN_BY, len(w.seq) // 4)
    done = 0
    async with AsyncEncoderClient(url, timeout=3600) as client:

        async def one(i: int) -> None:
            nonlocal done
            async with sem:
                t0 = time.perf_counter()
                try:
                    parts = [image_part(w.datas[j], w.mime) for j in w.seq[i]]
                    run.responses[i] = await client.encode(parts)
                except (EncodeError, OSError) as e:
                    run.errors.append(f"request {i}: {e}")
                run.latencies.append(time.perf_counter() - t0)
                done += 1
                if done == mark:
                    run.rss_quarter = rss_bytes(pid)

        t0, c0 = time.perf_counter(), cpu_seconds(pid)
        await asyncio.gather(*(one(i) for i in range(len(w.seq))))
        run.wall_s = time.perf_counter() - t0
        run.cpu_s = cpu_seconds(pid) - c0
    run.rss_end = rss_bytes(pid)
    run.cache_bytes = await _cache_bytes(url)
    return run


async def _cache_bytes(url: str) -> float | None:
    """The service's `mmferry_cache_bytes` gauge; None where there is none (transformers, an
    older mmferry)."""
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.get(f"{url}/metrics")
    for line in r.text.splitlines() if r.status_code == 200 else []:
        if line.startswith("mmferry_cache_bytes "):
            return float(line.split()[1])
    return None


def check(
    name: str,
    run: Run,
    seq: list[tuple[int, ...]],
    expected: list,
    *,
    hashes: bool,
    cache_bytes: int | None = None,
) -> None:
    """Zero errors; grids, tokens (and hashes) as preprocessed here; repeats equal the first;
    the encoder cache within `cache_bytes` at the end (where the service reports it)."""
    if run.errors:
        raise AssertionError(f"{name}: {len(run.errors)} errors, first: {run.errors[0]}")
    first: dict[int, torch.Tensor] = {}
    for i, items in sorted(run.responses.items()):
        if len(items) != len(seq[i]):
            raise AssertionError(f"{name}: request {i} has {len(items)} items, sent {len(seq[i])}")
        for j, got in zip(seq[i], items):
            want = expected[j]
            if (got.grid_thw, got.num_tokens) != (want.grid_thw, want.num_tokens):
                raise AssertionError(f"{name}: request {i} grid {got.grid_thw} != {want.grid_thw}")
            if hashes and got.hash != want.hash:
                raise AssertionError(f"{name}: request {i} hash differs")
            ref = first.setdefault(j, got.embeds)
            harness.check_equal(f"{name} request {i} vs first", got.embeds, ref, atol=1e-5)
    if cache_bytes is not None and run.cache_bytes is not None and run.cache_bytes > cache_bytes:
        raise AssertionError(
            f"{name}: the encoder cache holds {run.cache_bytes / 2**20:.1f} MiB, over its "
            f"{cache_bytes / 2**20:.0f} MiB"
        )


def measure(name: str, cmd: list[str], w: Workload, root: Path = ROOT) -> Run:
    proc, url = start(cmd, root)
    try:
        r = asyncio.run(drive(url, proc.pid, w))
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    print(
        f"  {name}: {len(w.seq) / r.wall_s:.2f} req/s, p50 {_pct(r.latencies, 50) * 1e3:.0f} ms, "
        f"p99 {_pct(r.latencies, 99) * 1e3:.0f} ms, {r.cpu_s / len(w.seq) * 1e3:.0f} ms of "
        f"server CPU a request, {len(r.errors)} errors, RSS "
        f"{r.rss_quarter / 2**20:.0f} -> {r.rss_end / 2**20:.0f} MiB",
        flush=True,
    )
    return r


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def run(report: harness.Report, quick: bool) -> None:
    """Three servers on three workloads, one load run each per round, the server order
    rotating; checks first on every run, then the figures (median and spread over the
    rounds)."""
    compare(report, quick)


def compare(
    report: harness.Report, quick: bool, against: Path | None = None, only: str | None = None
) -> None:
    """`run`, or this tree's service against the one in `against`; `only`: the workloads whose
    names hold one of its comma-separated words."""
    import mmferry as mf

    depth = ["--depth", "1"] if quick else []
    loads = [w for w in workloads() if only is None or any(k in w.name for k in only.split(","))]
    if not loads:
        raise SystemExit(f"--only {only!r} names no workload of {[w.name for w in workloads()]}")
    proc = mf.Processor.for_model("qwen3-vl")
    expected = {w.name: [proc.image(d, "compact-u8") for d in w.datas] for w in loads}
    serve = [sys.executable, "-m", "mmferry", "serve", "--port", "0", *depth]
    servers = {"batching on": serve}
    if against is None:
        servers["batching off"] = [*serve, "--no-batching"]
        servers["transformers"] = [
            sys.executable,
            "-m",
            "mmferry.bench.load",
            "--serve-baseline",
            *depth,
        ]
        baseline, compared = "transformers", ("batching on", "batching off")
        processor = baseline_processor()
        same = {w.name: pixels_agree(w.datas, processor) for w in loads}
        for w in loads:
            print(
                f"{w.name}: pixels equal {type(processor).__name__}'s for {sum(same[w.name])} "
                f"of {len(w.datas)} images (the rest within Pillow's resize rounding; their "
                "rows are not compared)",
                flush=True,
            )
    else:
        baseline, compared = f"mmferry at {against}", ("batching on",)
        servers[baseline] = serve
        same = {w.name: [True] * len(w.datas) for w in loads}
    names = list(servers)
    runs: dict[tuple[str, str], list[Run]] = {(w.name, n): [] for w in loads for n in names}
    worst = dict.fromkeys((w.name for w in loads), 0.0)
    for r in range(ROUNDS):
        print(f"round {r + 1} of {ROUNDS}", flush=True)
        for w in loads:
            for name in harness.rotated(names, r):
                cmd = servers[name] if name == "transformers" else [*servers[name], *w.serve_flags]
                root = against if against is not None and name == baseline else ROOT
                label = f"{name}, {w.name}"
                got = measure(label, cmd, w, root)
                hashes = name != "transformers"
                check(label, got, w.seq, expected[w.name], hashes=hashes, cache_bytes=w.cache_bytes)
                runs[w.name, name].append(got)
            ours, base = runs[w.name, "batching on"][-1], runs[w.name, baseline][-1]
            worst[w.name] = max(worst[w.name], _agreement(ours, base, w.seq, same[w.name]))
            for name in names:  # the responses are checked; keep only the timings
                runs[w.name, name][-1].responses.clear()
    tower = "1-layer qwen3-vl tower (--quick)" if quick else "24-layer qwen3-vl tower"
    for w in loads:
        print(
            f"{w.name}: {len(w.seq)} requests, concurrency {w.concurrency}, {len(w.datas)} "
            f"distinct images, {tower}; max |mmferry - {baseline}| {worst[w.name]:.2e} "
            f"(allowed {ROWS_TOLERANCE})"
        )
    for w in loads:
        base = runs[w.name, baseline]
        for name in compared:
            ours = runs[w.name, name]
            rss = max(r.rss_end for r in ours)
            grew = max((r.rss_end - r.rss_quarter) / r.rss_quarter for r in ours)
            note = f"RSS at most {rss / 2**20:.0f} MiB, at most {grew:+.0%} after a quarter"
            report.add(
                harness.Figure.of_values(
                    f"requests/s, {name}, {w.name}",
                    baseline,
                    [len(w.seq) / r.wall_s for r in base],
                    [len(w.seq) / r.wall_s for r in ours],
                    unit="req/s",
                    higher_is_better=True,
                    note=note,
                )
            )
            for q in (50, 99):
                report.add(
                    harness.Figure.of_values(
                        f"p{q} latency, {name}, {w.name}",
                        baseline,
                        [_pct(r.latencies, q) for r in base],
                        [_pct(r.latencies, q) for r in ours],
                        unit="ms",
                    )
                )


def tower_alone(depth: int | None, dtype: str, requests: int) -> dict[str, float]:
    """The floor of the all-distinct workload: its first `requests` images, preprocessed
    beforehand (not timed) as the service does (compact-u8), then only the tower: one item a
    call on one worker per core, one intra-op thread each, as `mmferry serve` runs a CPU tower
    by default. Wall and CPU seconds, and the tower's matmul FLOPs."""
    import mmferry as mf
    from mmferry.encoder.flops import tower_flops
    from mmferry.models import spec_for

    workers = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = spec_for("qwen3-vl").random_config
    if depth:
        cfg = cfg.with_depth(depth)
    proc = mf.Processor.for_model("qwen3-vl")
    items = [proc.image(d, "compact-u8") for d in workloads()[0].datas[:requests]]
    enc = mf.VisionEncoder.random(config=cfg, dtype=getattr(torch, dtype))
    with torch.inference_mode():
        enc(items[:2])  # warm-up, left out

        def work(mine: list) -> None:
            with torch.inference_mode():
                for item in mine:
                    enc([item])

        threads = [threading.Thread(target=work, args=(items[k::workers],)) for k in range(workers)]
        t0, c0 = time.perf_counter(), time.process_time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    flop = tower_flops(cfg, [item.grid_thw for item in items])
    return {"s": wall, "cpu": cpu, "flop": float(flop), "workers": workers}


def capacity(
    report: harness.Report,
    quick: bool,
    dtypes: list[str],
    requests: int,
    concurrencies: list[int] | None = None,
) -> None:
    """The tier's requests/s on the all-distinct workload at each of `concurrencies` (16 when
    None) against its own floor (the tower alone, same cores, same dtype: it has no
    concurrency, so one run a round serves every concurrency), and transformers' server
    beside it, for each dtype; the rounds interleave every side. Each requests/s figure
    carries its concurrency and side in `at`, which `mmferry.bench.plot` draws as the tier's
    capacity against concurrency. Checked first on every run: the load
    checks, mmferry's float32 rows against transformers' (ROWS_TOLERANCE, where pixels are
    equal); a dtype's rows against the same server's float32 rows are reported, and mmferry's
    bfloat16 rows must lie no further from transformers' float32 ones than
    BF16_AGAINST_HF times transformers' own bfloat16 rows do."""
    import mmferry as mf

    depth = ["--depth", "1"] if quick else []
    full = workloads()[0]
    w = Workload(
        full.name,
        full.datas[:requests],
        full.seq[:requests],
        full.serve_flags,
        cache_bytes=full.cache_bytes,
    )
    sweep = concurrencies or [w.concurrency]
    # With one concurrency the labels stay as they were (no suffix), so earlier runs compare.
    tag = {c: "" if sweep == [w.concurrency] else f", concurrency {c}" for c in sweep}
    loads = {c: replace(w, concurrency=c) for c in sweep}
    proc = mf.Processor.for_model("qwen3-vl")
    expected = [proc.image(d, "compact-u8") for d in w.datas]
    same = pixels_agree(w.datas, baseline_processor())
    serve = [sys.executable, "-m", "mmferry", "serve", "--port", "0", *depth, *w.serve_flags]
    base = [sys.executable, "-m", "mmferry.bench.load", "--serve-baseline", *depth]
    alone = [sys.executable, "-m", "mmferry.bench.load", "--tower-alone", *depth]
    sides: dict[str, list[str]] = {}
    at: dict[str, int] = {}  # a server side's concurrency
    for dt in dtypes:
        for c in sweep:
            sides[f"mmferry {dt}{tag[c]}"] = [*serve, "--dtype", dt]
            sides[f"transformers {dt}{tag[c]}"] = [*base, "--dtype", dt]
            at[f"mmferry {dt}{tag[c]}"] = at[f"transformers {dt}{tag[c]}"] = c
        sides[f"tower alone {dt}"] = [*alone, "--dtype", dt, "--requests", str(requests)]
    rate: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    gflops: dict[str, list[float]] = {k: [] for k in sides}
    diffs: dict[str, float] = {}
    for r in range(ROUNDS):
        print(f"round {r + 1} of {ROUNDS}", flush=True)
        runs: dict[str, Run] = {}
        for name in harness.rotated(list(sides), r):
            if name.startswith("tower alone"):
                env = {**os.environ, "PYTHONPATH": str(ROOT)}
                out = subprocess.run(sides[name], capture_output=True, text=True, env=env)
                if out.returncode:
                    raise RuntimeError(f"{name} failed:\n{out.stderr[-2000:]}")
                got = json.loads(out.stdout.strip().splitlines()[-1])
                rate[name].append(requests / got["s"])
                cpu[name].append(got["cpu"] / requests)
                gflops[name].append(got["flop"] / got["s"] / 1e9)
                print(
                    f"  {name}: {requests / got['s']:.2f} req/s, "
                    f"{got['flop'] / got['s'] / 1e9:.1f} GFLOPS, {got['workers']} workers, "
                    f"{got['cpu'] / requests * 1e3:.0f} ms of CPU a request",
                    flush=True,
                )
                continue
            got = measure(name, sides[name], loads[at[name]])
            check(name, got, w.seq, expected, hashes=name.startswith("mmferry"))
            rate[name].append(requests / got.wall_s)
            cpu[name].append(got.cpu_s / requests)
            runs[name] = got
        for dt in dtypes:
            for t in tag.values():
                ours, theirs = runs[f"mmferry {dt}{t}"], runs[f"transformers {dt}{t}"]
                key = f"mmferry {dt} - transformers {dt}"
                if dt == "float32":
                    diffs[key] = max(diffs.get(key, 0.0), _agreement(ours, theirs, w.seq, same))
                else:
                    diffs[key] = max(diffs.get(key, 0.0), _largest(ours, theirs, w.seq, same))
        for t in tag.values() if "float32" in dtypes else ():
            hf32 = runs[f"transformers float32{t}"]
            for dt in dtypes:
                if dt == "float32":
                    continue
                for who in ("mmferry", "transformers"):
                    key = f"{who} {dt} - {who} float32"
                    diffs[key] = max(
                        diffs.get(key, 0.0),
                        _largest(runs[f"{who} {dt}{t}"], runs[f"{who} float32{t}"], w.seq, same),
                    )
                key = f"mmferry {dt} - transformers float32"
                ours_off = _largest(runs[f"mmferry {dt}{t}"], hf32, w.seq, same)
                theirs_off = _largest(runs[f"transformers {dt}{t}"], hf32, w.seq, same)
                if ours_off > BF16_AGAINST_HF * theirs_off:
                    raise AssertionError(
                        f"mmferry {dt} lies {ours_off:.3g} from transformers' float32 rows, "
                        f"transformers {dt} {theirs_off:.3g}"
                    )
                diffs[key] = max(diffs.get(key, 0.0), ours_off)
        for got in runs.values():
            got.responses.clear()
    tower = "1-layer qwen3-vl tower (--quick)" if quick else "24-layer qwen3-vl tower"
    print(
        f"{w.name}: {requests} requests, concurrency {', '.join(map(str, sweep))}, {tower}; "
        "largest row "
        "differences (over images whose pixels are equal): "
        + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items())
    )
    for dt, c in ((dt, c) for dt in dtypes for c in sweep):
        t = tag[c]
        floor, ours, theirs = f"tower alone {dt}", f"mmferry {dt}{t}", f"transformers {dt}{t}"
        note = f"the tower alone at {np.median(gflops[floor]):.1f} GFLOPS"
        for name, base_name in ((ours, floor), (theirs, floor), (ours, theirs)):
            report.add(
                harness.Figure(
                    f"requests/s, {dt}, {w.name}{t}" + (f", {name}" if name != ours else ""),
                    base_name,
                    rate[base_name],
                    rate[name],
                    unit="req/s",
                    higher_is_better=True,
                    note=note if base_name == floor else "",
                    at={"concurrency": c, "side": name.removesuffix(t)},
                )
            )
        for name in (ours, theirs):
            report.add(
                harness.Figure(
                    f"CPU a request, {dt}, {w.name}, {name}",
                    floor,
                    cpu[floor],
                    cpu[name],
                    note="the server's every thread; the floor's tower calls only",
                )
            )
    for dt, t in ((dt, t) for dt in dtypes for t in tag.values()):
        if dt == "float32" or "float32" not in dtypes:
            continue
        for who in ("mmferry", "transformers"):
            report.add(
                harness.Figure(
                    f"requests/s, {who} {dt} against float32, {w.name}{t}",
                    f"{who} float32{t}",
                    rate[f"{who} float32{t}"],
                    rate[f"{who} {dt}{t}"],
                    unit="req/s",
                    higher_is_better=True,
                )
            )


# mmferry's bfloat16 rows may lie this many times further from transformers' float32 rows
# than transformers' own bfloat16 rows do (two bfloat16 towers round in different places).
BF16_AGAINST_HF = 2.0


def _largest(a: Run, b: Run, seq: list[tuple[int, ...]], same: list[bool]) -> float:
    """Largest difference between two runs' rows (the same requests), over the items whose
    pixels mmferry and the baseline preprocess alike."""
    worst = 0.0
    for i, items in a.responses.items():
        for j, x, y in zip(seq[i], items, b.responses[i], strict=True):
            if same[j]:
                worst = max(worst, (x.embeds.float() - y.embeds.float()).abs().max().item())
    return worst


def _agreement(ours: Run, base: Run, seq: list[tuple[int, ...]], same: list[bool]) -> float:
    """Largest difference between mmferry's and the baseline's rows, checked per item whose
    pixels the two preprocess alike (`same`, from `pixels_agree`)."""
    worst = 0.0
    for i, items in base.responses.items():
        for j, got, mine in zip(seq[i], items, ours.responses[i], strict=True):
            if not same[j]:
                continue
            harness.check_equal(
                f"baseline vs mmferry, request {i}", mine.embeds, got.embeds, atol=ROWS_TOLERANCE
            )
            worst = max(worst, (mine.embeds - got.embeds).abs().max().item())
    return worst


def baseline_processor() -> Any:
    """transformers' default Qwen-VL image processor for qwen3-vl's settings: torchvision's,
    or where torchvision does not import, transformers' own fallback on Pillow."""
    from mmferry.models import preset

    try:
        # NOTE: torchvision itself is asked: transformers' module may already be imported
        # with stand-ins for it (the tests' oracles do that).
        import torchvision  # noqa: F401
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
            Qwen2VLImageProcessor as Default,
        )
    except (ImportError, RuntimeError):  # no torchvision, or one built for another torch
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as Default,
        )
    p = preset("qwen3-vl")
    return Default(
        patch_size=p.patch_size,
        merge_size=p.merge_size,
        temporal_patch_size=p.temporal_patch_size,
        min_pixels=p.image_min_pixels,
        max_pixels=p.image_max_pixels,
        image_mean=list(p.image_mean),
        image_std=list(p.image_std),
    )


def baseline_image(data: bytes) -> Image.Image:
    """An image as the baseline server opens it."""
    return Image.open(io.BytesIO(data)).convert("RGB")


def pixels_agree(datas: list[bytes], processor: Any) -> list[bool]:
    """Per image, whether mmferry's `hf` pixels equal `processor`'s; raises where they differ
    by more than Pillow's resize rounding (only with the Pillow processor: PIL_LEVELS levels,
    in at most PIL_SHARE of the values unless mmferry's resized pixels lie within EXACT_LEVELS
    of the exact resample) or in their grid."""
    import mmferry as mf

    proc = mf.Processor.for_model("qwen3-vl")
    level = 1 / (255 * max(proc.config.image_std))  # one uint8 level, normalised, at least
    pillow = "Pil" in type(processor).__name__
    out = []
    for j, data in enumerate(datas):
        mine = proc.image(data, "hf")
        theirs = processor(images=[baseline_image(data)], return_tensors="pt")
        if tuple(theirs["image_grid_thw"][0].tolist()) != mine.grid_thw:
            raise AssertionError(f"image {j}: grid {mine.grid_thw} != the baseline's")
        diff = (mine.feature - theirs["pixel_values"]).abs()
        same = diff.max().item() <= 1e-6
        if not same:
            levels, share = diff.max().item() / level, (diff > 1e-6).float().mean().item()
            rounding = pillow and levels <= PIL_LEVELS + 0.01
            if rounding and share > PIL_SHARE:
                rounding = exact_distance(data, proc) <= EXACT_LEVELS
            if not rounding:
                raise AssertionError(
                    f"image {j}: pixels differ from {type(processor).__name__}'s by up to "
                    f"{levels:.2f} uint8 levels in {share:.2%} of the values"
                )
        out.append(same)
    return out


def exact_distance(data: bytes, proc: Any) -> float:
    """Largest distance, in uint8 levels, of mmferry's resized pixels (its compact-u8 rows) from
    the exact resample of the decoded image: the same antialiased bicubic in float64, width then
    height, clipped between, laid out as transformers lays out patch rows."""
    import torch.nn.functional as F

    item = proc.image(data, "compact-u8")
    _, gh, gw = item.grid_thw
    p, m = proc.config.patch_size, item.merge_size
    src = torch.from_numpy(np.array(baseline_image(data))).permute(2, 0, 1)[None].double()
    x = F.interpolate(src, size=(src.shape[2], gw * p), mode="bicubic", antialias=True)
    x = F.interpolate(x.clamp(0, 255), size=(gh * p, gw * p), mode="bicubic", antialias=True)
    c = x.shape[1]
    # [C, H, W] -> merge blocks row-major, the m x m patches inside, each patch [C][P][P].
    rows = x.clamp(0, 255)[0].reshape(c, gh // m, m, p, gw // m, m, p)
    rows = rows.permute(1, 4, 2, 5, 0, 3, 6).reshape(-1, c * p * p)
    return (item.feature.double() - rows).abs().max().item()


def serve_baseline(depth: int | None, dtype: str = "float32") -> int:
    """transformers behind FastAPI, the obvious way: one processor + one model call per request."""
    import base64

    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    import mmferry as mf
    from mmferry.bench.encoder import hf_tower
    from mmferry.models import preset, spec_for
    from mmferry.server.encoded import EncodedItem, to_bytes

    cfg = spec_for("qwen3-vl").random_config
    if depth:
        cfg = cfg.with_depth(depth)
    # NOTE: the float32 weights cast to `dtype`, as `mmferry serve --dtype` makes its own; the
    # model casts the processor's float32 pixels to its dtype in its patch embedding.
    model = hf_tower(mf.VisionEncoder.random(config=cfg), "cpu", getattr(torch, dtype))
    p = preset("qwen3-vl")
    processor = baseline_processor()
    print(f"baseline: {type(processor).__name__}", flush=True)
    app = FastAPI()

    def encode(body: dict) -> bytes:
        images = [
            baseline_image(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))
            for part in body["content"]
        ]
        inputs = processor(images=images, return_tensors="pt")
        with torch.inference_mode():
            out = model(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        deep = tuple(out.deepstack_features) if out.deepstack_features is not None else ()
        items, start = [], 0
        for grid in inputs["image_grid_thw"].tolist():
            n = grid[0] * grid[1] * grid[2] // p.merge_size**2
            rows = out.pooler_output[start : start + n]
            parts = tuple(d[start : start + n] for d in deep)
            items.append(EncodedItem("image", rows, parts, tuple(grid), n, ""))
            start += n
        return to_bytes(items)

    async def route(request: Any) -> Any:
        body = await request.json()
        try:
            data = await asyncio.get_running_loop().run_in_executor(None, encode, body)
        except Exception as e:  # noqa: BLE001
            return JSONResponse({"error": {"kind": "internal", "message": str(e)}}, 500)
        return Response(data, media_type="application/vnd.mmferry.safetensors")

    # Annotations are strings here; FastAPI needs the class to pass the raw request.
    route.__annotations__["request"] = Request
    app.post("/v1/encode")(route)

    from mmferry.server.run import listening_socket

    sock = listening_socket("127.0.0.1", 0)  # Nagle off, as the service's own
    print(f"baseline: listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "--serve-baseline" in argv:
        p = argparse.ArgumentParser()
        p.add_argument("--serve-baseline", action="store_true")
        p.add_argument("--depth", type=int)
        p.add_argument("--dtype", default="float32")
        args = p.parse_args(argv)
        return serve_baseline(args.depth, args.dtype)
    if "--tower-alone" in argv:
        p = argparse.ArgumentParser()
        p.add_argument("--tower-alone", action="store_true")
        p.add_argument("--depth", type=int)
        p.add_argument("--dtype", default="float32")
        p.add_argument("--requests", type=int, default=REQUESTS)
        args = p.parse_args(argv)
        print(json.dumps(tower_alone(args.depth, args.dtype, args.requests)), flush=True)
        return 0
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--against", type=Path)
    p.add_argument("--only")
    p.add_argument("--capacity", help="dtypes, comma-separated: the tier against its floor")
    p.add_argument("--requests", type=int, default=REQUESTS)
    p.add_argument("--concurrency", help="with --capacity: concurrencies, comma-separated")
    known, rest = p.parse_known_args(argv)
    if known.concurrency and not known.capacity:
        raise SystemExit("--concurrency is a setting of --capacity")
    if known.capacity:
        dtypes = known.capacity.split(",")
        sweep = [int(c) for c in known.concurrency.split(",")] if known.concurrency else None
        return harness.main_for(
            lambda report, quick: capacity(report, quick, dtypes, known.requests, sweep),
            rest,
            "The encoder tier's capacity against the tower alone",
        )
    against = known.against
    if against is not None and not (against / "mmferry" / "__init__.py").is_file():
        raise SystemExit(f"--against {against}: no mmferry package there")
    return harness.main_for(
        lambda report, quick: compare(report, quick, against, known.only),
        rest,
        __doc__.splitlines()[0],
    )


if __name__ == "__main__":
    raise SystemExit(main())
