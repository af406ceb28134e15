"""compact-u8 rows back to the hf layout, for tests that compare the two layouts."""

from __future__ import annotations

import torch

from mmferry.config import ProcessorConfig
from mmferry.items import MultimodalItem
from mmferry.preprocess.patchify import norm_affine


def compact_to_hf(item: MultimodalItem, cfg: ProcessorConfig) -> torch.Tensor:
    """The hf-layout float32 features of a compact-u8 item (normalised; images get T copies)."""
    if item.layout != "compact-u8":
        raise ValueError(f"expected a compact-u8 item, got layout {item.layout!r}")
    c, t, p = 3, cfg.temporal_patch_size, cfg.patch_size
    mean, std = (
        (cfg.image_mean, cfg.image_std)
        if item.modality == "image"
        else (
            cfg.video_mean,
            cfg.video_std,
        )
    )
    scale, shift = norm_affine(mean, std)
    rows = item.feature.shape[0]
    # [N, C*T'*P*P] -> [N, C, T', P*P] with T' = 1 (image) or T (video)
    x = item.feature.view(rows, c, -1, p * p).expand(rows, c, t, p * p)
    out = x.float() * scale.view(1, c, 1, 1) + shift.view(1, c, 1, 1)
    return out.reshape(rows, c * t * p * p)
