"""Session fixtures: tiny Qwen-VL checkpoints and transformers' towers holding the same weights."""

from __future__ import annotations

import pytest

from mmferry.testing.checkpoints import save_tiny_checkpoint


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory):
    """(checkpoint dir, transformers' Qwen3VLVisionModel with the same weights)."""
    return save_tiny_checkpoint("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="session")
def qwen2_5_ckpt(tmp_path_factory):
    return save_tiny_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory):
    return save_tiny_checkpoint("qwen2_vl", tmp_path_factory.mktemp("qwen2_vl"))
