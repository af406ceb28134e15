"""Work assignment for the DP encoder: the peers' worked cases, splitting, determinism, bounds."""

from __future__ import annotations

import random

import pytest

from mmferry.config import VisionConfig
from mmferry.encoder.assign import CostModel, assign_work


def _grids_of_patches(sizes: list[int]) -> list[tuple[int, int, int]]:
    # Grids with exactly `n` patches each (merge size 1), to state the peers' cases literally.
    return [(1, 1, n) for n in sizes]


def test_patch_baseline_reproduces_peers_lpt():
    a = assign_work(_grids_of_patches([1000, 100, 200, 50]), 2, merge_size=1, split_frames=False)
    assert a.order == (0, 2, 1, 3)
    assert a.counts == (1, 3)
    assert a.loads == (1000, 350)


def test_patch_baseline_two_items_four_ranks():
    a = assign_work(_grids_of_patches([100, 200]), 4, merge_size=1, split_frames=False)
    assert a.order == (1, 0)
    assert a.counts == (1, 1, 0, 0)
    assert a.loads == (200, 100, 0, 0)


def test_rows_and_padding_with_merge_two():
    # [1000, 100, 200, 48] patches at merge 2: rank 1 produces 87 rows; the padded gather is 250.
    grids = [(1, 20, 50), (1, 10, 10), (1, 10, 20), (1, 6, 8)]
    a = assign_work(grids, 2, merge_size=2, split_frames=False)
    assert a.counts == (1, 3) and a.loads == (1000, 348)
    assert a.rows == (250, 87) and max(a.rows) == 250
    # Each item's rows, located in its rank's packed output.
    assert a.pieces() == [[(0, 0, 250)], [(1, 50, 25)], [(1, 0, 50)], [(1, 75, 12)]]


def test_two_images_three_ranks_leave_one_rank_empty():
    a = assign_work([(1, 8, 8), (1, 8, 8)], 3, merge_size=2)
    assert a.counts == (1, 1, 0)
    assert a.rows == (16, 16, 0)


def test_empty_input():
    a = assign_work([], 3, merge_size=2)
    assert a.shards == ((), (), ())
    assert a.rows == (0, 0, 0) and a.order == () and a.pieces() == []
    assert a.imbalance == 1.0


def test_frames_split_exactly_and_contiguously():
    a = assign_work([(10, 4, 4)], 3, merge_size=2)
    assert [len(r) for r in a.shards] == [1, 1, 1]
    ranges = [(s.frame_start, s.frame_stop) for r in a.shards for s in r]
    assert ranges == [(0, 4), (4, 7), (7, 10)]
    assert a.rows == (16, 12, 12)
    assert a.pieces() == [[(0, 0, 16), (1, 0, 12), (2, 0, 12)]]
    # Without splitting, the whole video sits on one rank.
    whole = assign_work([(10, 4, 4)], 3, merge_size=2, split_frames=False)
    assert whole.counts == (1, 0, 0)


def test_video_fills_gaps_left_by_images():
    grids = [(1, 8, 8), (1, 4, 8), (12, 4, 4)]
    a = assign_work(grids, 2, merge_size=2)
    # 64 + 32 + 12*16 = 288 patches -> 144 per rank, reached exactly by 5 + 7 frames.
    assert a.loads == (144, 144)
    whole = assign_work(grids, 2, merge_size=2, split_frames=False)
    assert whole.loads == (192, 96)
    covered = sorted((s.frame_start, s.frame_stop) for r in a.shards for s in r if s.item == 2)
    assert covered[0][0] == 0 and covered[-1][1] == 12
    assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))


def test_deterministic_and_ties_to_lowest_rank():
    grids = [(1, 4, 4)] * 5 + [(7, 2, 2)]
    a = assign_work(grids, 4, merge_size=2)
    b = assign_work(list(grids), 4, merge_size=2)
    assert a == b
    # Equal images go round-robin from rank 0: ties to the lowest rank.
    assert [s.item for s in a.shards[0]][0] == 0
    assert [s.item for s in a.shards[1]][0] == 1


def test_quadratic_cost_prefers_balancing_attention():
    # One 64x64 image vs four 32x32 images: equal patches, but attention is 4x costlier for the
    # big one, so a quadratic model puts all small ones on the other rank.
    model = CostModel(linear=1.0, quadratic=1e-2)
    grids = [(1, 64, 64)] + [(1, 32, 32)] * 4
    a = assign_work(grids, 2, merge_size=2, cost_model=model)
    assert a.counts == (1, 4)
    assert a.loads[0] == pytest.approx(model.item_cost((1, 64, 64)))


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_imbalance_bounds(world):
    rng = random.Random(world)
    model = CostModel(linear=1.0, quadratic=1 / 6608)
    for _ in range(20):
        grids = [
            (1, 2 * rng.randint(2, 40), 2 * rng.randint(2, 40)) for _ in range(rng.randint(1, 12))
        ]
        grids += [(rng.randint(2, 64), 2 * rng.randint(2, 16), 2 * rng.randint(2, 16))]
        a = assign_work(grids, world, merge_size=2, cost_model=model)
        costs = [model.item_cost(g) for g in grids]
        total = sum(costs)
        assert sum(a.loads) == pytest.approx(total)
        # Every item's frames are covered exactly once.
        for i, g in enumerate(grids):
            got = sorted((s.frame_start, s.frame_stop) for r in a.shards for s in r if s.item == i)
            assert got[0][0] == 0 and got[-1][1] == g[0]
            assert all(x[1] == y[0] for x, y in zip(got, got[1:]))
        # LPT bound: no rank exceeds the mean by more than the largest indivisible unit.
        units = [model.item_cost(g) if g[0] == 1 else model.frame_cost(g[1], g[2]) for g in grids]
        assert max(a.loads) <= total / world + max(units) + 1e-6


def test_cost_model_constants():
    cfg = VisionConfig(
        family="qwen3_vl", depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
        out_hidden_size=3584, hidden_act="gelu_pytorch_tanh", patch_size=16,
    )  # fmt: skip
    m = CostModel.for_config(cfg)
    # quadratic = 2d / (4d^2 + 2dI) = 1 / (2d + I)
    assert m.linear == 1.0 and m.quadratic == pytest.approx(1 / (2 * 1152 + 4304))
    assert m.item_cost((3, 4, 6)) == pytest.approx(3 * (24 + 24**2 * m.quadratic))
    q25 = VisionConfig(
        family="qwen2_5_vl", depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
        out_hidden_size=3584, hidden_act="silu", patch_size=14, window_size=112,
        fullatt_block_indexes=(7, 15, 23, 31),
    )  # fmt: skip
    m25 = CostModel.for_config(q25)
    full_quad = 2 * 1280 / (4 * 1280**2 + 3 * 1280 * 3420)
    assert m25.quadratic == pytest.approx(full_quad * 4 / 32)
    assert m25.linear == pytest.approx(1 + full_quad * 28 / 32 * 64)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="world_size"):
        assign_work([(1, 2, 2)], 0, merge_size=2)
    with pytest.raises(ValueError, match="multiples of 2"):
        assign_work([(1, 3, 2)], 2, merge_size=2)
    with pytest.raises(ValueError, match="positive"):
        assign_work([(0, 2, 2)], 2, merge_size=2)
