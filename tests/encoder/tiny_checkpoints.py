"""Builders of tiny Qwen-VL checkpoints saved by transformers (the oracle) for encoder tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

TOKENS = dict(
    image_token_id=990, video_token_id=991, vision_start_token_id=992, vision_end_token_id=993
)


def tiny_text(**overrides):
    """A tiny language-model config: the tests only need the checkpoint keys it adds."""
    base = dict(
        hidden_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=24,
        intermediate_size=64,
        vocab_size=1000,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 4, 4]},
    )
    return {**base, **overrides}


def save_perturbed(model, path: Path, max_shard_size: str | None = None) -> Path:
    # Perturb every vision parameter so norms and biases are not at their trivial init.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.eval().save_pretrained(path, **kwargs)
    return path


QWEN3_VISION = dict(
    depth=3,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    out_hidden_size=48,
    patch_size=16,
    num_position_embeddings=144,
    deepstack_visual_indexes=[0, 2],
)


def make_qwen3_vl(path: Path, max_shard_size: str | None = None):
    torch.manual_seed(0)
    cfg = transformers.Qwen3VLConfig(
        vision_config=QWEN3_VISION,
        text_config=tiny_text(),
        **TOKENS,
    )
    model = transformers.Qwen3VLForConditionalGeneration(cfg)
    return save_perturbed(model, path, max_shard_size), model.model.visual
