"""qwen-vl-utils' per-item keys (0.0.14, `vision_process.py`): sizes and frame counts.

An item that carries any of these keys is sized and sampled as `process_vision_info` does, and
that size is final: the model cards hand `process_vision_info`'s output to the processor with
`do_resize=False`, so the item's budget replaces the checkpoint's. Only the arithmetic is
restated; the pixels are resized once, from the source to the final size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

# qwen-vl-utils' constants.
MAX_RATIO = 200
IMAGE_MIN_TOKENS, IMAGE_MAX_TOKENS = 4, 16384
VIDEO_MIN_TOKENS, VIDEO_MAX_TOKENS = 128, 768
FPS, FRAME_FACTOR, FPS_MIN_FRAMES, FPS_MAX_FRAMES = 2.0, 2, 4, 768
# Its `MODEL_SEQ_LEN` default: a video's whole pixel budget is 0.9 of it in tokens.
MODEL_SEQ_LEN = 128000
# A frame list's assumed rate when the part gives no `sample_fps`.
FRAME_LIST_FPS = 2.0


def _round(x: float, f: int) -> int:
    return round(x / f) * f


def _ceil(x: float, f: int) -> int:
    return math.ceil(x / f) * f


def _floor(x: float, f: int) -> int:
    return math.floor(x / f) * f


def smart_resize(
    height: int, width: int, factor: int, min_pixels: float | None = None,
    max_pixels: float | None = None,
) -> tuple[int, int]:  # fmt: skip
    """qwen-vl-utils' `smart_resize`: unlike transformers' it clamps the first rounding to one
    factor, and its max branch has no such clamp."""
    max_pixels = IMAGE_MAX_TOKENS * factor**2 if max_pixels is None else max_pixels
    min_pixels = IMAGE_MIN_TOKENS * factor**2 if min_pixels is None else min_pixels
    if max_pixels < min_pixels:
        raise ValueError("max_pixels must be at least min_pixels")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(
            f"aspect ratio must be under {MAX_RATIO}, got {max(height, width) / min(height, width)}"
        )
    h = max(factor, _round(height, factor))
    w = max(factor, _round(width, factor))
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = _floor(height / beta, factor), _floor(width / beta, factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = _ceil(height * beta, factor), _ceil(width * beta, factor)
    return h, w


def image_size(height: int, width: int, keys: Mapping[str, Any], factor: int) -> tuple[int, int]:
    """`fetch_image`'s size for an image of this size (`factor` = patch * merge)."""
    if "resized_height" in keys and "resized_width" in keys:
        return smart_resize(keys["resized_height"], keys["resized_width"], factor)
    return smart_resize(
        height,
        width,
        factor,
        keys.get("min_pixels", IMAGE_MIN_TOKENS * factor**2),
        keys.get("max_pixels", IMAGE_MAX_TOKENS * factor**2),
    )


def frame_range(keys: Mapping[str, Any], total: int, fps: float) -> tuple[int, int, int]:
    """`calculate_video_frame_range`: (first, last, count) of the frames `video_start` to
    `video_end` (seconds) cover, as its torchcodec and decord readers take them."""
    start, end = keys.get("video_start"), keys.get("video_end")
    if start is None and end is None:
        return 0, total - 1, total
    duration = total / fps
    first = math.ceil(max(0.0, min(start, duration)) * fps) if start is not None else 0
    last = total - 1
    if end is not None:
        last = min(math.floor(max(0.0, min(end, duration)) * fps), total - 1)
    if first >= last:
        raise ValueError(
            f"video_start..video_end selects frames {first}..{last} of a {duration:.2f} s "
            f"video of {total} frames; the range is empty"
        )
    return first, last, last - first + 1


def num_frames(keys: Mapping[str, Any], total: int, fps: float) -> int:
    """`smart_nframes`: how many frames of `total` (at `fps`) to keep."""
    if "nframes" in keys:
        n = _round(keys["nframes"], FRAME_FACTOR)
    else:
        lo = _ceil(keys.get("min_frames", FPS_MIN_FRAMES), FRAME_FACTOR)
        hi = _floor(keys.get("max_frames", min(FPS_MAX_FRAMES, total)), FRAME_FACTOR)
        n = total / fps * keys.get("fps", FPS)
        n = _floor(min(max(n, lo), hi, total), FRAME_FACTOR)
    if not FRAME_FACTOR <= n <= total:
        raise ValueError(f"the video gives {n} frames; need {FRAME_FACTOR} to {total}")
    return int(n)


def frame_indices(keys: Mapping[str, Any], total: int, fps: float) -> tuple[list[int], int]:
    """(indices of the frames kept, frames in the selected range), as the readers pick them."""
    first, last, count = frame_range(keys, total, fps)
    n = num_frames(keys, count, fps)
    # NOTE: numpy rounds half to even, as torch.round does in qwen-vl-utils.
    return np.linspace(first, last, n).round().astype(np.int64).tolist(), count


def video_size(
    num: int, height: int, width: int, keys: Mapping[str, Any], factor: int
) -> tuple[int, int]:
    """`fetch_video`'s frame size for `num` frames of this size."""
    if "resized_height" in keys and "resized_width" in keys:
        return smart_resize(keys["resized_height"], keys["resized_width"], factor)
    lo = keys.get("min_pixels", VIDEO_MIN_TOKENS * factor**2)
    total = keys.get("total_pixels", MODEL_SEQ_LEN * factor**2 * 0.9)
    hi = max(min(VIDEO_MAX_TOKENS * factor**2, total / num * FRAME_FACTOR), int(lo * 1.05))
    hi = min(keys.get("max_pixels", hi), hi)
    return smart_resize(height, width, factor, lo, hi)


def frame_list_size(height: int, width: int, keys: Mapping[str, Any], factor: int):
    """A listed frame's size before the video sizing: qwen-vl-utils resizes each frame as an
    image first, passing the factor where the patch size goes, so at twice the factor."""
    return image_size(height, width, keys, factor * 2)
