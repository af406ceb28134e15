"""The engine layout without an engine: `[main | ds...]` rows, grids, uuids and refusals."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from mmferry.embed.step import Precomputed
from mmferry.encoder.model import VisionOutput
from mmferry.engines.rows import engine_items, packed_rows
from mmferry.engines.sglang import to_sglang
from mmferry.engines.vllm import content_parts, to_vllm, to_vllm_refs
from mmferry.items import MultimodalItem
from mmferry.server.encoded import EncodedItem


def item(modality: str, grid: tuple[int, int, int], h: str, stamps=None) -> MultimodalItem:
    t, hh, w = grid
    return MultimodalItem(modality, torch.zeros(t * hh * w, 8), grid, "hf", h, timestamps=stamps)


def output(tokens: int, width: int = 4, levels: int = 2, seed: int = 0) -> VisionOutput:
    g = torch.Generator().manual_seed(seed)
    main = torch.randn(tokens, width, generator=g)
    return VisionOutput(main, tuple(torch.randn(tokens, width, generator=g) for _ in range(levels)))


def test_packed_rows_layout_and_cast():
    out = output(3)
    rows = packed_rows(out.embeds, out.deepstack, torch.bfloat16)
    assert rows.shape == (3, 12) and rows.dtype == torch.bfloat16
    for k, part in enumerate((out.embeds, *out.deepstack)):
        assert torch.equal(rows[:, 4 * k : 4 * (k + 1)], part.to(torch.bfloat16))
    plain = output(3, levels=0)
    assert packed_rows(plain.embeds) is plain.embeds  # nothing to pack: no copy


def test_to_vllm_groups_by_modality_in_order():
    its = [
        item("image", (1, 2, 4), "a"),
        item("video", (2, 2, 2), "v", stamps=(0.5, 1.5)),
        item("image", (1, 4, 2), "b"),
    ]
    outs = [output(2, seed=0), output(2, seed=1), output(2, seed=2)]
    got = to_vllm(its, outs)
    img = got.multi_modal_data["image"]
    assert img["image_embeds"].shape == (4, 12)
    assert torch.equal(img["image_embeds"][2:, :4], outs[2].embeds)
    assert img["image_grid_thw"].tolist() == [[1, 2, 4], [1, 4, 2]]
    assert img["image_grid_thw"].dtype == torch.int64
    vid = got.multi_modal_data["video"]
    assert vid["video_grid_thw"].tolist() == [[2, 2, 2]] and vid["timestamps"] == [[0.5, 1.5]]
    assert got.multi_modal_uuids == {"image": ["a", "b"], "video": ["v"]}
    assert got.prompt([1, 2])["prompt_token_ids"] == [1, 2]
    facts = [
        {
            "modality": it.modality,
            "hash": it.hash,
            "grid_thw": it.grid_thw,
            "timestamps": it.timestamps,
        }
        for it in its
    ]
    refs = to_vllm_refs(facts)
    assert "image_embeds" not in refs.multi_modal_data["image"]
    assert refs.multi_modal_data["video"]["timestamps"] == [[0.5, 1.5]]
    assert refs.multi_modal_uuids == got.multi_modal_uuids


def test_every_source_kind():
    out = output(2)
    enc = EncodedItem("image", out.embeds, out.deepstack, (1, 2, 4), 2, "h")
    pre = Precomputed("image", out)
    a, b, c = (
        engine_items([enc])
        + engine_items([pre], grids=[(1, 2, 4)], uuids=["u"])
        + (engine_items([item("image", (1, 2, 4), "i")], [out]))
    )
    assert torch.equal(a.rows, b.rows) and torch.equal(a.rows, c.rows)
    assert (a.uuid, b.uuid, c.uuid) == ("h", "u", "i")


def test_refusals():
    with pytest.raises(ValueError, match="needs"):  # rows do not match the grid
        engine_items([item("image", (1, 2, 4), "a")], [output(3)])
    with pytest.raises(ValueError, match="grids="):
        engine_items([Precomputed("image", output(2))])
    with pytest.raises(ValueError, match="one width"):
        to_vllm(
            [item("image", (1, 2, 4), "a"), item("image", (1, 2, 4), "b")],
            [output(2), output(2, levels=0)],
        )
    with pytest.raises(ValueError, match="2 timestamps for 1"):
        engine_items([item("video", (1, 2, 4), "v")], [output(2)], timestamps=[(0.0, 1.0)])


def test_content_part_decodes_as_vllm_reads_it():
    out = output(2)
    (part,) = content_parts([item("image", (1, 2, 4), "a")], [out])
    assert part["type"] == "image_embeds" and part["uuid"] == "a"
    payload = part["image_embeds"]
    assert payload["image_grid_thw"] == [1, 2, 4]
    raw = base64.b64decode(payload["image_embeds"])
    rows = torch.load(io.BytesIO(raw), weights_only=True)
    assert torch.equal(rows, torch.cat([out.embeds, *out.deepstack], dim=-1))
    (ref,) = content_parts([item("image", (1, 2, 4), "a")], [out], with_rows=False)
    assert "image_embeds" not in ref["image_embeds"]


def test_sglang_counts_rows_against_the_prompt():
    class Prompt:
        input_ids = [5, 9, 9, 6]
        offsets = [[(1, 3)]]

    its = [item("image", (1, 2, 4), "a")]
    req = to_sglang(Prompt(), its, [output(2)])
    (entry,) = req["image_data"]
    assert entry["precomputed_embeddings"].shape == (2, 12)
    assert entry["image_grid_thw"].tolist() == [[1, 2, 4]]
    Prompt.offsets = [[(1, 2)]]
    with pytest.raises(ValueError, match="2 rows for 1 placeholder"):
        to_sglang(Prompt(), its, [output(2)])
