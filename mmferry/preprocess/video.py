"""One video (file or frames) -> a `MultimodalItem`: sample, resize, pad, patchify, hash.

Clips with fewer sampled frames than the temporal patch size (1-frame videos, or 2-frame
ones with T > 2) are padded by repeating their last frame up to T before sizing, so they
become one temporal patch; transformers 5.24 raises on them instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from mmferry.config import ProcessorConfig
from mmferry.items import Layout, MultimodalItem
from mmferry.models import spec_for
from mmferry.preprocess.decode import (
    decode_image,
    describe,
    pixels_identity,
    read_source_bytes,
    without_negative_strides,
)
from mmferry.preprocess.hashing import identity_nbytes, item_hash
from mmferry.preprocess.image import check_layout
from mmferry.preprocess.patchify import patchify, resize_u8
from mmferry.preprocess.sampling import check_request, check_source_fps, frame_timestamps
from mmferry.preprocess.threads import (
    alongside,
    intra_op_threads,
    preprocess_threads,
    threads_for,
)
from mmferry.preprocess.video_decode import decode_frames, probe_video


def sample_indices(
    cfg: ProcessorConfig,
    total: int,
    source_fps: float,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
) -> list[int]:
    """Indices (ascending, into `total` frames) of the frames to keep."""
    if total < 1:
        raise ValueError("a video needs at least one frame")
    fps, num_frames, _ = check_request(fps, num_frames)
    source_fps = check_source_fps(source_fps)
    if fps is None and num_frames is None:
        # The processor's own settings, as transformers applies them.
        if not cfg.do_sample_frames:
            return list(range(total))
        fps, num_frames = (None, cfg.num_frames) if cfg.num_frames else (cfg.fps, None)
    if fps is not None and (fps <= 0 or source_fps <= 0):
        raise ValueError(f"fps and source fps must be positive, got {fps} and {source_fps}")
    return spec_for(cfg.family).sample_frames(cfg, total, source_fps, fps, num_frames)


def video_target_size(
    cfg: ProcessorConfig, num_frames: int, height: int, width: int
) -> tuple[int, int]:
    """(height, width) every sampled frame is resized to.

    `num_frames` is the sampled count before odd-count padding (as transformers sizes it).
    """
    return spec_for(cfg.family).frame_size(cfg, num_frames, height, width)


def _frames(
    source: Any, name: str, max_pixels: int
) -> tuple[torch.Tensor | list[torch.Tensor], list[bytes | memoryview]]:
    """A frame sequence -> ([T, 3, H, W] uint8 or T [3, H, W] frames, identity parts)."""
    if isinstance(source, (np.ndarray, torch.Tensor)):
        if source.ndim != 4 or source.dtype not in (np.uint8, torch.uint8):
            raise ValueError(
                f"video {name} must be a THWC uint8 numpy array or a TCHW uint8 tensor"
            )
        if isinstance(source, np.ndarray):
            # NOTE: a flipped axis of length 1 keeps its negative stride through
            # np.ascontiguousarray (numpy calls it contiguous); torch refuses it.
            thwc = torch.from_numpy(np.ascontiguousarray(without_negative_strides(source)))
            t, kind = thwc.permute(0, 3, 1, 2), b"frames-thwc-u8"
        else:
            t = thwc = source.detach().cpu()
            kind = b"frames-tchw-u8"
        if t.shape[1] != 3:
            raise ValueError(f"video {name} must have 3 (RGB) channels, got shape {tuple(t.shape)}")
        if min(t.shape) == 0:
            raise ValueError(f"video {name} has no frames or empty frames: {tuple(t.shape)}")
        # Hash the frames in their given (contiguous) memory, not a permuted copy.
        return t, list(pixels_identity(thwc, kind))
    frames = [decode_image(f, max_pixels) for f in source]
    if not frames:
        raise ValueError(f"video {name} has no frames")
    shapes = {tuple(f.pixels.shape) for f in frames}
    if len(shapes) != 1:
        raise ValueError(f"video {name} frames differ in size: {sorted(shapes)}")
    ident = [b"frames-rgb-u8"]
    for f in frames:
        ident.extend(f.identity or pixels_identity(f.pixels.permute(1, 2, 0), b"hwc-u8"))
    return [f.pixels for f in frames], ident


def _padded(indices: list[int], temporal: int) -> list[int]:
    """Indices with the last repeated up to a multiple of T, as transformers pads frames."""
    return indices + [indices[-1]] * (-len(indices) % temporal)


def _is_frame_sequence(source: Any) -> bool:
    if isinstance(source, (np.ndarray, torch.Tensor)):
        return True
    return isinstance(source, Sequence) and not isinstance(source, (str, bytes, bytearray))


@dataclass(frozen=True)
class _Sampled:
    frames: torch.Tensor  # [n + pad, 3, h, w] uint8, resized
    indices: list[int]
    total: int
    rate: float
    # Joins the item hash started as soon as the identity parts were known (process_video).
    digest: Callable[[], str]
    # Each source frame's own time (s), when the container gives them; else index / rate.
    times: tuple[float, ...] | None


def _sampled_frames(
    source: Any,
    name: str,
    cfg: ProcessorConfig,
    fps: float | None,
    num_frames: int | None,
    source_fps: float | None,
    threads: int,
    start_hash: Callable[[list[bytes | memoryview]], Callable[[], str]],
) -> _Sampled:
    """The sampled frames, padded to the temporal patch and resized.

    The hash of the identity parts is started (`start_hash`) before the frames are sampled,
    decoded and resized, so it runs alongside that work.
    """
    if _is_frame_sequence(source):
        if source_fps is None:
            raise ValueError(
                f"video {name} is a frame sequence; pass source_fps= (its frame rate) so "
                "frames can be sampled and timestamped"
            )
        all_frames, identity = _frames(source, name, cfg.max_decoded_pixels)
        digest = start_hash(identity)
        rate, total = float(source_fps), len(all_frames)
        indices = sample_indices(cfg, total, rate, fps=fps, num_frames=num_frames)
        slots = _padded(indices, cfg.temporal_patch_size)
        # Only the sampled frames are gathered.
        if isinstance(all_frames, torch.Tensor):
            # Every frame in order (a list already sampled): no gathered copy.
            frames = all_frames if slots == list(range(total)) else all_frames[slots]
        else:
            frames = torch.stack([all_frames[i] for i in slots])
        new_h, new_w = video_target_size(cfg, len(indices), *frames.shape[2:])
        with intra_op_threads(threads_for(frames.shape[0] * 3 * new_h * new_w, threads)):
            frames = resize_u8(frames, new_h, new_w)
        return _Sampled(frames, indices, total, rate, digest, None)
    if not isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)) and not hasattr(
        source, "read"
    ):
        raise ValueError(
            f"unsupported video source {name}; pass a path, bytes, a binary file, or frames "
            "(PIL images, HWC arrays, a THWC uint8 array or a TCHW uint8 tensor)"
        )
    data = read_source_bytes(source, "video") or b""
    digest = start_hash([b"encoded", data])
    info = probe_video(data, name)
    rate = float(source_fps) if source_fps is not None else info.fps
    indices = sample_indices(cfg, info.total_frames, rate, fps=fps, num_frames=num_frames)

    def check_size(h: int, w: int) -> None:
        if h * w > cfg.max_decoded_pixels:
            raise ValueError(
                f"video {name} frames of {h}x{w} exceed max_decoded_pixels={cfg.max_decoded_pixels}"
            )

    def target_size(h: int, w: int) -> tuple[int, int]:
        # NOTE: sized by the sampled count before padding, as transformers sizes it.
        return video_target_size(cfg, len(indices), h, w)

    slots = _padded(indices, cfg.temporal_patch_size)
    # NOTE: frames are resized as they are decoded: decoded frames are never all held.
    with intra_op_threads(1):
        frames = decode_frames(data, name, slots, check_size, target_size, info)
    # A rate given by the caller overrides the container's times (as for frame sequences).
    times = info.times if source_fps is None else None
    return _Sampled(frames, indices, info.total_frames, rate, digest, times)


def process_video(
    source: Any,
    cfg: ProcessorConfig,
    *,
    layout: Layout = "hf",
    fps: float | None = None,
    num_frames: int | None = None,
    source_fps: float | None = None,
    threads: int | None = None,
) -> MultimodalItem:
    """Sample, resize and patchify one video (a file, bytes, or frames with `source_fps`)."""
    check_layout(layout)
    threads = preprocess_threads(threads)
    name = describe(source) if not isinstance(source, list) else f"<{len(source)} frames>"
    # Validated before any decoding; numpy scalars become the Python numbers they equal.
    fps, num_frames, source_fps = check_request(fps, num_frames, source_fps)
    settings = json.dumps({"fps": fps, "num_frames": num_frames, "source_fps": source_fps})
    with ExitStack() as hashing:
        # NOTE: frame sources are keyed by all their given frames, often more bytes than the
        # sampled ones: the hash runs on one extra thread (threads.py) from when its parts are
        # known until patchify is done; leaving the block, by an error too, waits for it.
        def start_hash(identity: list[bytes | memoryview]) -> Callable[[], str]:
            work = partial(item_hash, "video", identity, cfg, settings.encode())
            return hashing.enter_context(alongside(work, identity_nbytes(identity)))

        sampled = _sampled_frames(
            source, name, cfg, fps, num_frames, source_fps, threads, start_hash
        )
        resized, indices, total, rate = sampled.frames, sampled.indices, sampled.total, sampled.rate
        padded_n, _, new_h, new_w = resized.shape
        temporal = cfg.temporal_patch_size
        feature = patchify(
            resized,
            image=False,
            patch=cfg.patch_size,
            merge=cfg.merge_size,
            temporal=temporal,
            layout=layout,
            mean=cfg.video_mean,
            std=cfg.video_std,
            threads=threads,
        )
        key = sampled.digest()
    timestamps = second_per_grid_t = None
    if spec_for(cfg.family).timestamps_in_prompt:
        timestamps = frame_timestamps(indices, rate, temporal, sampled.times)
    else:
        # As Qwen2.5-VL's processor: T / the sampled frame rate (metadata.sampled_fps).
        second_per_grid_t = temporal / (len(indices) / total * rate)
    return MultimodalItem(
        modality="video",
        feature=feature,
        grid_thw=(padded_n // temporal, new_h // cfg.patch_size, new_w // cfg.patch_size),
        layout=layout,
        hash=key,
        merge_size=cfg.merge_size,
        timestamps=timestamps,
        second_per_grid_t=second_per_grid_t,
    )
