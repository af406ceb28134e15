"""A parsed `MediaPart` -> a `MultimodalItem`, by the processor's rules or qwen-vl-utils' keys.

- An image or a video file with no per-item keys is processed as transformers' processor does
  (the checkpoint's settings, the call's `fps` / `num_frames`).
- With qwen-vl-utils keys, and always for a list of frames (qwen-vl-utils' own form), sizes,
  frame counts and frame times are qwen-vl-utils' (`mmferry.chat.qwen_keys`), and final: the
  item's budget replaces the checkpoint's, as in the model cards' recipe
  (`process_vision_info`, then the processor with `do_resize=False`). The pixels are resized
  once, from the source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from mmferry.chat import qwen_keys
from mmferry.chat.parts import MediaPart
from mmferry.config import ProcessorConfig
from mmferry.items import Layout, MultimodalItem
from mmferry.preprocess.buffers import empty_host
from mmferry.preprocess.decode import as_batch, decode_image
from mmferry.preprocess.image import process_image
from mmferry.preprocess.patchify import resize_u8
from mmferry.preprocess.sampling import frame_timestamps
from mmferry.preprocess.threads import intra_op_threads, preprocess_threads, threads_for
from mmferry.preprocess.video import process_video


class Configured(Protocol):
    """What building an item needs of a processor: its settings (`mmferry.Processor` has them)."""

    config: ProcessorConfig


def _checked(part: MediaPart, fn: Any, *args: Any, **kwargs: Any) -> Any:
    # Preprocessing names the source; the caller needs to know which part it was.
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        raise part.error(str(e), kind="bad_media") from None


def _keeping(part: MediaPart, cfg: ProcessorConfig, frames: int, h: int, w: int) -> ProcessorConfig:
    """`cfg` with size limits that hold `frames` frames of h x w as they are, so that the
    processor's resize is an identity: the item's own budget replaces the checkpoint's."""
    if h < cfg.factor or w < cfg.factor:
        raise part.error(f"the part's size keys give {h}x{w}, under {cfg.factor} a side")
    if h * w > cfg.max_decoded_pixels:
        raise part.error(
            f"the part's size keys give {h}x{w}, more than max_decoded_pixels="
            f"{cfg.max_decoded_pixels}",
            kind="bad_media",
        )
    # NOTE: Qwen3-VL's video rule weighs the frames rounded to whole temporal patches; the
    # bounds hold the size under each family's rule.
    lo, hi = cfg.factor**2, (frames + cfg.temporal_patch_size) * h * w
    return cfg.replace(
        image_min_pixels=lo,
        image_max_pixels=hi,
        video_min_pixels=lo,
        video_max_pixels=hi,
        cap_pixels_per_frame=False,
    )


def _image(
    cfg: ProcessorConfig, part: MediaPart, layout: Layout, threads: int | None
) -> MultimodalItem:
    if not part.options:
        return _checked(part, process_image, part.source, cfg, layout=layout, threads=threads)
    pixels = _checked(part, decode_image, part.source, cfg.max_decoded_pixels).pixels
    h, w = _checked(part, qwen_keys.image_size, *pixels.shape[1:], part.options, cfg.factor)
    kept = _keeping(part, cfg, 1, h, w)
    # [3, H, W] -> [3, h, w]
    resized = resize_u8(as_batch(pixels), h, w)[0]
    return _checked(part, process_image, resized, kept, layout=layout, threads=threads)


def _video_file(
    cfg: ProcessorConfig,
    part: MediaPart,
    layout: Layout,
    call: dict[str, Any],
    threads: int | None,
) -> MultimodalItem:
    from mmferry.preprocess.decode import read_source_bytes
    from mmferry.preprocess.video_decode import decode_frames, probe_video

    if not part.options:
        return _checked(
            part, process_video, part.source, cfg, layout=layout, **call, threads=threads
        )
    name = part.where
    data = _checked(part, read_source_bytes, part.source, "video")
    if data is None:
        raise part.error("a video with qwen-vl-utils keys must be a file, bytes or frames")
    info = _checked(part, probe_video, data, name)
    indices, count = _checked(
        part, qwen_keys.frame_indices, part.options, info.total_frames, info.fps
    )
    n = len(indices)
    size = _checked(
        part, qwen_keys.video_size, n, info.height, info.width, part.options, cfg.factor
    )
    kept = _keeping(part, cfg, n, *size)

    def check_size(h: int, w: int) -> None:
        if h * w > cfg.max_decoded_pixels:
            raise ValueError(f"frames of {h}x{w} exceed max_decoded_pixels")

    frames = _checked(part, decode_frames, data, name, indices, check_size, lambda h, w: size, info)
    # The kept frames, already sampled and sized: the processor takes them all, as they are.
    item = _checked(
        part,
        process_video,
        frames,
        kept,
        layout=layout,
        num_frames=n,
        source_fps=info.fps,
        threads=threads,
    )
    sample_fps = n / max(count, 1e-6) * info.fps
    return _retime(item, cfg.temporal_patch_size, indices, info.fps, sample_fps)


