"""Benchmark: image and video preprocessing, mmferry beside transformers, in one run.

Images: 16 seeded images from 12 MP (4000x3000) down to 224x224, qwen3-vl settings, given
two ways: already-decoded PIL images, and the same as JPEG bytes (decoded inside each call,
as transformers' `load_image` does). Baselines: transformers' `Qwen2VLImageProcessorPil`
(here) and transformers' default torchvision `Qwen2VLImageProcessor`, which runs in its own
environment (`--baseline-venv DIR`, created with torch 2.14.1 + torchvision 0.29.1 when
missing) as a worker process that times its own rounds; its rounds interleave with
mmferry's. The same 16 sizes every round let mmferry's buffer cache (preprocess/buffers.py)
hit nearly always, so a second image workload gives every round new sizes (none repeats
across rounds), JPEG bytes, with mmferry timed with its cache on and off beside the PIL
processor. Every output is checked first: against the baselines, and mmferry's in recycled
buffers against fresh pages. Floors: one 12 MP image (a decoded HWC array) against one uint8
resize plus one write of the output. Sizes: the same images one size at a time (decoded PIL
images, each round that image repeated to about SIZE_ROUND_PIXELS), mmferry's ratio against
each baseline per image size, drawn by `mmferry.bench.plot` against the size. Video: a
seeded 60 s 1280x720 H.264 clip (a keyframe every 2 s), sampled at 0.25 and 2 fps, against
today's decoder (every frame decoded up to the last sampled one, held at full size, then
resized), kept here as the reference.

Run: python -m mmferry.bench.preprocess [--quick] [--rounds N] [--baseline-venv DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from mmferry.bench.harness import (
    MIN_ROUNDS,
    Figure,
    Report,
    check_equal,
    compare,
    interleave,
    machine,
    timed,
)
from mmferry.models import preset
from mmferry.preprocess import buffers
from mmferry.preprocess import video as video_mod
from mmferry.preprocess.buffers import HostBufferCache, empty_host, host_cache
from mmferry.preprocess.image import process_image
from mmferry.preprocess.patchify import resize_u8
from mmferry.preprocess.resize import smart_resize
from mmferry.preprocess.threads import intra_op_threads, preprocess_threads
from mmferry.preprocess.video import process_video

SIZES = [  # (width, height): 12 MP down to 224x224
    (4000, 3000),
    (3000, 4000),
    (3264, 2448),
    (2592, 1944),
    (2048, 1536),
    (1920, 1080),
    (1600, 1200),
    (1280, 960),
    (1280, 720),
    (1024, 768),
    (800, 600),
    (640, 480),
    (512, 512),
    (448, 448),
    (320, 240),
    (224, 224),
]
BASELINE_PACKAGES = [
    "torch==2.14.1",
    "torchvision==0.29.1",
    "transformers==5.24.0",
    "pillow",
    "numpy",
]
# Outputs of the two resamplers (PIL's bicubic and torch's) differ by design: up to this many
# uint8 levels on a pixel (mean well under one), see tests/preprocess/test_image.py.
PIL_LEVELS = 20.0


def _smooth_field(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """A smooth random colour field plus pixel noise, [h, w, 3] uint8."""
    coarse = torch.from_numpy(rng.random((1, 3, 6, 8), dtype=np.float32) * 255)
    field = F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False)[0]
    noise = torch.from_numpy(rng.normal(0, 8, (3, h, w)).astype(np.float32))
    return (field + noise).clamp_(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()


def make_images(quick: bool) -> list[bytes]:
    """The fixed, seeded image workload as JPEG bytes."""
    rng = np.random.default_rng(1234)
    out = []
    for w, h in SIZES[8:] if quick else SIZES:
        buf = io.BytesIO()
        Image.fromarray(_smooth_field(rng, w, h)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def distinct_batches(quick: bool, batches: int) -> list[list[bytes]]:
    """`batches` lists of JPEG bytes, one per round: the image workload's sizes, grown by
    another step in each list, so that no size repeats across rounds (and the resized sizes
    differ too: each step moves the width by more than the 32-pixel rounding)."""
    base = SIZES[8:] if quick else SIZES
    sizes = [[(w + 40 * (b + 1), h + 24 * (b + 1)) for w, h in base] for b in range(batches)]
    flat = [size for batch in sizes for size in batch]
    if len(set(flat)) != len(flat):
        raise AssertionError("the distinct-size workload repeats a size")
    # One field to crop every image from: generating each would take longer than the run.
    field = _smooth_field(
        np.random.default_rng(4321), max(w for w, _ in flat) + 64, max(h for _, h in flat) + 64
    )
    out = []
    for b, batch in enumerate(sizes):
        datas = []
        for i, (w, h) in enumerate(batch):
            y, x = (7 * i + 3 * b) % 64, (5 * i + 11 * b) % 64
            buf = io.BytesIO()
            crop = np.ascontiguousarray(field[y : y + h, x : x + w])
            Image.fromarray(crop).save(buf, "JPEG", quality=90)
            datas.append(buf.getvalue())
        out.append(datas)
    return out


@contextmanager
def cache_off() -> Iterator[None]:
    """mmferry's buffer cache off for the block (MMFERRY_HOST_CACHE_MB=0): fresh pages."""
    real = buffers._cache
    buffers._cache = HostBufferCache(0)
    try:
        yield
    finally:
        buffers._cache = real


