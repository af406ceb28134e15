"""Session fixtures: tiny Qwen-VL checkpoints saved by transformers, tokenizer and processor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The tiny tokenizer and the transformers processor builders live with the prompt tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "prompt"))

from e2e_helpers import Tiny, build_tiny  # noqa: E402


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory) -> Tiny:
    return build_tiny("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="session")
def qwen2_5(tmp_path_factory) -> Tiny:
    return build_tiny("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl"))
