"""Session fixtures for the prompt tests: the tokenizer files and transformers' mRoPE oracle."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from prompt_helpers import TOK, build_tokenizer_json

from mmferry.testing.checkpoints import tiny_base_model


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_json(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_json: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))


RopeOracle = Callable[..., tuple[torch.Tensor, int]]


@pytest.fixture(scope="session")
def hf_rope() -> Callable[[str], RopeOracle]:
    """`hf_rope(family)(ids, image_grids, video_grids, second_per_grid_ts)` -> ([3, L], delta)."""
    models: dict[str, object] = {}

    def oracle(family: str) -> RopeOracle:
        if family not in models:
            models[family] = tiny_base_model(family)
        model = models[family]

        def run(ids, image_grids=(), video_grids=(), second_per_grid_ts=None):
            ids_t = torch.as_tensor(ids, dtype=torch.long)[None]
            # Token types as transformers' processors build them: 1 image pad, 2 video pad.
            types = torch.zeros_like(ids_t, dtype=torch.int32)
            types[ids_t == TOK.image] = 1
            types[ids_t == TOK.video] = 2
            kwargs = dict(
                image_grid_thw=torch.tensor(image_grids).reshape(-1, 3) if image_grids else None,
                video_grid_thw=torch.tensor(video_grids).reshape(-1, 3) if video_grids else None,
                attention_mask=torch.ones_like(ids_t),
            )
            if family == "qwen2_5_vl" and second_per_grid_ts is not None:
                kwargs["second_per_grid_ts"] = torch.tensor(second_per_grid_ts)
            pos, delta = model.get_rope_index(ids_t, types, **kwargs)
            return pos[:, 0], int(delta.reshape(-1)[0])

        return run

    return oracle
