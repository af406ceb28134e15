"""The prompts the vLLM tests run, as vLLM's own pixel requests and as mmferry's items."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

import mmferry as mf
from tests.engines.tiny_vlm import NUM_FRAMES, VIDEO_FPS, gradient, image, video

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


@dataclass
class Case:
    name: str
    text: str
    media: list[tuple[str, np.ndarray]]  # ("image" | "video", pixels) in prompt order


def cases(factor: int) -> dict[str, Case]:
    """Sizes are multiples of the resize factor inside the pixel budgets, so no resampling
    happens and vLLM's processor and mmferry start from the same pixels. The two images have
    different grids and the same token count, so one's rows can stand in for the other's; one
    is noise and one a smooth ramp, so their rows are far apart."""
    a, b = image(2 * factor, 3 * factor, 0), gradient(3 * factor, 2 * factor, 1)
    clip = video(2 * factor, 2 * factor)
    return {
        "images": Case(
            "images", f"hello {IMAGE} and {IMAGE} describe the image", [("image", a), ("image", b)]
        ),
        "same_twice": Case(
            "same_twice", f"hello {IMAGE} {IMAGE} what ?", [("image", a), ("image", a)]
        ),
        "image_video": Case(
            "image_video", f"hello {IMAGE} {VIDEO} what happens ?", [("image", b), ("video", clip)]
        ),
    }


def video_metadata() -> dict[str, Any]:
    """What vLLM's Qwen-VL processors read for a pre-sampled clip (no resampling)."""
    return {
        "fps": VIDEO_FPS,
        "frames_indices": list(range(NUM_FRAMES)),
        "total_num_frames": NUM_FRAMES,
        "duration": NUM_FRAMES / VIDEO_FPS,
        "video_backend": "opencv",
        "do_sample_frames": False,
    }


def pixel_request(case: Case, uuids: list[str] | None = None) -> dict[str, Any]:
    """vLLM's own path: its processor and tower see the pixels."""
    data: dict[str, list[Any]] = {}
    for kind, pixels in case.media:
        value = Image.fromarray(pixels) if kind == "image" else (pixels, video_metadata())
        data.setdefault(kind, []).append(value)
    req: dict[str, Any] = {"prompt": case.text, "multi_modal_data": data}
    if uuids is not None:
        ids: dict[str, list[str]] = {}
        for (kind, _), u in zip(case.media, uuids):
            ids.setdefault(kind, []).append(u)
        req["multi_modal_uuids"] = ids
    return req


def items(proc: mf.Processor, case: Case, layout: str = "compact-u8") -> list[mf.MultimodalItem]:
    """mmferry's items for the case's media, in prompt order."""
    out = []
    for kind, pixels in case.media:
        if kind == "image":
            out.append(proc.image(pixels, layout=layout))
        else:
            out.append(
                proc.video(pixels, layout=layout, num_frames=NUM_FRAMES, source_fps=VIDEO_FPS)
            )
    return out
