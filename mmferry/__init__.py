"""mmferry: images and videos into Qwen-VL vision-language models."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> module. Imported on first use so `import mmferry` stays cheap and optional
# extras (PyAV, tokenizers) are touched only when their feature is used.
_EXPORTS: dict[str, str] = {
    "smart_resize": "mmferry.preprocess.resize",
    "Processor": "mmferry.processor",
    "MultimodalItem": "mmferry.items",
    "ProcessorConfig": "mmferry.config",
    "VisionConfig": "mmferry.config",
    "ModelConfig": "mmferry.config",
    "TokenIds": "mmferry.config",
    "load_model_config": "mmferry.config",
    "ExpandedPrompt": "mmferry.prompt.expand",
    "materialize_features": "mmferry.feed.materialize",
    "VisionEncoder": "mmferry.encoder.model",
    "VisionOutput": "mmferry.encoder.model",
    "encode_sharded": "mmferry.encoder.sharded",
    "encode_sharded_packed": "mmferry.encoder.sharded",
    "ShardedEncodeError": "mmferry.encoder.sharded",
    "assign_work": "mmferry.encoder.assign",
    "Assignment": "mmferry.encoder.assign",
    "CostModel": "mmferry.encoder.assign",
    "ShmArena": "mmferry.transport.shm",
    "ShmHandle": "mmferry.transport.shm",
    "ArenaFullError": "mmferry.transport.shm",
    "open_shared": "mmferry.transport.shm",
    "FeaturePool": "mmferry.transport.pool",
    "PoolHandle": "mmferry.transport.pool",
    "HostBacking": "mmferry.transport.pool",
    "CudaBacking": "mmferry.transport.pool",
    "open_feature": "mmferry.transport.pool",
    "ack": "mmferry.transport.pool",
    "prepare_encoder_inputs": "mmferry.feed.capabilities",
    "capabilities_of": "mmferry.feed.capabilities",
    "merge_vision_embeddings": "mmferry.embed.merge",
    "MergedEmbeddings": "mmferry.embed.merge",
    "EncoderCache": "mmferry.embed.cache",
    "encode_with_cache": "mmferry.embed.cache",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mmferry' has no attribute {name!r}")
