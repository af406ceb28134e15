"""Model families (one module each), their registry, and checkpoint-folder reading."""

from __future__ import annotations

from mmferry.models.base import ModelSpec
from mmferry.models.checkpoint import load_model_config
from mmferry.models.registry import (
    PRESETS,
    SUPPORTED_MODEL_TYPES,
    all_specs,
    preset,
    spec_for,
    supported_model_types,
)

__all__ = [
    "PRESETS",
    "SUPPORTED_MODEL_TYPES",
    "ModelSpec",
    "all_specs",
    "load_model_config",
    "preset",
    "spec_for",
    "supported_model_types",
]
