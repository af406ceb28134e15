"""Model facts read once from a checkpoint folder, as frozen dataclasses.

The preprocessor configs' spellings (`size={"shortest_edge", "longest_edge"}` /
`min_pixels`/`max_pixels`) are translated here; each family's `vision_config` spellings are a
table in its spec (`mmferry/models/`), applied by `VisionConfig.from_hf`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
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

    @classmethod
    def from_hf(cls, vision: dict[str, Any], model_type: str) -> VisionConfig:
        """Build from the `vision_config` dict of a config.json with this `model_type`."""
        from mmferry.models import spec_for

        return spec_for(model_type).vision_from_hf(vision)


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
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    def replace(self, **overrides: Any) -> ProcessorConfig:
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown processor setting(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **overrides)


def preset(name: str) -> ProcessorConfig:
    """The public checkpoint's preprocessing for a preset name ("qwen3-vl", "qwen2.5-vl", ...)."""
    from mmferry.models import PRESETS, spec_for

    try:
        return spec_for(name).processor
    except ValueError:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}") from None


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint folder's facts: model type, tower, token ids, preprocessing."""

    model_type: str
    family: str
    vision: VisionConfig
    tokens: TokenIds
    processor: ProcessorConfig
    text_hidden_size: int | None = None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _pixel_limits(cfg: dict[str, Any]) -> tuple[int | None, int | None]:
    size = cfg.get("size") or {}
    lo = cfg.get("min_pixels", size.get("shortest_edge", size.get("min_pixels")))
    hi = cfg.get("max_pixels", size.get("longest_edge", size.get("max_pixels")))
    return lo, hi


def _settings(root: Path, kind: str, files: tuple[str, ...]) -> dict[str, Any] | None:
    """A sub-processor's settings as transformers finds them: processor_config.json's nested
    `kind` entry first, then the first of `files` that exists; None when there are none."""
    nested = root / "processor_config.json"
    if nested.is_file():
        entry = _read_json(nested).get(kind)
        if isinstance(entry, dict):
            return entry
    for name in files:
        if (root / name).is_file():
            return _read_json(root / name)
    return None


def _video_overrides(vc: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """Our video fields from a video processor's settings over its class defaults."""
    out = dict(defaults)
    lo, hi = _pixel_limits(vc)
    out.update({k: v for k, v in (("video_min_pixels", lo), ("video_max_pixels", hi)) if v})
    for ours, theirs in (("video_mean", "image_mean"), ("video_std", "image_std")):
        if theirs in vc:
            out[ours] = tuple(vc[theirs])
    for key in ("fps", "num_frames", "min_frames", "max_frames"):
        if key in vc:
            out[key] = vc[key]
    for key in ("do_sample_frames", "cap_pixels_per_frame"):
        if vc.get(key) is not None:
            out[key] = bool(vc[key])
    return out


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read config.json and the preprocessor configs of a local checkpoint folder."""
    root = Path(model_dir)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in {root}")
    cfg = _read_json(cfg_path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path} must hold a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ValueError(f"{cfg_path} has no model_type")
    from mmferry.models import spec_for

    spec = spec_for(str(model_type))
    vision_cfg = cfg.get("vision_config") or {}
    if not isinstance(vision_cfg, dict):
        raise ValueError(f"{cfg_path}: vision_config must be a JSON object")
    try:
        vision = spec.vision_from_hf(vision_cfg)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{cfg_path}: vision_config: {e}") from None
    default_tokens = spec.tokens
    tokens = TokenIds(
        image=cfg.get("image_token_id", default_tokens.image),
        video=cfg.get("video_token_id", default_tokens.video),
        vision_start=cfg.get("vision_start_token_id", default_tokens.vision_start),
        vision_end=cfg.get("vision_end_token_id", default_tokens.vision_end),
    )
    text = cfg.get("text_config") or cfg
    overrides: dict[str, Any] = {
        "patch_size": vision.patch_size,
        "merge_size": vision.spatial_merge_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "tokens": tokens,
    }
    if spec.video_time_in_mrope:
        overrides["tokens_per_second"] = vision.tokens_per_second
    ic = _settings(root, "image_processor", ("preprocessor_config.json",))
    if ic is not None:
        lo, hi = _pixel_limits(ic)
        overrides.update(
            {k: v for k, v in (("image_min_pixels", lo), ("image_max_pixels", hi)) if v}
        )
        for ours, theirs in (("image_mean", "image_mean"), ("image_std", "image_std")):
            if theirs in ic:
                overrides[ours] = tuple(ic[theirs])
        for key in ("patch_size", "merge_size", "temporal_patch_size"):
            if key in ic:
                overrides[key] = ic[key]
    # As transformers' video processor loading: with no video config, the image processor's
    # file stands in, and the family's video processor class supplies what a file leaves out.
    # A folder with neither keeps the preset.
    vc = _settings(
        root, "video_processor", ("video_preprocessor_config.json", "preprocessor_config.json")
    )
    if vc is not None:
        overrides.update(_video_overrides(vc, dict(spec.hf_video_defaults)))
    return ModelConfig(
        model_type=model_type,
        family=spec.family,
        vision=vision,
        tokens=tokens,
        processor=spec.processor.replace(**overrides),
        text_hidden_size=text.get("hidden_size"),
    )