def _retime(
    item: MultimodalItem, temporal: int, indices: Sequence[int], rate: float, sample_fps: float
) -> MultimodalItem:
    """Frame times as transformers derives them from qwen-vl-utils' metadata: the source
    indices at the source rate (Qwen3-VL's prompt text), or T / the sampled rate (Qwen2.5-VL)."""
    if item.timestamps is not None:
        return dataclasses.replace(item, timestamps=frame_timestamps(list(indices), rate, temporal))
    return dataclasses.replace(item, second_per_grid_t=temporal / sample_fps)


def _frame_list(
    cfg: ProcessorConfig,
    part: MediaPart,
    layout: Layout,
    threads: int | None,
    read_frame: Callable[[int, Any], Any] | None,
) -> MultimodalItem:
    keys = part.options
    given = len(part.source)
    if not given:
        raise part.error("its list of frames is empty")
    # qwen-vl-utils pads the list to an even count with the last frame.
    n = given + (-given % qwen_keys.FRAME_FACTOR)
    thwc = resized = torch.empty(0, dtype=torch.uint8)
    kept, size = cfg, (0, 0)
    # NOTE: one frame at a time: read (a service checks its header there), decode, resize into
    # its place, drop. Decoding every frame at full size first held them all at once (about
    # 23 MiB per 2000x2000 frame, whatever the final size).
    for k, source in enumerate(part.source):
        data = source if read_frame is None else read_frame(k, source)
        pixels = _checked(part, decode_image, data, cfg.max_decoded_pixels).pixels
        del data
        if k == 0:
            # The first frame sizes them all, as qwen-vl-utils sizes the list.
            h, w = pixels.shape[1:]
            h, w = _checked(part, qwen_keys.frame_list_size, h, w, keys, cfg.factor)
            size = _checked(part, qwen_keys.video_size, n, h, w, keys, cfg.factor)
            kept = _keeping(part, cfg, n, *size)  # a size past the decode limit is refused
            # THWC, as the resize writes, the patch kernel reads and the key hashes (in place).
            thwc = empty_host((n, *size, 3), torch.uint8)
            resized = thwc.permute(0, 3, 1, 2)
        with intra_op_threads(threads_for(3 * size[0] * size[1], preprocess_threads(threads))):
            resized[k] = resize_u8(as_batch(pixels), *size)[0]
        del pixels
    resized[given:] = resized[given - 1]
    sample_fps = keys.get("sample_fps", qwen_keys.FRAME_LIST_FPS)
    rate = keys.get("raw_fps", sample_fps)
    del resized
    item = _checked(
        part,
        process_video,
        thwc.numpy(),
        kept,
        layout=layout,
        num_frames=n,
        source_fps=rate,
        threads=threads,
    )
    return _retime(item, cfg.temporal_patch_size, range(n), rate, sample_fps)


def build_item(
    proc: Configured,
    part: MediaPart,
    layout: Layout,
    call: dict[str, Any],
    *,
    threads: int | None = None,
    read_frame: Callable[[int, Any], Any] | None = None,
) -> MultimodalItem:
    """The item for one media part (`call`: the call's `fps` / `num_frames` for videos;
    `threads`: the processor's, see preprocess/threads.py; `read_frame(k, source)`: a listed
    frame's source as it is decoded, just before, one frame at a time)."""
    cfg = proc.config
    if part.modality == "image":
        return _image(cfg, part, layout, threads)
    source = part.source
    if isinstance(source, (np.ndarray, torch.Tensor)) and source.ndim == 4:
        # A THWC array (or TCHW tensor) is a list of frames in one block.
        source = list(source)
    if isinstance(source, list):
        part = dataclasses.replace(part, source=source)
        return _frame_list(cfg, part, layout, threads, read_frame)
    return _video_file(cfg, part, layout, call, threads)