def load_pil(data: bytes) -> Image.Image:
    """transformers' `load_image` steps: EXIF orientation, then RGB."""
    return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")


def make_video(path: str, seconds: int) -> None:
    """A seeded 1280x720 30 fps H.264 clip, a keyframe every 2 s, panning over a field."""
    import av

    rng = np.random.default_rng(99)
    fps, w, h = 30, 1280, 720
    base = _smooth_field(rng, w + 4 * seconds * fps, h)
    with av.open(path, "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.codec_context.gop_size = 2 * fps
        stream.options = {"preset": "veryfast", "crf": "23", "keyint_min": str(2 * fps)}
        for i in range(seconds * fps):
            frame = np.ascontiguousarray(base[:, 4 * i : 4 * i + w])
            for pkt in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(pkt)
        for pkt in stream.encode():
            out.mux(pkt)


def decode_every_frame(data, name, indices, check_size, target_size, info=None):
    """Today's decoder, the reference: every frame up to the last sampled one is decoded, the
    sampled ones are held at full size, then all are resized at once."""
    from mmferry.preprocess.video_decode import _open, import_av

    av = import_av()
    container, stream = _open(av, data, name)
    wanted: dict[int, list[int]] = {}
    for slot, idx in enumerate(indices):
        wanted.setdefault(idx, []).append(slot)
    out = None
    with container:
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                if out is None:
                    check_size(frame.height, frame.width)
                    out = empty_host((len(indices), frame.height, frame.width, 3), torch.uint8)
                rgb = frame.to_ndarray(format="rgb24")
                for s in wanted[i]:
                    out.numpy()[s] = rgb
            if i >= indices[-1]:
                break
    frames = out.permute(0, 3, 1, 2)
    return resize_u8(frames, *target_size(*frames.shape[2:]))


class TorchvisionWorker:
    """transformers' default processor in the baseline environment, one process per run."""

    def __init__(self, venv: Path, files: list[str], settings: dict) -> None:
        worker = Path(__file__).with_name("_tv_worker.py")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen(
            [str(venv / "bin" / "python"), str(worker)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.ask({"cmd": "load", "files": files, "settings": settings})

    def ask(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the baseline worker exited; see its stderr above")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def run(
        self, kind: str, cpu: list[float] | None = None, items: list[int] | None = None, repeat=1
    ) -> float:
        """Seconds of one round of `kind` (every image, or `items` each `repeat` times); its
        CPU seconds (all the worker's threads) are appended to `cpu`."""
        msg: dict = {"cmd": "run", "kind": kind, "repeat": repeat}
        if items is not None:
            msg["items"] = items
        reply = self.ask(msg)
        if cpu is not None:
            cpu.append(reply["cpu"])
        return reply["s"]

    def close(self) -> None:
        self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def ensure_baseline_venv(venv: Path) -> Path:
    """The baseline environment, created (a large download, once) when missing."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating the baseline environment in {venv} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", *BASELINE_PACKAGES], check=True)
    return venv


def image_figures(
    report: Report, datas: list[bytes], cfg, rounds: int, worker: TorchvisionWorker | None
) -> None:
    """Interleaved rounds of every image runner; one figure per (layout, baseline) pair."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    proc = Qwen2VLImageProcessorPil(**settings(cfg))
    pils = [load_pil(d) for d in datas]
    for kind, sources in (("PIL images", pils), ("JPEG bytes", datas)):
        tag = "pil" if kind == "PIL images" else "jpeg"

        def pil_base(sources=sources, tag=tag) -> None:
            for s in sources:
                proc(images=[s if tag == "pil" else load_pil(s)], return_tensors="pt")

        # NOTE: CPU seconds beside the wall: on a shared host the wall of a round is mostly
        # the other tenants' share of the cores, while the CPU time is the work each side did
        # (every thread of its process: mmferry's hash thread, the baseline's torch threads).
        cpu: dict[str, list[float]] = {k: [] for k in ("pil", "hf", "cu", "tv")}
        runners: dict[str, Callable[[], float]] = {
            "pil": cpu_timed(pil_base, cpu["pil"]),
            "hf": cpu_timed(lambda s=sources: [process_image(x, cfg) for x in s], cpu["hf"]),
            "cu": cpu_timed(
                lambda s=sources: [process_image(x, cfg, layout="compact-u8") for x in s],
                cpu["cu"],
            ),
        }
        if worker is not None:
            runners["tv"] = lambda tag=tag, c=cpu["tv"]: worker.run(tag, c)
        times = interleave(runners, rounds=rounds)
        warm = len(cpu["hf"]) - rounds  # the warm-up round's CPU times are left out
        spent = {k: v[warm:] for k, v in cpu.items()}
        n = len(sources)
        for layout, key in (("hf", "hf"), ("compact-u8", "cu")):
            bases = [("transformers PIL processor", "pil")]
            if worker is not None:
                bases.append(("transformers torchvision processor", "tv"))
            for base_name, base in bases:
                report.add(
                    Figure(
                        f"{n} {kind}, {layout}",
                        base_name,
                        times[base],
                        times[key],
                        note=f"{n / np.median(times[key]):.1f} images/s",
                    )
                )
                report.add(
                    Figure(f"{n} {kind}, {layout}, CPU time", base_name, spent[base], spent[key])
                )


# A round of the per-size figures processes about this many input pixels (a small image
# repeated), so that a 224x224 round is not a few microseconds' noise.
SIZE_ROUND_PIXELS = 4_000_000


def size_figures(
    report: Report, datas: list[bytes], cfg, rounds: int, worker: TorchvisionWorker | None
) -> None:
    """Per image size, decoded PIL images: mmferry (hf and compact-u8) against transformers'
    PIL processor and (with `worker`) its torchvision one, interleaved rounds per size. Each
    figure's `at` holds the size, for the chart of ratio against image size."""
    proc = _pil_processor(cfg)
    pils = [load_pil(d) for d in datas]
    for i, im in enumerate(pils):
        w, h = im.size
        repeat = max(1, SIZE_ROUND_PIXELS // (w * h))
        runners: dict[str, Callable[[], float]] = {
            "pil": timed(
                lambda im=im, n=repeat: [proc(images=[im], return_tensors="pt") for _ in range(n)]
            ),
            "hf": timed(lambda im=im, n=repeat: [process_image(im, cfg) for _ in range(n)]),
            "cu": timed(
                lambda im=im, n=repeat: [
                    process_image(im, cfg, layout="compact-u8") for _ in range(n)
                ]
            ),
        }
        if worker is not None:
            runners["tv"] = lambda i=i, n=repeat: worker.run("pil", items=[i], repeat=n)
        times = interleave(runners, rounds=rounds)
        bases = [("transformers PIL processor", "pil")]
        if worker is not None:
            bases.append(("transformers torchvision processor", "tv"))
        for layout, key in (("hf", "hf"), ("compact-u8", "cu")):
            for base_name, base in bases:
                report.add(
                    Figure(
                        f"{w}x{h} PIL image x{repeat}, {layout}",
                        base_name,
                        times[base],
                        times[key],
                        at={"pixels": w * h, "size": f"{w}x{h}", "side": f"mmferry {layout}"},
                    )
                )


def cpu_timed(fn: Callable[[], object], cpu: list[float]) -> Callable[[], float]:
    """`timed(fn)` that also appends the CPU seconds of the call (every thread of this
    process) to `cpu`."""

    def run() -> float:
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
        cpu.append(time.process_time() - c0)
        return wall

    return run


def distinct_figures(report: Report, batches: list[list[bytes]], cfg, rounds: int) -> None:
    """JPEG bytes of sizes new every round (one batch a round, the same for every side),
    mmferry with its buffer cache on and off, beside transformers' PIL processor."""
    pil_proc = _pil_processor(cfg)
    cache = host_cache()
    counts = {"hf": [0, 0], "cu": [0, 0]}  # cache hits, misses over the calls of a side

    def side(work: Callable[[list[bytes]], object]) -> Callable[[], float]:
        # Each side takes the next batch at every call: warm-up and rounds alike.
        batch = iter(batches)
        return timed(lambda: work(next(batch)))

    def ours(key: str, layout: str, on: bool) -> Callable[[list[bytes]], None]:
        def work(datas: list[bytes]) -> None:
            if not on:
                with cache_off():
                    for d in datas:
                        process_image(d, cfg, layout=layout)
                return
            hits, misses = cache.hits, cache.misses
            for d in datas:
                process_image(d, cfg, layout=layout)
            counts[key][0] += cache.hits - hits
            counts[key][1] += cache.misses - misses

        return work

    runners = {
        "pil": side(lambda ds: [pil_proc(images=[load_pil(d)], return_tensors="pt") for d in ds]),
        "hf": side(ours("hf", "hf", True)),
        "hf off": side(ours("hf", "hf", False)),
        "cu": side(ours("cu", "compact-u8", True)),
        "cu off": side(ours("cu", "compact-u8", False)),
    }
    times = interleave(runners, rounds=rounds)
    n = len(batches[0])
    for layout, key in (("hf", "hf"), ("compact-u8", "cu")):
        hits, misses = counts[key]
        for off in (False, True):
            mine = times[f"{key} off" if off else key]
            report.add(
                Figure(
                    f"{n} JPEGs of sizes new every round, {layout}"
                    + (", mmferry's buffer cache off" if off else ""),
                    "transformers PIL processor",
                    times["pil"],
                    mine,
                    note=f"{n / np.median(mine):.1f} images/s"
                    + ("" if off else f", buffer cache hits {hits}/{hits + misses}"),
                )
            )


def settings(cfg) -> dict:
    return {
        "patch_size": cfg.patch_size,
        "merge_size": cfg.merge_size,
        "temporal_patch_size": cfg.temporal_patch_size,
        "min_pixels": cfg.image_min_pixels,
        "max_pixels": cfg.image_max_pixels,
        "image_mean": list(cfg.image_mean),
        "image_std": list(cfg.image_std),
    }


def check_images(datas: list[bytes], cfg, worker: TorchvisionWorker | None, tmp: str) -> None:
    """Every output compared before anything is timed."""
    pil_proc = _pil_processor(cfg)
    for i, data in enumerate(datas):
        ours = _check_image(f"image {i}", data, cfg, pil_proc)
        if worker is not None:
            path = os.path.join(tmp, f"tv{i}.npy")
            worker.ask({"cmd": "check", "index": i, "kind": "jpeg", "out": path})
            tv = torch.from_numpy(np.load(path))
            # Same uint8 resize kernel; the decoders' Pillow versions may differ by a level.
            check_equal(f"image {i} vs torchvision processor", ours, tv, atol=2 / 255 / 0.5)


def _pil_processor(cfg):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(**settings(cfg))


def _check_image(name: str, data: bytes, cfg, pil_proc) -> torch.Tensor:
    """mmferry's hf rows of one JPEG: built in recycled buffers equal to fresh pages, within
    the resamplers' difference of transformers' PIL processor, and equal to its compact-u8
    rows; returns them."""
    ours = process_image(data, cfg).feature
    compact = process_image(data, cfg, layout="compact-u8").feature
    with cache_off():
        check_equal(f"{name}, hf, cache on vs off", ours, process_image(data, cfg).feature)
        fresh = process_image(data, cfg, layout="compact-u8").feature
        check_equal(f"{name}, compact-u8, cache on vs off", compact, fresh)
    pil = pil_proc(images=[load_pil(data)], return_tensors="pt")["pixel_values"]
    # PIL resamples differently from torch; compared in uint8 levels.
    std = torch.tensor(cfg.image_std).repeat_interleave(cfg.temporal_patch_size * 256)
    levels = (ours - pil).abs() * std * 255
    if levels.max() > PIL_LEVELS or levels.mean() > 0.5:
        raise AssertionError(f"{name}: {levels.max():.1f} levels from the PIL processor")
    check_equal(f"{name}, compact-u8 as hf", _compact_as_hf(compact, cfg), ours, atol=1e-6)
    return ours


def _compact_as_hf(compact: torch.Tensor, cfg) -> torch.Tensor:
    from mmferry.items import MultimodalItem
    from mmferry.testing.layouts import compact_to_hf

    rows = compact.shape[0]
    item = MultimodalItem("image", compact, (1, 2, rows // 2), "compact-u8", "0" * 32, 2)
    return compact_to_hf(item, cfg)


def mmferry_stages(pils: list, cfg) -> dict[str, float]:
    """CPU seconds of each of mmferry's steps over decoded PIL images, each timed alone on
    one thread: the pixels out of Pillow, the resize, the patch rows (the normalise and the
    write in one pass), the key.

    NOTE: two passes, the second timed: the first refills the buffer cache, which gives its
    pages MADV_FREE after 10 s idle and unmaps them after 300 s (buffers.py), as may happen
    during the baseline's turn. The images part times whole calls with whatever the cache
    holds."""
    out = dict.fromkeys(("pixels", "resize", "rows hf", "rows compact-u8", "key"), 0.0)

    def clock(name: str, fn):
        c0 = time.process_time()
        value = fn()
        out[name] += time.process_time() - c0
        return value

    _stage_pass(pils, cfg, lambda name, fn: fn())
    _stage_pass(pils, cfg, clock)
    return out


def _stage_pass(pils: list, cfg, clock) -> None:
    """One pass of mmferry's steps over `pils`, each step through `clock(name, fn)`."""
    from mmferry.preprocess.decode import as_batch, decode_image, pixels_identity
    from mmferry.preprocess.hashing import item_hash
    from mmferry.preprocess.image import resized_size
    from mmferry.preprocess.patchify import patchify

    geometry = dict(patch=cfg.patch_size, merge=cfg.merge_size, temporal=cfg.temporal_patch_size)
    with intra_op_threads(1):
        for im in pils:
            px = clock("pixels", lambda im=im: decode_image(im, cfg.max_decoded_pixels).pixels)
            size = resized_size(px.shape[1], px.shape[2], cfg)
            x = clock("resize", lambda px=px, size=size: resize_u8(as_batch(px), *size))
            for layout in ("hf", "compact-u8"):
                clock(
                    f"rows {layout}",
                    lambda x=x, layout=layout: patchify(
                        x,
                        image=True,
                        **geometry,
                        layout=layout,
                        mean=cfg.image_mean,
                        std=cfg.image_std,
                        threads=1,
                    ),
                )
            # the smaller of the source and the resized pixels, as image.py keys a PIL image
            small = px if px[0].numel() <= x[0, 0].numel() else x[0]
            clock(
                "key",
                lambda small=small: item_hash(
                    "image", pixels_identity(small.permute(1, 2, 0), b"hwc"), cfg
                ),
            )


def stage_figures(report: Report, datas: list[bytes], cfg, rounds: int, worker) -> None:
    """Where the ratio goes: each side's steps over the 16 decoded images, CPU seconds, one
    round of both sides after the other. The baseline's steps are torchvision's (in its
    worker, 2 torch threads, its own environment); mmferry's on one thread."""
    pils = [load_pil(d) for d in datas]
    ours: dict[str, list[float]] = {}
    theirs: dict[str, list[float]] = {}
    for r in range(rounds + 1):  # the first is the warm-up
        sides = [("ours", lambda: mmferry_stages(pils, cfg))]
        if worker is not None:
            sides.append(("theirs", lambda: worker.ask({"cmd": "stages"})))
        for name, fn in sides if r % 2 == 0 else sides[::-1]:
            got = fn()
            if r:
                for k, v in got.items():
                    (ours if name == "ours" else theirs).setdefault(k, []).append(v)
    med = {k: np.median(v) * 1e3 for k, v in ours.items()}
    print(
        f"mmferry, one thread, {len(pils)} PIL images, CPU ms (median of {rounds} rounds): "
        + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
    )
    if not theirs:
        return
    tv = {k: np.median(v) * 1e3 for k, v in theirs.items()}
    print(
        "transformers torchvision processor, CPU ms: "
        + ", ".join(f"{k} {v:.1f}" for k, v in tv.items())
    )
    pairs = (
        ("pixels out of Pillow", "to tensor", ("pixels",)),
        ("resize", "resize", ("resize",)),
        ("normalise + patch rows, hf", ("normalise", "patchify"), ("rows hf",)),
        ("patch rows, compact-u8 (no normalise)", ("normalise", "patchify"), ("rows compact-u8",)),
    )
    for label, base_keys, our_keys in pairs:
        base_keys = (base_keys,) if isinstance(base_keys, str) else base_keys
        report.add(
            Figure(
                f"stage: {label}, CPU time",
                "transformers torchvision processor",
                [sum(v) for v in zip(*(theirs[k] for k in base_keys))],
                [sum(v) for v in zip(*(ours[k] for k in our_keys))],
            )
        )


def floor_figures(report: Report, cfg, rounds: int) -> None:
    """One 12 MP decoded image per layout beside its floor: one uint8 resize, one write of the
    output, on the thread count mmferry uses by default. Two floors: in recycled pages, as
    mmferry's own buffers are (buffers.py), and in fresh pages, as a plain new tensor is."""
    # A decoded image is a contiguous HWC array.
    rgb = np.ascontiguousarray(_smooth_field(np.random.default_rng(7), 4000, 3000))
    h, w = smart_resize(
        3000,
        4000,
        factor=cfg.factor,
        min_pixels=cfg.image_min_pixels,
        max_pixels=cfg.image_max_pixels,
    )
    chw = torch.from_numpy(rgb).unsqueeze(0).permute(0, 3, 1, 2)
    for layout, dtype, per_px in (("hf", torch.float32, 6), ("compact-u8", torch.uint8, 3)):

        def recycled(dtype=dtype, per_px=per_px) -> None:
            with intra_op_threads(preprocess_threads()):
                resize_u8(chw, h, w)
                empty_host((h * w * per_px,), dtype).fill_(1)

        def fresh(dtype=dtype, per_px=per_px) -> None:
            with intra_op_threads(preprocess_threads()):
                F.interpolate(chw, size=(h, w), mode="bicubic", antialias=True)
                torch.empty((h * w * per_px,), dtype=dtype).fill_(1)

        label = f"one 4000x3000 image -> {w}x{h}, {layout}"
        times = interleave(
            {
                "floor (recycled pages)": timed(recycled),
                "floor (fresh pages)": timed(fresh),
                "mmferry": timed(lambda l=layout: process_image(rgb, cfg, layout=l)),
            },
            rounds=rounds,
        )
        for name in ("floor (recycled pages)", "floor (fresh pages)"):
            fig = Figure(label, name, times[name], times["mmferry"])
            fig.note = f"{1 / fig.ratio:.2f}x the {name} (target <= 1.5x)"
            report.add(fig)


def thread_figures(report: Report, datas: list[bytes], cfg, rounds: int) -> None:
    """Two threads against one (the default), on the PIL workload."""
    pils = [load_pil(d) for d in datas]
    for layout in ("hf", "compact-u8"):
        fig = compare(
            f"{len(pils)} PIL images, {layout}, mmferry threads=2 against threads=1",
            {
                "threads=1": lambda l=layout: [
                    process_image(p, cfg, layout=l, threads=1) for p in pils
                ],
                "mmferry": lambda l=layout: [
                    process_image(p, cfg, layout=l, threads=2) for p in pils
                ],
            },
            rounds=rounds,
        )
        report.add(fig)


def video_figures(report: Report, cfg, rounds: int, quick: bool) -> None:
    seconds = 20 if quick else 60
    # The clip is seeded, so it is encoded once per machine and reused by later runs.
    path = os.path.join(tempfile.gettempdir(), f"mmferry-bench-clip-{seconds}s.mp4")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        part = path.replace(".mp4", ".part.mp4")
        make_video(part, seconds)
        os.replace(part, path)
        print(f"({seconds} s clip encoded in {time.perf_counter() - t0:.0f} s)", flush=True)

    def today(fps: float):
        real = video_mod.decode_frames
        video_mod.decode_frames = decode_every_frame
        try:
            return process_video(path, cfg, fps=fps)
        finally:
            video_mod.decode_frames = real

    for fps in (0.25, 2.0):
        ours = process_video(path, cfg, fps=fps)
        check_equal(f"video at {fps} fps", ours.feature, today(fps).feature)
        fig = compare(
            f"{seconds} s 1280x720 clip at {fps:g} fps -> grid {ours.grid_thw}, hf",
            {
                "today (decode every frame)": lambda f=fps: today(f),
                "mmferry": lambda f=fps: process_video(path, cfg, fps=f),
            },
            rounds=rounds,
        )
        report.add(fig)


# Where `--baseline-venv` puts the torchvision baseline by default; `mmferry bench preprocess`
# uses it when it exists (create it once with `python -m mmferry.bench.preprocess --baseline-venv`).
DEFAULT_BASELINE_VENV = Path(__file__).resolve().parents[2] / ".bench-venv"
PARTS = ("images", "stages", "sizes", "distinct", "floor", "threads", "video")


def run(report: Report, quick: bool) -> None:
    """Every preprocessing figure; the torchvision baseline when its environment exists."""
    venv = DEFAULT_BASELINE_VENV if DEFAULT_BASELINE_VENV.is_dir() else None
    measure(report, quick=quick, rounds=MIN_ROUNDS, baseline_venv=venv, parts=PARTS)


def measure(report: Report, *, quick: bool, rounds: int, baseline_venv: Path | None, parts) -> None:
    """The figures of `parts`, with transformers' torchvision processor if `baseline_venv`."""
    warnings.filterwarnings("ignore")
    cfg = preset("qwen3-vl")
    print(f"qwen3-vl settings; {rounds} rounds per figure")
    datas = make_images(quick)
    with tempfile.TemporaryDirectory() as tmp:
        worker = None
        if baseline_venv is not None and {"images", "stages", "sizes"} & set(parts):
            ensure_baseline_venv(baseline_venv)
            files = []
            for i, d in enumerate(datas):
                files.append(os.path.join(tmp, f"{i}.jpg"))
                Path(files[-1]).write_bytes(d)
            worker = TorchvisionWorker(baseline_venv, files, settings(cfg))
        try:
            if "images" in parts:
                report.section("images")
                check_images(datas, cfg, worker, tmp)
                image_figures(report, datas, cfg, rounds, worker)
            if "stages" in parts:
                report.section("stages")
                stage_figures(report, datas, cfg, rounds, worker)
            if "sizes" in parts:
                report.section("image sizes")
                if "images" not in parts:
                    check_images(datas, cfg, worker, tmp)
                size_figures(report, datas, cfg, rounds, worker)
        finally:
            if worker is not None:
                worker.close()
        if "distinct" in parts:
            report.section("images of sizes new every round")
            batches = distinct_batches(quick, rounds + 1)  # the warm-up takes one too
            pil_proc = _pil_processor(cfg)
            for b, batch in enumerate(batches):
                for i, data in enumerate(batch):
                    _check_image(f"round {b} image {i}", data, cfg, pil_proc)
            distinct_figures(report, batches, cfg, rounds)
        if "floor" in parts:
            report.section("floor")
            floor_figures(report, cfg, rounds)
        if "threads" in parts:
            report.section("threads")
            thread_figures(report, datas, cfg, rounds)
        if "video" in parts:
            report.section("video")
            video_figures(report, cfg, rounds, quick)


def main(argv: list[str] | None = None) -> int:
    """Print every preprocessing figure beside its baseline (median, spread over rounds)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller images and clip")
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="timed rounds per figure")
    ap.add_argument(
        "--baseline-venv",
        type=Path,
        nargs="?",
        const=DEFAULT_BASELINE_VENV,
        help="environment for transformers' torchvision processor (created when missing; "
        "default folder: .bench-venv)",
    )
    ap.add_argument("--json", type=Path, help="write every figure and round here")
    ap.add_argument("--only", choices=PARTS, action="append")
    args = ap.parse_args(argv)
    report = Report()
    print(f"machine: {machine()}")
    parts = args.only or PARTS
    measure(
        report, quick=args.quick, rounds=args.rounds, baseline_venv=args.baseline_venv, parts=parts
    )
    if args.json:
        report.dump_json(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
