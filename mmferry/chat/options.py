"""Processor options as transformers and vLLM's `mm_processor_kwargs` spell them -> our fields.

The spellings, as `AutoProcessor.from_pretrained(path, **kwargs)` hands them to its image and
video processors:
- `min_pixels`, `max_pixels`: the image limits, and the video limits where the family's video
  processor takes them (Qwen2-VL, Qwen2.5-VL; Qwen3-VL's reads only `size`);
- `size={"shortest_edge": min, "longest_edge": max}` (or `min_pixels`/`max_pixels` keys): the
  image and the video limits;
- `image_mean`, `image_std`: both processors' normalisation;
- `patch_size`, `temporal_patch_size`, `merge_size`;
- `fps`, `num_frames`, `do_sample_frames`, `min_frames`, `max_frames`, `cap_pixels_per_frame`:
  video sampling;
- `images_kwargs={...}`, `videos_kwargs={...}`: any of these for one processor only;
- every `ProcessorConfig` field by its own name (`image_max_pixels`, `video_min_pixels`, ...).
Anything else is an `UnknownOptionError` listing the valid names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mmferry.config import ProcessorConfig
from mmferry.models import spec_for

# Spelled the same for both processors; they configure one shared setting of ours.
_SHARED = ("patch_size", "temporal_patch_size", "merge_size")
_VIDEO_ONLY = (
    "fps",
    "num_frames",
    "do_sample_frames",
    "min_frames",
    "max_frames",
    "cap_pixels_per_frame",
)
_PER_PROCESSOR = ("min_pixels", "max_pixels", "size", "image_mean", "image_std")
_OURS = tuple(f.name for f in dataclasses.fields(ProcessorConfig) if f.name != "family")
TRANSFORMERS_NAMES = (*_PER_PROCESSOR, *_SHARED, *_VIDEO_ONLY, "images_kwargs", "videos_kwargs")


class UnknownOptionError(ValueError, TypeError):
    """An option no processor takes. (A TypeError too, as unknown keyword arguments are.)"""


def valid_names() -> tuple[str, ...]:
    return tuple(dict.fromkeys((*TRANSFORMERS_NAMES, *_OURS)))


def _unknown(names: list[str], where: str = "") -> UnknownOptionError:
    return UnknownOptionError(
        f"unknown processor setting(s){where}: {', '.join(sorted(names))}; valid names: "
        f"{', '.join(valid_names())}"
    )


def _size_limits(size: Any) -> tuple[int | None, int | None]:
    if not isinstance(size, Mapping):
        raise ValueError(f"size must be a dict with shortest_edge / longest_edge, got {size!r}")
    unknown = set(size) - {"shortest_edge", "longest_edge", "min_pixels", "max_pixels"}
    if unknown:
        raise ValueError(
            f"size keys are shortest_edge and longest_edge (pixel counts); got {sorted(unknown)}"
        )
    return (
        size.get("shortest_edge", size.get("min_pixels")),
        size.get("longest_edge", size.get("max_pixels")),
    )


def _one_processor(options: Mapping[str, Any], prefix: str, where: str) -> dict[str, Any]:
    """`images_kwargs` / `videos_kwargs` -> our fields for that processor (`prefix`)."""
    out: dict[str, Any] = {}
    video = prefix == "video"
    allowed = {*_PER_PROCESSOR, *_SHARED, *(_VIDEO_ONLY if video else ())}
    unknown = [k for k in options if k not in allowed]
    if unknown:
        raise _unknown(unknown, f" in {where}")
    for key, value in options.items():
        if key == "size":
            lo, hi = _size_limits(value)
            out.update({f"{prefix}_min_pixels": lo, f"{prefix}_max_pixels": hi})
        elif key in ("min_pixels", "max_pixels"):
            out[f"{prefix}_{key}"] = value
        elif key in ("image_mean", "image_std"):
            out[f"{prefix}_{key.split('_')[1]}"] = tuple(value)
        else:
            out[key] = value
    return {k: v for k, v in out.items() if v is not None}


def processor_overrides(options: Mapping[str, Any], family: str) -> dict[str, Any]:
    """`ProcessorConfig.replace` arguments for `options` in any accepted spelling."""
    unknown = [k for k in options if k not in TRANSFORMERS_NAMES and k not in _OURS]
    if unknown:
        raise _unknown(unknown)
    video_pixels = spec_for(family).video_takes_pixel_options
    out: dict[str, Any] = {}
    ours: dict[str, Any] = {}
    # Flat spellings first, so `images_kwargs` / `videos_kwargs` (more specific) win.
    for key, value in sorted(options.items(), key=lambda kv: kv[0].endswith("_kwargs")):
        if key == "images_kwargs":
            out.update(_one_processor(value, "image", key))
        elif key == "videos_kwargs":
            out.update(_one_processor(value, "video", key))
        elif key in ("size", "image_mean", "image_std") or (
            key in ("min_pixels", "max_pixels") and video_pixels
        ):
            out.update(_one_processor({key: value}, "image", key))
            out.update(_one_processor({key: value}, "video", key))
        elif key in ("min_pixels", "max_pixels"):
            out.update(_one_processor({key: value}, "image", key))
        elif key in _SHARED or key in _VIDEO_ONLY:
            out[key] = value
        else:
            ours[key] = value
    for key, value in ours.items():
        if key in out and out[key] != value:
            raise ValueError(f"{key} is given twice, in two spellings, with different values")
        out[key] = value
    return out


def apply_options(config: ProcessorConfig, options: Mapping[str, Any]) -> ProcessorConfig:
    """`config` with `options` (any accepted spelling) applied."""
    if not options:
        return config
    return config.replace(**processor_overrides(options, config.family))
