"""mmferry's towers against transformers' vision models on tiny saved checkpoints."""

from __future__ import annotations

import pytest
import torch

from mmferry.encoder.model import VisionEncoder
from tests.encoder.tower_helpers import items_for, max_diff, reference

# Three images of different grids and one video (t=3), for every tower.
QWEN3_GRIDS = [(1, 4, 6), (1, 12, 10), (1, 8, 8), (3, 6, 4)]
QWEN2_GRIDS = [(1, 6, 10), (1, 8, 8), (1, 4, 12), (2, 6, 6)]


def test_qwen3_vl_matches_transformers(qwen3_ckpt):
    path, ref_model = qwen3_ckpt
    enc = VisionEncoder.from_pretrained(path)
    feats, items = items_for(QWEN3_GRIDS, 1536)
    outs = enc(items)
    ref, ref_ds = reference(ref_model, feats, QWEN3_GRIDS)
    assert len(outs) == len(items)
    for i, out in enumerate(outs):
        assert out.embeds.shape == ref[i].shape
        assert max_diff(out.embeds, ref[i]) < 1e-4
        assert len(out.deepstack) == len(ref_ds) == 2
        for j, tap in enumerate(out.deepstack):
            assert max_diff(tap, ref_ds[j][i]) < 1e-4


def test_qwen3_vl_forward_packed_matchesitems_for(qwen3_ckpt):
    path, ref_model = qwen3_ckpt
    enc = VisionEncoder.from_pretrained(path)
    feats, _ = items_for(QWEN3_GRIDS, 1536, seed=3)
    outs = enc.forward_packed(torch.cat(feats), torch.tensor(QWEN3_GRIDS))
    ref, ref_ds = reference(ref_model, feats, QWEN3_GRIDS)
    for i, out in enumerate(outs):
        assert max_diff(out.embeds, ref[i]) < 1e-4
        assert max_diff(out.deepstack[1], ref_ds[1][i]) < 1e-4


def test_qwen3_vl_bfloat16(qwen3_ckpt):
    path, ref_model = qwen3_ckpt
    enc = VisionEncoder.from_pretrained(path, dtype=torch.bfloat16)
    assert enc.tower.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    feats, items = items_for(QWEN3_GRIDS, 1536, seed=1)
    outs = enc(items)
    ref, _ = reference(ref_model, feats, QWEN3_GRIDS)  # float32 reference
    for i, out in enumerate(outs):
        assert out.embeds.dtype == torch.bfloat16
        scale = ref[i].abs().max().item()
        # bfloat16 keeps 8 significant bits; a few roundings per layer stay well within 5%.
        assert max_diff(out.embeds, ref[i]) < 0.05 * scale + 1e-2


@pytest.mark.parametrize("fixture", ["qwen2_5_ckpt", "qwen2_ckpt"])
def test_qwen2_towers_match_transformers(fixture, request):
    path, ref_model = request.getfixturevalue(fixture)
    enc = VisionEncoder.from_pretrained(path)
    assert enc.num_deepstack == 0
    feats, items = items_for(QWEN2_GRIDS, 1176, seed=2)
    outs = enc(items)
    ref, _ = reference(ref_model, feats, QWEN2_GRIDS)
    for i, out in enumerate(outs):
        assert out.deepstack == ()
        assert max_diff(out.embeds, ref[i]) < 1e-4
