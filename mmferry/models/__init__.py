"""Model families: one module each; a family registers its specs when imported here."""

from __future__ import annotations

from types import MappingProxyType

from mmferry.config import ProcessorConfig
from mmferry.models import qwen2_vl, qwen3_vl  # noqa: F401  (the registry lines)
from mmferry.models.base import ModelSpec, all_specs, spec_for, supported_model_types

SUPPORTED_MODEL_TYPES = supported_model_types()
# The public checkpoints' preprocessor defaults, by the names users type.
PRESETS: MappingProxyType[str, ProcessorConfig] = MappingProxyType(
    {s.preset_name: s.processor for s in all_specs()}
)

__all__ = [
    "PRESETS",
    "SUPPORTED_MODEL_TYPES",
    "ModelSpec",
    "all_specs",
    "spec_for",
    "supported_model_types",
]
