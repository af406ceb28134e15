"""Benchmark: image and video preprocessing, mmferry beside transformers, in one run.

Images: 16 seeded JPEGs of mixed sizes up to 4000x3000 (smooth random fields plus noise, and
the bundled photographs upscaled), each decoded from its encoded bytes, qwen3-vl settings.
Baseline: transformers' `load_image` steps + `Qwen2VLImageProcessorPil` (its default
torchvision processor cannot run without torchvision). Video: a seeded 10 s 640x360 clip;
baseline: transformers' `read_video_pyav` with `Qwen3VLVideoProcessor.sample_frames`, then
the processor's resize / normalise / pad / patchify steps written unfused in torch.

Run: python -m bench.preprocess [--quick]
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from mmferry.config import preset
from mmferry.preprocess.image import process_image
from mmferry.preprocess.samples import sample_images
from mmferry.preprocess.video import process_video

SIZES = [  # (width, height)
    (4000, 3000),
    (3000, 4000),
    (3264, 2448),
    (2048, 1536),
    (1920, 1080),
    (1600, 1200),
    (1280, 720),
    (1366, 768),
    (1024, 768),
    (800, 600),
    (640, 480),
    (512, 512),
    (1080, 1920),
]


def _smooth_field(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """A smooth random colour field plus pixel noise, [h, w, 3] uint8."""
    coarse = torch.from_numpy(rng.random((1, 3, 6, 8), dtype=np.float32) * 255)
    field = F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False)[0]
    noise = torch.from_numpy(rng.normal(0, 8, (3, h, w)).astype(np.float32))
    return (field + noise).clamp_(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()


def make_images(quick: bool) -> list[bytes]:
    """The fixed, seeded image workload as encoded JPEG bytes."""
    rng = np.random.default_rng(1234)
    sizes = SIZES[3:9] if quick else SIZES
    out = []
    for w, h in sizes:
        buf = io.BytesIO()
        Image.fromarray(_smooth_field(rng, w, h)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    photos = sample_images()[:1] if quick else sample_images()
    for path in photos:
        im = Image.open(path).convert("RGB")
        big = im.resize((im.width * 3, im.height * 3), Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        big.save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def make_video(path: str, quick: bool) -> None:
    import av

    rng = np.random.default_rng(99)
    seconds, fps, w, h = (4, 30, 640, 360) if quick else (10, 30, 640, 360)
    base = _smooth_field(rng, w + 8 * seconds * fps, h)
    with av.open(path, "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"qscale": "4"}
        for i in range(seconds * fps):
            frame = np.ascontiguousarray(base[:, 8 * i : 8 * i + w])
            for pkt in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(pkt)
        for pkt in stream.encode():
            out.mux(pkt)


def _best_of(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Best wall time of each function over `reps` rounds, the functions interleaved per round
    so that load from other processes hits all of them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [min(ts) for ts in times]


def _baseline_images(datas: list[bytes], proc) -> int:
    nbytes = 0
    for data in datas:
        im = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
        out = proc(images=[im], return_tensors="pt")
        nbytes += out["pixel_values"].nbytes
    return nbytes


def _ours_images(datas: list[bytes], cfg, layout: str) -> int:
    return sum(process_image(d, cfg, layout=layout).feature.nbytes for d in datas)


def _baseline_video(path: str, cfg) -> int:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
        smart_resize,
    )
    from transformers.video_utils import read_video_pyav

    frames, meta = read_video_pyav(path, sample_indices_fn=Qwen3VLVideoProcessor().sample_frames)
    n, h, w, _ = frames.shape
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    rh, rw = smart_resize(
        n,
        h,
        w,
        temporal_factor=t,
        factor=p * m,
        min_pixels=cfg.video_min_pixels,
        max_pixels=cfg.video_max_pixels,
    )
    x = torch.from_numpy(frames).permute(0, 3, 1, 2)
    x = F.interpolate(x, size=(rh, rw), mode="bicubic", antialias=True, align_corners=False)
    mean = torch.tensor(cfg.video_mean).view(3, 1, 1) * 255
    std = torch.tensor(cfg.video_std).view(3, 1, 1) * 255
    x = (x.float() - mean) / std
    if pad := -n % t:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    gt, gh, gw = x.shape[0] // t, rh // p, rw // p
    x = x.view(gt, t, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, 3 * t * p * p).nbytes


def main(argv: list[str] | None = None) -> int:
    """Print images/s and bytes per image for mmferry (hf, compact-u8) beside transformers."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, smaller images; one repetition")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    cfg = preset("qwen3-vl")
    proc = Qwen2VLImageProcessorPil(
        patch_size=cfg.patch_size,
        merge_size=cfg.merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
        min_pixels=cfg.image_min_pixels,
        max_pixels=cfg.image_max_pixels,
        image_mean=list(cfg.image_mean),
        image_std=list(cfg.image_std),
    )
    reps = 1 if args.quick else 3
    datas = make_images(args.quick)
    n = len(datas)
    pixels = sum(
        Image.open(io.BytesIO(d)).size[0] * Image.open(io.BytesIO(d)).size[1] for d in datas
    )
    print(
        f"machine: {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), qwen3-vl settings"
    )
    print(
        f"images: {n} JPEGs, {pixels / n / 1e6:.2f} MP on average, decoded from bytes; "
        f"best of {reps} interleaved rounds"
    )
    # Warm-up (excluded): one small image through each path.
    small = [datas[-1]]
    _baseline_images(small, proc)
    _ours_images(small, cfg, "hf")
    _ours_images(small, cfg, "compact-u8")
    base_s, hf_s, cu_s = _best_of(
        [
            lambda: _baseline_images(datas, proc),
            lambda: _ours_images(datas, cfg, "hf"),
            lambda: _ours_images(datas, cfg, "compact-u8"),
        ],
        reps,
    )
    base_b = _baseline_images(datas[:1], proc)
    hf_b = _ours_images(datas[:1], cfg, "hf")
    cu_b = _ours_images(datas[:1], cfg, "compact-u8")
    first_w, first_h = Image.open(io.BytesIO(datas[0])).size
    for label, secs, nbytes in (("hf", hf_s, hf_b), ("compact-u8", cu_s, cu_b)):
        print(
            f"images/s ({label}): transformers PIL processor {n / base_s:.2f} | "
            f"mmferry {n / secs:.2f} | {base_s / secs:.2f}x"
        )
        print(
            f"bytes of the {first_w}x{first_h} image ({label}): "
            f"transformers {base_b / 2**20:.1f} MiB | mmferry {nbytes / 2**20:.1f} MiB | "
            f"{base_b / nbytes:.2f}x fewer"
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.mp4")
        make_video(path, args.quick)
        _baseline_video(path, cfg)
        process_video(path, cfg, layout="hf")
        vb, *vos = _best_of(
            [
                lambda: _baseline_video(path, cfg),
                lambda: process_video(path, cfg, layout="hf"),
                lambda: process_video(path, cfg, layout="compact-u8"),
            ],
            reps * 3,
        )
        for layout, vo in zip(("hf", "compact-u8"), vos):
            item = process_video(path, cfg, layout=layout)
            print(
                f"video {item.grid_thw} ({layout}): transformers pyav + unfused steps "
                f"{vb * 1e3:.1f} ms | mmferry {vo * 1e3:.1f} ms | {vb / vo:.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
