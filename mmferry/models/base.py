"""`ModelSpec`: everything that differs between model families.

A stage reads a spec's attributes (found by `mmferry.models.spec_for`); it never compares
family names itself. The registry of specs is `mmferry/models/registry.py`.
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
