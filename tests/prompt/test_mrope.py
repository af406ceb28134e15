"""mRoPE positions against transformers 5.24's `get_rope_index`, a plain statement of the original
Qwen rule (text resumes one past a span's largest position) and the worked case E10."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prompt_helpers import TOK, make_item

from mmferry.models import preset
from mmferry.prompt.expand import expand_prompt
from mmferry.prompt.mrope import VisionSpan, mrope_positions

VS, VE, IMG, VID = TOK.vision_start, TOK.vision_end, TOK.image, TOK.video


def extent_rule(ids: list[int], blocks: list[tuple[int, int, int, float]]) -> tuple[list, int]:
    """Original Qwen-VL / vLLM / SGLang rule, token by token: each maximal run of pad tokens is
    the next block (t, h, w merged; time step); text resumes at the block's max + 1."""
    rows: list[list[int]] = [[], [], []]
    nxt, i, b = 0, 0, iter(blocks)
    while i < len(ids):
        if ids[i] not in (IMG, VID):
            for r in rows:
                r.append(nxt)
            nxt, i = nxt + 1, i + 1
            continue
        t, h, w, step = next(b)
        hi = nxt
        for k in range(t):
            tk = int(torch.tensor(k, dtype=torch.float32) * torch.tensor(step))
            for y in range(h):
                for x in range(w):
                    for r, v in zip(rows, (nxt + tk, nxt + y, nxt + x)):
                        r.append(v)
                    hi = max(hi, nxt + tk, nxt + y, nxt + x)
        i += t * h * w
        nxt = hi + 1
    top = max((max(r) for r in rows if r), default=-1)
    return rows, top + 1 - len(ids)


def test_e10_image_worked_case():
    cfg = preset("qwen2-vl")
    ids = [11, 12, 13, VS, IMG, VE, 14, 15]
    out = expand_prompt(ids, [make_item("image", (1, 4, 6))], cfg)
    assert len(out.input_ids) == 13
    assert out.positions.tolist() == [
        [0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 7, 8, 9],
        [0, 1, 2, 3, 4, 4, 4, 5, 5, 5, 7, 8, 9],
        [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8, 9],
    ]
    assert out.mrope_delta == -3
    assert out.offsets == [[(4, 10)]]


def test_e10_qwen2_5_video_worked_case():
    cfg = preset("qwen2.5-vl").replace(tokens_per_second=2)
    video = make_item("video", (4, 2, 4), second_per_grid_t=1.0)
    out = expand_prompt([11, VID, 12, 13], [video], cfg)
    assert out.positions[0, 1:9].tolist() == [1, 1, 3, 3, 5, 5, 7, 7]
    assert out.positions[:, 9].tolist() == [8, 8, 8]  # the following text starts at 8
    assert out.mrope_delta == 10 - 11


def test_video_advance_rules_match_their_references(hf_rope):
    """The one case where the references split: a Qwen2.5 video whose time outruns its grid."""
    cfg = preset("qwen2.5-vl").replace(tokens_per_second=2)
    video = make_item("video", (4, 2, 4), second_per_grid_t=1.0)
    ids = [11, VS, VID, VE, 12, 13]
    spatial = expand_prompt(ids, [video], cfg, mrope_advance="spatial")
    want, want_delta = hf_rope("qwen2_5_vl")(
        spatial.input_ids, video_grids=[(4, 2, 4)], second_per_grid_ts=[1.0]
    )
    assert torch.equal(spatial.positions, want)
    assert spatial.mrope_delta == want_delta
    assert spatial.positions[:, 10].tolist() == [4, 4, 4]  # transformers 5.x: start + max(h, w)

    extent = expand_prompt(ids, [video], cfg)
    rows, delta = extent_rule(extent.input_ids, [(4, 1, 2, 2.0)])
    assert extent.positions.tolist() == rows
    assert extent.mrope_delta == delta
    assert extent.positions[:, 10].tolist() == [9, 9, 9]


def _video(grid: tuple[int, int, int], spgt: float):
    return make_item(
        "video", grid, timestamps=[0.3 + k for k in range(grid[0])], second_per_grid_t=spgt
    )


def _mixed_prompt(family: str):
    """Several images and videos in text, chat-template wrapped; grids for that family."""
    vid_grids = [(2, 4, 6), (3, 6, 4)] if family != "qwen2_vl" else [(2, 4, 6), (4, 2, 2)]
    items = [
        make_item("image", (1, 4, 6)),
        _video(vid_grids[0], 1.0),
        make_item("image", (1, 8, 2)),
        _video(vid_grids[1], 0.5),
        make_item("image", (1, 2, 2)),
    ]
    ids = [
        100,
        101,
        VS,
        IMG,
        VE,
        102,
        VS,
        VID,
        VE,
        VS,
        IMG,
        VE,
        103,
        104,
        105,
        VS,
        VID,
        VE,
        106,
        VS,
        IMG,
        VE,
    ]
    return ids, items


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mixed_prompt_matches_transformers(family, hf_rope, tokenizer_json):
    cfg = preset(family)
    ids, items = _mixed_prompt(family)
    out = expand_prompt(ids, items, cfg, tokenizer=tokenizer_json, mrope_advance="spatial")
    images = [it.grid_thw for it in items if it.modality == "image"]
    videos = [it.grid_thw for it in items if it.modality == "video"]
    spgt = [it.second_per_grid_t for it in items if it.modality == "video"]
    want, want_delta = hf_rope(family)(out.input_ids, images, videos, spgt)
    assert torch.equal(out.positions, want)
    assert out.mrope_delta == want_delta
    assert out.positions.dtype == torch.long and out.positions.shape == (3, len(out.input_ids))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_default_rule_matches_transformers_where_rules_agree(family, hf_rope, tokenizer_json):
    """Images, Qwen3 frames and videos whose time stays within their grid: one answer."""
    cfg = preset(family)
    items = [
        make_item("image", (1, 6, 4)),
        make_item("video", (2, 8, 8), timestamps=(0.5, 1.5), second_per_grid_t=1.0),
    ]
    ids = [100, VS, IMG, VE, 101, VS, VID, VE, 102]
    out = expand_prompt(ids, items, cfg, tokenizer=tokenizer_json)
    want, want_delta = hf_rope(family)(out.input_ids, [(1, 6, 4)], [(2, 8, 8)], [1.0])
    assert torch.equal(out.positions, want)
    assert out.mrope_delta == want_delta


