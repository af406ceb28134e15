"""`MultimodalItem`: one preprocessed image or video, the unit every later stage works on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Modality = Literal["image", "video"]
Layout = Literal["hf", "compact-u8"]
LAYOUTS: tuple[str, ...] = ("hf", "compact-u8")


@dataclass(frozen=True)
class MultimodalItem:
    """A preprocessed image or video.

    `feature` rows are patches in merge-block order, `t*h*w` of them for both layouts:
    - "hf": float32 `[t*h*w, C*T*P*P]`, normalised, images repeated to T copies.
    - "compact-u8": uint8 `[t*h*w, C*P*P]` for images (no temporal copy, t == 1) and
      `[t*h*w, C*T*P*P]` for videos; not normalised.
    """

    modality: Modality
    feature: torch.Tensor
    grid_thw: tuple[int, int, int]
    layout: Layout
    hash: str
    merge_size: int = 2
    # Qwen3-VL videos: one timestamp (seconds) per temporal patch, shown in the prompt.
    timestamps: tuple[float, ...] | None = None
    # Qwen2/2.5-VL videos: seconds covered by one temporal patch (mRoPE scaling).
    second_per_grid_t: float | None = None

    def __post_init__(self) -> None:
        if self.modality not in ("image", "video"):
            raise ValueError(f"modality must be 'image' or 'video', got {self.modality!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        t, h, w = self.grid_thw
        m = self.merge_size
        if min(t, h, w) < 1 or h % m or w % m:
            raise ValueError(f"grid {self.grid_thw} is not a positive grid of {m}x{m} blocks")
        if self.modality == "image" and t != 1:
            raise ValueError(f"an image has grid_t 1, got {self.grid_thw}")
        f = self.feature
        if f.dim() != 2 or f.shape[0] != t * h * w:
            raise ValueError(
                f"feature of shape {tuple(f.shape)} does not hold t*h*w = {t * h * w} patch rows"
            )
        want = torch.uint8 if self.layout == "compact-u8" else None
        if want is not None and f.dtype != want:
            raise ValueError(f"compact-u8 features are uint8, got {f.dtype}")
        if self.layout == "hf" and not f.dtype.is_floating_point:
            raise ValueError(f"hf-layout features are floating point, got {f.dtype}")
        if self.timestamps is not None and len(self.timestamps) != t:
            raise ValueError(f"{len(self.timestamps)} timestamps for {t} temporal patches")

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def num_tokens(self) -> int:
        """Vision tokens (LLM positions) this item fills: t*h*w / merge**2."""
        return self.num_patches // (self.merge_size**2)

    @property
    def tokens_per_frame(self) -> int:
        _, h, w = self.grid_thw
        return h * w // (self.merge_size**2)
