"""Session fixtures: tiny Qwen-VL checkpoints and transformers' towers holding the same weights."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import TOKENS, make_qwen3_vl, save_perturbed, tiny_text

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory):
    """(checkpoint dir, transformers' Qwen3VLVisionModel with the same weights)."""
    return make_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="session")
def qwen2_5_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen2_5_VLConfig(
        vision_config=dict(
            depth=3,
            hidden_size=64,
            intermediate_size=96,
            num_heads=4,
            out_hidden_size=48,
            patch_size=14,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        text_config=tiny_text(),
        **TOKENS,
    )
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    return save_perturbed(model, tmp_path_factory.mktemp("qwen2_5_vl")), model.model.visual


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen2VLConfig(
        vision_config=dict(
            depth=2, embed_dim=64, num_heads=4, hidden_size=48, mlp_ratio=2, patch_size=14
        ),
        text_config=tiny_text(),
        **TOKENS,
    )
    model = transformers.Qwen2VLForConditionalGeneration(cfg)
    return save_perturbed(model, tmp_path_factory.mktemp("qwen2_vl")), model.model.visual
