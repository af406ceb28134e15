"""Host metadata against the worked cases of the reference notes and plain-torch formulas."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmferry.encoder.metadata import build_metadata, frame_interpolation, frame_windows


def test_qwen2_5_windows_8x12():
    _, lengths = frame_windows(8, 12, 2, 4)
    meta = build_metadata([(1, 8, 12)], merge=2, head_dim=16, window=4)
    assert meta.window_index.tolist() == [
        0, 1, 2, 3, 6, 7, 8, 9, 12, 13, 14, 15, 18, 19, 20, 21, 4, 5, 10, 11, 16, 17, 22, 23
    ]  # fmt: skip
    assert meta.windows.cu_seqlens.tolist() == [0, 64, 96]
    assert lengths == (64, 32)


def test_qwen2_5_windows_20x20():
    meta = build_metadata([(1, 20, 20)], merge=2, head_dim=16, window=4)
    assert meta.windows.cu_seqlens.tolist() == [0, 64, 128, 160, 224, 288, 320, 352, 384, 400]
    perm = meta.window_index
    assert torch.equal(perm[meta.window_reverse], torch.arange(100))


def test_position_interpolation_h4():
    taps, weights = frame_interpolation(4, 2, 1, 48)
    rows = taps[::2, 0] // 48  # column 0 of each row: the (floor row, floor col) tap
    assert rows.tolist() == [0, 15, 31, 47]
    dh = weights[::2, 2] + weights[::2, 3]  # weight on the row floor+1
    assert torch.allclose(dh, torch.tensor([0.0, 2 / 3, 1 / 3, 0.0]), atol=1e-5)


def test_interpolation_equals_f_interpolate():
    # Resample a random 8x8 table to 6x10 with the taps, compare with F.interpolate.
    side, h, w = 8, 6, 10
    table = torch.randn(side * side, 5)
    taps, weights = frame_interpolation(h, w, 1, side)  # merge 1 keeps raster order
    got = (table[taps] * weights[..., None]).sum(1)
    grid = table.T.reshape(1, 5, side, side)
    want = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)
    assert torch.allclose(got, want[0].reshape(5, -1).T, atol=1e-5)


def test_identity_at_table_size_and_merge_order():
    taps, weights = frame_interpolation(4, 4, 2, 4)
    # Merge-block order: rows 0-3 are patches (0,0),(0,1),(1,0),(1,1).
    assert taps[:4, 0].tolist() == [0, 1, 4, 5]
    assert torch.equal(weights[:, 0], torch.ones(16))


def test_frames_and_runs():
    meta = build_metadata([(1, 4, 6), (3, 2, 2), (1, 2, 2)], merge=2, head_dim=16)
    assert meta.full.cu_seqlens.tolist() == [0, 24, 28, 32, 36, 40]
    assert meta.full.runs == ((0, 1, 24), (24, 4, 4))
    assert meta.full.max_seqlen == 24
    assert meta.positions.shape == (40, 2)
    # The video's frames repeat the same (row, col) positions.
    assert torch.equal(meta.positions[24:28], meta.positions[28:32])


def test_a_calls_metadata_is_built_once_per_list_of_grids_and_settings():
    """Calls repeat image sizes: their metadata is kept per list of grids, keyed by every
    setting too (a window size or table side of another tower never answers)."""
    from mmferry.encoder import metadata

    metadata.clear_caches()
    grids = [(1, 8, 12), (1, 4, 4)]
    first = build_metadata(grids, merge=2, head_dim=16, window=4)
    assert build_metadata([list(g) for g in grids], merge=2, head_dim=16, window=4) is first
    assert 0 < metadata.cache_bytes() <= metadata.CACHE_BYTES
    plain = build_metadata(grids, merge=2, head_dim=16)
    assert plain.windows is None and first.windows is not None
    assert build_metadata(grids, merge=2, head_dim=32, window=4).inv_freq.shape == (8,)
    assert build_metadata(grids[::-1], merge=2, head_dim=16, window=4) is not first
    interpolated = build_metadata(grids, merge=2, head_dim=16, position_side=4)
    assert interpolated.interp_taps is not None and plain.interp_taps is None
