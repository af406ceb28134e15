"""Model facts as frozen dataclasses: pure data, importing nothing of mmferry.

They are built once from a checkpoint folder by `mmferry.models.checkpoint.load_model_config`
(which knows the families' spellings) or from a family's preset (`mmferry.models.preset`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# Decoded images larger than this many pixels are refused before full decoding
# (decompression bombs). 128 MP is ~10x a 4000x3000 photo.
DEFAULT_MAX_DECODED_PIXELS = 1 << 27


@dataclass(frozen=True)
class TokenIds:
    image: int = 151655
    video: int = 151656
    vision_start: int = 151652
    vision_end: int = 151653


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's architecture (our names; the family's spec holds the HF spellings)."""

    family: str
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    hidden_act: str
    patch_size: int
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    # Qwen3-VL: learned position table (side**2 entries) and deepstack taps.
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()
    # Qwen2.5-VL: window attention.
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: int = 0

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"vision {name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision hidden_size {self.hidden_size} is not divisible by "
                f"num_heads {self.num_heads}"
            )
        for i in self.deepstack_visual_indexes + self.fullatt_block_indexes:
            if not 0 <= i < self.depth:
                raise ValueError(f"vision layer index {i} is outside depth {self.depth}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def with_depth(self, depth: int) -> VisionConfig:
        """This tower cut to its first `depth` layers (all of them when it has no more), its
        deepstack taps and full-attention blocks kept in range."""
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        if depth >= self.depth:
            return self
        clamp = lambda idx: tuple(sorted({min(i, depth - 1) for i in idx}))  # noqa: E731
        return dataclasses.replace(
            self,
            depth=depth,
            deepstack_visual_indexes=clamp(self.deepstack_visual_indexes),
            fullatt_block_indexes=clamp(self.fullatt_block_indexes),
        )


@dataclass(frozen=True)
class ProcessorConfig:
    """Everything preprocessing and prompt expansion need; part of every item's hash."""

    family: str
    patch_size: int
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_min_pixels: int = 3136
    image_max_pixels: int = 12845056
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    video_mean: tuple[float, float, float] = CLIP_MEAN
    video_std: tuple[float, float, float] = CLIP_STD
    # Video sampling when a call passes neither fps nor num_frames: off keeps every frame;
    # on samples `num_frames` if set, else at `fps` (None: every frame), as transformers does.
    do_sample_frames: bool = True
    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    # Qwen3-VL video per-frame pixel cap (transformers' `cap_pixels_per_frame`); off by default
    # as in transformers 5.24.
    cap_pixels_per_frame: bool = False
    # Qwen2.5-VL mRoPE: temporal positions per second of video.
    tokens_per_second: int = 2
    max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS
    tokens: TokenIds = field(default_factory=TokenIds)

    def __post_init__(self) -> None:
        # NOTE: the family is checked where it is used (`spec_for`): the specs themselves
        # build ProcessorConfigs while the registry is being filled.
        if not isinstance(self.family, str) or not self.family:
            raise ValueError(f"processor family must be a family name, got {self.family!r}")
        for name in ("patch_size", "merge_size", "temporal_patch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.image_min_pixels > self.image_max_pixels:
            raise ValueError("image_min_pixels is larger than image_max_pixels")
        if self.video_min_pixels > self.video_max_pixels:
            raise ValueError("video_min_pixels is larger than video_max_pixels")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError("need 1 <= min_frames <= max_frames")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"fps must be positive or None, got {self.fps}")
        if self.num_frames is not None and self.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1 or None, got {self.num_frames}")

    @property
    def factor(self) -> int:
        """Side lengths are resized to multiples of this (patch * merge)."""
        return self.patch_size * self.merge_size

    def fingerprint(self) -> bytes:
        """Stable bytes of every setting, mixed into each item's hash."""
        # NOTE: kept once made (the settings are frozen): asdict and a JSON dump took 30-50 us,
        # once for each item a request names or encodes.
        made = self.__dict__.get("_fingerprint")
        if made is None:
            made = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
            object.__setattr__(self, "_fingerprint", made)
        return made

    def replace(self, **overrides: Any) -> ProcessorConfig:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown processor setting(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **overrides)


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint folder's facts: model type, tower, token ids, preprocessing."""

    model_type: str
    family: str
    vision: VisionConfig
    tokens: TokenIds
    processor: ProcessorConfig
    text_hidden_size: int | None = None
