"""Token budgets: a batch padded to a budget gives the unpadded rows, for every family.

The padded path here runs without capture (the same body and attention a CUDA graph records),
so its exactness is proven where CI runs; `test_graphs.py` replays it on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from mmferry.encoder.attention import varlen_batch
from mmferry.encoder.budgets import (
    budget_for,
    check_budgets,
    pad_batch,
    pad_metadata,
    token_budgets,
)
from mmferry.encoder.metadata import build_metadata
from mmferry.encoder.model import VisionEncoder
from mmferry.items import MultimodalItem
from mmferry.models import spec_for
from tests.encoder.test_batched import FAMILIES
from tests.encoder.tower_helpers import items_for, max_diff, reference, small_config


def test_default_budgets_are_powers_of_two_from_1k_to_64k():
    assert token_budgets() == (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    assert token_budgets(256, 1024) == (256, 512, 1024)
    with pytest.raises(ValueError, match="power of two"):
        token_budgets(1000)
    with pytest.raises(ValueError, match="exceeds"):
        token_budgets(4096, 1024)
    with pytest.raises(ValueError, match="multiples of 4"):
        check_budgets([256, 250], 4)


def test_budget_for_picks_the_smallest_that_holds():
    budgets = token_budgets()
    assert budget_for(1, budgets) == 1024
    assert budget_for(1024, budgets) == 1024
    assert budget_for(1025, budgets) == 2048
    assert budget_for(65537, budgets) is None  # past the largest: eager


def test_pad_batch_adds_one_padding_sequence_and_fixed_slots():
    b = pad_batch(varlen_batch([8, 4, 4]), 32, 4)
    assert b.cu_seqlens.tolist() == [0, 8, 12, 16, 32] + [32] * 5  # 32 // 4 + 1 slots
    assert (b.total, b.max_seqlen, b.count) == (32, 32, 9)
    # Full: no padding sequence, the same fixed number of slots.
    assert pad_batch(varlen_batch([16, 16]), 32, 4).cu_seqlens.shape == (10,)


def test_pad_metadata_keeps_real_rows_and_windows_in_place():
    meta = build_metadata([(1, 8, 12), (1, 4, 4)], merge=2, head_dim=16, window=4)
    padded = pad_metadata(meta, 256, 4)
    n = meta.num_patches
    assert padded.num_patches == 256
    assert torch.equal(padded.positions[:n], meta.positions)
    assert torch.equal(padded.positions[n:], torch.zeros(256 - n, 2, dtype=torch.int64))
    blocks = n // 4
    assert torch.equal(padded.window_index[:blocks], meta.window_index)
    assert padded.window_index[blocks:].tolist() == list(range(blocks, 64))
    assert torch.equal(padded.window_index[padded.window_reverse], torch.arange(64))
    q3 = build_metadata([(1, 4, 6)], merge=2, head_dim=16, position_side=12)
    p3 = pad_metadata(q3, 64, 4)
    assert p3.interp_weights[24:].abs().sum() == 0  # padding takes no learned position
    with pytest.raises(ValueError, match="multiple of 4"):
        pad_metadata(q3, 26, 4)


@pytest.mark.parametrize("fixture", list(FAMILIES))
def test_padded_equals_unpadded_and_transformers(fixture, request):
    path, ref_model = request.getfixturevalue(fixture)
    grids, cols = FAMILIES[fixture]  # 320 patches: padded to 512, 192 rows of padding
    plain = VisionEncoder.from_pretrained(path)
    padded = VisionEncoder.from_pretrained(path, token_budgets=(128, 512))
    feats, items = items_for(grids, cols, seed=5)
    want = plain(items)
    got = padded(items)
    ref, ref_ds = reference(ref_model, feats, grids)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.embeds.shape == w.embeds.shape
        assert max_diff(g.embeds, w.embeds) < 1e-5
        assert max_diff(g.embeds, ref[i]) < 1e-4
        assert len(g.deepstack) == len(w.deepstack) == len(ref_ds)
        for j, tap in enumerate(g.deepstack):
            assert tap.shape == w.deepstack[j].shape
            assert max_diff(tap, w.deepstack[j]) < 1e-5
            assert max_diff(tap, ref_ds[j][i]) < 1e-4


@pytest.mark.parametrize("fixture", list(FAMILIES))
def test_padding_at_every_budget_and_past_the_largest(fixture, request):
    path, _ = request.getfixturevalue(fixture)
    grids, cols = FAMILIES[fixture]
    plain = VisionEncoder.from_pretrained(path)
    _, items = items_for(grids, cols, seed=6)
    want = plain(items)
    # 320 patches fill 320 exactly (no padding row), 384 leaves a 64-row padding sequence, and
    # past a largest budget of 256 the batch runs eagerly unpadded.
    for budgets in ((320,), (384,), (256,)):
        enc = VisionEncoder.from_pretrained(path, token_budgets=budgets)
        for g, w in zip(enc(items), want):
            assert max_diff(g.embeds, w.embeds) < 1e-5
            assert all(max_diff(a, b) < 1e-5 for a, b in zip(g.deepstack, w.deepstack))


def test_compact_layout_padded_forward_packed(qwen3_ckpt):
    path, _ = qwen3_ckpt
    plain = VisionEncoder.from_pretrained(path)
    padded = VisionEncoder.from_pretrained(path, token_budgets=(1024,))
    gen = torch.Generator().manual_seed(7)
    grids = [(1, 8, 8), (1, 6, 10)]
    x = torch.randint(0, 256, (124, 3 * 16 * 16), generator=gen, dtype=torch.uint8)
    for g, w in zip(
        padded.forward_packed(x, grids, layout="compact-u8"),
        plain.forward_packed(x, grids, layout="compact-u8"),
    ):
        assert max_diff(g.embeds, w.embeds) < 1e-5


@pytest.mark.parametrize("model", ["qwen3-vl", "qwen2.5-vl", "qwen2-vl"])
def test_padded_forward_on_meta(model):
    # The padding, the padded metadata and the block-diagonal attention read no tensor value.
    cfg = small_config(model)
    enc = VisionEncoder.random(config=cfg, device="meta", token_budgets=(128,))
    cols = 3 * 2 * cfg.patch_size**2
    items = [
        MultimodalItem("image", torch.randn(24, cols), (1, 4, 6), "hf", "a"),
        MultimodalItem("image", torch.randn(64, cols), (1, 8, 8), "hf", "b"),
    ]
    outs = enc(items)
    assert [o.embeds.shape[0] for o in outs] == [6, 16]
    assert all(o.embeds.is_meta for o in outs)


def test_cuda_graphs_need_cuda():
    with pytest.raises(ValueError, match="CUDA device"):
        VisionEncoder.random(config=spec_for("qwen3-vl").tiny_config, cuda_graphs=True)
