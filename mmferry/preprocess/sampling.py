"""Which frames of a video to keep, their timestamps, and each frame's pixel budget.

Each family's spec (`mmferry/models/`) picks one rule of each kind (`preprocess/video.py`
applies the spec's choice); the rules follow
transformers 5.24: `even_indices` / `per_frame_size` are `Qwen3VLVideoProcessor`'s and
`stride_indices` / `whole_clip_size` are `Qwen2VLVideoProcessor`'s, with two
deliberate differences that only matter where transformers fails: a clip shorter than the
temporal patch size keeps all its frames (transformers divides by zero or raises), and
`num_frames` larger than the clip is capped at the clip's length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from mmferry.config import ProcessorConfig
from mmferry.preprocess.resize import smart_resize, smart_resize_video

# Frame rates outside this range are typos or corrupt metadata (1e-300 gives timestamps of
# 1e300 s); a caller's rate is refused outside it rather than used.
MIN_SOURCE_FPS, MAX_SOURCE_FPS = 1e-3, 1e6

# transformers' `max_video_tokens` class defaults, used by `cap_pixels_per_frame`.
QWEN3_MAX_FRAME_TOKENS = 768
QWEN2_MAX_VIDEO_TOKENS = 128000


def check_source_fps(source_fps: float) -> float:
    """A source frame rate as a float, or a ValueError if it is not a plausible rate."""
    rate = _real(source_fps, "source_fps")
    if not MIN_SOURCE_FPS <= rate <= MAX_SOURCE_FPS:
        raise ValueError(
            f"source_fps must be a frame rate between {MIN_SOURCE_FPS:g} and "
            f"{MAX_SOURCE_FPS:g} frames per second, got {source_fps!r}"
        )
    return rate


def _real(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def check_request(
    fps: float | None, num_frames: int | None, source_fps: float | None = None
) -> tuple[float | None, int | None, float | None]:
    """The caller's fps / num_frames / source_fps, validated, as Python float / int / float.

    numpy scalars are accepted; returning plain Python numbers makes 4, 4.0 and np.int64(4)
    frames one setting (the item hash serialises the settings as JSON).
    """
    if fps is not None and num_frames is not None:
        raise ValueError("pass either fps or num_frames, not both")
    if fps is not None:
        rate = _real(fps, "fps")
        if rate <= 0:
            raise ValueError(f"fps must be positive, got {fps!r}")
        fps = rate
    if num_frames is not None:
        count = _real(num_frames, "num_frames")
        if count != int(count) or count < 1:
            raise ValueError(f"num_frames must be a whole number >= 1, got {num_frames!r}")
        num_frames = int(count)
    if source_fps is not None:
        source_fps = check_source_fps(source_fps)
    return fps, num_frames, source_fps


def even_indices(
    cfg: ProcessorConfig, total: int, source_fps: float, fps: float | None, num_frames: int | None
) -> list[int]:
    """`n` frames spread evenly from the first to the last (Qwen3-VL's rule)."""
    if num_frames is not None:
        n = min(num_frames, total)
    elif fps is not None:
        n = int(total / source_fps * fps)
        n = min(max(n, cfg.min_frames), cfg.max_frames, total)
    else:
        n = min(total, cfg.max_frames)
    # NOTE: numpy's round is half-to-even, as transformers uses.
    return np.linspace(0, total - 1, n).round().astype(np.int64).tolist()


def stride_indices(
    cfg: ProcessorConfig, total: int, source_fps: float, fps: float | None, num_frames: int | None
) -> list[int]:
    """Whole temporal patches of frames at a fixed stride from the first (Qwen2-VL's rule)."""
    if fps is None and num_frames is None:
        return list(range(total))
    t = cfg.temporal_patch_size
    if num_frames is not None:
        n = round(num_frames / t) * t
    else:
        cap = math.floor(min(cfg.max_frames, total) / t) * t
        n = min(max(total / source_fps * fps, cfg.min_frames), cap, total)
        n = math.floor(n / t) * t
    n = min(n, total)
    if n < 1:
        # Fewer than one temporal patch asked for, or a clip shorter than one: keep one patch
        # (or every frame of the short clip, padded later), never the whole long clip.
        n = min(t, total)
    return torch.arange(0, total, total / n).int().tolist()


def frame_timestamps(
    indices: list[int],
    source_fps: float,
    temporal: int,
    frame_times: Sequence[float] | None = None,
) -> tuple[float, ...]:
    """Qwen3-VL: one time (s) per temporal patch, the mean of its first and last frame's time.

    A frame's time is `frame_times[i]` when given (the container's own times, right for
    variable-frame-rate files), else `i / source_fps` (transformers' rule, right for constant).
    """
    padded = indices + [indices[-1]] * (-len(indices) % temporal)
    if frame_times is None:
        times = [i / source_fps for i in padded]
    else:
        times = [frame_times[i] for i in padded]
    return tuple((times[k] + times[k + temporal - 1]) / 2 for k in range(0, len(times), temporal))


def per_frame_size(
    cfg: ProcessorConfig, num_frames: int, height: int, width: int
) -> tuple[int, int]:
    """The pixel budget spans the clip's frames (Qwen3-VL's rule); clips shorter than the
    temporal patch are sized as if already padded to it."""
    f = cfg.factor
    lo, hi = cfg.video_min_pixels, cfg.video_max_pixels
    n = max(num_frames, cfg.temporal_patch_size)
    if cfg.cap_pixels_per_frame:
        per_frame = max(min(QWEN3_MAX_FRAME_TOKENS * f * f, hi // n), int(lo * 1.05))
        hi = per_frame * n
    return smart_resize_video(
        n,
        height,
        width,
        temporal_factor=cfg.temporal_patch_size,
        factor=f,
        min_pixels=lo,
        max_pixels=hi,
    )


def whole_clip_size(
    cfg: ProcessorConfig, num_frames: int, height: int, width: int
) -> tuple[int, int]:
    """One frame's pixel budget, optionally capped by the clip's token cap (Qwen2-VL's rule)."""
    f = cfg.factor
    lo, hi = cfg.video_min_pixels, cfg.video_max_pixels
    if cfg.cap_pixels_per_frame:
        total_pixels = int(QWEN2_MAX_VIDEO_TOKENS * f * f * 0.9)
        hi = max(min(hi, total_pixels * cfg.temporal_patch_size // num_frames), int(lo * 1.05))
    return smart_resize(height, width, factor=f, min_pixels=lo, max_pixels=hi)