def test_text_only_and_empty():
    pos, delta = mrope_positions(5, [])
    assert pos.tolist() == [list(range(5))] * 3 and delta == 0
    pos, delta = mrope_positions(0, [])
    assert pos.shape == (3, 0) and delta == 0


def test_vision_at_both_ends():
    # [img 2x2][text][img 1x3]: positions resume after each block; no trailing text.
    pos, delta = mrope_positions(8, [VisionSpan(0, 1, 2, 2), VisionSpan(5, 1, 1, 3)])
    assert pos.tolist() == [
        [0, 0, 0, 0, 2, 3, 3, 3],
        [0, 0, 1, 1, 2, 3, 3, 3],
        [0, 1, 0, 1, 2, 3, 4, 5],
    ]
    assert delta == 6 - 8


def test_bad_spans_raise():
    with pytest.raises(ValueError, match="overlaps"):
        mrope_positions(10, [VisionSpan(0, 1, 2, 2), VisionSpan(2, 1, 1, 1)])
    with pytest.raises(ValueError, match="runs past"):
        mrope_positions(3, [VisionSpan(0, 1, 2, 2)])
    with pytest.raises(ValueError, match="advance"):
        mrope_positions(3, [], advance="max")


SPGT = st.sampled_from([0.25, 0.5, 1.0, 1.5, 2 / 3, 1 / 3, 0.083])
GRID_HW = st.tuples(st.integers(1, 3), st.integers(1, 3)).map(lambda hw: (2 * hw[0], 2 * hw[1]))
ITEM = st.one_of(
    GRID_HW.map(lambda hw: ("image", (1, *hw), None)),
    st.tuples(st.integers(1, 5), GRID_HW, SPGT).map(lambda a: ("video", (a[0], *a[1]), a[2])),
)
SEGMENTS = st.lists(
    st.tuples(st.lists(st.integers(100, 109), max_size=3), ITEM), min_size=1, max_size=5
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(segments=SEGMENTS, tail=st.lists(st.integers(100, 109), max_size=3))
def test_property_qwen2_5_random_mixes(segments, tail, hf_rope):
    """Random text/image/video mixes (Qwen2.5-VL): 5.x rule equals transformers, default rule
    equals the token-by-token original rule."""
    cfg = preset("qwen2.5-vl")
    ids: list[int] = []
    items = []
    for text, (modality, grid, spgt) in segments:
        ids += [*text, VS, IMG if modality == "image" else VID, VE]
        items.append(make_item(modality, grid, second_per_grid_t=spgt))
    ids += tail
    images = [it.grid_thw for it in items if it.modality == "image"]
    videos = [it.grid_thw for it in items if it.modality == "video"]
    spgt = [it.second_per_grid_t for it in items if it.modality == "video"]

    out = expand_prompt(ids, items, cfg, mrope_advance="spatial")
    want, want_delta = hf_rope("qwen2_5_vl")(out.input_ids, images, videos, spgt or None)
    assert torch.equal(out.positions, want)
    assert out.mrope_delta == want_delta

    out = expand_prompt(ids, items, cfg)
    blocks = [
        (
            t,
            h // 2,
            w // 2,
            1.0
            if it.modality == "image"
            else float(
                torch.tensor(it.second_per_grid_t, dtype=torch.float32) * cfg.tokens_per_second
            ),
        )
        for it in items
        for t, h, w in [it.grid_thw]
    ]
    rows, delta = extent_rule(out.input_ids, blocks)
    assert out.positions.tolist() == rows
    assert out.mrope_delta == delta


@pytest.mark.parametrize("grid, spgt", [((16, 2, 2), 2.1), ((26, 2, 4), 0.58), ((31, 4, 2), 1.05)])
def test_qwen2_5_time_steps_round_as_transformers(grid, spgt, hf_rope):
    """Cases where float64 arithmetic would truncate differently from transformers' float32."""
    cfg = preset("qwen2.5-vl")
    video = make_item("video", grid, second_per_grid_t=spgt)
    out = expand_prompt([100, VS, VID, VE, 101], [video], cfg, mrope_advance="spatial")
    want, want_delta = hf_rope("qwen2_5_vl")(
        out.input_ids, video_grids=[grid], second_per_grid_ts=[spgt]
    )
    assert torch.equal(out.positions, want)
    assert out.mrope_delta == want_delta
