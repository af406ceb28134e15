"""Independent references for the preprocessing tests.

transformers' default (torchvision) Qwen-VL processors cannot run here, so their arithmetic is
restated in plain torch: transformers' loading and sizing functions, torch's antialiased bicubic
resize on uint8 (what torchvision runs on CPU), the fused fp32 normalisation
`(x - 255*mean) / (255*std)`, and the reshape/permute patchify transformers documents.
"""

from __future__ import annotations

import importlib
import io
import sys
import types

import av
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps
from transformers.image_transforms import convert_to_rgb  # noqa: F401 (re-exported)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
    smart_resize as hf_video_smart_resize,
)


def import_without_torchvision(module: str) -> types.ModuleType:
    """Import a transformers module whose top level imports torchvision, to call its pure
    functions (frame sampling, sizing). torchvision is not installed here; a placeholder stands
    in only during the import and is removed afterwards, and nothing that would use it is run.
    """
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2"]
    names.append("torchvision.transforms.v2.functional")
    if importlib.util.find_spec("torchvision") is not None:
        return importlib.import_module(module)
    saved = {n: sys.modules.get(n) for n in names}
    try:
        for n in names:
            sys.modules[n] = types.ModuleType(n)
        for parent, child in zip(names, names[1:]):
            setattr(sys.modules[parent], child.rsplit(".", 1)[1], sys.modules[child])
        return importlib.import_module(module)
    finally:
        for n, old in saved.items():
            if old is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = old


def load_rgb(source: str | bytes | Image.Image) -> np.ndarray:
    """transformers' loading: EXIF orientation applied, alpha composited on white; HWC uint8."""
    im = (
        source
        if isinstance(source, Image.Image)
        else Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
    )
    im = ImageOps.exif_transpose(im)
    return convert_to_rgb(im, return_numpy=True)


def resize_like_torchvision(chw: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[N, C, H, W] uint8 -> resized uint8, as torchvision's CPU uint8 bicubic path does."""
    if tuple(chw.shape[-2:]) == (h, w):
        return chw
    return F.interpolate(chw, size=[h, w], mode="bicubic", antialias=True, align_corners=False)


def normalise(x: torch.Tensor, mean, std) -> torch.Tensor:
    m = torch.tensor(mean) * 255
    s = torch.tensor(std) * 255
    return (x.float() - m[:, None, None]) / s[:, None, None]


def image_hf(rgb: np.ndarray, cfg) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The hf pixel_values and grid of one RGB image (transformers' Qwen2VLImageProcessor)."""
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    h, w = hf_smart_resize(
        rgb.shape[0],
        rgb.shape[1],
        factor=p * m,
        min_pixels=cfg.image_min_pixels,
        max_pixels=cfg.image_max_pixels,
    )
    x = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)[None].contiguous()
    x = normalise(resize_like_torchvision(x, h, w), cfg.image_mean, cfg.image_std)
    c = x.shape[1]
    gh, gw = h // p, w // p
    x = x.reshape(1, c, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
    x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1)
    return x.reshape(gh * gw, c * t * p * p), (1, gh, gw)


def video_hf(frames: np.ndarray, cfg, size: tuple[int, int]) -> torch.Tensor:
    """[n, H, W, 3] sampled frames -> hf pixel_values_videos, as the video processors do."""
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
    x = normalise(resize_like_torchvision(x, *size), cfg.video_mean, cfg.video_std)
    if pad := -x.shape[0] % t:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    n, c, h, w = x.shape
    gt, gh, gw = n // t, h // p, w // p
    x = x.view(gt, t, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * t * p * p)


def qwen3_video_size(cfg, n: int, h: int, w: int) -> tuple[int, int]:
    return hf_video_smart_resize(
        n,
        h,
        w,
        temporal_factor=cfg.temporal_patch_size,
        factor=cfg.factor,
        min_pixels=cfg.video_min_pixels,
        max_pixels=cfg.video_max_pixels,
    )


def encode_video(path, frames: np.ndarray, fps: int) -> None:
    """Write [n, H, W, 3] uint8 frames as an MPEG-4 file at `fps`."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "3"}
        for f in frames:
            for pkt in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(pkt)
        for pkt in stream.encode():
            out.mux(pkt)


def moving_frames(n: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """n smooth, moving RGB frames [n, h, w, 3] uint8 (distinct per frame)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    phase = rng.random(3) * 6
    out = np.empty((n, h, w, 3), np.uint8)
    for i in range(n):
        for c in range(3):
            out[i, :, :, c] = 127 + 120 * np.sin(xx / (7 + 3 * c) + yy / 13 + phase[c] + 0.3 * i)
    return out
