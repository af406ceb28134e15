"""Every supported model type: a tiny checkpoint saved by transformers loads, and the tower's
embeddings (and deepstack rows) equal transformers' own vision model on the same features."""

from __future__ import annotations

import pytest
import torch

from mmferry.encoder.model import VisionEncoder
from mmferry.items import MultimodalItem
from mmferry.models import load_model_config, spec_for, supported_model_types
from mmferry.testing.checkpoints import HF_CLASSES, save_tiny_checkpoint

# Three images of different sizes and one video of three temporal patches.
GRIDS = [(1, 4, 6), (1, 8, 8), (1, 6, 10), (3, 4, 4)]
CLAIMED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


def test_every_claimed_model_type_is_registered_and_has_an_oracle():
    assert set(supported_model_types()) == set(CLAIMED) == set(HF_CLASSES)


@pytest.mark.parametrize("model_type", CLAIMED)
def test_tiny_checkpoint_matches_transformers(model_type, tmp_path):
    path, hf_visual = save_tiny_checkpoint(model_type, tmp_path)
    mc = load_model_config(path)
    spec = spec_for(model_type)
    assert (mc.model_type, mc.family, mc.vision) == (model_type, spec.family, spec.tiny_config)
    assert mc.tokens.image == 990

    enc = VisionEncoder.from_pretrained(path)
    c = enc.config
    cols = c.in_channels * c.temporal_patch_size * c.patch_size**2
    gen = torch.Generator().manual_seed(0)
    feats = [torch.randn(t * h * w, cols, generator=gen) for t, h, w in GRIDS]
    items = [
        MultimodalItem("image" if g[0] == 1 else "video", f, g, "hf", f"item{i}")
        for i, (f, g) in enumerate(zip(feats, GRIDS))
    ]
    outs = enc(items)
    with torch.no_grad():
        ref = hf_visual.eval()(torch.cat(feats), grid_thw=torch.tensor(GRIDS))
    sizes = [t * h * w // c.spatial_merge_size**2 for t, h, w in GRIDS]
    want = ref.pooler_output.split(sizes)
    taps = [d.split(sizes) for d in (getattr(ref, "deepstack_features", None) or [])]
    assert enc.num_deepstack == len(taps) == len(spec.tiny_config.deepstack_visual_indexes)
    for i, out in enumerate(outs):
        assert out.embeds.shape == want[i].shape
        torch.testing.assert_close(out.embeds, want[i], atol=1e-4, rtol=1e-4)
        for j, tap in enumerate(out.deepstack):
            torch.testing.assert_close(tap, taps[j][i], atol=1e-4, rtol=1e-4)
