"""One image source -> a `MultimodalItem` (decode, smart_resize, patchify, hash)."""

from __future__ import annotations

from typing import Any

from mmferry.config import ProcessorConfig
from mmferry.items import LAYOUTS, Layout, MultimodalItem
from mmferry.preprocess.decode import decode_image
from mmferry.preprocess.hashing import item_hash
from mmferry.preprocess.patchify import patchify, resize_u8
from mmferry.preprocess.resize import smart_resize


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def process_image(source: Any, cfg: ProcessorConfig, *, layout: Layout = "hf") -> MultimodalItem:
    """Decode, resize and patchify one image into the requested layout."""
    check_layout(layout)
    decoded = decode_image(source, cfg.max_decoded_pixels)
    _, height, width = decoded.pixels.shape
    new_h, new_w = smart_resize(
        height,
        width,
        factor=cfg.factor,
        min_pixels=cfg.image_min_pixels,
        max_pixels=cfg.image_max_pixels,
    )
    resized = resize_u8(decoded.pixels.unsqueeze(0), new_h, new_w)  # [1, 3, new_h, new_w]
    feature = patchify(
        resized,
        image=True,
        patch=cfg.patch_size,
        merge=cfg.merge_size,
        temporal=cfg.temporal_patch_size,
        layout=layout,
        mean=cfg.image_mean,
        std=cfg.image_std,
    )
    return MultimodalItem(
        modality="image",
        feature=feature,
        grid_thw=(1, new_h // cfg.patch_size, new_w // cfg.patch_size),
        layout=layout,
        hash=item_hash("image", decoded.identity, cfg),
        merge_size=cfg.merge_size,
    )
