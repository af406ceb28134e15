"""One attention call for all items of a batch: equal to the per-item loop and to transformers.

Every family, on tiny saved checkpoints. The grids mix frame sizes whose padded single call
costs less than `PAD_COST_LIMIT` times the exact work, so each layer is ONE SDPA call (counted).
"""

from __future__ import annotations

import pytest

from mmferry.encoder import attention
from mmferry.encoder.model import VisionEncoder
from tests.encoder.tower_helpers import items_for, max_diff, reference

FAMILIES = {
    # fixture: (grids, feature columns)
    "qwen3_ckpt": ([(1, 8, 8), (1, 8, 10), (1, 10, 8), (2, 8, 6)], 3 * 2 * 16 * 16),
    "qwen2_5_ckpt": ([(1, 8, 8), (1, 8, 10), (1, 10, 8), (2, 8, 6)], 3 * 2 * 14 * 14),
    "qwen2_ckpt": ([(1, 8, 8), (1, 8, 10), (1, 10, 8), (2, 8, 6)], 3 * 2 * 14 * 14),
}


@pytest.mark.parametrize("fixture", list(FAMILIES))
def test_batch_is_one_call_per_layer_and_matches_loop_and_transformers(
    fixture, request, monkeypatch
):
    path, ref_model = request.getfixturevalue(fixture)
    grids, cols = FAMILIES[fixture]
    enc = VisionEncoder.from_pretrained(path)
    feats, items = items_for(grids, cols)
    calls = []
    real = attention.F.scaled_dot_product_attention

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counted)
    batched = enc(items)
    assert len(calls) == enc.config.depth  # one call a layer for all four items
    monkeypatch.undo()
    looped = [enc([it])[0] for it in items]
    ref, ref_ds = reference(ref_model, feats, grids)
    for i, (b, one) in enumerate(zip(batched, looped)):
        assert max_diff(b.embeds, one.embeds) < 1e-5
        assert max_diff(b.embeds, ref[i]) < 1e-4
        assert len(b.deepstack) == len(one.deepstack) == len(ref_ds)
        for j, tap in enumerate(b.deepstack):
            assert max_diff(tap, one.deepstack[j]) < 1e-5
            assert max_diff(tap, ref_ds[j][i]) < 1e-4
