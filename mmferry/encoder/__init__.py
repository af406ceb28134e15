"""encoder stage of mmferry: the vision tower, its loader, and data-parallel work assignment."""

from __future__ import annotations

from mmferry._exports import lazy_exports

_EXPORTS: dict[str, str] = {
    "VisionEncoder": "mmferry.encoder.model",
    "VisionOutput": "mmferry.encoder.model",
    "encode_sharded": "mmferry.encoder.sharded",
    "encode_sharded_packed": "mmferry.encoder.sharded",
    "ShardedEncodeError": "mmferry.encoder.sharded",
    "assign_work": "mmferry.encoder.assign",
    "Assignment": "mmferry.encoder.assign",
    "CostModel": "mmferry.encoder.assign",
}

__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
