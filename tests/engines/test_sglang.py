"""`to_sglang` without an engine: the `processor_output` dict SGLang's scheduler reads as
precomputed embeddings, and the refusals of anything that would kill that scheduler (a prompt
with one pad id per item, rows that do not match the pads, mixed widths). SGLang's engine
itself runs in test_sglang_engine.py."""

from __future__ import annotations

import pytest
import torch

from mmferry.encoder.model import VisionOutput
from mmferry.engines.sglang import to_sglang
from mmferry.items import MultimodalItem
from mmferry.prompt.expand import ExpandedPrompt

IMAGE, VIDEO = 151655, 151656
PADS = {"image": IMAGE, "video": VIDEO}


def item(modality: str, grid: tuple[int, int, int], h: str, seconds=None) -> MultimodalItem:
    t, hh, w = grid
    return MultimodalItem(
        modality, torch.zeros(t * hh * w, 8), grid, "hf", h, second_per_grid_t=seconds
    )


def output(tokens: int, levels: int = 2, seed: int = 0, width: int = 4) -> VisionOutput:
    g = torch.Generator().manual_seed(seed)
    main = torch.randn(tokens, width, generator=g)
    return VisionOutput(main, tuple(torch.randn(tokens, width, generator=g) for _ in range(levels)))


def expanded(ids: list[int], offsets) -> ExpandedPrompt:
    return ExpandedPrompt(ids, offsets, torch.zeros(3, len(ids), dtype=torch.long), 0)


def test_one_entry_per_modality_in_prompt_order():
    its = [item("image", (1, 2, 4), "a"), item("video", (2, 2, 2), "v", 1.0)]
    its.append(item("image", (1, 4, 2), "b"))
    outs = [output(2, seed=0), output(2, seed=1), output(2, seed=2)]
    ids = [1, IMAGE, IMAGE, 2, VIDEO, VIDEO, 3, IMAGE, IMAGE]
    req = to_sglang(expanded(ids, [[(1, 3)], [(4, 6)], [(7, 9)]]), its, outs)
    assert req["input_ids"] == ids
    (img,) = req["image_data"]
    assert img["format"] == "processor_output" and img["modality"] == "image"
    rows = img["precomputed_embeddings"]
    assert rows.shape == (4, 12)  # [main | ds0 | ds1], both images
    assert torch.equal(rows[2:, :4], outs[2].embeds)
    assert torch.equal(rows[:2, 8:], outs[0].deepstack[1])
    assert img["image_grid_thw"].tolist() == [[1, 2, 4], [1, 4, 2]]
    assert "second_per_grid_ts" not in img
    (vid,) = req["video_data"]
    assert vid["modality"] == "video" and vid["video_grid_thw"].tolist() == [[2, 2, 2]]
    assert vid["second_per_grid_ts"].tolist() == [1.0]
    # Plain ids are checked by their pad ids instead of offsets; same answer.
    plain = to_sglang(ids, its, outs, pad_ids=PADS)
    assert torch.equal(plain["image_data"][0]["precomputed_embeddings"], rows)


def test_refuses_one_pad_per_item():
    """SGLang's scheduler dies on a prompt holding one pad id per image with rows for all its
    vision tokens; `to_sglang` says what to do instead."""
    its = [item("image", (1, 2, 4), "a"), item("image", (1, 2, 4), "b")]
    outs = [output(2), output(2, seed=1)]
    with pytest.raises(ValueError, match=r"runs are \[1, 1\] tokens long.*expand_prompt"):
        to_sglang([1, IMAGE, 2, IMAGE, 3], its, outs, pad_ids=PADS)
    with pytest.raises(ValueError, match="needs the prompt's offsets"):
        to_sglang([1, IMAGE, 2, IMAGE, 3], its, outs)


def test_refuses_rows_that_do_not_match_the_pads():
    its = [item("image", (1, 2, 4), "a")]
    with pytest.raises(ValueError, match="2 rows for 3 placeholder"):
        to_sglang(expanded([IMAGE] * 3, [[(0, 3)]]), its, [output(2)])
    with pytest.raises(ValueError, match="the prompt has 2 items, got 1"):
        to_sglang(expanded([IMAGE] * 4, [[(0, 2)], [(2, 4)]]), its, [output(2)])
    with pytest.raises(ValueError, match=r"runs are \[3\]"):
        to_sglang([IMAGE] * 3, its, [output(2)], pad_ids=PADS)
    vid = [item("video", (2, 2, 2), "v")]
    with pytest.raises(ValueError, match="1 video pad ids for 2 rows"):
        to_sglang([VIDEO, 5, 6], vid, [output(2)], pad_ids=PADS)
    with pytest.raises(ValueError, match="pad_ids has no video id"):
        to_sglang([VIDEO, VIDEO], vid, [output(2)], pad_ids={"image": IMAGE})
    with pytest.raises(ValueError, match="needs"):  # rows that do not match the grid
        to_sglang(expanded([IMAGE] * 3, [[(0, 3)]]), its, [output(3)])


def test_refuses_mixed_widths():
    its = [item("image", (1, 2, 4), "a"), item("image", (1, 2, 4), "b")]
    with pytest.raises(ValueError, match="one width"):
        to_sglang(
            expanded([IMAGE] * 4, [[(0, 2)], [(2, 4)]]), its, [output(2), output(2, levels=0)]
        )
