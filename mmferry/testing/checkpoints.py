"""Tiny transformers Qwen-VL checkpoints (the oracle) for every supported model type.

The tower sizes are each spec's `tiny_config`, written back in HF spelling by inverting the
spec's `hf_vision` table, so a checkpoint saved here loads into mmferry's tiny tower as is.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from mmferry.config import VisionConfig
from mmferry.models import spec_for

# model_type -> (transformers config class, conditional-generation class, base model class)
HF_CLASSES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLModel"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "Qwen3VLModel"),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeModel"),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "Qwen3_5Model"),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeModel"),
}

# Token ids inside the tiny vocabulary of saved checkpoints.
TOKENS = dict(
    image_token_id=990, video_token_id=991, vision_start_token_id=992, vision_end_token_id=993
)

_MROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 4, 4]}
_MOE = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32)
# Qwen3.5 mixes linear and full attention layers; one full-attention layer is enough here.
_HYBRID = dict(
    layer_types=["full_attention"],
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
)
_TEXT_EXTRA: dict[str, dict[str, Any]] = {
    "qwen3_vl_moe": _MOE,
    "qwen3_5": _HYBRID,
    "qwen3_5_moe": {**_HYBRID, **_MOE, "shared_expert_intermediate_size": 32},
}


def tiny_text(model_type: str, **overrides: Any) -> dict[str, Any]:
    """A tiny language-model config: the tests need only the keys and ids it brings."""
    base = dict(
        hidden_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=24,
        intermediate_size=64,
        vocab_size=1000,
        rope_parameters=_MROPE,
    )
    return {**base, **_TEXT_EXTRA.get(model_type, {}), **overrides}


def hf_vision(model_type: str, config: VisionConfig | None = None) -> dict[str, Any]:
    """`config` (default: the spec's tiny tower) as a config.json `vision_config` dict."""
    spec = spec_for(model_type)
    config = config or spec.tiny_config
    out: dict[str, Any] = {}
    for ours, rule in spec.hf_vision.items():
        if callable(rule):
            continue
        value = getattr(config, ours)
        out[rule[0][0]] = list(value) if isinstance(value, tuple) else value
    if "embed_dim" in out:  # Qwen2-VL gives the MLP width as a ratio of the tower width
        ratio, rest = divmod(config.intermediate_size, config.hidden_size)
        assert not rest, "transformers takes an integer mlp_ratio"
        out["mlp_ratio"] = ratio
    return out


def _classes(model_type: str):
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "mmferry.testing's tiny checkpoints need transformers: pip install 'mmferry[testing]'"
        ) from None

    return tuple(getattr(transformers, name) for name in HF_CLASSES[model_type])


def hf_config(model_type: str, *, vision: dict[str, Any] | None = None, **kwargs: Any):
    """A transformers config of the tiny tower and tiny text model."""
    config_cls = _classes(model_type)[0]
    kwargs.setdefault("text_config", tiny_text(model_type))
    return config_cls(vision_config=vision or hf_vision(model_type), **kwargs)


def save_perturbed(model, path: Path, max_shard_size: str | None = None) -> Path:
    """Save `model` after nudging every vision weight off its trivial init (norms, biases)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.eval().save_pretrained(path, **kwargs)
    return path


def save_tiny_checkpoint(model_type: str, path: Path, max_shard_size: str | None = None):
    """(checkpoint folder, transformers' vision model with the same weights)."""
    torch.manual_seed(0)
    model = _classes(model_type)[1](hf_config(model_type, **TOKENS))
    return save_perturbed(model, path, max_shard_size), model.model.visual


def tiny_base_model(model_type: str, *, tokens_per_second: int = 2):
    """A tiny transformers base model whose `get_rope_index` is the mRoPE reference."""
    text = tiny_text(model_type, hidden_size=16, head_dim=8, intermediate_size=32)
    text["vocab_size"] = 152000  # the prompts use Qwen's real vision token ids
    vision = hf_vision(model_type)
    if "tokens_per_second" in vision:
        vision["tokens_per_second"] = tokens_per_second
    return _classes(model_type)[2](hf_config(model_type, vision=vision, text_config=text)).eval()


def small_patch_qwen3(**overrides: Any) -> VisionConfig:
    """The tiny Qwen3-VL tower with 4-pixel patches (small grids), two deepstack taps."""
    small = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=16,
        patch_size=4,
        num_position_embeddings=64,
        deepstack_visual_indexes=(0, 1),
    )
    return dataclasses.replace(spec_for("qwen3-vl").tiny_config, **{**small, **overrides})
