"""Target sizes: `smart_resize` for images and the Qwen3-VL video variant.

Both follow transformers' Qwen-VL processors to the pixel: Python's `round` (half to even) for
the first rounding, no lower clamp on that first rounding (a side may round to 0 and is then
fixed by the min-pixels branch), `max(factor, ...)` only in the max-pixels branch.
"""

from __future__ import annotations

import math

MAX_ASPECT_RATIO = 200


def _check_sides(height: int, width: int) -> None:
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got height={height} width={width}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"aspect ratio {ratio:.1f} of a {height}x{width} image exceeds {MAX_ASPECT_RATIO}; "
            "crop or pad it to a less extreme shape"
        )


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with area in [min_pixels, max_pixels]."""
    _check_sides(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar < 1 or w_bar < 1:
        # Only reachable with min_pixels <= 0: a side under factor/2 rounds to 0 and passes.
        raise ValueError(
            f"a {height}x{width} image resizes to {h_bar}x{w_bar} with min_pixels={min_pixels}; "
            f"set min_pixels to at least {factor * factor}"
        )
    return h_bar, w_bar


def smart_resize_video(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """Qwen3-VL video sizing: the pixel budget covers all frames (`num_frames` >= temporal_factor).

    Sides shorter than `factor` are first scaled up (truncating), the budget test uses the frame
    count rounded to the temporal factor, while beta uses the raw frame count.
    """
    if num_frames < temporal_factor:
        raise ValueError(
            f"{num_frames} frame(s) is fewer than the temporal patch size {temporal_factor}; "
            "pad the clip by repeating its last frame first"
        )
    if height < 1 or width < 1:
        raise ValueError(f"frame size must be positive, got height={height} width={width}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    _check_sides(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
