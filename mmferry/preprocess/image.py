"""One image source -> a `MultimodalItem` (decode, smart_resize, patchify, hash)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from typing import Any

import torch

from mmferry.config import ProcessorConfig
from mmferry.items import LAYOUTS, Layout, MultimodalItem
from mmferry.preprocess.decode import (
    DecodedImage,
    as_batch,
    decode_image,
    encoded_identity,
    pixels_identity,
    upright_size,
)
from mmferry.preprocess.hashing import identity_nbytes, item_hash
from mmferry.preprocess.patchify import patchify, resize_u8
from mmferry.preprocess.resize import smart_resize
from mmferry.preprocess.threads import (
    alongside,
    intra_op_threads,
    preprocess_threads,
    threads_for,
)


def _pixel_key(pixels: torch.Tensor, kind: bytes, cfg: ProcessorConfig) -> Callable[[], str]:
    """The item hash over HWC pixels; any contiguous copy is made where it runs."""
    return lambda: item_hash("image", pixels_identity(pixels, kind), cfg)


def _early_key(
    decoded: DecodedImage, resized_pixels: int, cfg: ProcessorConfig
) -> tuple[Callable[[], str] | None, int]:
    """The key that needs no resize, and the bytes it reads; None for the key when the resized
    pixels are fewer than the source's (then those are hashed)."""
    if decoded.identity is not None:
        return partial(item_hash, "image", decoded.identity, cfg), identity_nbytes(decoded.identity)
    source = decoded.pixels.permute(1, 2, 0)  # [H, W, 3]
    if source.numel() <= resized_pixels:
        return _pixel_key(source, b"upright-hwc-u8", cfg), source.numel()
    return None, 0


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def resized_size(height: int, width: int, cfg: ProcessorConfig) -> tuple[int, int]:
    """The (height, width) an upright image of this size is resized to."""
    return smart_resize(
        height,
        width,
        factor=cfg.factor,
        min_pixels=cfg.image_min_pixels,
        max_pixels=cfg.image_max_pixels,
    )


def encoded_image_facts(data: bytes, cfg: ProcessorConfig) -> tuple[str, tuple[int, int, int]]:
    """The hash and grid `process_image` gives the encoded image `data`, from its header
    alone (nothing decoded); ValueError where `process_image` would refuse its header."""
    height, width = upright_size(data, cfg.max_decoded_pixels)
    new_h, new_w = resized_size(height, width, cfg)
    key = item_hash("image", encoded_identity(data), cfg)
    return key, (1, new_h // cfg.patch_size, new_w // cfg.patch_size)


def process_image(
    source: Any, cfg: ProcessorConfig, *, layout: Layout = "hf", threads: int | None = None
) -> MultimodalItem:
    """Decode, resize and patchify one image into the requested layout (see threads.py)."""
    check_layout(layout)
    threads = preprocess_threads(threads)
    decoded = decode_image(source, cfg.max_decoded_pixels)
    _, height, width = decoded.pixels.shape
    new_h, new_w = resized_size(height, width, cfg)
    # NOTE: the key covers the encoded bytes where there are any, else the smaller of the
    # upright source pixels and the resized pixels, hashed in place (no copy of contiguous
    # pixels). A hash that does not need the resize starts before it, on one extra thread
    # (threads.py), and runs beside the resize and the gather, which only read the same memory.
    early, early_bytes = _early_key(decoded, 3 * new_h * new_w, cfg)
    with ExitStack() as stack:
        digest = None
        if early is not None:
            digest = stack.enter_context(alongside(early, early_bytes))
        with intra_op_threads(threads_for(3 * new_h * new_w, threads)):
            resized = resize_u8(as_batch(decoded.pixels), new_h, new_w)  # [1, 3, new_h, new_w]
        if digest is None:
            hwc = resized[0].permute(1, 2, 0)
            late = _pixel_key(hwc, b"resized-hwc-u8", cfg)
            digest = stack.enter_context(alongside(late, hwc.numel()))
        feature = patchify(
            resized,
            image=True,
            patch=cfg.patch_size,
            merge=cfg.merge_size,
            temporal=cfg.temporal_patch_size,
            layout=layout,
            mean=cfg.image_mean,
            std=cfg.image_std,
            threads=threads,
        )
        key = digest()
    return MultimodalItem(
        modality="image",
        feature=feature,
        grid_thw=(1, new_h // cfg.patch_size, new_w // cfg.patch_size),
        layout=layout,
        hash=key,
        merge_size=cfg.merge_size,
    )
