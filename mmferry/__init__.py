"""mmferry: images and videos into Qwen-VL vision-language models.

The top level holds what a pipeline user needs, in call order; transport and lower-level names
live in their subpackages (`mmferry.transport`, `mmferry.feed`, `mmferry.encoder`,
`mmferry.models`). To add a public name, add one line to `_EXPORTS` and to the README's API list.
"""

from __future__ import annotations

from mmferry._exports import lazy_exports

__version__ = "0.1.0"

# Public name -> module. Imported on first use so `import mmferry` stays cheap and optional
# extras (PyAV, tokenizers) are touched only when their feature is used.
_EXPORTS: dict[str, str] = {
    # configuration
    "load_model_config": "mmferry.models",
    "ModelConfig": "mmferry.config",
    "VisionConfig": "mmferry.config",
    "ProcessorConfig": "mmferry.config",
    "TokenIds": "mmferry.config",
    # preprocessing and prompt
    "Processor": "mmferry.processor",
    "MultimodalItem": "mmferry.items",
    "ImagePart": "mmferry.preprocess.batch",
    "VideoPart": "mmferry.preprocess.batch",
    "ItemError": "mmferry.preprocess.batch",
    "smart_resize": "mmferry.preprocess.resize",
    "sample_images": "mmferry.preprocess.samples",
    "sample_video": "mmferry.preprocess.samples",
    "ExpandedPrompt": "mmferry.prompt.expand",
    # device feed and encoder
    "materialize_features": "mmferry.feed.materialize",
    "VisionEncoder": "mmferry.encoder.model",
    "VisionOutput": "mmferry.encoder.model",
    "encode_sharded": "mmferry.encoder.sharded",
    "encode_sharded_packed": "mmferry.encoder.sharded",
    "ShardedEncodeError": "mmferry.encoder.sharded",
    # embeddings into the LLM
    "merge_vision_embeddings": "mmferry.embed.merge",
    "MergedEmbeddings": "mmferry.embed.merge",
    "EncoderCache": "mmferry.embed.cache",
    "encode_with_cache": "mmferry.embed.cache",
    "prefill_step": "mmferry.embed.step",
    "StepRequest": "mmferry.embed.step",
    "StepOutput": "mmferry.embed.step",
    "Precomputed": "mmferry.embed.step",
    "decode_positions": "mmferry.prompt.mrope",
}

__all__ = ["__version__", *_EXPORTS]
__getattr__ = lazy_exports(__name__, _EXPORTS)
