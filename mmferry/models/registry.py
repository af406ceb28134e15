"""The registry of model specs: every family module's specs, found by any spelling of a name.

A stage that needs a family fact asks `spec_for(name)` (a config.json `model_type`, a family
name, or a preset name such as "qwen2.5-vl") and reads an attribute. Adding a family is one
module in `mmferry/models/` exporting `SPECS`, plus its entry in `_FAMILIES` below.
"""

from __future__ import annotations

from types import MappingProxyType

from mmferry.config import ProcessorConfig
from mmferry.models import qwen2_vl, qwen3_vl
from mmferry.models.base import ModelSpec

_FAMILIES = (qwen2_vl, qwen3_vl)


def _key(name: str) -> str:
    # "qwen2.5-vl", "Qwen2_5_VL" and "qwen2_5_vl" are one name.
    return name.lower().replace("-", "_").replace(".", "_")


def _build() -> dict[str, ModelSpec]:
    table: dict[str, ModelSpec] = {}
    for module in _FAMILIES:
        for spec in module.SPECS:
            for name in (spec.model_type, spec.preset_name):
                table[_key(name)] = spec
            # A family name resolves to its first model type.
            table.setdefault(_key(spec.family), spec)
    return table


_SPECS = _build()
_ALL = tuple(spec for module in _FAMILIES for spec in module.SPECS)

SUPPORTED_MODEL_TYPES = tuple(s.model_type for s in _ALL)
# The public checkpoints' preprocessor defaults, by the names users type.
PRESETS: MappingProxyType[str, ProcessorConfig] = MappingProxyType(
    {s.preset_name: s.processor for s in _ALL}
)


def spec_for(name: str) -> ModelSpec:
    """The spec for a model type, family or preset name; ValueError listing supported types."""
    spec = _SPECS.get(_key(name))
    if spec is None:
        raise ValueError(
            f"unsupported model {name!r}; mmferry supports: " + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    return spec


def all_specs() -> tuple[ModelSpec, ...]:
    """Every registered spec, one per model type, in registration order."""
    return _ALL


def supported_model_types() -> tuple[str, ...]:
    """The config.json `model_type` values mmferry loads."""
    return SUPPORTED_MODEL_TYPES


def preset(name: str) -> ProcessorConfig:
    """The public checkpoint's preprocessing for a preset name ("qwen3-vl", "qwen2.5-vl", ...)."""
    try:
        return spec_for(name).processor
    except ValueError:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}") from None
