"""One image source -> a `MultimodalItem` (decode, smart_resize, patchify, hash)."""

from __future__ import annotations

from functools import partial
from typing import Any

from mmferry.config import ProcessorConfig
from mmferry.items import LAYOUTS, Layout, MultimodalItem
from mmferry.preprocess.decode import as_batch, decode_image, pixels_identity
from mmferry.preprocess.hashing import identity_nbytes, item_hash
from mmferry.preprocess.patchify import patchify, resize_u8
from mmferry.preprocess.resize import smart_resize
from mmferry.preprocess.threads import (
    alongside,
    intra_op_threads,
    preprocess_threads,
    threads_for,
)


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def process_image(
    source: Any, cfg: ProcessorConfig, *, layout: Layout = "hf", threads: int | None = None
) -> MultimodalItem:
    """Decode, resize and patchify one image into the requested layout (see threads.py)."""
    check_layout(layout)
    threads = preprocess_threads(threads)
    decoded = decode_image(source, cfg.max_decoded_pixels)
    _, height, width = decoded.pixels.shape
    new_h, new_w = smart_resize(
        height,
        width,
        factor=cfg.factor,
        min_pixels=cfg.image_min_pixels,
        max_pixels=cfg.image_max_pixels,
    )
    with intra_op_threads(threads_for(3 * new_h * new_w, threads)):
        resized = resize_u8(as_batch(decoded.pixels), new_h, new_w)  # [1, 3, new_h, new_w]
    identity = decoded.identity
    if identity is None:
        # NOTE: decoded sources are keyed by their resized uint8 pixels, what every layout is
        # built from: never more bytes than the source, hashed in place without a copy.
        identity = pixels_identity(resized[0].permute(1, 2, 0), b"resized-hwc-u8")
    # NOTE: the hash reads `resized` while patchify gathers from it (both only read it): a
    # 12 MP item's hash is a tenth of the call, hidden behind the gather (threads.py).
    hash_item = partial(item_hash, "image", identity, cfg)
    with alongside(hash_item, identity_nbytes(identity)) as digest:
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
