"""A local checkpoint folder read into a `ModelConfig`, with transformers' file precedence.

The preprocessor configs' spellings (`size={"shortest_edge", "longest_edge"}` /
`min_pixels`/`max_pixels`) are translated here; each family's `vision_config` spellings are a
table in its spec, applied by `ModelSpec.vision_from_hf`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mmferry.config import ModelConfig, TokenIds
from mmferry.models.registry import spec_for


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
