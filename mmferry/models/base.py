"""`ModelSpec`: everything that differs between model families, and the registry of specs.

A stage that needs a family fact asks `spec_for(name)` (a config.json `model_type`, a family
name, or a preset name such as "qwen2.5-vl") and reads an attribute; it never compares family
names itself. Adding a family is one module in `mmferry/models/` that calls `register`, plus
its import line in `mmferry/models/__init__.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmferry.config import ProcessorConfig, TokenIds, VisionConfig

if TYPE_CHECKING:
    from torch import nn

# One HF spelling rule: (config keys tried in order, default) or a function of the whole
# `vision_config` dict for fields that are computed rather than renamed.
HFField = tuple[tuple[str, ...], Any] | Callable[[Mapping[str, Any]], Any]
# (indices, target size) rules; see `mmferry.preprocess.sampling` for their signatures.
FrameSampler = Callable[..., list[int]]
FrameSizer = Callable[[ProcessorConfig, int, int, int], tuple[int, int]]


# NOTE: eq=False: specs are compared (and hashed) by identity; each is registered once.
@dataclass(frozen=True, eq=False)
class ModelSpec:
    """The facts of one config.json `model_type`; model types of one family share its rules."""

    model_type: str
    family: str
    # The name users type (`Processor.for_model`); any spelling of the model type works too.
    preset_name: str
    # Our `VisionConfig` field -> its HF spelling in `vision_config`.
    hf_vision: Mapping[str, HFField]
    tokens: TokenIds
    processor: ProcessorConfig
    # transformers' video processor class defaults (our field names): what a checkpoint folder's
    # video settings fall back to. Presets (`processor`) keep their own documented choice.
    hf_video_defaults: Mapping[str, Any]
    # The public checkpoint's tower for `VisionEncoder.random`, and a tiny one for tests.
    random_config: VisionConfig
    tiny_config: VisionConfig
    tower: Callable[[VisionConfig], nn.Module]
    # Video rules: which frames to keep and the size every kept frame is resized to.
    sample_frames: FrameSampler
    frame_size: FrameSizer
    # Where the tower's weights live in a checkpoint, most specific first, and key renames
    # (regex, replacement) applied after the prefix is stripped.
    vision_prefixes: tuple[str, ...] = ("model.visual.", "visual.")
    key_renames: tuple[tuple[str, str], ...] = ()
    # Attention, rotary positions and position embeddings never cross a frame, so a video can
    # be split across data-parallel ranks by frames exactly.
    frame_local: bool = True
    # Cost model: MLP matmuls per block (2 for fc1/fc2, 3 for gated) and window attention.
    mlp_matmuls: int = 2
    windowed: bool = False
    # Prompt rules: per-frame `<t seconds>` text in the prompt (Qwen3-VL) or seconds scaling
    # the video's mRoPE time axis (Qwen2.5-VL, `tokens_per_second`).
    timestamps_in_prompt: bool = False
    video_time_in_mrope: bool = False
    # The family's transformers video processor takes `min_pixels` / `max_pixels` options
    # (Qwen2VLVideoProcessor does; Qwen3-VL's reads only `size`), see `mmferry.chat.options`.
    video_takes_pixel_options: bool = False

    def vision_from_hf(self, vision: Mapping[str, Any]) -> VisionConfig:
        """Our `VisionConfig` from a config.json `vision_config` dict (the table, applied)."""
        values: dict[str, Any] = {}
        for ours, rule in self.hf_vision.items():
            if callable(rule):
                values[ours] = rule(vision)
                continue
            keys, default = rule
            value = next((vision[k] for k in keys if vision.get(k) is not None), default)
            values[ours] = tuple(value) if isinstance(value, list) else value
        return VisionConfig(family=self.family, **values)


_SPECS: dict[str, ModelSpec] = {}


def _key(name: str) -> str:
    # "qwen2.5-vl", "Qwen2_5_VL" and "qwen2_5_vl" are one name.
    return name.lower().replace("-", "_").replace(".", "_")


def register(*specs: ModelSpec) -> None:
    """Make specs reachable by model type and preset name (a family resolves to its first)."""
    for spec in specs:
        for name in (spec.model_type, spec.preset_name):
            _SPECS[_key(name)] = spec
        _SPECS.setdefault(_key(spec.family), spec)


def spec_for(name: str) -> ModelSpec:
    """The spec for a model type, family or preset name; ValueError listing supported types."""
    from mmferry import models  # noqa: F401  (registers the families)

    spec = _SPECS.get(_key(name))
    if spec is None:
        raise ValueError(
            f"unsupported model {name!r}; mmferry supports: " + ", ".join(supported_model_types())
        )
    return spec


def all_specs() -> tuple[ModelSpec, ...]:
    """Every registered spec, one per model type, in registration order."""
    from mmferry import models  # noqa: F401

    return tuple(dict.fromkeys(_SPECS.values()))


def supported_model_types() -> tuple[str, ...]:
    """The config.json `model_type` values mmferry loads."""
    return tuple(s.model_type for s in all_specs())


def families() -> frozenset[str]:
    """The family names (rule sets) the registered model types belong to."""
    return frozenset(s.family for s in all_specs())
