"""Items, transformers' reference rows and small meta configs, for the tower tests."""

from __future__ import annotations

import dataclasses

import torch

from mmferry.config import VisionConfig
from mmferry.items import MultimodalItem
from mmferry.models import spec_for


def items_for(grids, cols, seed=0):
    """Random hf-layout features for `grids` (t=1 an image, else a video), and their items."""
    gen = torch.Generator().manual_seed(seed)
    feats = [torch.randn(t * h * w, cols, generator=gen) for t, h, w in grids]
    items = [
        MultimodalItem("image" if g[0] == 1 else "video", f, g, "hf", f"item{i}")
        for i, (f, g) in enumerate(zip(feats, grids))
    ]
    return feats, items


def reference(model, feats, grids):
    """transformers' tower on the packed batch, split per item (main rows, deepstack rows)."""
    with torch.no_grad():
        out = model(torch.cat(feats), grid_thw=torch.tensor(grids))
    sizes = [t * h * w // 4 for t, h, w in grids]
    deepstack = [d.split(sizes) for d in (getattr(out, "deepstack_features", None) or [])]
    return out.pooler_output.split(sizes), deepstack


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def small_config(model: str) -> VisionConfig:
    """`model`'s architecture at two layers of width 32 (a deepstack tap or a full-attention
    block on the second), for the forwards run on `meta`."""
    return dataclasses.replace(
        spec_for(model).random_config,
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        deepstack_visual_indexes=(1,) if model == "qwen3-vl" else (),
        fullatt_block_indexes=(1,) if model == "qwen2.5-vl" else (),
    )
