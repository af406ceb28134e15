"""VisionEncoder API: the random built-in tower, meta-device forward (no host sync), errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmferry.encoder.model import VisionEncoder, VisionOutput
from mmferry.items import MultimodalItem
from mmferry.models import spec_for
from tests.encoder.tower_helpers import small_config

TINY = dataclasses.replace(
    spec_for("qwen3-vl").random_config,
    depth=3,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=24,
    deepstack_visual_indexes=(0, 2),
)


def test_builtin_default_is_the_2b_tower():
    cfg = spec_for("qwen3-vl").random_config
    assert (cfg.depth, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads) == (
        24,
        1024,
        4096,
        16,
    )
    assert (cfg.patch_size, cfg.out_hidden_size, cfg.num_position_embeddings) == (16, 2048, 2304)
    assert cfg.deepstack_visual_indexes == (5, 11, 17)


def test_random_is_seeded_and_says_so():
    a = VisionEncoder.random(config=TINY, seed=7)
    b = VisionEncoder.random(config=TINY, seed=7)
    c = VisionEncoder.random(config=TINY, seed=8)
    sa, sb, sc = (e.tower.state_dict() for e in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.attn.qkv.weight"], sc["blocks.0.attn.qkv.weight"])
    assert a.random_weights is True
    assert "RANDOM" in repr(a)
    assert a.moves_own_inputs is True
    assert a.accepted_layouts == ("hf", "compact-u8")
    assert (a.out_hidden_size, a.num_deepstack) == (24, 2)


def _mixed_items():
    return [
        MultimodalItem("image", torch.randn(24, 1536), (1, 4, 6), "hf", "a"),
        MultimodalItem(
            "image", torch.zeros(64, 768, dtype=torch.uint8), (1, 8, 8), "compact-u8", "b"
        ),
        MultimodalItem(
            "video", torch.zeros(48, 1536, dtype=torch.uint8), (2, 4, 6), "compact-u8", "c"
        ),
        MultimodalItem("video", torch.randn(32, 1536), (2, 4, 4), "hf", "d"),
    ]


@pytest.mark.parametrize("model", ["qwen3-vl", "qwen2.5-vl", "qwen2-vl"])
def test_whole_forward_on_meta(model):
    # Every tensor op runs on `meta`, where reading a value back to the host (.item(),
    # .tolist(), boolean-mask indexing, data-dependent shapes) raises: the forward makes no
    # host sync.
    cfg = small_config(model)
    enc = VisionEncoder.random(config=cfg, device="meta")
    assert enc.tower.blocks[0].attn.qkv.weight.is_meta
    cols = 3 * 2 * cfg.patch_size**2
    items = [
        MultimodalItem("image", torch.randn(24, cols), (1, 4, 6), "hf", "a"),
        MultimodalItem(
            "video", torch.zeros(32, cols, dtype=torch.uint8), (2, 4, 4), "compact-u8", "d"
        ),
        MultimodalItem("image", torch.randn(64, cols), (1, 8, 8), "hf", "b"),
    ]
    outs = enc(items)
    assert [o.embeds.shape for o in outs] == [
        (6, cfg.out_hidden_size),
        (8, cfg.out_hidden_size),
        (16, cfg.out_hidden_size),
    ]
    assert all(o.embeds.is_meta for o in outs)
    assert all(len(o.deepstack) == enc.num_deepstack for o in outs)


def test_mixed_layouts_keep_input_order():
    enc = VisionEncoder.random(config=TINY)
    items = _mixed_items()
    outs = enc(items)
    assert all(isinstance(o, VisionOutput) for o in outs)
    assert [o.embeds.shape[0] for o in outs] == [it.num_tokens for it in items]
    alone = [enc([it])[0] for it in items]
    for o, a in zip(outs, alone):
        assert torch.allclose(o.embeds, a.embeds, atol=1e-5)
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(o.deepstack, a.deepstack))
    assert enc([]) == []


def test_bad_inputs_are_refused():
    enc = VisionEncoder.random(config=TINY)
    with pytest.raises(ValueError, match="columns"):
        enc([MultimodalItem("image", torch.randn(24, 100), (1, 4, 6), "hf", "x")])
    with pytest.raises(ValueError, match="merge_size"):
        enc([MultimodalItem("image", torch.randn(36, 1536), (1, 6, 6), "hf", "x", merge_size=3)])
    with pytest.raises(ValueError, match="patch rows"):
        enc.forward_packed(torch.randn(10, 1536), [(1, 4, 6)])
    with pytest.raises(ValueError, match="layout"):
        enc.forward_packed(torch.randn(24, 1536), [(1, 4, 6)], layout="jpeg")
    with pytest.raises(ValueError, match="uint8"):
        enc.forward_packed(torch.randn(24, 768), [(1, 4, 6)], layout="compact-u8")
    with pytest.raises(ValueError, match="unknown model"):
        VisionEncoder.random("llava")


def test_attention_backend_errors():
    with pytest.raises(ValueError, match="unknown attention"):
        VisionEncoder.random(config=TINY, attention="xformers")
    with pytest.raises(ValueError, match="CUDA"):
        VisionEncoder.random(config=TINY, attention="flash_attn")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_makes_no_sync():
    enc = VisionEncoder.random(config=TINY, device="cuda", dtype=torch.bfloat16)
    items = _mixed_items()
    enc(items)  # warm-up: first-call allocations and lazy inits
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = enc(items)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert outs[0].embeds.is_cuda
