"""Frame splitting is exact: checked on transformers' towers (the oracle) and on mmferry's."""

from __future__ import annotations

import pytest
import torch

from mmferry.encoder.assign import Shard
from mmferry.encoder.model import VisionEncoder
from mmferry.encoder.sharded import _sub_item
from mmferry.items import MultimodalItem
from mmferry.models import all_specs
from mmferry.testing.checkpoints import small_patch_qwen3

GRID = (5, 8, 12)  # 5 temporal patches of 8x12: six Qwen2.5 windows per frame at window_size 16
SPLITS = [(0, 2), (2, 3), (3, 5)]


def _hf_tower(family: str) -> torch.nn.Module:
    common = dict(depth=2, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as Tower,
        )

        cfg = Qwen2VLVisionConfig(embed_dim=32, hidden_size=16, mlp_ratio=2, **common)
    elif family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
            Qwen2_5_VLVisionConfig,
        )
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower,
        )

        cfg = Qwen2_5_VLVisionConfig(
            hidden_size=32,
            intermediate_size=48,
            out_hidden_size=16,
            window_size=16,
            fullatt_block_indexes=[1],
            **common,
        )
    else:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Tower

        cfg = Qwen3VLVisionConfig(
            hidden_size=32,
            intermediate_size=48,
            out_hidden_size=16,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
            **common,
        )
    torch.manual_seed(0)
    return Tower._from_config(cfg, dtype=torch.float64).eval()


@pytest.mark.parametrize("family", sorted({s.family for s in all_specs() if s.frame_local}))
def test_transformers_towers_attend_within_a_frame(family):
    tower = _hf_tower(family)
    t, h, w = GRID
    x = torch.randn(
        t * h * w, 3 * 2 * 4 * 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        whole = tower(x, torch.tensor([GRID])).pooler_output
        rows_per_frame = h * w // 4
        for a, b in SPLITS:
            part = tower(x[a * h * w : b * h * w], torch.tensor([(b - a, h, w)])).pooler_output
            torch.testing.assert_close(
                part, whole[a * rows_per_frame : b * rows_per_frame], rtol=0, atol=1e-10
            )


def test_mmferry_sub_items_give_the_whole_video_rows():
    cfg = small_patch_qwen3(intermediate_size=48)
    enc = VisionEncoder.random(config=cfg, seed=3, dtype=torch.float64)
    t, h, w = GRID
    g = torch.Generator().manual_seed(1)
    video = MultimodalItem(
        "video",
        torch.randn(t * h * w, 96, generator=g),
        GRID,
        "hf",
        "v",
        timestamps=tuple(float(i) for i in range(t)),
    )
    (whole,) = enc([video])
    subs = [_sub_item(video, Shard(0, a, b, 0)) for a, b in SPLITS]
    assert subs[1].grid_thw == (1, h, w) and subs[1].timestamps == (2.0,)
    assert subs[0].feature.data_ptr() == video.feature.data_ptr()  # a view, not a copy
    outs = enc(subs)
    rows = h * w // 4
    for (a, b), o in zip(SPLITS, outs):
        torch.testing.assert_close(o.embeds, whole.embeds[a * rows : b * rows], rtol=0, atol=1e-10)
        for d, dw in zip(o.deepstack, whole.deepstack):
            torch.testing.assert_close(d, dw[a * rows : b * rows], rtol=0, atol=1e-10)
